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

The two processes are :func:`vllm_dsa_dev.harness.pair.run_pair`'s producer (this module's
driver) and consumer (the harness's one receiver loop). Timed end to end: from the sender's first call
to the receiver's DONE (all data landed, scattered, synchronised; the ack crosses the control channel), with phases: send (host: gathers / kernel launch + post), wait
(until the WRITEs are done / the kernel finished and the notification went out), receiver (scatter +
completion + ack). Every rep is verified byte for byte on the receiver. Then kernel-only numbers:
gather/scatter (Triton run copy and torch index ops) and the IPC single copy vs a device-to-device copy
of the same bytes (and, across GPUs, vs a plain torch peer copy: the NVLink copy bound): gpu_kernels.py;
the text summary: gpu_report.py. Without a GPU, ``--src-device cpu --dst-device cpu`` (below) runs the
same two-process path small.

    PYTHONPATH=. python dev/bench/gpu_transfer.py [--reps 10] [--shapes 594,64,8] [--out results.json]
    PYTHONPATH=. python dev/bench/gpu_transfer.py --src-device cpu --dst-device cpu --pool-blocks 64 \\
        --shapes 20 --mla-page-bytes 64 --idx-page-bytes 32   # a small smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels import check_odd, kernel_bench, tune  # noqa: E402
from gpu_report import summary  # noqa: E402
from vllm_dsa_dev.harness.pair import PairSpec, ProducerSide, SideSpec, run_pair, sync  # noqa: E402

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
RAW = ("per_page_layer_major", "per_page", "merged")  # engine.write of the descriptors as listed


def page_runs(a: dict[str, Any], blocks: int | None = None) -> tuple[Any, int]:
    """Per-page runs for the request (src block i -> dst block i), and the block size in bytes."""
    from vllm_dsa_connector.core.plan.runs import Runs

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
    from vllm_dsa_connector.core.plan.runs import Runs

    def t(x: Any) -> Any:
        return x.reshape(blocks, -1).T.reshape(-1)

    return Runs(t(page.src_offsets), t(page.dst_offsets), t(page.lengths))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    """P's side of the run (inside the harness's producer process): the sender, the gate, the IPC mapping."""

    def __init__(self, side: ProducerSide, a: dict[str, Any]) -> None:
        from vllm_dsa_dev.harness.paths.links import PATHS, PathChooser, link_between
        from vllm_dsa_dev.harness.paths.sender import BounceSender

        from vllm_dsa_connector.core.transfer.copy.launches import trace_launches
        from vllm_dsa_connector.core.transfer.gate import BounceGate
        from vllm_dsa_connector.core.transfer.ipc import (
            IpcUnavailable,
            enable_peer_access,
            open_region,
        )

        self.side, self.a = side, a
        self.dev, ddev = a["src_device"], a["dst_device"]
        self.out: dict[str, Any] = {"shapes": {}}
        self.mapped, link, ripc = None, a["link"], side.remote_ipc
        if ripc is not None and self.dev.startswith("cuda"):
            try:
                enable_peer_access(self.dev, ddev)
                self.mapped = open_region(ripc, self.dev)  # mapped in OUR GPU's context (peer access)
                if link == "auto":
                    link = link_between(self.dev, ripc["host"], ripc["uuid"])
            except IpcUnavailable as e:
                self.out["ipc_error"] = str(e)
        if link == "auto":
            link = "same_gpu" if self.dev == ddev and self.dev.startswith("cuda") else (
                "nvlink" if self.dev.startswith("cuda") else "cma")
        self.gate = PathChooser(BounceGate.from_config({}, device=self.dev), link=link)
        self.snd = BounceSender(side.engine, side.arena, self.gate)
        self.out.update(link=link, link_profile=repr(self.gate.link_profile), ipc=self.mapped is not None,
                        copy_impl=os.environ.get("VLLM_DSA_COPY_IMPL", "auto"))
        self.avail = tuple(p for p in PATHS if p != "ipc" or self.mapped is not None)
        self.trace = trace_launches(True)
        assert self.trace is not None

    def one(self, path: str, tag: bytes, key: str, page: Any, runs: Any, by_layer: Any) -> tuple[Any, ...]:
        """One transfer of the request over ``path``, verified on D; its timings (see :meth:`shape`)."""
        from vllm_dsa_connector.core.plan.runs import Runs
        from vllm_dsa_connector.core.transfer.notices import encode_notif

        side, d, dev = self.side, self.side.consumer, self.dev
        assert d is not None
        kind, _, k = path.partition(":")
        slot = d.expect(tag, key, bounce=kind in ("bounce", "pipelined", "auto"))
        sync(dev)
        t0 = time.perf_counter()
        chunks, launch, stages, s = 1, float("nan"), [], None
        if kind in RAW:
            posted = {"per_page": page, "merged": runs, "per_page_layer_major": by_layer}[kind]
            x = side.engine.write(side.peer, side.region, side.remote_region, posted, encode_notif("direct", 0, tag))
            t1 = time.perf_counter()
            st = side.engine.wait(x, 120.0)
            used = kind
        else:
            common = {"slot": slot, "ipc": self.mapped}
            if kind == "auto":
                s = self.snd.send(side.peer, side.region, side.remote_region, page, tag, paths=self.avail, **common)
            elif kind.startswith("ipc"):
                # ipc_cold: a new request's (merged) runs: no cached plan, no graph
                posted = Runs(runs.src_offsets, runs.dst_offsets, runs.lengths) if kind == "ipc_cold" else page
                s = self.snd.send(side.peer, side.region, side.remote_region, posted, tag, path="ipc",
                                  ipc_impl={"ipc_sm": "triton", "ipc_ce": "ce"}.get(kind),
                                  ipc_signal="notify" if kind == "ipc_notify" else None, **common)
                kind = "ipc"
            else:
                s = self.snd.send(side.peer, side.region, side.remote_region, page, tag, path=kind,
                                  chunks=int(k) if k else None, **common)
            t1 = time.perf_counter()
            tr = self.trace
            if s.path == "ipc":
                launch = s.launch_s
                if len(tr) == 4:  # send preamble, plan lookup, to the launch, launch, rest
                    stages = [tr[0] - t0, tr[1] - tr[0], tr[2] - tr[1], tr[3] - tr[2], t1 - tr[3]]
            st = self.snd.wait(s, 120.0)
            used, chunks = s.path, s.chunks
            if kind != "auto" and used != kind:
                raise RuntimeError(f"{path} fell back to {used}: {s.reason}")
        t2 = time.perf_counter()
        t_rcv = d.done()
        t3 = time.perf_counter()
        if not d.verified():
            raise RuntimeError(f"bytes differ on {path}")
        label = used + (f":{chunks}" if used == "pipelined" else "")
        if used == "ipc" and s is not None:
            label += f"({s.signal})"
        return (t3 - t0, t1 - t0, t2 - t1, label, st.desc_count, st.num_runs, launch, t_rcv - t0, stages)

    def shape(self, blocks: int, paths: list[str]) -> dict[str, Any]:
        """Every path on a request of ``blocks`` blocks, interleaved rep by rep; medians per path."""
        from vllm_dsa_connector.core.transfer.copy.local_copy import ce_available

        a, d = self.a, self.side.consumer
        assert d is not None
        page, _ = page_runs(a, blocks)
        runs = page.merged()
        by_layer = layer_major(page, blocks)
        key = str(blocks)
        d.runs(key, page)
        total = runs.total_bytes
        dec = self.gate.choose(runs, merged=True, paths=self.avail)
        res: dict[str, Any] = {
            "blocks": blocks, "page_runs": page.num_runs, "merged_runs": runs.num_runs,
            "total_bytes": total, "gate_path": dec.path + (f":{dec.chunks}" if dec.path == "pipelined" else ""),
            "gate_reason": dec.reason, "gate_estimates_us": dict(dec.estimates), "paths": {},
        }
        print(f"[sender] shape {blocks} blocks: {page.num_runs} page runs -> {runs.num_runs} merged, "
              f"{total / 1e9:.3f} GB; gate ({self.out['link']}): {res['gate_path']}", flush=True)
        todo = [p for p in paths if not (p.startswith("ipc") and self.mapped is None)]
        if "ipc_ce" in todo and not ce_available():
            todo.remove("ipc_ce")
        got: dict[str, list[Any]] = {p: [] for p in todo}
        for rep in range(a["reps"] + 2):  # paths interleaved rep by rep: drift hits all alike
            for path in todo:
                if path == "per_page_layer_major" and rep >= max(3, a["reps"] // 3) + 2:
                    continue
                got[path].append(self.one(path, f"{blocks}-{path}-{rep}".encode(), key, page, runs, by_layer))
        for path in todo:
            res["paths"][path] = p = path_stats(got[path][2:], total)
            print(f"[sender]   {path:22s} {p['median_ms']:9.3f} ms (rcv {p['rcv_median_ms']:.3f}) "
                  f"{p['gb_per_s']:7.1f} GB/s  send {p['phases_ms']['send']:.3f} (launch "
                  f"{p['phases_ms']['launch']:.3f} {p['launch_stages_us']}) wait {p['phases_ms']['wait']:.3f} "
                  f"recv {p['phases_ms']['receiver']:.3f}  used={p['used']} descCount={p['desc_count']}", flush=True)
        for prefix, col in (("", "median_ms"), ("rcv_", "rcv_median_ms")):
            best = min((v[col], k) for k, v in res["paths"].items() if k != "auto")
            res[f"{prefix}best_path"], res[f"{prefix}best_ms"] = best[1], best[0]
            if "auto" in res["paths"]:
                res[f"{prefix}auto_over_best"] = res["paths"]["auto"][col] / best[0]
        return res


def path_stats(rows: list[tuple[Any, ...]], total: int) -> dict[str, Any]:
    """Medians of one path's rows (end to end, at the receiver, phases, launch stages) and what was used."""
    med = _median([r[0] for r in rows])
    staged = [r[8] for r in rows if r[8]]
    return {
        "median_ms": med * 1e3,
        # end to end until the receiver completed (its clock), without the ack's channel
        "rcv_median_ms": _median([r[7] for r in rows]) * 1e3,
        "launch_stages_us": [round(_median([x[i] for x in staged]) * 1e6, 1) for i in range(5)] if staged else [],
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


def drive(side: ProducerSide, a: dict[str, Any]) -> dict[str, Any]:
    """The harness driver (P): every shape and path, then the kernel numbers through the IPC mapping."""
    from vllm_dsa_connector.core.transfer.copy.launches import plan_stats

    b = Bench(side, a)
    paths = [p for p in a["paths"].split(",") if p]
    for blocks in a["shapes"]:
        b.out["shapes"][str(blocks)] = b.shape(int(blocks), paths)
    b.out["plan_stats"] = plan_stats()
    if b.mapped is not None:
        big, _ = page_runs(a, max(a["shapes"]))
        b.out["kernels"] = kernel_bench(side.pool, b.mapped, big.merged(), a, b.dev != a["dst_device"])
    return b.out


def parser(doc: str, paths: str, src: str, dst: str, shapes: str) -> argparse.ArgumentParser:
    """The command line of gpu_transfer.py and gpu_two_gpu.py (defaults differ)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0], epilog="\n".join(doc.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="both processes spin on their channel between transfers (no idle core before a send)")
    p.add_argument("--out", default="")
    return p


def run(a: dict[str, Any]) -> int:
    """Kernel checks, the optional sweep, then the two-process run; prints JSON and the summary."""
    a["shapes"] = [int(x) for x in str(a["shapes"]).split(",") if x]
    for dev in (a["src_device"], a["dst_device"]):
        if dev.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                print(f"{dev} requested but CUDA is not available; for a small CPU run see --help", file=sys.stderr)
                return 2
    odd = check_odd(a["src_device"])
    print("gather/scatter/copy_runs exact on", a["src_device"], odd, flush=True)
    tuned: dict[str, Any] = {}
    page, bb = page_runs(a, max(a["shapes"]))
    if a["src_device"].startswith("cuda") and not a.get("no_tune"):
        import torch

        tuned = tune(a, page, bb)
        torch.cuda.empty_cache()
        print("tuned:", json.dumps(tuned), flush=True)
    arena = max(a["shapes"]) * bb + (8 << 20)
    pool = a["pool_blocks"] * bb
    spec = PairSpec(
        producer=SideSpec(a["src_device"], pool, arena, threads=None, telemetry=True),
        consumer=SideSpec(a["dst_device"], pool, arena, threads=None, telemetry=True, ipc=True),
        seed=a["seed"], transfer_timeout_s=120.0, hot=a["hot"])
    try:
        res: dict[str, Any] = run_pair(spec, drive, a, timeout_s=a["timeout"])
    except RuntimeError as e:
        res = {"error": str(e)}
    res.update(args=a, odd_exact=odd, tune=tuned)
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
