"""The consumer (D) role: handshakes, registrations, give-up, heartbeats, cancels.

Each request that takes its prompt's KV from P is a :class:`Loading` with an explicit
:class:`LoadState`; every state change goes through :meth:`Loading.to`, which refuses a transition not in
:data:`TRANSITIONS`. All calls come from one thread (the engine's scheduler): :meth:`Consumer.step`
(background replies are collected there), :meth:`Consumer.register`, :meth:`Consumer.give_up` and
:meth:`Consumer.finished`:

    QUEUED (waiting for the handshake or for blocks; heartbeated)
      -> REGISTERING (blocks allocated, registration sent) -> REGISTERED (P accepted)
      -> (gone: every notice arrived, the workers report finished_recving)
    REGISTERING / REGISTERED -> GIVING_UP (timeout, abort) -> FAILED (fail_recv sent to the workers)
    REGISTERING -> FAILED (P refused the registration: it will never write it)
    QUEUED -> (gone) when the request will not load (nothing was registered, nothing to wait for)

A handshake that fails transiently (unanswered, P still starting, or an answer that is not P's signed reply
to this request: an unsigned refusal, e.g. of a clock skew over the replay window or a secret P cannot
check) is tried again while a request waits for it inside its transfer budget (``transfer_timeout_s`` from
when it was queued); a refused peer (layout, engine id) fails its requests at once.

Guarantee "no WRITE lands in blocks D gave back": D hands its blocks back to the engine only by reporting
the request finished, and after a give-up it does so only when no WRITE can still arrive:

- a registration carries ``post_deadline``, D's give-up time mapped to P's clock with a margin for the
  clock estimate (``ClockEstimate.to_peer_before``): P posts nothing after it (see :mod:`.producer`);
- D releases at once when P never got the registration by its own word (refused, or a cancel answered
  ``not_posted``; P tombstones cancelled requests, so a registration arriving later is refused too);
- otherwise D keeps the blocks until give-up time + P's write timeout (P's workers complete or abort a
  posted WRITE within it) + :data:`SAFETY_MARGIN_S`. A P that is merely slow, stalled or unreachable
  therefore costs D blocks for that bound, never corrupted KV.
The residual assumption: monotonic clocks of the two hosts drift less than ``ClockEstimate.DRIFT``.

Producer restarts (epochs). The handshake records the epoch of the P start that answered
(``PeerMeta.epoch``); P's ``kv_transfer_params`` name the start that holds the lease (``remote_epoch``).
D redoes the handshake (a fresh :class:`Peer`, the same control thread) when a request names another
epoch than the handshake's (once per epoch it names), or when any reply of P (registration, heartbeat)
comes from another epoch. When the new handshake settles on a new epoch, the loads of the old start fail
(:meth:`Consumer._restarted`): queued ones at allocation, registered ones by the give-up rule above (P's
new start never writes them; D still keeps their blocks until the write bound unless the start that took
the registration confirms a cancel); a request naming an epoch that is not P's current one fails its load
(its lease died with that start). D's payloads reach the new start with its first registration (P asks
for them), and the workers get the new start's :class:`~.wire.PeerInfo` (scheduler's job).
The staging slots of a failed load follow the same rule (:meth:`Consumer.writes_over_at`).

Nothing grows without bound: a peer no load has used for ``peer_idle_s`` is forgotten
(:meth:`Consumer.forget_idle`: its control thread stops, the workers drop it; its next request handshakes
again), and a peer's unanswered heartbeats queue at most :data:`_HB_PENDING` deep.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_dsa_connector.handoff.messages import (
    MAX_ID_CHARS,
    MAX_REQS_PER_MESSAGE,
    Authenticator,
    CancelReq,
    CancelState,
    HeartbeatReq,
    Origin,
    RegReq,
    Reply,
    ReqRef,
    new_epoch,
)
from vllm_dsa_connector.handoff.routes import Held
from vllm_dsa_connector.handoff.settings import HandoffSettings
from vllm_dsa_connector.handoff.side_channel import (
    HandshakeError,
    PeerMeta,
    exchange,
    fetch_payloads,
    validate_peer,
)
from vllm_dsa_connector.handoff.states import Transitions
from vllm_dsa_connector.handoff.wire import (
    TRANSFER_MODE,
    RankPayload,
    RecvJob,
    Routes,
    encode,
    max_block_id,
)

if TYPE_CHECKING:
    from vllm_dsa_connector.matching import PeerPlan

logger = logging.getLogger(__name__)

#: ``check(src_payloads, dst_payloads) -> plan``: refuses an incompatible peer, plans the transfer
PeerCheck = Callable[[Sequence[RankPayload], Sequence[RankPayload]], "PeerPlan"]

SAFETY_MARGIN_S = 1.0
# A request inside its transfer budget tries an unanswered handshake again this soon (one attempt in flight per
# peer): on a loaded host a P's side channel can stay unanswered past handshake_timeout_s (2 cores, CI: P's
# engine starved), and one slow answer must not fail every request that was waiting for it.
_RETRY_S = 0.5
_TAKEN = 65536  # P requests remembered as taken by a D request (n > 1 siblings arrive within steps)
_EPOCHS = 64  # epochs a peer's requests named that already caused a fresh handshake (remembered per peer)
# Heartbeats of one peer still unanswered (its control thread is behind, P is slow or gone): beyond this no new
# one is queued for it (each waits handshake_timeout_s; a queue growing every heartbeat_s would never drain).
_HB_PENDING = 64


class RemoteParams(msgspec.Struct, frozen=True):
    """The ``kv_transfer_params`` P handed out (through the proxy: untrusted, checked)."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    remote_num_tokens: int
    remote_token: str
    transfer_mode: str = TRANSFER_MODE
    remote_epoch: int = 0  # the P start holding the lease (0: not named)

    @property
    def ref(self) -> ReqRef:
        return ReqRef(self.remote_request_id, self.remote_token)


