"""``vllm-dsa bench tokenizer``: prefix token cache vs full encode on growing multi-turn chat prompts.

Conversations are rendered with the Qwen chat format (``<|im_start|>role\\n...<|im_end|>\\n``) and tokenized with
the Qwen3 (NFC) tokenizer. Text is deterministic and varied: Python standard-library sources and docstrings,
taken in sorted module order. Each conversation first grows with large turns (pasted files) to near the
target size, then continues with ``--turns`` measured requests of ordinary size (a user message and an assistant
reply each). Times are wall-clock (``perf_counter``) and, as a check on a busy machine, process CPU time.
Every request goes through the cache; every cached result is compared with a full encode
(outside the timed region). Prints median per-request times, the speedup, hit rate, fallbacks and mismatches;
with ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TARGETS = (38_000, 128_000)


def corpus() -> Iterator[str]:
    """Standard-library module docstrings and sources, in a fixed order (skips unreadable modules)."""
    import importlib.util

    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this"}:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec else None
        if not origin or not origin.endswith(".py"):
            continue
        try:
            source = Path(origin).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        doc = inspect.cleandoc(source.split('"""')[1]) if source.count('"""') >= 2 else ""
        if doc:
            yield doc
        yield source


class TextSource:
    """Deterministic chunks of real text, cut at line ends."""

    def __init__(self) -> None:
        self._lines: Iterator[str] = (line for text in _cycle(corpus) for line in text.splitlines(True))

    def take(self, chars: int) -> str:
        out: list[str] = []
        n = 0
        while n < chars:
            line = next(self._lines)
            out.append(line)
            n += len(line)
        return "".join(out).strip("\n") or "ok"


def _cycle(factory: Any) -> Iterator[str]:
    while True:
        yield from factory()


def render(messages: list[tuple[str, str]]) -> str:
    """Qwen chat format with the generation prompt."""
    parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def run_scenario(tok: Any, target: int, turns: int, seed: int, cache_options: dict[str, Any]) -> dict[str, Any]:
    from vllm_dsa_connector.tokenizer import PrefixTokenCache

    cache = PrefixTokenCache(tok, **cache_options)
    src = TextSource()
    for _ in range(seed):
        src.take(500)
    messages: list[tuple[str, str]] = [("system", "You are a careful assistant for Python code review.\n"
                                        + src.take(3000))]
    # Ordinary turn sizes (chars), varied deterministically: user 150..1500, assistant 200..1800.
    sizes = [(150 + (i * 577) % 1350, 200 + (i * 911) % 1600) for i in range(turns)]
    window_tokens = int(sum(u + a for u, a in sizes) / 4.0)  # ~4 chars per token on this text
    build_to = max(0, target - window_tokens // 2)  # the measured requests straddle the target size
    full_ms: list[float] = []
    cache_ms: list[float] = []
    full_cpu: list[float] = []
    cache_cpu: list[float] = []
    lengths: list[int] = []
    mismatches = 0

    def request(measure: bool) -> int:
        nonlocal mismatches
        text = render(messages)
        c0, t0 = time.process_time(), time.perf_counter()
        got = cache.encode(text)
        c1, t1 = time.process_time(), time.perf_counter()
        ref = tok(text, add_special_tokens=False)["input_ids"]
        c2, t2 = time.process_time(), time.perf_counter()
        if got != ref:  # verification, outside the timed regions
            mismatches += 1
        if measure:
            cache_ms.append((t1 - t0) * 1e3)
            full_ms.append((t2 - t1) * 1e3)
            cache_cpu.append((c1 - c0) * 1e3)
            full_cpu.append((c2 - c1) * 1e3)
            lengths.append(len(ref))
        return len(ref)

    n_tokens = request(False)
    while n_tokens < build_to:  # grow with pasted files and short replies
        messages.append(("user", "Please review this file:\n" + src.take(6000)))
        n_tokens = request(False)
        messages.append(("assistant", src.take(600)))
    for user_chars, assistant_chars in sizes:
        messages.append(("user", src.take(user_chars)))
        request(True)
        messages.append(("assistant", src.take(assistant_chars)))
    s = cache.stats()
    lookups = s["hits"] + s["misses"] + s["fallbacks"]
    full_med = statistics.median(full_ms)
    cache_med = statistics.median(cache_ms)
    return {
        "target_tokens": target,
        "requests_measured": len(cache_ms),
        "prompt_tokens_median": int(statistics.median(lengths)),
        "prompt_tokens_max": max(lengths),
        "full_ms_median": round(full_med, 3),
        "cache_ms_median": round(cache_med, 3),
        "cache_ms_p90": round(sorted(cache_ms)[int(0.9 * (len(cache_ms) - 1))], 3),
        "speedup": round(full_med / cache_med, 1),
        "full_cpu_ms_median": round(statistics.median(full_cpu), 3),
        "cache_cpu_ms_median": round(statistics.median(cache_cpu), 3),
        "speedup_cpu": round(statistics.median(full_cpu) / max(statistics.median(cache_cpu), 1e-6), 1),
        "hit_rate": round(s["hits"] / lookups, 3) if lookups else 0.0,
        "hits": s["hits"],
        "misses": s["misses"],
        "fallbacks": s["fallbacks"],
        "mismatches": mismatches,
        "tail_tokens": s["tail_tokens"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), help="prompt sizes (tokens)")
    parser.add_argument("--turns", type=int, default=32, help="measured requests per conversation")
    parser.add_argument("--seed", type=int, default=0, help="offset into the text corpus")


def run(args: argparse.Namespace) -> int:
    if args.turns < 1 or any(t < 1000 for t in args.targets):
        print("bench tokenizer: --turns must be >= 1 and --targets >= 1000", file=sys.stderr)
        return 2
    from vllm_dsa_connector.tokenizer.assets import qwen_tokenizer

    tok = qwen_tokenizer()
    results = []
    for target in args.targets:
        r = run_scenario(tok, target, args.turns, args.seed, {})
        results.append(r)
        print(
            f"~{target // 1000}k tokens (median prompt {r['prompt_tokens_median']}, {r['requests_measured']} "
            f"requests): full {r['full_ms_median']:.2f} ms, cache {r['cache_ms_median']:.2f} ms "
            f"(p90 {r['cache_ms_p90']:.2f}), speedup {r['speedup']:.1f}x (CPU time: {r['speedup_cpu']:.1f}x), "
            f"hit rate {r['hit_rate']:.2f}, "
            f"fallbacks {r['fallbacks']}, mismatches {r['mismatches']}"
        )
    if args.json:
        print(json.dumps({"bench": "tokenizer", "tokenizer": "qwen3-nfc", "results": results}))
    return 1 if any(r["mismatches"] for r in results) else 0
