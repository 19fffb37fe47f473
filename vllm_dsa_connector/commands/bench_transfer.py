"""``vllm-dsa bench transfer``: NIXL scattered runs vs bounce vs the gate, two real processes.

A sender and a receiver process (multiprocessing spawn) each hold a pool of ``2 * blocks`` blocks of
``block_bytes``; the same ``blocks`` random blocks move four ways, interleaved rep by rep:

- ``contiguous``: one run of ``blocks * block_bytes`` (the ceiling),
- ``scattered``: one descriptor per run (runs after merging),
- ``bounce``: gather into the staging arena + one write + receiver scatter,
- ``auto``: whatever :class:`BounceGate` chooses (``auto_path``).

The two processes are :func:`vllm_dsa_connector.harness.pair.run_pair`'s producer and consumer. A time
is from the sender's start until the receiver reported completion (data landed and, for bounce,
scattered) over the control channel; its latency is in every column alike. After every rep the receiver
compares all received bytes with what was sent and the bench fails loudly on a difference.
UCX_TLS from the environment applies (e.g. ``UCX_TLS=tcp``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from vllm_dsa_connector.harness.pair import ConsumerSide, PairSpec, ProducerSide, SideSpec, run_pair

METHODS = ("contiguous", "scattered", "bounce", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI flags."""
    parser.add_argument("--blocks", type=int, default=4096, help="blocks moved (default 4096)")
    parser.add_argument("--block-bytes", type=int, default=576, help="bytes per block (default 576)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per method (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="random block choice and data")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per transfer before failing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")


def _layout(blocks: int, block_bytes: int, seed: int) -> tuple[int, Any, Any]:
    """(pool bytes, the scattered runs after merging, the one contiguous run) of the request."""
    import numpy as np

    from vllm_dsa_connector.transport import Runs

    rng = np.random.default_rng(seed)
    pool = 2 * blocks
    src = rng.choice(pool, blocks, replace=False)
    dst = rng.choice(pool, blocks, replace=False)
    lens = np.full(blocks, block_bytes, np.int64)
    scattered = Runs(src * block_bytes, dst * block_bytes, lens).merged()
    contiguous = Runs(np.array([0]), np.array([0]), np.array([blocks * block_bytes]))
    return pool * block_bytes, scattered, contiguous


def _time_scatter(side: ConsumerSide, key: str, reps: int) -> float:
    """On D: median seconds of one scatter of the arena's bytes over ``runs[key]`` into the pool."""
    from vllm_dsa_connector.transport import scatter

    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        scatter(side.arena.buffer, side.pool, side.runs[key])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _drive(side: ProducerSide, args: dict[str, Any]) -> dict[str, Any]:
    """On P: every method, interleaved rep by rep, timed from the send to D's DONE; bytes verified."""
    from vllm_dsa_connector.transport import BounceGate, BounceSender, gather

    _, scattered, contiguous = _layout(args["blocks"], args["block_bytes"], args["seed"])
    d = side.consumer
    assert d is not None
    d.runs("scattered", scattered)
    d.runs("contiguous", contiguous)
    gate = BounceGate.from_config({})
    snd = BounceSender(side.engine, side.arena, gate)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    phases: dict[str, list[tuple[float, float, float]]] = {m: [] for m in METHODS}
    auto_paths: set[str] = set()
    order_rng = random.Random(args["seed"])
    for rep in range(args["reps"] + 1):  # rep 0 warms up every path
        # A fresh order every rep: no path always runs right after another (position effects).
        for method in order_rng.sample(METHODS, len(METHODS)):
            tag = f"{method}-{rep}".encode()
            key = "contiguous" if method == "contiguous" else "scattered"
            slot = d.expect(tag, key, bounce=method in ("bounce", "auto"))
            force = {"contiguous": "direct", "scattered": "direct", "bounce": "bounce"}.get(method)
            t0 = time.perf_counter()
            send = snd.send(side.peer, side.region, side.remote_region, scattered if key == "scattered"
                            else contiguous, tag, slot=slot, path=force)
            t1 = time.perf_counter()
            snd.wait(send, args["timeout"])
            t2 = time.perf_counter()
            d.done()
            dt = time.perf_counter() - t0
            if not d.verified():
                raise RuntimeError(f"bench transfer: received bytes differ ({method}, rep {rep})")
            if method == "bounce" and send.path != "bounce":
                raise RuntimeError(f"bench transfer: bounce path fell back: {send.reason}")
            if rep:
                times[method].append(dt)
                phases[method].append((t1 - t0, t2 - t1, t0 + dt - t2))
                if method == "auto":
                    auto_paths.add(send.path)
    gts = []
    for _ in range(args["reps"]):
        t0 = time.perf_counter()
        gather(side.pool, scattered, side.arena.buffer)
        gts.append(time.perf_counter() - t0)
    scatter_s = d.call(_time_scatter, key="scattered", reps=args["reps"])
    dec = gate.decision(scattered, merged=True)
    return {
        **{f"{m}_ms": statistics.median(times[m]) * 1e3 for m in METHODS},
        "min_ms": {m: round(min(times[m]) * 1e3, 3) for m in METHODS},  # for noisy hosts
        "auto_path": "/".join(sorted(auto_paths)),
        # Sender's view, medians in ms: [send() = gather + post, wait for the WRITE, receiver's
        # completion (incl. scatter) + the pipe's ack].
        "phases_ms": {m: [round(statistics.median(p[i] for p in phases[m]) * 1e3, 3) for i in range(3)]
                      for m in METHODS},
        "gather_ms": statistics.median(gts) * 1e3,
        "scatter_ms": scatter_s * 1e3,
        "runs": scattered.num_runs,
        "total_bytes": scattered.total_bytes,
        "profile": gate.profile,
        "gate_reason": dec.reason,
    }


