"""What P keeps per request and per D engine, and the checks a registration must pass.

:class:`Lease` (one P request's blocks kept for D, with its :class:`LeaseState` and the one transition check
:meth:`Lease.to`), :class:`DPeer` (P's record of one D engine start, from the payloads a registration brought:
:func:`peer_record`), the checks a registration must pass against both (:func:`check_registration`: prompt
length and digest, token span, D's blocks, staging slots and ipc exports), and :class:`HeldRegistrations`,
the early registrations P keeps for requests it has not seen yet, and :class:`Tombstones`, the requests that
ended. :mod:`.producer` drives them; nothing
here takes a lock or talks to anyone.

Peers and restarts (epochs). P keeps one record per D engine id (:class:`DPeer`: the epoch it was learnt
from, that start's payloads, its pool and staging sizes), learnt from a registration's ``d_payloads``. A
registration names only its sender's engine: ``d_engine`` must be the engine the (signed) envelope names,
else it is refused naming both. The rule for a registration from engine E at epoch X:

- P knows E at X: served with the payloads E@X sent.
- P does not know E, or knows it at another epoch Y: a registration without payloads is answered
  ``need_payloads`` (the error names both epochs); one with payloads makes E@X the record (a restart of E:
  random epochs carry no order, so "newer" is "the one that sent fresh payloads"). The replacement is one
  step (:meth:`~.producer.Producer._replace_peer`): registrations of E@Y not yet handed to the workers are dropped
  (released, never written: E@Y's blocks are not E@X's), and the next dispatch hands the workers the new
  :class:`~.wire.PeerInfo` (they remove E@Y's NIXL agents and add E@X's). Every job names the epoch it was
  registered by (``PushJob.dst_epoch``): a worker that knows another start of E does not write it.
- Heartbeats and cancels are per-request and token-checked: they never change a peer record.

Two live D engines sharing one engine id (a misconfiguration) therefore take turns being the record: each
replacement is a warning naming both epochs, and each side's registrations are served with its own
payloads or dropped, never written with the other's agent or layout.

A D engine no lease has named for ``peer_idle_s`` is forgotten (its record here, its remote agents in the
workers: :attr:`Dispatch.forget`); its next registration is answered ``need_payloads`` and re-sends them.

Early registration: a router may send the request to D at the same time as to P, both legs carrying one
``transfer_id`` it made (random: the capability the two legs share). D registers by the transfer id
(``p_req`` = :data:`~.messages.TRANSFER_REF_PREFIX` + id, ``token`` = id), naming its prompt's length and
digest. A registration that arrives before P has seen the request is held (its peer checks done, at most
:data:`EARLY_HELD`, until its post deadline) and attached when the lease opens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from vllm_dsa_connector.handoff.messages import MessageError, RegReq
from vllm_dsa_connector.handoff.states import Transitions
from vllm_dsa_connector.handoff.wire import PeerInfo, decode_payload, max_block_id

__all__ = ["EARLY_HELD", "TOMBSTONES", "TRANSITIONS", "DPeer", "DRecords", "HeldRegistrations", "Lease", "LeaseState",
           "Tombstones", "block_range", "check_registration", "check_routes", "check_span", "peer_record"]

#: Early registrations P holds for requests it has not seen yet (beyond it a new one is refused)
EARLY_HELD = 4096
#: Ended requests P remembers (:class:`Tombstones`; beyond it the oldest are forgotten)
TOMBSTONES = 65536


class LeaseState(Enum):
    """Where a finished prefill's KV stands on P."""

    HELD = "held"  # waiting for D's registration (heartbeats extend the lease)
    REGISTERED = "registered"  # D named its blocks; dispatched on the next step before the post deadline
    DISPATCHED = "dispatched"  # handed to the workers: a WRITE may be in flight
    CANCELLED = "cancelled"  # D gave up before dispatch; released on the next step
    RELEASED = "released"  # the workers free the blocks (no WRITE was or will be posted)


#: Every legal lease transition; anything else is a bug and raises :class:`~.states.IllegalTransition`.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.HELD: frozenset({LeaseState.REGISTERED, LeaseState.CANCELLED, LeaseState.RELEASED}),
    LeaseState.REGISTERED: frozenset({LeaseState.DISPATCHED, LeaseState.CANCELLED, LeaseState.RELEASED}),
    LeaseState.CANCELLED: frozenset({LeaseState.RELEASED}),
    LeaseState.DISPATCHED: frozenset(),
    LeaseState.RELEASED: frozenset(),
}
_LEASES = Transitions("lease", TRANSITIONS)