def parse_remote_params(params: dict[str, Any]) -> RemoteParams:
    """Typed params; ``ValueError`` naming the problem."""
    fields = {k: params[k] for k in RemoteParams.__struct_fields__ if k in params}
    try:
        rp = msgspec.convert(fields, RemoteParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"malformed kv_transfer_params: {e}") from None
    if not 0 < rp.remote_port < 65536:
        raise ValueError(f"remote_port {rp.remote_port} out of range")
    if not 0 <= rp.remote_epoch < 1 << 63:
        raise ValueError(f"remote_epoch {rp.remote_epoch} out of range (0..2**63-1)")
    if rp.remote_num_tokens < 0 or any(b < 0 for b in rp.remote_block_ids):
        raise ValueError("negative remote_num_tokens or block id")
    for name in ("remote_engine_id", "remote_request_id", "remote_token"):
        # P refuses a whole heartbeat or cancel naming one id it cannot take: never let one through
        if not 0 < len(getattr(rp, name)) <= MAX_ID_CHARS:
            raise ValueError(f"{name} must be 1..{MAX_ID_CHARS} characters, got {len(getattr(rp, name))}")
    return rp


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
class Peer:
    """One producer engine, as learnt by the handshake."""

    host: str
    port: int
    future: Future | None = None
    meta: PeerMeta | None = None
    plan: PeerPlan | None = None  # the transfer plan the handshake built (validate_peer)
    payloads: list[bytes] = field(default_factory=list)
    expected: dict[int, list[int]] = field(default_factory=dict)
    max_block: int = 0
    error: str | None = None
    failed_at: float = 0.0  # when a transient handshake failure happened (0: refused, never retried)
    control: ThreadPoolExecutor | None = None  # cancels and heartbeats to this peer only
    started_at: float = 0.0  # the current handshake attempt
    attempt: int = 1
    stale: str = ""  # a reply came from another start of P than the handshake's: redo it (why)
    epochs_asked: set[int] = field(default_factory=set)  # request epochs that already caused a fresh handshake
    last_used: float = 0.0  # the last step a request used this peer (idle peers are forgotten)
    warned: set[str] = field(default_factory=set)  # caps already logged for this peer (once each)

    @property
    def retryable(self) -> bool:
        """The last handshake failed transiently (no answer, or P still starting): another may succeed."""
        return bool(self.error and self.failed_at)


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


