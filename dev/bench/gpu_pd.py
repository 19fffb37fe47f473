"""GPU P/D bench: DSAConnector (and vLLM's NixlConnector beside it) on one GPU, pages, page tables and timings.

Runs on a host with vLLM's GPU build (see shared/gpu/README.md for the H200 payload). Each pair (``--pairs``:
``name=connector/mode/kv_cache_dtype``; connector ``dsa`` or ``nixl``, mode ``eager`` (``--enforce-eager``)
or ``graphs`` (vLLM's default torch.compile + CUDA graphs; async scheduling is vLLM's default either way);
a DSAConnector pair whose name has ``verify`` runs with ``verify_transfers``, ``bounce`` with
``bounce_mode=always`` (the staging arena on the device), ``ipc`` with ``ipc_mode=auto`` (on one GPU D
routes every pair through CUDA IPC), ``mtp`` serves ``--mtp-model`` with MTP speculative decoding, ``early``
times requests with early registration (both legs at once, one ``transfer_id``: D registers while P
prefills) and ``layer_push`` on P (``nolp``: without it), ``chunk`` prefills on P in 512-token chunks)
is a prefill and a decode engine with the KV probe worker extension; every engine starts at once
(``--kv-cache-memory-bytes``, so concurrent starts on one GPU do not disturb each other's memory profile).
Per pair:

- **pages**: three turns as multi-turn traffic has them (a prompt of 3 blocks + 1 token, one that keeps its
  first 3 blocks so D serves them from its own prefix cache, one that keeps 2). P prefills
  (``do_remote_decode``), D decodes with P's ``kv_transfer_params`` and, while it runs, the probe returns
  D's block list and a CRC32 per layer and block; P's come from the prefill request's own blocks (named by
  its ``kv_transfer_params``, read before D loads). Every full block must be equal on every layer (a block D
  served from its own prefix cache: equal to what P computed for it in the earlier turn).
- **page table** (DSAConnector pairs): the table the connector built from the engine's ``kv_caches``
  (``KVProbe.dsa_page_table``) against the offline builder's prediction (``connector.page_tables.build_offline``, what
  ``vllm-dsa inspect`` prints) for the same model, block size, KV cache dtype, KV cache layout and block
  count, every offset included; pointers, allocation sizes and the device left out.
- **burst** (``--burst N``): first of all, on the fresh pair, N P/D requests at once (an early pair's through
  both legs at once): the first requests of a pair overlap its handshake and its cold connections; every one
  must complete, and D's loads are counted.
- **timing**: fresh prompts of 16 and 30 blocks, one request at a time (the first, with the peer
  handshake, reported apart): TTFT as the client sees it (P's one-token prefill + D's first streamed
  token), the connector's own transfer time from its metrics (DSAConnector: P's post-to-completion
  ``vllm:dsa_kv_transfer_seconds``; NixlConnector: D's ``vllm:nixl_xfer_time_seconds``), bytes and NIXL
  descriptors, and whether D's 8 greedy tokens equal P's own plain reply (bf16 with random weights can flip
  a flat argmax: the pages are the exact check, the reply rate is reported). Every shape also times the same
  prompt on P alone (``single_ttft_ms``: one engine without P/D), and ``--timing-blocks`` sets the shapes
  (``128``: 8k-token prompts). An ``early`` pair's TTFT runs from sending both legs to D's first token.
  ``transfer_ms`` is per (request, destination rank) for every contender: DSAConnector observes one span per
  request and D rank (post to the last part's completion), NixlConnector one READ per request and P rank.
- **span** (the same for every connector): from P's prefill end (the last forward with prefill tokens
  finished on P's device) to D's KV ready (D's connector reported the request received), both
  ``time.monotonic()`` of this one host (``KVProbe.dsa_span_marks``): ``span_ms`` per request.

A real-width slice: ``vllm-dsa make-model --kind dsa --width deepseek-v3.2 --out M`` and ``--load-format
dummy`` (``--max-model-len`` for 32k-token prompts: ``--timing-blocks 128,512``).

    python dev/bench/gpu_pd.py --model /tmp/models/tiny-glm-dsa-h32-k128 \\
        [--pairs dsa=dsa/graphs/auto,nixl=nixl/graphs/auto,fp8=dsa/graphs/fp8_ds_mla]

Prints a JSON line and writes ``$OUT/gpu_pd.json`` (and trimmed engine logs) when ``OUT`` is set; exit 1
when a DSAConnector page or page table differs or one of its turns fails (NixlConnector results are
reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dsa_dev.harness.client import complete, metric, post_json, scrape
from vllm_dsa_dev.harness.pages import pd_pages
from vllm_dsa_dev.harness.procs import Cluster, Proc, cluster, wait_healthy

BLOCK = 64
MAX_MODEL_LEN = 9000  # 8k-token prompts (--timing-blocks 128) and their replies (--max-model-len)
ENGINE_ARGS: list[str] = []  # every engine's extra arguments (--load-format)
PROBE = ["--worker-extension-cls", "vllm_dsa_dev.kv_probe.KVProbe"]
CONNECTORS = ("dsa", "nixl")
MODES = ("eager", "graphs")
LOG_MARKS = ("attention backend", "DSAConnector", "NixlConnector", "sync scheduling", "CUDA graph",
             "kv_cache_dtype", "KV cache", "Error", "Traceback", "WARNING")


@dataclass(frozen=True)
class PairSpec:
    """One P/D pair of the run."""

    name: str
    connector: str
    mode: str
    kv_cache_dtype: str

    @classmethod
    def parse(cls, text: str) -> PairSpec:
        name, _, rest = text.partition("=")
        parts = rest.split("/")
        if not name or len(parts) != 3 or parts[0] not in CONNECTORS or parts[1] not in MODES:
            raise SystemExit(f"--pairs: {text!r} is not name=connector/mode/kv_cache_dtype with connector in "
                             f"{CONNECTORS} and mode in {MODES}")
        if parts[0] != "dsa" and any(flag in name for flag in ("verify", "bounce")):
            raise SystemExit(f"--pairs: {text!r}: \"verify\" and \"bounce\" pairs need connector dsa")
        return cls(name, parts[0], parts[1], parts[2])

    @property
    def early(self) -> bool:
        """The pair's requests are timed with early registration."""
        return "early" in self.name and self.connector == "dsa"

    @property
    def layer_push(self) -> bool:
        """P posts layer by layer (``layer_push``): an early pair unless its name has ``nolp``."""
        return self.early and "nolp" not in self.name

    @property
    def chunked(self) -> bool:
        """P prefills in 512-token chunks (``--max-num-batched-tokens 512``): D registers before the last."""
        return "chunk" in self.name

    @property
    def mtp(self) -> bool:
        """The pair serves ``--mtp-model`` with MTP speculative decoding (one draft token)."""
        return "mtp" in self.name


