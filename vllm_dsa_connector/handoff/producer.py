"""The producer (P) role: leases on finished prefills, D's registrations, push dispatch.

One :class:`Lease` per finished prefill whose KV D will take, with an explicit :class:`LeaseState`;
every state change goes through :meth:`Lease.to`, which refuses a transition not in :data:`TRANSITIONS`
(:class:`~.states.IllegalTransition` naming the request, both states and the allowed ones). All calls hold one lock: the side-channel thread
and the engine's scheduler thread both call in.

    HELD --reg--> REGISTERED --step--> DISPATCHED --workers' finished_sending--> (gone)
      |               |                     \\-- never cancelled: a WRITE may be in flight
      +--cancel-------+--cancel--> CANCELLED --step--> RELEASED --finished_sending--> (gone)
      +--expiry / post deadline passed at step--------> RELEASED

Guarantee "no WRITE after D gave up": a registration carries ``post_deadline`` (P's monotonic clock,
derived by D from its give-up time). P dispatches a registration only before that deadline and never
after a cancel; the push job carries the deadline to the workers, which check it again right before
posting (same host, same monotonic clock), so a P whose workers were stalled past the deadline drops
the job instead of writing. A cancel is answered with ``not_posted`` (nothing was or will be posted:
D may reuse its blocks at once) or ``posted`` (D keeps them until the deadline plus P's write timeout,
after which P's workers have completed or aborted the WRITE). Ended requests leave a tombstone, so a
registration that arrives after its cancel is refused. A lease is registered by one D request: another
D request registering it (kv_transfer_params handed to several) is refused, naming both.

Peers and restarts (epochs). P keeps one record per D engine id (:class:`DPeer`: the epoch it was learnt
from, that start's payloads, its pool and staging sizes), learnt from a registration's ``d_payloads``. A
registration names only its sender's engine: ``d_engine`` must be the engine the (signed) envelope names,
else it is refused naming both. The rule for a registration from engine E at epoch X:

- P knows E at X: served with the payloads E@X sent.
- P does not know E, or knows it at another epoch Y: a registration without payloads is answered
  ``need_payloads`` (the error names both epochs); one with payloads makes E@X the record (a restart of E:
  random epochs carry no order, so "newer" is "the one that sent fresh payloads"). The replacement is one
  step (:meth:`Producer._replace_peer`): registrations of E@Y not yet handed to the workers are dropped
  (released, never written: E@Y's blocks are not E@X's), and the next dispatch hands the workers the new
  :class:`PeerInfo` (they remove E@Y's NIXL agents and add E@X's). Every job names the epoch it was
  registered by (``PushJob.dst_epoch``): a worker that knows another start of E does not write it.
- Heartbeats and cancels are per-request and token-checked: they never change a peer record.

Two live D engines sharing one engine id (a misconfiguration) therefore take turns being the record: each
replacement is a warning naming both epochs, and each side's registrations are served with its own
payloads or dropped, never written with the other's agent or layout.

A D engine no lease has named for ``peer_idle_s`` is forgotten (its record here, its remote agents in the
workers: :attr:`Dispatch.forget`); its next registration is answered ``need_payloads`` and re-sends them.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from vllm_dsa_connector.handoff.messages import (
    NOT_READY,
    CancelReq,
    CancelState,
    HeartbeatReq,
    MessageError,
    MetaReq,
    Origin,
    RegReq,
    Reply,
    ReqRef,
    Request,
)
from vllm_dsa_connector.handoff.settings import HandoffSettings
from vllm_dsa_connector.handoff.states import Transitions
from vllm_dsa_connector.handoff.wire import PeerInfo, PushJob, decode_payload, max_block_id

logger = logging.getLogger(__name__)

_TOMBSTONES = 65536


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

    def to(self, new: LeaseState) -> None:
        """The one place a lease changes state (:class:`~.states.IllegalTransition` if ``new`` is not
        allowed)."""
        self.state = _LEASES.step(self.req_id, self.state, new)


@dataclass
class DPeer:
    """P's record of one D engine start: its epoch and what its payloads say (learnt from a registration)."""

    epoch: int
    payloads: list[bytes]  # encoded RankPayload, one per D worker
    num_blocks: int  # blocks 0..num_blocks-1 exist in every pool of every D worker
    block_size: int  # D's tokens per block (0: not published)
    staging: dict[int, int]  # D rank -> staging arena bytes
    ipc: frozenset[int] = frozenset()  # D ranks that exported their pools for the ipc path


@dataclass
class Dispatch:
    """What one :meth:`Producer.step` hands the workers: peers they must know, WRITEs, releases."""

    peers: list[PeerInfo] = field(default_factory=list)
    push: list[PushJob] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)  # idle D engines the workers drop (before ``peers``)