class Consumer:
    """All loads of one decode engine."""

    def __init__(self, engine_id: str, settings: HandoffSettings, auth: Authenticator,
                 local_payloads: Callable[[], list[RankPayload]], local_encoded: Callable[[], list[bytes]],
                 clock: Callable[[], float] = time.monotonic, check_peer: PeerCheck = validate_peer,
                 on_reply: Callable[[], None] | None = None, epoch: int = 0) -> None:
        self.engine_id = engine_id
        self.epoch = epoch or new_epoch()  # this engine start's, named in every message it sends
        self.origin = Origin(engine_id, self.epoch)
        self._on_reply = on_reply  # a handshake or registration finished on a background thread
        self.settings = settings
        self.check_peer = check_peer
        self.auth = auth
        self.clock = clock
        self._local = local_payloads
        self._local_encoded = local_encoded
        self.peers: dict[str, Peer] = {}
        self.loads: dict[str, Loading] = {}
        self._handshakes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsa-handshake")
        self._regs = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsa-register")
        self._last_hb = 0.0
        self._heartbeats: list[tuple[str, list[ReqRef], Future]] = []  # (engine, refs, reply) in flight
        self._taken: OrderedDict[tuple[str, str], str] = OrderedDict()  # (P engine, P request) -> D request
        self.heartbeats_refused = 0  # heartbeats P answered with a refusal (each an error, logged)

    # ------------------------------------------------------------ handshake

    def _notifying(self, fut: Future) -> Future:
        """``fut``, calling ``on_reply`` once it is done (the engine's idle pause ends: its next step reads it)."""
        if self._on_reply is not None:
            on_reply = self._on_reply
            fut.add_done_callback(lambda _f: on_reply())
        return fut

    def _handshake(self, peer: Peer) -> tuple[PeerMeta, PeerPlan]:
        meta = fetch_payloads(peer.host, peer.port, self.settings.handshake_timeout_s, self.auth, self.origin)
        return meta, self.check_peer(meta.payloads, self._local())

    def peer(self, engine: str, host: str, port: int, waiting_since: float | None = None, epoch: int = 0) -> Peer:
        """The peer (its handshake started on first use). After a transient failure (no answer, or P still
        starting) the handshake is tried again ``_RETRY_S`` later for a request queued at ``waiting_since``
        whose transfer budget is not spent (:meth:`patient`). A fresh handshake also starts when a reply came
        from another start of P (``stale``) or a request names a P start (``epoch``) the handshake did not
        answer from, once per such epoch."""
        now = self.clock()
        peer = self.peers.get(engine)
        attempt = 1
        asked: set[int] = set()
        if peer is not None and peer.retryable and self.patient(waiting_since) and now - peer.failed_at >= _RETRY_S:
            attempt, peer = peer.attempt + 1, None
        elif peer is not None and peer.future is None and peer.meta is not None and (
                peer.stale or (epoch and epoch != peer.meta.epoch and epoch not in peer.epochs_asked)):
            why = peer.stale or f"a request names its epoch {epoch:016x}, the handshake's is {peer.meta.epoch:016x}"
            logger.warning("DSAConnector %s: P %s at %s:%d restarted? %s; redoing the handshake", self.engine_id,
                           engine, host, port, why)
            asked = set(peer.epochs_asked) if len(peer.epochs_asked) < _EPOCHS else set()
            if epoch:
                asked.add(epoch)
            peer = None
        if peer is None:
            peer = Peer(host, port, started_at=now, attempt=attempt, epochs_asked=asked)
            peer.control = (self.peers[engine].control if engine in self.peers else
                            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-control"))
            peer.future = self._notifying(self._handshakes.submit(self._handshake, peer))
            self.peers[engine] = peer
        if peer.future is not None and peer.future.done():
            self._settle_handshake(engine, peer, peer.future, now)
        peer.last_used = now
        return peer

    def forget_idle(self) -> list[str]:
        """Forget the peers no load has used for ``peer_idle_s`` (no handshake, heartbeat or load in
        flight): their control thread stops once its queued cancels went out, and the returned engines are
        the ones the workers must drop (their plan). A later request to such an engine handshakes again;
        without this every P ever seen (each restart is a new engine) would keep a thread and its state."""
        now = self.clock()
        busy = {load.engine for load in self.loads.values()} | {engine for engine, _, _ in self._heartbeats}
        gone = []
        for engine, peer in list(self.peers.items()):
            if engine in busy or peer.future is not None:
                peer.last_used = now
            elif now - peer.last_used >= self.settings.peer_idle_s:
                del self.peers[engine]
                if peer.control is not None:
                    peer.control.shutdown(wait=False)
                gone.append(engine)
                logger.info("DSAConnector %s: peer %s (%s:%d) idle for %.0f s: forgotten", self.engine_id, engine,
                            peer.host, peer.port, now - peer.last_used)
        return gone

    def patient(self, waiting_since: float | None) -> bool:
        """Whether a request queued at ``waiting_since`` may still wait for a handshake to be retried."""
        return waiting_since is not None and self.clock() - waiting_since < self.settings.transfer_timeout_s

    def waits_for(self, peer: Peer, waiting_since: float) -> bool:
        """Whether a request queued at ``waiting_since`` should ask again later: the handshake is in flight,
        or it went unanswered and will be retried inside the request's transfer budget."""
        return peer.future is not None or (peer.retryable and self.patient(waiting_since))

    def _settle_handshake(self, engine: str, peer: Peer, done: Future, now: float) -> None:
        host, port = peer.host, peer.port
        took = now - peer.started_at
        try:
            peer.meta, peer.plan = done.result()
            if peer.meta.engine_id != engine:
                raise HandshakeError(f"DSAConnector peer {host}:{port} is engine {peer.meta.engine_id!r}, "
                                     f"kv_transfer_params name {engine!r}")
            peer.payloads = [encode(p) for p in peer.meta.payloads]
            peer.expected = {p.rank: list(peer.plan.senders_for(p.rank)) for p in self._local()}
            peer.max_block = max_block_id(peer.meta.payloads)
            logger.info("DSAConnector %s: handshake with %s (epoch %016x) done in %.2f s (attempt %d; %d workers, "
                        "plan %s)", self.engine_id, engine, peer.meta.epoch, took, peer.attempt, len(peer.payloads),
                        peer.expected)
            self._restarted(engine, peer.meta.epoch)
        except HandshakeError as e:
            peer.error = str(e)
            # an unreachable or starting peer may come back; a refused layout will not
            peer.failed_at = now if e.transient else 0.0
            logger.error("%s (attempt %d, after %.2f s%s)", e, peer.attempt, took,
                         "; waiting requests retry within their transfer budget" if e.transient else "")
        except Exception as e:  # noqa: BLE001 - any handshake bug becomes a load failure, not a crash
            peer.error = f"DSAConnector handshake with {engine} failed: {e!r}"
            peer.failed_at = now
            logger.exception("DSAConnector handshake with %s failed", engine)
        peer.future = None

    def _restarted(self, engine: str, epoch: int) -> None:
        """The handshake with ``engine`` settled on start ``epoch``: the loads whose lease another start of it
        holds fail (queued ones at allocation; registered ones are given up: the new start never writes them,
        and their blocks come back by the give-up rule)."""
        for req_id, load in list(self.loads.items()):
            if load.engine != engine or not load.epoch or load.epoch == epoch:
                continue
            reason = (f"P {engine} restarted: the lease is held by its start {load.epoch:016x}, P is now "
                      f"{epoch:016x}")
            if load.state is LoadState.QUEUED:
                load.error = load.error or reason
            elif load.state in (LoadState.REGISTERING, LoadState.REGISTERED):
                self.give_up(req_id, reason)

    def _check_sender(self, engine: str, sender: Origin) -> None:
        """A reply of ``engine`` from another start than the handshake's: the next :meth:`peer` redoes it."""
        peer = self.peers.get(engine)
        if (peer is not None and peer.meta is not None and not peer.stale and sender.engine_id == engine
                and sender.epoch != peer.meta.epoch):
            peer.stale = (f"a reply came from its epoch {sender.epoch:016x}, the handshake's is "
                          f"{peer.meta.epoch:016x}")
            logger.warning("DSAConnector %s: P %s: %s (restarted?)", self.engine_id, engine, peer.stale)

    # ------------------------------------------------------------ requests

    def taken_by(self, req_id: str, rp: RemoteParams) -> str | None:
        """The other D request that already loads (or loaded) the P request ``rp`` names, else ``None``.

        One P request feeds one D request: vLLM forks a request with ``n > 1`` into children that share its
        ``kv_transfer_params``, and a completion with a prompt list hands the first prompt's params to all
        of them. The first D request to come takes the KV; the caller computes the others itself."""
        other = self._taken.get((rp.remote_engine_id, rp.remote_request_id))
        return other if other is not None and other != req_id else None

    def queue(self, req_id: str, rp: RemoteParams) -> float:
        """The request waits (handshake or blocks): heartbeats keep P's lease alive meanwhile. Returns when
        it was first queued (its transfer budget runs from there)."""
        if req_id not in self.loads:
            # the P start holding the lease: the params' word, else the start D's handshake knows now
            known = self.peers.get(rp.remote_engine_id)
            epoch = rp.remote_epoch or (known.meta.epoch if known is not None and known.meta is not None else 0)
            self.loads[req_id] = Loading(rp.remote_engine_id, rp.ref, req_id=req_id, queued_at=self.clock(),
                                         epoch=epoch)
            key = (rp.remote_engine_id, rp.remote_request_id)
            self._taken.setdefault(key, req_id)
            self._taken.move_to_end(key)
            while len(self._taken) > _TAKEN:
                self._taken.popitem(last=False)
        return self.loads[req_id].queued_at

    def forget_queued(self, req_id: str) -> None:
        """A queued request that will not load from P."""
        load = self.loads.get(req_id)
        if load is not None and load.state is LoadState.QUEUED:
            del self.loads[req_id]

    def register(self, req_id: str, rp: RemoteParams, peer: Peer, first_token: int, num_tokens: int,
                 src_blocks: list[int], dst_blocks: list[int], routes: Routes,
                 held_slots: Held) -> RecvJob:
        """Blocks are allocated and paired (``matching.BlockPairing``: tokens ``[first_token, +num_tokens)``
        in P's ``src_blocks`` and D's ``dst_blocks``): send the registration; the returned job goes to the
        workers."""
        assert peer.meta is not None
        now = self.clock()
        load = self.loads.setdefault(req_id, Loading(rp.remote_engine_id, rp.ref, req_id=req_id))
        load.epoch = load.epoch or peer.meta.epoch
        load.to(LoadState.REGISTERING)
        load.give_up_at = now + self.settings.transfer_timeout_s
        load.release_at = now + self._release_bound(peer)  # no WRITE of this registration lands after it
        load.slots = held_slots
        reg = RegReq(rp.remote_request_id, rp.remote_token, self.engine_id, req_id, first_token, num_tokens,
                     dst_blocks, peer.meta.clock.to_peer_before(load.give_up_at, now),
                     self.settings.verify_transfers, routes)
        load.reg_body = reg
        load.reg = self._notifying(self._regs.submit(self._register, peer, reg))
        return RecvJob(req_id=req_id, src_engine=rp.remote_engine_id, blocks=dst_blocks, expected=peer.expected,
                       timeout_s=self._release_bound(peer) + 60.0, verify=self.settings.verify_transfers,
                       src_blocks=src_blocks, routes=routes, first_token=first_token, num_tokens=num_tokens,
                       src_epoch=peer.meta.epoch)

    def epoch_error(self, req_id: str, rp: RemoteParams, peer: Peer) -> str:
        """Why the load of ``req_id`` cannot be served by ``peer``'s start (its lease is another start's), or
        ``""``. A mismatch is recorded as the load's error (it fails at allocation)."""
        load = self.loads.get(req_id)
        if peer.meta is None or not rp.remote_epoch or rp.remote_epoch == peer.meta.epoch:
            return load.error if load is not None else ""
        reason = (f"kv_transfer_params name P {rp.remote_engine_id}'s start {rp.remote_epoch:016x}, P is now "
                  f"{peer.meta.epoch:016x} (restarted: the lease is gone)")
        if load is not None:
            load.error = load.error or reason
        return reason

    def _register(self, peer: Peer, reg: RegReq) -> tuple[Reply, Origin]:
        assert peer.meta is not None
        answer = exchange(peer.host, peer.port, reg, self.settings.handshake_timeout_s, self.auth, peer.meta.clock,
                          self.origin)
        if not answer[0].ok and answer[0].need_payloads:
            answer = exchange(peer.host, peer.port, msgspec.structs.replace(reg, d_payloads=self._local_encoded()),
                              self.settings.handshake_timeout_s, self.auth, peer.meta.clock, self.origin)
        return answer

    def _release_bound(self, peer: Peer | None) -> float:
        write = peer.meta.write_timeout_s if peer is not None and peer.meta is not None else 0.0
        return self.settings.transfer_timeout_s + max(write, self.settings.transfer_timeout_s) + SAFETY_MARGIN_S

    def writes_over_at(self, load: Loading) -> float:
        """From when no WRITE of P can land in this load's blocks or staging slots: at once for a FAILED
        load (P refused it, confirmed ``not_posted``, or the bound passed: the only ways there) or a cancel
        P answered ``not_posted``; else the load's release bound (give-up time + P's write timeout +
        :data:`SAFETY_MARGIN_S`). The workers may report a load failed before the scheduler gave up on it
        (a writer's failure notice, a bad notice): its slots wait for this bound, never for less."""
        if load.state is LoadState.FAILED or self._cancel_confirmed(load):
            return 0.0
        return load.release_at

    def give_up(self, req_id: str, reason: str) -> None:
        """Stop waiting for P: cancel there, hand the blocks back once no WRITE can land in them."""
        load = self.loads.get(req_id)
        if load is None or load.state in (LoadState.GIVING_UP, LoadState.FAILED):
            return
        peer = self.peers.get(load.engine)
        if load.state is LoadState.QUEUED:
            del self.loads[req_id]  # nothing was registered: nothing to wait for
            self.cancel(load.engine, [load.ref])
            return
        logger.warning("DSAConnector: giving up on %s: %s", req_id, reason)
        load.to(LoadState.GIVING_UP)
        load.reason = reason
        write = peer.meta.write_timeout_s if peer is not None and peer.meta is not None else 0.0
        load.release_at = load.give_up_at + max(write, self.settings.transfer_timeout_s) + SAFETY_MARGIN_S
        load.cancel = self.cancel(load.engine, [load.ref])

    def cancel(self, engine: str, refs: list[ReqRef]) -> Future | None:
        """Tell P to drop these requests (on the peer's own control thread); the future holds P's reply."""
        peer = self.peers.get(engine)
        if peer is None or peer.control is None:
            return None
        return peer.control.submit(exchange, peer.host, peer.port, CancelReq(refs), self.settings.handshake_timeout_s,
                                   self.auth, None, self.origin)

    def in_flight(self) -> bool:
        """Whether a load needs the engine's next steps (its workers report the outcome of a registered
        load, or a give-up hands blocks back), rather than waiting for the handshake or P's reply."""
        return any(load.state not in (LoadState.QUEUED, LoadState.REGISTERING)
                   for load in list(self.loads.values()))

    def giving_up(self) -> bool:
        """Whether a given-up load still waits for its workers to hand its blocks back."""
        return any(load.state in (LoadState.GIVING_UP, LoadState.FAILED) for load in list(self.loads.values()))

    def pending(self) -> bool:
        """Whether any load is tracked (queued, registering, registered or given up)."""
        return bool(self.loads)

    def load(self, req_id: str) -> Loading | None:
        """The load of D request ``req_id`` (None: it does not load from P, or it finished)."""
        return self.loads.get(req_id)

    def load_error(self, req_id: str) -> str:
        """Why the load of ``req_id`` fails at allocation (a refused heartbeat, P restarted), or ``""``."""
        load = self.loads.get(req_id)
        return load.error if load is not None else ""

    def known_peer(self, engine: str) -> Peer | None:
        """P ``engine``'s record as it stands, without starting or redoing its handshake (:meth:`peer` does)."""
        return self.peers.get(engine)

    def finished(self, req_id: str) -> Loading | None:
        """The workers reported the request (loaded or failed): forget it."""
        return self.loads.pop(req_id, None)

    def step(self, fail: dict[str, str]) -> None:
        """Collect replies, apply timeouts and bounds; requests to hand back go into ``fail``."""
        now = self.clock()
        for req_id, load in list(self.loads.items()):
            if load.state is LoadState.REGISTERING and load.reg is not None and load.reg.done():
                try:
                    reply, sender = load.reg.result()
                except Exception as e:  # noqa: BLE001 - unanswered: P may have it; retry (idempotent on P)
                    peer = self.peers.get(load.engine)
                    # (a peer whose handshake is being redone has no meta: P restarted, the retry is pointless)
                    if peer is not None and peer.meta is not None and load.reg_body is not None and (
                            now + self.settings.handshake_timeout_s < load.give_up_at):
                        logger.warning("DSAConnector: registration of %s unanswered (%s); retrying", req_id, e)
                        load.reg = self._notifying(self._regs.submit(self._register, peer, load.reg_body))
                    else:
                        self.give_up(req_id, f"registration unanswered: {e}")
                    continue
                self._check_sender(load.engine, sender)
                if reply.ok:
                    load.to(LoadState.REGISTERED)
                else:  # P refused: it will never write this registration
                    logger.error("DSAConnector: P refused registration of %s: %s", req_id, reply.error)
                    self._fail(fail, req_id, load, f"P refused the registration: {reply.error}")
                    continue
            if load.state in (LoadState.REGISTERING, LoadState.REGISTERED) and now >= load.give_up_at:
                self.give_up(req_id, f"no KV after {self.settings.transfer_timeout_s:.1f} s")
            if load.state is LoadState.GIVING_UP:
                if self._cancel_confirmed(load):
                    self._fail(fail, req_id, load, load.reason + " (P confirmed nothing was written)")
                elif now >= load.release_at:
                    self._fail(fail, req_id, load, load.reason + " (write bound passed)")
        self._heartbeat(now)

    @staticmethod
    def _cancel_confirmed(load: Loading) -> bool:
        """P's start that holds the lease said nothing was or will be posted (another start's word, e.g. of a
        P restarted on the same port, is not: it never knew the registration)."""
        if load.cancel is None or not load.cancel.done() or load.cancel.exception() is not None:
            return False
        reply, sender = load.cancel.result()
        return (reply.ok and reply.states.get(load.ref.p_req) == CancelState.NOT_POSTED
                and (not load.epoch or sender.epoch == load.epoch))

    @staticmethod
    def _fail(fail: dict[str, str], req_id: str, load: Loading, reason: str) -> None:
        load.to(LoadState.FAILED)
        fail[req_id] = reason

    def _heartbeat(self, now: float) -> None:
        """Collect heartbeat replies, then, every ``heartbeat_s``, renew P's leases of the loads still waiting:
        one heartbeat per :data:`MAX_REQS_PER_MESSAGE` requests (P refuses a larger one whole)."""
        self._collect_heartbeats()
        if now - self._last_hb < self.settings.heartbeat_s:
            return
        self._last_hb = now
        by_engine: dict[str, list[ReqRef]] = {}
        for load in self.loads.values():
            if load.state in (LoadState.QUEUED, LoadState.REGISTERING, LoadState.REGISTERED) and not load.error:
                by_engine.setdefault(load.engine, []).append(load.ref)
        pending: dict[str, int] = {}
        for engine, _, _ in self._heartbeats:
            pending[engine] = pending.get(engine, 0) + 1
        for engine, refs in by_engine.items():
            peer = self.peers.get(engine)
            if peer is not None and peer.control is not None and not peer.error:
                for i in range(0, len(refs), MAX_REQS_PER_MESSAGE):
                    if pending.get(engine, 0) >= _HB_PENDING:
                        if "heartbeats" not in peer.warned:
                            peer.warned.add("heartbeats")
                            logger.warning("DSAConnector %s: %d heartbeats to %s (%s:%d) unanswered; no more "
                                           "are queued until they are", self.engine_id, _HB_PENDING, engine,
                                           peer.host, peer.port)
                        break
                    chunk = refs[i : i + MAX_REQS_PER_MESSAGE]
                    self._heartbeats.append((engine, chunk, peer.control.submit(self._send_heartbeat, peer, chunk)))
                    pending[engine] = pending.get(engine, 0) + 1

    def _send_heartbeat(self, peer: Peer, refs: list[ReqRef]) -> tuple[Reply, Origin]:
        return exchange(peer.host, peer.port, HeartbeatReq(refs), self.settings.handshake_timeout_s, self.auth,
                        peer.meta.clock if peer.meta else None, self.origin)

    def _collect_heartbeats(self) -> None:
        """An unanswered heartbeat is a warning (the next one may pass, the lease has slack); a refused one is
        an error: P keeps none of those leases, so the loads of it still queued fail (at allocation, where
        vLLM applies ``kv_load_failure_policy``) instead of waiting for KV P will have released."""
        pending = []
        for engine, refs, fut in self._heartbeats:
            if not fut.done():
                pending.append((engine, refs, fut))
                continue
            try:
                reply, sender = fut.result()
            except Exception as e:  # noqa: BLE001 - unanswered (HandshakeError) or cancelled at shutdown
                logger.warning("DSAConnector heartbeat of %d requests to %s: %s", len(refs), engine, e)
                continue
            self._check_sender(engine, sender)
            if reply.ok:
                continue
            self.heartbeats_refused += 1
            reason = f"P {engine} refused the heartbeat: {reply.error}"
            logger.error("DSAConnector %s: %s (%d requests; their queued loads fail)", self.engine_id, reason,
                         len(refs))
            refused = {ref.p_req for ref in refs}
            for load in self.loads.values():
                if load.engine == engine and load.state is LoadState.QUEUED and load.ref.p_req in refused:
                    load.error = load.error or reason
        self._heartbeats = pending

    def shutdown(self) -> None:
        """Stop background threads."""
        for pool in [self._handshakes, self._regs] + [p.control for p in self.peers.values() if p.control]:
            pool.shutdown(wait=False, cancel_futures=True)
