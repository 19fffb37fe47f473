"""Two-GPU transfer run: one GLM-5.2-shaped request from GPU 0 (prefill) to GPU 1 (decode) over NIXL UCX.

Sender process on cuda:0, receiver on cuda:1, VRAM -> VRAM WRITE of 594 scattered blocks in vLLM's
block-outermost layout (78 MLA pages x 41,984 B + 21 indexer pages x 8,448 B per block), three ways with
our transport:
  per_page_layer_major  one descriptor per (layer page, block) in NixlConnector's order (58,806)
  per_page  the same descriptors block by block (NIXL merges list-adjacent contiguous ones)
  merged    runs merged by memory adjacency on both sides (``Runs.merged``: one per block, ~594)
  bounce    gather into one staging region, ONE write, scatter on the receiver (``BounceSender``)
Every rep is verified byte for byte on the receiver. Prints medians, GB/s and NIXL descriptor counts.
Set UCX_PROTO_INFO=y to see what UCX selected.

    PYTHONPATH=. python bench/gpu_two_gpu.py [--reps 5] [--out results.json]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_transfer import fill, page_runs, sync  # noqa: E402  (same request shape and seeded data)

PATHS = ("per_page_layer_major", "per_page", "merged", "bounce")


def layer_major(page: Any, blocks: int) -> Any:
    """The same page runs in NixlConnector's order: region (layer page) by region, every block in each.

    Memory-adjacent descriptors are then not list-adjacent, so NIXL cannot merge them.
    """
    from vllm_dsa_connector.transport import Runs

    def t(x: Any) -> Any:
        return x.reshape(blocks, -1).T.reshape(-1)

    return Runs(t(page.src_offsets), t(page.dst_offsets), t(page.lengths))


def receiver(conn: Any, a: dict[str, Any]) -> None:
    import torch

    from vllm_dsa_connector.transport import BounceReceiver, NixlEngine, Runs, StagingArena, gather

    try:
        dev = a["dst_device"]
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        page, bb = page_runs(a)
        runs = page.merged()
        pool = a["pool_blocks"] * bb
        eng = NixlEngine(f"x2-rcv-{os.getpid()}", telemetry=True)
        dst = torch.zeros(pool, dtype=torch.uint8, device=dev)
        region = eng.register(dst)
        rcv = BounceReceiver(eng, StagingArena(runs.total_bytes + (1 << 20), device=dev))
        want = torch.empty(runs.total_bytes, dtype=torch.uint8, device=dev)
        gather(fill(pool, dev, a["seed"]), runs, want)
        got = torch.empty_like(want)
        dst_runs = Runs(runs.dst_offsets, runs.dst_offsets, runs.lengths)
        conn.send((eng.metadata(), region.desc().to_dict()))
        eng.add_peer(conn.recv())
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, tag, path = msg
            dst.zero_()
            sync(dev)
            if path == "bounce":
                (slot,) = rcv.expect(tag, dst, [page], bounce=True)
                conn.send(("ready", slot.to_dict() if slot else None))
                rcv.wait(tag, 120.0)
            else:
                conn.send(("ready", None))
                deadline = time.time() + 120
                while not any(m == tag for _, m in eng.poll_notifications()):
                    if time.time() > deadline:
                        raise TimeoutError(f"no notification for {tag!r}")
            conn.send(("done",))
            gather(dst, dst_runs, got)
            conn.send(("verified", bool(torch.equal(got, want))))
        eng.close()
    except BaseException as e:
        conn.send(("error", f"receiver: {type(e).__name__}: {e}"))
        raise


def sender(conn: Any, rconn: Any, a: dict[str, Any]) -> None:
    import torch

    from vllm_dsa_connector.transport import BounceGate, BounceSender, NixlEngine, StagingArena

    out: dict[str, Any] = {}
    try:
        dev = a["src_device"]
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        page, bb = page_runs(a)
        runs = page.merged()
        by_layer = layer_major(page, a["blocks"])
        out.update(block_bytes=bb, page_runs=page.num_runs, merged_runs=runs.num_runs,
                   total_bytes=runs.total_bytes)
        eng = NixlEngine(f"x2-snd-{os.getpid()}", telemetry=True)
        src = fill(a["pool_blocks"] * bb, dev, a["seed"])
        region = eng.register(src)
        snd = BounceSender(eng, StagingArena(runs.total_bytes + (1 << 20), device=dev),
                           BounceGate.from_config({}, device=dev))
        rmeta, rdesc = rconn.recv()
        peer = eng.add_peer(rmeta)
        rconn.send(eng.metadata())
        for path in PATHS:
            ts, descs = [], set()
            for rep in range(a["reps"] + 1):
                tag = f"{path}-{rep}".encode()
                rconn.send(("xfer", tag, path))
                msg = rconn.recv()
                if msg[0] != "ready":
                    raise RuntimeError(str(msg))
                sync(dev)
                t0 = time.perf_counter()
                if path == "bounce":
                    s = snd.send(peer, region, rdesc, page, tag, slot=msg[1], path="bounce")
                    if s.path != "bounce":
                        raise RuntimeError(f"bounce fell back: {s.reason}")
                    st = snd.wait(s, 120.0)
                else:
                    posted = {"per_page": page, "merged": runs, "per_page_layer_major": by_layer}[path]
                    st = eng.wait(eng.write(peer, region, rdesc, posted, tag), 120.0)
                if rconn.recv()[0] != "done":
                    raise RuntimeError("receiver did not finish")
                dt = time.perf_counter() - t0
                ok = rconn.recv()
                if ok != ("verified", True):
                    raise RuntimeError(f"bytes differ on {path}: {ok}")
                if rep:
                    ts.append(dt)
                descs.add(st.desc_count)
            med = statistics.median(ts)
            out[path] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                         "gb_per_s": runs.total_bytes / med / 1e9, "desc_count": sorted(descs),
                         "posted_runs": {"per_page": page.num_runs, "per_page_layer_major": page.num_runs,
                                         "merged": runs.num_runs, "bounce": 1}[path]}
            print(f"[sender] {path}: {med * 1e3:.2f} ms median, {runs.total_bytes / med / 1e9:.1f} GB/s, "
                  f"descCount={sorted(descs)}", flush=True)
        rconn.send(("stop",))
        eng.close()
        conn.send(out)
    except BaseException as e:
        out["error"] = f"sender: {type(e).__name__}: {e}"
        conn.send(out)
        raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src-device", default="cuda:0")
    p.add_argument("--dst-device", default="cuda:1")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=594)
    p.add_argument("--pool-blocks", type=int, default=1400)
    p.add_argument("--mla-pages", type=int, default=78)
    p.add_argument("--mla-page-bytes", type=int, default=41984)
    p.add_argument("--idx-pages", type=int, default=21)
    p.add_argument("--idx-page-bytes", type=int, default=8448)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    a = vars(p.parse_args())
    ctx = mp.get_context("spawn")
    main_end, snd_end = ctx.Pipe()
    ra, rb = ctx.Pipe()
    procs = [ctx.Process(target=receiver, args=(rb, a)), ctx.Process(target=sender, args=(snd_end, ra, a))]
    for pr in procs:
        pr.start()
    res: dict[str, Any] = {"error": "timed out"}
    deadline = time.time() + 480
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
    print(json.dumps(res, indent=1))
    if a["out"]:
        with open(a["out"], "w") as f:
            json.dump(res, f, indent=1)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
