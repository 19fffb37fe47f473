"""``vllm:dsa_kv_transfer_seconds`` observes ONE span per (request, destination rank) on every route (issue 49).

A real P and a real D :class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker` in one process over
vLLM-allocated KV caches of a GLM-MoE-DSA config in a GPU engine's layout (LBNHC: two pools: the MLA latent and the indexer K cache, so a
direct post is two WRITEs and a layer-by-layer one a WRITE per layer and pool), two real NIXL agents, the
workers' real receive path. Each request goes along one route D names in its registration (direct, bounce
through D's staging slot, ipc into P's mapping of D's pools: CPU tensors here, which the copies accept),
whole or layer by layer (``layer_push``); P's stats must then hold exactly one ``transfer_s`` observation for
it, at most the time from the post to P reporting it finished. A layer-by-layer post's span starts at its
close (P's last layer): the time the layers took to compute before is not transfer time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

BLOCK_SIZE = 64
NUM_BLOCKS = 16
SRC_BLOCKS = [3, 4, 5]
DST_BLOCKS = [7, 2, 9]
CFG = {"num_layers": 4, "index_topk_pattern": "FSFS"}
ARENA = 8 << 20
FORWARD_S = 0.5  # how long the layer-by-layer case's "forward" takes between the post's open and its layers


def _worker(engine: str, role: str) -> Any:
    import torch
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import allocate_offline
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    kv_caches, _, table = allocate_offline(glm_dsa_config(**CFG), pp_rank=0, pp_size=1, tp_rank=0, tp_size=1,
                                           block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, layout="LBNHC")
    opts = ConnectorOptions.from_config({"transfer_timeout_s": 30, "prefault_kv_cache": False,
                                         "bounce_mode": "auto", "bounce_arena_bytes": ARENA}, environ={})
    worker = DSAConnectorWorker(engine, opts, {"model_dtype": "bf16"}, role=role)
    worker.register(kv_caches, table)
    g = torch.Generator().manual_seed(5)
    for t in kv_caches.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, tuple(t.view(torch.uint8).shape), generator=g,
                                                dtype=torch.uint8))
    return worker


@pytest.fixture(scope="module")
def pd():
    p, d = _worker("P-span", "kv_producer"), _worker("D-span", "kv_consumer")
    yield p, d
    p.shutdown()
    d.shutdown()


def _push(p: Any, d: Any, req: str, path: str, layered: bool) -> float:
    """One request along ``path`` (whole or layer by layer), until D has it and P reported it finished;
    seconds from P's post (the open, for a layered one) to that report."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, RecvJob, Route, encode

    routes = {} if path == "direct" else {0: {0: Route("bounce", 0, ARENA) if path == "bounce" else Route("ipc")}}
    peers = [] if p.engine_id in d.sources else [PeerInfo(p.engine_id, [encode(p.payload)], as_source=True)]
    d.start_load_kv(DSAConnectorMetadata(peers=peers, recv=[RecvJob(f"d-{req}", p.engine_id, DST_BLOCKS, {0: [0]},
                                                                     30.0, src_blocks=SRC_BLOCKS, routes=routes)]))
    push = PushJob(f"p-{req}", d.engine_id, f"d-{req}", SRC_BLOCKS, DST_BLOCKS, routes=routes, layered=layered)
    t0 = time.perf_counter()
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])], push=[push]))
    if layered:
        time.sleep(FORWARD_S)  # the forward computes its layers
        for name in sorted(p.layer_ids, key=p.layer_ids.get):
            p.save_layer(name)
        p.wait_for_save()
    deadline = time.monotonic() + 20
    sent: set[str] = set()
    received: set[str] = set()
    while f"p-{req}" not in sent or f"d-{req}" not in received:
        s, r, f = p.get_transfer_results()
        sent |= s
        _, r, f = d.get_transfer_results()
        received |= r
        assert not f, f"{req}: D failed the load"
        assert time.monotonic() < deadline, f"{req} never landed and finished"
        time.sleep(0.002)
    return time.perf_counter() - t0


def test_one_observation_per_request_and_destination_rank_on_every_route(pd) -> None:
    p, d = pd
    assert len(p.regions) == 2  # two pools: a direct post is (at least) two WRITEs
    counts: dict[str, int] = {}
    for path in ("direct", "bounce", "ipc"):
        for layered in (False, True):
            key = f"{path}{'-layered' if layered else ''}"
            if path == "ipc":  # P's mapping of D's pools: D's CPU tensors themselves (the copies accept them)
                agent = next(iter(p.remotes[d.engine_id].agents.values()))
                p.send.transport._maps[agent] = [r.tensor for r in d.regions]
            before = list(p.stats.data.get("transfer_s", []))
            wall = _push(p, d, key, path, layered)
            new = p.stats.data.get("transfer_s", [])[len(before):]
            counts[key] = len(new)
            assert all(0 < s <= wall for s in new), (key, new, wall)
            if layered:
                assert all(s < FORWARD_S for s in new), (key, new)  # from the close on, not from the open
    assert p.stats.data["send_failed"] == 0 and p.stats.data["ipc_bytes"] > 0 and p.stats.data["bounce_bytes"] > 0
    assert counts == {k: 1 for k in counts}, counts
