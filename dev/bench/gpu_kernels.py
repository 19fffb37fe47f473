"""Kernel-only measurements of dev/bench/gpu_transfer.py (one process, no NIXL): copy / gather / scatter
kernels, launch shapes, the single copy through a CUDA IPC mapping and the NVLink copy bound, and an
exactness check of gather/scatter/copy_runs with odd offsets against numpy."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
from vllm_dsa_dev.harness.pair import fill, sync


def set_device(dev: str) -> None:
    """Make ``dev`` torch's current CUDA device (no-op on the CPU)."""
    import torch

    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)


def timed(fn: Any, device: str, reps: int) -> float:
    """Median seconds of ``fn`` (synchronised), after one warm-up."""
    ts = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def ev_ms(fn: Any, n: int = 15, sleep_cycles: int = 3_000_000) -> float:
    """Median milliseconds of ``fn`` between two CUDA events on the current stream (GPU time only).

    A ~1.5 ms GPU sleep (``sleep_cycles``) is queued first, so the host's launch work overlaps it and
    stays out.
    """
    import torch

    fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


SWEEP = (
    (64 << 10, 16 << 10, 8),
    (256 << 10, 16 << 10, 8),
    (1 << 20, 16 << 10, 8),
    (4 << 20, 16 << 10, 8),
    (1 << 20, 32 << 10, 8),
    (1 << 20, 8 << 10, 4),
    (1 << 20, 16 << 10, 4),
    (1 << 20, 32 << 10, 16),
)


def tune(a: dict[str, Any], page: Any, bb: int) -> dict[str, Any]:
    """Kernel-only numbers on the largest shape, in this process, before the two-process run.

    Device copy (the floor), gather / scatter (torch index ops and the Triton run copy, kernel time
    and per call), the scattered -> scattered single copy for each launch shape of :data:`SWEEP`
    (the best becomes ``VLLM_DSA_COPY_CONFIG`` for the transfer processes), the host cost of one
    launch, and the merge of the page runs (a per-request host cost).
    """
    import torch

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.copy.kernels import CopyConfig
    from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs, gather, scatter

    dev = a["src_device"]
    set_device(dev)
    t0 = time.perf_counter()
    runs = Runs(page.src_offsets, page.dst_offsets, page.lengths).merged()
    out: dict[str, Any] = {"merge_ms": (time.perf_counter() - t0) * 1e3, "bytes": runs.total_bytes}
    total = runs.total_bytes
    pool = a["pool_blocks"] * bb
    src = fill(pool, dev, a["seed"] + 1)
    other = torch.empty(pool, dtype=torch.uint8, device=dev)
    stage = torch.empty(total, dtype=torch.uint8, device=dev)
    self_runs = Runs(runs.src_offsets, runs.src_offsets, runs.lengths)
    cp = ev_ms(lambda: stage.copy_(src[:total]))
    out.update(copy_ms=cp, copy_tbps_rw=2 * total / cp / 1e9)
    reps = max(10, a["reps"])
    for impl in ("index", "triton"):
        try:
            g = ev_ms(lambda impl=impl: gather(src, runs, stage, impl=impl))
            sc = ev_ms(lambda impl=impl: scatter(stage, src, self_runs, impl=impl))
            gc = timed(lambda impl=impl: gather(src, runs, stage, impl=impl), dev, reps) * 1e3
            scc = timed(lambda impl=impl: scatter(stage, src, self_runs, impl=impl), dev, reps) * 1e3
            out[impl] = {"gather_ms": g, "scatter_ms": sc, "gather_vs_copy": cp / g,
                         "scatter_vs_copy": cp / sc, "gather_call_ms": gc, "scatter_call_ms": scc,
                         "gather_call_vs_copy": cp / gc, "scatter_call_vs_copy": cp / scc}
        except Exception as e:
            out[impl] = {"error": f"{type(e).__name__}: {e}"}
    sweep: dict[str, Any] = {}
    best = (float("inf"), "")
    for pb, bk, nw in SWEEP:
        cfg = CopyConfig(pb, bk, nw)
        key = f"{pb},{bk},{nw}"
        try:
            k = ev_ms(lambda cfg=cfg: copy_runs(src, other, runs, impl="triton", config=cfg))
            g = ev_ms(lambda cfg=cfg: copy_runs(src, stage, Runs(runs.src_offsets, runs.staging_offsets(),
                                                                 runs.lengths), impl="triton", config=cfg))
            sweep[key] = {"scattered_ms": k, "scattered_vs_copy": cp / k, "gather_vs_copy": cp / g}
            best = min(best, (k + g, key))
        except Exception as e:
            sweep[key] = f"{type(e).__name__}: {e}"
    out["sweep"] = sweep
    out["best_config"] = best[1]
    if best[1]:
        os.environ["VLLM_DSA_COPY_CONFIG"] = best[1]
        host = []
        for _ in range(20):  # host time of one launch (asynchronous; synchronised between calls)
            sync(dev)
            t0 = time.perf_counter()
            copy_runs(src, other, runs)
            host.append(time.perf_counter() - t0)
        sync(dev)
        out["launch_host_ms"] = statistics.median(host[2:]) * 1e3  # cached plan (graph replay)
        cold = []
        for _ in range(12):  # a new request's runs every call: plan, table upload, Triton launch
            fresh = Runs(runs.src_offsets, runs.dst_offsets, runs.lengths)
            sync(dev)
            t0 = time.perf_counter()
            copy_runs(src, other, fresh)
            cold.append(time.perf_counter() - t0)
        sync(dev)
        out["launch_cold_host_ms"] = statistics.median(cold[2:]) * 1e3
        idle = []
        for _ in range(12):  # the cached plan again, after 3 ms of host sleep (a core that idled)
            sync(dev)
            time.sleep(0.003)
            t0 = time.perf_counter()
            copy_runs(src, other, runs)
            idle.append(time.perf_counter() - t0)
        sync(dev)
        out["launch_after_idle_host_ms"] = statistics.median(idle[2:]) * 1e3
        out["scattered_call_ms"] = timed(lambda: copy_runs(src, other, runs), dev, reps) * 1e3
    return out  # the buffers go with this frame (run() empties the cache)