def _engine(c: Cluster, name: str, spec: PairSpec, model: str, port: int, side: int, role: str,
            kv_bytes: int) -> tuple[Proc, str]:
    # the tiny model states max_position_embeddings 4096; the 8k-token timing prompts need more (random
    # weights: the positions past it only have to run, not to mean anything)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if spec.connector == "dsa":
        extra: dict[str, Any] = {"verify_transfers": "verify" in spec.name, "side_channel_port": side}
        if "ipc" in spec.name:  # on one GPU, D then routes every pair through CUDA IPC
            extra["ipc_mode"] = "auto"
        if "bounce" in spec.name:
            extra["bounce_mode"] = "always"
        if spec.layer_push:
            extra["layer_push"] = True
        cfg: dict[str, Any] = {"kv_connector": "DSAConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                               "kv_connector_extra_config": extra, "engine_id": f"{spec.name}-{role}"}
    else:
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
           "--seed", "0", "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(kv_bytes),
           "--kv-cache-dtype", spec.kv_cache_dtype, "--kv-transfer-config", json.dumps(cfg), *PROBE, *ENGINE_ARGS]
    if spec.mode == "eager":
        cmd.append("--enforce-eager")
    if spec.chunked and role == "kv_producer":
        cmd += ["--max-num-batched-tokens", "512"]  # chunked: D registers before the final chunk
    if spec.mtp:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]
    return c.start(name, cmd, env), f"http://127.0.0.1:{port}"


