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

- P knows E at X: served with the payloads E@X sent; a registration of E@X bringing other payloads is refused
  (:class:`IdentityError`: an engine start has one set of payloads).
- P does not know E, or knows it at another epoch Y: a registration without payloads is answered
  ``need_payloads`` (the error names both epochs); one with payloads makes E@X the record (a restart of E:
  random epochs carry no order, so "newer" is "the one that sent fresh payloads"). The replacement is one
  step (:meth:`~.producer.Producer._replace_peer`): registrations of E@Y not yet handed to the workers are dropped
  (released, never written: E@Y's blocks are not E@X's), and the next dispatch hands the workers the new
  :class:`~.wire.PeerInfo` (they remove E@Y's NIXL agents and add E@X's). Every job names the epoch it was
  registered by (``PushJob.dst_epoch``): a worker that knows another start of E does not write it.
- Heartbeats and cancels are per-request and token-checked: they never change a peer record.

Identity: every NIXL agent a record's payloads name is bound to that engine id (:class:`DRecords`; P's own agents
to P). Payloads naming an agent bound to another engine, or whose agent metadata names another agent than the
payload, are refused (:class:`IdentityError`), so P never adds one engine's agent for another engine's requests.

Two live D engines sharing one engine id (a misconfiguration) therefore take turns being the record: each
replacement is a warning naming both epochs, and each side's registrations are served with its own
payloads or dropped, never written with the other's agent or layout.

A D engine no lease has named for ``peer_idle_s`` is forgotten (its record here, its remote agents in the
workers: :attr:`Dispatch.forget`); its next registration is answered ``need_payloads`` and re-sends them.

Early registration: a router may send the request to D at the same time as to P, both legs carrying one
``transfer_id`` it made (random: the capability the two legs share). D registers by the transfer id
(``p_req`` = :data:`~.messages.TRANSFER_REF_PREFIX` + id, ``token`` = id), naming its prompt's length and
digest. A registration that arrives before P has seen the request is held (its peer checks done, at most
:data:`EARLY_HELD` in all and a quota per D engine, compactly, until its post deadline, which P clamps to its
horizon) and attached when the lease opens. Transfer ids P never saw but must refuse are
:class:`TransferTombstones`, kept for that horizon, never evicted by other cancels.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import msgspec

from vllm_dsa_connector.core.handoff.messages import MessageError, RegReq
from vllm_dsa_connector.core.handoff.states import Transitions
from vllm_dsa_connector.core.handoff.wire import PeerInfo, RankPayload, decode_payload, max_block_id
from vllm_dsa_connector.core.transfer.nixl.data import metadata_agent_name
from vllm_dsa_connector.core.transfer.paths import PathName

__all__ = ["EARLY_HELD", "TOMBSTONES", "TRANSFER_TOMBSTONES", "TRANSITIONS", "DPeer",
           "DRecords", "HeldReg", "HeldRegistrations", "IdentityError", "Lease", "LeaseState", "Tombstones",
           "TransferTombstones", "block_range", "check_registration", "check_routes", "check_span", "peer_record"]

#: Early registrations P holds for requests it has not seen yet, all D engines together (beyond it a new one is
#: refused; each D engine is held to its own quota below this, ``HandoffSettings.early_held_per_peer``)
EARLY_HELD = 4096
#: Ended requests P remembers (:class:`Tombstones`; beyond it the oldest are forgotten). Only P's own requests
#: enter it (a lease that ended), never an id a peer merely named
TOMBSTONES = 65536
#: Transfer ids P never saw a request for but must refuse a registration of (cancelled by D, or held until its
#: post deadline passed): :class:`TransferTombstones`, each kept for P's post-deadline horizon; when full, new
#: early registrations are refused (never a tombstone evicted)
TRANSFER_TOMBSTONES = 65536


class IdentityError(MessageError):
    """A registration's payloads do not belong to the engine that sent it: their NIXL agent is bound to another
    engine, their metadata names another agent, or they differ from what that engine start sent before."""


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
    decoded: tuple[RankPayload, ...] = ()  # ``payloads`` decoded (their agent names bind them to the engine)


