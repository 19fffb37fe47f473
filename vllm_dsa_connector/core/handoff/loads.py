"""One D request's KV load from P: its state machine and its give-up/release bounds (the params it names:
:mod:`.params`).

Each request that takes its prompt's KV from P is a :class:`Loading` with an explicit
:class:`LoadState`; every state change goes through :meth:`Loading.to`, which refuses a transition not in
:data:`TRANSITIONS`:

    QUEUED (waiting for the handshake or for blocks; heartbeated)
      -> REGISTERING (blocks allocated, registration sent) -> REGISTERED (P accepted)
      -> (gone: every notice arrived, the workers report finished_recving)
    REGISTERING / REGISTERED -> GIVING_UP (timeout, abort) -> FAILED (fail_recv sent to the workers)
    REGISTERING -> FAILED (P refused the registration: it will never write it)
    QUEUED -> (gone) when the request will not load (nothing was registered, nothing to wait for)

Guarantee "no WRITE lands in blocks D gave back": D hands its blocks back to the engine only by reporting
the request finished, and after a give-up it does so only when no WRITE can still arrive:

- a registration carries ``post_deadline``, D's give-up time mapped to P's clock with a margin for the
  clock estimate (``ClockEstimate.to_peer_before``): P posts nothing after it (see :mod:`.producer`);
- D releases at once when P never got the registration by its own word (refused, or a cancel answered
  ``not_posted``, :meth:`Loading.cancel_confirmed`; P tombstones cancelled requests, so a registration
  arriving later is refused too);
- otherwise D keeps the blocks until give-up time + P's write timeout (P's workers complete or abort a
  posted WRITE within it) + :data:`SAFETY_MARGIN_S` (:func:`write_bound_s`). A P that is merely slow,
  stalled or unreachable therefore costs D blocks for that bound, never corrupted KV. After that bound D's
  workers still keep the blocks until every writer that had not reported sent its notice, which P sends
  after an aborted WRITE only as a fence (``core/transfer/fence.py``), at most the option ``fence_timeout_s``
  (not for a P whose start is gone: :mod:`.fence_waits`).
The residual assumption: monotonic clocks of the two hosts drift less than ``ClockEstimate.DRIFT``.
The staging slots of a failed load follow the same rule (:meth:`Loading.writes_over_at`).

The :class:`~.consumer.Consumer` drives these records; this module holds what one record is and what
its bounds are, nothing that talks to P.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from vllm_dsa_connector.core.handoff.messages import (
    CancelState,
    RegReq,
    ReqRef,
)
from vllm_dsa_connector.core.handoff.routes import Held
from vllm_dsa_connector.core.handoff.states import Transitions

#: Seconds added to every write bound: slack for the clock estimate and the last WRITE's completion.
SAFETY_MARGIN_S = 1.0


def write_bound_s(write_timeout_s: float, transfer_timeout_s: float) -> float:
    """How long after D's give-up time a WRITE of P may still land: P's write timeout (at least D's transfer
    timeout, when P did not say) + :data:`SAFETY_MARGIN_S`."""
    return max(write_timeout_s, transfer_timeout_s) + SAFETY_MARGIN_S


class LoadState(Enum):
    """Where one D request's KV load stands."""

    QUEUED = "queued"
    REGISTERING = "registering"
    REGISTERED = "registered"
    GIVING_UP = "giving_up"
    FAILED = "failed"


#: Every legal load transition; anything else is a bug and raises :class:`~.states.IllegalTransition`.
TRANSITIONS: dict[LoadState, frozenset[LoadState]] = {
    LoadState.QUEUED: frozenset({LoadState.REGISTERING}),
    LoadState.REGISTERING: frozenset({LoadState.REGISTERED, LoadState.GIVING_UP, LoadState.FAILED}),
    LoadState.REGISTERED: frozenset({LoadState.GIVING_UP}),
    LoadState.GIVING_UP: frozenset({LoadState.FAILED}),
    LoadState.FAILED: frozenset(),
}
_LOADS = Transitions("load", TRANSITIONS)


@dataclass
class Loading:
    """One request loading its prompt's KV from P."""

    engine: str
    ref: ReqRef
    state: LoadState = LoadState.QUEUED
    give_up_at: float = 0.0
    release_at: float = 0.0  # registered: no WRITE lands after this (GIVING_UP: reported finished by then)
    reason: str = ""
    reg: Future | None = None
    reg_body: RegReq | None = None
    cancel: Future | None = None
    slots: Held = field(default_factory=list)  # staging slots its routes hold (RoutePlanner.free)
    req_id: str = ""
    queued_at: float = 0.0  # the request's transfer budget (transfer_timeout_s) runs from here
    error: str = ""  # QUEUED: P refused a heartbeat for it, or restarted (its lease is not kept); the load fails
    epoch: int = 0  # the P start holding the lease (the params' remote_epoch, else the handshake's when queued)

    def to(self, new: LoadState) -> None:
        """The one place a load changes state (:class:`~.states.IllegalTransition` if ``new`` is not
        allowed)."""
        self.state = _LOADS.step(self.req_id, self.state, new)

    def cancel_confirmed(self) -> bool:
        """P's start that holds the lease said nothing was or will be posted (another start's word, e.g. of a
        P restarted on the same port, is not: it never knew the registration)."""
        if self.cancel is None or not self.cancel.done() or self.cancel.exception() is not None:
            return False
        reply, sender = self.cancel.result()
        return (reply.ok and reply.states.get(self.ref.p_req) == CancelState.NOT_POSTED
                and (not self.epoch or sender.epoch == self.epoch))

    def writes_over_at(self) -> float:
        """From when no WRITE of P can land in this load's blocks or staging slots: at once for a FAILED
        load (P refused it, confirmed ``not_posted``, or the bound passed: the only ways there) or a cancel
        P answered ``not_posted``; else :attr:`release_at` (give-up time + :func:`write_bound_s`)."""
        if self.state is LoadState.FAILED or self.cancel_confirmed():
            return 0.0
        return self.release_at
