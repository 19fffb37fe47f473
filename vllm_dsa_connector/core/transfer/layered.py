"""Layer-by-layer push: one writer's post fed a layer at a time while later layers still compute.

During P's last prefill step the connector learns after each attention layer that this layer's pages (MLA
latent and, on an owning layer, the indexer K page) are final; posting them right away overlaps the
transfer with the layers still to run. The receiver (D) must not see a difference: it is armed for the
whole request as today, gets ONE completion notice per writer (the route's ``dsa1:<b|d|i><writer>:<tag>``,
:func:`~.notices.encode_notif`), and a bounced writer's bytes sit in its slot in the packed layout of the
one-shot bounce (each part at :func:`~.runs.packed_offsets` of the WHOLE request's merged runs, in merged
run order), so :class:`~.receiver.Receiver` scatters them unchanged.

A layered post (:class:`LayeredPost`) lives in three calls of :class:`~.routed.RoutedTransport`:

- :func:`open_post` (``RoutedTransport.open``): the whole request's parts, nothing written. A bounce
  reserves the whole packed size in the local staging arena now; an ipc route checks its mapping.
- :func:`add_layer` (``RoutedTransport.add``): one layer's runs per part index. Each run must lie inside
  one merged run of its part (located with ``np.searchsorted``; no Python loop per run) and no merged run
  may receive more bytes than it has (a byte added twice). ``direct``: one NIXL WRITE per part of these
  runs, no notification. ``ipc``: :func:`~.local_copy.copy_runs` into the mapped pool. ``bounce``: the runs
  are copied into the reservation at their packed positions, the bytes gathered per merged run counted,
  and the newly complete prefix of each part's packed region (up to the first merged run not fully
  gathered) written to the same offsets of D's slot in one WRITE. With layer-outermost pools every layer
  goes out as it is ready; with block-outermost pools (one merged run spans every layer of a block) the
  one WRITE happens at the last layer.
- :func:`close_post` (``RoutedTransport.close``): no more layers; :func:`progress` sends the notice once
  every WRITE / copy is DONE and every byte of the open's parts was added, then the post is DONE (on a
  connection that has not carried a completed WRITE, e.g. ipc's, once the notice can be presumed delivered:
  :meth:`~.agent.NixlAgent.notification_pending`).

CUDA sources: NIXL must not read a page before the kernels that wrote it finished, so ``add`` records a
``torch.cuda.Event`` on the current stream (after the gather or copy it enqueued, which is ordered on that
stream already) and the WRITE is posted from :func:`progress` once the event fired: ``add`` never blocks.
CPU sources post at once. No WRITE is posted at or after the deadline
(:func:`~.transports.check_deadline`): the post fails instead. Any failure (a WRITE in ERR or past the
timeout, the deadline, a copy that never finished, bytes never added) fails the post with the reason once
nothing is in flight any more; no completion notice is sent, the caller sends its failure notice as today
(``RoutedTransport.notify``). The bounce reservation is released once its WRITEs are over, quarantined when
a WRITE failed (it may still be read) or a gather never finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs, merge_runs, packed_offsets
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs
from vllm_dsa_connector.core.transfer.fence import Fences
from vllm_dsa_connector.core.transfer.nixl.data import (
    Region,
    RegionDesc,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import Part, Post, PostState, check_deadline

logger = logging.getLogger(__name__)

__all__ = ["LayerHost", "LayeredPost", "add_layer", "close_post", "open_post", "progress"]

_PATHS = ("direct", "bounce", "ipc")


class LayerHost(Protocol):
    """What a layered post needs of its transport (:class:`~.routed.RoutedTransport` is one)."""

    engine: NixlEngine
    arena: StagingArena | None
    region: Region | None
    timeout_s: float
    reserve_timeout_s: float
    clock: Callable[[], float]
    fences: Fences

    def mapping(self, peer: str) -> list[torch.Tensor] | None:
        """The peer's pools mapped here for ipc (``None``: not mapped)."""


