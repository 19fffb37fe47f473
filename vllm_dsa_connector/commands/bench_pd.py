"""``vllm-dsa bench pd``: the same P/D pair with DSAConnector, vLLM's NixlConnector and NixlPushConnector.

All runs use the same model, dtype, prompts, proxy and engine flags; only ``--kv-transfer-config``
differs (DSAConnector push, NixlConnector pull, NixlPushConnector push, all over NIXL UCX). Per request
the KV transfer time is measured the same way for each: NIXL's own telemetry (``xferDuration``: post to
completion of the transfer requests of that request), read from the side that posts them (P for the
WRITEs of DSAConnector, ``vllm:dsa_kv_transfer_seconds``, and of NixlPushConnector; D for NixlConnector's
READs, ``vllm:nixl_xfer_time_seconds``). A warm-up request per run (UCX connection set-up) is excluded.
The same requests also run on one engine without P/D (``ttft_single_ms``). Prints a table; ``--json``
adds a last line::

    {"dsa_transfer_ms": ..., "nixl_transfer_ms": ..., "nixl_push_transfer_ms": ..., "outputs_match": true,
     "dsa_ttft_ms": ..., "nixl_ttft_ms": ..., "nixl_push_ttft_ms": ..., "ttft_single_ms": ..., ...}

(medians per request). Outputs are compared request by request across all four (greedy, float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dsa_connector.harness.client import chat, metric, scrape
from vllm_dsa_connector.harness.engines import choose_backend, engine_env, start_engine, start_pair
from vllm_dsa_connector.harness.procs import cluster

WORDS = ("dragon paint colour sky river stone lantern harbour winter garden melody thunder "
         "orchard compass library velvet meadow ember glacier canyon").split()


def _prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    return f"Request {i}: describe these words as a story: {body}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``vllm-dsa bench pd``."""
    parser.add_argument("--requests", type=int, default=10, help="measured requests per connector")
    parser.add_argument("--words", type=int, default=1000, help="words per prompt (~1.06 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny MLA model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "CPU_MLA", "AMX_MLA"),
                        help="as for `vllm-dsa demo` (auto: CPU_MLA for float32, vLLM's choice for bf16)")
    parser.add_argument("--base-port", type=int, default=24400)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--connectors", default="dsa,nixl,nixl_push",
                        help="comma-separated subset of dsa,nixl,nixl_push (default: all three)")


CONNECTORS: dict[str, dict[str, Any]] = {
    "dsa": {"name": "DSAConnector", "time": ("prefill", "vllm:dsa_kv_transfer_seconds_sum"),
            "count": ("prefill", "vllm:dsa_kv_transfer_seconds_count"),
            "bytes": ("decode", "vllm:dsa_kv_bytes_total"),
            "descs": ("prefill", "vllm:dsa_kv_descriptors_total")},
    # pull: D posts the READs and records them
    "nixl": {"name": "NixlConnector", "time": ("decode", "vllm:nixl_xfer_time_seconds_sum"),
             "count": ("decode", "vllm:nixl_xfer_time_seconds_count"),
             "bytes": ("decode", "vllm:nixl_bytes_transferred_sum"),
             "descs": ("decode", "vllm:nixl_num_descriptors_sum")},
    # push: P posts the WRITEs and records them
    "nixl_push": {"name": "NixlPushConnector", "time": ("prefill", "vllm:nixl_xfer_time_seconds_sum"),
                  "count": ("prefill", "vllm:nixl_xfer_time_seconds_count"),
                  "bytes": ("prefill", "vllm:nixl_bytes_transferred_sum"),
                  "descs": ("prefill", "vllm:nixl_num_descriptors_sum")},
}


