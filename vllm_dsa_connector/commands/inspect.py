"""``vllm-dsa inspect``: the KV page tables of a model, per PP stage, as vLLM would allocate them.

With ``--src-block-size``/``--dst-block-size`` (and optionally ``--dst-model``) it shows instead how the
pages of one configuration (P) map onto the other's (D) over one span of ``lcm(Bp, Bd)`` tokens: per view
(MLA latent rows, indexer values, indexer scales) of one layer, the byte runs
``P block/offset -> D block/offset, length`` of :meth:`PeerPlan.runs`, cut at page-part boundaries.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from vllm_dsa_connector.core.plan.rules import LayoutError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG_JSON", help="model directory or config.json")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_ds_mla"), default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    g = p.add_argument_group("how a block of one configuration maps onto another (P -> D)")
    g.add_argument("--src-block-size", type=int, help="P's tokens per block (default: --block-size)")
    g.add_argument("--dst-block-size", type=int, help="D's tokens per block (default: --block-size)")
    g.add_argument("--dst-model", metavar="MODEL_DIR_OR_CONFIG_JSON", help="D's model/config (default: MODEL)")
    g.add_argument("--layer", type=int, help="the layer shown (default: the first layer with an indexer)")


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


@dataclass(frozen=True)
class _Part:
    """One page part of one layer inside a block: ``[start, end)`` from the block's start."""

    start: int
    end: int
    view: str  # "mla", "indexer_k values", "indexer_k scales", "kv"
    layer: int
    page: int  # where the layer's page starts in the block (offsets are shown from here)
    row: int  # bytes per token of this part
    tokens_before: int  # bytes of the page before this part's first token row (scales: B * values)


def _parts(table: Any) -> dict[int, list[_Part]]:
    """Per pool: the page parts of every layer of ``table`` within one block, sorted by start."""
    from vllm_dsa_connector.core.plan.pages import PageFormat

    out: dict[int, list[_Part]] = {}
    for v in table.views:
        for e in v.entries:
            if v.page_format is PageFormat.BLOCK_SPLIT:
                values = table.model.index_head_dim
                split = e.offset + table.block_size * values
                out.setdefault(v.pool, []).extend([
                    _Part(e.offset, split, f"{v.role.value} values", e.global_layer, e.offset, values, 0),
                    _Part(split, e.offset + e.nbytes, f"{v.role.value} scales", e.global_layer, e.offset,
                          v.bytes_per_token - values, split - e.offset)])
            else:
                out.setdefault(v.pool, []).append(
                    _Part(e.offset, e.offset + e.nbytes, v.role.value, e.global_layer, e.offset, v.bytes_per_token, 0))
    return {k: sorted(x, key=lambda p: p.start) for k, x in out.items()}


def _find(parts: list[_Part], off: int) -> _Part | None:
    i = bisect.bisect_right([p.start for p in parts], off) - 1
    return parts[i] if i >= 0 and off < parts[i].end else None