@dataclass(eq=False)
class _Part:
    """One part of the open: where its bytes go, its whole merged runs and how much of each was added."""

    src: Region
    dst: RegionDesc | dict[str, Any]
    merged: Runs
    stage: np.ndarray  # start of each merged run inside the part's packed region (bounce)
    start: int = 0  # the part's packed region starts here in the slot (bounce)
    pool: int = -1  # the receiver's pool written into (ipc)
    got: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # bytes added per merged run
    sent: int = 0  # merged runs whose packed bytes were written (bounce)
    added: tuple[np.ndarray, np.ndarray] = field(  # source byte intervals added so far: sorted, disjoint
        default_factory=lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64)))

    @property
    def complete(self) -> bool:
        """Whether every byte of the part was added."""
        return bool(np.array_equal(self.got, self.merged.lengths))


@dataclass(eq=False)
class _Pending:
    """Work of one ``add`` waiting for its CUDA event (``None``: ready): WRITEs to post, or ipc copies."""

    event: Any
    writes: list[tuple[Region, RegionDesc | dict[str, Any], Runs]]
    deadline: float | None
    started: float
    copied: tuple[int, int] | None = None  # ipc: (runs, bytes) copied, recorded as one TransferStats


@dataclass(eq=False)
class LayeredPost(Post):
    """A post fed layer by layer (see the module docstring); ``stats``: one TransferStats per WRITE / copy;
    ``seconds``: one span, from its close (the last layer added) or, on CUDA, the post of a layer whose kernels
    finished after the close (the CPU runs ahead of the device) to its last part's completion, i.e. the
    transfer time left after P's last layer was computed."""

    slot: StagingSlot | None = None
    deadline: float | None = None
    closed: bool = False
    _parts: list[_Part] = field(default_factory=list, repr=False)
    _res: Reservation | None = field(default=None, repr=False)
    _pending: list[_Pending] = field(default_factory=list, repr=False)
    _close_event: Any = field(default=None, repr=False)
    _closed_at: float = field(default=0.0, repr=False)
    _poisoned: bool = field(default=False, repr=False)  # a failed WRITE or unfinished gather: quarantine


def open_post(host: LayerHost, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str,
              slot: StagingSlot | None = None, pools: Sequence[int] = (),
              deadline: float | None = None) -> LayeredPost:
    """Open a layered post of the WHOLE request's ``parts``; nothing is written. Never raises: a route that
    cannot be followed is a FAILED post naming why (as ``RoutedTransport.post``)."""
    post = LayeredPost(peer, writer, tag, path, started=host.clock(), slot=slot, deadline=deadline)
    try:
        if path not in _PATHS:
            raise TransferError(f"unknown path {path!r} (known: {', '.join(_PATHS)})", peer=peer)
        merged = [runs.merged() for _, _, runs in parts]
        post._parts = [_Part(src, dst, m, m.staging_offsets(), got=np.zeros(m.num_runs, np.int64))
                       for (src, dst, _), m in zip(parts, merged, strict=True)]
        if path == "bounce":
            _open_bounce(host, post)
        elif path == "ipc":
            _open_ipc(host, post, pools)
    except Exception as e:  # noqa: BLE001 - a path that cannot be followed fails the post, never a crash
        post.error = f"cannot follow the receiver's {path} route to {peer!r}: {e}"
        post.state = PostState.FAILED
    return post


def _open_bounce(host: LayerHost, post: LayeredPost) -> None:
    """Reserve the whole packed size now; each part's packed region as the one-shot bounce lays it out."""
    peer, slot = post.peer, post.slot
    if host.arena is None or host.region is None:
        raise TransferError("this writer has no staging arena (bounce_mode=never here)", peer=peer)
    if slot is None:
        raise TransferError("the receiver named a bounce without a staging slot", peer=peer)
    offsets, total = packed_offsets([p.merged.total_bytes for p in post._parts])
    if total > slot.size:
        raise TransferError(f"its slot holds {slot.size} B, the parts need {total} B", peer=peer)
    res = host.arena.reserve(total, host.reserve_timeout_s)
    if res is None:
        raise TransferError(f"no {total} B free in the local staging arena within {host.reserve_timeout_s} s "
                            f"({host.arena.free_bytes} B free)", peer=peer)
    post._res = res
    for p, off in zip(post._parts, offsets, strict=True):
        p.start = off


