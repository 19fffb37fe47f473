"""HTTP client side of the harness: Prometheus ``/metrics`` and OpenAI-compatible requests (stdlib only)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any


def scrape(url: str) -> dict[str, float]:
    """Prometheus text of ``url``/metrics as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                continue
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, val in m.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(re.search(rf'\b{k}="{re.escape(v)}"', rest) for k, v in labels.items()):
            total += val
    return total


@dataclass(frozen=True)
class Reply:
    """One chat completion."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int


def post_json(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """POST ``body`` as JSON, return the JSON answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read() or b"{}")
    return out


def complete(url: str, model: str, prompt_ids: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request of ``url`` on token ids; returns vLLM's JSON answer.

    The prompt is ``prompt_ids`` (no tokenizer round trip), EOS is ignored (exactly ``max_tokens`` tokens)
    and the answer carries the generated ids (``choices[0]["token_ids"]``). ``kv_transfer_params`` is sent
    as is: ``{"do_remote_decode": True}`` makes a P/D prefill whose answer holds the params for D; D then
    gets those params back with the same ids.
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return post_json(url + "/v1/completions", body, timeout_s)


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float = 600.0) -> Reply:
    """A streamed greedy chat completion (TTFT measured at the first content chunk); ``timeout_s`` bounds each
    wait for the server (connect, first byte, every chunk)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    prompt_tokens = 0
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
            for ch in chunk.get("choices", []):
                content = (ch.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(content)
    total = time.perf_counter() - t0
    return Reply("".join(parts), ttft if ttft is not None else total, total, prompt_tokens)


def probe_running(url: str, model: str, prompt_ids: list[int], kv_transfer_params: dict[str, Any] | None = None,
                  timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Start a long greedy streamed completion of ``prompt_ids`` on ``url`` and, while it runs, return every
    worker's :meth:`~vllm_dsa_dev.kv_probe.KVProbe.dsa_probe_running` entry for it (rank order).

    The engine needs ``--worker-extension-cls vllm_dsa_dev.kv_probe.KVProbe`` and
    ``VLLM_SERVER_DEV_MODE=1`` (``POST /collective_rpc``). The completion is aborted once probed. Raises
    RuntimeError when the request finishes, or ``timeout_s`` passes, before any worker reports it.
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids, "max_tokens": 400, "ignore_eos": True,
                            "temperature": 0.0, "stream": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=timeout_s)
    done = threading.Event()

    def drain() -> None:
        try:
            for _ in resp:
                if done.is_set():
                    break
        except (OSError, ValueError, AttributeError):  # the connection closed under the reader
            pass
        done.set()

    wanted = json.dumps(list(prompt_ids))  # only this request is digested (an engine under load is not stalled)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = post_json(url + "/collective_rpc", {"method": "dsa_probe_running", "args": [wanted]}, timeout_s)
            found = [entry for worker in out["results"] for entry in worker or []
                     if entry["prompt_token_ids"] == list(prompt_ids)]
            if found:
                return found
            if done.is_set():
                raise RuntimeError(f"request on {url} finished before the probe saw it")
            time.sleep(0.05)
        raise RuntimeError(f"request on {url} not seen running within {timeout_s} s")
    finally:
        done.set()
        resp.close()  # aborts the rest of the generation
        reader.join(timeout=10)
