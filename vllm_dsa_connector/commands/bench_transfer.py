"""``vllm-dsa bench transfer``: NIXL scattered runs vs bounce vs the gate, two real processes.

A sender and a receiver process (multiprocessing spawn) each hold a pool of ``2 * blocks`` blocks of
``block_bytes``; the same ``blocks`` random blocks move four ways, interleaved rep by rep:

- ``contiguous``: one run of ``blocks * block_bytes`` (the ceiling),
- ``scattered``: one descriptor per run (runs after merging),
- ``bounce``: gather into the staging arena + one write + receiver scatter,
- ``auto``: whatever :class:`BounceGate` chooses (``auto_path``).

A time is from the sender's start until the receiver reported completion (data landed and, for bounce,
scattered) over a pipe; the pipe's latency is in every column alike. After every rep the receiver
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


def _layout(blocks: int, block_bytes: int, seed: int) -> Any:
    import numpy as np

    from vllm_dsa_connector.transport.runs import Runs

    rng = np.random.default_rng(seed)
    pool = 2 * blocks
    src = rng.choice(pool, blocks, replace=False)
    dst = rng.choice(pool, blocks, replace=False)
    lens = np.full(blocks, block_bytes, np.int64)
    scattered = Runs(src * block_bytes, dst * block_bytes, lens).merged()
    contiguous = Runs(np.array([0]), np.array([0]), np.array([blocks * block_bytes]))
    return pool * block_bytes, scattered, contiguous


def _pool(nbytes: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _setup(name: str, conn: Any, args: dict[str, Any]) -> Any:
    import torch

    from vllm_dsa_connector.transport.bounce import StagingArena
    from vllm_dsa_connector.transport.engine import NixlEngine

    # One intra-op thread per process: with two processes on a small host, torch's second thread waits
    # for a scheduler tick behind the peer's polling thread (gather/scatter times quantised to ~8 ms).
    torch.set_num_threads(args["threads"])

    pool_bytes, scattered, contiguous = _layout(args["blocks"], args["block_bytes"], args["seed"])
    eng = NixlEngine(f"bench-{name}-{os.getpid()}")
    arena = StagingArena(max(1 << 20, scattered.total_bytes + 4096))
    return eng, arena, pool_bytes, scattered, contiguous


def _receiver(conn: Any, args: dict[str, Any]) -> None:
    import torch

    from vllm_dsa_connector.transport.bounce import BounceReceiver, gather, scatter
    from vllm_dsa_connector.transport.runs import Runs

    eng, arena, pool_bytes, scattered, contiguous = _setup("rcv", conn, args)
    try:
        expected = _pool(pool_bytes, args["seed"])
        dst = torch.zeros(pool_bytes, dtype=torch.uint8)
        region = eng.register(dst)
        rcv = BounceReceiver(eng, arena, reserve_timeout_s=0.2)
        conn.send((eng.metadata(), region.desc().to_dict()))
        eng.add_peer(conn.recv())
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "scatter_time":
                stage = arena.buffer
                ts = []
                for _ in range(args["reps"]):
                    t0 = time.perf_counter()
                    scatter(stage, dst, scattered)
                    ts.append(time.perf_counter() - t0)
                conn.send(statistics.median(ts))
                continue
            _, method, tag = msg
            runs = contiguous if method == "contiguous" else scattered
            dst.zero_()
            slots = rcv.expect(tag, dst, [runs], bounce=method in ("bounce", "auto"))
            conn.send(("ready", slots[0].to_dict() if slots[0] else None))
            rcv.wait(tag, args["timeout"])
            conn.send(("done",))
            got = torch.empty(runs.total_bytes, dtype=torch.uint8)
            want = torch.empty(runs.total_bytes, dtype=torch.uint8)
            gather(dst, Runs(runs.dst_offsets, runs.dst_offsets, runs.lengths), got)
            gather(expected, runs, want)
            conn.send(("verified", bool(torch.equal(got, want))))
    except BaseException as e:
        conn.send(("error", f"receiver: {type(e).__name__}: {e}"))
        raise
    finally:
        eng.close()


def _sender(conn: Any, rconn: Any, args: dict[str, Any]) -> None:
    from vllm_dsa_connector.transport.bounce import BounceSender, gather
    from vllm_dsa_connector.transport.gate import BounceGate

    eng, arena, pool_bytes, scattered, contiguous = _setup("snd", rconn, args)
    try:
        src = _pool(pool_bytes, args["seed"])
        region = eng.register(src)
        gate = BounceGate.from_config({})
        snd = BounceSender(eng, arena, gate)
        rmeta, rdesc = rconn.recv()
        peer = eng.add_peer(rmeta)
        rconn.send(eng.metadata())
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        auto_paths: set[str] = set()
        phases: dict[str, list[tuple[float, float, float]]] = {m: [] for m in METHODS}
        order_rng = random.Random(args["seed"])
        for rep in range(args["reps"] + 1):  # rep 0 warms up every path
            # A fresh order every rep: no path always runs right after another (position effects).
            for method in order_rng.sample(METHODS, len(METHODS)):
                tag = f"{method}-{rep}".encode()
                runs = contiguous if method == "contiguous" else scattered
                rconn.send(("xfer", method, tag))
                kind, slot = _expect(rconn, "ready")
                force = {"contiguous": "direct", "scattered": "direct", "bounce": "bounce"}.get(method)
                t0 = time.perf_counter()
                send = snd.send(peer, region, rdesc, runs, tag, slot=slot, path=force)
                t1 = time.perf_counter()
                snd.wait(send, args["timeout"])
                t2 = time.perf_counter()
                _expect(rconn, "done")
                dt = time.perf_counter() - t0
                if rep:
                    phases[method].append((t1 - t0, t2 - t1, t0 + dt - t2))
                _, ok = _expect(rconn, "verified")
                if not ok:
                    raise RuntimeError(f"bench transfer: received bytes differ ({method}, rep {rep})")
                if method == "bounce" and send.path != "bounce":
                    raise RuntimeError(f"bench transfer: bounce path fell back: {send.reason}")
                if rep:
                    times[method].append(dt)
                    if method == "auto":
                        auto_paths.add(send.path)
        stage = arena.buffer
        gts = []
        for _ in range(args["reps"]):
            t0 = time.perf_counter()
            gather(src, scattered, stage)
            gts.append(time.perf_counter() - t0)
        rconn.send(("scatter_time",))
        scatter_s = rconn.recv()
        rconn.send(("stop",))
        dec = gate.decision(scattered, merged=True)
        conn.send({
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
        })
    except BaseException as e:
        conn.send({"error": f"sender: {type(e).__name__}: {e}"})
        raise
    finally:
        eng.close()


def _expect(conn: Any, kind: str) -> tuple[Any, ...]:
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"bench transfer: expected {kind!r} from the receiver, got {msg!r}")
    return msg


def measure(blocks: int, block_bytes: int, reps: int, seed: int = 0, timeout: float = 60.0,
            threads: int = 1) -> dict[str, Any]:
    """Run the bench in two fresh processes; returns the result dict (raises on mismatch)."""
    import multiprocessing as mp

    if blocks < 1 or block_bytes < 1 or reps < 1:
        raise ValueError("--blocks, --block-bytes and --reps must be >= 1")
    args = {"blocks": blocks, "block_bytes": block_bytes, "reps": reps, "seed": seed, "timeout": timeout,
            "threads": threads}
    ctx = mp.get_context("spawn")
    main_end, snd_end = ctx.Pipe()
    s2r_a, s2r_b = ctx.Pipe()
    rcv = ctx.Process(target=_receiver, args=(s2r_b, args), daemon=True)
    snd = ctx.Process(target=_sender, args=(snd_end, s2r_a, args), daemon=True)
    rcv.start()
    snd.start()
    try:
        deadline = time.monotonic() + timeout + 30 + reps * 4 * len(METHODS) * 2
        while not main_end.poll(0.5):
            if not snd.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bench transfer: sender ended (exit code {snd.exitcode}) or timed out")
        out = main_end.recv()
        if "error" in out:
            raise RuntimeError(out["error"])
        out.update(blocks=blocks, block_bytes=block_bytes, reps=reps,
                   ucx_tls=os.environ.get("UCX_TLS", "default"))
        return out
    finally:
        for p in (snd, rcv):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


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