def block_map(src_tables: list, dst_tables: list, layer: int | None = None) -> dict[str, Any]:
    """How P's pages map onto D's over one span of ``lcm(Bp, Bd)`` tokens (blocks ``0..`` on both sides).

    Returns ``{src_block_size, dst_block_size, span_tokens, layer, descriptors, bytes, views}``; ``views``
    maps ``"mla"``, ``"indexer_k values"``, ``"indexer_k scales"`` (those the layer has) to pieces
    ``{src_rank, dst_rank, src_block, src_offset, dst_block, dst_offset, length, tokens: [first, end)}``
    (offsets from the layer's page start): :meth:`PeerPlan.runs`' runs of the span cut at page-part
    boundaries. ``descriptors``/``bytes``: all runs of the span, every layer. ``PlanError`` when the two
    configurations cannot exchange KV.
    """
    import numpy as np

    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

    peer = PeerPlan.build(src_tables, dst_tables)
    bp, bd = peer.src_block_size, peer.dst_block_size
    span = math.lcm(bp, bd)
    sb, db = np.arange(span // bp), np.arange(span // bd)
    if layer is None:
        owners = src_tables[0].model.owning_layers
        layer = owners[0] if owners else min(src_tables[0].layers)
    views: dict[str, list[dict[str, Any]]] = {}
    descriptors = nbytes = 0
    for d in peer.dst_tables:
        dparts = _parts(d)
        for s in peer.src_tables:
            sparts = _parts(s)
            for sp, dp, runs in peer.runs(s.rank, d.rank, sb, db, first_token=0, num_tokens=span):
                descriptors += runs.num_runs
                nbytes += runs.total_bytes
                ss, ds = s.pools[sp].block_stride, d.pools[dp].block_stride
                for x, y, n in zip(runs.src_offsets.tolist(), runs.dst_offsets.tolist(), runs.lengths.tolist(),
                                   strict=True):
                    while n > 0:
                        (sblk, soff), (dblk, doff) = divmod(x, ss), divmod(y, ds)
                        a, b = _find(sparts.get(sp, []), soff), _find(dparts.get(dp, []), doff)
                        if a is None or b is None:
                            raise ValueError(f"run byte {x} -> {y} lies outside every page (P rank {s.rank} "
                                             f"pool {sp}, D rank {d.rank} pool {dp})")
                        take = min(n, a.end - soff, b.end - doff)
                        if a.layer == layer:
                            first = sblk * bp + (soff - a.start) // a.row
                            views.setdefault(a.view, []).append({
                                "src_rank": s.rank, "dst_rank": d.rank, "src_block": int(sblk),
                                "src_offset": soff - a.page, "dst_block": int(dblk), "dst_offset": doff - b.page,
                                "length": take, "dst_view": b.view, "dst_layer": b.layer,
                                "tokens": [first, first + take // a.row]})
                        x, y, n = x + take, y + take, n - take
    order = ("mla", "indexer_k values", "indexer_k scales", "kv")
    return {"src_block_size": bp, "dst_block_size": bd, "span_tokens": span, "layer": layer,
            "descriptors": descriptors, "bytes": nbytes,
            "views": {k: sorted(views[k], key=lambda r: (r["tokens"][0], r["dst_rank"])) for k in order if k in views}}


def _run_block_map(args: argparse.Namespace, build_offline: Any) -> int:
    from vllm_dsa_connector.core.plan.token_map import PlanError

    bp = args.src_block_size or args.block_size
    bd = args.dst_block_size or args.block_size
    try:
        if bp < 1 or bd < 1:
            raise LayoutError(f"block sizes must be >= 1 (--src-block-size {bp}, --dst-block-size {bd})")
        common = dict(pp_size=args.pp_size, tp_size=args.tp_size, kv_cache_dtype=args.kv_cache_dtype)
        src = build_offline(args.model, block_size=bp, num_blocks=math.lcm(bp, bd) // bp + 2, **common)
        dst = build_offline(args.dst_model or args.model, block_size=bd, num_blocks=math.lcm(bp, bd) // bd + 2,
                            **common)
        out = block_map(src, dst, args.layer)
    except (LayoutError, PlanError) as e:
        print(f"vllm-dsa inspect: {e}", file=sys.stderr)
        return 2
    if not out["views"]:
        print(f"vllm-dsa inspect: no rank holds layer {out['layer']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"P blocks of {bp} tokens -> D blocks of {bd} tokens: one span of lcm = {out['span_tokens']} tokens "
          f"({out['span_tokens'] // bp} P block(s), {out['span_tokens'] // bd} D block(s)); layer {out['layer']}, "
          "offsets from the layer's page start")
    for view, pieces in out["views"].items():
        print(f"{view}:")
        for r in pieces:
            ranks = f"rank {r['src_rank']}->{r['dst_rank']}  " if len(src) > 1 or len(dst) > 1 else ""
            moved = "" if (r["dst_view"], r["dst_layer"]) == (view, out["layer"]) else \
                f"  !! into {r['dst_view']} layer {r['dst_layer']}"
            print(f"  {ranks}P block {r['src_block']} +{r['src_offset']:<9,} -> D block {r['dst_block']} "
                  f"+{r['dst_offset']:<9,} {r['length']:>9,} B  tokens {r['tokens'][0]}-{r['tokens'][1] - 1}{moved}")
    print(f"the whole span, every layer: {out['descriptors']:,} runs after merging, {out['bytes']:,} B")
    return 0


def run(args: argparse.Namespace) -> int:
    import os

    # Keep stdout for the table/JSON: vLLM's import-time info lines are noise here. (Only for this
    # process's own imports; restored below so callers running it in-process keep their setting.)
    previous = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        from vllm_dsa_connector.connector.page_tables import build_offline
    finally:
        if previous is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = previous

    if args.src_block_size is not None or args.dst_block_size is not None or args.dst_model is not None:
        return _run_block_map(args, build_offline)
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
