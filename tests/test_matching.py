"""Transfer plans between real page tables (built by vLLM's spec/allocation code), checked byte for byte."""

from __future__ import annotations

from functools import cache

import msgspec
import numpy as np
import pytest
from vllm_dsa_dev.tiny_models import glm_dsa_config

from vllm_dsa_connector.connector.page_tables import build_offline
from vllm_dsa_connector.core.plan.pages import Role
from vllm_dsa_connector.core.plan.peer_plan import expand_runs
from vllm_dsa_connector.core.plan.segments import TransferPlan, assert_exactly_once, plan_transfer
from vllm_dsa_connector.core.plan.token_map import PlanError

MODELS = {
    "dense": dict(num_layers=6),
    "masked": dict(num_layers=9, index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=1),
    "fully_masked_stage": dict(num_layers=9, index_topk_pattern="FFFSSSFFF"),
}
NUM_BLOCKS = 6


@cache
def tables(model: str, pp: int, tp: int, block_size: int = 64):
    kw = dict(MODELS[model])
    cfg = glm_dsa_config(kw.pop("num_layers"), **kw)
    return tuple(build_offline(cfg, pp_size=pp, tp_size=tp, block_size=block_size, num_blocks=NUM_BLOCKS))


def _memory(table, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, p.nbytes, dtype=np.uint8) for p in table.pools]


def _simulate(plan: TransferPlan, src, dst, src_blocks, dst_blocks):
    """Apply the plan's byte runs to per-rank numpy memories; return destination memories."""
    src_mem = {t.rank: _memory(t, 100 + t.rank) for t in src}
    dst_mem = {t.rank: [np.zeros(p.nbytes, np.uint8) for p in t.pools] for t in dst}
    by_rank = {t.rank: t for t in src}
    for d in dst:
        for s_rank in plan.senders_for(d.rank):
            for runs in expand_runs(plan.for_pair(s_rank, d.rank), by_rank[s_rank], d, src_blocks, dst_blocks):
                sm, dm = src_mem[s_rank][runs.src_pool], dst_mem[d.rank][runs.dst_pool]
                for so, do, n in zip(runs.src_offsets, runs.dst_offsets, runs.lengths, strict=True):
                    dm[do:do + n] = sm[so:so + n]
    return src_mem, dst_mem


def _page(table, mem, role, layer, block):
    v = table.view(role)
    e = v.entry(layer)
    pool = table.pools[v.pool]
    start = e.offset + block * pool.block_stride
    return mem[v.pool][start:start + e.nbytes]


CASES = [(1, 1, 1, 2), (1, 1, 2, 1), (2, 1, 1, 1), (1, 1, 3, 1), (2, 1, 3, 1), (3, 1, 2, 1),
         (1, 1, 1, 2), (1, 2, 1, 1), (1, 4, 1, 2), (2, 2, 1, 1), (1, 2, 2, 1)]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("p_pp,p_tp,d_pp,d_tp", CASES)
def test_plan_moves_every_owned_page_exactly_once(model, p_pp, p_tp, d_pp, d_tp) -> None:
    src, dst = tables(model, p_pp, p_tp), tables(model, d_pp, d_tp)
    plan = plan_transfer(src, dst)
    # exactly one sender per (destination, role, layer); one elected sender per destination view
    assert_exactly_once(plan, dst)
    if p_pp == 1:  # every layer is on every source rank: one elected sender per destination view
        for d in dst:
            for v in d.views:
                senders = {s.src_rank for s in plan.for_dst(d.rank) for r, _ in s.layers if r == v.role.value}
                assert len(senders) == 1
    src_blocks, dst_blocks = [1, 2, 4], [5, 0, 3]
    src_mem, dst_mem = _simulate(plan, src, dst, src_blocks, dst_blocks)
    by_layer = {}
    for s in plan.segments:
        for role, layer in s.layers:
            by_layer[(s.dst_rank, role, layer)] = s.src_rank
    src_by_rank = {t.rank: t for t in src}
    for d in dst:
        for v in d.views:
            for layer in v.layers:
                s = src_by_rank[by_layer[(d.rank, v.role.value, layer)]]
                for sb, db in zip(src_blocks, dst_blocks, strict=True):
                    want = _page(s, src_mem[s.rank], v.role, layer, sb)
                    got = _page(d, dst_mem[d.rank], v.role, layer, db)
                    assert np.array_equal(want, got), (d.rank, v.role, layer, sb, db)
        # blocks not requested stay untouched (zero)
        for v in d.views:
            for layer in v.layers:
                for b in set(range(NUM_BLOCKS)) - set(dst_blocks):
                    assert not _page(d, dst_mem[d.rank], v.role, layer, b).any()


def test_tp_reshard_spreads_elected_senders() -> None:
    plan = plan_transfer(tables("masked", 1, 4), tables("masked", 1, 2))
    assert plan.senders_for(0) != plan.senders_for(1)
    assert all(len(plan.senders_for(r)) == 1 for r in (0, 1))


def test_fully_masked_stage_receives_no_indexer_pages() -> None:
    src, dst = tables("fully_masked_stage", 1, 1), tables("fully_masked_stage", 3, 1)
    plan = plan_transfer(src, dst)
    roles = {r for s in plan.for_dst(1) for r, _ in s.layers}
    assert roles == {"mla"}
    back = plan_transfer(dst, src)  # 3 -> 1: stage 1 sends MLA only, stages 0 and 2 send indexer rows
    idx_senders = {s.src_rank for s in back.segments for r, _ in s.layers if r == "indexer_k"}
    assert idx_senders == {0, 2}


