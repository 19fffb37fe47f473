"""DeepSeek-V3.2 chat path: stock ``deepseek_v32`` tokenizer mode vs ``dsa-prefix-cache`` wrapping it, side by side.

``vllm-dsa bench tokenizer --modes [--targets 38000 128000] [--turns 16] [--json]`` (or
``python -m vllm_dsa_dev.tokenizer.bench_modes`` with the same options)

Both tokenizers are loaded by vLLM's ``get_tokenizer`` from the tiny ``DeepseekV32ForCausalLM`` directory
(:func:`~vllm_dsa_dev.tokenizer.tiny_models.make_tiny_v32`; real DeepSeek tokenizer), the second through
``--tokenizer-mode dsa-prefix-cache`` with its default options, so ``auto`` resolves to ``deepseek_v32``. A
conversation (system prompt with two tools, pasted files, assistant replies with reasoning and tool calls)
grows to near each target, then ``--turns`` requests are measured: ``apply_chat_template(messages, tools,
thinking=...)``, i.e. DeepSeek-V3.2's Python encoding plus text -> ids, as the renderer runs it. In thinking
mode the encoding rewrites the previous turn (``<think>`` after the last user message becomes ``</think>``
and earlier reasoning is dropped), so a prompt is not a literal extension of the previous one. Each request is
timed on both tokenizers (wall clock and process CPU time); the text -> ids step alone is timed as a full
encode vs the cache; every cached result is compared with the stock ids outside the timed regions. Text comes
from :mod:`.workloads` (standard-library sources). Printed by :func:`.bench_cache.report`, like
``vllm-dsa bench tokenizer``'s own results. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from vllm_dsa_dev.tokenizer.bench_cache import TARGETS

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite.",
                                      "parameters": {"type": "object", "properties": {"k": {"type": "string"}}}}},
]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def run_scenario(stock: Any, cached: Any, cached_enc: Any, target: int, turns: int, thinking: bool,
                 seed: int) -> dict[str, Any]:
    """``cached`` runs the chat path, ``cached_enc`` (its own cache, same prompts) the text -> ids step alone."""
    from vllm_dsa_dev.tokenizer.workloads import TextSource

    src = TextSource(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You review Python code.\n" + src.take(3000)},
    ]
    times: dict[str, list[float]] = {k: [] for k in ("stock", "cache", "stock_cpu", "cache_cpu", "render",
                                                      "full", "tail")}
    lengths: list[int] = []
    mismatches = 0
    kw = {"tools": TOOLS, "thinking": thinking}

    def assistant(i: int) -> dict[str, Any]:
        calls_i = i % 3 == 0
        msg: dict[str, Any] = {"role": "assistant", "content": "" if calls_i else src.take(400),
                               "reasoning": src.take(300)}
        if calls_i:
            msg["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                  "function": {"name": "read_file", "arguments": json.dumps({"path": f"m{i}.py"})}}]
        return msg

    def request(measure: bool) -> int:
        nonlocal mismatches
        c0, t0 = time.process_time(), time.perf_counter()
        got = cached.apply_chat_template(messages, **kw)
        c1, t1 = time.process_time(), time.perf_counter()
        text = stock.apply_chat_template(messages, tokenize=False, **kw)
        t2 = time.perf_counter()
        got_enc = cached_enc.encode(text, add_special_tokens=False)
        t3 = time.perf_counter()
        if not measure:
            return len(got)
        c4, t4 = time.process_time(), time.perf_counter()
        ref = stock.apply_chat_template(messages, **kw)
        c5, t5 = time.process_time(), time.perf_counter()
        stock.encode(text, add_special_tokens=False)
        t6 = time.perf_counter()
        if got != ref or got_enc != ref:  # checked outside the timed regions
            mismatches += 1
        times["cache"].append((t1 - t0) * 1e3)
        times["cache_cpu"].append((c1 - c0) * 1e3)
        times["render"].append((t2 - t1) * 1e3)
        times["tail"].append((t3 - t2) * 1e3)
        times["stock"].append((t5 - t4) * 1e3)
        times["stock_cpu"].append((c5 - c4) * 1e3)
        times["full"].append((t6 - t5) * 1e3)
        lengths.append(len(ref))
        return len(ref)

    n = request(False)
    i = 0
    while n < target - 2000:  # grow with pasted files; every 3rd reply calls a tool
        i += 1
        messages.append({"role": "user", "content": "Please review this file:\n" + src.take(6000)})
        n = request(False)
        messages.append(assistant(i))
        if "tool_calls" in messages[-1]:
            messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": src.take(800)})
    for _ in range(turns):
        i += 1
        messages.append({"role": "user", "content": src.take(150 + (i * 577) % 1350)})
        request(True)
        messages.append(assistant(i))
        if "tool_calls" in messages[-1]:
            messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": src.take(400)})
    s = cached.prefix_cache.stats()
    stock_med, cache_med = _median(times["stock"]), _median(times["cache"])
    return {
        "target_tokens": target,
        "thinking": thinking,
        "requests_measured": len(lengths),
        "prompt_tokens_median": int(_median([float(x) for x in lengths])),
        "stock_ms_median": round(stock_med, 2),
        "cache_ms_median": round(cache_med, 2),
        "speedup": round(stock_med / max(cache_med, 1e-6), 1),
        "speedup_cpu": round(_median(times["stock_cpu"]) / max(_median(times["cache_cpu"]), 1e-6), 1),
        "render_ms_median": round(_median(times["render"]), 2),
        "encode_full_ms_median": round(_median(times["full"]), 2),
        "encode_cache_ms_median": round(_median(times["tail"]), 2),
        "encode_speedup": round(_median(times["full"]) / max(_median(times["tail"]), 1e-6), 1),
        "fallbacks": s["fallbacks"],
        "mismatches": mismatches,
    }


def run_modes(targets: list[int], turns: int, seed: int, as_json: bool) -> int:
    """Run both scenarios (chat, thinking) per target and print them through :func:`.bench_cache.report`."""
    if turns < 1 or any(t < 4000 for t in targets):
        print("bench_modes: --turns must be >= 1 and --targets >= 4000", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.tokenizers.registry import get_tokenizer

    from vllm_dsa_connector.tokenizer.modes import BASE_MODE_ENV, MODE
    from vllm_dsa_connector.tokenizer.registration import register_tokenizer_mode
    from vllm_dsa_dev.tokenizer.bench_cache import report
    from vllm_dsa_dev.tokenizer.tiny_models import make_tiny_v32

    os.environ.pop(BASE_MODE_ENV, None)
    register_tokenizer_mode()
    path = str(make_tiny_v32())
    stock = get_tokenizer(path, tokenizer_mode="deepseek_v32")
    cached = get_tokenizer(path, tokenizer_mode=MODE)
    cached_enc = get_tokenizer(path, tokenizer_mode=MODE)  # a second cache for the text -> ids timing
    results = []
    for target in targets:
        for thinking in (False, True):
            cached.prefix_cache.clear()
            cached_enc.prefix_cache.clear()
            results.append(run_scenario(stock, cached, cached_enc, target, turns, thinking, seed))
    header = (f"DeepSeek-V3.2 chat encoding: stock {type(stock).__name__} vs {MODE} over "
              f"{cached._dsa_base.describe()}")
    return report(header, {"bench": "tokenizer_modes", "mode": "deepseek_v32"}, results, as_json)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_dsa_dev.tokenizer.bench_modes``: the same as ``vllm-dsa bench tokenizer --modes``."""
    parser = argparse.ArgumentParser(prog="python -m vllm_dsa_dev.tokenizer.bench_modes")
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), help="prompt sizes (tokens)")
    parser.add_argument("--turns", type=int, default=16, help="measured requests per conversation")
    parser.add_argument("--seed", type=int, default=0, help="offset into the text corpus")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    return run_modes(args.targets, args.turns, args.seed, args.json)


if __name__ == "__main__":
    sys.exit(main())
