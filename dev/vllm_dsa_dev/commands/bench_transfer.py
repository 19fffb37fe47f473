"""``vllm-dsa bench transfer``: NIXL scattered runs vs bounce vs the gate, two real processes.

A sender and a receiver process (multiprocessing spawn) each hold a pool of ``2 * blocks`` blocks of
``block_bytes``; the same ``blocks`` random blocks move four ways, interleaved rep by rep:

- ``contiguous``: one run of ``blocks * block_bytes`` (the ceiling),
- ``scattered``: one descriptor per run (runs after merging),
- ``bounce``: gather into the staging arena + one write + receiver scatter,
- ``auto``: whatever :class:`BounceGate` chooses (``auto_path``).

The two processes are :func:`vllm_dsa_dev.harness.pair.run_pair`'s producer and consumer. A time
is from the sender's start until the receiver reported completion (data landed and, for bounce,
scattered) over the control channel; its latency is in every column alike. After every rep the receiver
compares all received bytes with what was sent and the bench fails loudly on a difference.
UCX_TLS from the environment applies (e.g. ``UCX_TLS=tcp``).

With ``--src-block-size``/``--dst-block-size`` (or ``--block-sizes``) the request is one of a model's page
tables instead (default: the GLM-5.2-shaped example, one rank each side): P with ``Bp``-token blocks, D
with ``Bd``-token blocks, runs from :meth:`PeerPlan.runs` for ``--tokens`` tokens (P's and D's blocks
shuffled), moved ``direct`` (one descriptor per run after merging), ``bounce`` (gather, ONE write,
scatter) and ``auto``, side by side with the equal-size cases of the same sizes, in one process pair.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_dsa_dev.harness.pair import (
    ConsumerSide,
    PairSpec,
    ProducerSide,
    RemoteConsumer,
    SideSpec,
    run_pair,
)

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.gate import BounceGate
    from vllm_dsa_dev.harness.paths.sends import Send

METHODS = ("contiguous", "scattered", "bounce", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI flags."""
    parser.add_argument("--blocks", type=int, default=4096, help="blocks moved (default 4096)")
    parser.add_argument("--block-bytes", type=int, default=576, help="bytes per block (default 576)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per method (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="random block choice and data")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per transfer before failing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object (keys: see below)")
    g = parser.add_argument_group("different block sizes (a model's page tables instead of synthetic blocks)")
    g.add_argument("--src-block-size", type=int, help="P's tokens per block (with --dst-block-size)")
    g.add_argument("--dst-block-size", type=int, help="D's tokens per block (with --src-block-size)")
    g.add_argument("--block-sizes", metavar="P:D,...", help="several pairs, e.g. 64:32,32:64 (the equal-size "
                   "case of every size given is added)")
    g.add_argument("--model", default=str(EXAMPLE), help="model directory or config.json (default: the "
                   "GLM-5.2-shaped example)")
    g.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request (default 1024)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8_ds_mla"), default="auto",
                   help="auto: bf16 latent, as on CPU (default)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = JSON_KEYS


EXAMPLE = Path(str(importlib.resources.files("vllm_dsa_connector") / "examples" / "glm5_2_shape.json"))
JSON_KEYS = """JSON keys (--json), synthetic blocks: contiguous_ms, scattered_ms, bounce_ms, auto_ms (medians per
request), min_ms, auto_path, phases_ms, gather_ms, scatter_ms, runs, total_bytes, profile, gate_reason,
blocks, block_bytes, reps, ucx_tls.
With block sizes: model, tokens, reps, ucx_tls, kv_cache_dtype and "cases", one object per P:D pair:
  src_block_size, dst_block_size   tokens per block on P and on D
  descriptors     direct path: runs after merging = NIXL descriptors of the one WRITE
  bounce_writes   bounce path: writes on the wire per peer (1)
  bytes           bytes per request (every layer, MLA rows and indexer values/scales)
  direct_ms, bounce_ms, auto_ms   median ms per request, send until D reported completion
  gather_ms, scatter_ms           bounce's relayout: P's gather, D's scatter (median ms)
  auto_path, gate_reason          what the gate chose and why"""


