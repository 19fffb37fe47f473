"""D's cancels that P has not answered yet, sent again until P answers or P's lease has run out anyway.

A cancel tells P that D gave up on a request: P drops the lease (or says a WRITE may still land). One that P
left unanswered (its side channel starved past ``handshake_timeout_s`` on a loaded host, or a reply that was
not P's word) may never have reached P, which would then keep the lease for its whole duration, or write a
registration it still holds. :class:`PendingCancels` keeps such cancels and sends them again on D's next
steps, at most every :data:`CANCEL_RETRY_S`, until P answers or ``until`` (the first attempt plus P's lease
duration: the bound of a lease D no longer renews) has passed. A cancel is idempotent on P (a repeated one
gets the same answer), so sending it again is always safe. At most :data:`MAX_PENDING` are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from vllm_dsa_connector.core.handoff.loads import Loading
from vllm_dsa_connector.core.handoff.messages import ReqRef
from vllm_dsa_connector.core.handoff.side_channel import HandshakeError

__all__ = ["CANCEL_RETRY_S", "MAX_PENDING", "PendingCancel", "PendingCancels"]

logger = logging.getLogger(__name__)

# An unanswered cancel is sent again after this pause at the soonest (an exchange that times out already took
# handshake_timeout_s; one refused as unread comes back at once and must not spin).
CANCEL_RETRY_S = 0.5
MAX_PENDING = 4096  # unanswered cancels kept at once (beyond it the oldest are no longer retried)


@dataclass
class PendingCancel:
    """A cancel of ``refs`` sent to P ``engine`` (its latest attempt: ``future``, sent at ``sent_at``), retried
    until ``until``. ``load``: the given-up load whose ``cancel`` is this one (it follows the latest attempt, so
    P's answer to a retry releases D's blocks too)."""

    engine: str
    refs: list[ReqRef]
    future: Future
    sent_at: float
    until: float
    load: Loading | None = None
    retried: bool = False


class PendingCancels:
    """The cancels awaiting P's answer; ``send(engine, refs)`` posts one attempt (None: the peer is gone)."""

    def __init__(self, send: Callable[[str, list[ReqRef]], Future | None], engine_id: str = "") -> None:
        self._send = send
        self._engine_id = engine_id
        self._pending: list[PendingCancel] = []

    def add(self, engine: str, refs: list[ReqRef], future: Future, now: float, until: float,
            load: Loading | None = None) -> None:
        """Track the first attempt of a cancel (``future``), to be retried while unanswered until ``until``."""
        self._pending.append(PendingCancel(engine, list(refs), future, now, until, load))
        del self._pending[:-MAX_PENDING]

    def engines(self) -> set[str]:
        """The P engines a cancel still waits on (their peer records stay)."""
        return {c.engine for c in self._pending}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def retry(self, now: float) -> None:
        """Send again the cancels P left unanswered (a transient error: timeout, or a reply that was not P's
        word), at most every :data:`CANCEL_RETRY_S`, until their ``until``; forget the answered ones (P's answer,
        whatever it says, is its word on them) and those refused for good."""
        keep = []
        for c in self._pending:
            if not c.future.done():
                keep.append(c)
                continue
            error = None if c.future.cancelled() else c.future.exception()
            if not (isinstance(error, HandshakeError) and error.transient) or now >= c.until:
                continue  # answered, refused for good, cancelled at shutdown, or P released by its own clock
            if now - c.sent_at < CANCEL_RETRY_S:
                keep.append(c)
                continue
            fut = self._send(c.engine, c.refs)
            if fut is None:
                continue  # the peer was forgotten meanwhile
            (logger.debug if c.retried else logger.warning)(
                "DSAConnector %s: cancel of %s sent to %s unanswered (%s); sending it again", self._engine_id,
                [r.p_req for r in c.refs][:8], c.engine, error)
            if c.load is not None and c.load.cancel is c.future:
                c.load.cancel = fut
            c.future, c.sent_at, c.retried = fut, now, True
            keep.append(c)
        self._pending = keep
