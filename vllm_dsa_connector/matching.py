"""Who sends what to whom: transfer plans as pure functions over two sets of page tables.

For every destination rank and every (role, global layer) it holds, exactly one source rank is chosen:
- PP reshard by global-layer overlap (any P pp -> any D pp, both directions);
- TP reshard of REPLICATED views (MLA latent, indexer K): the candidates are the source ranks holding the
  layer; one ``elected_sender`` per destination, spread across source ranks by destination rank;
- INDEXED (head-sharded) views need equal TP sizes (head slicing is not implemented: a clear error).
Per-layer fragments are then merged into ``Segment``s where they are contiguous on BOTH sides (in vLLM's
block-outermost DSA layout one request block is usually one run), and ``expand_runs`` turns segments and
block ids into byte runs, merged again across consecutive blocks (the merge rule itself lives in
``transport.runs``: one implementation for planner and transport).

:class:`PeerPlan` is what a connector keeps per peer: both sides' decoded page tables and the plan, built
once at the handshake; ``PeerPlan.runs(src_rank, dst_rank, src_blocks, dst_blocks, first_token=,
num_tokens=)`` answers every per-request question (scheduler slot planning, the sender's WRITE, the
receiver's scatter) without parsing a table again.

P and D may use different block sizes (``Bp != Bd``): the plan still elects one sender per (destination,
role, layer), but pages are then mapped by token position (:mod:`vllm_dsa_connector.token_map`: chunks of
``gcd(Bp, Bd)`` tokens, MLA rows and the indexer's block-split values/scales parts mapped separately)
instead of copied whole. ``Bp == Bd`` keeps the page-for-page runs exactly.

Which of P's blocks go into which of D's blocks (by token position) is :mod:`vllm_dsa_connector.pairing`
(``pair_blocks_by_position``, ``BlockPairing``, ``PairingError``; re-exported here).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from vllm_dsa_connector.layout.model import LayerEntry, MapperKind, PageTable, PoolView
from vllm_dsa_connector.pairing import BlockPairing, PairingError, pair_blocks_by_position
from vllm_dsa_connector.token_map import (
    PlanError,
    TokenMap,
    build_token_map,
    check_dst_tiling,
    token_span,
)
from vllm_dsa_connector.transport.runs import Runs, merge_adjacent, merge_runs

__all__ = [
    "BlockPairing",
    "PairingError",
    "PeerPlan",
    "PlanError",
    "PoolRuns",
    "Segment",
    "TransferPlan",
    "assert_exactly_once",
    "check_compatible",
    "elected_sender",
    "expand_runs",
    "merge_adjacent",
    "pair_blocks_by_position",
    "plan_transfer",
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

    def for_src(self, src_rank: int) -> tuple[Segment, ...]:
        """Segments a source rank sends."""
        return tuple(s for s in self.segments if s.src_rank == src_rank)

    def for_pair(self, src_rank: int, dst_rank: int) -> tuple[Segment, ...]:
        """Segments from one source rank to one destination rank."""
        return tuple(s for s in self.segments if s.src_rank == src_rank and s.dst_rank == dst_rank)

    def senders_for(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks that write into a destination rank."""
        return tuple(sorted({s.src_rank for s in self.for_dst(dst_rank)}))

    def bytes_per_block(self, dst_rank: int) -> int:
        """Bytes a destination rank receives per block."""
        return sum(s.nbytes for s in self.for_dst(dst_rank))


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
    every sender of that destination tile each of its pages exactly once (:func:`token_map.check_dst_tiling`).
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
            check_dst_tiling([_token_map(plan.for_pair(s.rank, d.rank), s, d) for s in senders], d)


def _token_map(segments: Sequence[Segment], src: PageTable, dst: PageTable) -> TokenMap:
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


@dataclass(frozen=True)
class PoolRuns:
    """Byte runs between one source pool and one destination pool, offsets relative to each pool base."""

    src_pool: int
    dst_pool: int
    src_offsets: np.ndarray  # int64
    dst_offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64

    @property
    def num_runs(self) -> int:
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())


