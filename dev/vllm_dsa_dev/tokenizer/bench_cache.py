"""The prefix token cache measured side by side with a full encode and with encoding only the new text.

For each workload (:mod:`.workloads`: ``chat``, ``prose``, ``code``, ``code-open``) and target size, a conversation grows through the
cache to near the target, then every measured request is timed three ways, back to back in one process
(the order of the first two alternates):

- ``delta_only``: ``tokenizer(delta)``, the same call on just the text added since the previous request (the
  floor a prefix cache aims at); ``delta_backend`` is the bare Rust encode of the delta (no transformers);
- ``cache``: ``PrefixTokenCache.encode(prompt)``;
- ``full``: ``tokenizer(prompt)``, whose ids every cached result is compared with (outside the timed regions).

Ratios are medians of per-request ratios (both sides measured within a millisecond of each other, so a busy
machine slows both); times are medians in ms. The previous cached result (a list of up to 128k ids) is
released before the next timed call, like the reference's (freeing it is its owner's cost, ~0.3 ms at 128k,
and none of the encode's). After the untimed reference encode the allocator is settled
(:func:`_settle`): freeing a 128k-token encoding leaves glibc ~5 ms of deferred consolidation that the next
large allocation pays, which would otherwise be charged to whichever timed call runs first. :func:`lookup_flatness` times the index lookup of one prompt
with 1 and with 1,000 cached entries sharing its first part, and counts the dict probes of each.
:func:`report` prints the results of this bench and of :mod:`.bench_modes` (one line per result, then one
JSON object as the last line with ``--json``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from vllm_dsa_dev.tokenizer.workloads import Request, requests

TARGETS = (38_000, 128_000)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _ms(x: float, digits: int = 3) -> float:
    return round(x * 1e3, digits)


def _settle() -> None:
    """Make the allocator do the deferred work of the frees before it (glibc consolidates the small blocks a
    large encoding freed at the next large allocation), so that no timed call pays for an untimed one."""
    for _ in range(3):
        bytearray(1 << 16)


def run_workload(tok: Any, kind: str, target: int, turns: int, seed: int = 0,
                 cache_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Grow one ``kind`` conversation to ``target`` tokens and measure ``turns`` requests (see the module)."""
    from vllm_dsa_connector.tokenizer.cache import PrefixTokenCache

    cache = PrefixTokenCache(tok, **(cache_options or {}))
    backend = cache._encoder()
    t: dict[str, list[float]] = {k: [] for k in ("full", "cache", "delta", "delta_backend", "cache_cpu",
                                                 "delta_cpu", "ratio", "ratio_backend", "ratio_cpu",
                                                 "delta_chars")}
    lengths: list[int] = []
    mismatches = 0
    clock, cpu = time.perf_counter, time.process_time

    def delta_only(req: Request) -> tuple[float, float]:
        c0, t0 = cpu(), clock()
        tok(req.delta, add_special_tokens=False)["input_ids"]
        return clock() - t0, cpu() - c0

    got: list[int] = []
    for n, req in enumerate(requests(kind, target, turns, lambda text: len(cache.encode(text)), seed)):
        if n % 2:
            d, d_cpu = delta_only(req)
        del got  # the previous result is freed by its owner, not charged to this request's encode
        c0, t0 = cpu(), clock()
        got = cache.encode(req.text)
        c1, t1 = cpu(), clock()
        if not n % 2:
            d, d_cpu = delta_only(req)
        t2 = clock()
        _ = backend.encode(req.delta, add_special_tokens=False).ids
        t3 = clock()
        ref = tok(req.text, add_special_tokens=False)["input_ids"]
        t4 = clock()
        mismatches += got != ref
        lengths.append(len(ref))
        del ref
        _settle()
        for key, value in (("cache", t1 - t0), ("cache_cpu", c1 - c0), ("delta", d), ("delta_cpu", d_cpu),
                           ("delta_backend", t3 - t2), ("full", t4 - t3), ("ratio", (t1 - t0) / d),
                           ("ratio_backend", (t1 - t0) / (t3 - t2)), ("ratio_cpu", (c1 - c0) / max(d_cpu, 1e-9)),
                           ("delta_chars", len(req.delta))):
            t[key].append(value)
    s = cache.stats()
    full, cached = _median(t["full"]), _median(t["cache"])
    return {
        "workload": kind,
        "target_tokens": target,
        "requests_measured": len(lengths),
        "prompt_tokens_median": int(_median([float(x) for x in lengths])),
        "delta_chars_median": int(_median(t["delta_chars"])),
        "full_ms": _ms(full),
        "cache_ms": _ms(cached),
        "cache_ms_p90": _ms(sorted(t["cache"])[int(0.9 * (len(t["cache"]) - 1))]),
        "delta_only_ms": _ms(_median(t["delta"])),
        "delta_backend_ms": _ms(_median(t["delta_backend"])),
        "speedup": round(full / max(cached, 1e-9), 1),
        "cache_over_delta": round(_median(t["ratio"]), 3),
        "cache_over_delta_backend": round(_median(t["ratio_backend"]), 3),
        "cache_over_delta_cpu": round(_median(t["ratio_cpu"]), 3),
        "hits": s["hits"],
        "misses": s["misses"],
        "fallbacks": s["fallbacks"],
        "probe_fallbacks": s["probe_fallbacks"],
        "mismatches": mismatches,
    }