def _rng_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def _turns() -> list[list[int]]:
    rng = random.Random(7)
    x = _rng_ids(rng, 3 * BLOCK + 1)
    y = x[: 3 * BLOCK] + _rng_ids(rng, 2 * BLOCK + 1)
    z = y[: 2 * BLOCK] + _rng_ids(rng, 3 * BLOCK + 1)
    return [x, y, z]


def _pages(p_url: str, d_url: str, model: str, recv_bytes: Any) -> dict[str, Any]:
    """Three turns (:func:`_turns`), each checked by :func:`vllm_dsa_dev.harness.pages.pd_pages`: D's pages of
    every full prompt block against P's pages of the prefill request itself, or, where D served a block from
    its own prefix cache, against P's pages of an earlier turn with the same tokens up to it."""
    out: list[dict[str, Any]] = []
    ok = True
    seen: list[tuple[list[int], dict[str, list[int]]]] = []  # (prompt, P's per-layer digests) of earlier turns
    for turn, ids in enumerate(_turns(), 1):
        row: dict[str, Any] = {"turn": turn, "prompt_tokens": len(ids)}
        try:
            recv0 = recv_bytes()
            got = pd_pages(p_url, d_url, "tiny", ids, BLOCK, seen)
            time.sleep(1.0)
            row["recv_bytes"] = recv_bytes() - recv0
            seen.append((ids, got.pop("p_layers")))
            got["equal_to_earlier_turn"] = got.pop("equal_to_earlier")
            row.update(got)
        except Exception as e:  # noqa: BLE001 - a failed turn is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        ok = ok and bool(row.get("pages_equal"))
        out.append(row)
        print(f"[gpu_pd] turn {turn} ({model}): {row}", flush=True)
    return {"turns": out, "ok": ok}


def _shape(table: dict[str, Any]) -> dict[str, Any]:
    """A page table without what differs from run to run (pointers, allocation sizes, device)."""
    return {**{k: v for k, v in table.items() if k != "pools"},
            "pools": [{"block_stride": p["block_stride"], "num_blocks": p["num_blocks"]} for p in table["pools"]]}


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: engine {a!r} vs offline {b!r}"]


def _table_check(url: str, model: str, kv_cache_dtype: str) -> dict[str, Any]:
    from vllm_dsa_connector.connector.page_tables import build_offline

    out = post_json(url + "/collective_rpc", {"method": "dsa_page_table"})
    (got,) = [t for t in out["results"] if t]
    engine, layout = got["table"], got["kv_cache_layout"]
    dtype = engine["kv_cache_dtype"]
    (offline,) = build_offline(model, block_size=engine["block_size"], kv_cache_dtype=dtype,
                               num_blocks=engine["pools"][0]["num_blocks"], layout=layout)
    diffs = _diff(_shape(engine), _shape(offline.to_dict()))
    views = [(v["role"], v["page_format"], v["bytes_per_token"], [e["global_layer"] for e in v["entries"]])
             for v in engine["views"]]
    return {"requested_dtype": kv_cache_dtype, "engine_dtype": dtype, "kv_cache_layout": layout,
            "pools": len(engine["pools"]),
            "block_strides": [p["block_stride"] for p in engine["pools"]], "views": views,
            "bytes_per_block": sum(e["nbytes"] for v in engine["views"] for e in v["entries"]),
            "equal": not diffs, "differences": diffs[:20]}


