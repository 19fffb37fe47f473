"""GPU load sweep: DSAConnector against vLLM's NixlConnector against one engine, through the proxy (issue 48, item 4).

Starts, at once on one GPU (``--kv-cache-memory-bytes`` each, so concurrent starts do not disturb each other's
memory profile): one engine without P/D (``single``) and, per connector, a prefill and a decode engine with
:mod:`vllm_dsa_connector.proxy.app` in front (``dsa``: DSAConnector; ``nixl``: NixlConnector; ``early``:
DSAConnector behind ``--early-registration``). Every engine has the KV probe worker extension. Then, per
concurrency level (``--concurrency``, e.g. 8,32,64), every contender in turn (the order rotates per level) runs
vLLM's own serving benchmark (``vllm.benchmarks.serve``: random prompts of ``--input-len`` tokens,
``--output-len`` tokens each within ``--output-range``, EOS ignored, greedy, at most that many in flight,
``--prompts-per-slot`` x the level requests; one seed per level, so every contender gets the same prompts,
and a fresh one per level, so no level hits an earlier one's prefix cache). Reported per contender and level:
requests completed / failed, output tokens/s, TTFT and ITL p50 / p99 (vLLM's figures, the client's clock, the
same span for all), and the connector's own counts (D's loads, failures, bytes).

Pages on sampled requests: while each run is under way (``--sample-after`` seconds in), ``--samples``
requests of the same length go directly to the contender's P and D (:func:`vllm_dsa_dev.harness.pages.pd_pages`:
D's pages of every full prompt block and layer against P's pages of that prefill request itself); the one
engine gets the same number of probes of a running request (the same stall for every contender, not judged).

    python dev/bench/gpu_load.py --model M --load-format dummy --concurrency 8,32,64

Prints a JSON line, writes ``$OUT/gpu_load.json`` and the engines' log tails when ``OUT`` is set; exit 1 when
a DSAConnector request failed, a D load failed or a sampled page differs (NixlConnector is reported, not
judged). ``--cpu`` runs the same on vLLM's CPU build (tiny model, float32): a dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dsa_dev.harness.client import metric, post_json, probe_running, scrape
from vllm_dsa_dev.harness.engines import proxy_cmd
from vllm_dsa_dev.harness.pages import pd_pages
from vllm_dsa_dev.harness.procs import Cluster, Proc, cluster, wait_healthy

BLOCK = 64
CONTENDERS = ("single", "dsa", "nixl", "early")
PROBE = ["--worker-extension-cls", "vllm_dsa_dev.kv_probe.KVProbe"]


@dataclass
class Contender:
    """One way of serving: its front URL (the proxy, or the one engine), its engines and processes."""

    name: str
    url: str
    p_url: str | None = None
    d_url: str | None = None
    procs: list[Proc] = field(default_factory=list)

    @property
    def connector(self) -> str | None:
        """``dsa``, ``nixl`` or None (the one engine)."""
        return None if self.name == "single" else ("nixl" if self.name == "nixl" else "dsa")


def _engine_cmd(args: argparse.Namespace, port: int, kv_config: dict[str, Any] | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--seed", "0", *PROBE]
    if not args.cpu:
        # five real-width engines share one GPU: vLLM's start-up check asks for gpu-memory-utilization of the
        # whole card free, so ask for little (the KV cache is sized by --kv-cache-memory-bytes), and no more
        # sequences than the sweep sends (the sampler's start-up buffers scale with it)
        cmd += ["--gpu-memory-utilization", "0.02", "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                "--max-num-seqs", str(args.max_num_seqs)]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if args.mode == "eager" or args.cpu:
        cmd.append("--enforce-eager")
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd


def _env(args: argparse.Namespace, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", **(extra or {})}
    if args.cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    return env


def start(c: Cluster, name: str, args: argparse.Namespace, base: int) -> Contender:
    """Start ``name``'s engines (and proxy) in ``c`` on ports ``base`` .. ``base+4``; returns at once."""
    if name == "single":
        proc = c.start("single", _engine_cmd(args, base, None), _env(args))
        return Contender(name, f"http://127.0.0.1:{base}", procs=[proc])
    p_url, d_url = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"
    if name == "nixl":
        cfg: dict[str, dict[str, Any]] = {
            r: {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}
            for r in ("P", "D")}
        envs = {"P": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 3)},
                "D": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 4)}}
    else:
        cfg = {r: {"kv_connector": "DSAConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                   "engine_id": f"{name}-{r}",
                   "kv_connector_extra_config": {"side_channel_port": base + 3 + k}}
               for k, (r, role) in enumerate((("P", "kv_producer"), ("D", "kv_consumer")))}
        envs = {"P": {}, "D": {}}
    procs = [c.start(f"{name}-{r}", _engine_cmd(args, base + k, cfg[r]), _env(args, envs[r]))
             for k, r in enumerate(("P", "D"))]
    extra = ["--early-registration"] if name == "early" else []
    procs.append(c.start(f"{name}-proxy", proxy_cmd(p_url, d_url, base + 2, extra), _env(args)))
    return Contender(name, f"http://127.0.0.1:{base + 2}", p_url, d_url, procs)


