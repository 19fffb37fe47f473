"""``vllm-dsa bench pd``: the same P/D pair with DSAConnector and with vLLM's NixlConnector.

Both runs use the same model, dtype, prompts, proxy and engine flags; only ``--kv-transfer-config``
differs (DSAConnector push vs NixlConnector pull, both over NIXL UCX). Per request the KV transfer time
is measured the same way for both: NIXL's own telemetry (``xferDuration``: post to completion of the
transfer requests of that request), read from the side that posts them (P for DSAConnector's WRITE:
``vllm:dsa_kv_transfer_seconds``; D for NixlConnector's READ: ``vllm:nixl_xfer_time_seconds``). A warm-up
request per run (UCX connection set-up) is excluded. Prints a table; ``--json`` adds a last line::

    {"dsa_transfer_ms": ..., "nixl_transfer_ms": ..., "ratio": ..., "outputs_match": true, ...}

(medians per request). Outputs are compared turn by turn (greedy, float32).
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

from vllm_dsa_connector.commands.demo import (
    chat,
    cluster,
    metric,
    scrape,
    start_pair,
)

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


CONNECTORS: dict[str, dict[str, Any]] = {
    "dsa": {"name": "DSAConnector", "time": ("prefill", "vllm:dsa_kv_transfer_seconds_sum"),
            "count": ("prefill", "vllm:dsa_kv_transfer_seconds_count"),
            "bytes": ("decode", "vllm:dsa_kv_bytes_total"),
            "descs": ("prefill", "vllm:dsa_kv_descriptors_total")},
    "nixl": {"name": "NixlConnector", "time": ("decode", "vllm:nixl_xfer_time_seconds_sum"),
             "count": ("decode", "vllm:nixl_xfer_time_seconds_count"),
             "bytes": ("decode", "vllm:nixl_bytes_transferred_sum"),
             "descs": ("decode", "vllm:nixl_num_descriptors_sum")},
}


def _run_one(key: str, model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = CONNECTORS[key]
    base = args.base_port
    p_cfg: dict[str, Any] = {"kv_connector": spec["name"], "kv_role": "kv_producer"}
    d_cfg: dict[str, Any] = {"kv_connector": spec["name"], "kv_role": "kv_consumer"}
    env: dict[str, dict[str, str]] = {}
    if key == "dsa":
        p_cfg["kv_connector_extra_config"] = {"side_channel_port": base + 3}
        d_cfg["kv_connector_extra_config"] = {"side_channel_port": base + 4}
    else:
        env = {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 3)},
               "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 4)}}
    with cluster(workdir / key) as c:
        (workdir / key).mkdir(parents=True, exist_ok=True)
        urls = dict(zip(("prefill", "decode", "proxy"), start_pair(c, model, args, p_cfg, d_cfg, env), strict=True))

        def sample() -> dict[str, float]:
            m = {"prefill": scrape(urls["prefill"]), "decode": scrape(urls["decode"])}
            return {k: metric(m[side], name) for k, (side, name) in
                    ((k, spec[k]) for k in ("time", "count", "bytes", "descs"))}

        rows = []
        for i in range(args.requests + 1):  # request 0 warms the UCX connection up
            before = sample()
            reply = chat(urls["proxy"], str(model), [{"role": "user", "content": _prompt(i, args.words)}],
                         args.max_tokens)
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


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench pd``."""
    from vllm_dsa_connector.tiny_models import make_tiny_mla

    model = Path(args.model) if args.model else make_tiny_mla()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-dsa-bench-pd-"))
    results: dict[str, dict[str, Any]] = {}
    try:
        for key in ("dsa", "nixl"):
            print(f"[bench pd] {CONNECTORS[key]['name']}: starting P/D pair (logs in {workdir / key})", flush=True)
            results[key] = _run_one(key, model, args, workdir)
    except RuntimeError as e:
        print(f"[bench pd] FAILED: {e}", file=sys.stderr)
        return 1
    dsa, nixl = results["dsa"]["rows"], results["nixl"]["rows"]
    (workdir / "rows.json").write_text(json.dumps(results, indent=1))
    match = [a["text"] == b["text"] for a, b in zip(dsa, nixl, strict=True)]

    def med(rows: list[dict[str, Any]], k: str) -> float:
        return statistics.median(r[k] for r in rows) if rows else 0.0

    def p90(rows: list[dict[str, Any]], k: str) -> float:
        vals = sorted(r[k] for r in rows)
        return vals[min(len(vals) - 1, int(0.9 * len(vals)))] if vals else 0.0

    print(f"\n{'req':>3} {'prompt':>6} | {'DSA ms':>8} {'descs':>6} {'bytes':>10} | {'NIXL ms':>8} {'descs':>6} "
          f"{'bytes':>10} | {'DSA TTFT':>8} {'NIXL TTFT':>9} | same")
    for i, (a, b) in enumerate(zip(dsa, nixl, strict=True)):
        print(f"{i + 1:>3} {a['prompt_tokens']:>6} | {a['transfer_ms']:>8.3f} {int(a['descriptors']):>6} "
              f"{int(a['bytes']):>10,} | {b['transfer_ms']:>8.3f} {int(b['descriptors']):>6} {int(b['bytes']):>10,} | "
              f"{a['ttft_ms']:>8.1f} {b['ttft_ms']:>9.1f} | {'yes' if match[i] else 'NO'}")
    summary = {
        "dsa_transfer_ms": round(med(dsa, "transfer_ms"), 4),
        "nixl_transfer_ms": round(med(nixl, "transfer_ms"), 4),
        "ratio": round(med(dsa, "transfer_ms") / med(nixl, "transfer_ms"), 3) if med(nixl, "transfer_ms") else None,
        "dsa_transfer_p90_ms": round(p90(dsa, "transfer_ms"), 4),
        "nixl_transfer_p90_ms": round(p90(nixl, "transfer_ms"), 4),
        "outputs_match": all(match) and len(match) == args.requests,
        "requests": args.requests,
        "dsa_descriptors": med(dsa, "descriptors"),
        "nixl_descriptors": med(nixl, "descriptors"),
        "dsa_bytes": med(dsa, "bytes"),
        "nixl_bytes": med(nixl, "bytes"),
        "dsa_ttft_ms": round(med(dsa, "ttft_ms"), 2),
        "nixl_ttft_ms": round(med(nixl, "ttft_ms"), 2),
    }
    print(f"\ntransfer per request, median (p90): DSAConnector {summary['dsa_transfer_ms']} "
          f"({summary['dsa_transfer_p90_ms']}) ms, NixlConnector {summary['nixl_transfer_ms']} "
          f"({summary['nixl_transfer_p90_ms']}) ms, ratio of medians {summary['ratio']}; "
          f"outputs match: {summary['outputs_match']}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["outputs_match"] else 1
