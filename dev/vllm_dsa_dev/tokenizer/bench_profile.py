"""Where the time of a prefix-cache hit goes: ``PrefixTokenCache.encode`` under cProfile, per workload and size.

The conversation of :func:`.workloads.requests` grows through the cache unprofiled; then each measured
request's ``cache.encode`` runs under cProfile (the previous result freed first, as in :mod:`.bench_cache`).
Each row is a function's own time per hit (not counting the calls it makes), largest first: the Rust tail
encode (``encode_batch_fast``, or ``encode`` where the tail keeps its offsets), the lookup and the prefix
check (``find``, ``startswith``), the result list and the entry's ``rest`` (the own time of
``_encode_cached``, with the cut search), the entry update (``keys_for``, ``insert``, ``_keep``,
``interned``). ``tok(delta)``, the delta-only encode, is timed beside each hit for scale. cProfile adds a
fixed cost to every Python call, so small functions read larger than they are and the rows add up to more
than an unprofiled hit (:mod:`.bench_cache` measures that).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

from vllm_dsa_dev.tokenizer.workloads import requests


def _label(key: tuple[str, int, str]) -> str:
    file, _, name = key
    if file == "~":  # a builtin: "<method 'encode_batch_fast' of 'tokenizers.Tokenizer' objects>"
        return name.strip("<>").replace("method ", "").replace("built-in ", "")
    return f"{Path(file).stem}.{name}"


def profile_hits(tok: Any, kind: str, target: int, turns: int, seed: int = 0, rows: int = 14) -> dict[str, Any]:
    """cProfile rows (µs per hit, own time) of ``turns`` measured requests of one ``kind`` conversation grown
    to ``target`` tokens; the median ``tok(delta)`` time beside them."""
    from vllm_dsa_connector.tokenizer.cache import PrefixTokenCache

    cache = PrefixTokenCache(tok)
    prof = cProfile.Profile()
    deltas: list[float] = []
    got: list[int] = []
    n = 0
    for req in requests(kind, target, turns, lambda text: len(cache.encode(text)), seed):
        del got
        prof.enable()
        got = cache.encode(req.text)
        prof.disable()
        t0 = time.perf_counter()
        tok(req.delta, add_special_tokens=False)["input_ids"]
        deltas.append(time.perf_counter() - t0)
        n += 1
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own = sorted(((v[2], _label(k)) for k, v in stats.items()), reverse=True)
    s = cache.stats()
    return {
        "workload": kind,
        "target_tokens": target,
        "profiled_hits": n,
        "prompt_tokens": len(got),
        "delta_only_us": round(statistics.median(deltas) * 1e6, 1),
        "profiled_us_per_hit": round(sum(t for t, _ in own) / max(n, 1) * 1e6, 1),
        "own_us_per_hit": {label: round(t / max(n, 1) * 1e6, 1) for t, label in own[:rows]},
        "fast_tails": s["fast_tails"],
        "mismatches": s["mismatches"],
    }


def lines_of(r: dict[str, Any]) -> list[str]:
    """Printed lines for one result of :func:`profile_hits`."""
    head = (f"{r['workload']} ~{r['target_tokens'] // 1000}k tokens ({r['prompt_tokens']} in the last prompt, "
            f"{r['profiled_hits']} hits): profiled {r['profiled_us_per_hit']:.0f} µs per hit, tok(delta) "
            f"{r['delta_only_us']:.0f} µs; own time per hit:")
    return [head] + [f"  {us:9.1f} µs  {label}" for label, us in r["own_us_per_hit"].items()]


__all__ = ["profile_hits", "lines_of"]
