"""Notifications that arrive before their request is armed on the receiver, kept within bounds.

A writer's notification may overtake the receiver's :meth:`~.receiver.Receiver.arm` (P's WRITE completes
before D's step arms the load). :class:`EarlyNotices` keeps such notifications until their key is armed
(:meth:`take`), cancelled, or they expire, bounded three ways so a peer cannot grow the receiver's memory:

- ``cap`` keys: beyond it new keys' notifications are not kept (their requests time out);
- ``per_key`` per key: a flood for one request drops all of them with one warning, and that request FAILS
  when armed (:meth:`overflowed`): never a load that waits on notifications thrown away;
- ``per_peer`` per sending agent: beyond it that agent's early ones are dropped, warned once; their
  requests time out.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from vllm_dsa_connector.core.transfer.notices import Notif

logger = logging.getLogger(__name__)

__all__ = ["Early", "EarlyNotices"]

#: (arrival time, sending agent, notification, the hooks' payload of its tag)
Early = tuple[float, "str | None", Notif, Any]


class EarlyNotices:
    """The early notifications of one receiver (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], *, ttl_s: float = 600.0, cap: int = 65536,
                 per_key: int = 4096, per_peer: int = 65536) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.cap = cap
        self.per_key = per_key
        self.per_peer = per_peer
        self.kept: dict[bytes, list[Early]] = {}
        self.by_peer: dict[str | None, list[Any]] = {}  # agent -> [early ones kept, cap warned]
        # keys whose early notifications overflowed per_key -> why their request fails when armed
        self.over: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def offer(self, key: bytes, peer: str | None, n: Notif, payload: Any) -> None:
        """Keep a notification for a key not armed yet, inside the caps (silently dropped beyond them)."""
        if key in self.over:
            return  # its flood was dropped (warned once); the request fails when armed
        if key not in self.kept and len(self.kept) >= self.cap:
            return
        if len(self.kept.get(key, ())) >= self.per_key:
            self.drop(key)
            why = (f"more than {self.per_key} notifications (early_per_key) before it was armed, the last "
                   f"from agent {peer!r}; all dropped")
            self.over[key] = why
            while len(self.over) > self.cap:
                self.over.popitem(last=False)
            logger.warning("receiver: %r: %s; the request fails when armed", key, why)
            return
        count = self.by_peer.setdefault(peer, [0, False])
        if count[0] >= self.per_peer:
            if not count[1]:
                count[1] = True
                logger.warning("receiver: agent %r has %d early notifications kept (early_per_peer); more are "
                               "dropped until those are armed or expire (their requests time out)", peer, count[0])
            return
        count[0] += 1
        self.kept.setdefault(key, []).append((self.clock(), peer, n, payload))

    def drop(self, key: bytes) -> list[Early]:
        """The one place early notifications leave (armed, cancelled, expired, overflowed): the agents'
        counts follow. Returns what was kept for ``key``."""
        kept = self.kept.pop(key, [])
        for _, peer, _, _ in kept:
            count = self.by_peer.get(peer)
            if count is not None:
                count[0] -= 1
                if count[0] <= 0:
                    del self.by_peer[peer]
        return kept

    def take(self, key: bytes) -> tuple[str | None, list[Early]]:
        """``key`` is armed: why it must fail (its flood was dropped; ``None``: it need not) and what was kept."""
        return self.over.pop(key, None), self.drop(key)

    def forget(self, key: bytes) -> None:
        """``key`` was cancelled: nothing of it is kept any more."""
        self.drop(key)
        self.over.pop(key, None)

    def overflowed(self, key: bytes) -> bool:
        """Whether ``key``'s early notifications were dropped for flooding."""
        return key in self.over

    def expire(self, now: float) -> None:
        """Drop the keys whose first early notification is older than ``ttl_s``."""
        for key in [k for k, v in self.kept.items() if v and now - v[0][0] > self.ttl_s]:
            self.drop(key)