def _open_ipc(host: LayerHost, post: LayeredPost, pools: Sequence[int]) -> None:
    maps = host.mapping(post.peer)
    if maps is None:
        raise TransferError("the receiver's pools are not mapped here", peer=post.peer)
    if len(pools) != len(post._parts) or any(not 0 <= q < len(maps) for q in pools):
        raise TransferError(f"pools {list(pools)} do not name {len(post._parts)} of the {len(maps)} mapped pools",
                            peer=post.peer)
    for p, q in zip(post._parts, pools, strict=True):
        p.merged.check_bounds(p.src.size, maps[q].numel(), what=f"ipc copy to pool {q} of {post.peer!r}")
        p.pool = q


def _locate(part: _Part, idx: int, runs: Runs) -> tuple[Runs, np.ndarray]:
    """``runs`` without empty ones and the merged run each lies in; ``ValueError`` for a run outside the
    part's whole runs or bytes added twice (vectorised)."""
    keep = runs.lengths > 0
    r = runs if keep.all() else Runs(runs.src_offsets[keep], runs.dst_offsets[keep], runs.lengths[keep])
    m = part.merged
    s, d, n = r.src_offsets, r.dst_offsets, r.lengths
    k = np.searchsorted(m.src_offsets, s, side="right") - 1
    kk = np.clip(k, 0, max(m.num_runs - 1, 0))
    if m.num_runs == 0:
        ok = np.zeros(s.size, bool)
    else:
        ok = (k >= 0) & (s + n <= m.src_offsets[kk] + m.lengths[kk]) & (d - m.dst_offsets[kk] == s - m.src_offsets[kk])
    if not ok.all():
        j = int(np.flatnonzero(~ok)[0])
        raise ValueError(f"layered post: run {j} of part {idx} (src byte {int(s[j])}, dst byte {int(d[j])}, "
                         f"{int(n[j])} B) lies inside none of the part's runs given at open")
    _check_once(part, idx, s, s + n)
    return r, kk


def _check_once(part: _Part, idx: int, start: np.ndarray, end: np.ndarray) -> None:
    """``ValueError`` when a source byte in ``[start, end)`` was added before or twice now (vectorised:
    the new intervals sorted, each checked against its neighbours and the added ones by searchsorted);
    records them as added (a refused add fails its post, so nothing relies on them then)."""
    if start.size == 0:
        return
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    old_s, old_e = part.added
    i = np.searchsorted(old_s, s, side="right")
    clash = s[1:] < e[:-1]  # two new runs overlap
    before = (i > 0) & (old_e[np.maximum(i - 1, 0)] > s) if old_s.size else np.zeros(s.size, bool)
    after = (i < old_s.size) & (old_s[np.minimum(i, old_s.size - 1)] < e) if old_s.size else before
    bad = np.flatnonzero(before | after | np.r_[clash, False] | np.r_[False, clash])
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"layered post: part {idx}'s source bytes {int(s[j])}..{int(e[j]) - 1} were added "
                         "before: bytes added twice")
    cs, ce = np.concatenate([old_s, s]), np.concatenate([old_e, e])
    order = np.argsort(cs, kind="stable")
    cs, ce = cs[order], ce[order]
    keep = np.r_[True, cs[1:] != ce[:-1]]  # join touching intervals: the list stays short
    starts = np.flatnonzero(keep)
    part.added = (cs[starts], np.r_[ce[starts[1:] - 1], ce[-1:]])


def add_layer(host: LayerHost, post: LayeredPost, layer_parts: Sequence[tuple[int, Runs]], *,
              deadline: float | None = None) -> None:
    """Post one layer's runs (``(part index of the open, Runs)`` each; see the module docstring).

    ``ValueError`` for a misuse (the post is closed, an unknown part, a run outside its part's whole runs,
    bytes added twice; the post then fails too unless it was closed); a post that already failed checks
    and then ignores further layers. Transport failures (the deadline, a refused WRITE) fail the post and never raise.
    ``deadline``: this layer's (``None``: the open's).
    """
    if not isinstance(post, LayeredPost):
        raise TypeError(f"add: {type(post).__name__} is not a layered post (RoutedTransport.open makes one)")
    if post.closed:
        raise ValueError(f"add: the layered post of writer {post.writer} to {post.peer!r} is closed")
    try:  # a misuse is refused whatever the post's state
        located = []
        for idx, runs in layer_parts:
            if not 0 <= idx < len(post._parts):
                raise ValueError(f"add: part {idx} of a post opened with {len(post._parts)} parts")
            located.append((idx, *_locate(post._parts[idx], idx, runs)))
    except ValueError as e:
        post.error = post.error or str(e)
        raise
    if post.error or post.state is not PostState.IN_FLIGHT:
        return
    deadline = post.deadline if deadline is None else deadline
    try:
        check_deadline(deadline, f"layered {post.path} post to {post.peer!r}")
        _stage(host, post, located, deadline)
        _flush(host, post)
    except Exception as e:  # noqa: BLE001 - a failed layer fails the post, never a crash
        post.error = post.error or f"layered {post.path} post to {post.peer!r}: {e}"


