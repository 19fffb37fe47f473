"""Fencing a connection after an aborted WRITE, and the staging space such a WRITE held.

A WRITE that is still in flight after the write timeout is released (aborted) by the sender, but its bytes may
already sit in a socket buffer, or be queued behind a partition, and land at the receiver whenever the receiver
next progresses its agent, possibly after the receiver gave the blocks back (UCX over TCP: minutes after a
partition heals). :class:`Fences` tracks, per peer, whether a WRITE on the connection was aborted
(:meth:`Fences.aborted`), and sends the writer's next notice to that peer (its failure notice) as a fence
(:meth:`~.engine.NixlEngine.fence`: a 1-byte READ whose notification NIXL sends only after flushing the
connection). The notice's arrival at the receiver therefore proves that no byte of the aborted WRITEs can land
any more, and the fence's DONE here that none of them reads local memory any more: the staging reservations
those WRITEs read from (:meth:`Fences.hold`, quarantined meanwhile) go back to the arena then. A fence that
is not DONE within ``timeout_s`` (the link is down) closes the connection (the remote agent is removed and added
again: UCX destroys the endpoint with its queued operations and P's kernel drops the socket's unsent bytes)
and the staging space goes back too (with the engine's ``reconnect_inline`` off, once the reconnect run off
this thread made a new connection); a fence that fails (ERR) means the connection is gone: likewise. The
notice is then fenced again on the new connection (retried, under the engine's reconnect backoff, until it is
confirmed or the peer is forgotten): the receiver keeps the given-up blocks until a notice arrives.

Invariant: a staging reservation an aborted WRITE may still read is never handed out again before its
connection is fenced or closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc, Transfer, TransferError
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena

logger = logging.getLogger(__name__)

__all__ = ["Fences"]


@dataclass(eq=False)
class _Fence:
    """One posted fence and the staging reservations it frees once confirmed."""

    peer: str
    transfer: Transfer | None  # None: to be posted again (its connection was closed)
    held: list[Reservation]
    posted: float
    notif: bytes
    remote: RegionDesc
    closing: int | None = None  # the connection being closed off the caller's thread (held kept until then)


@dataclass(eq=False)
class Fences:
    """The fences of one sender's connections (see the module docstring).

    ``fenced``: fences confirmed (DONE); ``resets``: connections closed instead (the fence failed, could not
    be posted, or was not DONE within ``timeout_s``).
    """

    engine: NixlEngine
    timeout_s: float
    arena: StagingArena | None = None
    clock: Callable[[], float] = time.monotonic
    fenced: int = 0
    resets: int = 0
    _dirty: dict[str, RegionDesc] = field(default_factory=dict)  # peer -> a region of it a fence may READ
    _held: dict[str, list[Reservation]] = field(default_factory=dict)  # quarantined until the next fence
    _posted: list[_Fence] = field(default_factory=list)
    _reset_at: dict[str, float] = field(default_factory=dict)  # peer -> when a fence last closed its connection

    def aborted(self, peer: str, remote: RegionDesc | dict[str, Any]) -> None:
        """A WRITE to ``remote`` (a region of ``peer``) was aborted while in flight: fence before the next
        notice to ``peer``."""
        self._dirty.setdefault(peer, RegionDesc.from_dict(remote))

    def hold(self, peer: str, res: Reservation) -> None:
        """Quarantine ``res`` (an aborted WRITE to ``peer`` may still read it) until ``peer``'s connection is
        fenced or closed."""
        assert self.arena is not None
        self.arena.quarantine(res)
        self._held.setdefault(peer, []).append(res)

    def needed(self, peer: str) -> bool:
        """Whether a WRITE to ``peer`` was aborted since its last fence."""
        return peer in self._dirty or peer in self._held

    @property
    def pending(self) -> int:
        """Fences posted and not confirmed yet."""
        return len(self._posted)

    def send(self, peer: str, notif: bytes) -> None:
        """Send ``notif`` to ``peer`` as a fence (:meth:`needed` must be true); :class:`TransferError` when it
        cannot be posted (the connection is then treated as closed: its staging space goes back)."""
        remote = self._dirty.pop(peer, None)
        held = self._held.pop(peer, [])
        if remote is None:  # only staging held (a layered bounce whose WRITE never went): nothing to flush
            self._restore(held)
            self.engine.send_notification(peer, notif)
            return
        f = _Fence(peer, None, held, self.clock(), notif, remote)
        self._posted.append(f)
        try:
            f.transfer = self.engine.fence(peer, remote, notif)
        except TransferError:  # the connection is gone: nothing of it reads the staging; post it again later
            self._restore(f.held)
            f.held = []
            self.resets += 1
            raise

    def unposted(self) -> set[str]:
        """Peers with a fence to post again on a new connection (their reconnect may be due)."""
        return {f.peer for f in self._posted if f.transfer is None}

    def pending_for(self, peer: str) -> bool:
        """Whether a fence to ``peer`` is not confirmed yet."""
        return any(f.peer == peer for f in self._posted)

    def poll(self) -> None:
        """Confirm the fences that are DONE; close the connections of those that failed or are overdue (their
        notices, and those of every other fence posted on the closed connection, are fenced again on the next
        one)."""
        left = []
        for f in self._posted:
            if f.peer not in self.engine.peers:  # forgotten (its engine restarted or went idle): nobody waits
                self._restore(f.held)
                continue
            if f.transfer is None:  # its connection was closed: fence the notice on a new one
                if f.closing is not None:  # closed off this thread: staging held until the new connection
                    if self.engine.connection(f.peer) == f.closing:
                        left.append(f)
                        continue
                    self._restore(f.held)
                    f.held, f.closing = [], None
                try:
                    f.transfer, f.posted = self.engine.fence(f.peer, f.remote, f.notif), self.clock()
                except TransferError as e:  # unreachable, backing off: try again on a later poll
                    logger.debug("transport: fence to %r not posted again yet: %s", f.peer, e)
                left.append(f)
                continue
            st = self.engine.state(f.transfer)
            stale = f.posted <= self._reset_at.get(f.peer, float("-inf"))  # on a connection closed since
            if st == "PROC" and not stale and self.clock() - f.posted < self.timeout_s:
                left.append(f)
                continue
            try:
                self.engine.wait(f.transfer, 0.0)
                self.fenced += 1
                self._restore(f.held)
                continue
            except TransferError as e:
                if not stale:
                    self.resets += 1
                    why = f"fence not confirmed ({e}): connection closed"
                    logger.warning("transport: %s", why)
                    if st == "PROC":
                        try:  # drop the endpoint with whatever it still has queued; the next post reconnects
                            self.engine.close_connection(f.peer, why)
                        except TransferError as e2:
                            logger.warning("transport: closing the connection to %r: %s", f.peer, e2)
                        if not self.engine.reconnect_inline:  # closed once reconnected off this thread
                            self._reset_at[f.peer] = self.clock()
                            f.transfer, f.closing = None, self.engine.connection(f.peer)
                            left.append(f)
                            continue
                    self._reset_at[f.peer] = self.clock()
            self._restore(f.held)
            f.held, f.transfer = [], None
            left.append(f)
        self._posted = left

    def _restore(self, held: list[Reservation]) -> None:
        if self.arena is not None:
            for res in held:
                self.arena.slots.restore(res)
