"""The connector's sending side: each writer's post follows the path the receiver chose for it.

The receiver (D) picks one path per (destination rank, source rank) pair when it registers a request and
arms its receive for that path; the writer follows it and never picks another (a path it cannot follow
fails the post with the reason, and the caller's failure notice tells D):

- ``direct``: :class:`~.transports.DirectTransport`: one NIXL WRITE per part, ``dsa1:d<writer>:<tag>``
  once every WRITE is DONE.
- ``bounce``: every part gathered into ONE reservation of the local staging arena, back to back at the
  offsets of :func:`~.runs.packed_offsets` (each part packed in its merged run order), then one WRITE into the
  receiver's slot that carries ``dsa1:b<writer>:<tag>``; the receiver scatters each part from the same
  offsets (:class:`~.receiver.WriterSpec` ``parts``).
- ``ipc`` (same host, CUDA pools): one copy per part (:func:`~.local_copy.copy_runs`) into this process's
  CUDA IPC mapping of the receiver's pools (:meth:`RoutedTransport.map_peer`, opened once per peer), a
  CUDA event behind the copies, and ``dsa1:i<writer>:<tag>`` once it fired (polled from
  :meth:`RoutedTransport.progress`, never waited on in a step). No WRITE crosses the connection, so on a
  cold one the post stays IN_FLIGHT after the notification until it can be presumed delivered
  (:meth:`~.agent.NixlAgent.notification_pending`: NIXL does not track it, it leaves while P progresses).

A writer may also push layer by layer (:mod:`.layered`): :meth:`RoutedTransport.open` the whole request's
parts, :meth:`RoutedTransport.add` each layer's runs as its attention ran, :meth:`RoutedTransport.close`;
the receiver sees the same notice and (bounce) the same packed slot as from one :meth:`RoutedTransport.post`.

No vLLM imports: the caller passes the route as plain values (``path``, and the slot for a bounce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs, packed_offsets
from vllm_dsa_connector.core.transfer import layered
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs, gather, sync
from vllm_dsa_connector.core.transfer.fence import Fences
from vllm_dsa_connector.core.transfer.ipc import IpcUnavailable, open_region
from vllm_dsa_connector.core.transfer.nixl.agent import PeerReconnecting
from vllm_dsa_connector.core.transfer.nixl.data import Transfer, TransferError, TransferStats
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import (
    DirectTransport,
    Part,
    Post,
    PostState,
    check_deadline,
)

logger = logging.getLogger(__name__)

__all__ = ["ROUTE_PATHS", "RoutedTransport"]

#: Every path a post can follow.
ROUTE_PATHS = ("direct", "bounce", "ipc")
@dataclass(eq=False)
class _Bounced:
    """The one WRITE of a bounced post and the local staging it was gathered into."""

    transfer: Transfer
    res: Reservation | None
    remote: Any = None  # the receiver's slot region (what a fence READs)


@dataclass(eq=False)
class _Copied:
    """The copies of an ipc post: the event behind them and the notification to send once it fired."""

    event: Any
    notif: bytes
    num_runs: int
    total_bytes: int
    started: float = field(default_factory=time.perf_counter)
    sent: bool = False  # the notification went out (it may still wait in the agent on a cold connection)
    late: bool = False  # past the timeout: the post fails, once the copies are over (never before)


class RoutedTransport:
    """Posts that follow their route: ``post(peer, parts, writer=, tag=, path=, slot=, deadline=)``.

    ``arena``: the local staging arena of bounced posts (``None``: a bounce route fails; this writer offered
    none); ``timeout_s``: a WRITE or copy still running after it is FAILED (a WRITE is released, i.e.
    aborted). ``reserve_timeout_s``: bounded wait for local staging space before a bounce fails.
    """

    def __init__(self, engine: NixlEngine, timeout_s: float = 30.0, *, arena: StagingArena | None = None,
                 reserve_timeout_s: float = 0.2, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.direct = DirectTransport(engine, timeout_s, clock)
        self.timeout_s = timeout_s
        self.clock = clock
        self.arena = arena
        self.reserve_timeout_s = reserve_timeout_s
        self.region = engine.register(arena.buffer) if arena is not None else None
        self.fences = Fences(engine, timeout_s, arena)  # connections with an aborted WRITE (:mod:`.fence`)
        self.direct.fences = self.fences
        self._maps: dict[str, list[torch.Tensor]] = {}  # peer agent -> its pools mapped here (ipc)

    # -- ipc mappings ---------------------------------------------------------------------------------

    def map_peer(self, peer: str, exports: Sequence[Any], device: torch.device | str) -> None:
        """Open the peer's exported pools (``IpcDesc`` dicts, pool order) for kernels on ``device``, once per
        peer agent; :class:`~.ipc.IpcUnavailable` naming the pool when one cannot be opened here."""
        if peer in self._maps:
            return
        maps = []
        for i, desc in enumerate(exports):
            try:
                maps.append(open_region(desc, device))
            except IpcUnavailable as e:
                raise IpcUnavailable(f"pool {i} of peer {peer!r}: {e}") from None
        self._maps[peer] = maps

    def unmap_peer(self, peer: str) -> None:
        """Drop the mappings of ``peer`` (its engine restarted or was forgotten)."""
        self._maps.pop(peer, None)

    def mapped(self, peer: str) -> bool:
        """Whether the pools of ``peer`` are mapped here."""
        return peer in self._maps

    def mapping(self, peer: str) -> list[torch.Tensor] | None:
        """The pools of ``peer`` mapped here (pool order), ``None`` when not mapped."""
        return self._maps.get(peer)

    # -- posting -------------------------------------------------------------------------------------

    def post(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str = "direct",
             slot: StagingSlot | None = None, pools: Sequence[int] = (), deadline: float | None = None) -> Post:
        """Post one writer's ``parts`` along ``path``; raises only :class:`~.agent.PeerReconnecting` (nothing was
        posted: post again once the peer's reconnect is over), any other failure is ``post.error``.

        ``slot``: the receiver's staging slot of a bounce; ``pools``: for ipc, the receiver's pool index of
        each part (the mapping written into).
        """
        if path == "direct":
            return self.direct.post(peer, parts, writer=writer, tag=tag, deadline=deadline)
        post = Post(peer, writer, tag, path, started=self.clock())
        try:
            if path == "bounce":
                post._inflight.append(self._bounce(peer, parts, writer, tag, slot, deadline))  # type: ignore[arg-type]
            elif path == "ipc":
                post._inflight.append(self._ipc(peer, parts, writer, tag, pools, deadline))  # type: ignore[arg-type]
            else:
                raise TransferError(f"unknown path {path!r} (known: {', '.join(ROUTE_PATHS)})", peer=peer)
        except PeerReconnecting:  # nothing posted (see the docstring)
            raise
        except Exception as e:  # noqa: BLE001 - a path that cannot be followed fails the post, never a crash
            post.error = f"cannot follow the receiver's {path} route to {peer!r}: {e}"
            post.state = PostState.FAILED
        return post

    def _bounce(self, peer: str, parts: Sequence[Part], writer: int, tag: bytes, slot: StagingSlot | None,
                deadline: float | None) -> _Bounced:
        if self.arena is None or self.region is None:
            raise TransferError("this writer has no staging arena (bounce_mode=never here)", peer=peer)
        if slot is None:
            raise TransferError("the receiver named a bounce without a staging slot", peer=peer)
        merged = [runs.merged() for _, _, runs in parts]
        offsets, total = packed_offsets([r.total_bytes for r in merged])
        if total > slot.size:
            raise TransferError(f"its slot holds {slot.size} B, the parts need {total} B", peer=peer)
        res = self.arena.reserve(total, self.reserve_timeout_s)
        if res is None:
            raise TransferError(f"no {total} B free in the local staging arena within {self.reserve_timeout_s} s "
                                f"({self.arena.free_bytes} B free)", peer=peer)
        try:
            view = self.arena.view(res)
            for (src, _, _), runs, off in zip(parts, merged, offsets, strict=True):
                gather(src.tensor, runs, view[off:])
            sync(self.arena.buffer)
            check_deadline(deadline, f"bounce to {peer!r}")
            one = Runs(np.array([res.offset]), np.array([slot.offset]), np.array([total]))
            return _Bounced(self.engine.write(peer, self.region, slot.region, one, encode_notif("bounce", writer, tag),
                                              deadline=deadline), res, slot.region)
        except BaseException:
            self.arena.release(res)  # nothing was posted from it
            raise

    def _ipc(self, peer: str, parts: Sequence[Part], writer: int, tag: bytes, pools: Sequence[int],
             deadline: float | None) -> _Copied:
        maps = self._maps.get(peer)
        if maps is None:
            raise TransferError("the receiver's pools are not mapped here", peer=peer)
        if len(pools) != len(parts) or any(not 0 <= p < len(maps) for p in pools):
            raise TransferError(f"pools {list(pools)} do not name {len(parts)} of the {len(maps)} mapped pools",
                                peer=peer)
        check_deadline(deadline, f"ipc copy to {peer!r}")
        nruns = nbytes = 0
        device = None
        for (src, _, runs), pool in zip(parts, pools, strict=True):
            merged = runs.merged()
            merged.check_bounds(src.size, maps[pool].numel(), what=f"ipc copy to pool {pool} of {peer!r}")
            copy_runs(src.tensor, maps[pool], merged)
            nruns += merged.num_runs
            nbytes += merged.total_bytes
            device = src.tensor.device
        event = None
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return _Copied(event, encode_notif("ipc", writer, tag), nruns, nbytes)

    # -- layer by layer (:mod:`.layered`) ------------------------------------------------------------

    def open(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str,
             slot: StagingSlot | None = None, pools: Sequence[int] = (),
             deadline: float | None = None) -> Post:
        """Open a layer-by-layer post of the WHOLE request's ``parts`` (as for :meth:`post`); nothing is
        written yet (a bounce reserves its whole packed size now). Never raises: FAILED with the reason."""
        return layered.open_post(self, peer, parts, writer=writer, tag=tag, path=path, slot=slot, pools=pools,
                                 deadline=deadline)

    def add(self, post: Post, layer_parts: Sequence[tuple[int, Runs]], *, deadline: float | None = None) -> None:
        """Post one layer's runs, ``(part index of the open, Runs)`` each, no notice; ``ValueError`` for
        runs outside the open's parts or an add after :meth:`close` (:func:`.layered.add_layer`)."""
        layered.add_layer(self, post, layer_parts, deadline=deadline)  # type: ignore[arg-type]

    def close(self, post: Post) -> None:
        """No more layers: :meth:`progress` sends the route's one notice once everything is DONE."""
        layered.close_post(self, post)  # type: ignore[arg-type]

    # -- progress ------------------------------------------------------------------------------------

    def progress(self, post: Post) -> bool:
        """Drive the post; ``True`` once it is over (``post.state`` DONE or FAILED). Never raises."""
        self.fences.poll()
        if post.state is not PostState.IN_FLIGHT:
            return True
        if isinstance(post, layered.LayeredPost):
            return layered.progress(self, post)
        if post.path == "direct":
            return self.direct.progress(post)
        remaining: list[Any] = []
        for x in post._inflight:
            try:
                if not self._settle(post, x):
                    remaining.append(x)
            except Exception as e:  # noqa: BLE001 - a failed WRITE or copy fails the post
                post.error = post.error or str(e)
        post._inflight = remaining
        if remaining:
            return False
        post.state = PostState.FAILED if post.error else PostState.DONE
        return True

    def _settle(self, post: Post, x: Any) -> bool:
        """``True`` once ``x`` is over (its stats recorded); raises what made it fail."""
        now = self.clock()
        if isinstance(x, _Bounced):
            st = self.engine.state(x.transfer)
            if st == "PROC" and now - x.transfer.started < self.timeout_s:
                return False
            try:
                post.completed(self.engine.wait(x.transfer, self.timeout_s), self.clock())
            except BaseException:
                if st == "PROC" and x.remote is not None:
                    self.fences.aborted(post.peer, x.remote)  # its bytes may still land: fence first
                if x.res is not None and self.arena is not None:
                    self.fences.hold(post.peer, x.res)  # the WRITE may still read it: until fenced
                    x.res = None
                raise
            if x.res is not None and self.arena is not None:
                self.arena.release(x.res)
                x.res = None
            return True
        assert isinstance(x, _Copied)
        if x.sent:
            return not self.engine.notification_pending(post.peer)
        if x.event is not None and not x.event.query():
            if now - x.started >= self.timeout_s and not x.late:
                x.late = True  # fails the post, but only once the copies are over: they write into D's blocks
                post.error = post.error or f"ipc copy to {post.peer!r} not done after {self.timeout_s} s"
            return False
        if x.late:
            raise TransferError(post.error, peer=post.peer)
        x.sent = self.engine.send_notification(post.peer, x.notif)
        post.completed(TransferStats(x.num_runs, x.total_bytes, now - x.started, 0), now)
        return not x.sent

    def poll_fences(self) -> None:
        """Confirm posted fences (:class:`~.fence.Fences`); call while any is pending (:attr:`Fences.pending`)."""
        self.fences.poll()

    def notify(self, peer: str, writer: int, tag: bytes) -> None:
        """A notification ``dsa1:d<writer>:<tag>`` on its own (the caller's failure notice); as a fence after
        an aborted WRITE to ``peer`` (:mod:`.fence`)."""
        self.direct.notify(peer, writer, tag)