def _layout(blocks: int, block_bytes: int, seed: int) -> tuple[int, Any, Any]:
    """(pool bytes, the scattered runs after merging, the one contiguous run) of the request."""
    import numpy as np

    from vllm_dsa_connector.core.plan.runs import Runs

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
    from vllm_dsa_connector.core.transfer.copy.local_copy import scatter

    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        scatter(side.arena.buffer, side.pool, side.runs[key])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _relayout_row(side: ProducerSide, runs: Runs, key: str, reps: int, gate: BounceGate) -> dict[str, Any]:
    """The per-case columns every result row shares (ms rounded to the microsecond): bounce's relayout cost,
    P's ``gather_ms`` of ``runs`` and D's ``scatter_ms`` over its ``runs[key]`` (medians of ``reps``), and
    ``gate_reason``, why :class:`BounceGate` picks its path for the merged request."""
    from vllm_dsa_connector.core.transfer.copy.local_copy import gather

    d = side.consumer
    assert d is not None
    gts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gather(side.pool, runs, side.arena.buffer)
        gts.append(time.perf_counter() - t0)
    return {
        "gather_ms": round(statistics.median(gts) * 1e3, 3),
        "scatter_ms": round(d.call(_time_scatter, key=key, reps=reps) * 1e3, 3),
        "gate_reason": gate.decision(runs.merged(), merged=True).reason,
    }


def _check_landed(d: RemoteConsumer, send: Send, method: str, what: str) -> None:
    """RuntimeError unless D received exactly what was sent and a ``bounce`` send really bounced."""
    if not d.verified():
        raise RuntimeError(f"bench transfer: received bytes differ ({what})")
    if method == "bounce" and send.path != "bounce":
        raise RuntimeError(f"bench transfer: bounce path fell back: {send.reason}")


def _drive(side: ProducerSide, args: dict[str, Any]) -> dict[str, Any]:
    """On P: every method, interleaved rep by rep, timed from the send to D's DONE; bytes verified."""
    from vllm_dsa_connector.core.transfer.gate import BounceGate
    from vllm_dsa_dev.harness.paths.sender import BounceSender

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
            _check_landed(d, send, method, f"{method}, rep {rep}")
            if rep:
                times[method].append(dt)
                phases[method].append((t1 - t0, t2 - t1, t0 + dt - t2))
                if method == "auto":
                    auto_paths.add(send.path)
    return {
        **{f"{m}_ms": statistics.median(times[m]) * 1e3 for m in METHODS},
        "min_ms": {m: round(min(times[m]) * 1e3, 3) for m in METHODS},  # for noisy hosts
        "auto_path": "/".join(sorted(auto_paths)),
        # Sender's view, medians in ms: [send() = gather + post, wait for the WRITE, receiver's
        # completion (incl. scatter) + the pipe's ack].
        "phases_ms": {m: [round(statistics.median(p[i] for p in phases[m]) * 1e3, 3) for i in range(3)]
                      for m in METHODS},
        **_relayout_row(side, scattered, "scattered", args["reps"], gate),
        "runs": scattered.num_runs,
        "total_bytes": scattered.total_bytes,
        "profile": gate.profile,
    }


