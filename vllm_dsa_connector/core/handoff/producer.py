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

Peers and restarts (epochs), idle peers and early registration: the rules are in :mod:`.leases`. An early
lease opens when P's scheduler first allocates the request's blocks (:meth:`Producer.add_early`, HELD, not yet
*final*) and is dispatched once its blocks are final: layer by layer in the step that finishes the prefill
(:meth:`Producer.dispatch_layered`), else on the step after it (:meth:`Producer.finish_early`); never
released while vLLM still prefills into its blocks. A registration P accepted and can no longer serve (an
aborted prefill, another prompt) becomes a failure job (``PushJob.error``): a failure notice, nothing written.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from vllm_dsa_connector.core.handoff.ids import TRANSFER_REF_PREFIX
from vllm_dsa_connector.core.handoff.leases import (
    DPeer,
    DRecords,
    HeldRegistrations,
    IdentityError,
    Lease,
    LeaseState,
    Tombstones,
    TransferTombstones,
    block_range,
    check_registration,
    check_routes,
    peer_record,
)
from vllm_dsa_connector.core.handoff.messages import (
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
from vllm_dsa_connector.core.handoff.settings import POST_DEADLINE_MARGIN_S, HandoffSettings
from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, decode_payload

logger = logging.getLogger(__name__)

__all__ = ["Dispatch", "Producer"]


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
        self._ended = Tombstones()  # ended requests (P's ids, transfer references): whether a WRITE went
        # transfer ids of requests P never saw whose registration it refuses (cancelled, or held past deadline)
        self._unseen = TransferTombstones(self.post_horizon_s)
        self._peers = DRecords()  # the D engine starts P knows (one record per engine id)
        self._by_transfer: dict[str, str] = {}  # transfer id -> P request id (early leases)
        # early registrations for requests P has not seen yet (per-D quotas)
        self._held = HeldRegistrations(settings.early_held_per_peer, settings.early_held_bytes_per_peer)
        self.refused_identities = 0  # registrations refused for payloads not their sender's (a counter)
        self._own_reserved = False  # this engine's own NIXL agents are bound to it (once its payloads exist)
        self.staging_full = False  # the workers' staging arenas are (nearly) full: told to D in every accept

    @property
    def post_horizon_s(self) -> float:
        """How far past its arrival P posts a registration at most: a later ``post_deadline`` is clamped."""
        return self.settings.transfer_timeout_s + POST_DEADLINE_MARGIN_S

    def held(self) -> int:
        """Early registrations held now for requests P has not seen yet (a gauge)."""
        with self._lock:
            return len(self._held)

    def _tombstoned(self, p_req: str) -> bool:
        """Whether a registration naming ``p_req`` is refused as ended (caller holds the lock)."""
        return p_req in self._ended or (p_req.startswith(TRANSFER_REF_PREFIX)
                                        and p_req[len(TRANSFER_REF_PREFIX):] in self._unseen)

    # ------------------------------------------------------------ engine thread

    def add_lease(self, req_id: str, blocks: list[int], *, prompt_tokens: int = 0, digest: str = "") -> str:
        """Keep ``blocks`` of a finished prefill for ``lease_s``; returns the request's token. ``prompt_tokens``
        and ``digest`` (P's prompt) are checked against what D's registration states."""
        token = secrets.token_hex(16)
        with self._lock:
            self._leases[req_id] = Lease(req_id, list(blocks), token, self.clock() + self.settings.lease_s,
                                         prompt_tokens=prompt_tokens, digest=digest)
        return token

    def add_early(self, req_id: str, transfer_id: str, blocks: list[int], *, prompt_tokens: int,
                  digest: str) -> None:
        """Open the lease of a prefill that has started, for D to register by ``transfer_id`` (early
        registration); a registration held for it is attached now. Again for the same request (its blocks
        allocated again after a preemption): the blocks are updated while nothing was dispatched."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is not None:
                if lease.state in (LeaseState.HELD, LeaseState.REGISTERED):
                    lease.blocks = list(blocks)
                return
            lease = Lease(req_id, list(blocks), transfer_id, self.clock() + self.settings.lease_s, final=False,
                          transfer_id=transfer_id, prompt_tokens=prompt_tokens, digest=digest)
            self._leases[req_id] = lease
            self._by_transfer[transfer_id] = req_id
            if self._tombstoned(TRANSFER_REF_PREFIX + transfer_id):
                lease.to(LeaseState.CANCELLED)  # D gave up before P saw the request: released once final
                return
            held = self._held.take(transfer_id)
            if held is None:
                return
            reg, epoch = held
            peer = self._peers.get(reg.d_engine)
            if peer is None or peer.epoch != epoch:
                return  # the D start that sent it was replaced meanwhile: its registration is void
            try:
                check_registration(reg, lease, peer, self.block_size)
            except MessageError as e:
                lease.fail = f"early registration of {reg.d_req!r} does not fit P's request {req_id}: {e}"
                logger.error("DSAConnector %s: %s", self.engine_id, lease.fail)
            lease.reg, lease.reg_epoch = reg, epoch
            lease.to(LeaseState.REGISTERED)
            lease.deadline = max(lease.deadline, reg.post_deadline)

    def update_blocks(self, req_id: str, blocks: list[int]) -> None:
        """The blocks an early lease's request holds now (the scheduler allocated more for its next chunk)."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is not None and not lease.final and lease.state in (LeaseState.HELD, LeaseState.REGISTERED):
                lease.blocks = list(blocks)

    def finish_early(self, req_id: str, blocks: list[int], ok: bool, why: str = "") -> bool:
        """P's request of an early lease finished: ``ok`` with its prefill (the blocks are final, the
        registration is dispatched on the next step, or kept for D's for ``lease_s``), else (aborted, failed)
        nothing will be written: a registered lease becomes a failure job, an unregistered one is released.
        Returns whether the lease still holds the blocks (the caller keeps them until finished_sending)."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None:
                return False
            if lease.state in (LeaseState.HELD, LeaseState.REGISTERED):
                lease.blocks = list(blocks)
            lease.final = True
            if ok:
                if lease.state is LeaseState.HELD:
                    lease.deadline = max(lease.deadline, self.clock() + self.settings.lease_s)
                return True
            if lease.state is LeaseState.HELD:
                del self._leases[req_id]
                self._ended_early(lease)
                return False
            if lease.state is LeaseState.REGISTERED and not lease.fail:
                lease.fail = f"P's request {req_id} ended without its prefill ({why or 'aborted'})"
            return True

    def dispatch_layered(self, req_id: str, blocks: list[int]) -> Dispatch:
        """The step that finishes the prefill of early lease ``req_id`` is scheduled with ``blocks``: hand the
        workers its registration as a layer-by-layer job (empty when it is not registered, or cannot be)."""
        out = Dispatch()
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None or lease.state is not LeaseState.REGISTERED or lease.reg is None or lease.fail:
                return out
            peer = self._peers.get(lease.reg.d_engine)
            first, end = block_range(lease.reg, self.block_size)
            if (peer is None or peer.epoch != lease.reg_epoch or end > len(blocks)
                    or self.clock() >= lease.reg.post_deadline):
                return out  # step() handles it as any registration once the prefill finished
            lease.blocks = list(blocks)
            self._dispatch(out, lease, lease.reg, layered=True)
        return out

    def step(self) -> Dispatch:
        """Dispatch registrations (before their post deadline) and release ended leases."""
        now = self.clock()
        out = Dispatch()
        with self._lock:
            for tid in self._held.expire(now):
                self._unseen.add(tid, now)  # a resent copy is past its deadline anyway
                logger.warning("DSAConnector %s: early registration of transfer %s expired before P saw the "
                               "request", self.engine_id, tid)
            for req_id, lease in self._leases.items():
                if not lease.final and not (lease.state is LeaseState.REGISTERED and lease.fail):
                    # an early lease whose prefill runs: dispatched (or released) once its blocks are final; a
                    # registration it cannot serve goes out as a failure job at once (nothing is written)
                    continue
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
        named = {lease.reg.d_engine for lease in self._leases.values() if lease.reg is not None}
        for d_engine, sent in self._peers.forget_idle(named, now, self.settings.peer_idle_s):
            if sent:
                out.forget.append(d_engine)
            logger.info("DSAConnector %s: decode engine %s idle for %.0f s: forgotten (its next registration "
                        "re-sends its payloads)", self.engine_id, d_engine, self.settings.peer_idle_s)

    @staticmethod
    def _release(out: Dispatch, lease: Lease, why: str) -> None:
        logger.warning("DSAConnector: releasing KV of %s (%s)", lease.req_id, why)
        lease.to(LeaseState.RELEASED)
        out.release.append(lease.req_id)

    def _dispatch(self, out: Dispatch, lease: Lease, reg: RegReq, layered: bool = False) -> None:
        peer = self._peers.by_engine[reg.d_engine]
        if (info := self._peers.unsent(reg.d_engine)) is not None:  # new to the workers, or a new start of it
            out.peers.append(info)
        first, end = block_range(reg, self.block_size)
        error = lease.fail
        if not error and end > len(lease.blocks):
            error = (f"P's request {lease.req_id} holds {len(lease.blocks)} blocks of {self.block_size} tokens, "
                     f"the registration asks tokens {reg.first_token}..{reg.first_token + reg.num_tokens - 1}")
        src = [] if error else lease.blocks[first:end]
        out.push.append(PushJob(lease.req_id, reg.d_engine, reg.d_req, src, list(reg.d_blocks),
                                reg.verify, reg.routes, post_deadline=reg.post_deadline,
                                first_token=reg.first_token, num_tokens=reg.num_tokens, dst_epoch=peer.epoch,
                                layered=layered and not error, error=error))
        lease.to(LeaseState.DISPATCHED)
        # the workers report finished_sending within post deadline + write timeout; keep the lease as long
        lease.deadline = max(lease.deadline, reg.post_deadline + self.settings.transfer_timeout_s)

    def finished_sending(self, req_ids: set[str]) -> None:
        """The workers are done with these requests (WRITE completed/failed, or blocks released)."""
        with self._lock:
            for req_id in req_ids:
                lease = self._leases.pop(req_id, None)
                if lease is not None:
                    self._ended.add(req_id, lease.state is LeaseState.DISPATCHED)
                    self._ended_early(lease, lease.state is LeaseState.DISPATCHED)

    def _ended_early(self, lease: Lease, posted: bool = False) -> None:
        """An early lease ended: its transfer id is tombstoned too (caller holds the lock)."""
        if lease.transfer_id and self._by_transfer.get(lease.transfer_id) == lease.req_id:
            del self._by_transfer[lease.transfer_id]
            self._ended.add(TRANSFER_REF_PREFIX + lease.transfer_id, posted)

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

    # ------------------------------------------------------------ side-channel thread

    def handle(self, req: Request, payloads: list[bytes], sender: Origin) -> Reply:
        """Answer one side-channel request from ``sender`` (the engine and epoch its envelope names);
        ``payloads`` are this engine's encoded worker payloads (the handshake's answer; empty while the
        workers have not registered their KV caches)."""
        if payloads and not self._own_reserved:
            self._reserve_own(payloads)
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

    def _reserve_own(self, payloads: list[bytes]) -> None:
        """Bind this engine's own NIXL agents to it, so no D can register with P's own payloads."""
        try:
            names = [decode_payload(p).agent_name for p in payloads]
        except ValueError:
            return
        with self._lock:
            self._peers.reserve(self.engine_id, names)
            self._own_reserved = True

    def _lease_named(self, p_req: str) -> Lease | None:
        """The lease ``p_req`` names: P's request id, or an early registration's transfer reference."""
        if p_req.startswith(TRANSFER_REF_PREFIX):
            req_id = self._by_transfer.get(p_req[len(TRANSFER_REF_PREFIX):])
            return self._leases.get(req_id) if req_id is not None else None
        return self._leases.get(p_req)

    def _owned(self, ref: ReqRef | RegReq) -> Lease | None:
        lease = self._lease_named(ref.p_req)
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
        if reg.post_deadline > now + self.post_horizon_s:  # P never posts it later than its horizon
            reg = msgspec.structs.replace(reg, post_deadline=now + self.post_horizon_s)
        with self._lock:
            lease = self._owned(reg)
            if lease is None and reg.p_req.startswith(TRANSFER_REF_PREFIX) and not self._tombstoned(reg.p_req):
                return self._hold(reg, sender, now)
            if lease is None:
                why = "ended" if self._tombstoned(reg.p_req) else "unknown, or the token does not match"
                return Reply(False, error=f"P holds no KV for request {reg.p_req} ({why})", clock=now)
            refused = lease.refusal(reg, sender.epoch, str(sender), now)
            if refused is not None:  # "": D retried a registration whose reply it missed (same answer)
                return Reply(not refused, clock=now, error=refused,
                             write_timeout_s=0.0 if refused else self.settings.transfer_timeout_s)
            peer = self._identify(reg, sender)
            if isinstance(peer, Reply):
                return peer
            check_registration(reg, lease, peer, self.block_size)
            known = self._peers.get(reg.d_engine)
            if peer is not known:
                self._replace_peer(reg.d_engine, peer, known)
            lease.reg = msgspec.structs.replace(reg, d_payloads=None)  # kept once, in the peer record
            lease.reg_epoch = sender.epoch
            lease.to(LeaseState.REGISTERED)
            lease.deadline = max(lease.deadline, reg.post_deadline)
        return Reply(True, clock=now, write_timeout_s=self.settings.transfer_timeout_s,
                     staging_full=self.staging_full)

    def _identify(self, reg: RegReq, sender: Origin) -> DPeer | Reply:
        """The record of the registration's sender start: the one P knows, else a new one from the payloads it
        brings (checked, not yet P's record: the caller makes it so once the registration passed its checks), or
        the reply asking for them (caller holds the lock). :class:`IdentityError` (counted) when the payloads
        are not the sender's: their NIXL agent is bound to another engine, their metadata names another agent,
        or they differ from those this engine start sent first."""
        known = self._peers.get(reg.d_engine)
        if known is not None and known.epoch == sender.epoch:
            if reg.d_payloads and list(reg.d_payloads) != known.payloads:
                raise self._refused(f"payloads sent by D engine {reg.d_engine!r} (epoch {sender.epoch:016x}) differ "
                                    "from those this engine start registered with first: refusing them (an engine "
                                    "start has one set of payloads)")
            return known
        if not reg.d_payloads:
            why = ("unknown decode engine" if known is None else
                   f"decode engine {reg.d_engine!r} is known at epoch {known.epoch:016x}, this "
                   f"registration comes from epoch {sender.epoch:016x} (restarted?): send its payloads")
            return Reply(False, need_payloads=True, error=why, clock=self.clock())
        try:
            peer = peer_record(reg.d_engine, sender.epoch, reg.d_payloads)
        except IdentityError as e:
            raise self._refused(str(e)) from None
        if why := self._peers.identity_refusal(reg.d_engine, sender.epoch, peer):
            raise self._refused(why)
        return peer

    def _refused(self, why: str) -> IdentityError:
        """Count and log a refused identity; the error to raise (caller holds the lock)."""
        self.refused_identities += 1
        logger.warning("DSAConnector %s: refused a registration: %s", self.engine_id, why)
        return IdentityError(why)

    def _hold(self, reg: RegReq, sender: Origin, now: float) -> Reply:
        """An early registration for a request P has not seen yet: keep it until the lease opens
        (:meth:`add_early`) or its post deadline passes (caller holds the lock)."""
        tid = reg.p_req[len(TRANSFER_REF_PREFIX):]
        if reg.token != tid:
            return Reply(False, clock=now, error=f"early registration {reg.p_req}: token is not its transfer id")
        if why := self._held.refusal(tid, reg, sender.epoch, str(sender)):
            return Reply(False, clock=now, error=why)
        if now >= reg.post_deadline:
            return Reply(False, error=f"registration of {reg.p_req} arrived after its post deadline", clock=now)
        if not reg.prompt_digest or reg.prompt_tokens <= 0:
            return Reply(False, clock=now, error=f"early registration {reg.p_req} states no prompt length and "
                                                 "digest (P cannot check it is the same prompt)")
        if tid not in self._held and self._unseen.full(now):
            return Reply(False, clock=now, error=(
                f"P remembers {len(self._unseen)} cancelled transfers of requests it never saw (for "
                f"{self._unseen.ttl_s:.0f} s each): refusing early registrations until some expire"))
        peer = self._identify(reg, sender)
        if isinstance(peer, Reply):
            return peer
        check_routes(reg, peer)
        known = self._peers.get(reg.d_engine)
        if peer is not known:
            self._replace_peer(reg.d_engine, peer, known)
        self._held.put(tid, reg, sender.epoch)
        return Reply(True, clock=now, write_timeout_s=self.settings.transfer_timeout_s,
                     staging_full=self.staging_full)

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
        self._peers.set(d_engine, peer, self.clock())

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
                lease = self._lease_named(ref.p_req)
                tid = ref.p_req[len(TRANSFER_REF_PREFIX):] if ref.p_req.startswith(TRANSFER_REF_PREFIX) else ""
                if lease is None and tid:
                    self._held.cancel(tid, ref.token)  # held, never written
                if lease is None:
                    states[ref.p_req] = self._cancel_unknown(ref.p_req, tid, now)
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

    def _cancel_unknown(self, p_req: str, tid: str, now: float) -> str:
        """The answer to a cancel of a request P holds no lease for (caller holds the lock): an ended one's
        tombstone says whether a WRITE went; a transfer id P never saw is tombstoned for P's post-deadline
        horizon, so its registration, if it still comes, is refused (table full: P promises nothing, ``posted``,
        and D keeps its blocks until its write bound); an unknown P request id has no lease to come."""
        if p_req in self._ended:
            return CancelState.POSTED if self._ended.posted(p_req) else CancelState.NOT_POSTED
        if tid and tid not in self._unseen and not self._unseen.add(tid, now):
            logger.warning("DSAConnector %s: cannot remember the cancel of transfer %s (%d cancelled transfers "
                           "held): answered 'posted', D keeps its blocks until its write bound", self.engine_id,
                           tid, len(self._unseen))
            return CancelState.POSTED
        return CancelState.NOT_POSTED
