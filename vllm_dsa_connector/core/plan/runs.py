"""Byte runs: the unit a transfer is described in.

A transfer copies ``lengths[i]`` bytes from ``src_offsets[i]`` of a source region to ``dst_offsets[i]`` of a
destination region (offsets relative to the registered regions). Engines pay per descriptor, so runs that
are contiguous on BOTH sides are merged before anything counts them (NIXL merges such descriptors itself:
4096 adjacent blocks post as one); the bounce gate decides on the merged count, never on blocks.
Everything here is vectorised numpy: no Python loop per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PACK_ALIGN", "Chunk", "Runs", "merge_adjacent", "merge_runs", "packed_offsets", "packed_parts", "plan_chunks", "runs_from_blocks"]


def _as_i64(name: str, values: object) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(values), dtype=np.int64).reshape(-1).view()
    arr.setflags(write=False)  # a read-only VIEW: the caller's array keeps its flags
    return arr


@dataclass(frozen=True, eq=False)
class Runs:
    """A transfer as byte runs (int64 numpy arrays of equal length, read-only).

    Order matters for the bounce transport: run ``i`` is packed into the staging buffer at
    ``staging_offsets()[i]`` (the prefix sum of the lengths), on the sender and on the receiver alike.
    """

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    _merged: Runs | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        src = _as_i64("src_offsets", self.src_offsets)
        dst = _as_i64("dst_offsets", self.dst_offsets)
        lens = _as_i64("lengths", self.lengths)
        if not (src.shape == dst.shape == lens.shape):
            raise ValueError(
                f"Runs: src_offsets, dst_offsets and lengths differ in length "
                f"({src.size}, {dst.size}, {lens.size})"
            )
        if src.size and (src.min() < 0 or dst.min() < 0 or lens.min() < 0):
            raise ValueError("Runs: offsets and lengths must be >= 0")
        object.__setattr__(self, "src_offsets", src)
        object.__setattr__(self, "dst_offsets", dst)
        object.__setattr__(self, "lengths", lens)

    @classmethod
    def empty(cls) -> Runs:
        """No bytes to move."""
        z = np.zeros(0, np.int64)
        return cls(z, z, z)

    @property
    def num_runs(self) -> int:
        """Number of runs (descriptors if posted as they are)."""
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        """Bytes moved."""
        return int(self.lengths.sum()) if self.lengths.size else 0

    def staging_offsets(self) -> np.ndarray:
        """Where each run lands in a packed staging buffer (exclusive prefix sum of the lengths)."""
        out = np.zeros(self.lengths.size, np.int64)
        if self.lengths.size > 1:
            np.cumsum(self.lengths[:-1], out=out[1:])
        return out

    def src_extent(self) -> int:
        """One past the last source byte touched (0 when empty)."""
        return int((self.src_offsets + self.lengths).max()) if self.lengths.size else 0

    def dst_extent(self) -> int:
        """One past the last destination byte touched (0 when empty)."""
        return int((self.dst_offsets + self.lengths).max()) if self.lengths.size else 0

    def check_bounds(self, src_size: int, dst_size: int, what: str = "transfer") -> None:
        """Raise ``ValueError`` when a run reaches past either region."""
        if self.src_extent() > src_size:
            raise ValueError(
                f"{what}: runs read up to byte {self.src_extent()} of a {src_size}-byte source"
            )
        if self.dst_extent() > dst_size:
            raise ValueError(
                f"{what}: runs write up to byte {self.dst_extent()} of a {dst_size}-byte destination"
            )

    def merged(self) -> Runs:
        """These runs with neighbours contiguous on both sides merged (see :func:`merge_runs`); cached."""
        m = self._merged
        if m is None:
            m = merge_runs(self.src_offsets, self.dst_offsets, self.lengths)
            object.__setattr__(self, "_merged", m)
        return m

    def __repr__(self) -> str:
        return f"Runs(num_runs={self.num_runs}, total_bytes={self.total_bytes})"


def merge_runs(
    src_offsets: object, dst_offsets: object, lengths: object, *, sort: bool = True
) -> Runs:
    """Merge runs contiguous on BOTH sides; drop empty runs.

    With ``sort`` (default) runs are also ordered by source offset (stable), so blocks listed out of
    order still merge when they are adjacent in both regions. Vectorised, no Python loop: one linear pass
    merges neighbours in the given order (pages of a block listed together collapse here), then only the
    survivors are sorted and merged again. Deterministic: both sides of a bounce get the same order.
    """
    src = np.asarray(src_offsets, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_offsets, dtype=np.int64).reshape(-1)
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not (src.shape == dst.shape == lens.shape):
        raise ValueError(f"merge_runs: array lengths differ ({src.size}, {dst.size}, {lens.size})")
    keep = lens > 0
    if not keep.all():
        src, dst, lens = src[keep], dst[keep], lens[keep]
    if src.size == 0:
        return Runs.empty()
    src, dst, lens = merge_adjacent(src, dst, lens)
    if sort and src.size > 1 and np.any(src[1:] < src[:-1]):
        order = np.argsort(src, kind="stable")
        src, dst, lens = merge_adjacent(src[order], dst[order], lens[order])
    out = Runs(src, dst, lens)
    object.__setattr__(out, "_merged", out)  # already merged: ``out.merged()`` costs nothing
    return out


def merge_adjacent(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge each run into its predecessor when it continues it on BOTH sides (given order; vectorised).

    The one implementation of the merge rule: the planner (``core.plan.peer_plan.expand_runs``) and the transport
    (:func:`merge_runs`) both use it. Returns ``(src, dst, length)`` arrays.
    """
    if src.size <= 1:
        return src, dst, length
    cont = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def runs_from_blocks(
    src_blocks: object,
    dst_blocks: object,
    block_bytes: int,
    *,
    src_base: int = 0,
    dst_base: int = 0,
    merge: bool = True,
) -> Runs:
    """Runs for copying whole blocks of ``block_bytes`` (block ``src_blocks[i]`` -> ``dst_blocks[i]``)."""
    s = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    if s.shape != d.shape:
        raise ValueError(
            f"runs_from_blocks: {s.size} source blocks but {d.size} destination blocks"
        )
    lens = np.full(s.size, int(block_bytes), np.int64)
    src, dst = s * block_bytes + src_base, d * block_bytes + dst_base
    return merge_runs(src, dst, lens) if merge else Runs(src, dst, lens)