def peer_record(d_engine: str, epoch: int, encoded: list[bytes]) -> DPeer:
    """The record of D engine start ``d_engine``@``epoch`` from the payloads it sent; :class:`MessageError`
    when they do not decode, are empty or name another engine."""
    try:
        payloads = [decode_payload(p) for p in encoded]
    except ValueError as e:
        raise MessageError(str(e)) from None
    if not payloads or any(p.engine_id != d_engine for p in payloads):
        raise MessageError(f"payloads of {d_engine!r} name another engine or are empty")
    for p in payloads:
        named = metadata_agent_name(p.agent_metadata)
        if named is not None and named != p.agent_name:
            raise IdentityError(f"payload of {d_engine!r} rank {p.rank} says NIXL agent {p.agent_name!r}, its agent "
                                f"metadata is agent {named!r}'s")
    if len({p.agent_name for p in payloads}) != len(payloads):
        raise IdentityError(f"payloads of {d_engine!r} name one NIXL agent for several ranks")
    return DPeer(epoch, list(encoded), max_block_id(payloads), payloads[0].page_table.block_size,
                 {p.rank: p.staging.size if p.staging else 0 for p in payloads},
                 frozenset(p.rank for p in payloads if p.ipc), tuple(payloads))


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
            if route.path == PathName.IPC and rank not in peer.ipc:
                raise MessageError(f"ipc route to D rank {rank}, which exported no pools for it")
            if route.path == PathName.BOUNCE and route.offset + route.size > staging.get(rank, 0):
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


class TransferTombstones:
    """Transfer ids P never saw a request for whose registration it must refuse: cancelled by D before P saw the
    request (P answered ``not_posted``), or held until their post deadline passed. Each is kept ``ttl_s`` (P's
    post-deadline horizon: a registration D sent before its cancel states a deadline inside it, so once the
    tombstone goes, such a registration arrives after its own deadline and is refused for that). At most
    ``limit``; never evicted early: :meth:`add` says False when full (the caller then promises nothing, and P
    refuses new early registrations while :meth:`full`)."""

    def __init__(self, ttl_s: float, limit: int = TRANSFER_TOMBSTONES) -> None:
        self._until: OrderedDict[str, float] = OrderedDict()  # in expiry order (one ttl for all)
        self.ttl_s = ttl_s
        self.limit = limit

    def __contains__(self, tid: str) -> bool:
        return tid in self._until

    def __len__(self) -> int:
        return len(self._until)

    def expire(self, now: float) -> None:
        """Forget the tombstones whose time is over."""
        while self._until:
            tid, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[tid]

    def full(self, now: float) -> bool:
        """Whether no tombstone can be added now."""
        self.expire(now)
        return len(self._until) >= self.limit

    def add(self, tid: str, now: float) -> bool:
        """Remember ``tid`` for ``ttl_s`` from ``now``; False when the table is full (nothing evicted)."""
        self.expire(now)
        if tid not in self._until and len(self._until) >= self.limit:
            return False
        self._until[tid] = now + self.ttl_s
        self._until.move_to_end(tid)
        return True


@dataclass
class HeldReg:
    """An early registration held for a request P has not seen yet, stored compactly: its blocks as an ``int32``
    array, without the sender's payloads (P's record of the sender keeps them once per engine start)."""

    reg: RegReq  # ``d_blocks`` empty and ``d_payloads`` None here: see :meth:`full`
    blocks: array
    epoch: int  # the start of the D engine that sent it
    nbytes: int  # what it counts against its engine's byte quota

    @classmethod
    def of(cls, reg: RegReq, epoch: int) -> HeldReg:
        """``reg`` (sent by the start ``epoch`` of its engine) in compact form."""
        blocks = array("i", reg.d_blocks)
        routes = sum(len(per) for per in reg.routes.values())
        nbytes = (blocks.itemsize * len(blocks) + 32 * routes + len(reg.p_req) + len(reg.token) + len(reg.d_req)
                  + len(reg.prompt_digest) + 256)
        return cls(msgspec.structs.replace(reg, d_blocks=[], d_payloads=None), blocks, epoch, nbytes)

    def full(self) -> RegReq:
        """The registration again (its blocks as a list; no payloads)."""
        return msgspec.structs.replace(self.reg, d_blocks=self.blocks.tolist())