def _requests(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Request 0 warms the UCX connection up (excluded); then the measured ones."""
    return [[{"role": "user", "content": _prompt(i, args.words)}] for i in range(args.requests + 1)]


def _run_one(key: str, model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = CONNECTORS[key]
    base = args.base_port
    # The same lease for all: the first request waits for the NIXL handshake, which on a loaded 2-core
    # machine took 27 s once; vLLM's NIXL connectors do not extend a lease before D registers (default
    # 30 s), and NixlPushConnector's D then waits its 480 s registration watchdog.
    extra: dict[str, Any] = {"kv_lease_duration": 120}
    if key == "nixl_push":
        extra["push_registration_timeout"] = 120
    p_cfg: dict[str, Any] = {"kv_connector": spec["name"], "kv_role": "kv_producer",
                             "kv_connector_extra_config": dict(extra)}
    d_cfg: dict[str, Any] = {"kv_connector": spec["name"], "kv_role": "kv_consumer",
                             "kv_connector_extra_config": dict(extra)}
    env: dict[str, dict[str, str]] = {}
    if key == "dsa":
        p_cfg["kv_connector_extra_config"]["side_channel_port"] = base + 3
        d_cfg["kv_connector_extra_config"]["side_channel_port"] = base + 4
    else:
        env = {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 3)},
               "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 4)}}
    with cluster(workdir / key) as c:
        urls = start_pair(c, model, p_cfg, d_cfg, base_port=base, dtype=args.dtype,
                          startup_timeout=args.startup_timeout, attention_backend=args.attention_backend,
                          extra_env=env, label="bench pd")._asdict()

        def sample() -> dict[str, float]:
            m = {"prefill": scrape(urls["prefill"]), "decode": scrape(urls["decode"])}
            return {k: metric(m[side], name) for k, (side, name) in
                    ((k, spec[k]) for k in ("time", "count", "bytes", "descs"))}

        rows = []
        for i, messages in enumerate(_requests(args)):
            before = sample()
            reply = chat(urls["proxy"], str(model), messages, args.max_tokens)
            deadline = time.monotonic() + 10
            after = sample()
            while after["count"] <= before["count"] and time.monotonic() < deadline:
                time.sleep(0.2)
                after = sample()
            d = {k: after[k] - before[k] for k in after}
            if i == 0:
                continue
            rows.append({"text": reply.text, "ttft_ms": reply.ttft_s * 1000, "prompt_tokens": reply.prompt_tokens,
                         "transfer_ms": d["time"] * 1000, "bytes": d["bytes"], "descriptors": d["descs"],
                         "transfers": d["count"]})
    return {"rows": rows}


def _run_single(model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The same requests on one engine without a connector (TTFT and outputs to compare with)."""
    backend = choose_backend(model, args.dtype, args.attention_backend)
    with cluster(workdir / "single") as c:
        eng = start_engine(c, "single", model, args.base_port + 5, args.dtype, None, backend, engine_env("0"))
        eng.ready(args.startup_timeout)
        url = eng.url
        rows = []
        for i, messages in enumerate(_requests(args)):
            reply = chat(url, str(model), messages, args.max_tokens)
            if i:
                rows.append({"text": reply.text, "ttft_ms": reply.ttft_s * 1000})
    return {"rows": rows}


def _med(rows: list[dict[str, Any]], k: str) -> float:
    return statistics.median(r[k] for r in rows) if rows else 0.0


def _p90(rows: list[dict[str, Any]], k: str) -> float:
    vals = sorted(r[k] for r in rows)
    return vals[min(len(vals) - 1, int(0.9 * len(vals)))] if vals else 0.0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench pd``."""
    from vllm_dsa_connector.tiny_models import make_tiny_mla

    model = Path(args.model) if args.model else make_tiny_mla()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-dsa-bench-pd-"))
    keys = [k.strip() for k in args.connectors.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(CONNECTORS))
    if unknown or not keys:
        print(f"[bench pd] --connectors: unknown {unknown or 'empty list'}; choose from {sorted(CONNECTORS)}",
              file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    try:
        for key in keys:
            print(f"[bench pd] {CONNECTORS[key]['name']}: starting P/D pair (logs in {workdir / key})", flush=True)
            results[key] = _run_one(key, model, args, workdir)
        print(f"[bench pd] one engine without P/D (logs in {workdir / 'single'})", flush=True)
        results["single"] = _run_single(model, args, workdir)
    except (RuntimeError, OSError) as e:  # OSError: a request that failed or timed out (urllib)
        print(f"[bench pd] FAILED: {e}", file=sys.stderr)
        return 1
    (workdir / "rows.json").write_text(json.dumps(results, indent=1))
    rows = {k: results[k]["rows"] for k in [*keys, "single"]}
    match = [len({rows[k][i]["text"] for k in rows}) == 1 for i in range(args.requests)]
    print(f"\n{'req':>3} {'prompt':>6} | " + " | ".join(f"{k + ' ms':>13} {'descs':>5}" for k in keys)
          + " | " + " ".join(f"{k + ' TTFT':>14}" for k in [*keys, "single"]) + " | same")
    for i in range(args.requests):
        print(f"{i + 1:>3} {rows[keys[0]][i]['prompt_tokens']:>6} | "
              + " | ".join(f"{rows[k][i]['transfer_ms']:>13.3f} {int(rows[k][i]['descriptors']):>5}" for k in keys)
              + " | " + " ".join(f"{rows[k][i]['ttft_ms']:>14.1f}" for k in [*keys, "single"])
              + f" | {'yes' if match[i] else 'NO'}")
    summary: dict[str, Any] = {}
    for k in keys:
        summary[f"{k}_transfer_ms"] = round(_med(rows[k], "transfer_ms"), 4)
        summary[f"{k}_transfer_p90_ms"] = round(_p90(rows[k], "transfer_ms"), 4)
        summary[f"{k}_descriptors"] = _med(rows[k], "descriptors")
        summary[f"{k}_bytes"] = _med(rows[k], "bytes")
        summary[f"{k}_ttft_ms"] = round(_med(rows[k], "ttft_ms"), 2)
    summary["ttft_single_ms"] = round(_med(rows["single"], "ttft_ms"), 2)
    nixl = [summary[f"{k}_transfer_ms"] for k in ("nixl", "nixl_push") if k in keys]
    best = min(nixl) if nixl else 0.0
    summary["ratio_vs_best_nixl"] = (round(summary["dsa_transfer_ms"] / best, 3)
                                     if best and "dsa" in keys else None)
    summary["outputs_match"] = all(match) and len(match) == args.requests
    summary["requests"] = args.requests
    print("\ntransfer per request, median (p90): " + ", ".join(
        f"{CONNECTORS[k]['name']} {summary[f'{k}_transfer_ms']} ({summary[f'{k}_transfer_p90_ms']}) ms" for k in keys)
        + f"; DSA / best NIXL {summary['ratio_vs_best_nixl']}; outputs match (every P/D run and one engine): "
        f"{summary['outputs_match']}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["outputs_match"] else 1
