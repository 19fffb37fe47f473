"""``vllm-dsa bench pd``: the same P/D pair with DSAConnector, vLLM's NixlConnector and NixlPushConnector.

All pairs use the same model, dtype, prompts, proxy and engine flags; only ``--kv-transfer-config``
differs (DSAConnector push, NixlConnector pull, NixlPushConnector push, all over NIXL UCX), and for the
two DSAConnector modes of issue 34 the proxy: ``dsa_early`` runs our proxy with ``--early-registration``
(D gets each request at the same time as P and registers its blocks while P prefills; P pushes when its
prefill is done), ``dsa_layered`` the same with P's ``layer_push`` (P posts each layer's pages from
``save_kv_layer`` in the step that finishes the prefill); their D falls back to computing the prompt
(``kv_load_failure_policy: recompute``) where a load fails, counted as ``<key>_failed_loads``.
``--prefill-max-batched-tokens N`` chunks P's prefill (P only), so that D's registration comes before
P's last prefill step. The pairs
and one engine without P/D run one after the other; with ``--together`` (7 servers at once, ~3 GB of
RAM each) they run at the same time and the requests are interleaved (request i goes to every pair, in
an order that rotates with i, before request i+1), so a load change on the host hits all of them
alike. A warm-up request per pair (UCX connection set-up) is excluded.

Transfer time (one unit for all three: the time from posting a request's transfer to seeing it done, per
(request, destination rank), summed per request), read from the side that posts: P for DSAConnector
(``vllm:dsa_kv_transfer_seconds``: its post to the last WRITE's completion, one observation however many
pools or layers it wrote) and NixlPushConnector, D for NixlConnector's READs (``vllm:nixl_xfer_time_seconds``:
NIXL's telemetry ``xferDuration`` of the request's one READ). It covers the copy and any wait for the peer
inside the transfer, not the control messages around it; TTFT (``*_ttft_ms``, first streamed token at the
client) covers everything. Prints a table; ``--json`` adds a last line::

    {"dsa_transfer_ms": ..., "nixl_transfer_ms": ..., "nixl_push_transfer_ms": ..., "outputs_match": true,
     "dsa_ttft_ms": ..., "nixl_ttft_ms": ..., "nixl_push_ttft_ms": ..., "ttft_single_ms": ..., ...}

(medians per request). Against the one engine, request by request (the same prompts in the same order):
``<key>_ttft_ratio_vs_single`` (median of TTFT / the one engine's TTFT), ``<key>_overhead_ms`` (median of
TTFT - the one engine's TTFT) and ``<key>_ttft_p90_ms``; ``dsa_layered_layered_share`` is the share of P's
sent bytes it posted layer by layer (``vllm:dsa_kv_layered_bytes_total`` over ``vllm:dsa_kv_bytes_total``
``side="send"``), and ``<key>_x_kv_transfer`` the proxy's ``x-kv-transfer`` header on one more request
after the measured ones (``early`` when D's leg went with P's). Outputs are compared request by request across every pair and the one
engine (greedy, float32). A pair that fails to start or to answer is reported as ``<key>_error`` (the
others still run; the exit status is then 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_dsa_dev.harness.client import chat, metric, scrape
from vllm_dsa_dev.harness.engines import (
    choose_backend,
    engine_env,
    resolve_model,
    start_engine,
    start_pair,
)
from vllm_dsa_dev.harness.procs import Cluster, cluster

WORDS = ("dragon paint colour sky river stone lantern harbour winter garden melody thunder "
         "orchard compass library velvet meadow ember glacier canyon").split()
SINGLE = "single"


def _prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
    return f"Request {i}: describe these words as a story: {body}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``vllm-dsa bench pd``."""
    parser.description = (
        "The same requests through a DSAConnector, a NixlConnector and a NixlPushConnector P/D pair and one "
        "engine without P/D (one after the other; --together: all at once, requests interleaved). Transfer time, the same for all "
        "three: post to done of a request's transfers, one per (request, destination rank), summed per request, "
        "from the side that posts them (P for DSAConnector's WRITEs, its post to the last one's completion, and "
        "NixlPushConnector's, D for NixlConnector's READs: NIXL's telemetry xferDuration); TTFT at the client covers "
        "everything else. Medians; "
        "outputs compared request by request.")
    parser.add_argument("--requests", type=int, default=10, help="measured requests per connector")
    parser.add_argument("--words", type=int, default=1000, help="words per prompt (~1.06 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="model directory (overrides --model-kind)")
    parser.add_argument("--model-kind", default="mla", choices=("mla", "dsa"),
                        help="tiny model when --model is not given: mla (DeepSeek-V2) or dsa (GLM-MoE-DSA, "
                             "index_topk_freq 2, topk 16)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "CPU_MLA", "AMX_MLA"),
                        help="as for `vllm-dsa demo` (auto: CPU_MLA for float32, vLLM's choice for bf16)")
    parser.add_argument("--base-port", type=int, default=24400,
                        help="pair k uses ports base+10k .. base+10k+4 (k: dsa 0, nixl 1, nixl_push 2, dsa_early "
                             "5, dsa_layered 6); the one engine base+40")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may wait for the server before its connector counts as failed "
                             "(its remaining requests are skipped)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--together", action="store_true",
                        help="start every pair and the one engine at once and interleave the requests (7 "
                             "servers: ~3 GB of RAM each); default: one pair after the other")
    parser.add_argument("--connectors", "--pairs", dest="connectors", default="dsa,nixl,nixl_push",
                        help="comma-separated pairs out of dsa,nixl,nixl_push,dsa_early,dsa_layered (default: "
                             "dsa,nixl,nixl_push); the one engine always runs")
    parser.add_argument("--prefill-max-batched-tokens", type=int, default=None, metavar="N",
                        help="P's --max-num-batched-tokens (P only: its prefill in chunks of N tokens; default "
                             "vLLM's)")


