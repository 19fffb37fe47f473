"""Per-peer reconnect backoff of :class:`~.engine.NixlEngine`, for a peer that is really gone.

A reconnect attempt that fails (NIXL cannot add the remote agent again, e.g. the connect is refused), or a new
connection that is lost again before any transfer on it completed, starts a per-peer backoff: the next attempt
is made no sooner than ``initial_s`` later, doubling with each further failure up to ``max_s``. Until then every
post to the peer fails at once (:meth:`ReconnectBackoff.refusal` says why: the peer, the failed attempts, the
last error and when the next attempt is), without touching NIXL (no connect, no UCX error lines per post). A
transfer that completes on the new connection ends it (:meth:`ReconnectBackoff.works`); so do adding or removing
the peer. A successful re-add alone does not: UCX connects lazily over some transports, so only a completed
transfer proves the peer is back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["ReconnectBackoff"]


class ReconnectBackoff:
    """The backoff state of every peer of one engine (``name``: the engine's agent, for the log lines)."""

    def __init__(self, name: str, initial_s: float = 0.5, max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``ValueError`` unless ``0 < initial_s <= max_s`` (finite): a peer that is gone must cost little per
        post, and one that comes back must be tried again within a bounded time."""
        for what, value in (("reconnect_backoff_s", initial_s), ("reconnect_backoff_max_s", max_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
        if max_s < initial_s:
            raise ValueError(f"reconnect_backoff_max_s ({max_s}) must be >= reconnect_backoff_s ({initial_s})")
        self.name = name
        self.initial_s = float(initial_s)
        self.max_s = float(max_s)
        self.clock = clock
        self._failures: dict[str, int] = {}  # failed attempts in a row
        self._retry_at: dict[str, float] = {}  # when the next attempt may be made
        self._last: dict[str, str] = {}  # the last attempt's error
        # peers whose current connection completed a transfer (or was never replaced): a loss of an unproven
        # connection counts as a failed attempt
        self._proven: set[str] = set()

    def state(self, peer: str) -> tuple[int, float]:
        """``(failed attempts in a row, seconds until the next attempt may be made)``; ``(0, 0.0)`` when the
        peer is not backing off."""
        at = self._retry_at.get(peer)
        return self._failures.get(peer, 0), max(0.0, at - self.clock()) if at is not None else 0.0

    def attempts(self, peer: str) -> int:
        """Failed attempts in a row (0: none)."""
        return self._failures.get(peer, 0)

    def reset(self, peer: str, *, proven: bool) -> None:
        """The peer was added (``proven``: its connection counts as working) or removed: no backoff."""
        self._failures.pop(peer, None)
        self._retry_at.pop(peer, None)
        self._last.pop(peer, None)
        if proven:
            self._proven.add(peer)
        else:
            self._proven.discard(peer)

    def failed(self, peer: str, why: str) -> float:
        """Count a failed attempt and schedule the next one (doubling, capped); returns the wait (s)."""
        n = self._failures.get(peer, 0) + 1
        delay = min(self.initial_s * 2.0 ** min(n - 1, 60), self.max_s)
        self._failures[peer] = n
        self._retry_at[peer] = self.clock() + delay
        self._last[peer] = why
        logger.warning("NIXL agent %s: peer %s still unreachable after %d reconnect attempt(s) (%s); posts to it "
                       "fail at once for the next %.2f s", self.name, peer, n, why, delay)
        return delay

    def lost(self, peer: str, why: str) -> None:
        """The peer's connection was lost: a failed attempt when nothing completed on it since it was made."""
        if peer not in self._proven:
            self.failed(peer, f"the new connection was lost: {why}")

    def reconnected(self, peer: str) -> None:
        """A new connection was made: the next attempt may follow at once, but it is unproven (the failure
        count stays until a transfer on it completes)."""
        self._retry_at.pop(peer, None)
        self._proven.discard(peer)

    def works(self, peer: str) -> None:
        """A transfer completed on the peer's current connection: it is back, the backoff is over."""
        if peer in self._proven:
            return
        self._proven.add(peer)
        if self._failures.get(peer):
            logger.info("NIXL agent %s: peer %s reachable again after %d failed reconnect attempt(s)", self.name,
                        peer, self._failures[peer])
        self._failures.pop(peer, None)
        self._retry_at.pop(peer, None)
        self._last.pop(peer, None)

    def refusal(self, peer: str) -> str:
        """Why a post to ``peer`` must not be tried now (it is waiting out a backoff), or ``""``."""
        n, wait = self.state(peer)
        if wait <= 0:
            return ""
        return (f"peer {peer!r} is unreachable: {n} reconnect attempt(s) in a row failed (last: "
                f"{self._last.get(peer, '?')}); not posting; next reconnect attempt in {wait:.3f} s")
