"""The peer clock estimate: P's monotonic clock as seen from D, with an error bound.

D gives up on a load at a time of its own clock; P must never post a WRITE after it, so D maps that time
into P's clock through this estimate (``to_peer_before``: surely not later, whatever the offset's error).
Samples come from the side channel's replies (``Reply.clock``, :mod:`.side_channel`); the estimate itself is
plain arithmetic, kept apart from the message structs of :mod:`.messages`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ClockEstimate"]


@dataclass
class ClockEstimate:
    """P's monotonic clock as seen from D: ``p_time ~= d_time + offset``, within ``uncertainty`` (half the
    round trip of the best sample) plus a drift allowance that grows with the sample's age."""

    offset: float = 0.0
    uncertainty: float = math.inf
    taken_at: float = 0.0

    DRIFT = 1e-4  # 100 ppm between two hosts' monotonic clocks, generously

    def bound(self, now: float) -> float:
        """Current uncertainty of the offset (s)."""
        return self.uncertainty + self.DRIFT * max(now - self.taken_at, 0.0)

    def add_sample(self, sent: float, received: float, peer_clock: float) -> None:
        """One request/reply: D sent at ``sent``, got P's clock ``peer_clock`` back at ``received``."""
        if peer_clock <= 0 or received < sent:
            return
        u = (received - sent) / 2
        if u < self.bound(received):
            self.offset, self.uncertainty, self.taken_at = peer_clock - (sent + received) / 2, u, received

    def to_peer_before(self, d_time: float, now: float) -> float:
        """A time in P's clock that is surely not later than ``d_time`` on D's clock."""
        return d_time + self.offset - self.bound(now)