def kv_counts(ct: Contender) -> dict[str, float]:
    """The connector's counters on D (and P's transfer times): loads, failures, bytes."""
    if ct.connector is None:
        return {}
    assert ct.p_url and ct.d_url
    mp, md = scrape(ct.p_url), scrape(ct.d_url)
    if ct.connector == "dsa":
        out = {o: metric(md, "vllm:dsa_kv_requests_total", side="recv", outcome=o)
               for o in ("ok", "failed", "timeout", "expired")}
        out.update(bytes=metric(md, "vllm:dsa_kv_bytes_total", side="recv"),
                   recompute=metric(md, "vllm:dsa_kv_load_failures_total"),
                   xfer_s=metric(mp, "vllm:dsa_kv_transfer_seconds_sum"),
                   xfer_n=metric(mp, "vllm:dsa_kv_transfer_seconds_count"))
        return out
    return {"ok": metric(md, "vllm:nixl_xfer_time_seconds_count"),
            "failed": metric(md, "vllm:nixl_num_failed_transfers_total"),
            "bytes": metric(md, "vllm:nixl_bytes_transferred_sum"),
            "xfer_s": metric(md, "vllm:nixl_xfer_time_seconds_sum"),
            "xfer_n": metric(md, "vllm:nixl_xfer_time_seconds_count")}


def bench_args(url: str, args: argparse.Namespace, concurrency: int, seed: int) -> argparse.Namespace:
    """The namespace of vLLM's serving benchmark for one run, parsed by vLLM's own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "m",
        "--tokenizer", args.model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", json.dumps({"input": 0.0, "output": args.output_range}),
        "--num-prompts", str(concurrency * args.prompts_per_slot), "--max-concurrency", str(concurrency),
        "--temperature", "0", "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--ready-check-timeout-sec", "0",
    ])


def _sample(ct: Contender, args: argparse.Namespace, seed: int, stop: threading.Event) -> list[dict[str, Any]]:
    """``args.samples`` page checks (P/D) or running-request probes (the one engine) while the run is under way."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    if stop.wait(args.sample_after):
        return rows
    for k in range(args.samples):
        ids = [rng.randrange(100, 20000) for _ in range(args.input_len)]
        t0 = time.perf_counter()
        try:
            if ct.connector is None:
                (got,) = probe_running(ct.url, "m", ids, None, 300)
                row: dict[str, Any] = {"probed_blocks": len(got["digests"])}
            else:
                assert ct.p_url and ct.d_url
                row = pd_pages(ct.p_url, ct.d_url, "m", ids, BLOCK, timeout_s=300)
                row.pop("p_layers")
                row.pop("p_blocks")
                row.pop("d_blocks")
        except Exception as e:  # noqa: BLE001 - a failed sample is reported, the run goes on
            row = {"error": f"{type(e).__name__}: {e}"[:400]}
        row.update(sample=k, wall_s=round(time.perf_counter() - t0, 3))
        rows.append(row)
        print(f"[gpu_load] {ct.name} sample {k}: {row}", flush=True)
        if stop.is_set():
            break
    return rows


def _r(v: Any, nd: int = 2) -> float | None:
    return round(float(v), nd) if v is not None else None


