"""Worker-level DSA reshard through DSAConnector's worker API, with real NIXL between real processes.

DSA attention cannot run on CPU, so these tests prove the DSA path below the engine: each rank lives in
its own spawned process holding ``kv_caches`` allocated by vLLM's own allocation code for a GLM-MoE-DSA
config (``connector.page_tables.allocate_offline``: vLLM's spec grouping + ``allocate_kv_cache``, BLHNC layout), wrapped
by :class:`DSAConnectorWorker` exactly as ``DSAConnector.register_kv_caches`` does; the test plays the
scheduler (it builds the same step metadata) and checks every byte:

- every MLA and indexer page of every layer the destination owns equals the source page, block for block;
- blocks not requested are untouched (the destination starts filled with 0xAB);
- a mask mismatch is refused at the handshake (real ZMQ side channel), naming it.

Source pages are filled from a generator seeded by the layer NAME, so TP ranks hold identical replicated
pages (as in a real deployment) and the destination can recompute the expected bytes. Each case runs with
UCX's default transports (CMA on loopback) and with ``UCX_TLS=tcp`` (the network path); the rank processes
set ``UCX_TLS`` before creating each case's NIXL agents (UCX reads it per agent: a bogus value makes the
agent creation fail). Marked slow.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import zlib
from typing import Any

import pytest

pytestmark = pytest.mark.slow

NUM_BLOCKS = 40
BLOCK_SIZE = 64
SRC_BLOCKS = [3, 4, 5, 9, 10, 20, 21]
DST_BLOCKS = [7, 8, 2, 30, 31, 12, 13]

CASES: dict[str, dict[str, Any]] = {
    # freq 2, offset 1 (layers 0, 2, 4 own; 1, 3, 5 share) + one MTP layer (always owns)
    "pp2_to_pp1": {"cfg": {"num_layers": 6, "index_topk_freq": 2, "index_skip_topk_offset": 1,
                           "num_nextn_predict_layers": 1}, "p": (2, 1), "d": (1, 1)},
    # freq 4, default offset 2 (layers 1 and 5 own)
    "pp1_to_pp2": {"cfg": {"num_layers": 8, "index_topk_freq": 4}, "p": (1, 1), "d": (2, 1)},
    # explicit pattern: F = full (owns), S = shared
    "tp2_to_tp1": {"cfg": {"num_layers": 6, "index_topk_pattern": "FSSFSF"}, "p": (1, 2), "d": (1, 1)},
    # vLLM's GPU layout (LBNHC): one pool per KV cache spec, so every writer has two parts (latent, indexer)
    "pp2_to_pp1_two_pools": {"cfg": {"num_layers": 6, "index_topk_freq": 2, "index_skip_topk_offset": 1},
                             "p": (2, 1), "d": (1, 1), "layout": "LBNHC"},
}

BOUNCE = {"bounce_mode": "always", "bounce_arena_bytes": 64 << 20}

# ------------------------------------------------------------------------------ in the rank processes

_STATE: dict[str, Any] = {}


def _fill_source(kv_caches: dict[str, Any]) -> None:
    import torch

    for name, t in kv_caches.items():
        b = t.view(torch.uint8)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        b.copy_(torch.randint(0, 256, tuple(b.shape), generator=g, dtype=torch.uint8))


def h_setup(key: str, side: str, cfg: dict[str, Any], pp_rank: int, pp: int, tp_rank: int, tp: int,
            tls: str, engine: str, bounce: bool = False, layout: str | None = None) -> bytes:
    """Allocate one rank's KV cache with vLLM's code, wrap it in the connector worker; return its payload."""
    if tls == "default":
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = tls
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import allocate_offline
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker
    from vllm_dsa_connector.core.handoff.wire import encode

    kv_caches, _, table = allocate_offline(glm_dsa_config(**cfg), pp_rank=pp_rank, pp_size=pp,
                                           tp_rank=tp_rank, tp_size=tp, block_size=BLOCK_SIZE,
                                           num_blocks=NUM_BLOCKS, layout=layout)
    opts = ConnectorOptions.from_config({"transfer_timeout_s": 30, **(BOUNCE if bounce else {})}, environ={})
    role = "kv_producer" if side == "P" else "kv_consumer"
    worker = DSAConnectorWorker(engine, opts, {"model_dtype": "bf16"}, role=role)
    payload = worker.register(kv_caches, table)  # (pre-faults D's pools: fill after it, as vLLM would)
    if side == "P":
        _fill_source(kv_caches)
    else:
        for t in kv_caches.values():
            t.view(__import__("torch").uint8).fill_(0xAB)
    _STATE[key] = (worker, kv_caches, table)
    return encode(payload)


def h_step(key: str, meta: Any) -> None:
    _STATE[key][0].start_load_kv(meta)


def h_ready(key: str) -> bool:
    """Wait until the worker's set-up thread loaded the peers it learned (a real P learns D at D's registration,
    steps before the step that finishes an early prefill)."""
    return _STATE[key][0].setup.wait_idle(60)


def h_layers(key: str, seed: int) -> int:
    """Play the forward of the step that finishes the prefill: ``save_kv_layer`` for every attention layer
    but one, in a shuffled order, then ``wait_for_save`` (which adds the layer nobody reported); the number
    of layers reported."""
    import random

    worker = _STATE[key][0]
    names = sorted(n for n in worker.layer_ids if "indexer" not in n)  # vLLM names the attention layers
    random.Random(seed).shuffle(names)
    for name in names[1:]:
        worker.save_layer(name)
    worker.wait_for_save()
    return len(names) - 1


def h_poll(key: str, want: str, timeout_s: float) -> dict[str, Any]:
    """Drive ``get_transfer_results`` until ``want`` is reported (sent or received)."""
    worker = _STATE[key][0]
    deadline = time.monotonic() + timeout_s
    out: dict[str, Any] = {"sending": set(), "recving": set(), "failed": set(), "error_blocks": set()}
    while time.monotonic() < deadline:
        s, r, f = worker.get_transfer_results()
        out["sending"] |= s
        out["recving"] |= r
        out["failed"] |= f
        out["error_blocks"] |= worker.get_block_ids_with_load_errors()
        if want in out["sending"] or want in out["recving"]:
            break
        time.sleep(0.002)
    out["stats"] = worker.stats.data
    return out


def h_check(key: str, src_blocks: list[int], dst_blocks: list[int]) -> dict[str, Any]:
    """Compare every destination page with the expected source bytes; count untouched blocks."""
    import torch

    _, kv_caches, table = _STATE[key]
    expected_src: dict[str, Any] = {}
    for name, t in kv_caches.items():  # the source of a layer is recomputed from its name
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        expected_src[name] = torch.randint(0, 256, tuple(t.view(torch.uint8).shape), generator=g,
                                           dtype=torch.uint8)
    src = torch.tensor(src_blocks)
    dst = torch.tensor(dst_blocks)
    others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in set(dst_blocks)])
    bad, checked, roles, nbytes = [], 0, set(), 0
    for name, t in kv_caches.items():
        b = t.view(torch.uint8)
        if not torch.equal(b[dst], expected_src[name][src]):
            bad.append(name)
        if not bool((b[others] == 0xAB).all()):
            bad.append(f"{name} (untouched blocks changed)")
        checked += 1
        nbytes += b[dst].numel()
        roles.add("indexer_k" if "indexer" in name else "mla")
    return {"bad": bad, "layers": checked, "roles": sorted(roles), "bytes": nbytes, "rank": table.rank,
            "owning": list(table.owning_layers), "names": sorted(kv_caches)}


def h_close(key: str) -> None:
    worker = _STATE.pop(key, (None,))[0]
    if worker is not None:
        worker.shutdown()


def _host(conn: Any) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", globals()[fn](*args)))
        except Exception as e:  # report to the parent, keep serving
            import traceback

            conn.send(("err", f"{e!r}\n{traceback.format_exc()}"))


# ------------------------------------------------------------------------------ in the test process


class Host:
    """One spawned rank process, called synchronously (or started and collected later)."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host, args=(child,), daemon=True)
        self.proc.start()

    def send(self, fn: str, *args: Any) -> None:
        self.conn.send((fn, args))

    def result(self, timeout_s: float = 300) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("rank process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"rank process failed: {value}")
        return value

    def call(self, fn: str, *args: Any) -> Any:
        self.send(fn, *args)
        return self.result()


@pytest.fixture(scope="module")
def hosts():
    ctx = mp.get_context("spawn")
    hs = [Host(ctx) for _ in range(3)]
    yield hs
    for h in hs:
        try:
            h.conn.send(None)
        except OSError:
            pass
        h.proc.join(2)
        if h.proc.is_alive():  # NIXL/UCX threads can delay interpreter exit; the state is not needed
            h.proc.kill()
            h.proc.join(5)


def _ranks(pp: int, tp: int) -> list[tuple[int, int]]:
    return [(p, t) for p in range(pp) for t in range(tp)]


def _setup(hosts: list[Host], case: dict[str, Any], tls: str, tag: str,
           d_cfg: dict[str, Any] | None = None, bounce: bool = False) -> tuple[list, list]:
    """Set up P ranks then D ranks on the hosts (in parallel); returns [(host, key, payload)] per side."""
    p_ranks, d_ranks = _ranks(*case["p"]), _ranks(*case["d"])
    assert len(p_ranks) + len(d_ranks) <= len(hosts)
    jobs = []
    for i, (pp_r, tp_r) in enumerate(p_ranks):
        key = f"{tag}-P{i}"
        hosts[i].send("h_setup", key, "P", case["cfg"], pp_r, case["p"][0], tp_r, case["p"][1], tls, f"P-{tag}",
                      bounce, case.get("layout"))
        jobs.append(("P", hosts[i], key))
    for j, (pp_r, tp_r) in enumerate(d_ranks):
        h = hosts[len(p_ranks) + j]
        key = f"{tag}-D{j}"
        h.send("h_setup", key, "D", d_cfg or case["cfg"], pp_r, case["d"][0], tp_r, case["d"][1], tls,
               f"D-{tag}", bounce, case.get("layout"))
        jobs.append(("D", h, key))
    out: dict[str, list] = {"P": [], "D": []}
    for side, h, key in jobs:
        out[side].append((h, key, h.result()))
    return out["P"], out["D"]


def _close(*sides: list) -> None:
    for side in sides:
        for h, key, _ in side:
            h.call("h_close", key)


@pytest.mark.parametrize("tls,path", [("default", "direct"), ("tcp", "direct"), ("tcp", "bounce"),
                                      ("default", "layered"), ("tcp", "layered-bounce"),
                                      ("default", "early-layered")])
@pytest.mark.parametrize("name", list(CASES))
def test_reshard_moves_every_owning_page(hosts: list[Host], name: str, tls: str, path: str) -> None:
    """``path="bounce"``: the gate is forced to bounce and D's slots are planned by the scheduler's
    ``plan_routes``, so every write is gathered into P's staging arena, written once, scattered on D.
    ``layered``: the push job is posted layer by layer from the workers' ``save_layer`` (``layer_push``),
    the bounce one into the same packed slot D scatters from once. ``early-layered``: D's receive job is an early
    registration's (stand-in source blocks 0..n-1, P's real ones are not contiguous): the checksums must
    still be taken as the runs D expects."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.routes import plan_routes
    from vllm_dsa_connector.core.handoff.side_channel import validate_peer
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, RecvJob, decode_payload
    from vllm_dsa_connector.core.transfer.gate import BounceGate
    from vllm_dsa_connector.core.transfer.gate_options import BounceSettings
    from vllm_dsa_connector.core.transfer.slots import SlotAllocator

    case = CASES[name]
    tag = f"{name}-{tls}-{path}"
    bounce = path.endswith("bounce")
    P, D = _setup(hosts, case, tls, tag, bounce=bounce)
    try:
        p_payloads = [p for _, _, p in P]
        d_payloads = [p for _, _, p in D]
        src, dst = [decode_payload(p) for p in p_payloads], [decode_payload(p) for p in d_payloads]
        plan = validate_peer(src, dst)
        expected = {d.rank: list(plan.senders_for(d.rank)) for d in dst}
        routes: dict = {}
        if bounce:
            arenas = {d.rank: SlotAllocator(d.staging.size) for d in dst}  # bookkeeping only, no tensor
            gate = BounceGate(BounceSettings.from_config(BOUNCE, environ={}))
            routes, _ = plan_routes(plan, src, dst, SRC_BLOCKS, DST_BLOCKS, gate, arenas)
            assert sum(len(v) for v in routes.values()) == sum(len(v) for v in expected.values()), routes
        early = path.startswith("early")
        src_blocks = SRC_BLOCKS[::-1] if early else SRC_BLOCKS  # P's blocks handed out in reverse
        recv = RecvJob("d-req", f"P-{tag}", DST_BLOCKS, expected, 30.0, verify=True,
                       src_blocks=list(range(len(SRC_BLOCKS))) if early else SRC_BLOCKS, routes=routes, early=early)
        for h, key, _ in D:
            h.call("h_step", key, DSAConnectorMetadata(peers=[PeerInfo(f"P-{tag}", p_payloads, as_source=True)],
                                                       recv=[recv]))
        push = PushJob("p-req", f"D-{tag}", "d-req", src_blocks, DST_BLOCKS, verify=True, routes=routes,
                       layered="layered" in path)
        meta = DSAConnectorMetadata(local=PeerInfo(f"P-{tag}", p_payloads),
                                    peers=[PeerInfo(f"D-{tag}", d_payloads)], push=[push])
        for i, (h, key, _) in enumerate(P):
            if push.layered:  # layer by layer needs the peer set up when the step opens its post (h_ready)
                h.call("h_step", key, DSAConnectorMetadata(local=meta.local, peers=meta.peers))
                assert h.call("h_ready", key)
            h.call("h_step", key, meta)
            if push.layered:
                assert h.call("h_layers", key, i) > 0
        for h, key, _ in P + D:
            h.send("h_poll", key, "p-req" if (h, key, _) in P else "d-req", 30.0)
        polls = {key: h.result() for h, key, _ in P + D}
        for _, key, _ in P:
            assert "p-req" in polls[key]["sending"], f"{key} never finished sending: {polls[key]}"
        for _, key, _ in D:
            r = polls[key]
            assert "d-req" in r["recving"] and not r["failed"] and not r["error_blocks"], r
            assert r["stats"]["checksummed_runs"] > 0 and r["stats"]["checksum_mismatches"] == 0, r["stats"]
        sent = [polls[key]["stats"] for _, key, _ in P]
        bounced = sum(st["bounce_bytes"] for st in sent)
        assert (bounced == sum(st["send_bytes"] for st in sent) > 0) if bounce else bounced == 0, sent
        layered = sum(st.get("layered_bytes", 0) for st in sent)
        assert layered == (sum(st["send_bytes"] for st in sent) if push.layered else 0), sent
        for h, key, _ in D:
            res = h.call("h_check", key, src_blocks, DST_BLOCKS)
            assert not res["bad"], f"{key}: wrong bytes in {res['bad']}"
            assert res["roles"] == ["indexer_k", "mla"], res  # indexer pages moved too
            assert res["bytes"] > 0
    finally:
        _close(P, D)


def test_mask_mismatch_refused_at_handshake(hosts: list[Host]) -> None:
    from vllm_dsa_connector.core.handoff.messages import Origin, Reply
    from vllm_dsa_connector.core.handoff.side_channel import (
        HandshakeError,
        SideChannelServer,
        fetch_payloads,
        validate_peer,
    )
    from vllm_dsa_connector.core.handoff.wire import decode_payload

    case = CASES["pp1_to_pp2"]
    other = {**case["cfg"], "index_topk_freq": 2}  # same model otherwise, different indexer mask
    P, D = _setup(hosts, case, "default", "mask", d_cfg=other)
    p_payloads = [p for _, _, p in P]
    server = SideChannelServer("127.0.0.1", 24950, lambda req, sender: Reply(True, engine_id="P", payloads=p_payloads),
                               origin=Origin("P", 1))
    try:
        remote = fetch_payloads("127.0.0.1", server.port, 10.0).payloads  # the real handshake path
        with pytest.raises(HandshakeError, match="indexer mask mismatch"):
            validate_peer(remote, [decode_payload(p) for _, _, p in D])
    finally:
        server.close()
        _close(P, D)


def h_corrupt_notice(key: str, src_engine: str, src_payloads: list[bytes], src_blocks: list[int],
                     blocks: list[int]) -> dict[str, Any]:
    """Arm a receive, then feed it a notice whose entries are the runs D's plan expects from rank 0 but whose
    first checksum cannot match (a fault we cannot cause on a real wire: the notice is fabricated, the rest is
    the worker's real receive path)."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import Notice, PeerInfo, RecvJob, encode
    from vllm_dsa_connector.core.transfer.notices import encode_notif

    worker = _STATE[key][0]
    me = worker.table.rank
    worker.start_load_kv(DSAConnectorMetadata(peers=[PeerInfo(src_engine, src_payloads, as_source=True)],
                                              recv=[RecvJob("bad-req", src_engine, blocks, {me: [0]}, 30.0, True,
                                                            src_blocks=src_blocks)]))
    region = worker.regions[0]
    plan = worker.sources[src_engine].plan
    checks = [(dp, int(o), int(n), 12345) for _, dp, runs in plan.runs(0, me, src_blocks, blocks)
              for o, n in zip(runs.dst_offsets, runs.lengths, strict=True)]
    bad = Notice("bad-req", 0, True, sum(c[2] for c in checks), len(checks), checks=checks)
    agent = next(p.agent_name for p in worker.sources[src_engine].payloads if p.rank == 0)
    with worker._lock:  # as the worker's own progress thread does
        worker.receiver.handle(agent, encode_notif("direct", 0, encode(bad)))
    done = worker.get_transfer_results()
    return {"done": done, "error_blocks": worker.get_block_ids_with_load_errors(),
            "mismatches": worker.stats.data["checksum_mismatches"], "region": region.size}


def test_checksum_mismatch_is_a_load_failure(hosts: list[Host]) -> None:
    case = CASES["tp2_to_tp1"]
    P, D = _setup(hosts, {**case, "p": (1, 1)}, "default", "crc")
    try:
        h, key, _ = D[0]
        out = h.call("h_corrupt_notice", key, "P-crc", [p for _, _, p in P], SRC_BLOCKS, DST_BLOCKS)
        assert "bad-req" in out["done"][1]  # finished receiving (vLLM then applies the policy) ...
        assert out["error_blocks"] == set(DST_BLOCKS)  # ... on these blocks, reported the vLLM way
        assert out["mismatches"] == 1
    finally:
        _close(P, D)