def measure(blocks: int, block_bytes: int, reps: int, seed: int = 0, timeout: float = 60.0,
            threads: int = 1) -> dict[str, Any]:
    """Run the bench in two fresh processes (:func:`~vllm_dsa_dev.harness.pair.run_pair`); returns the
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


# -- different block sizes: a model's page tables ---------------------------------------------------------


def block_size_pairs(src: int | None, dst: int | None, spec: str | None) -> list[tuple[int, int]]:
    """The P:D pairs to measure (``--src/--dst-block-size`` and ``--block-sizes``), each size's equal-size
    pair added after them; ``ValueError`` naming a bad value."""
    pairs: list[tuple[int, int]] = []
    if (src is None) != (dst is None):
        raise ValueError("--src-block-size and --dst-block-size go together")
    if src is not None and dst is not None:
        pairs.append((src, dst))
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        try:
            a, b = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--block-sizes: {item!r} is not P:D (e.g. 64:32)") from None
        pairs.append((a, b))
    for a, b in pairs:
        if a < 1 or b < 1:
            raise ValueError(f"block sizes must be >= 1, got {a}:{b}")
    sizes = sorted({x for pair in pairs for x in pair}, reverse=True)
    return list(dict.fromkeys(pairs + [(x, x) for x in sizes]))


def block_size_case(model: str, bp: int, bd: int, tokens: int, seed: int, kv_cache_dtype: str = "auto"
                    ) -> tuple[int, int, Any]:
    """(P's pool bytes, D's pool bytes, the request's merged runs) for ``tokens`` tokens moved from a P with
    ``bp``-token blocks to a D with ``bd``-token blocks (one rank each; blocks shuffled in pools twice the
    request's size), from :meth:`PeerPlan.runs`."""
    import numpy as np

    from vllm_dsa_connector.connector.page_tables import build_offline
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

    n_p, n_d = -(-tokens // bp), -(-tokens // bd)
    (src,) = build_offline(model, block_size=bp, num_blocks=2 * n_p, kv_cache_dtype=kv_cache_dtype)
    (dst,) = build_offline(model, block_size=bd, num_blocks=2 * n_d, kv_cache_dtype=kv_cache_dtype)
    if len(src.pools) != 1 or len(dst.pools) != 1:
        raise ValueError(f"{model}: the bench moves one pool per side, the layout has {len(src.pools)} on P "
                         f"and {len(dst.pools)} on D")
    rng = np.random.default_rng(seed)
    peer = PeerPlan.build([src], [dst])
    ((_, _, runs),) = peer.runs(src.rank, dst.rank, rng.permutation(2 * n_p)[:n_p], rng.permutation(2 * n_d)[:n_d],
                                first_token=0, num_tokens=tokens)
    return src.pools[0].nbytes, dst.pools[0].nbytes, runs


def _drive_block_sizes(side: ProducerSide, args: dict[str, Any]) -> list[dict[str, Any]]:
    """On P: per case, direct/bounce/auto interleaved rep by rep (bytes verified), then gather/scatter."""
    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.gate import BounceGate
    from vllm_dsa_dev.harness.paths.sender import BounceSender

    d = side.consumer
    assert d is not None
    gate = BounceGate.from_config({})
    snd = BounceSender(side.engine, side.arena, gate)
    order_rng = random.Random(args["seed"])
    methods = ("direct", "bounce", "auto")
    out = []
    for case in args["cases"]:
        key = f"{case['src_block_size']}:{case['dst_block_size']}"
        runs = Runs(*case["runs"])
        d.runs(key, runs)
        times: dict[str, list[float]] = {m: [] for m in methods}
        auto_paths: set[str] = set()
        for rep in range(args["reps"] + 1):  # rep 0 warms up every path
            for method in order_rng.sample(methods, len(methods)):
                tag = f"{key}-{method}-{rep}".encode()
                slot = d.expect(tag, key, bounce=method != "direct")
                t0 = time.perf_counter()
                send = snd.send(side.peer, side.region, side.remote_region, runs, tag, slot=slot,
                                path=None if method == "auto" else method)
                snd.wait(send, args["timeout"])
                d.done()
                dt = time.perf_counter() - t0
                _check_landed(d, send, method, f"P{key.replace(':', ' -> D')}, {method}, rep {rep}")
                if rep:
                    times[method].append(dt)
                    if method == "auto":
                        auto_paths.add(send.path)
        merged = runs.merged()
        out.append({
            "src_block_size": case["src_block_size"], "dst_block_size": case["dst_block_size"],
            "descriptors": merged.num_runs, "bounce_writes": 1, "bytes": merged.total_bytes,
            **{f"{m}_ms": round(statistics.median(times[m]) * 1e3, 3) for m in methods},
            **_relayout_row(side, runs, key, args["reps"], gate),
            "auto_path": "/".join(sorted(auto_paths)),
        })
    return out


def measure_block_sizes(pairs: list[tuple[int, int]], *, model: str = str(EXAMPLE), tokens: int = 1024,
                        reps: int = 5, seed: int = 0, timeout: float = 60.0, threads: int = 1,
                        kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Every P:D pair of ``pairs`` in one process pair; the result dict (``cases`` in ``pairs`` order)."""
    if tokens < 1 or reps < 1 or not pairs:
        raise ValueError("--tokens and --reps must be >= 1 and at least one block-size pair given")
    cases: list[dict[str, Any]] = []
    p_bytes = d_bytes = request_bytes = 0
    for bp, bd in pairs:
        pb, db, runs = block_size_case(model, bp, bd, tokens, seed, kv_cache_dtype)
        p_bytes, d_bytes, request_bytes = max(p_bytes, pb), max(d_bytes, db), max(request_bytes, runs.total_bytes)
        cases.append({"src_block_size": bp, "dst_block_size": bd,
                      "runs": (runs.src_offsets, runs.dst_offsets, runs.lengths)})
    arena = max(1 << 20, request_bytes + 4096)
    spec = PairSpec(producer=SideSpec(pool_bytes=p_bytes, arena_bytes=arena, threads=threads),
                    consumer=SideSpec(pool_bytes=d_bytes, arena_bytes=arena, threads=threads),
                    seed=seed + 1, transfer_timeout_s=timeout)
    args = {"cases": cases, "reps": reps, "seed": seed, "timeout": timeout}
    results = run_pair(spec, _drive_block_sizes, args, timeout_s=timeout + 60 + reps * len(cases) * 3 * 5)
    return {"model": Path(model).stem if Path(model).is_file() else model, "tokens": tokens, "reps": reps,
            "kv_cache_dtype": kv_cache_dtype, "ucx_tls": os.environ.get("UCX_TLS", "default"), "cases": results}


def _run_block_sizes(args: argparse.Namespace) -> int:
    try:
        pairs = block_size_pairs(args.src_block_size, args.dst_block_size, args.block_sizes)
        out = measure_block_sizes(pairs, model=args.model, tokens=args.tokens, reps=args.reps, seed=args.seed,
                                  timeout=args.timeout, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype)
    except (RuntimeError, ValueError) as e:
        print(f"vllm-dsa bench transfer: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"{out['model']}: {out['tokens']} tokens per request, P and D blocks shuffled, kv_cache_dtype="
          f"{out['kv_cache_dtype']}, UCX_TLS={out['ucx_tls']}, medians of {out['reps']} (bytes verified every rep)")
    print("| P -> D | descriptors (direct) | bytes | direct_ms | bounce_ms (1 write) | gather_ms | scatter_ms "
          "| auto_ms | auto_path |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in out["cases"]:
        print(f"| {c['src_block_size']} -> {c['dst_block_size']} | {c['descriptors']:,} | {c['bytes']:,} | "
              f"{c['direct_ms']:.2f} | {c['bounce_ms']:.2f} | {c['gather_ms']:.2f} | {c['scatter_ms']:.2f} | "
              f"{c['auto_ms']:.2f} | {c['auto_path']} |")
    if args.json:
        print(json.dumps(out))
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench transfer``."""
    if args.src_block_size is not None or args.dst_block_size is not None or args.block_sizes:
        return _run_block_sizes(args)
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
