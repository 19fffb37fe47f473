"""GPU end-to-end check of the transport: one GLM-5.2-shaped request through every path of OUR transport.

Two processes (sender = prefill on --src-device, receiver = decode on --dst-device; one GPU by default),
NIXL UCX, VRAM -> VRAM. Per block (vLLM's BLHNC layout: all pages of one block are contiguous): 78 MLA
pages x 41,984 B + 21 indexer pages x 8,448 B = 3,452,160 B; the request has 594 scattered blocks on
each side (2.05 GB). The transfer is described per page (58,806 runs) and merged by ``Runs.merged``
(-> 593 runs). Paths (``--paths``):

  per_page_layer_major  one NIXL descriptor per (layer page, block) in NixlConnector's order
  per_page              the same descriptors block by block (NIXL merges list-adjacent contiguous ones)
  merged / direct       one descriptor per merged run (raw engine.write / BounceSender direct)
  bounce                gather into staging, ONE write, scatter on the receiver
  pipelined:K           bounce in K chunks: gather, WRITE and scatter of different chunks overlap
  ipc                   one kernel reads P's pages and writes D's pages through a CUDA IPC mapping
                        (launch plan cached on the request's runs, replayed from a CUDA graph; the
                        notification carries an interprocess event and leaves right after the launch)
  ipc_cold              the same with a new request's runs every rep (plan built, no graph)
  ipc_notify            the same with the notification only after the copy finished (the old signal)
  auto                  what the gate picks (``BounceGate.choose`` over direct/bounce/pipelined/ipc)

Timed end to end: from the sender's first call to the receiver's "done" (all data landed, scattered,
synchronised; the ack crosses a pipe), with phases: send (host: gathers / kernel launch + post), wait
(until the WRITEs are done / the kernel finished and the notification went out), receiver (scatter +
completion + ack). Every rep is verified byte for byte on the receiver. Then kernel-only numbers:
gather/scatter (Triton run copy and torch index ops) and the IPC single copy vs a device-to-device copy
of the same bytes (and, across GPUs, vs a plain torch peer copy: the NVLink copy bound).

    PYTHONPATH=. python bench/gpu_transfer.py [--reps 10] [--shapes 594,64,8] [--out results.json]
    PYTHONPATH=. python bench/gpu_transfer.py --src-device cpu --dst-device cpu --pool-blocks 64 \\
        --shapes 20 --mla-page-bytes 64 --idx-page-bytes 32   # a small smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

ALL_PATHS = (
    "per_page_layer_major",
    "per_page",
    "merged",
    "direct",
    "bounce",
    "pipelined:4",
    "pipelined:8",
    "ipc",
    "ipc_cold",
    "ipc_notify",
    "ipc_sm",
    "ipc_ce",
    "auto",
)
ONE_GPU_PATHS = "direct,bounce,pipelined:4,ipc,auto"


def page_runs(a: dict[str, Any], blocks: int | None = None) -> tuple[Any, int]:
    """Per-page runs for the request (src block i -> dst block i), and the block size in bytes."""
    from vllm_dsa_connector.transport import Runs

    n = int(a["blocks"] if blocks is None else blocks)
    rng = np.random.default_rng(a["seed"])
    sizes = [a["mla_page_bytes"]] * a["mla_pages"] + [a["idx_page_bytes"]] * a["idx_pages"]
    page_off = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
    page_len = np.asarray(sizes, np.int64)
    bb = int(page_len.sum())
    src_b = rng.choice(a["pool_blocks"], n, replace=False)
    dst_b = rng.choice(a["pool_blocks"], n, replace=False)
    src = (src_b[:, None] * bb + page_off[None, :]).reshape(-1)
    dst = (dst_b[:, None] * bb + page_off[None, :]).reshape(-1)
    lens = np.broadcast_to(page_len, (n, page_len.size)).reshape(-1)
    return Runs(src, dst, lens), bb


def layer_major(page: Any, blocks: int) -> Any:
    """The same page runs in NixlConnector's order: region (layer page) by region, every block in each.

    Memory-adjacent descriptors are then not list-adjacent, so NIXL cannot merge them.
    """
    from vllm_dsa_connector.transport import Runs

    def t(x: Any) -> Any:
        return x.reshape(blocks, -1).T.reshape(-1)

    return Runs(t(page.src_offsets), t(page.dst_offsets), t(page.lengths))


def fill(nbytes: int, device: str, seed: int) -> Any:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(nbytes // 8, dtype=torch.int64, device=device)
    out.random_(generator=g)
    return out.view(torch.uint8)


def sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


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


def recv(conn: Any, hot: bool) -> Any:
    """``conn.recv()``; with ``hot`` spin on ``poll`` first (the core never idles between transfers)."""
    if hot:
        while not conn.poll():
            pass
    return conn.recv()


def _set_device(dev: str) -> None:
    import torch

    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)


# -- receiver ----------------------------------------------------------------------------------------


def receiver(conn: Any, a: dict[str, Any]) -> None:
    import torch

    from vllm_dsa_connector.transport import (
        BounceReceiver,
        NixlEngine,
        Runs,
        StagingArena,
        export_region,
        gather,
    )

    try:
        dev = a["dst_device"]
        _set_device(dev)
        shapes = [int(x) for x in a["shapes"]]
        _, bb = page_runs(a, 1)
        pool = a["pool_blocks"] * bb
        eng = NixlEngine(f"rcv-{os.getpid()}", telemetry=True)
        dst = torch.zeros(pool, dtype=torch.uint8, device=dev)
        region = eng.register(dst)
        top = max(shapes) * bb
        rcv = BounceReceiver(eng, StagingArena(top + (8 << 20), device=dev))
        expected = fill(pool, dev, a["seed"])
        want_buf = torch.empty(top, dtype=torch.uint8, device=dev)
        got_buf = torch.empty(top, dtype=torch.uint8, device=dev)
        ipc = None
        if dev.startswith("cuda"):
            try:
                ipc = export_region(dst).to_dict()
            except Exception as e:
                print(f"[receiver] no IPC export: {e}", flush=True)
        conn.send((eng.metadata(), region.desc().to_dict(), ipc))
        eng.add_peer(conn.recv())
        page = runs = dst_runs = None
        while True:
            msg = recv(conn, a["hot"])
            if msg[0] == "stop":
                break
            if msg[0] == "shape":
                page, _ = page_runs(a, msg[1])
                runs = page.merged()
                dst_runs = Runs(runs.dst_offsets, runs.dst_offsets, runs.lengths)
                gather(expected, runs, want_buf)
                sync(dev)
                conn.send(("ok",))
                continue
            _, tag, staged = msg
            dst.zero_()
            sync(dev)
            (slot,) = rcv.expect(tag, dst, [page], bounce=staged)
            conn.send(("ready", slot.to_dict() if slot else None))
            rcv.wait(tag, 120.0)
            conn.send(("done", time.perf_counter()))  # CLOCK_MONOTONIC: comparable across processes
            n = runs.total_bytes
            gather(dst, dst_runs, got_buf)
            conn.send(("verified", bool(torch.equal(got_buf[:n], want_buf[:n]))))
        eng.close()
    except BaseException as e:
        conn.send(("error", f"receiver: {type(e).__name__}: {e}"))
        raise


# -- sender ------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def sender(conn: Any, rconn: Any, a: dict[str, Any]) -> None:

    from vllm_dsa_connector.transport import (
        PATHS,
        BounceGate,
        BounceSender,
        IpcUnavailable,
        NixlEngine,
        Runs,
        StagingArena,
        ce_available,
        enable_peer_access,
        encode_notif,
        link_between,
        open_region,
        plan_stats,
        trace_launches,
    )

    out: dict[str, Any] = {"shapes": {}}
    try:
        dev, ddev = a["src_device"], a["dst_device"]
        _set_device(dev)
        shapes = [int(x) for x in a["shapes"]]
        paths = [p for p in a["paths"].split(",") if p]
        _, bb = page_runs(a, 1)
        pool = a["pool_blocks"] * bb
        eng = NixlEngine(f"snd-{os.getpid()}", telemetry=True)
        src = fill(pool, dev, a["seed"])
        region = eng.register(src)
        top = max(shapes) * bb
        arena = StagingArena(top + (8 << 20), device=dev)
        rmeta, rdesc, ripc = rconn.recv()
        peer = eng.add_peer(rmeta)
        rconn.send(eng.metadata())
        mapped, link = None, a["link"]
        if ripc is not None and dev.startswith("cuda"):
            try:
                enable_peer_access(dev, ddev)
                mapped = open_region(ripc, dev)  # mapped in OUR GPU's context (peer access)
                if link == "auto":
                    link = link_between(dev, ripc["host"], ripc["uuid"])
            except IpcUnavailable as e:
                out["ipc_error"] = str(e)
        if link == "auto":
            link = "same_gpu" if dev == ddev and dev.startswith("cuda") else (
                "nvlink" if dev.startswith("cuda") else "cma")
        gate = BounceGate.from_config({}, device=dev, link=link)
        snd = BounceSender(eng, arena, gate)
        out.update(link=link, link_profile=repr(gate.link_profile), ipc=mapped is not None,
                   copy_impl=os.environ.get("VLLM_DSA_COPY_IMPL", "auto"))
        avail = tuple(p for p in PATHS if p != "ipc" or mapped is not None)
        trace = trace_launches(True)
        assert trace is not None

        for blocks in shapes:
            page, _ = page_runs(a, blocks)
            runs = page.merged()
            by_layer = layer_major(page, blocks)
            rconn.send(("shape", blocks))
            if rconn.recv()[0] != "ok":
                raise RuntimeError("receiver did not take the shape")
            total = runs.total_bytes
            d = gate.choose(runs, merged=True, paths=avail)
            res: dict[str, Any] = {
                "blocks": blocks, "page_runs": page.num_runs, "merged_runs": runs.num_runs,
                "total_bytes": total, "gate_path": d.path + (f":{d.chunks}" if d.path == "pipelined" else ""),
                "gate_reason": d.reason, "gate_estimates_us": dict(d.estimates), "paths": {},
            }
            print(f"[sender] shape {blocks} blocks: {page.num_runs} page runs -> {runs.num_runs} merged, "
                  f"{total / 1e9:.3f} GB; gate ({link}): {res['gate_path']}", flush=True)

            def one(path: str, tag: bytes, page: Any = page, runs: Any = runs,
                    by_layer: Any = by_layer) -> tuple[Any, ...]:
                kind, _, k = path.partition(":")
                staged = kind in ("bounce", "pipelined", "auto")
                rconn.send(("xfer", tag, staged))
                msg = recv(rconn, a["hot"])
                if msg[0] != "ready":
                    raise RuntimeError(str(msg))
                slot = msg[1]
                sync(dev)
                t0 = time.perf_counter()
                chunks = 1
                launch = float("nan")
                stages: list[float] = []
                if kind in ("per_page_layer_major", "per_page", "merged"):
                    posted = {"per_page": page, "merged": runs, "per_page_layer_major": by_layer}[kind]
                    x = eng.write(peer, region, rdesc, posted, encode_notif("direct", 0, tag))
                    t1 = time.perf_counter()
                    st = eng.wait(x, 120.0)
                    used = kind
                else:
                    if kind == "auto":
                        s = snd.send(peer, region, rdesc, page, tag, slot=slot, paths=avail, ipc=mapped)
                    elif kind.startswith("ipc"):
                        impl = {"ipc_sm": "triton", "ipc_ce": "ce"}.get(kind)
                        # ipc_cold: a new request's (merged) runs: no cached plan, no graph
                        posted = Runs(runs.src_offsets, runs.dst_offsets, runs.lengths) \
                            if kind == "ipc_cold" else page
                        signal = "notify" if kind == "ipc_notify" else None
                        s = snd.send(peer, region, rdesc, posted, tag, slot=slot, path="ipc", ipc=mapped,
                                     ipc_impl=impl, ipc_signal=signal)
                        kind = "ipc"
                    else:
                        s = snd.send(peer, region, rdesc, page, tag, slot=slot, path=kind,
                                     chunks=int(k) if k else None, ipc=mapped)
                    t1 = time.perf_counter()
                    if s.path == "ipc":
                        launch = s.launch_s
                        if len(trace) == 4:  # send preamble, plan lookup, to the launch, launch, rest
                            stages = [trace[0] - t0, trace[1] - trace[0], trace[2] - trace[1],
                                      trace[3] - trace[2], t1 - trace[3]]
                    st = snd.wait(s, 120.0)
                    used, chunks = s.path, s.chunks
                    if kind != "auto" and used != kind:
                        raise RuntimeError(f"{path} fell back to {used}: {s.reason}")
                t2 = time.perf_counter()
                done = recv(rconn, a["hot"])
                if done[0] != "done":
                    raise RuntimeError("receiver did not finish")
                t3 = time.perf_counter()
                ok = rconn.recv()
                if ok != ("verified", True):
                    raise RuntimeError(f"bytes differ on {path}: {ok}")
                label = used + (f":{chunks}" if used == "pipelined" else "")
                if used == "ipc":
                    label += f"({s.signal})"
                return (t3 - t0, t1 - t0, t2 - t1, label, st.desc_count, st.num_runs, launch,
                        done[1] - t0, stages)

            todo = [p for p in paths if not (p.startswith("ipc") and mapped is None)]
            if "ipc_ce" in todo and not ce_available():
                todo.remove("ipc_ce")
            got: dict[str, list[Any]] = {p: [] for p in todo}
            for rep in range(a["reps"] + 2):  # paths interleaved rep by rep: drift hits all alike
                for path in todo:
                    if path == "per_page_layer_major" and rep >= max(3, a["reps"] // 3) + 2:
                        continue
                    got[path].append(one(path, f"{blocks}-{path}-{rep}".encode()))
            for path in todo:
                rows = got[path][2:]
                med = _median([r[0] for r in rows])
                staged = [r[8] for r in rows if r[8]]
                res["paths"][path] = {
                    "median_ms": med * 1e3,
                    # end to end until the receiver completed (its clock), without the ack's pipe
                    "rcv_median_ms": _median([r[7] for r in rows]) * 1e3,
                    "launch_stages_us": [round(_median([x[i] for x in staged]) * 1e6, 1)
                                         for i in range(5)] if staged else [],
                    "min_ms": min(r[0] for r in rows) * 1e3,
                    "gb_per_s": total / med / 1e9,
                    "phases_ms": {
                        "send": _median([r[1] for r in rows]) * 1e3,
                        "wait": _median([r[2] for r in rows]) * 1e3,
                        "receiver": _median([r[0] - r[1] - r[2] for r in rows]) * 1e3,
                        "launch": _median([r[6] for r in rows]) * 1e3,  # ipc: host launch inside send
                    },
                    "used": sorted({r[3] for r in rows}),
                    "desc_count": sorted({r[4] for r in rows}),
                    "posted": sorted({r[5] for r in rows}),
                }
                p = res["paths"][path]
                print(f"[sender]   {path:22s} {p['median_ms']:9.3f} ms (rcv {p['rcv_median_ms']:.3f}) "
                      f"{p['gb_per_s']:7.1f} GB/s  "
                      f"send {p['phases_ms']['send']:.3f} (launch {p['phases_ms']['launch']:.3f} "
                      f"{p['launch_stages_us']}) "
                      f"wait {p['phases_ms']['wait']:.3f} "
                      f"recv {p['phases_ms']['receiver']:.3f}  used={p['used']} "
                      f"descCount={p['desc_count']}", flush=True)
            best = min((v["median_ms"], k) for k, v in res["paths"].items() if k != "auto")
            res["best_path"], res["best_ms"] = best[1], best[0]
            if "auto" in res["paths"]:
                res["auto_over_best"] = res["paths"]["auto"]["median_ms"] / best[0]
            best = min((v["rcv_median_ms"], k) for k, v in res["paths"].items() if k != "auto")
            res["rcv_best_path"], res["rcv_best_ms"] = best[1], best[0]
            if "auto" in res["paths"]:
                res["rcv_auto_over_best"] = res["paths"]["auto"]["rcv_median_ms"] / best[0]
            out["shapes"][str(blocks)] = res

        out["plan_stats"] = plan_stats()
        if mapped is not None:
            big, _ = page_runs(a, max(shapes))
            out["kernels"] = kernel_bench(src, mapped, big.merged(), a, dev != ddev)
        rconn.send(("stop",))
        eng.close()
        conn.send(out)
    except BaseException as e:
        import traceback

        out["error"] = f"sender: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        conn.send(out)
        raise


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


def tune(a: dict[str, Any]) -> dict[str, Any]:
    """Kernel-only numbers on the largest shape, in this process, before the two-process run.

    Device copy (the floor), gather / scatter (torch index ops and the Triton run copy, kernel time
    and per call), the scattered -> scattered single copy for each launch shape of :data:`SWEEP`
    (the best becomes ``VLLM_DSA_COPY_CONFIG`` for the transfer processes), the host cost of one
    launch, and the merge of the page runs (a per-request host cost).
    """
    import torch

    from vllm_dsa_connector.transport import CopyConfig, Runs, copy_runs, gather, scatter

    dev = a["src_device"]
    _set_device(dev)
    page, bb = page_runs(a, max(a["shapes"]))
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

    from vllm_dsa_connector.transport import CopyConfig, Runs, ce_available, copy_runs

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

    from vllm_dsa_connector.transport import Runs, copy_runs

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

    from vllm_dsa_connector.transport import Runs, copy_runs, gather, scatter

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


def summary(res: dict[str, Any]) -> str:
    lines = [f"link {res.get('link')} ipc={res.get('ipc')} {res.get('ipc_error', '')}"]
    for blocks, sh in res.get("shapes", {}).items():
        lines.append(f"shape {blocks} blocks ({sh['total_bytes'] / 1e9:.3f} GB, {sh['page_runs']} page runs, "
                     f"{sh['merged_runs']} merged): gate -> {sh['gate_path']}; best {sh['best_path']} "
                     f"{sh['best_ms']:.3f} ms; auto/best {sh.get('auto_over_best', float('nan')):.3f}")
        for p, v in sh["paths"].items():
            ph = v["phases_ms"]
            lines.append(f"  {p:22s} {v['median_ms']:9.3f} ms (rcv {v.get('rcv_median_ms', float('nan')):.3f}) "
                         f"{v['gb_per_s']:7.1f} GB/s  send {ph['send']:.3f} "
                         f"(launch {ph.get('launch', float('nan')):.3f}) wait {ph['wait']:.3f} "
                         f"recv {ph['receiver']:.3f}  used {v['used']} desc {v['desc_count']}")
    t = res.get("tune", {})
    if t:
        lines.append(f"device copy {t['copy_ms']:.3f} ms ({t['copy_tbps_rw']:.2f} TB/s r+w); merge of the page "
                     f"runs {t['merge_ms']:.2f} ms; best launch shape {t.get('best_config')}; host per launch "
                     f"{t.get('launch_host_ms', float('nan')):.3f} ms (cached plan; after 3 ms idle "
                     f"{t.get('launch_after_idle_host_ms', float('nan')):.3f}; new runs "
                     f"{t.get('launch_cold_host_ms', float('nan')):.3f} ms); scattered copy per call "
                     f"{t.get('scattered_call_ms', float('nan')):.3f} ms")
        for impl in ("index", "triton"):
            v = t.get(impl, {})
            if "gather_ms" in v:
                lines.append(f"  {impl}: gather {v['gather_vs_copy']:.3f} scatter {v['scatter_vs_copy']:.3f} of copy "
                             f"(per call {v['gather_call_vs_copy']:.3f} / {v['scatter_call_vs_copy']:.3f})")
            elif v:
                lines.append(f"  {impl}: {v}")
        for key, v in t.get("sweep", {}).items():
            lines.append(f"  sweep {key}: {v if isinstance(v, str) else ', '.join(f'{x} {y:.3f}' for x, y in v.items())}")
    k = res.get("kernels", {})
    if k:
        if "ipc_kernel_ms" in k:
            lines.append(f"  ipc kernel {k['ipc_kernel_ms']:.3f} ms = {k['ipc_kernel_gbps']:.0f} GB/s; "
                         f"sweep {k.get('ipc_sweep_gbps', {})}")
        if "split_gbps" in k:
            lines.append(f"  split across streams (GB/s, GPU time): {k['split_gbps']}")
        if "ipc_kernel_error" in k:
            lines.append(f"  ipc kernel error: {k['ipc_kernel_error']}")
        if "ipc_ce_ms" in k:
            lines.append(f"  ipc copy engine {k['ipc_ce_ms']:.3f} ms = {k['ipc_ce_gbps']:.0f} GB/s "
                         f"(per call {k['ipc_ce_call_ms']:.3f} ms)")
        elif "ipc_ce_error" in k:
            lines.append(f"  ipc copy engine error: {k['ipc_ce_error']}")
        if "peer_copy" in k:
            pc = k["peer_copy"]
            lines.append(f"  peer copy bound: torch {pc['torch_copy_ms']:.3f} ms = {pc['torch_copy_gbps']:.0f} GB/s;"
                         f" triton contiguous {pc['triton_contiguous_gbps']:.0f} GB/s")
            sh = res.get("shapes", {}).get(str(max(int(b) for b in res["shapes"])), {})
            if sh:
                auto = sh["paths"].get("auto", {}).get("median_ms", float("nan"))
                lines.append(f"GOALS ({sh['blocks']} blocks): gate {sh['gate_path']} {auto:.3f} ms = "
                             f"{auto / sh['best_ms']:.3f}x of best {sh['best_path']} {sh['best_ms']:.3f} ms "
                             f"(goal <= 1.05); best = {sh['best_ms'] / pc['torch_copy_ms']:.3f}x of the NVLink "
                             f"bound {pc['torch_copy_ms']:.3f} ms (goal <= 1.1)")
                if "rcv_best_ms" in sh:
                    ra = sh["paths"].get("auto", {}).get("rcv_median_ms", float("nan"))
                    lines.append(f"GOALS, end at the receiver's completion (no ack pipe): gate {ra:.3f} ms = "
                                 f"{ra / sh['rcv_best_ms']:.3f}x of best {sh['rcv_best_path']} "
                                 f"{sh['rcv_best_ms']:.3f} ms; best = {sh['rcv_best_ms'] / pc['torch_copy_ms']:.3f}x"
                                 f" of the bound")
    if "plan_stats" in res:
        lines.append(f"copy plans: {res['plan_stats']}")
    return "\n".join(lines)


def parser(doc: str, paths: str, src: str, dst: str, shapes: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--src-device", default=src)
    p.add_argument("--dst-device", default=dst)
    p.add_argument("--paths", default=paths, help=f"comma list of {', '.join(ALL_PATHS)}")
    p.add_argument("--link", default="auto", help="gate link (auto: from the IPC descriptor)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shapes", default=shapes, help="comma list of request sizes in blocks")
    p.add_argument("--blocks", type=int, default=594)
    p.add_argument("--pool-blocks", type=int, default=1400)
    p.add_argument("--mla-pages", type=int, default=78)
    p.add_argument("--mla-page-bytes", type=int, default=41984)
    p.add_argument("--idx-pages", type=int, default=21)
    p.add_argument("--idx-page-bytes", type=int, default=8448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=480.0)
    p.add_argument("--no-tune", action="store_true", help="skip the kernel sweep before the run")
    p.add_argument("--hot", action="store_true",
                   help="both processes spin on their pipes between transfers (no idle core before a send)")
    p.add_argument("--out", default="")
    return p


def run(a: dict[str, Any]) -> int:
    a["shapes"] = [int(x) for x in str(a["shapes"]).split(",") if x]
    odd = check_odd(a["src_device"])
    print("gather/scatter/copy_runs exact on", a["src_device"], odd, flush=True)
    tuned: dict[str, Any] = {}
    if a["src_device"].startswith("cuda") and not a.get("no_tune"):
        import torch

        tuned = tune(a)
        torch.cuda.empty_cache()
        print("tuned:", json.dumps(tuned), flush=True)
    ctx = mp.get_context("spawn")
    main_end, snd_end = ctx.Pipe()
    ra, rb = ctx.Pipe()
    procs = [ctx.Process(target=receiver, args=(rb, a)), ctx.Process(target=sender, args=(snd_end, ra, a))]
    for pr in procs:
        pr.start()
    res: dict[str, Any] = {"error": "timed out"}
    deadline = time.time() + a["timeout"]
    while time.time() < deadline:
        if main_end.poll(1.0):
            res = main_end.recv()
            break
        if not procs[1].is_alive():
            res = {"error": f"sender exited with {procs[1].exitcode}"}
            break
    for pr in procs:
        pr.join(15)
        if pr.is_alive():
            pr.kill()
    res["args"] = a
    res["odd_exact"] = odd
    res["tune"] = tuned
    if a["out"]:
        with open(a["out"], "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("shapes", "kernels", "tune", "args")}))
    print(summary(res), flush=True)
    return 0 if "error" not in res and all(odd.values()) else 1


def main() -> int:
    a = vars(parser(__doc__ or "", ONE_GPU_PATHS, "cuda:0", "cuda:0", "594,64,8").parse_args())
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