@dataclass
class Lease:
    """P's blocks of one finished prefill, kept for D."""

    req_id: str
    blocks: list[int]
    token: str
    deadline: float  # P releases the blocks after this without news from D
    state: LeaseState = LeaseState.HELD
    reg: RegReq | None = None
    reg_epoch: int = 0  # the epoch of the D engine start that sent ``reg``
    final: bool = True  # the blocks hold the whole prefill (an early lease: once P's prefill finished)
    transfer_id: str = ""  # an early lease's: D registers by it
    prompt_tokens: int = 0  # P's prompt length (0: not known)
    digest: str = ""  # :func:`~.messages.prompt_digest` of P's prompt ("" : not known)
    fail: str = ""  # a registration P accepted and can no longer serve: dispatched as a failure job

    def to(self, new: LeaseState) -> None:
        """The one place a lease changes state (:class:`~.states.IllegalTransition` if ``new`` is not
        allowed)."""
        self.state = _LEASES.step(self.req_id, self.state, new)

    def refusal(self, reg: RegReq, epoch: int, sender: str, now: float) -> str | None:
        """Whether ``reg``, sent by ``sender`` (its start ``epoch``), may register this lease: ``None`` it may
        (the peer checks still to come), ``""`` it repeats the registration accepted (D missed the reply: the
        same answer, nothing changes), else why not."""
        prev = self.reg
        if (prev is not None and self.state in (LeaseState.REGISTERED, LeaseState.DISPATCHED)
                and (prev.d_engine, self.reg_epoch, prev.d_req, prev.first_token, prev.num_tokens, prev.d_blocks)
                == (reg.d_engine, epoch, reg.d_req, reg.first_token, reg.num_tokens, reg.d_blocks)):
            return ""
        if prev is not None and (prev.d_engine, self.reg_epoch, prev.d_req) != (reg.d_engine, epoch, reg.d_req):
            # one P request feeds one D request: a second one would get (or take) KV that is not its own
            return (f"request {reg.p_req} is already registered by D request {prev.d_req!r} of engine "
                    f"{prev.d_engine!r} (epoch {self.reg_epoch:016x}); refusing D request {reg.d_req!r} of engine "
                    f"{sender} (one P request feeds one D request: were its kv_transfer_params given to several?)")
        if self.state is not LeaseState.HELD:
            return f"request {reg.p_req} is {self.state.value}"
        if now >= reg.post_deadline:
            return (f"registration of {reg.p_req} arrived after its post deadline "
                    f"({now - reg.post_deadline:.3f} s late)")
        return None


@dataclass
class DPeer:
    """P's record of one D engine start: its epoch and what its payloads say (learnt from a registration)."""

    epoch: int
    payloads: list[bytes]  # encoded RankPayload, one per D worker
    num_blocks: int  # blocks 0..num_blocks-1 exist in every pool of every D worker
    block_size: int  # D's tokens per block (0: not published)
    staging: dict[int, int]  # D rank -> staging arena bytes
    ipc: frozenset[int] = frozenset()  # D ranks that exported their pools for the ipc path


def peer_record(d_engine: str, epoch: int, encoded: list[bytes]) -> DPeer:
    """The record of D engine start ``d_engine``@``epoch`` from the payloads it sent; :class:`MessageError`
    when they do not decode, are empty or name another engine."""
    try:
        payloads = [decode_payload(p) for p in encoded]
    except ValueError as e:
        raise MessageError(str(e)) from None
    if not payloads or any(p.engine_id != d_engine for p in payloads):
        raise MessageError(f"payloads of {d_engine!r} name another engine or are empty")
    return DPeer(epoch, list(encoded), max_block_id(payloads), payloads[0].page_table.block_size,
                 {p.rank: p.staging.size if p.staging else 0 for p in payloads},
                 frozenset(p.rank for p in payloads if p.ipc))