class Producer:
    """All leases of one prefill engine; ``block_size`` is its tokens per KV block (a registration names a
    token span, P takes its own blocks of it)."""

    def __init__(self, engine_id: str, settings: HandoffSettings,
                 clock: Callable[[], float] = time.monotonic, *, block_size: int, epoch: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"Producer {engine_id}: block_size must be >= 1, got {block_size}")
        self.engine_id = engine_id
        self.epoch = epoch  # this engine start's (named in its handshake replies)
        self.block_size = block_size
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, bool] = OrderedDict()  # p_req -> a WRITE was dispatched
        self._peers: dict[str, DPeer] = {}  # D engine id -> the start P knows (one record per id)
        self._peers_sent: dict[str, int] = {}  # D engine id -> the epoch whose PeerInfo the workers have
        self._peer_seen: dict[str, float] = {}  # D engine -> the last step a lease named it

    # ------------------------------------------------------------ engine thread

    def add_lease(self, req_id: str, blocks: list[int]) -> str:
        """Keep ``blocks`` of a finished prefill for ``lease_s``; returns the request's token."""
        token = secrets.token_hex(16)
        with self._lock:
            self._leases[req_id] = Lease(req_id, list(blocks), token, self.clock() + self.settings.lease_s)
        return token

    def step(self) -> Dispatch:
        """Dispatch registrations (before their post deadline) and release ended leases."""
        now = self.clock()
        out = Dispatch()
        with self._lock:
            for req_id, lease in self._leases.items():
                if lease.state is LeaseState.REGISTERED and lease.reg is not None:
                    peer = self._peers.get(lease.reg.d_engine)
                    if peer is None or peer.epoch != lease.reg_epoch:  # _replace_peer drops these; never write
                        self._release(out, lease, f"D engine {lease.reg.d_engine!r} restarted (registered by epoch "
                                                  f"{lease.reg_epoch:016x}, P now knows "
                                                  f"{peer.epoch if peer else 0:016x})")
                        continue
                    if now < lease.reg.post_deadline:
                        self._dispatch(out, lease, lease.reg)
                        continue
                    logger.warning("DSAConnector: registration of %s reached its post deadline before "
                                   "dispatch; not writing", req_id)
                    self._release(out, lease, "post deadline passed")
                elif lease.state is LeaseState.CANCELLED:
                    self._release(out, lease, "cancelled by D")
                elif lease.state is LeaseState.HELD and now > lease.deadline:
                    self._release(out, lease, "deadline passed")
            self._forget_idle(out, now)
        return out

    def _forget_idle(self, out: Dispatch, now: float) -> None:
        """Drop the D engines no lease has named for ``peer_idle_s`` (caller holds the lock)."""
        for lease in self._leases.values():
            if lease.reg is not None:
                self._peer_seen[lease.reg.d_engine] = now
        for d_engine in [d for d in self._peers if now - self._peer_seen.get(d, now) >= self.settings.peer_idle_s]:
            self._peers.pop(d_engine, None)
            self._peer_seen.pop(d_engine, None)
            if self._peers_sent.pop(d_engine, None) is not None:
                out.forget.append(d_engine)
            logger.info("DSAConnector %s: decode engine %s idle for %.0f s: forgotten (its next registration "
                        "re-sends its payloads)", self.engine_id, d_engine, self.settings.peer_idle_s)

    @staticmethod
    def _release(out: Dispatch, lease: Lease, why: str) -> None:
        logger.warning("DSAConnector: releasing KV of %s (%s)", lease.req_id, why)
        lease.to(LeaseState.RELEASED)
        out.release.append(lease.req_id)

    def _dispatch(self, out: Dispatch, lease: Lease, reg: RegReq) -> None:
        peer = self._peers[reg.d_engine]
        if self._peers_sent.get(reg.d_engine) != peer.epoch:  # new to the workers, or a new start of it
            out.peers.append(PeerInfo(reg.d_engine, list(peer.payloads), epoch=peer.epoch))
            self._peers_sent[reg.d_engine] = peer.epoch
        first, end = self._block_range(reg)
        out.push.append(PushJob(lease.req_id, reg.d_engine, reg.d_req, lease.blocks[first:end], list(reg.d_blocks),
                                reg.verify, reg.routes, post_deadline=reg.post_deadline,
                                first_token=reg.first_token, num_tokens=reg.num_tokens, dst_epoch=peer.epoch))
        lease.to(LeaseState.DISPATCHED)
        # the workers report finished_sending within post deadline + write timeout; keep the lease as long
        lease.deadline = max(lease.deadline, reg.post_deadline + self.settings.transfer_timeout_s)

    def finished_sending(self, req_ids: set[str]) -> None:
        """The workers are done with these requests (WRITE completed/failed, or blocks released)."""
        with self._lock:
            for req_id in req_ids:
                lease = self._leases.pop(req_id, None)
                if lease is not None:
                    self._tombstone(req_id, lease.state is LeaseState.DISPATCHED)

    def pending(self) -> bool:
        """Whether any lease still holds blocks."""
        return bool(self._leases)

    def in_flight(self) -> bool:
        """Whether a lease needs the engine's next steps (to dispatch, release, or collect its WRITE's
        outcome), rather than waiting for D's registration."""
        return any(lease.state is not LeaseState.HELD for lease in list(self._leases.values()))

    def lease(self, req_id: str) -> Lease | None:
        """A lease (tests, diagnostics)."""
        return self._leases.get(req_id)

    def _tombstone(self, req_id: str, posted: bool) -> None:
        self._ended[req_id] = posted or self._ended.get(req_id, False)
        self._ended.move_to_end(req_id)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)

    # ------------------------------------------------------------ side-channel thread

    def handle(self, req: Request, payloads: list[bytes], sender: Origin) -> Reply:
        """Answer one side-channel request from ``sender`` (the engine and epoch its envelope names);
        ``payloads`` are this engine's encoded worker payloads (the handshake's answer; empty while the
        workers have not registered their KV caches)."""
        if isinstance(req, MetaReq):
            if not payloads:
                return Reply(False, error=NOT_READY, clock=self.clock())
            return Reply(True, clock=self.clock(), engine_id=self.engine_id, payloads=list(payloads),
                         write_timeout_s=self.settings.transfer_timeout_s)
        if isinstance(req, RegReq):
            return self.handle_reg(req, sender)
        if isinstance(req, HeartbeatReq):
            return self.handle_heartbeat(req)
        return self.handle_cancel(req)

    def _owned(self, ref: ReqRef | RegReq) -> Lease | None:
        lease = self._leases.get(ref.p_req)
        if lease is None or not hmac.compare_digest(lease.token.encode(), ref.token.encode()):
            return None
        return lease

    def handle_reg(self, reg: RegReq, sender: Origin | None = None) -> Reply:
        """Accept or refuse a registration sent by ``sender``; ``need_payloads`` when P does not know the
        sender's start (its engine unknown, or known at another epoch) and the registration brings no payloads.
        ``sender`` None (in-process callers only; the side channel always passes the envelope's, which an
        anonymous sender fails): the engine ``reg.d_engine`` names, at the epoch P knows (or 0)."""
        now = self.clock()
        if sender is None:
            known = self._peers.get(reg.d_engine)
            sender = Origin(reg.d_engine, known.epoch if known else 0)
        if sender.engine_id != reg.d_engine:
            # a registration names only its sender's engine: never write into another D's blocks
            return Reply(False, clock=now, error=(
                f"registration of {reg.p_req} names D engine {reg.d_engine!r} but was sent by engine {sender}: "
                "a registration names only its sender's engine"))
        with self._lock:
            lease = self._owned(reg)
            if lease is None:
                why = "ended" if reg.p_req in self._ended else "unknown, or the token does not match"
                return Reply(False, error=f"P holds no KV for request {reg.p_req} ({why})", clock=now)
            prev = lease.reg
            if (prev is not None and lease.state in (LeaseState.REGISTERED, LeaseState.DISPATCHED)
                    and (prev.d_engine, lease.reg_epoch, prev.d_req, prev.first_token, prev.num_tokens, prev.d_blocks)
                    == (reg.d_engine, sender.epoch, reg.d_req, reg.first_token, reg.num_tokens, reg.d_blocks)):
                # D retried a registration whose reply it missed: same answer, nothing changes
                return Reply(True, clock=now, write_timeout_s=self.settings.transfer_timeout_s)
            if prev is not None and (prev.d_engine, lease.reg_epoch, prev.d_req) != (reg.d_engine, sender.epoch,
                                                                                   reg.d_req):
                # one P request feeds one D request: a second one would get (or take) KV that is not its own
                return Reply(False, clock=now, error=(
                    f"request {reg.p_req} is already registered by D request {prev.d_req!r} of engine "
                    f"{prev.d_engine!r} (epoch {lease.reg_epoch:016x}); refusing D request {reg.d_req!r} of engine "
                    f"{sender} (one P request feeds one D request: were its kv_transfer_params given to several?)"))
            if lease.state is not LeaseState.HELD:
                return Reply(False, error=f"request {reg.p_req} is {lease.state.value}", clock=now)
            if now >= reg.post_deadline:
                return Reply(False, error=f"registration of {reg.p_req} arrived after its post deadline "
                                          f"({now - reg.post_deadline:.3f} s late)", clock=now)
            known = self._peers.get(reg.d_engine)
            if known is None or known.epoch != sender.epoch:
                if not reg.d_payloads:
                    why = ("unknown decode engine" if known is None else
                           f"decode engine {reg.d_engine!r} is known at epoch {known.epoch:016x}, this "
                           f"registration comes from epoch {sender.epoch:016x} (restarted?): send its payloads")
                    return Reply(False, need_payloads=True, error=why, clock=now)
                peer = self._peer_record(reg.d_engine, sender.epoch, reg.d_payloads)
                self._check_reg(reg, lease, peer)
                self._replace_peer(reg.d_engine, peer, known)
            else:
                self._check_reg(reg, lease, known)
            lease.reg = reg
            lease.reg_epoch = sender.epoch
            lease.to(LeaseState.REGISTERED)
            lease.deadline = max(lease.deadline, reg.post_deadline)
        return Reply(True, clock=now, write_timeout_s=self.settings.transfer_timeout_s)

    @staticmethod
    def _peer_record(d_engine: str, epoch: int, encoded: list[bytes]) -> DPeer:
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

    def _replace_peer(self, d_engine: str, peer: DPeer, old: DPeer | None) -> None:
        """The one place a D record changes: ``peer`` becomes the record of ``d_engine``; registrations of the
        replaced start not yet handed to the workers are dropped by the next :meth:`step` (their epoch is no
        longer the record's), and the next dispatch hands the workers the new :class:`PeerInfo`."""
        if old is not None:
            dropped = [lease.req_id for lease in self._leases.values() if lease.state is LeaseState.REGISTERED
                       and lease.reg is not None and lease.reg.d_engine == d_engine and lease.reg_epoch == old.epoch]
            logger.warning("DSAConnector %s: decode engine %r restarted (epoch %016x replaces %016x): its new "
                           "payloads replace the old ones; %d registration(s) of the old start dropped, not written "
                           "(%s)", self.engine_id, d_engine, peer.epoch, old.epoch, len(dropped), dropped[:8])
        self._peers[d_engine] = peer
        self._peer_seen[d_engine] = self.clock()

    def _check_reg(self, reg: RegReq, lease: Lease, peer: DPeer) -> None:
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
        first, end = self._block_range(reg)
        if end > len(lease.blocks):
            raise MessageError(f"tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1} asked (blocks "
                               f"{first}..{end - 1} of {self.block_size} tokens), request {reg.p_req} has "
                               f"{len(lease.blocks)}")
        bd = peer.block_size
        need = -(-(reg.first_token + reg.num_tokens) // bd) - reg.first_token // bd if bd else 0
        if len(reg.d_blocks) < need:
            raise MessageError(f"tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1} need {need} of "
                               f"D's {bd}-token blocks, the registration names {len(reg.d_blocks)}")

    def _block_range(self, reg: RegReq) -> tuple[int, int]:
        """``[first, end)``: the indexes into the lease's blocks holding the registration's token span."""
        b = self.block_size
        return reg.first_token // b, -(-(reg.first_token + reg.num_tokens) // b)

    def handle_heartbeat(self, hb: HeartbeatReq) -> Reply:
        """Extend the leases D still waits for."""
        now = self.clock()
        with self._lock:
            for ref in hb.reqs:
                lease = self._owned(ref)
                if lease is not None and lease.state is LeaseState.HELD:
                    lease.deadline = max(lease.deadline, now + self.settings.lease_s)
        return Reply(True, clock=now)

    def handle_cancel(self, cancel: CancelReq) -> Reply:
        """D gave up: release what was not dispatched; say per request whether a WRITE may still land."""
        now = self.clock()
        states: dict[str, str] = {}
        with self._lock:
            for ref in cancel.reqs:
                lease = self._leases.get(ref.p_req)
                if lease is None:
                    # unknown or ended: remember it, so a registration arriving late is refused
                    posted = self._ended.get(ref.p_req, False)
                    self._tombstone(ref.p_req, posted)
                    states[ref.p_req] = CancelState.POSTED if posted else CancelState.NOT_POSTED
                    continue
                if self._owned(ref) is None:
                    states[ref.p_req] = CancelState.POSTED  # not D's to cancel: promise nothing
                    continue
                if lease.state is LeaseState.DISPATCHED:
                    states[ref.p_req] = CancelState.POSTED
                    continue
                if lease.state in (LeaseState.HELD, LeaseState.REGISTERED):
                    lease.to(LeaseState.CANCELLED)
                states[ref.p_req] = CancelState.NOT_POSTED  # CANCELLED / RELEASED: nothing posted, ever
        return Reply(True, clock=now, states=states)