def test_same_layout_merges_each_block_into_one_run() -> None:
    (src,), (dst,) = tables("masked", 1, 1), tables("masked", 1, 1)
    plan = plan_transfer([src], [dst])
    assert len(plan.segments) == 1 and plan.segments[0].nbytes == src.bytes_per_block
    (runs,) = expand_runs(plan.segments, src, dst, [0, 1, 2, 5], [0, 1, 2, 4])
    assert runs.num_runs == 2 and runs.total_bytes == 4 * src.bytes_per_block


def test_coverage_check_fails_on_duplicate_or_missing() -> None:
    src, dst = tables("masked", 2, 1), tables("masked", 1, 1)
    plan = plan_transfer(src, dst)
    with pytest.raises(PlanError, match="exactly once"):
        assert_exactly_once(TransferPlan(plan.segments + plan.segments[:1]), dst)
    with pytest.raises(PlanError, match="exactly once"):
        assert_exactly_once(TransferPlan(plan.segments[1:]), dst)


def test_mask_mismatch_is_refused() -> None:
    (t,) = tables("masked", 1, 1)
    other = msgspec.structs.replace(t, model=msgspec.structs.replace(t.model, owning_layers=(0, 1, 9)))
    with pytest.raises(PlanError, match="indexer mask mismatch"):
        plan_transfer([t], [other])


def test_block_sizes_may_differ_but_bytes_mismatch_is_refused() -> None:
    # different block sizes plan (pages mapped by token position, proven by the simulation matrix of issue 19);
    # page-for-page expansion refuses them instead of copying a page into a different meaning
    (src,), (dst,) = tables("masked", 1, 1, 64), tables("masked", 1, 1, 32)
    plan = plan_transfer([src], [dst])
    assert_exactly_once(plan, [dst], [src])
    with pytest.raises(PlanError, match="one block size"):
        expand_runs(plan.segments, src, dst, [0], [0])
    (t,) = tables("masked", 1, 1)
    v = t.view(Role.INDEXER_K)
    bad_view = msgspec.structs.replace(v, entries=tuple(msgspec.structs.replace(e, nbytes=e.nbytes + 4) for e in v.entries))
    bad = msgspec.structs.replace(t, views=tuple(bad_view if x is v else x for x in t.views))
    with pytest.raises(PlanError, match=r"indexer_k layer 0: bytes per layer differ \(sender 8448, receiver 8452\)"):
        plan_transfer([t], [bad])


def test_block_lists_are_validated() -> None:
    (t,) = tables("dense", 1, 1)
    plan = plan_transfer([t], [t])
    with pytest.raises(PlanError, match="differ in length"):
        expand_runs(plan.segments, t, t, [1, 2], [1])
    with pytest.raises(PlanError, match="out of range"):
        expand_runs(plan.segments, t, t, [NUM_BLOCKS], [0])


@pytest.mark.parametrize("p_pp,p_tp,d_pp,d_tp", [(1, 1, 2, 1), (1, 4, 1, 2), (2, 1, 1, 1)])
def test_peer_plan_runs_are_the_plans_merged_runs(p_pp, p_tp, d_pp, d_tp) -> None:
    """``PeerPlan.runs`` (tables decoded once, segments indexed per pair) gives exactly the plan's runs,
    merged with sorting (the order sender and receiver pack a bounce in); unknown pairs give nothing."""
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
    from vllm_dsa_connector.core.plan.runs import merge_runs

    src, dst = tables("masked", p_pp, p_tp), tables("masked", d_pp, d_tp)
    peer = PeerPlan.build(list(reversed(src)), dst)  # any order in: ranks index the tables
    assert peer.plan.segments == plan_transfer(src, dst).segments
    assert [t.rank for t in peer.src_tables] == sorted(t.rank for t in src)
    src_blocks, dst_blocks = [4, 1, 2], [0, 5, 3]  # out of order, as vLLM's free list hands them out
    by_rank = {t.rank: t for t in src}
    for d in dst:
        assert peer.senders_for(d.rank) == peer.plan.senders_for(d.rank)
        for s_rank in by_rank:
            got = peer.runs(s_rank, d.rank, src_blocks, dst_blocks)
            want = expand_runs(peer.plan.for_pair(s_rank, d.rank), by_rank[s_rank], d, src_blocks, dst_blocks)
            assert [(sp, dp) for sp, dp, _ in got] == [(w.src_pool, w.dst_pool) for w in want]
            for (_, _, runs), w in zip(got, want, strict=True):
                ref = merge_runs(w.src_offsets, w.dst_offsets, w.lengths)
                assert np.array_equal(runs.src_offsets, ref.src_offsets)
                assert np.array_equal(runs.dst_offsets, ref.dst_offsets)
                assert np.array_equal(runs.lengths, ref.lengths) and runs.merged() is runs
    assert peer.runs(99, 0, [0], [0]) == []
    with pytest.raises(PlanError, match="out of range"):
        peer.runs(0, 0, [NUM_BLOCKS], [0])