def check_registration(reg: RegReq, lease: Lease, peer: DPeer, block_size: int) -> None:
    """Whether ``reg`` fits ``lease`` (its prompt, its span) and ``peer``'s pools and staging;
    :class:`~.messages.MessageError` naming what does not."""
    check_routes(reg, peer)
    if lease.prompt_tokens and reg.prompt_tokens and lease.prompt_tokens != reg.prompt_tokens:
        raise MessageError(f"D's prompt has {reg.prompt_tokens} tokens, P's request {lease.req_id} "
                           f"{lease.prompt_tokens}: not the same prompt")
    if lease.digest and reg.prompt_digest and lease.digest != reg.prompt_digest:
        raise MessageError(f"D's prompt ({reg.prompt_tokens} tokens, digest {reg.prompt_digest}) is not P's "
                           f"request {lease.req_id} ({lease.prompt_tokens} tokens, digest {lease.digest})")
    if lease.transfer_id and not (reg.prompt_digest and reg.prompt_tokens):
        raise MessageError(f"early registration of {lease.req_id} states no prompt length and digest")
    if not lease.final:  # an early lease: P's blocks of the span exist once its prefill has run
        if reg.first_token + reg.num_tokens > lease.prompt_tokens:
            raise MessageError(f"tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1} asked, P's "
                               f"request {lease.req_id} has {lease.prompt_tokens} prompt tokens")
        return
    check_span(reg, lease, block_size)

