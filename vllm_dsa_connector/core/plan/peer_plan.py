"""Who sends what to whom, per request: byte runs of a transfer plan for given block lists.

The plan itself (one elected source rank per destination page, PP/TP reshard, pages merged into
``Segment``s, the exactly-once proof) is built once per handshake by :mod:`vllm_dsa_connector.core.plan.segments`
over page tables alone. What this module adds is the per-request side: ``expand_runs`` turns segments and block
ids into byte runs (:class:`PoolRuns`), merged again across consecutive blocks (the merge rule itself lives
in ``core.plan.runs``: one implementation for planner and transport).

:class:`PeerPlan` is what a connector keeps per peer: both sides' decoded page tables and the plan, built
once at the handshake; ``PeerPlan.runs(src_rank, dst_rank, src_blocks, dst_blocks, first_token=,
num_tokens=, layers=)`` answers every per-request question (scheduler slot planning, the sender's WRITE,
the receiver's scatter, one layer of a layer-by-layer push) without parsing a table again.

P and D may use different block sizes (``Bp != Bd``): the plan still elects one sender per (destination,
role, layer), but pages are then mapped by token position (:mod:`vllm_dsa_connector.core.plan.token_map`: chunks of
``gcd(Bp, Bd)`` tokens, MLA rows and the indexer's block-split values/scales parts mapped separately)
instead of copied whole. ``Bp == Bd`` keeps the page-for-page runs exactly.

Which of P's blocks go into which of D's blocks (by token position) is :mod:`vllm_dsa_connector.core.plan.pairing`
(``pair_blocks_by_position``, ``BlockPairing``, ``PairingError``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from vllm_dsa_connector.core.plan.pages import PageTable
from vllm_dsa_connector.core.plan.runs import Runs, merge_adjacent, merge_runs
from vllm_dsa_connector.core.plan.segments import (
    Segment,
    TransferPlan,
    plan_transfer,
    segment_token_map,
)
from vllm_dsa_connector.core.plan.token_map import PlanError, TokenMap, build_token_map, token_span

__all__ = ["PeerPlan", "PoolRuns", "expand_runs"]


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
                maps[(sr, dr)] = segment_token_map(segs, src, dst)
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
        (``core.transfer.merge_runs``): blocks listed out of order (vLLM's free list hands them out in
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
