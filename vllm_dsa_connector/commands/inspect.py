"""``vllm-dsa inspect``: the KV page tables of a model, per PP stage, as vLLM would allocate them."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_dsa_connector.layout.rules import LayoutError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG_JSON", help="model directory or config.json")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_ds_mla"), default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _ranges(layers: tuple[int, ...]) -> str:
    """Compact "0-3,5,9-12" form of a sorted layer list."""
    if not layers:
        return "-"
    out, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + (None,):
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def stages_json(tables: list) -> list[dict]:
    """The ``stages`` list: per PP rank, its layers and pools (role, mapper, layers, rows, bytes/token)."""
    stages = []
    for t in tables:
        if t.tp_rank != 0:
            continue  # replicated views: every TP rank of a stage has the same table
        stages.append({
            "pp_rank": t.pp_rank,
            "layers": list(t.layers),
            "bytes_per_block": t.bytes_per_block,
            "pools": [
                {
                    "role": v.role.value,
                    "mapper": v.mapper.value,
                    "layers": list(v.layers),
                    "rows": list(v.rows),
                    "bytes_per_token": v.bytes_per_token * len(v.entries),
                    "bytes_per_layer": v.bytes_per_layer,
                    "page_format": v.page_format.value,
                }
                for v in t.views
            ],
        })
    return stages


def run(args: argparse.Namespace) -> int:
    import os

    # Keep stdout for the table/JSON: vLLM's import-time info lines are noise here. (Only for this
    # process's own imports; restored below so callers running it in-process keep their setting.)
    previous = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from vllm_dsa_connector.layout import build_offline
    finally:
        if previous is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = previous

    try:
        if args.tp_size < 1:
            raise LayoutError(f"--tp-size must be >= 1, got {args.tp_size}")
        if args.block_size < 1:
            raise LayoutError(f"--block-size must be >= 1, got {args.block_size}")
        tables = build_offline(args.model, pp_size=args.pp_size, tp_size=args.tp_size,
                               block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    except LayoutError as e:
        print(f"vllm-dsa inspect: {e}", file=sys.stderr)
        return 2
    m = tables[0].model
    stages = stages_json(tables)
    if args.json:
        print(json.dumps({
            "model": m.architecture,
            "num_hidden_layers": m.num_hidden_layers,
            "num_mtp_layers": m.num_mtp_layers,
            "owning_layers": list(m.owning_layers),
            "pp_size": args.pp_size,
            "tp_size": args.tp_size,
            "block_size": args.block_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "stages": stages,
        }))
        return 0
    total_tok = sum(p["bytes_per_token"] for s in stages for p in s["pools"])
    print(f"{m.architecture}: {m.num_hidden_layers} layers + {m.num_mtp_layers} MTP, "
          f"{len(m.owning_layers)} own an indexer ({_ranges(m.owning_layers)}); "
          f"pp={args.pp_size} tp={args.tp_size} block={args.block_size} kv_cache_dtype={args.kv_cache_dtype}")
    def owners(s: dict) -> str:
        idx = next((p for p in s["pools"] if p["role"] == "indexer_k"), None)
        return _ranges(tuple(idx["layers"])) if idx else "none (no indexer pool)"

    w = max(22, *(len(owners(s)) for s in stages))
    hdr = f"{'stage':>5}  {'layers':<14} {'owning indexer layers':<{w}} {'rows':<9} " \
          f"{'mla B/tok':>10} {'idx B/tok':>10} {'B/block':>11}"
    print(hdr)
    print("-" * len(hdr))
    for s in stages:
        by_role = {p["role"]: p for p in s["pools"]}
        idx = by_role.get("indexer_k")
        mla = by_role.get("mla") or by_role.get("kv")
        rows = f"0..{len(idx['rows']) - 1}" if idx else "-"
        print(f"{s['pp_rank']:>5}  {_ranges(tuple(s['layers'])):<14} "
              f"{owners(s):<{w}} {rows:<9} "
              f"{mla['bytes_per_token'] if mla else 0:>10,} {idx['bytes_per_token'] if idx else 0:>10,} "
              f"{s['bytes_per_block']:>11,}")
    print(f"total bytes per token: {total_tok:,}")
    return 0