def check_routes(reg: RegReq, peer: DPeer) -> None:
    """``reg``'s D blocks and routes inside what ``peer`` offers (pools, staging, ipc exports)."""
    limit = peer.num_blocks
    bad = [b for b in reg.d_blocks if not 0 <= b < limit]
    if bad:
        raise MessageError(f"d_blocks {bad[:8]} outside D's pools (0..{limit - 1})")
    staging = peer.staging
    for rank, per in reg.routes.items():
        for route in per.values():
            if route.path == "ipc" and rank not in peer.ipc:
                raise MessageError(f"ipc route to D rank {rank}, which exported no pools for it")
            if route.path == "bounce" and route.offset + route.size > staging.get(rank, 0):
                raise MessageError(f"bounce route [{route.offset}, +{route.size}) outside D rank {rank}'s "
                                   f"staging arena ({staging.get(rank, 0)} B)")
    bd = peer.block_size
    need = -(-(reg.first_token + reg.num_tokens) // bd) - reg.first_token // bd if bd else 0
    if len(reg.d_blocks) < need:
        raise MessageError(f"tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1} need {need} of "
                           f"D's {bd}-token blocks, the registration names {len(reg.d_blocks)}")

def check_span(reg: RegReq, lease: Lease, block_size: int) -> None:
    """P's blocks of ``lease`` hold the registration's token span."""
    first, end = block_range(reg, block_size)
    if end > len(lease.blocks):
        raise MessageError(f"tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1} asked (blocks "
                           f"{first}..{end - 1} of {block_size} tokens), request {reg.p_req} has "
                           f"{len(lease.blocks)}")

def block_range(reg: RegReq, block_size: int) -> tuple[int, int]:
    """``[first, end)``: the indexes into a lease's blocks (of ``block_size`` tokens) holding the
    registration's token span."""
    b = block_size
    return reg.first_token // b, -(-(reg.first_token + reg.num_tokens) // b)


class Tombstones:
    """The references of ended requests (P request ids, early transfer references), each with whether a WRITE
    was dispatched for it: a registration arriving after its request ended is refused, a late cancel is
    answered truthfully. Bounded (``limit``: the oldest are forgotten first)."""

    def __init__(self, limit: int = TOMBSTONES) -> None:
        self._ended: OrderedDict[str, bool] = OrderedDict()
        self.limit = limit

    def __contains__(self, ref: str) -> bool:
        return ref in self._ended

    def posted(self, ref: str) -> bool:
        """Whether a WRITE was dispatched for the ended ``ref`` (False when not remembered)."""
        return self._ended.get(ref, False)

    def add(self, ref: str, posted: bool) -> None:
        """``ref`` ended; ``posted``: a WRITE was dispatched for it (kept once said)."""
        self._ended[ref] = posted or self._ended.get(ref, False)
        self._ended.move_to_end(ref)
        while len(self._ended) > self.limit:
            self._ended.popitem(last=False)


class HeldRegistrations:
    """Early registrations for requests P has not seen yet, by transfer id: each with the epoch of the D
    start that sent it, kept until its lease opens or its post deadline passes (at most :data:`EARLY_HELD`)."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, tuple[RegReq, int]] = OrderedDict()

    def __contains__(self, tid: str) -> bool:
        return tid in self._held

    def refusal(self, tid: str, reg: RegReq, epoch: int, sender: str) -> str:
        """Why ``reg`` (from ``sender``'s start ``epoch``) cannot be held for ``tid`` (``""``: it can; a retry
        of the one held replaces it)."""
        prev = self._held.get(tid)
        if prev is not None:
            if (prev[0].d_engine, prev[1], prev[0].d_req) == (reg.d_engine, epoch, reg.d_req):
                return ""
            return (f"transfer {tid} is already registered by D request {prev[0].d_req!r} of engine "
                    f"{prev[0].d_engine!r}; refusing D request {reg.d_req!r} of engine {sender} (one P request "
                    "feeds one D request)")
        if len(self._held) >= EARLY_HELD:
            return f"P holds {EARLY_HELD} early registrations of requests it has not seen yet; refusing more"
        return ""

    def put(self, tid: str, reg: RegReq, epoch: int) -> None:
        """Hold ``reg`` for ``tid`` (after :meth:`refusal` said it may)."""
        self._held[tid] = (reg, epoch)

    def take(self, tid: str) -> tuple[RegReq, int] | None:
        """The registration held for ``tid`` and its sender's epoch, no longer held."""
        return self._held.pop(tid, None)

    def expire(self, now: float) -> list[str]:
        """Drop the registrations past their post deadline; their transfer ids."""
        gone = [t for t, (reg, _) in self._held.items() if now >= reg.post_deadline]
        for tid in gone:
            del self._held[tid]
        return gone

    def cancel(self, tid: str, token: str) -> bool:
        """D gave up on ``tid`` before P saw the request: drop it (its token must match); whether one was held."""
        held = self._held.get(tid)
        if held is None or held[0].token != token:
            return False
        del self._held[tid]
        return True


class DRecords:
    """P's records of D engine starts (one per engine id), which start's :class:`~.wire.PeerInfo` the workers
    have, and when a lease last named each engine."""

    def __init__(self) -> None:
        self.by_engine: dict[str, DPeer] = {}
        self._sent: dict[str, int] = {}  # D engine id -> the epoch whose PeerInfo the workers have
        self._seen: dict[str, float] = {}  # D engine id -> the last step a lease named it

    def get(self, d_engine: str) -> DPeer | None:
        """The start of ``d_engine`` P knows."""
        return self.by_engine.get(d_engine)

    def __contains__(self, d_engine: str) -> bool:
        return d_engine in self.by_engine

    def __getitem__(self, d_engine: str) -> DPeer:
        return self.by_engine[d_engine]

    def sent_epoch(self, d_engine: str) -> int | None:
        """The start of ``d_engine`` whose record the workers have (None: none)."""
        return self._sent.get(d_engine)

    def set(self, d_engine: str, peer: DPeer, now: float) -> None:
        """``peer`` is now the record of ``d_engine``."""
        self.by_engine[d_engine] = peer
        self._seen[d_engine] = now

    def unsent(self, d_engine: str) -> PeerInfo | None:
        """The record of ``d_engine`` for the workers when they do not have this start yet (then marked sent)."""
        peer = self.by_engine[d_engine]
        if self._sent.get(d_engine) == peer.epoch:
            return None
        self._sent[d_engine] = peer.epoch
        return PeerInfo(d_engine, list(peer.payloads), epoch=peer.epoch)

    def forget_idle(self, named: Iterable[str], now: float, idle_s: float) -> list[tuple[str, bool]]:
        """``named`` engines were named by a lease now; drop those no lease named for ``idle_s``: each with
        whether the workers had its record (then they must drop it too)."""
        for d_engine in named:
            self._seen[d_engine] = now
        out = []
        for d_engine in [d for d in self.by_engine if now - self._seen.get(d, now) >= idle_s]:
            del self.by_engine[d_engine]
            self._seen.pop(d_engine, None)
            out.append((d_engine, self._sent.pop(d_engine, None) is not None))
        return out
