"""``vllm-dsa bench tokenizer``: prefix token cache vs a full encode vs encoding only the new text.

Four workloads (:mod:`vllm_dsa_dev.tokenizer.workloads`): ``chat`` (code-review chat, many lines),
``prose`` (running prose with few newlines and NFC-composed accents), ``code`` (user turns of Python source,
replies of prose) and ``code-open`` (the same, each prompt ending inside the user's code), grown to ~38k and
~128k tokens with the Qwen3 (NFC) tokenizer. Per workload and size: median ``full_ms``, ``cache_ms``, ``delta_only_ms`` (the same
tokenizer call on only the text added since the previous request), ``speedup`` (full / cache),
``cache_over_delta`` (median per-request ratio, both measured back to back) and ``mismatches`` (every cached
result is compared with the full encode). Then the index lookup of one prompt with 1 and 1,000 cached
entries (time and dict probes). ``--profile`` shows where a hit's time goes instead (cProfile, own time per
function and hit: :mod:`vllm_dsa_dev.tokenizer.bench_profile`). ``--modes`` measures the DeepSeek-V3.2 chat path instead
(:mod:`vllm_dsa_dev.tokenizer.bench_modes`); both print through one printer
(:func:`vllm_dsa_dev.tokenizer.bench_cache.report`). With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_dsa_dev.tokenizer.bench_cache import TARGETS
from vllm_dsa_dev.tokenizer.workloads import WORKLOADS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), help="prompt sizes (tokens)")
    parser.add_argument("--turns", type=int, default=None,
                        help="measured requests per conversation (default 32; 16 with --modes)")
    parser.add_argument("--seed", type=int, default=0, help="offset into the text corpus")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--lookup-entries", type=int, nargs="*", default=[1, 1000],
                        help="cached-entry counts for the lookup measurement (none: skip it)")
    parser.add_argument("--profile", action="store_true",
                        help="where a hit's time goes: cache.encode under cProfile, own time per function")
    parser.add_argument("--modes", action="store_true",
                        help="DeepSeek-V3.2 chat path: stock deepseek_v32 tokenizer mode vs dsa-prefix-cache")


def run(args: argparse.Namespace) -> int:
    turns = args.turns if args.turns is not None else (16 if args.modes else 32)
    if turns < 1 or any(t < 1000 for t in args.targets):
        print("bench tokenizer: --turns must be >= 1 and --targets >= 1000", file=sys.stderr)
        return 2
    if args.modes:
        from vllm_dsa_dev.tokenizer.bench_modes import run_modes

        return run_modes(args.targets, turns, args.seed, args.json)
    from vllm_dsa_dev.tokenizer.assets import qwen_tokenizer
    from vllm_dsa_dev.tokenizer.bench_cache import lookup_flatness, report, run_workload

    tok = qwen_tokenizer()
    if args.profile:
        from vllm_dsa_dev.tokenizer.bench_profile import lines_of, profile_hits

        profiles = [profile_hits(tok, kind, target, turns, args.seed) for kind in args.workloads
                    for target in args.targets]
        print("prefix token cache hits under cProfile (Qwen3 NFC tokenizer):")
        for r in profiles:
            print("\n".join(lines_of(r)))
        if args.json:
            print(json.dumps({"bench": "tokenizer-profile", "tokenizer": "qwen3-nfc", "results": profiles}))
        return 1 if any(r["mismatches"] for r in profiles) else 0
    results = []
    for kind in args.workloads:
        for target in args.targets:
            results.append(run_workload(tok, kind, target, turns, args.seed))
    sizes = tuple(args.lookup_entries)
    extra = lookup_flatness(tok, sizes, min(args.targets)) if sizes else None
    return report("prefix token cache (Qwen3 NFC tokenizer), medians:",
                  {"bench": "tokenizer", "tokenizer": "qwen3-nfc"}, results, args.json, extra)
