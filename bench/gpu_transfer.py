"""GPU end-to-end check of the transport: one GLM-5.2-shaped request through OUR bounce transport.

Two processes on one GPU (sender = prefill, receiver = decode), NIXL UCX, VRAM -> VRAM WRITE.
Per block (vLLM's BLHNC layout: all pages of one block are contiguous): 78 MLA pages x 41,984 B +
21 indexer pages x 8,448 B = 3,452,160 B; the request has 594 scattered blocks on each side.
The transfer is described per page (58,806 runs), merged by ``Runs.merged`` (-> ~594 runs), and the gate
(profile ``cuda``) picks the path. Timed end to end: sender gather + one WRITE + receiver scatter +
completion (the receiver's ack over a pipe). Also: the direct path (one descriptor per merged run), NIXL's
descriptor counts (telemetry), and gather/scatter vs a device-to-device copy of the same bytes.
Bytes are verified every rep (the receiver regenerates the sender's seeded data).

    PYTHONPATH=. python bench/gpu_transfer.py [--device cuda] [--reps 10] [--out results.json]
    PYTHONPATH=. python bench/gpu_transfer.py --device cpu --pool-blocks 64 --blocks 20 --mla-page-bytes 64 \
        --idx-page-bytes 32   # a small smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np


def page_runs(a: dict[str, Any]) -> tuple[Any, int]:
    """Per-page runs for the request (src block i -> dst block i), and the block size in bytes."""
    from vllm_dsa_connector.transport import Runs

    rng = np.random.default_rng(a["seed"])
    sizes = [a["mla_page_bytes"]] * a["mla_pages"] + [a["idx_page_bytes"]] * a["idx_pages"]
    page_off = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
    page_len = np.asarray(sizes, np.int64)
    bb = int(page_len.sum())
    src_b = rng.choice(a["pool_blocks"], a["blocks"], replace=False)
    dst_b = rng.choice(a["pool_blocks"], a["blocks"], replace=False)
    src = (src_b[:, None] * bb + page_off[None, :]).reshape(-1)
    dst = (dst_b[:, None] * bb + page_off[None, :]).reshape(-1)
    lens = np.broadcast_to(page_len, (a["blocks"], page_len.size)).reshape(-1)
    return Runs(src, dst, lens), bb


def fill(nbytes: int, device: str, seed: int) -> Any:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(nbytes // 8, dtype=torch.int64, device=device)
    out.random_(generator=g)
    return out.view(torch.uint8)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Any, device: str, reps: int) -> float:
    """Median seconds of ``fn`` (synchronised)."""
    ts = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def kernel_bench(src: Any, stage: Any, runs: Any, dev: str) -> dict[str, float]:
    """Kernel-only times (CUDA events, index prebuilt) of the index ops per view width, vs copy_."""
    import torch

    total = runs.total_bytes
    row = int(np.gcd.reduce(np.concatenate([runs.src_offsets, runs.lengths])))
    out: dict[str, float] = {}

    def ev(fn: Any, n: int = 20) -> float:
        fn()
        ts = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    out["copy_ms"] = ev(lambda: stage.copy_(src[:total]))
    for sub in (1, 8, 64):
        if row % sub or (row // sub) % 16:
            continue
        r = row // sub
        counts = runs.lengths // r
        first = runs.src_offsets // r
        starts = np.r_[0, np.cumsum(counts)[:-1]]
        idx = torch.from_numpy(np.repeat(first - starts, counts) + np.arange(int(counts.sum()))).to(dev)
        n_rows = src.numel() // r
        for w, dt in ((8, torch.int64), (16, torch.complex128)):
            s2 = src[: n_rows * r].view(dt).view(-1, r // w)
            o2 = stage[:total].view(dt).view(-1, r // w)
            out[f"index_select_row{r}_w{w}_ms"] = ev(lambda s2=s2, o2=o2, idx=idx: torch.index_select(
                s2, 0, idx, out=o2))
            out[f"index_copy_row{r}_w{w}_ms"] = ev(lambda s2=s2, o2=o2, idx=idx: s2.index_copy_(0, idx, o2))
    return out


def receiver(conn: Any, a: dict[str, Any]) -> None:
    import torch

    from vllm_dsa_connector.transport import BounceReceiver, NixlEngine, Runs, StagingArena, gather

    try:
        dev = a["device"]
        page, bb = page_runs(a)
        runs = page.merged()
        pool_bytes = a["pool_blocks"] * bb
        eng = NixlEngine(f"gpu-rcv-{a['seed']}", telemetry=True)
        dst = torch.zeros(pool_bytes, dtype=torch.uint8, device=dev)
        region = eng.register(dst)
        arena = StagingArena(runs.total_bytes + (1 << 20), device=dev)
        rcv = BounceReceiver(eng, arena, reserve_timeout_s=0.2)
        expected = fill(pool_bytes, dev, a["seed"])
        want = torch.empty(runs.total_bytes, dtype=torch.uint8, device=dev)
        gather(expected, runs, want)
        del expected
        got = torch.empty_like(want)
        dst_runs = Runs(runs.dst_offsets, runs.dst_offsets, runs.lengths)
        conn.send((eng.metadata(), region.desc().to_dict()))
        eng.add_peer(conn.recv())
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, tag, bounce = msg
            dst.zero_()
            sync(dev)
            slots = rcv.expect(tag, dst, [page], bounce=bounce)
            conn.send(("ready", slots[0].to_dict() if slots[0] else None))
            rcv.wait(tag, 60.0)
            conn.send(("done",))
            gather(dst, dst_runs, got)
            conn.send(("verified", bool(torch.equal(got, want))))
        eng.close()
    except BaseException as e:
        conn.send(("error", f"receiver: {type(e).__name__}: {e}"))
        raise


def sender(conn: Any, rconn: Any, a: dict[str, Any]) -> None:

    from vllm_dsa_connector.transport import (
        BounceGate,
        BounceSender,
        NixlEngine,
        Runs,
        StagingArena,
        gather,
        scatter,
    )

    out: dict[str, Any] = {}
    try:
        dev = a["device"]
        t0 = time.perf_counter()
        page, bb = page_runs(a)
        runs = page.merged()
        out.update(block_bytes=bb, page_runs=page.num_runs, merged_runs=runs.num_runs,
                   total_bytes=runs.total_bytes, merge_ms=(time.perf_counter() - t0) * 1e3)
        pool_bytes = a["pool_blocks"] * bb
        eng = NixlEngine(f"gpu-snd-{a['seed']}", telemetry=True)
        src = fill(pool_bytes, dev, a["seed"])
        region = eng.register(src)
        arena = StagingArena(runs.total_bytes + (1 << 20), device=dev)
        gate = BounceGate.from_config({}, device=dev)
        snd = BounceSender(eng, arena, gate)
        d = gate.decision(runs, merged=True)
        out.update(profile=gate.profile, gate_path=d.path, gate_reason=d.reason)
        rmeta, rdesc = rconn.recv()
        peer = eng.add_peer(rmeta)
        rconn.send(eng.metadata())

        def one(path: str | None, tag: bytes) -> tuple[float, Any, Any]:
            rconn.send(("xfer", tag, path != "direct"))
            msg = rconn.recv()
            if msg[0] != "ready":
                raise RuntimeError(str(msg))
            sync(dev)
            t0 = time.perf_counter()
            s = snd.send(peer, region, rdesc, page, tag, slot=msg[1], path=path)
            t1 = time.perf_counter()
            st = snd.wait(s, 60.0)
            t2 = time.perf_counter()
            if rconn.recv()[0] != "done":
                raise RuntimeError("receiver did not finish")
            dt = time.perf_counter() - t0
            phases.append((t1 - t0, t2 - t1, t0 + dt - t2))
            ok = rconn.recv()
            if ok != ("verified", True):
                raise RuntimeError(f"bytes differ ({path}): {ok}")
            return dt, s, st

        for label, path in (("auto", None), ("direct", "direct")):
            ts, stats, phases = [], None, []
            for rep in range(a["reps"] + 2):
                dt, s, st = one(path, f"{label}-{rep}".encode())
                if rep >= 2:
                    ts.append(dt)
                stats = (s, st)
            s, st = stats
            out[f"{label}_ms"] = statistics.median(ts) * 1e3
            ph = phases[2:]
            out[f"{label}_phases_ms"] = {
                "send(gather+post)": statistics.median(p[0] for p in ph) * 1e3,
                "wait(write done)": statistics.median(p[1] for p in ph) * 1e3,
                "receiver(scatter+ack)": statistics.median(p[2] for p in ph) * 1e3,
            }
            out[f"{label}_min_ms"] = min(ts) * 1e3
            out[f"{label}_path"] = s.path
            out[f"{label}_desc_count"] = st.desc_count
            out[f"{label}_nixl_xfer_us"] = st.xfer_us
            print(f"[sender] {label}: {out[f'{label}_ms']:.2f} ms median, path={s.path}, "
                  f"descCount={st.desc_count}", flush=True)
        rconn.send(("stop",))

        # Gather / scatter vs a device-to-device copy of the same bytes (same buffers).
        total = runs.total_bytes
        stage = arena.buffer[:total]
        self_runs = Runs(runs.src_offsets, runs.src_offsets, runs.lengths)
        reps = max(10, a["reps"])
        g = timed(lambda: gather(src, runs, stage), dev, reps)
        sc = timed(lambda: scatter(stage, src, self_runs), dev, reps)  # writes the same bytes back
        cp = timed(lambda: stage.copy_(src[:total]), dev, reps)
        g8 = timed(lambda: gather(src, runs, stage, max_width=8), dev, reps)
        sc8 = timed(lambda: scatter(stage, src, self_runs, max_width=8), dev, reps)
        out.update(gather_ms=g * 1e3, scatter_ms=sc * 1e3, copy_ms=cp * 1e3,
                   gather_vs_copy=cp / g, scatter_vs_copy=cp / sc,
                   gather_int64_vs_copy=cp / g8, scatter_int64_vs_copy=cp / sc8,
                   copy_tbps_rw=2 * total / cp / 1e12)
        out["kernels"] = kernel_bench(src, stage, runs, dev) if dev.startswith("cuda") else {}
        eng.close()
        conn.send(out)
    except BaseException as e:
        out["error"] = f"sender: {type(e).__name__}: {e}"
        conn.send(out)
        raise


def check_odd(device: str) -> dict[str, Any]:
    """gather/scatter on ``device`` with odd offsets/lengths (narrow views) against a numpy reference."""
    import torch

    from vllm_dsa_connector.transport import Runs, gather, scatter

    rng = np.random.default_rng(1)
    out = {}
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
        stage = torch.empty(runs.total_bytes, dtype=torch.uint8, device=device)
        gather(host.to(device), runs, stage)
        idx = np.concatenate([np.arange(o, o + k) for o, k in zip(src, lens, strict=True)])
        ok_g = np.array_equal(stage.cpu().numpy(), host.numpy()[idx])
        dst_t = torch.zeros(size, dtype=torch.uint8, device=device)
        scatter(stage, dst_t, runs)
        ref = np.zeros(size, np.uint8)
        ref[np.concatenate([np.arange(o, o + k) for o, k in zip(dst, lens, strict=True)])] = host.numpy()[idx]
        out[name] = bool(ok_g and np.array_equal(dst_t.cpu().numpy(), ref))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=594)
    p.add_argument("--pool-blocks", type=int, default=1400)
    p.add_argument("--mla-pages", type=int, default=78)
    p.add_argument("--mla-page-bytes", type=int, default=41984)
    p.add_argument("--idx-pages", type=int, default=21)
    p.add_argument("--idx-page-bytes", type=int, default=8448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    a = vars(args)
    odd = check_odd(args.device)
    print("gather/scatter exact on", args.device, odd, flush=True)
    ctx = mp.get_context("spawn")
    main_end, snd_end = ctx.Pipe()
    ra, rb = ctx.Pipe()
    pr = ctx.Process(target=receiver, args=(rb, a))
    ps = ctx.Process(target=sender, args=(snd_end, ra, a))
    pr.start()
    ps.start()
    res: dict[str, Any] = {}
    deadline = time.time() + 420
    while time.time() < deadline:
        if main_end.poll(1.0):
            res = main_end.recv()
            break
        if not ps.is_alive():
            res = {"error": f"sender exited with {ps.exitcode}"}
            break
    else:
        res = {"error": "timed out"}
    for proc in (ps, pr):
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    res["args"] = a
    res["odd_exact"] = odd
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
