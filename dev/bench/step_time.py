"""P's step time with and without a WRITE in flight (issue 44): what a push costs the engine's step.

One process, two real connector workers (:class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker`)
over vLLM-allocated KV caches of a tiny GLM-MoE-DSA config, two real NIXL agents on UCX (CPU). One "step" of
P is what vLLM's worker runs: ``start_load_kv`` (the step's pushes), the forward (a fixed CPU matmul standing
in for the model), ``wait_for_save`` and ``get_transfer_results``. Timed per step: ``start_load_kv`` alone
and the whole step, in three scenarios:

- ``idle``: no push (the baseline);
- ``push, D progressing``: every step pushes one request (``--blocks`` blocks) to D, whose receiver thread
  is armed for it (D polls as a live engine does);
- ``push, D busy``: every step pushes to a D that is not progressing (its receiver is not armed until the
  measured steps are over), so no WRITE can finish quickly (as with a busy D or a slow link).

Before issue 44 ``start_load_kv`` spun up to 50 ms on each WRITE it had just posted; after it, P's send
progress thread completes the WRITEs and the step never waits. Run it on both trees (``PYTHONPATH``) and
merge the rows (``--label``):

    PYTHONPATH=<tree> python dev/bench/step_time.py --label after --json

``--device cuda`` puts the KV caches (VRAM registered with NIXL) and the forward on the GPU, which the
forward's end synchronises, as a GPU engine's step does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

CFG = {"num_layers": 8, "index_topk_pattern": "FSFSFSFS"}
BLOCK_SIZE = 64


def _caches(num_blocks: int, device: str) -> tuple[dict[str, torch.Tensor], Any]:
    """One worker's KV caches allocated by vLLM on ``device`` and their page table (the runtime builder)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.page_tables import build_from_kv_caches, kv_cache_configs

    hf_config, configs = kv_cache_configs(glm_dsa_config(**CFG), pp_size=1, block_size=BLOCK_SIZE,
                                          num_blocks=num_blocks)
    kv_caches = allocate_kv_cache(configs[0], torch.device(device), KVCacheLayout["BLHNC"])
    table = build_from_kv_caches(kv_caches, configs[0], hf_config, pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    return kv_caches, table


def _worker(engine: str, role: str, num_blocks: int, device: str = "cpu") -> Any:
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    kv_caches, table = _caches(num_blocks, device)
    opts = ConnectorOptions.from_config({"transfer_timeout_s": 60, "prefault_kv_cache": True}, environ={})
    worker = DSAConnectorWorker(engine, opts, {"model_dtype": "bf16"}, role=role)
    worker.register(kv_caches, table)
    return worker


def _forward(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        torch.mm(a, a)


def _arm(p: Any, d: Any, req: str, blocks: list[int]) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, RecvJob, encode

    peers = [] if p.engine_id in d.sources else [PeerInfo(p.engine_id, [encode(p.payload)], as_source=True)]
    d.start_load_kv(DSAConnectorMetadata(peers=peers, recv=[RecvJob(req, p.engine_id, blocks, {0: [0]}, 60.0,
                                                                     src_blocks=blocks)]))


def _drain(p: Any, d: Any, reqs: set[str], timeout_s: float = 60.0) -> None:
    """Steps of both (no forward) until D got every request of ``reqs``."""
    done: set[str] = set()
    end = time.monotonic() + timeout_s
    while not reqs <= done:
        p.get_transfer_results()
        done |= d.get_transfer_results()[1]
        if time.monotonic() > end:
            raise RuntimeError(f"{sorted(reqs - done)} never reached D")
        time.sleep(0.001)
    for _ in range(50):  # P reports finished_sending
        p.get_transfer_results()
        time.sleep(0.001)


def run(args: argparse.Namespace) -> list[list[Any]]:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    torch.set_num_threads(1)
    p = _worker("P-step", "kv_producer", args.blocks + 8, args.device)
    d = _worker("D-step", "kv_consumer", args.blocks * (args.steps + 2) + 8, args.device)
    blocks = list(range(args.blocks))
    nbytes = p.table.bytes_per_block * args.blocks
    a = torch.randn(256, 256, device=args.device)
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])]))
    setup = getattr(p, "setup", None)
    if setup is not None:
        setup.wait_idle(10)
    rows = []
    n = 0
    for scenario in ("idle", "push, D progressing", "push, D busy"):
        starts, steps = [], []
        pending: set[str] = set()
        for i in range(args.warmup + args.steps):
            meta = DSAConnectorMetadata()
            if scenario != "idle":
                n += 1
                dst = [args.blocks * (i % (args.steps + 1)) + b for b in blocks]
                if scenario == "push, D progressing":
                    _arm(p, d, f"d{n}", dst)
                pending.add(f"d{n}")
                meta = DSAConnectorMetadata(push=[PushJob(f"p{n}", d.engine_id, f"d{n}", blocks, dst)])
            t0 = time.perf_counter()
            p.start_load_kv(meta)
            t1 = time.perf_counter()
            _forward(a, args.forward_reps)
            if a.is_cuda:
                torch.cuda.synchronize()  # the step's forward is over when its kernels are
            p.wait_for_save()
            p.get_transfer_results()
            t2 = time.perf_counter()
            if i >= args.warmup:
                starts.append((t1 - t0) * 1e3)
                steps.append((t2 - t0) * 1e3)
            if scenario == "push, D progressing":
                _drain(p, d, pending)
                pending.clear()
        if scenario == "push, D busy":
            for req in sorted(pending):  # D arms them now: every WRITE completes before the next scenario
                _arm(p, d, req, [0])
            time.sleep(0.5)
            for _ in range(200):
                p.get_transfer_results()
                d.get_transfer_results()
                time.sleep(0.002)
        steps.sort()
        rows.append([args.label + (f" ({args.device})" if args.device != "cpu" else ""), scenario, round(nbytes / 2**20, 2) if scenario != "idle" else 0,
                     round(statistics.median(starts), 2), round(max(starts), 2),
                     round(statistics.median(steps), 2), round(steps[int(0.9 * (len(steps) - 1))], 2)])
    p.shutdown()
    d.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per pushed request")
    ap.add_argument("--steps", type=int, default=30, help="measured steps per scenario")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--forward-reps", type=int, default=20, help="256x256 matmuls standing in for the forward")
    ap.add_argument("--device", default="cpu", help="where the KV caches and the forward live (cpu or cuda)")
    ap.add_argument("--label", default="", help="names this tree in the rows (before / after)")
    ap.add_argument("--merge", nargs="*", default=[], help="JSON files of earlier runs whose rows come first")
    ap.add_argument("--json", action="store_true", help="print one JSON line (vllm-dsa bench report --record)")
    args = ap.parse_args(argv)
    rows = [r for path in args.merge for r in json.load(open(path))["rows"]] + run(args)
    out = {"kind": "table", "columns": ["tree", "scenario", "MiB per push", "start_load_kv median ms",
                                        "start_load_kv max ms", "step median ms", "step p90 ms"], "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(*r, sep="\t")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