class HeldRegistrations:
    """Early registrations for requests P has not seen yet, by transfer id (:class:`HeldReg`), kept until its
    lease opens or its post deadline passes: at most :data:`EARLY_HELD` in all, and per D engine at most
    ``per_peer`` of them and ``bytes_per_peer`` bytes, so one D cannot fill P's table."""

    def __init__(self, per_peer: int = EARLY_HELD, bytes_per_peer: int = 1 << 62) -> None:
        self._held: OrderedDict[str, HeldReg] = OrderedDict()
        self._count: dict[str, int] = {}  # D engine -> registrations held
        self._bytes: dict[str, int] = {}  # D engine -> their bytes
        self.per_peer = per_peer
        self.bytes_per_peer = bytes_per_peer

    def __contains__(self, tid: str) -> bool:
        return tid in self._held

    def __len__(self) -> int:
        return len(self._held)

    def refusal(self, tid: str, reg: RegReq, epoch: int, sender: str) -> str:
        """Why ``reg`` (from ``sender``'s start ``epoch``) cannot be held for ``tid`` (``""``: it can; a retry
        of the one held replaces it)."""
        prev = self._held.get(tid)
        if prev is not None:
            if (prev.reg.d_engine, prev.epoch, prev.reg.d_req) == (reg.d_engine, epoch, reg.d_req):
                return ""
            return (f"transfer {tid} is already registered by D request {prev.reg.d_req!r} of engine "
                    f"{prev.reg.d_engine!r}; refusing D request {reg.d_req!r} of engine {sender} (one P request "
                    "feeds one D request)")
        if len(self._held) >= EARLY_HELD:
            return f"P holds {EARLY_HELD} early registrations of requests it has not seen yet; refusing more"
        d = reg.d_engine
        if self._count.get(d, 0) >= self.per_peer:
            return (f"P holds {self._count[d]} early registrations of D engine {d!r} for requests it has not seen "
                    f"yet (early_held_per_peer {self.per_peer}); refusing more until P sees them")
        size = HeldReg.of(reg, epoch).nbytes
        if self._bytes.get(d, 0) + size > self.bytes_per_peer:
            return (f"P holds {self._bytes.get(d, 0)} B of early registrations of D engine {d!r}; this one "
                    f"({size} B) would pass early_held_bytes_per_peer {self.bytes_per_peer}; refusing it")
        return ""

    def put(self, tid: str, reg: RegReq, epoch: int) -> None:
        """Hold ``reg`` for ``tid`` (after :meth:`refusal` said it may)."""
        self._drop(tid)
        held = HeldReg.of(reg, epoch)
        self._held[tid] = held
        d = reg.d_engine
        self._count[d] = self._count.get(d, 0) + 1
        self._bytes[d] = self._bytes.get(d, 0) + held.nbytes

    def _drop(self, tid: str) -> HeldReg | None:
        held = self._held.pop(tid, None)
        if held is not None:
            d = held.reg.d_engine
            self._count[d] -= 1
            self._bytes[d] -= held.nbytes
            if not self._count[d]:
                del self._count[d], self._bytes[d]
        return held

    def take(self, tid: str) -> tuple[RegReq, int] | None:
        """The registration held for ``tid`` and its sender's epoch, no longer held."""
        held = self._drop(tid)
        return None if held is None else (held.full(), held.epoch)

    def expire(self, now: float) -> list[str]:
        """Drop the registrations past their post deadline; their transfer ids."""
        gone = [t for t, held in self._held.items() if now >= held.reg.post_deadline]
        for tid in gone:
            self._drop(tid)
        return gone

    def cancel(self, tid: str, token: str) -> bool:
        """D gave up on ``tid`` before P saw the request: drop it (its token must match); whether one was held."""
        held = self._held.get(tid)
        if held is None or held.reg.token != token:
            return False
        self._drop(tid)
        return True


class DRecords:
    """P's records of D engine starts (one per engine id), which start's :class:`~.wire.PeerInfo` the workers
    have, and when a lease last named each engine."""

    def __init__(self) -> None:
        self.by_engine: dict[str, DPeer] = {}
        self._sent: dict[str, int] = {}  # D engine id -> the epoch whose PeerInfo the workers have
        self._seen: dict[str, float] = {}  # D engine id -> the last step a lease named it
        self._agents: dict[str, str] = {}  # NIXL agent name -> the D engine whose record names it

    def reserve(self, engine_id: str, agents: Iterable[str]) -> None:
        """Bind this engine's own NIXL agents to it: no D may present them as its own."""
        for name in agents:
            self._agents[name] = engine_id

    def identity_refusal(self, d_engine: str, epoch: int, peer: DPeer) -> str:
        """Why ``peer`` (payloads sent by ``d_engine``@``epoch``) cannot become that engine's record: one of its
        NIXL agents is bound to another engine P knows (``""``: it can). A new start of an engine re-binds its
        own agents; another engine's agent stays that engine's until P forgets it."""
        for p in peer.decoded:
            owner = self._agents.get(p.agent_name)
            if owner is not None and owner != d_engine:
                return (f"payloads sent by D engine {d_engine!r} (epoch {epoch:016x}) name NIXL agent "
                        f"{p.agent_name!r}, which is bound to D engine {owner!r}: refusing them (a D registers "
                        "with its own payloads; P never writes one engine's request into another's pools)")
        return ""

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
        """``peer`` is now the record of ``d_engine`` (its agents bound to it; the replaced start's unbound)."""
        old = self.by_engine.get(d_engine)
        if old is not None:
            self._unbind(old)
        self.by_engine[d_engine] = peer
        self._seen[d_engine] = now
        for p in peer.decoded:
            self._agents[p.agent_name] = d_engine

    def _unbind(self, peer: DPeer) -> None:
        for p in peer.decoded:
            self._agents.pop(p.agent_name, None)

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
            self._unbind(self.by_engine.pop(d_engine))
            self._seen.pop(d_engine, None)
            out.append((d_engine, self._sent.pop(d_engine, None) is not None))
        return out
