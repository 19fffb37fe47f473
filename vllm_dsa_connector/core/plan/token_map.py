"""Token-position mapping between two block sizes: P pages of ``Bp`` tokens onto D pages of ``Bd`` tokens.

When both sides use the same block size a page is copied whole (:func:`core.plan.peer_plan.expand_runs`). When they
differ, a page of one side is not a page of the other, and for the DSA indexer it is not even a run of
rows: its page is block-split (``[B x values][B x scales]``), so the scales of token ``t`` sit at
``B * values_per_token + (t % B) * scale_bytes`` and depend on each side's own ``B``. So the planner maps
token positions instead. With ``g = gcd(Bp, Bd)`` tokens per chunk, token ``t`` lies in P block
``t // Bp`` at in-page token ``t % Bp`` and in D block ``t // Bd`` at ``t % Bd``; one chunk of one layer
is one piece per page part::

    TOKEN_ROWS  (MLA latent, plain KV)  offset = entry.offset + (t % B) * bytes_per_token
    BLOCK_SPLIT (indexer K) values      offset = entry.offset + (t % B) * values_per_token
                            scales      offset = entry.offset + B * values_per_token + (t % B) * scale_bytes

each ``g * row`` bytes long. The pieces of a peer pair are decided once (:func:`build_token_map`, at the
handshake); per request :meth:`TokenMap.expand` turns a token span and both block lists into byte runs
with numpy int64 vector ops (no Python loop per block or chunk), merged by the one merge rule of
:mod:`vllm_dsa_connector.core.plan.runs`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_dsa_connector.core.plan.pages import PageFormat, PageTable
from vllm_dsa_connector.core.plan.runs import Runs, merge_runs

__all__ = ["PieceGroup", "PlanError", "TokenMap", "build_token_map", "check_dst_tiling", "token_span"]


class PlanError(ValueError):
    """Two sets of page tables that cannot exchange KV; the message names what differs.

    (Defined here, below the planner, so the token map can raise it; ``core.plan.peer_plan.PlanError`` is this class.)
    """


@dataclass(frozen=True, eq=False)
class PieceGroup:
    """The pieces of one ``g``-token chunk between one source pool and one destination pool.

    Piece ``j`` of the chunk starting at token ``t`` copies ``g * row[j]`` bytes from
    ``src_block * src_stride + src_base[j] + (t % Bp) * row[j]`` to
    ``dst_block * dst_stride + dst_base[j] + (t % Bd) * row[j]`` (offsets relative to each pool's base).
    """

    src_pool: int
    dst_pool: int
    src_stride: int
    dst_stride: int
    src_base: np.ndarray  # int64
    dst_base: np.ndarray  # int64
    row: np.ndarray  # int64 bytes per token of the piece's page part


@dataclass(frozen=True, eq=False)
class TokenMap:
    """What one source rank sends one destination rank per token chunk, when block sizes differ."""

    src_block_size: int
    dst_block_size: int
    groups: tuple[PieceGroup, ...]

    @property
    def chunk(self) -> int:
        """Tokens per chunk: ``gcd(Bp, Bd)``."""
        return math.gcd(self.src_block_size, self.dst_block_size)

    def expand(self, src_blocks: np.ndarray, dst_blocks: np.ndarray, start: int,
               end: int) -> list[tuple[int, int, Runs]]:
        """``[(src_pool, dst_pool, Runs)]`` for tokens ``[start, end)`` (multiples of :attr:`chunk`).

        ``src_blocks[i]`` holds tokens ``[(start // Bp + i) * Bp, +Bp)``, ``dst_blocks[j]`` tokens
        ``[(start // Bd + j) * Bd, +Bd)`` (the caller checked the span lies inside both lists). Runs come
        chunk by chunk in token order, then merged with sorting (``core.transfer.merge_runs``): the sender and
        the receiver compute the same runs in the same order.
        """
        bp, bd, g = self.src_block_size, self.dst_block_size, self.chunk
        t = np.arange(start, end, g, dtype=np.int64)
        out: list[tuple[int, int, Runs]] = []
        if t.size == 0:
            return out
        sb = src_blocks[t // bp - start // bp]
        db = dst_blocks[t // bd - start // bd]
        for grp in self.groups:
            src = (sb * grp.src_stride)[:, None] + grp.src_base[None, :] + (t % bp)[:, None] * grp.row[None, :]
            dst = (db * grp.dst_stride)[:, None] + grp.dst_base[None, :] + (t % bd)[:, None] * grp.row[None, :]
            length = np.broadcast_to(grp.row * g, src.shape)
            out.append((grp.src_pool, grp.dst_pool, merge_runs(src.ravel(), dst.ravel(), length.ravel())))
        return out


def _parts(table: PageTable, role: str, layer: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(pool, block stride, [(base offset, row bytes)] per page part) of one layer's page on one side."""
    view = table.view(role)
    entry = view.entry(layer) if view is not None else None
    if view is None or entry is None:
        raise PlanError(f"rank {table.rank} holds no {role} page of layer {layer}")
    b, bpt = table.block_size, view.bytes_per_token
    if entry.nbytes != b * bpt:
        raise PlanError(f"rank {table.rank} {role} layer {layer}: page of {entry.nbytes} B is not "
                        f"{b} tokens x {bpt} B")
    if view.page_format is PageFormat.TOKEN_ROWS:
        return view.pool, table.pools[view.pool].block_stride, [(entry.offset, bpt)]
    values = table.model.index_head_dim
    if not 0 < values < bpt:
        raise PlanError(f"rank {table.rank} {role} layer {layer}: a block-split page of {bpt} B per token "
                        f"needs 0 < values per token ({values}) < {bpt}")
    return view.pool, table.pools[view.pool].block_stride, [(entry.offset, values),
                                                            (entry.offset + b * values, bpt - values)]


def build_token_map(pages: Iterable[tuple[str, int]], src: PageTable, dst: PageTable) -> TokenMap:
    """The chunk pieces of the ``(role, global layer)`` pages ``src`` sends ``dst`` (decided once).

    Both sides must agree on bytes per token and page format of every page (the planner checked that);
    raises :class:`PlanError` naming the layer otherwise.
    """
    by_pools: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    strides: dict[tuple[int, int], tuple[int, int]] = {}
    for role, layer in pages:
        sp, sstride, sparts = _parts(src, role, layer)
        dp, dstride, dparts = _parts(dst, role, layer)
        if [r for _, r in sparts] != [r for _, r in dparts]:
            raise PlanError(f"{role} layer {layer}: page parts differ per token (sender "
                            f"{[r for _, r in sparts]}, receiver {[r for _, r in dparts]})")
        strides[(sp, dp)] = (sstride, dstride)
        by_pools.setdefault((sp, dp), []).extend(
            (so, do, r) for (so, r), (do, _) in zip(sparts, dparts, strict=True))
    groups = []
    for (sp, dp), pieces in sorted(by_pools.items()):
        arr = np.array(sorted(pieces), dtype=np.int64).reshape(-1, 3)
        groups.append(PieceGroup(sp, dp, *strides[(sp, dp)], arr[:, 0].copy(), arr[:, 1].copy(),
                                 arr[:, 2].copy()))
    return TokenMap(src.block_size, dst.block_size, tuple(groups))


def token_span(first_token: int, num_tokens: int | None, n_src: int, n_dst: int, src_block_size: int,
               dst_block_size: int) -> tuple[int, int]:
    """``(start, end)`` of the tokens to copy: ``first_token`` up to ``first_token + num_tokens`` rounded
    up to whole chunks of ``gcd(Bp, Bd)`` tokens (``None``: all that both block lists cover).

    ``n_src`` / ``n_dst`` source / destination blocks are listed from the blocks holding ``first_token``.
    Raises :class:`PlanError` for a span that does not start on a chunk or reaches past either list.
    """
    bp, bd = src_block_size, dst_block_size
    if bp < 1 or bd < 1:
        raise PlanError(f"block sizes must be positive (sender {bp}, receiver {bd})")
    g = math.gcd(bp, bd)
    if first_token < 0 or first_token % g:
        raise PlanError(f"first_token {first_token} is not a multiple of gcd({bp}, {bd}) = {g} "
                        "(a token span starts on a chunk boundary)")
    src_end = (first_token // bp + n_src) * bp
    dst_end = (first_token // bd + n_dst) * bd
    if num_tokens is None:
        return first_token, max(first_token, min(src_end, dst_end) // g * g)
    if num_tokens < 0:
        raise PlanError(f"num_tokens must be >= 0, got {num_tokens}")
    end = first_token + -(-num_tokens // g) * g
    if end > src_end or end > dst_end:
        raise PlanError(f"tokens {first_token}..{end - 1} asked: the sender's {n_src} blocks of {bp} cover "
                        f"up to token {src_end - 1}, the receiver's {n_dst} blocks of {bd} up to {dst_end - 1}")
    return first_token, end


def check_dst_tiling(maps: Sequence[TokenMap], dst: PageTable) -> None:
    """Byte-level exactly-once on the receiver: over one block of ``Bd`` tokens, the pieces of every
    sender's map tile every page of every view of ``dst`` exactly once (no gap, no overlap, nothing
    outside a page). Raises :class:`PlanError` naming the pool and the first bad byte."""
    bd = dst.block_size
    starts: dict[int, list[np.ndarray]] = {}
    lens: dict[int, list[np.ndarray]] = {}
    for m in maps:
        t = np.arange(0, bd, m.chunk, dtype=np.int64)
        for grp in m.groups:
            s = grp.dst_base[None, :] + t[:, None] * grp.row[None, :]
            starts.setdefault(grp.dst_pool, []).append(s.ravel())
            lens.setdefault(grp.dst_pool, []).append(np.broadcast_to(grp.row * m.chunk, s.shape).ravel())
    want: dict[int, list[tuple[int, int]]] = {}
    for v in dst.views:
        want.setdefault(v.pool, []).extend((e.offset, e.nbytes) for e in v.entries)
    for pool in sorted(set(want) | set(starts)):
        s = np.concatenate(starts.get(pool, [np.zeros(0, np.int64)]))
        n = np.concatenate(lens.get(pool, [np.zeros(0, np.int64)]))
        order = np.argsort(s, kind="stable")
        got = merge_runs(s[order], s[order], n[order], sort=False)
        if np.any(s[order][1:] < (s[order] + n[order])[:-1]):
            bad = int(s[order][1:][s[order][1:] < (s[order] + n[order])[:-1]][0])
            raise PlanError(f"receiver rank {dst.rank} pool {pool}: byte {bad} of a block is written twice")
        w = sorted(want.get(pool, []))
        ws = np.array([o for o, _ in w], np.int64)
        ref = merge_runs(ws, ws, np.array([n_ for _, n_ in w], np.int64), sort=False)
        if not (np.array_equal(got.src_offsets, ref.src_offsets) and np.array_equal(got.lengths, ref.lengths)):
            raise PlanError(f"receiver rank {dst.rank} pool {pool}: the senders' pieces cover "
                            f"{got.total_bytes} B of a block in {got.num_runs} ranges, its pages are "
                            f"{ref.total_bytes} B in {ref.num_runs} ranges (a gap or a stray write)")