def measure(blocks: int, block_bytes: int, reps: int, seed: int = 0, timeout: float = 60.0,
            threads: int = 1) -> dict[str, Any]:
    """Run the bench in two fresh processes (:func:`~vllm_dsa_connector.harness.pair.run_pair`); returns the
    result dict (raises on a byte mismatch or a failed side)."""
    if blocks < 1 or block_bytes < 1 or reps < 1:
        raise ValueError("--blocks, --block-bytes and --reps must be >= 1")
    pool_bytes, scattered, _ = _layout(blocks, block_bytes, seed)
    # One intra-op thread per process: with two processes on a small host, torch's second thread waits
    # for a scheduler tick behind the peer's polling thread (gather/scatter times quantised to ~8 ms).
    side = SideSpec(pool_bytes=pool_bytes, arena_bytes=max(1 << 20, scattered.total_bytes + 4096), threads=threads)
    spec = PairSpec(producer=side, consumer=side, seed=seed + 1, transfer_timeout_s=timeout)
    args = {"blocks": blocks, "block_bytes": block_bytes, "reps": reps, "seed": seed, "timeout": timeout}
    out: dict[str, Any] = run_pair(spec, _drive, args, timeout_s=timeout + 30 + reps * 4 * len(METHODS) * 2)
    out.update(blocks=blocks, block_bytes=block_bytes, reps=reps, ucx_tls=os.environ.get("UCX_TLS", "default"))
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench transfer``."""
    try:
        out = measure(args.blocks, args.block_bytes, args.reps, args.seed, args.timeout, args.threads)
    except (RuntimeError, ValueError) as e:
        print(f"vllm-dsa bench transfer: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"NIXL WRITE, {out['blocks']} x {out['block_bytes']} B -> {out['runs']} runs after merging, "
          f"UCX_TLS={out['ucx_tls']}, medians of {out['reps']} (bytes verified every rep)")
    print("| contiguous_ms | scattered_ms | bounce_ms | auto_ms | auto_path | gather_ms | scatter_ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {out['contiguous_ms']:.2f} | {out['scattered_ms']:.2f} | {out['bounce_ms']:.2f} | "
          f"{out['auto_ms']:.2f} | {out['auto_path']} | {out['gather_ms']:.2f} | {out['scatter_ms']:.2f} |")
    print(f"gate ({out['profile']}): {out['gate_reason']}")
    if args.json:
        print(json.dumps(out))
    return 0