def expand_runs(
    segments: Sequence[Segment],
    src_table: PageTable,
    dst_table: PageTable,
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
) -> list[PoolRuns]:
    """Byte runs for moving ``src_blocks[i]`` -> ``dst_blocks[i]`` under the given segments (page for page:
    both tables must use the same block size; :meth:`PeerPlan.runs` maps different ones by token)."""
    if src_table.block_size != dst_table.block_size:
        raise PlanError(f"page-for-page runs need one block size (sender {src_table.block_size}, receiver "
                        f"{dst_table.block_size}); use PeerPlan.runs, which maps tokens")
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    if sb.shape != db.shape or sb.ndim != 1:
        raise PlanError(f"block id lists differ in length ({sb.size} sender, {db.size} receiver)")
    for blocks, table, side in ((sb, src_table, "sender"), (db, dst_table, "receiver")):
        if blocks.size and (blocks.min() < 0 or blocks.max() >= min(p.num_blocks for p in table.pools)):
            raise PlanError(f"{side} block id out of range 0..{min(p.num_blocks for p in table.pools) - 1}")
    groups: dict[tuple[int, int], list[Segment]] = defaultdict(list)
    for s in segments:
        groups[(s.src_pool, s.dst_pool)].append(s)
    out = []
    for (sp, dp), segs in sorted(groups.items()):
        so = np.array([s.src_offset for s in segs], dtype=np.int64)
        do = np.array([s.dst_offset for s in segs], dtype=np.int64)
        ln = np.array([s.nbytes for s in segs], dtype=np.int64)
        # block-major order: every segment of block i, then of block i+1, so block runs can chain.
        src = (sb[:, None] * src_table.pools[sp].block_stride + so[None, :]).ravel()
        dst = (db[:, None] * dst_table.pools[dp].block_stride + do[None, :]).ravel()
        length = np.broadcast_to(ln, (sb.size, ln.size)).ravel()
        src, dst, length = merge_adjacent(src, dst, length)
        out.append(PoolRuns(sp, dp, src, dst, length))
    return out