@dataclass(frozen=True, eq=False)
class Chunk:
    """One piece of a pipelined transfer: staging bytes ``[start, start + nbytes)`` and the runs in them.

    ``runs`` keep their source and destination offsets; packed in order they fill exactly the chunk's
    staging range (gather chunk ``i`` into ``staging[start:start + nbytes]``, scatter it from there).
    """

    index: int
    start: int
    nbytes: int
    runs: Runs


def plan_chunks(runs: Runs, count: int, *, align: int = 4096) -> list[Chunk]:
    """Cut ``runs`` (in their packed order) into at most ``count`` chunks of about equal bytes.

    Cuts fall on multiples of ``align`` in the packed (staging) byte stream, so a run may be split
    between two chunks; every byte lands in exactly one chunk, in order. Deterministic: the sender and
    the receiver of a pipelined bounce compute the same plan from the same (merged) runs and ``count``.
    Vectorised (no Python loop per run). Empty chunks are dropped.
    """
    if count < 1:
        raise ValueError(f"plan_chunks: count must be >= 1, got {count}")
    if align < 1:
        raise ValueError(f"plan_chunks: align must be >= 1, got {align}")
    total = runs.total_bytes
    if count == 1 or total == 0:
        return [Chunk(0, 0, total, runs)] if total else []
    # Cut points in staging space: multiples of align near j * total / count, strictly inside (0, total).
    j = np.arange(1, count, dtype=np.int64)
    cuts = -(-(j * total // count) // align) * align
    cuts = np.unique(cuts[(cuts > 0) & (cuts < total)])
    keep = runs.lengths > 0
    src, dst, lens = runs.src_offsets[keep], runs.dst_offsets[keep], runs.lengths[keep]
    starts = np.zeros(lens.size, np.int64)
    if lens.size > 1:
        np.cumsum(lens[:-1], out=starts[1:])
    bounds = np.union1d(starts, cuts)  # every piece starts at a run start or a cut
    ends = np.r_[bounds[1:], total]
    r = np.searchsorted(starts, bounds, side="right") - 1  # the run each piece lies in
    delta = bounds - starts[r]
    p_src, p_dst, p_len = src[r] + delta, dst[r] + delta, ends - bounds
    chunk_of = np.searchsorted(cuts, bounds, side="right")
    edges = np.searchsorted(chunk_of, np.arange(cuts.size + 2), side="left")
    out: list[Chunk] = []
    for c in range(cuts.size + 1):
        a, b = int(edges[c]), int(edges[c + 1])
        if a == b:
            continue
        sub = Runs(p_src[a:b], p_dst[a:b], p_len[a:b])
        out.append(Chunk(len(out), int(bounds[a]), int(p_len[a:b].sum()), sub))
    return out


#: Where each part of a bounced writer starts in its slot: a multiple of this (the gather and scatter of a
#: part then use their widest integer view whatever the length of the part before it).
PACK_ALIGN = 512


def packed_offsets(sizes: Sequence[int], align: int = PACK_ALIGN) -> tuple[list[int], int]:
    """Start of each part in a bounced writer's slot, and the bytes the slot needs (the last part's end).

    Both sides compute it from the same runs, so the writer's packing and the receiver's scatter agree.
    """
    offsets: list[int] = []
    pos = 0
    for n in sizes:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += int(n)
    return offsets, pos


def packed_parts(parts: Sequence[Runs], align: int = PACK_ALIGN) -> tuple[list[Runs], list[int], int]:
    """A bounced writer's slot layout: each part's runs merged (the order it is gathered and scattered in), where
    each part starts in the slot (:func:`packed_offsets`) and the bytes the slot needs.

    The one place the layout is computed: the sender packs a bounce at these offsets (``RoutedTransport``),
    the receiver scatters from them (:meth:`~.receiver_data.WriterSpec.for_bounce`).
    """
    merged = [runs.merged() for runs in parts]
    offsets, total = packed_offsets([r.total_bytes for r in merged], align)
    return merged, offsets, total