_DSA: dict[str, Any] = {"name": "DSAConnector", "time": ("prefill", "vllm:dsa_kv_transfer_seconds_sum"),
                        "count": ("prefill", "vllm:dsa_kv_transfer_seconds_count"),
                        "bytes": ("decode", "vllm:dsa_kv_bytes_total"),
                        "descs": ("prefill", "vllm:dsa_kv_descriptors_total")}
#: Early registration through our proxy (issue 34): D's leg goes with P's
EARLY = ("--early-registration",)

CONNECTORS: dict[str, dict[str, Any]] = {
    "dsa": _DSA,
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
    "dsa_early": {**_DSA, "proxy_args": EARLY},
    "dsa_layered": {**_DSA, "proxy_args": EARLY, "layer_push": True},
}
#: Port slot of each pair (ports base + 10 * slot ...); slot 4 is the one engine's (base + 40)
SLOTS = {"dsa": 0, "nixl": 1, "nixl_push": 2, SINGLE: 4, "dsa_early": 5, "dsa_layered": 6}


def _requests(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """Request 0 warms the UCX connection up (excluded); then the measured ones."""
    return [[{"role": "user", "content": _prompt(i, args.words)}] for i in range(args.requests + 1)]


def _pair_configs(key: str, base: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, str]]]:
    """(P's and D's ``--kv-transfer-config``, extra environment per engine) of one connector's pair."""
    # The same lease for all: the first request waits for the NIXL handshake, which on a loaded 2-core
    # machine took 27 s once; vLLM's NIXL connectors do not extend a lease before D registers (default
    # 30 s), and NixlPushConnector's D then waits its registration watchdog (default: the lease TTL).
    extra: dict[str, Any] = {"kv_lease_duration": 120}
    if key == "nixl_push":
        extra["push_registration_timeout"] = 120
    p_cfg: dict[str, Any] = {"kv_connector": CONNECTORS[key]["name"], "kv_role": "kv_producer",
                             "kv_connector_extra_config": dict(extra)}
    d_cfg: dict[str, Any] = {"kv_connector": CONNECTORS[key]["name"], "kv_role": "kv_consumer",
                             "kv_connector_extra_config": dict(extra)}
    if CONNECTORS[key]["name"] == "DSAConnector":
        p_cfg["kv_connector_extra_config"]["side_channel_port"] = base + 3
        d_cfg["kv_connector_extra_config"]["side_channel_port"] = base + 4
        if CONNECTORS[key].get("layer_push"):
            p_cfg["kv_connector_extra_config"]["layer_push"] = True
        if CONNECTORS[key].get("proxy_args"):  # a failed early load costs D the prompt's compute, not the answer
            d_cfg["kv_load_failure_policy"] = "recompute"
        return p_cfg, d_cfg, {}
    return p_cfg, d_cfg, {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 3)},
                          "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base + 4)}}


