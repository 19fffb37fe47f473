"""Layer-by-layer push: one writer's post fed a layer at a time while later layers still compute.

During P's last prefill step the connector learns after each attention layer that this layer's pages (MLA
latent and, on an owning layer, the indexer K page) are final; posting them right away overlaps the
transfer with the layers still to run. The receiver (D) must not see a difference: it is armed for the
whole request as today, gets ONE completion notice per writer (the route's ``dsa1:<b|d|i><writer>:<tag>``,
:func:`~.notices.encode_notif`), and a bounced writer's bytes sit in its slot in the packed layout of the
one-shot bounce (each part at :func:`~.runs.packed_offsets` of the WHOLE request's merged runs, in merged
run order), so :class:`~.receiver.Receiver` scatters them unchanged.

A layered post (:class:`~.paths.base.LayeredPost`) lives in three calls of :class:`~.routed.RoutedTransport`,
each of which does what is common here and what the route needs through its path (:mod:`.paths`: ``open``,
``add``, ``close`` of :class:`~.paths.base.Path`):

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
from collections.abc import Sequence

import numpy as np

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.nixl.data import TransferError, TransferStats
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.paths import ROUTE_PATHS
from vllm_dsa_connector.core.transfer.paths.base import (
    LayeredPost,
    LayerPart,
    PathHost,
)
from vllm_dsa_connector.core.transfer.staging import StagingSlot
from vllm_dsa_connector.core.transfer.transports import Part, PostState, check_deadline

logger = logging.getLogger(__name__)

__all__ = ["add_layer", "close_post", "open_post", "progress"]


def open_post(host: PathHost, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str,
              slot: StagingSlot | None = None, pools: Sequence[int] = (),
              deadline: float | None = None) -> LayeredPost:
    """Open a layered post of the WHOLE request's ``parts``; nothing is written. Never raises: a route that
    cannot be followed is a FAILED post naming why (as ``RoutedTransport.post``)."""
    post = LayeredPost(peer, writer, tag, path, started=host.clock(), slot=slot, deadline=deadline)
    try:
        if path not in ROUTE_PATHS:
            raise TransferError(f"unknown path {path!r} (known: {', '.join(ROUTE_PATHS)})", peer=peer)
        merged = [runs.merged() for _, _, runs in parts]
        post._parts = [LayerPart(src, dst, m, m.staging_offsets(), got=np.zeros(m.num_runs, np.int64))
                       for (src, dst, _), m in zip(parts, merged, strict=True)]
        host.paths[path].open(post, pools)
    except Exception as e:  # noqa: BLE001 - a path that cannot be followed fails the post, never a crash
        post.error = f"cannot follow the receiver's {path} route to {peer!r}: {e}"
        post.state = PostState.FAILED
    return post


def _locate(part: LayerPart, idx: int, runs: Runs) -> tuple[Runs, np.ndarray]:
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


def _check_once(part: LayerPart, idx: int, start: np.ndarray, end: np.ndarray) -> None:
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


def add_layer(host: PathHost, post: LayeredPost, layer_parts: Sequence[tuple[int, Runs]], *,
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
        host.paths[post.path].add(post, located, deadline)
        _flush(host, post)
    except Exception as e:  # noqa: BLE001 - a failed layer fails the post, never a crash
        post.error = post.error or f"layered {post.path} post to {post.peer!r}: {e}"


def _flush(host: PathHost, post: LayeredPost) -> None:
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


def close_post(host: PathHost, post: LayeredPost) -> None:
    """No more layers: :func:`progress` completes the post once everything added is DONE (a second close
    does nothing). ipc: a CUDA event behind every copy, recorded now."""
    if not isinstance(post, LayeredPost):
        raise TypeError(f"close: {type(post).__name__} is not a layered post (RoutedTransport.open makes one)")
    if post.closed:
        return
    post.closed = True
    post._closed_at = post.started = host.clock()  # its span runs from here: the layers before were computing
    host.paths[post.path].close(post)


def _settle_writes(host: PathHost, post: LayeredPost) -> None:
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


def _finish(host: PathHost, post: LayeredPost, state: PostState) -> bool:
    res, post._res = post._res, None
    if res is not None and host.arena is not None:
        if post._poisoned:
            host.fences.hold(post.peer, res)  # until the connection is fenced or closed
        else:
            host.arena.release(res)
    post.state = state
    return True


def progress(host: PathHost, post: LayeredPost) -> bool:
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