def run_level(ct: Contender, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    """One contender at one concurrency: vLLM's serving benchmark, with page samples beside it."""
    from vllm.benchmarks.serve import main as vllm_bench_main

    seed = 1000 + concurrency
    k0 = kv_counts(ct)
    stop = threading.Event()
    samples: list[dict[str, Any]] = []
    sampler = threading.Thread(target=lambda: samples.extend(_sample(ct, args, seed + 7, stop)), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        res = vllm_bench_main(bench_args(ct.url, args, concurrency, seed))
    except Exception as e:  # noqa: BLE001 - vLLM's benchmark raises what it likes; the sweep goes on
        res = {"error": f"{type(e).__name__}: {e}"[:600]}
    wall = time.monotonic() - t0
    stop.set()
    sampler.join(600)
    time.sleep(1.5)  # the connectors' stats reach /metrics with an engine step
    k1 = kv_counts(ct)
    kv = {k: k1[k] - k0[k] for k in k0}
    errors = [e for e in res.get("errors") or [] if e]
    out: dict[str, Any] = {
        "concurrency": concurrency, "num_prompts": concurrency * args.prompts_per_slot,
        "completed": int(res.get("completed", 0)), "failed": int(res.get("failed", 0)),
        "duration_s": _r(res.get("duration"), 3), "output_tok_s": _r(res.get("output_throughput")),
        "total_tok_s": _r(res.get("total_token_throughput")), "request_per_s": _r(res.get("request_throughput"), 3),
        "total_output_tokens": int(res.get("total_output_tokens", 0)),
        **{f"{m}_{s}_ms": _r(res.get(f"{s if s != 'p50' else 'median'}_{m}_ms"))
           for m in ("ttft", "itl", "tpot", "e2el") for s in ("p50", "p99")},
        "wall_s": round(wall, 1), "errors": errors[:3], "error": res.get("error"),
    }
    if kv:
        out["kv"] = {k: (round(v, 6) if k == "xfer_s" else int(v)) for k, v in kv.items()}
        if kv.get("xfer_n"):
            out["kv"]["transfer_ms_mean"] = round(1e3 * kv["xfer_s"] / kv["xfer_n"], 3)
    out["samples"] = samples
    if ct.connector is not None:
        out["samples_pages_equal"] = sum(bool(s.get("pages_equal")) for s in samples)
    print(f"[gpu_load] {ct.name} c={concurrency}: " + json.dumps({k: v for k, v in out.items() if k != "samples"}),
          flush=True)
    return out


def judge(result: dict[str, Any]) -> list[str]:
    """What fails the run: a DSAConnector pair did not start, a request or a load failed, a sampled page
    differed."""
    bad = [f"{name} did not start: {why}"[:600] for name, why in result.get("not_started", {}).items()
           if name not in ("single", "nixl")]
    for name, levels in result["runs"].items():
        if name in ("single", "nixl"):
            continue
        for lv in levels:
            c = lv["concurrency"]
            if lv["failed"] or lv["completed"] < lv["num_prompts"] or lv.get("error"):
                bad.append(f"{name} c={c}: {lv['completed']}/{lv['num_prompts']} completed, {lv['failed']} failed "
                           f"{lv.get('error') or (lv['errors'][:1])}")
            kv = lv.get("kv", {})
            if kv.get("failed") or kv.get("timeout") or kv.get("expired") or kv.get("recompute"):
                bad.append(f"{name} c={c}: D's loads {kv}")
            if lv.get("samples_pages_equal") != len(lv["samples"]) or not lv["samples"]:
                bad.append(f"{name} c={c}: pages equal in {lv.get('samples_pages_equal')}/{len(lv['samples'])} "
                           f"samples: {[s.get('differing') or s.get('error') for s in lv['samples']]}"[:600])
    return bad


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per level, each P/D contender against the one engine (and DSAConnector against NixlConnector)."""
    out: dict[str, Any] = {}
    by = {name: {lv["concurrency"]: lv for lv in levels} for name, levels in result["runs"].items()}
    for c in sorted({c for levels in by.values() for c in levels}):
        row: dict[str, Any] = {}
        for name, levels in by.items():
            lv = levels.get(c)
            if lv:
                row[name] = {k: lv[k] for k in ("completed", "failed", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                "itl_p50_ms", "itl_p99_ms")}
        for a, b in (("dsa", "single"), ("nixl", "single"), ("early", "single"), ("nixl", "dsa")):
            if a in row and b in row and row[b]["output_tok_s"] and row[b]["ttft_p50_ms"]:
                row[f"{a}_over_{b}"] = {
                    "output_tok_s": round(row[a]["output_tok_s"] / row[b]["output_tok_s"], 3),
                    "ttft_p50": round(row[a]["ttft_p50_ms"] / row[b]["ttft_p50_ms"], 3),
                    "ttft_p99": round(row[a]["ttft_p99_ms"] / row[b]["ttft_p99_ms"], 3),
                    "itl_p50": round(row[a]["itl_p50_ms"] / row[b]["itl_p50_ms"], 3),
                    "itl_p99": round(row[a]["itl_p99_ms"] / row[b]["itl_p99_ms"], 3)}
        out[str(c)] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model directory (its tokenizer makes the prompts)")
    ap.add_argument("--contenders", default="single,dsa,nixl", help=f"out of {','.join(CONTENDERS)}")
    ap.add_argument("--concurrency", default="8,32,64", help="levels: requests in flight at most")
    ap.add_argument("--input-len", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--output-len", type=int, default=160, help="mean output tokens (default 160)")
    ap.add_argument("--output-range", type=float, default=0.6,
                    help="output lengths within output-len x (1 -/+ this) (default 0.6: 64..256); prompts keep "
                         "their length")
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="requests per level = this x the level")
    ap.add_argument("--samples", type=int, default=2, help="page samples per contender and level")
    ap.add_argument("--sample-after", type=float, default=1.0, help="seconds into a run before sampling")
    ap.add_argument("--mode", choices=("eager", "graphs"), default="eager")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-bytes", type=int, default=3 << 30)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=128, help="every GPU engine's --max-num-seqs (default 128)")
    ap.add_argument("--load-format", default=None, help="every engine's --load-format (dummy: a config-only model)")
    ap.add_argument("--base-port", type=int, default=9500)
    ap.add_argument("--startup-timeout", type=float, default=480.0)
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU build (no --kv-cache-memory-bytes; eager)")
    args = ap.parse_args()
    names = [n for n in args.contenders.split(",") if n]
    levels = [int(x) for x in args.concurrency.split(",") if x]
    if not names or any(n not in CONTENDERS for n in names) or len(set(names)) != len(names):
        raise SystemExit(f"--contenders: {args.contenders!r}: distinct names out of {CONTENDERS}")
    if not levels or min(levels) < 1 or args.input_len < 2 * BLOCK or args.output_len < 1:
        raise SystemExit("--concurrency levels >= 1, --input-len >= 128 and --output-len >= 1")
    if args.input_len + int(args.output_len * (1 + args.output_range)) + 400 > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is below input + longest output + 400 (the page "
                         "samples' decode)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.time()
    result: dict[str, Any] = {"model": args.model, "argv": sys.argv[1:], "contenders": names, "levels": levels,
                              "runs": {n: [] for n in names}}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="gpu-load-"))
    with cluster(work / "engines") as c:
        cts = {n: start(c, n, args, args.base_port + 10 * k) for k, n in enumerate(names)}
        try:
            for name, ct in list(cts.items()):  # a contender that does not come up is reported; the others run
                try:
                    for url in [u for u in (ct.p_url, ct.d_url) if u] or [ct.url]:
                        wait_healthy(url, ct.procs, args.startup_timeout)
                    if ct.url != (ct.p_url or ct.url):
                        wait_healthy(ct.url, ct.procs, 60)
                    # the first request of a pair does its handshake: not in any run
                    post_json(ct.url + "/v1/completions", {
                        "model": "m", "prompt": [random.randrange(100, 20000) for _ in range(BLOCK * 3)],
                        "max_tokens": 4, "temperature": 0.0}, 300)
                except Exception as e:  # noqa: BLE001 - reported as the contender's failure
                    result.setdefault("not_started", {})[name] = f"{type(e).__name__}: {e}"[-1500:]
                    print(f"[gpu_load] {name} did not start: {e}"[:2000], flush=True)
                    for proc in ct.procs:
                        c.stop(proc)
                    del cts[name]
            result["up_s"] = round(time.time() - t_start, 1)
            print(f"[gpu_load] up in {result['up_s']} s: {sorted(cts)}", flush=True)
            for i, conc in enumerate(levels):
                order = [n for n in names[i % len(names):] + names[: i % len(names)] if n in cts]
                for n in order:
                    result["runs"][n].append(run_level(cts[n], args, conc))
                    if out_dir is not None:  # what ran so far survives a run cut short by its time limit
                        (out_dir / "gpu_load.json").write_text(json.dumps({**result, "partial": True}, indent=1))
        finally:
            if out_dir is not None:  # every engine's log tail, also when one did not start
                for proc in c.procs:
                    tail = proc.log.read_text(errors="replace").splitlines()[-300:]
                    (out_dir / f"load_{proc.name}.log").write_text("\n".join(tail))
    result["summary"] = summarize(result)
    result["problems"] = judge(result)
    result["ok"] = not result["problems"]
    result["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if out_dir is not None:
        (out_dir / "gpu_load.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