def _stream_d(d_url: str, ids: list[int], params: dict[str, Any] | None, max_tokens: int) -> tuple[float, str]:
    """Seconds to D's first streamed token and the text of ``max_tokens`` greedy tokens."""
    body: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(d_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    text: list[str] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[5:]).get("choices", []):
                if ch.get("text"):
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(ch["text"])
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def _counters(connector: str, p_url: str, d_url: str) -> dict[str, float]:
    mp, md = scrape(p_url), scrape(d_url)
    if connector == "dsa":
        return {"xfer_s": metric(mp, "vllm:dsa_kv_transfer_seconds_sum"),
                "xfers": metric(mp, "vllm:dsa_kv_transfer_seconds_count"),
                "bytes": metric(md, "vllm:dsa_kv_bytes_total", side="recv"),
                "descriptors": metric(mp, "vllm:dsa_kv_descriptors_total"),
                "bounce_bytes": metric(mp, "vllm:dsa_kv_bounce_bytes_total"),
                "ipc_bytes": metric(mp, "vllm:dsa_kv_ipc_bytes_total"),
                "layered_bytes": metric(mp, "vllm:dsa_kv_layered_bytes_total"),
                "recv_ok": metric(md, "vllm:dsa_kv_requests_total", side="recv", outcome="ok")}
    return {"xfer_s": metric(md, "vllm:nixl_xfer_time_seconds_sum"),
            "xfers": metric(md, "vllm:nixl_xfer_time_seconds_count"),
            "bytes": metric(md, "vllm:nixl_bytes_transferred_sum"),
            "descriptors": metric(md, "vllm:nixl_num_descriptors_sum"),
            "failed": metric(md, "vllm:nixl_num_failed_transfers_total")}


def _marks(url: str) -> dict[str, Any]:
    """The engine's span marks (``KVProbe.dsa_span_marks``; the first call hooks its worker)."""
    return post_json(url + "/collective_rpc", {"method": "dsa_span_marks"})["results"][0]


def _span(p_url: str, d_url: str, since: float) -> float | None:
    """Seconds from P's prefill end to D's KV ready of the one request sent at ``since`` (``time.monotonic()``):
    D's first KV-ready mark after ``since``, P's last prefill forward end between the two."""
    try:
        ready = [t for t, _ in _marks(d_url)["kv_ready"] if t >= since]
        ends = [t for t in _marks(p_url)["forward_ends"] if ready and since <= t <= min(ready)]
    except Exception as e:  # noqa: BLE001 - no span for this request, the rest of it stands
        print(f"[gpu_pd] span marks: {type(e).__name__}: {e}", flush=True)
        return None
    return min(ready) - max(ends) if ready and ends else None


def _early_legs(p_url: str, d_url: str, ids: list[int], p_side: dict[str, Any]) -> tuple[float, float, str]:
    """Both legs at once with one transfer id (what ``pd_proxy --early-registration`` sends): (seconds to P's
    answer, seconds to D's first token, D's text), both from sending."""
    import secrets
    from concurrent.futures import ThreadPoolExecutor

    tid = secrets.token_hex(16)
    dparams = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
               "transfer_mode": "dsa-push", "kv_connector": "DSAConnector",
               **{k: p_side[k] for k in ("remote_engine_id", "remote_host", "remote_port")}}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        p_leg = pool.submit(post_json, p_url + "/v1/completions", {
            "model": "tiny", "prompt": ids, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}})
        first, text = _stream_d(d_url, ids, dparams, 8)
        p_leg.result(120)
        prefill = time.perf_counter() - t0
    return prefill, first, text