def _event_after(tensors: Sequence[torch.Tensor]) -> Any:
    """A CUDA event recorded on the current stream of the first CUDA tensor (``None``: all on CPU)."""
    for t in tensors:
        if t.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            return ev
    return None


def _stage(host: LayerHost, post: LayeredPost, located: list[tuple[int, Runs, np.ndarray]],
           deadline: float | None) -> None:
    """Enqueue one layer's copies and queue its WRITEs (posted by :func:`_flush` once its event fired)."""
    now = host.clock()
    srcs = [post._parts[idx].src.tensor for idx, *_ in located]
    if post.path == "direct":
        writes = []
        for idx, runs, k in located:
            p = post._parts[idx]
            writes.append((p.src, p.dst, merge_runs(runs.src_offsets, runs.dst_offsets, runs.lengths)))
            np.add.at(p.got, k, runs.lengths)
        post._pending.append(_Pending(_event_after(srcs), writes, deadline, now))
        return
    if post.path == "ipc":
        maps = host.mapping(post.peer)
        if maps is None:
            raise TransferError("the receiver's pools are no longer mapped here", peer=post.peer)
        nruns = nbytes = 0
        for idx, runs, k in located:
            p = post._parts[idx]
            copy_runs(p.src.tensor, maps[p.pool], runs)
            np.add.at(p.got, k, runs.lengths)
            nruns, nbytes = nruns + runs.num_runs, nbytes + runs.total_bytes
        if nbytes:
            post._pending.append(_Pending(_event_after(srcs), [], deadline, now, (nruns, nbytes)))
        return
    assert host.arena is not None and host.region is not None and post._res is not None and post.slot is not None
    base = post._res.offset
    for idx, runs, k in located:  # gather at the packed positions of the whole request's layout
        p = post._parts[idx]
        packed = base + p.start + p.stage[k] + (runs.src_offsets - p.merged.src_offsets[k])
        copy_runs(p.src.tensor, host.arena.buffer, Runs(runs.src_offsets, packed, runs.lengths))
        np.add.at(p.got, k, runs.lengths)
    local, remote, lens = [], [], []
    for p in post._parts:  # the newly complete prefix of each part's packed region
        done = p.got[p.sent:] == p.merged.lengths[p.sent:]
        front = p.sent + (int(np.argmin(done)) if not done.all() else done.size)
        if front == p.sent:
            continue
        a = int(p.stage[p.sent])
        b = int(p.stage[front]) if front < p.merged.num_runs else p.merged.total_bytes
        local.append(base + p.start + a)
        remote.append(post.slot.offset + p.start + a)
        lens.append(b - a)
        p.sent = front
    if lens:
        one = merge_runs(local, remote, lens)
        post._pending.append(_Pending(_event_after([host.arena.buffer, *srcs]), [(host.region, post.slot.region, one)],
                                      deadline, now))


def _flush(host: LayerHost, post: LayeredPost) -> None:
    """Post the WRITEs (and count the copies) of pending layers whose event fired, in order; raises what
    fails (a passed deadline, a refused WRITE, an event past the timeout)."""
    now = host.clock()
    while post._pending:
        pend = post._pending[0]
        if pend.event is not None and not pend.event.query():
            if now - pend.started >= host.timeout_s:
                post._poisoned = True  # the gather may still write into the reservation
                raise TransferError(f"a layer's copies to {post.peer!r} not done after {host.timeout_s} s",
                                    peer=post.peer)
            return
        post._pending.pop(0)
        if post.closed:  # a layer whose pages became final after the close: the post's span starts at its post
            post.started = max(post.started, now)
        if pend.copied is not None:
            post.completed(TransferStats(*pend.copied, now - pend.started, 0), now)
        if not post.error:
            for src, dst, runs in pend.writes:
                check_deadline(pend.deadline, f"layered {post.path} WRITE to {post.peer!r}")
                post._inflight.append(host.engine.write(post.peer, src, dst, runs, deadline=pend.deadline))


