"""D's routes (``core.handoff.routes``): real page tables and plan, the real bounce gate and allocator.
A forced-bounce request gets one slot per writer inside the arena, a request that does not fit gets none
(a direct WRITE), a released slot is reused and a quarantined one never is; a writer of several pool pairs
bounces all of them in one slot; a P on D's host that reaches D's GPU is routed through ipc."""

from __future__ import annotations

from vllm_dsa_dev.tiny_models import glm_dsa_config

from vllm_dsa_connector.connector.page_tables import build_offline
from vllm_dsa_connector.core.handoff.routes import RoutePlanner, ipc_reachable
from vllm_dsa_connector.core.handoff.wire import RankPayload, Route
from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
from vllm_dsa_connector.core.transfer.gate_options import BounceSettings
from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc


def _payloads(engine: str, tables, arena: int, **kw) -> list[RankPayload]:
    return [RankPayload(engine, t.rank, t.pp_rank, t.tp_rank, f"{engine}-{t.rank}", b"", t,
                        [], {}, staging=RegionDesc(f"{engine}-{t.rank}", 0, arena, "DRAM"), **kw) for t in tables]


def test_staging_slots_reserve_release_and_quarantine() -> None:
    tables = build_offline(glm_dsa_config(6), num_blocks=8)
    plan = PeerPlan.build(tables, tables)
    block = tables[0].bytes_per_block
    src = _payloads("P", tables, 0)
    dst = _payloads("D", tables, 4 * block)
    slots = RoutePlanner(BounceSettings.from_config({"bounce_mode": "always"}, {}), lambda: dst)
    assert slots.bouncing

    got, held = slots.plan(plan, src, [5, 1, 3], [2, 7, 0])  # three scattered blocks: one slot, 3 blocks
    (rank,) = got
    assert got[rank] == {0: Route("bounce", 0, 3 * block)} and len(held) == 1
    assert slots.plan(plan, src, [0, 1], [3, 4]) == ({}, [])  # no room left: a direct WRITE
    slots.free(held, failed=False)
    again, held2 = slots.plan(plan, src, [0, 1], [3, 4])
    assert again[rank][0].offset == 0  # the released range is reused
    slots.free(held2, failed=True)  # a late WRITE may land there: quarantined
    _, held3 = slots.plan(plan, src, [6], [5])
    assert held3 and held3[0][1].offset >= 2 * block

    never = RoutePlanner(BounceSettings.from_config({"bounce_mode": "never"}, {}), lambda: dst)
    assert not never.bouncing and never.plan(plan, src, [5], [2]) == ({}, [])


def test_different_block_sizes_still_bounce_in_one_write_per_writer() -> None:
    """P at 64 tokens per block, D at 16: the token-mapped runs of a request (many, short: every 16-token
    chunk of every layer) still get ONE staging slot per (D rank, P rank) writer, of exactly their bytes, so
    P gathers them and writes once; the slot is sized for the token span, not for whole blocks."""
    cfg = glm_dsa_config(6)
    src_tables = build_offline(cfg, num_blocks=8, block_size=64)
    dst_tables = build_offline(cfg, num_blocks=32, block_size=16)
    plan = PeerPlan.build(src_tables, dst_tables)
    src = _payloads("P", src_tables, 0)
    dst = _payloads("D", dst_tables, 1 << 20)
    slots = RoutePlanner(BounceSettings.from_config({"bounce_mode": "always"}, {}), lambda: dst)
    # D holds tokens 0..31 (two of its blocks); it loads tokens 32..149 of P's blocks 5, 1, 3
    got, held = slots.plan(plan, src, [5, 1, 3], [9, 2, 30, 4, 11, 7, 6, 8], first_token=32, num_tokens=118)
    ((rank, per),) = got.items()
    ((src_rank, route),) = per.items()
    size = route.size
    (part,) = plan.runs(src_rank, rank, [5, 1, 3], [9, 2, 30, 4, 11, 7, 6, 8], first_token=32, num_tokens=118)
    per_token = sum(v.bytes_per_token * len(v.entries) for v in dst_tables[0].views)
    assert size == part[2].total_bytes == (160 - 32) * per_token and part[2].num_runs > 8 and len(held) == 1


def test_a_writer_of_two_pool_pairs_bounces_both_in_one_slot() -> None:
    """A GPU engine's table has two pools (the MLA latent and the indexer K cache have different page
    sizes): each writer has two parts; its one slot holds both, each at a :func:`packed_offsets` offset."""
    from vllm_dsa_connector.core.plan.runs import packed_offsets

    # LBNHC (what vLLM's GPU build uses): one pool per KV cache spec, i.e. two
    (split,) = build_offline(glm_dsa_config(6), num_blocks=8, layout="LBNHC")
    assert len(split.pools) == 2
    plan = PeerPlan.build([split], [split])
    src, dst = _payloads("P", [split], 0), _payloads("D", [split], 8 << 20)
    slots = RoutePlanner(BounceSettings.from_config({"bounce_mode": "always"}, {}), lambda: dst)
    got, held = slots.plan(plan, src, [5, 1, 3], [2, 7, 0])
    parts = plan.runs(0, 0, [5, 1, 3], [2, 7, 0])
    assert len(parts) == 2
    _, total = packed_offsets([r.merged().total_bytes for _, _, r in parts])
    assert got == {0: {0: Route("bounce", 0, total)}} and len(held) == 1
    assert total >= sum(r.total_bytes for _, _, r in parts)


def test_ipc_route_only_on_one_host_with_a_reachable_gpu() -> None:
    tables = build_offline(glm_dsa_config(6), num_blocks=8)
    plan = PeerPlan.build(tables, tables)
    exports = [{"pool": 0}]
    src = _payloads("P", tables, 0, host="h1", gpu="GPU-a", reach=["GPU-a", "GPU-b"])
    dst = _payloads("D", tables, 1 << 20, host="h1", gpu="GPU-b", reach=["GPU-b"], ipc=exports)
    assert ipc_reachable(src[0], dst[0]) and not ipc_reachable(dst[0], src[0])  # P exported nothing
    planner = RoutePlanner(BounceSettings.from_config({"bounce_mode": "always"}, {}), lambda: dst)
    got, held = planner.plan(plan, src, [5, 1], [2, 7])
    assert got == {0: {0: Route("ipc")}} and held == []  # ipc first: no slot held
    other_host = _payloads("P", tables, 0, host="h2", gpu="GPU-a", reach=["GPU-a", "GPU-b"])
    got, held = planner.plan(plan, other_host, [5, 1], [2, 7])
    assert got[0][0].path == "bounce" and len(held) == 1  # another host: the gate's bounce
    no_reach = _payloads("P", tables, 0, host="h1", gpu="GPU-a", reach=["GPU-a"])
    assert not ipc_reachable(no_reach[0], dst[0])
    off = RoutePlanner(BounceSettings.from_config({"bounce_mode": "never"}, {}), lambda: dst, ipc=False)
    assert off.plan(plan, src, [5, 1], [2, 7]) == ({}, [])  # ipc_mode=never and no bounce: all direct
