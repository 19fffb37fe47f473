"""The transfer plan between two deployments: which source rank sends each destination page, as segments.

For every destination rank and every (role, global layer) it holds, exactly one source rank is chosen:
- PP reshard by global-layer overlap (any P pp -> any D pp, both directions);
- TP reshard of REPLICATED views (MLA latent, indexer K): the candidates are the source ranks holding the
  layer; one ``elected_sender`` per destination, spread across source ranks by destination rank;
- INDEXED (head-sharded) views need equal TP sizes (head slicing is not implemented: a clear error).
Per-layer fragments are then merged into ``Segment``s where they are contiguous on BOTH sides (in vLLM's
block-outermost DSA layout one request block is usually one run); :func:`assert_exactly_once` proves the
coverage (and, when block sizes differ, the token maps' tiling byte by byte).

This is the once-per-handshake half of the planner, over page tables only: it knows nothing of a request's
blocks. The per-request half (byte runs for given block lists, :class:`~vllm_dsa_connector.core.plan.peer_plan.PeerPlan`)
is :mod:`vllm_dsa_connector.core.plan.peer_plan`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from vllm_dsa_connector.core.plan.pages import LayerEntry, MapperKind, PageTable, PoolView
from vllm_dsa_connector.core.plan.token_map import (
    PlanError,
    TokenMap,
    build_token_map,
    check_dst_tiling,
)

__all__ = [
    "Segment",
    "TransferPlan",
    "assert_exactly_once",
    "check_compatible",
    "elected_sender",
    "plan_transfer",
    "segment_token_map",
]


@dataclass(frozen=True)
class Segment:
    """One contiguous byte run per block pair, from one source rank to one destination rank.

    For source block ``sb`` and destination block ``db``: source address
    ``src_pool.base_ptr + src_offset + sb * src_pool.block_stride``, destination likewise. When the two
    sides' block sizes differ a segment is one layer's page (``nbytes`` is the receiver's page) and the
    bytes move by token position (:class:`PeerPlan`), never page for page.
    """

    src_rank: int
    dst_rank: int
    src_pool: int
    dst_pool: int
    src_offset: int
    dst_offset: int
    nbytes: int
    layers: tuple[tuple[str, int], ...]  # (role, global layer) covered, in source-offset order


@dataclass(frozen=True)
class TransferPlan:
    """All segments between two deployments."""

    segments: tuple[Segment, ...]

    def for_dst(self, dst_rank: int) -> tuple[Segment, ...]:
        """Segments a destination rank receives."""
        return tuple(s for s in self.segments if s.dst_rank == dst_rank)

    def for_pair(self, src_rank: int, dst_rank: int) -> tuple[Segment, ...]:
        """Segments from one source rank to one destination rank."""
        return tuple(s for s in self.segments if s.src_rank == src_rank and s.dst_rank == dst_rank)

    def senders_for(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks that write into a destination rank."""
        return tuple(sorted({s.src_rank for s in self.for_dst(dst_rank)}))


def check_compatible(src: PageTable, dst: PageTable) -> None:
    """Refuse pairs whose pages would be copied into a different meaning (corrupt KV)."""
    a, b = src.model, dst.model
    for name in ("architecture", "num_hidden_layers", "num_mtp_layers", "kv_lora_rank",
                 "qk_rope_head_dim", "index_head_dim"):
        if getattr(a, name) != getattr(b, name):
            raise PlanError(f"model mismatch: {name} is {getattr(a, name)!r} on the sender and "
                            f"{getattr(b, name)!r} on the receiver")
    if a.owning_layers != b.owning_layers:
        raise PlanError(
            "indexer mask mismatch (index_topk_freq/index_skip_topk_offset/index_topk_pattern): sender owns "
            f"{list(a.owning_layers)}, receiver owns {list(b.owning_layers)}"
        )
    if src.kv_cache_dtype != dst.kv_cache_dtype:
        raise PlanError(f"kv cache dtype mismatch: {src.kv_cache_dtype!r} vs {dst.kv_cache_dtype!r}")
    # Block sizes may differ: pages are then mapped by token position (token_map), not copied whole.


def elected_sender(candidates: Sequence[PageTable], dst: PageTable) -> PageTable:
    """The one source rank that sends a replicated layer to ``dst``.

    Candidates hold identical bytes; destinations are spread over them by destination rank, so each
    destination has one sender per layer and source ranks share the load.
    """
    ordered = sorted(candidates, key=lambda t: (t.tp_rank, t.rank))
    return ordered[dst.rank % len(ordered)]


class _Fragment(NamedTuple):
    """One destination page's (role, global layer) and where its bytes come from: the unit
    :func:`_merge` joins into :class:`Segment` runs (offsets relative to each pool's block start)."""

    src_rank: int
    src_pool: int
    src_offset: int
    dst_pool: int
    dst_offset: int
    nbytes: int
    role: str
    layer: int


class _Holder(NamedTuple):
    """A source rank that holds a (role, layer) a destination page needs: its table, view and entry."""

    table: PageTable
    view: PoolView
    entry: LayerEntry


def _fragments(src_tables: Sequence[PageTable], dst: PageTable) -> list[_Fragment]:
    """One :class:`_Fragment` for every page of ``dst``, from the source rank elected to send it."""
    out = []
    for dview in dst.views:
        for dentry in dview.entries:
            holders: list[_Holder] = []
            for s in src_tables:
                sview = s.view(dview.role)
                sentry = sview.entry(dentry.global_layer) if sview else None
                if sview is not None and sentry is not None:
                    holders.append(_Holder(s, sview, sentry))
            if not holders:
                raise PlanError(
                    f"no source rank holds {dview.role.value} layer {dentry.global_layer} needed by "
                    f"receiver rank {dst.rank}"
                )
            if dview.mapper is MapperKind.REPLICATED:
                chosen = elected_sender([h.table for h in holders], dst)
            else:
                same = [h.table for h in holders
                        if h.table.tp_rank == dst.tp_rank and h.table.tp_size == dst.tp_size]
                if not same:
                    raise PlanError(
                        f"{dview.role.value} layer {dentry.global_layer} is head-sharded and TP sizes differ "
                        f"({holders[0].table.tp_size} -> {dst.tp_size}); head slicing is not supported"
                    )
                chosen = same[0]
            _, sview, sentry = next(h for h in holders if h.table is chosen)
            if sview.mapper != dview.mapper or sview.page_format != dview.page_format:
                raise PlanError(
                    f"{dview.role.value} layer {dentry.global_layer}: sender is {sview.mapper.value}/"
                    f"{sview.page_format.value}, receiver {dview.mapper.value}/{dview.page_format.value}"
                )
            if chosen.block_size == dst.block_size and sentry.nbytes != dentry.nbytes:
                raise PlanError(
                    f"{dview.role.value} layer {dentry.global_layer}: bytes per layer differ "
                    f"(sender {sentry.nbytes}, receiver {dentry.nbytes})"
                )
            if chosen.block_size != dst.block_size and (
                    sview.bytes_per_token != dview.bytes_per_token
                    or sentry.nbytes != sview.bytes_per_token * chosen.block_size
                    or dentry.nbytes != dview.bytes_per_token * dst.block_size):
                raise PlanError(
                    f"{dview.role.value} layer {dentry.global_layer}: bytes per token differ or pages are "
                    f"not whole rows (sender {sentry.nbytes} B / {chosen.block_size} tokens, receiver "
                    f"{dentry.nbytes} B / {dst.block_size} tokens)"
                )
            out.append(_Fragment(chosen.rank, sview.pool, sentry.offset, dview.pool, dentry.offset,
                                 dentry.nbytes, dview.role.value, dentry.global_layer))
    return out


def _merge(frags: list[_Fragment], dst_rank: int, merge: bool = True) -> list[Segment]:
    """Merge fragments contiguous on both sides (same pools), in source-offset order (``merge``: only
    when both sides' pages have the same size, i.e. equal block sizes)."""
    segs: list[Segment] = []
    cur: Segment | None = None  # the segment being grown; appended when the next fragment does not extend it
    for f in sorted(frags, key=lambda f: (f.src_rank, f.src_pool, f.dst_pool, f.src_offset)):
        if (merge and cur is not None and cur.src_rank == f.src_rank and cur.src_pool == f.src_pool
                and cur.dst_pool == f.dst_pool and cur.src_offset + cur.nbytes == f.src_offset
                and cur.dst_offset + cur.nbytes == f.dst_offset):
            cur = replace(cur, nbytes=cur.nbytes + f.nbytes, layers=cur.layers + ((f.role, f.layer),))
            continue
        if cur is not None:
            segs.append(cur)
        cur = Segment(src_rank=f.src_rank, dst_rank=dst_rank, src_pool=f.src_pool, dst_pool=f.dst_pool,
                      src_offset=f.src_offset, dst_offset=f.dst_offset, nbytes=f.nbytes,
                      layers=((f.role, f.layer),))
    if cur is not None:
        segs.append(cur)
    return segs


def assert_exactly_once(plan: TransferPlan, dst_tables: Sequence[PageTable],
                        src_tables: Sequence[PageTable] = ()) -> None:
    """Every (destination, role, layer) is covered by exactly one segment; nothing else is.

    With ``src_tables`` whose block size differs from a destination's, also byte by byte: the token maps of
    every sender of that destination tile each of its pages exactly once (:func:`core.plan.token_map.check_dst_tiling`).
    """
    seen: dict[tuple[int, str, int], int] = defaultdict(int)
    for s in plan.segments:
        for role, layer in s.layers:
            seen[(s.dst_rank, role, layer)] += 1
    want = {(d.rank, v.role.value, e.global_layer) for d in dst_tables for v in d.views for e in v.entries}
    extra = sorted(set(seen) - want)
    missing = sorted(want - set(seen))
    twice = sorted(k for k, n in seen.items() if n != 1)
    if extra or missing or twice:
        raise PlanError(f"coverage is not exactly once: missing {missing[:8]}, "
                        f"duplicated {twice[:8]}, unexpected {extra[:8]}")
    src_by_rank = {t.rank: t for t in src_tables}
    for d in dst_tables:
        senders = [src_by_rank[r] for r in plan.senders_for(d.rank) if r in src_by_rank]
        if any(s.block_size != d.block_size for s in senders):
            check_dst_tiling([segment_token_map(plan.for_pair(s.rank, d.rank), s, d) for s in senders], d)


def segment_token_map(segments: Sequence[Segment], src: PageTable, dst: PageTable) -> TokenMap:
    """The token-position map of one (source rank, destination rank) pair's segments."""
    return build_token_map([p for s in segments for p in s.layers], src, dst)


def plan_transfer(src_tables: Sequence[PageTable], dst_tables: Sequence[PageTable]) -> TransferPlan:
    """The transfer plan from every source rank's table to every destination rank's table."""
    if not src_tables or not dst_tables:
        raise PlanError("both sides need at least one page table")
    for d in dst_tables:
        for s in src_tables:
            check_compatible(s, d)
    segments: list[Segment] = []
    for d in sorted(dst_tables, key=lambda t: t.rank):
        same = all(s.block_size == d.block_size for s in src_tables)
        segments.extend(_merge(_fragments(src_tables, d), d.rank, merge=same))
    plan = TransferPlan(tuple(segments))
    assert_exactly_once(plan, dst_tables, src_tables)
    return plan