def lookup_flatness(tok: Any, sizes: tuple[int, ...] = (1, 1000), prompt_tokens: int = 38_000,
                    repeats: int = 200) -> dict[str, Any]:
    """Median time and dict probes of looking up one prose prompt of ~``prompt_tokens`` among ``sizes`` cached
    entries (the others share the prompt's first 9,000 characters, then diverge)."""
    from vllm_dsa_connector.tokenizer.cache import PrefixTokenCache
    from vllm_dsa_dev.tokenizer.workloads import ProseSource

    prompt = next(iter(requests("prose", prompt_tokens, 1, lambda text: len(text) // 4)))
    other = ProseSource(7)
    out: dict[str, Any] = {"prompt_chars": len(prompt.text)}
    for n in sizes:
        cache = PrefixTokenCache(tok, max_entries=max(sizes) + 16)
        cache.encode(prompt.text)
        base = prompt.text[:9000]
        for i in range(n - 1):
            cache.encode(f"{base}<|im_end|>\n<|im_start|>user\n{i} {other.take(400)}")
        times = []
        probes = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = cache.lookup(prompt.text + "x")
            times.append(time.perf_counter() - t0)
            probes = m.probes
        assert m.entry is not None and m.common == len(prompt.text)
        out[f"lookup_ms_{n}"] = _ms(_median(times), 4)
        out[f"lookup_probes_{n}"] = probes
        out[f"entries_{n}"] = cache.stats()["entries"]
    a, b = sizes[0], sizes[-1]
    out["lookup_ratio"] = round(out[f"lookup_ms_{b}"] / max(out[f"lookup_ms_{a}"], 1e-9), 2)
    return out


def line_of(r: dict[str, Any]) -> str:
    """One printed line for a result of :func:`run_workload` or of :mod:`.bench_modes`."""
    if "workload" in r:
        return (f"{r['workload']:9} ~{r['target_tokens'] // 1000}k tokens (median prompt "
                f"{r['prompt_tokens_median']}, {r['requests_measured']} requests): full {r['full_ms']:.2f} ms, "
                f"cache {r['cache_ms']:.3f} ms (p90 {r['cache_ms_p90']:.3f}), delta only {r['delta_only_ms']:.3f} "
                f"ms (bare {r['delta_backend_ms']:.3f}); speedup {r['speedup']:.1f}x, cache/delta "
                f"{r['cache_over_delta']:.2f} (bare {r['cache_over_delta_backend']:.2f}, CPU "
                f"{r['cache_over_delta_cpu']:.2f}); fallbacks {r['fallbacks']}, mismatches {r['mismatches']}")
    if "lookup_ratio" in r:
        keys = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("lookup_ms_"))
        return f"lookup of a {r['prompt_chars']}-character prompt: " + ", ".join(
            f"{n} entries {r[f'lookup_ms_{n}']:.4f} ms ({r[f'lookup_probes_{n}']} probes)" for n in keys
        ) + f"; ratio {r['lookup_ratio']:.2f}"
    return (f"~{r['target_tokens'] // 1000}k tokens, {'thinking' if r['thinking'] else 'chat    '} (median prompt "
            f"{r['prompt_tokens_median']}, {r['requests_measured']} requests): apply_chat_template stock "
            f"{r['stock_ms_median']:.1f} ms | cache {r['cache_ms_median']:.1f} ms -> {r['speedup']:.1f}x (CPU "
            f"{r['speedup_cpu']:.1f}x; encoding alone {r['render_ms_median']:.1f} ms); text->ids full "
            f"{r['encode_full_ms_median']:.1f} ms | cache {r['encode_cache_ms_median']:.2f} ms -> "
            f"{r['encode_speedup']:.1f}x; fallbacks {r['fallbacks']}, mismatches {r['mismatches']}")


def report(header: str, meta: dict[str, Any], results: list[dict[str, Any]], as_json: bool,
           extra: dict[str, Any] | None = None, emit: Callable[[str], None] = print) -> int:
    """Print ``header``, one line per result (and ``extra``: :func:`lookup_flatness`), then with ``as_json``
    one JSON object ``{**meta, "results": [...], "lookup": extra}``; exit status 1 on any mismatch."""
    emit(header)
    for r in results:
        emit(line_of(r))
    if extra is not None:
        emit(line_of(extra))
    if as_json:
        emit(json.dumps({**meta, "results": results, **({"lookup": extra} if extra is not None else {})}))
    return 1 if any(r.get("mismatches") for r in results) else 0