def _start(key: str, c: Cluster, model: Path, args: argparse.Namespace, base: int) -> str:
    """Start ``key``'s pair (or the one engine) in ``c``; its URL for requests once ready."""
    if key == SINGLE:
        backend = choose_backend(model, args.dtype, args.attention_backend)
        eng = start_engine(c, SINGLE, model, base, args.dtype, None, backend, engine_env("0"))
        eng.ready(args.startup_timeout)
        return eng.url
    p_cfg, d_cfg, env = _pair_configs(key, base)
    p_args = ["--max-num-batched-tokens", str(args.prefill_max_batched_tokens)] if args.prefill_max_batched_tokens \
        else []
    urls = start_pair(c, model, p_cfg, d_cfg, base_port=base, dtype=args.dtype,
                      startup_timeout=args.startup_timeout, attention_backend=args.attention_backend,
                      extra_env=env, label=f"bench pd {key}", proxy_args=CONNECTORS[key].get("proxy_args", ()),
                      p_args=p_args)
    return f"{urls.proxy}|{urls.prefill}|{urls.decode}"


def _one(key: str, url: str, model: Path, messages: list[dict[str, str]],
         args: argparse.Namespace) -> dict[str, Any]:
    """One request through ``key``'s proxy (or the one engine), with the metric deltas it caused."""
    if key == SINGLE:
        reply = chat(url, str(model), messages, args.max_tokens, args.request_timeout)
        return {"text": reply.text, "ttft_ms": reply.ttft_s * 1000}
    proxy, prefill, decode = url.split("|")
    spec = CONNECTORS[key]

    def sample() -> dict[str, float]:
        m = {"prefill": scrape(prefill), "decode": scrape(decode)}
        out = {k: metric(m[side], name) for k, (side, name) in ((k, spec[k]) for k in ("time", "count", "bytes",
                                                                                         "descs"))}
        if spec["name"] == "DSAConnector":
            out["sent"] = metric(m["prefill"], "vllm:dsa_kv_bytes_total", side="send")
            out["layered"] = metric(m["prefill"], "vllm:dsa_kv_layered_bytes_total")
            out["failed"] = sum(metric(m["decode"], "vllm:dsa_kv_requests_total", side="recv", outcome=o)
                                for o in ("failed", "timeout"))
        return out

    before = sample()
    reply = chat(proxy, str(model), messages, args.max_tokens, args.request_timeout)
    deadline = time.monotonic() + 10
    after = sample()
    while after["count"] <= before["count"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = sample()
    d = {k: after[k] - before[k] for k in after}
    row = {"text": reply.text, "ttft_ms": reply.ttft_s * 1000, "prompt_tokens": reply.prompt_tokens,
           "transfer_ms": d["time"] * 1000, "bytes": d["bytes"], "descriptors": d["descs"], "transfers": d["count"]}
    row.update({k: d[k] for k in ("sent", "layered", "failed") if k in d})
    return row


def _transfer_header(url: str, model: Path, messages: list[dict[str, str]], timeout_s: float) -> str:
    """The proxy's ``x-kv-transfer`` header on one more (non-streamed, one-token) request: ``early`` when D's
    leg went together with P's."""
    body = {"model": str(model), "messages": messages, "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(url.split("|")[0] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()
        return r.headers.get("x-kv-transfer", "")


def _run_all(keys: list[str], model: Path, args: argparse.Namespace,
             workdir: Path) -> tuple[dict[str, list[Any]], dict[str, str], dict[str, str]]:
    """Run every pair and the one engine (one after the other, or with ``--together`` all at once with the
    requests interleaved); (rows, errors, the early pairs' ``x-kv-transfer`` header) per key."""
    names = [*keys, SINGLE]
    rows: dict[str, list[Any]] = {k: [] for k in names}
    errors: dict[str, str] = {}
    headers: dict[str, str] = {}
    for group in ([names] if args.together else [[k] for k in names]):
        _run_group(group, model, args, workdir, rows, errors, headers)
    return rows, errors, headers


def _run_group(names: list[str], model: Path, args: argparse.Namespace, workdir: Path,
               rows: dict[str, list[Any]], errors: dict[str, str], headers: dict[str, str]) -> None:
    """Start ``names`` at once, then send every request to each of them in turn (order rotating)."""
    bases = {k: args.base_port + 10 * SLOTS[k] for k in names}
    with contextlib.ExitStack() as stack:
        clusters = {k: stack.enter_context(cluster(workdir / k)) for k in names}
        for k in names:
            print(f"[bench pd] {k} ({CONNECTORS[k]['name'] if k in CONNECTORS else 'one engine without P/D'}"
                  f"{', ' + ' '.join(CONNECTORS[k]['proxy_args']) if CONNECTORS.get(k, {}).get('proxy_args') else ''}"
                  f"{', layer_push' if CONNECTORS.get(k, {}).get('layer_push') else ''}): starting (logs in "
                  f"{workdir / k})", flush=True)
        pool = ThreadPoolExecutor(len(names))
        try:  # never wait for the start threads on Ctrl-C: closing the clusters ends them
            futs = {k: pool.submit(_start, k, clusters[k], model, args, bases[k]) for k in names}
            urls: dict[str, str] = {}
            for k, f in futs.items():
                try:
                    urls[k] = f.result()
                except (RuntimeError, OSError) as e:
                    errors[k] = f"start failed: {e}"
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        requests = _requests(args)
        for i, messages in enumerate(requests):
            live = [k for k in names if k in urls and k not in errors]
            turn = i % max(1, len(live))
            for k in live[turn:] + live[:turn]:
                try:
                    row = _one(k, urls[k], model, messages, args)
                except (RuntimeError, OSError) as e:  # OSError: a request that failed or timed out (urllib)
                    errors[k] = f"request {i} failed: {e}"
                    print(f"[bench pd] {k}: request {i} failed, skipping its other requests: {e}", flush=True)
                    continue
                print(f"[bench pd] {k}: request {i}/{len(requests) - 1}{' (warm-up)' if not i else ''}: TTFT "
                      f"{row['ttft_ms']:.0f} ms" + (f", transfer {row['transfer_ms']:.2f} ms" if "transfer_ms" in row
                                                    else ""), flush=True)
                if i:
                    rows[k].append(row)
        for k in names:
            if k in urls and k not in errors and CONNECTORS.get(k, {}).get("proxy_args"):
                try:
                    headers[k] = _transfer_header(urls[k], model, requests[-1], args.request_timeout)
                except OSError as e:
                    headers[k] = f"request failed: {e}"


def _med(rows: list[dict[str, Any]], k: str) -> float:
    return statistics.median(r[k] for r in rows) if rows else 0.0


def _p90(rows: list[dict[str, Any]], k: str) -> float:
    vals = sorted(r[k] for r in rows)
    return vals[min(len(vals) - 1, int(0.9 * len(vals)))] if vals else 0.0


def vs_single(rows: list[dict[str, Any]], single: list[dict[str, Any]]) -> dict[str, float]:
    """A pair's TTFTs against the one engine's, request by request (the same prompts in the same order):
    medians of the ratio and of the difference (the P/D overhead), and the pair's own median and p90."""
    pairs = list(zip(rows, single, strict=True))
    return {"ttft_ms": round(_med(rows, "ttft_ms"), 2), "ttft_p90_ms": round(_p90(rows, "ttft_ms"), 2),
            "ttft_ratio_vs_single": round(statistics.median(r["ttft_ms"] / s["ttft_ms"] for r, s in pairs), 3),
            "overhead_ms": round(statistics.median(r["ttft_ms"] - s["ttft_ms"] for r, s in pairs), 2)}


def layered_share(rows: list[dict[str, Any]]) -> float | None:
    """Share of P's sent bytes that it posted layer by layer, over the measured requests (None: nothing sent)."""
    sent = sum(r.get("sent", 0.0) for r in rows)
    return round(sum(r.get("layered", 0.0) for r in rows) / sent, 4) if sent else None


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa bench pd``."""
    keys = [k.strip() for k in args.connectors.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(CONNECTORS))
    if unknown or not keys:
        print(f"[bench pd] --connectors: unknown {unknown or 'empty list'}; choose from {sorted(CONNECTORS)}",
              file=sys.stderr)
        return 2
    model = resolve_model(args.model, args.model_kind)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-dsa-bench-pd-"))
    rows, errors, headers = _run_all(keys, model, args, workdir)
    (workdir / "rows.json").write_text(json.dumps({"rows": rows, "errors": errors, "headers": headers}, indent=1))
    for k, e in errors.items():
        print(f"[bench pd] {k}: {e}", file=sys.stderr)
    ok = [k for k in keys if k not in errors and len(rows[k]) == args.requests]
    shown = [*ok, SINGLE] if SINGLE not in errors else ok
    match = [len({rows[k][i]["text"] for k in shown}) == 1 for i in range(args.requests)] if shown else []
    if ok:
        print(f"\n{'req':>3} {'prompt':>6} | " + " | ".join(f"{k + ' ms':>13} {'descs':>5}" for k in ok)
              + " | " + " ".join(f"{k + ' TTFT':>14}" for k in shown) + " | same")
        for i in range(args.requests):
            print(f"{i + 1:>3} {rows[ok[0]][i]['prompt_tokens']:>6} | "
                  + " | ".join(f"{rows[k][i]['transfer_ms']:>13.3f} {int(rows[k][i]['descriptors']):>5}" for k in ok)
                  + " | " + " ".join(f"{rows[k][i]['ttft_ms']:>14.1f}" for k in shown)
                  + f" | {'yes' if match[i] else 'NO'}")
    summary: dict[str, Any] = {"requests": args.requests, "words": args.words,
                               "prompt_tokens": _med(rows[ok[0]], "prompt_tokens") if ok else None}
    for k in ok:
        summary[f"{k}_transfer_ms"] = round(_med(rows[k], "transfer_ms"), 4)
        summary[f"{k}_transfer_p90_ms"] = round(_p90(rows[k], "transfer_ms"), 4)
        # the fastest request: the copy without the host's preemptions (they only ever add time)
        summary[f"{k}_transfer_min_ms"] = round(min((r["transfer_ms"] for r in rows[k]), default=0.0), 4)
        summary[f"{k}_descriptors"] = _med(rows[k], "descriptors")
        summary[f"{k}_bytes"] = _med(rows[k], "bytes")
        summary[f"{k}_ttft_ms"] = round(_med(rows[k], "ttft_ms"), 2)
        if SINGLE not in errors and len(rows[SINGLE]) == args.requests:
            summary.update({f"{k}_{n}": v for n, v in vs_single(rows[k], rows[SINGLE]).items()})
        if CONNECTORS[k]["name"] == "DSAConnector":
            summary[f"{k}_failed_loads"] = int(sum(r.get("failed", 0.0) for r in rows[k]))
        if CONNECTORS[k].get("layer_push"):
            summary[f"{k}_layered_share"] = layered_share(rows[k])
        if k in headers:
            summary[f"{k}_x_kv_transfer"] = headers[k]
    for k, e in errors.items():
        summary[f"{k}_error"] = e
    summary["ttft_single_ms"] = round(_med(rows[SINGLE], "ttft_ms"), 2) if SINGLE not in errors else None
    summary["ttft_single_p90_ms"] = round(_p90(rows[SINGLE], "ttft_ms"), 2) if SINGLE not in errors else None
    summary["prefill_max_batched_tokens"] = args.prefill_max_batched_tokens
    nixl = [summary[f"{k}_transfer_ms"] for k in ("nixl", "nixl_push") if k in ok]
    best = min(nixl) if nixl else 0.0
    summary["ratio_vs_best_nixl"] = (round(summary["dsa_transfer_ms"] / best, 3) if best and "dsa" in ok else None)
    summary["outputs_match"] = bool(match) and all(match) and not errors
    print("\ntransfer per request, median (p90): " + ", ".join(
        f"{k} {summary[f'{k}_transfer_ms']} ({summary[f'{k}_transfer_p90_ms']}) ms" for k in ok)
        + f"; DSA / best NIXL {summary['ratio_vs_best_nixl']}; outputs match (every P/D run and one engine): "
        f"{summary['outputs_match']}")
    if SINGLE not in errors:
        print("TTFT per request, median (p90) and against the one engine (median ratio, median TTFT - its TTFT): "
              + "; ".join(f"{k} {summary[f'{k}_ttft_ms']} ({summary.get(f'{k}_ttft_p90_ms')}) ms, "
                          f"{summary.get(f'{k}_ttft_ratio_vs_single')}x, {summary.get(f'{k}_overhead_ms')} ms"
                          for k in ok) + f"; one engine {summary['ttft_single_ms']} ms"
              + "".join(f"; {k}: layered share {summary[f'{k}_layered_share']}" for k in ok
                        if f"{k}_layered_share" in summary))
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["outputs_match"] else 1