@dataclass(frozen=True, eq=False)
class PeerPlan:
    """One producer/consumer pairing, decided once at the handshake (frozen).

    ``src_tables`` are the producer's (P) decoded page tables, ``dst_tables`` the consumer's (D), both by
    rank; ``plan`` the exactly-once transfer plan between them. :meth:`runs` is the one place per-request
    byte runs come from (sender, receiver and scheduler compute the same runs in the same order). Pairs
    whose block sizes differ get their token map here, once.
    """

    src_tables: tuple[PageTable, ...]
    dst_tables: tuple[PageTable, ...]
    plan: TransferPlan
    _src: dict[int, PageTable] = field(init=False, repr=False)
    _dst: dict[int, PageTable] = field(init=False, repr=False)
    _pairs: dict[tuple[int, int], tuple[Segment, ...]] = field(init=False, repr=False)
    _maps: dict[tuple[int, int], TokenMap] = field(init=False, repr=False)
    # (src rank, dst rank, layers) -> that pair's per-layer segments / token map (filled on first use)
    _layer_segs: dict[tuple[int, int, frozenset[int]], tuple[Segment, ...]] = field(init=False, repr=False)
    _layer_maps: dict[tuple[int, int, frozenset[int]], TokenMap] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_src", {t.rank: t for t in self.src_tables})
        object.__setattr__(self, "_dst", {t.rank: t for t in self.dst_tables})
        pairs: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for s in self.plan.segments:
            pairs[(s.src_rank, s.dst_rank)].append(s)
        object.__setattr__(self, "_pairs", {k: tuple(v) for k, v in pairs.items()})
        maps = {}
        for (sr, dr), segs in self._pairs.items():
            src, dst = self._src.get(sr), self._dst.get(dr)
            if src is not None and dst is not None and src.block_size != dst.block_size:
                maps[(sr, dr)] = _token_map(segs, src, dst)
        object.__setattr__(self, "_maps", maps)
        object.__setattr__(self, "_layer_segs", {})
        object.__setattr__(self, "_layer_maps", {})

    @classmethod
    def build(cls, src_tables: Sequence[PageTable], dst_tables: Sequence[PageTable]) -> PeerPlan:
        """Plan ``src -> dst`` (:func:`plan_transfer`; raises :class:`PlanError` naming what differs)."""
        src = tuple(sorted(src_tables, key=lambda t: t.rank))
        dst = tuple(sorted(dst_tables, key=lambda t: t.rank))
        return cls(src, dst, plan_transfer(src, dst))

    @property
    def src_block_size(self) -> int:
        """The producer's block size (tokens per P block)."""
        return self.src_tables[0].block_size

    @property
    def dst_block_size(self) -> int:
        """The consumer's block size (tokens per D block)."""
        return self.dst_tables[0].block_size

    def senders_for(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks that write into a destination rank."""
        return self.plan.senders_for(dst_rank)

    def for_pair(self, src_rank: int, dst_rank: int) -> tuple[Segment, ...]:
        """Segments from one source rank to one destination rank."""
        return self._pairs.get((src_rank, dst_rank), ())

    def layers_of(self, src_rank: int, dst_rank: int) -> tuple[int, ...]:
        """The global layers (any role) source rank ``src_rank`` sends ``dst_rank``, sorted (empty: none)."""
        return tuple(sorted({layer for s in self.for_pair(src_rank, dst_rank) for _, layer in s.layers}))

    def _layer_segments(self, src_rank: int, dst_rank: int, layers: frozenset[int]) -> tuple[Segment, ...]:
        """The pair's segments restricted to ``layers``: a segment merged across layers is split back into
        its per-(role, layer) pages (the page tables' :class:`LayerEntry` offsets and sizes); cached."""
        key = (src_rank, dst_rank, layers)
        got = self._layer_segs.get(key)
        if got is not None:
            return got
        src, dst = self._src[src_rank], self._dst[dst_rank]
        out = []
        for seg in self.for_pair(src_rank, dst_rank):
            if all(layer in layers for _, layer in seg.layers):
                out.append(seg)  # whole: keeps the page-for-page runs of the whole request
                continue
            for role, layer in seg.layers:
                if layer not in layers:
                    continue
                sview, dview = src.view(role), dst.view(role)
                sentry = sview.entry(layer) if sview is not None else None
                dentry = dview.entry(layer) if dview is not None else None
                if sentry is None or dentry is None:  # the plan was built from these tables
                    raise PlanError(f"{role} layer {layer} of segment {seg} has no page on rank {src_rank} "
                                    f"or {dst_rank}")
                out.append(replace(seg, src_offset=sentry.offset, dst_offset=dentry.offset,
                                   nbytes=dentry.nbytes, layers=((role, layer),)))
        got = tuple(out)
        self._layer_segs[key] = got
        return got

    def _layer_map(self, src_rank: int, dst_rank: int, layers: frozenset[int]) -> TokenMap:
        """The token map of the pair's pages of ``layers`` only (block sizes differ); cached."""
        key = (src_rank, dst_rank, layers)
        tmap = self._layer_maps.get(key)
        if tmap is None:
            pages = [p for s in self.for_pair(src_rank, dst_rank) for p in s.layers if p[1] in layers]
            tmap = build_token_map(pages, self._src[src_rank], self._dst[dst_rank])
            self._layer_maps[key] = tmap
        return tmap

    def runs(self, src_rank: int, dst_rank: int, src_blocks: Sequence[int] | np.ndarray,
             dst_blocks: Sequence[int] | np.ndarray, *, first_token: int = 0,
             num_tokens: int | None = None, layers: Collection[int] | None = None) -> list[tuple[int, int, Runs]]:
        """``[(src_pool, dst_pool, Runs)]`` source rank ``src_rank`` writes to ``dst_rank`` for a token span.

        ``src_blocks[i]`` holds P's tokens ``[(first_token // Bp + i) * Bp, +Bp)``, ``dst_blocks[j]`` D's
        tokens ``[(first_token // Bd + j) * Bd, +Bd)``; tokens ``[first_token, end)`` are copied in whole
        chunks of ``g = gcd(Bp, Bd)`` tokens, ``end = first_token + num_tokens`` rounded up to ``g``
        (``None``: everything both block lists cover). ``Bp == Bd``: whole pages, exactly the plan's
        page-for-page runs of the blocks the span touches. Runs are merged with sorting
        (``transport.merge_runs``): blocks listed out of order (vLLM's free list hands them out in
        reverse) and layer-outermost layouts still collapse into long runs. Empty when the pair exchanges
        nothing. Raises :class:`PlanError` for an unknown rank, a block id out of range or a span the
        lists do not cover.

        ``layers``: only the pages of these global layers (every role: MLA latent and indexer K), e.g. the
        one layer whose pages a layer-by-layer push sends once its attention ran; parts with no runs are
        left out. The runs of every layer of :meth:`layers_of` together are exactly the whole request's
        bytes, each written once (the same (source byte, destination byte) pairs; runs merged per layer).
        """
        segs = self.for_pair(src_rank, dst_rank)
        if not segs:
            return []
        wanted = None if layers is None else frozenset(int(x) for x in layers)
        src, dst = self._src.get(src_rank), self._dst.get(dst_rank)
        if src is None or dst is None:  # segments exist only between known ranks
            raise PlanError(f"no page table for sender rank {src_rank} or receiver rank {dst_rank}")
        sb, db = np.asarray(src_blocks, np.int64).reshape(-1), np.asarray(dst_blocks, np.int64).reshape(-1)
        for blocks, table, side in ((sb, src, "sender"), (db, dst, "receiver")):
            limit = min(p.num_blocks for p in table.pools)
            if blocks.size and (blocks.min() < 0 or blocks.max() >= limit):
                raise PlanError(f"{side} block id out of range 0..{limit - 1}")
        start, end = token_span(first_token, num_tokens, sb.size, db.size, src.block_size, dst.block_size)
        tmap = self._maps.get((src_rank, dst_rank))
        if tmap is not None:
            if wanted is not None:
                tmap = self._layer_map(src_rank, dst_rank, wanted)
            return [(sp, dp, r) for sp, dp, r in tmap.expand(sb, db, start, end) if wanted is None or r.num_runs]
        if wanted is not None:
            segs = self._layer_segments(src_rank, dst_rank, wanted)
            if not segs:
                return []
        n = (end - start) // src.block_size  # one block size: the span is whole blocks on both sides
        pool_runs = expand_runs(segs, src, dst, sb[:n], db[:n])
        return [(pr.src_pool, pr.dst_pool, merge_runs(pr.src_offsets, pr.dst_offsets, pr.lengths))
                for pr in pool_runs if wanted is None or pr.num_runs]