def close_post(host: LayerHost, post: LayeredPost) -> None:
    """No more layers: :func:`progress` completes the post once everything added is DONE (a second close
    does nothing). ipc: a CUDA event behind every copy, recorded now."""
    if not isinstance(post, LayeredPost):
        raise TypeError(f"close: {type(post).__name__} is not a layered post (RoutedTransport.open makes one)")
    if post.closed:
        return
    post.closed = True
    post._closed_at = post.started = host.clock()  # its span runs from here: the layers before were computing
    if post.path == "ipc" and post.state is PostState.IN_FLIGHT:
        post._close_event = _event_after([p.src.tensor for p in post._parts])


def _settle_writes(host: LayerHost, post: LayeredPost) -> None:
    """Complete the WRITEs that are DONE, ERR or past the timeout (as the direct transport does)."""
    now = host.clock()
    remaining = []
    for t in post._inflight:
        st = host.engine.state(t)
        if st == "PROC" and now - t.started < host.timeout_s:
            remaining.append(t)
            continue
        try:
            post.completed(host.engine.wait(t, host.timeout_s), host.clock())
        except TransferError as e:
            post.error = post.error or str(e)
            post._poisoned = True  # the WRITE may still read the reservation
            if st == "PROC":  # aborted: its bytes may still land, fence before the failure notice
                host.fences.aborted(post.peer, post.slot.region if post.slot is not None else post._parts[0].dst)
    post._inflight = remaining


def _finish(host: LayerHost, post: LayeredPost, state: PostState) -> bool:
    res, post._res = post._res, None
    if res is not None and host.arena is not None:
        if post._poisoned:
            host.fences.hold(post.peer, res)  # until the connection is fenced or closed
        else:
            host.arena.release(res)
    post.state = state
    return True


def progress(host: LayerHost, post: LayeredPost) -> bool:
    """Drive a layered post; ``True`` once it is over (``post.state`` DONE or FAILED). Never raises."""
    if post.state is not PostState.IN_FLIGHT:
        return True
    try:
        _flush(host, post)
    except Exception as e:  # noqa: BLE001 - a layer that cannot be posted fails the post
        post.error = post.error or f"layered {post.path} post to {post.peer!r}: {e}"
    _settle_writes(host, post)
    if post.error:
        if post._inflight or (post._pending and not post._poisoned):
            return False  # wait for what is in flight (a gather or copy may still run) before failing
        post._pending.clear()
        return _finish(host, post, PostState.FAILED)
    if not post.closed or post._pending or post._inflight:
        return False
    if post._close_event is not None and not post._close_event.query():
        if host.clock() - post._closed_at < host.timeout_s:
            return False
        post.error = f"ipc copies to {post.peer!r} not done after {host.timeout_s} s"
        return _finish(host, post, PostState.FAILED)
    missing = [i for i, p in enumerate(post._parts) if not p.complete]
    if missing:
        p = post._parts[missing[0]]
        post.error = (f"layered {post.path} post to {post.peer!r} closed before every byte was added: part "
                      f"{missing[0]} got {int(p.got.sum())} of {p.merged.total_bytes} B")
        return _finish(host, post, PostState.FAILED)
    if not post._noticed:
        post.finished = max(post.finished, host.clock())  # closed, every part seen complete (ipc: its event)
        try:
            post._noticed = True
            host.engine.send_notification(post.peer, encode_notif(post.path, post.writer, post.tag))
        except Exception as e:  # noqa: BLE001 - no notice: the receiver fails the writer after its timeout
            post.error = f"completion notice to {post.peer!r} not sent: {e}"
            return _finish(host, post, PostState.FAILED)
    if host.engine.notification_pending(post.peer):
        return False  # a cold connection: progress until the notice can be presumed delivered (:mod:`.agent`)
    logger.debug("layered %s post of writer %d to %r done (%d WRITEs/copies)", post.path, post.writer,
                 post.peer, len(post.stats))
    return _finish(host, post, PostState.DONE)