def _timing(connector: str, p_url: str, d_url: str, repeats: int, shapes_blocks: list[int],
            early: bool = False) -> dict[str, Any]:
    rng = random.Random(11)
    shapes = [shapes_blocks[0]] + [b for b in shapes_blocks for _ in range(repeats)]
    rows = []
    p_side: dict[str, Any] = {}
    for k, blocks in enumerate(shapes):
        ids = _rng_ids(rng, blocks * BLOCK)
        row: dict[str, Any] = {"blocks": blocks, "warmup": k == 0}
        try:
            single, _ = _stream_d(p_url, ids, None, 1)  # one engine without P/D (P's own prefix cache: a
            ids = _rng_ids(rng, blocks * BLOCK)  # fresh prompt of the same shape for the P/D request)
            c0 = _counters(connector, p_url, d_url)
            since = time.monotonic()
            t0 = time.perf_counter()
            if early and p_side:
                prefill, first, text = _early_legs(p_url, d_url, ids, p_side)
                ttft = first
            else:
                res = post_json(p_url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
                prefill = time.perf_counter() - t0
                p_side = res.get("kv_transfer_params") or {}
                first, text = _stream_d(d_url, ids, res.get("kv_transfer_params"), 8)
                ttft = prefill + first
            time.sleep(0.2)  # the marks' watcher takes P's device time once it got there
            span = _span(p_url, d_url, since)  # before the plain reply (another forward on P)
            plain = complete(p_url, "tiny", ids, 8)["choices"][0]["text"]
            time.sleep(1.0)
            c1 = _counters(connector, p_url, d_url)
            delta = {k2: c1[k2] - c0[k2] for k2 in c0}
            row.update(ttft_ms=round(ttft * 1e3, 2), single_ttft_ms=round(single * 1e3, 2),
                       p_prefill_ms=round(prefill * 1e3, 2), d_first_token_ms=round(first * 1e3, 2),
                       transfer_ms=round(delta["xfer_s"] / delta["xfers"] * 1e3, 3) if delta["xfers"] else None,
                       span_ms=round(span * 1e3, 3) if span is not None else None,
                       reply_equal=text == plain, **{k2: v for k2, v in delta.items() if k2 != "xfer_s"})
        except Exception as e:  # noqa: BLE001 - reported per request
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(f"[gpu_pd] {connector} timing: {row}", flush=True)
    summary = {}
    for blocks in sorted({r["blocks"] for r in rows}):
        ok = [r for r in rows if r["blocks"] == blocks and not r["warmup"] and "error" not in r]
        if ok:
            summary[str(blocks)] = {
                "n": len(ok),
                "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in ok), 2),
                "single_ttft_ms_median": round(statistics.median(r["single_ttft_ms"] for r in ok), 2),
                "ttft_ratio_vs_single": round(statistics.median(r["ttft_ms"] / r["single_ttft_ms"] for r in ok), 3),
                "d_first_token_ms_median": round(statistics.median(r["d_first_token_ms"] for r in ok), 2),
                "transfer_ms_median": (round(statistics.median(r["transfer_ms"] for r in ok if r["transfer_ms"]), 3)
                                       if any(r["transfer_ms"] for r in ok) else None),
                "transfers_per_request": ok[0].get("xfers"),
                "span_ms_median": (round(statistics.median(r["span_ms"] for r in ok if r.get("span_ms") is not None), 3)
                                   if any(r.get("span_ms") is not None for r in ok) else None),
                "bytes": ok[0]["bytes"], "descriptors": ok[0]["descriptors"],
                "bounce_bytes": ok[0].get("bounce_bytes"), "ipc_bytes": ok[0].get("ipc_bytes"),
                "layered_bytes": ok[0].get("layered_bytes"),
                "reply_equal": sum(r["reply_equal"] for r in ok)}
    return {"requests": rows, "summary": summary}


def _burst(connector: str, p_url: str, d_url: str, n: int, blocks: int, early: bool) -> dict[str, Any]:
    """``n`` P/D requests at once (fresh prompts of ``blocks`` blocks; an early pair's through both legs at once):
    how many completed, D's loads counted ok, each one's TTFT, and what failed. Real traffic overlaps: a
    notice, lease or block list shared or lost between concurrent requests shows here."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(23)
    prompts = [_rng_ids(rng, blocks * BLOCK) for _ in range(n)]

    def sequential(ids: list[int]) -> tuple[float, str, dict[str, Any]]:
        t0 = time.perf_counter()
        res = post_json(p_url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_decode": True}})
        prefill = time.perf_counter() - t0
        first, text = _stream_d(d_url, ids, res.get("kv_transfer_params"), 8)
        return prefill + first, text, res.get("kv_transfer_params") or {}

    p_side: dict[str, Any] = {}
    if early:  # P's side-channel address, as the proxy knows it
        p_side = sequential(_rng_ids(rng, BLOCK + 1))[2]

    def one(ids: list[int]) -> tuple[float, str]:
        if early:
            _, first, text = _early_legs(p_url, d_url, ids, p_side)
            return first, text
        ttft, text, _ = sequential(ids)
        return ttft, text

    c0 = _counters(connector, p_url, d_url)
    t0 = time.perf_counter()
    ttfts, errors = [], []
    with ThreadPoolExecutor(n) as pool:
        for fut in [pool.submit(one, ids) for ids in prompts]:
            try:
                first, text = fut.result(300)
                ttfts.append(first)
                if not text:
                    errors.append("empty reply")
            except Exception as e:  # noqa: BLE001 - reported per request
                errors.append(f"{type(e).__name__}: {e}"[:300])
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    c1 = _counters(connector, p_url, d_url)
    out = {"requests": n, "blocks": blocks, "completed": len(ttfts) - sum(e == "empty reply" for e in errors),
           "wall_s": round(wall, 3), "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 2) if ttfts else None,
           "ttft_ms_max": round(max(ttfts) * 1e3, 2) if ttfts else None, "errors": errors[:8],
           "bytes": c1["bytes"] - c0["bytes"]}
    if "recv_ok" in c0:
        out["d_loads_ok"] = c1["recv_ok"] - c0["recv_ok"]
    print(f"[gpu_pd] {connector} burst: {out}", flush=True)
    return out


def _key_lines(proc: Proc, limit: int = 40) -> list[str]:
    lines = proc.log.read_text(errors="replace").splitlines()
    keep = [ln[:400] for ln in lines if any(m in ln for m in LOG_MARKS) and "non-default args" not in ln]
    return keep[:limit]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--pairs", default="dsa=dsa/graphs/auto,nixl=nixl/graphs/auto,fp8=dsa/graphs/fp8_ds_mla",
                    help="name=connector/mode/kv_cache_dtype,...; DSAConnector pairs whose name has \"verify\" run "
                         "with verify_transfers (CRC of every run on the device pools)")
    ap.add_argument("--mtp-model", default=None,
                    help="the model of pairs whose name has \"mtp\" (make-model --mtp-layers 1): served with MTP "
                         "speculative decoding, one draft token")
    ap.add_argument("--pair-model", action="append", default=[], metavar="NAME=PATH",
                    help="the model of pair NAME instead of --model (or --mtp-model); repeatable, e.g. two MTP "
                         "pairs at different widths")
    ap.add_argument("--base-port", type=int, default=9100)
    ap.add_argument("--kv-cache-bytes", type=int, default=4 << 30)
    ap.add_argument("--startup-timeout", type=float, default=480.0)
    ap.add_argument("--repeats", type=int, default=4, help="timed requests per prompt shape (default 4)")
    ap.add_argument("--timing-blocks", default="16,30",
                    help="prompt shapes of the timing, in 64-token blocks (default 16,30; 128: 8k tokens)")
    ap.add_argument("--burst", type=int, default=0,
                    help="after the timing, this many P/D requests at once per pair (0: none)")
    ap.add_argument("--burst-blocks", type=int, default=16, help="prompt blocks of each burst request")
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                    help=f"every engine's --max-model-len (default {MAX_MODEL_LEN}; 33000 for --timing-blocks 512)")
    ap.add_argument("--load-format", default=None,
                    help="every engine's --load-format (dummy: a config-only model, e.g. make-model --width "
                         "deepseek-v3.2)")
    args = ap.parse_args()
    globals()["MAX_MODEL_LEN"] = args.max_model_len
    if args.load_format:
        ENGINE_ARGS.extend(["--load-format", args.load_format])
    specs = [PairSpec.parse(x) for x in args.pairs.split(",") if x]
    model_of = {s.name: (args.mtp_model if s.mtp else args.model) for s in specs}
    for text in args.pair_model:
        name, _, path = text.partition("=")
        if name not in model_of or not path:
            raise SystemExit(f"--pair-model: {text!r} is not NAME=PATH with NAME one of the pairs {sorted(model_of)}")
        model_of[name] = path
    if any(s.mtp and not model_of[s.name] for s in specs):
        raise SystemExit("--pairs: a pair named \"mtp\" needs --mtp-model or --pair-model (a model with an MTP layer)")
    t_start = time.time()
    # transfer_ms: one observation per (request, destination rank) for every connector (issue 49)
    result: dict[str, Any] = {"model": args.model, "block_size": BLOCK, "pairs": {}, "argv": sys.argv[1:],
                              "transfer_unit": "request"}
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="gpu-pd-"))
    with cluster(work / "engines") as c:
        procs = {}
        for k, spec in enumerate(specs):
            base = args.base_port + 10 * k
            procs[spec.name] = (
                _engine(c, f"{spec.name}-P", spec, model_of[spec.name], base, base + 3, "kv_producer",
                        args.kv_cache_bytes),
                _engine(c, f"{spec.name}-D", spec, model_of[spec.name], base + 1, base + 4, "kv_consumer",
                        args.kv_cache_bytes))
        for spec in specs:
            (pp, pu), (dp, du) = procs[spec.name]
            res: dict[str, Any] = {"connector": spec.connector, "mode": spec.mode, "kv_cache_dtype": spec.kv_cache_dtype,
                                   "model": model_of[spec.name]}
            try:
                for url in (pu, du):
                    wait_healthy(url, [pp, dp], args.startup_timeout)
                res["up_s"] = round(time.time() - t_start, 1)

                def recv(connector: str = spec.connector, d_url: str = du) -> float:
                    return _counters(connector, d_url, d_url)["bytes"] if connector == "nixl" else \
                        metric(scrape(d_url), "vllm:dsa_kv_bytes_total", side="recv")

                for url in (pu, du):
                    try:
                        _marks(url)  # hook the workers (span marks) before any request
                    except Exception as e:  # noqa: BLE001 - the pair runs without spans
                        res.setdefault("span_error", f"{type(e).__name__}: {e}"[:300])
                if args.burst:  # first, on the fresh pair: concurrent first requests (handshake, cold connections)
                    res["burst"] = _burst(spec.connector, pu, du, args.burst, args.burst_blocks, spec.early)
                res["pages"] = _pages(pu, du, model_of[spec.name], recv)
                if spec.connector == "dsa":
                    res["page_table"] = {"P": _table_check(pu, model_of[spec.name], spec.kv_cache_dtype),
                                         "D": _table_check(du, model_of[spec.name], spec.kv_cache_dtype)}
                res["timing"] = _timing(spec.connector, pu, du, args.repeats,
                                        [int(b) for b in args.timing_blocks.split(",")], early=spec.early)
            except Exception as e:  # noqa: BLE001 - one pair failing does not hide the others
                res["error"] = f"{type(e).__name__}: {e}"[:800]
            res["log"] = {proc.name: _key_lines(proc) for proc in (pp, dp)}
            result["pairs"][spec.name] = res
            for proc in (pp, dp):
                if out_dir is not None:
                    tail = proc.log.read_text(errors="replace").splitlines()[-400:]
                    (out_dir / f"{proc.name}.log").write_text("\n".join(tail))
                c.stop(proc)
    judged = [r for r in result["pairs"].values() if r["connector"] == "dsa"]
    result["ok"] = all(r.get("pages", {}).get("ok") and all(t["equal"] for t in r.get("page_table", {}).values())
                       and r.get("page_table") and (not args.burst or r.get("burst", {}).get("completed") == args.burst)
                       for r in judged)
    nixl = result["pairs"].get("nixl", {}).get("timing", {}).get("summary", {})
    side: dict[str, dict[str, Any]] = {}
    for name, pair in result["pairs"].items():
        if pair["connector"] != "dsa" or pair.get("kv_cache_dtype") != "auto" or "mtp" in name:
            continue
        for blocks, s in pair.get("timing", {}).get("summary", {}).items():
            n = nixl.get(blocks)
            if n:
                side.setdefault(name, {})[blocks] = {
                    "ttft_nixl_over_dsa": round(n["ttft_ms_median"] / s["ttft_ms_median"], 3),
                    "transfer_nixl_over_dsa": (round(n["transfer_ms_median"] / s["transfer_ms_median"], 3)
                                               if n["transfer_ms_median"] and s["transfer_ms_median"] else None),
                    "span_nixl_over_dsa": (round(n["span_ms_median"] / s["span_ms_median"], 3)
                                           if n.get("span_ms_median") and s.get("span_ms_median") else None)}
    result["side_by_side"] = side
    result["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(result))
    if out_dir is not None:
        (out_dir / "gpu_pd.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