def kernel_bench(src: Any, mapped: Any, runs: Any, a: dict[str, Any], cross: bool) -> dict[str, Any]:
    """The single copy through the IPC mapping (GPU time); across GPUs also the NVLink copy bound."""
    import torch

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.copy.kernels import CopyConfig
    from vllm_dsa_connector.core.transfer.copy.local_copy import ce_available, copy_runs

    total = runs.total_bytes
    out: dict[str, Any] = {"bytes": total}
    reps = max(10, a["reps"])
    for impl in ("ce",) if cross else ():
        try:
            k = ev_ms(lambda impl=impl: copy_runs(src, mapped, runs, impl=impl))
            out[f"ipc_{impl}_ms"] = k
            out[f"ipc_{impl}_gbps"] = total / k / 1e6
            out[f"ipc_{impl}_call_ms"] = timed(lambda impl=impl: copy_runs(src, mapped, runs, impl=impl),
                                               a["src_device"], reps) * 1e3
        except Exception as e:
            out[f"ipc_{impl}_error"] = f"{type(e).__name__}: {e}"
    try:
        k = ev_ms(lambda: copy_runs(src, mapped, runs, impl="triton"))
        out.update(ipc_kernel_ms=k, ipc_kernel_gbps=total / k / 1e6)
        if cross:  # launch shapes for stores over NVLink
            sweep = {}
            for pb, bk, nw in ((256 << 10, 16 << 10, 8), (1 << 20, 16 << 10, 8),
                               (4 << 20, 32 << 10, 16), (1 << 20, 8 << 10, 4)):
                cfg = CopyConfig(pb, bk, nw)
                ms = ev_ms(lambda cfg=cfg: copy_runs(src, mapped, runs, impl="triton", config=cfg))
                sweep[f"{pb},{bk},{nw}"] = round(total / ms / 1e6, 1)
            out["ipc_sweep_gbps"] = sweep
    except Exception as e:
        out["ipc_kernel_error"] = f"{type(e).__name__}: {e}"
    if cross and ce_available():  # exploration: copy engines on several streams, SM kernel + DMAs
        out["split_gbps"] = split_bench(src, mapped, runs)
    if cross:  # the NVLink copy bound: a plain torch peer copy
        peer = torch.empty(total, dtype=torch.uint8, device=a["dst_device"])

        def both() -> None:
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(peer.device)

        ts = []
        for _ in range(reps + 1):
            both()
            t0 = time.perf_counter()
            peer.copy_(src[:total])
            both()
            ts.append(time.perf_counter() - t0)
        pc = statistics.median(ts[1:]) * 1e3
        pe = ev_ms(lambda: peer.copy_(src[:total]))
        one = Runs(np.array([0]), np.array([0]), np.array([total]))
        tk = ev_ms(lambda: copy_runs(src, peer, one, impl="triton"))
        out["peer_copy"] = {"torch_copy_ms": pc, "torch_copy_event_ms": pe,
                            "torch_copy_gbps": total / pc / 1e6,
                            "triton_contiguous_ms": tk, "triton_contiguous_gbps": total / tk / 1e6}
        del peer
    return out


