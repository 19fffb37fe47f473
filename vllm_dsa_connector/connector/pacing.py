"""How long an engine that only waits on its peer pauses per step (scheduler side).

vLLM steps in a tight loop while P holds leased blocks (``has_pending_push_work``) and while D has requests
waiting for remote KV: every step is a round trip through every worker process (shared-memory broadcast,
connector calls, reply), and vLLM CPU's workers busy-spin for a second after each read. On a small host two
such idle engines saturate every core, and the engine whose workers share a core with the other's gets
starved (on two cores, a P engine's side channel can go unanswered for 30 s while D waits). So an idle
step pauses, and the pause grows while nothing happens:

- *urgent* (a WRITE in flight on P, a registered load on D, a give-up to finish): the workers report the
  outcome only through a step, so the pause stays short (``urgent_cap_s``);
- otherwise (P waits for a registration, D for a handshake or registration reply): everything that ends
  the wait arrives on a background thread, which calls :meth:`IdlePacer.wake`; the pause may grow to
  ``cap_s``.

A new request reaching vLLM while the engine idles waits at most one pause.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class IdlePacer:
    """Pauses of consecutive idle steps: ``base_s`` doubling per idle step up to the cap of its kind."""

    base_s: float = 0.001
    urgent_cap_s: float = 0.002
    cap_s: float = 0.02
    wait: Callable[[threading.Event, float], bool] = field(default=threading.Event.wait, repr=False)
    idle_steps: int = 0
    _event: threading.Event = field(default_factory=threading.Event, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.urgent_cap_s <= self.cap_s:
            raise ValueError(f"IdlePacer: need 0 < base_s <= urgent_cap_s <= cap_s, got base_s={self.base_s}, "
                             f"urgent_cap_s={self.urgent_cap_s}, cap_s={self.cap_s}")

    def period(self, urgent: bool) -> float:
        """The pause of the next idle step (pure)."""
        cap = self.urgent_cap_s if urgent else self.cap_s
        return min(cap, self.base_s * (2 ** min(self.idle_steps, 30)))

    def pause(self, urgent: bool) -> float:
        """Pause one idle step (returns early on :meth:`wake`); returns the period used."""
        period = self.period(urgent)
        self.idle_steps += 1
        if self.wait(self._event, period):
            self.idle_steps = 0  # something happened: look again at once next time too
        self._event.clear()
        return period

    def busy(self) -> None:
        """A step had work: the next idle pause starts at ``base_s`` again."""
        self.idle_steps = 0

    def wake(self) -> None:
        """End the current pause (from any thread): a peer's message or a background reply arrived."""
        self._event.set()