def split_bench(src: Any, mapped: Any, runs: Any) -> dict[str, float]:
    """GPU-time GB/s of the scattered copy over NVLink split across streams: per-run copy-engine DMAs
    round-robin on k streams (``ce_xk``), and the Triton kernel on the main stream with every m-th run
    on copy engines beside it (``sm+ce_1/m``). Host issue hidden behind a ~5 ms GPU sleep."""
    import torch

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs

    total = runs.total_bytes
    main = torch.cuda.current_stream()
    side = [torch.cuda.Stream() for _ in range(4)]

    def sub(idx: Any) -> Any:
        return Runs(runs.src_offsets[idx], runs.dst_offsets[idx], runs.lengths[idx])

    def multi(parts: list[tuple[Any, str]]) -> None:
        start = torch.cuda.Event()
        start.record(main)
        for i, (r, impl) in enumerate(parts):
            st = main if impl == "triton" else side[i % len(side)]
            if st is not main:
                st.wait_event(start)
            with torch.cuda.stream(st):
                copy_runs(src, mapped, r, impl=impl)
            if st is not main:
                main.wait_stream(st)

    n = runs.num_runs
    every = np.arange(n)
    variants: dict[str, list[tuple[Any, str]]] = {
        "ce_x2": [(sub(every[i::2]), "ce") for i in range(2)],
        "ce_x4": [(sub(every[i::4]), "ce") for i in range(4)],
    }
    for m in (8, 4, 3):
        ce = every[::m]
        sm = np.setdiff1d(every, ce)
        variants[f"sm+ce_1/{m}"] = [(sub(sm), "triton"), (sub(ce), "ce")]
    ce = every[::4]
    sm = np.setdiff1d(every, ce)
    variants["sm+ce_1/4_x2"] = [(sub(sm), "triton"), (sub(ce[0::2]), "ce"), (sub(ce[1::2]), "ce")]
    out = {}
    for name, parts in variants.items():
        try:
            ms = ev_ms(lambda parts=parts: multi(parts), n=11, sleep_cycles=10_000_000)
            out[name] = round(total / ms / 1e6, 1)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    return out


def check_odd(device: str) -> dict[str, bool]:
    """gather/scatter/copy_runs on ``device`` with odd offsets/lengths against a numpy reference."""
    import torch

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs, gather, scatter

    rng = np.random.default_rng(1)
    out = {}
    impls = ("index", "triton") if device.startswith("cuda") else ("index",)
    for name, n, lmax, off, unit in (("odd", 3000, 999, 3, 1), ("int64", 3000, 64, 0, 8),
                                     ("w16", 3000, 64, 0, 16)):
        lens = rng.integers(1, lmax, n) * unit
        gaps = rng.integers(1, 40, n) * unit
        src = np.r_[0, np.cumsum((lens + gaps)[:-1])] + off
        dst = np.empty(n, np.int64)
        order = rng.permutation(n)
        dst[order] = np.r_[0, np.cumsum((lens[order] + gaps[order])[:-1])]
        runs = Runs(src, dst, lens)
        size = int(max(runs.src_extent(), runs.dst_extent()))
        host = torch.randint(0, 256, (size,), dtype=torch.uint8)
        idx = np.concatenate([np.arange(o, o + k) for o, k in zip(src, lens, strict=True)])
        didx = np.concatenate([np.arange(o, o + k) for o, k in zip(dst, lens, strict=True)])
        ref = np.zeros(size, np.uint8)
        ref[didx] = host.numpy()[idx]
        for impl in impls:
            stage = torch.empty(runs.total_bytes, dtype=torch.uint8, device=device)
            gather(host.to(device), runs, stage, impl=impl)
            ok_g = np.array_equal(stage.cpu().numpy(), host.numpy()[idx])
            dst_t = torch.zeros(size, dtype=torch.uint8, device=device)
            scatter(stage, dst_t, runs, impl=impl)
            one = torch.zeros(size, dtype=torch.uint8, device=device)
            copy_runs(host.to(device), one, runs, impl=impl)
            out[f"{name}/{impl}"] = bool(ok_g and np.array_equal(dst_t.cpu().numpy(), ref)
                                         and np.array_equal(one.cpu().numpy(), ref))
    return out
