"""The consumer (D) role: registrations, give-up, heartbeats, cancels of every load of one decode engine.

All calls come from one thread (the engine's scheduler): :meth:`Consumer.step` (background replies are
collected there), :meth:`Consumer.register`, :meth:`Consumer.give_up` and :meth:`Consumer.finished`.
What one load is, its states and the bounds that keep a WRITE out of blocks D gave back live in
:mod:`.loads` (:class:`~.loads.Loading`, :class:`~.loads.LoadState`); the P engines D knows, their
handshakes, retries and restarts in :mod:`.peers` (:class:`~.peers.Peers`). The consumer drives both: it
queues a request while it waits for its peer's handshake or for blocks (heartbeats keep P's lease alive
meanwhile), sends the registration once blocks are paired, collects P's replies, gives up on timeout or
abort (a cancel on the peer's control thread), and fails the loads of a P start that is gone
(:meth:`Consumer._restarted`).

A cancel P did not answer may never have reached P: D sends it again on its next steps until P answers or
P's lease has run out anyway (:mod:`.cancels`); D retries on the steps it takes anyway.

Nothing grows without bound: idle peers are forgotten (:meth:`Consumer.forget_idle`), at most
:data:`_TAKEN` P requests are remembered as taken (:meth:`Consumer.taken_by`), a peer's unanswered
heartbeats queue at most :data:`_HB_PENDING` deep, and at most :data:`.cancels.MAX_PENDING` unanswered cancels
are retried.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from vllm_dsa_connector.core.handoff.cancels import PendingCancels
from vllm_dsa_connector.core.handoff.loads import Loading, LoadState, write_bound_s
from vllm_dsa_connector.core.handoff.messages import (
    MAX_REQS_PER_MESSAGE,
    Authenticator,
    CancelReq,
    HeartbeatReq,
    Origin,
    RegReq,
    Reply,
    ReqRef,
    new_epoch,
)
from vllm_dsa_connector.core.handoff.params import RemoteParams
from vllm_dsa_connector.core.handoff.peers import Peer, PeerCheck, Peers
from vllm_dsa_connector.core.handoff.routes import Held
from vllm_dsa_connector.core.handoff.settings import POST_DEADLINE_MARGIN_S, HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import exchange, validate_peer
from vllm_dsa_connector.core.handoff.wire import RankPayload, RecvJob, Routes

__all__ = ["Consumer"]

logger = logging.getLogger(__name__)

_TAKEN = 65536  # P requests remembered as taken by a D request (n > 1 siblings arrive within steps)
# Heartbeats of one peer still unanswered (its control thread is behind, P is slow or gone): beyond this no new
# one is queued for it (each waits handshake_timeout_s; a queue growing every heartbeat_s would never drain).
_HB_PENDING = 64
#: P starts remembered as having delivered a load here (their loads no longer get ``peer_setup_s``); the
#: oldest are forgotten first (one entry per real P start that delivered: a proxy cannot grow it).
_PROVEN_CAP = 4096


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
        self.auth = auth
        self.clock = clock
        self._local_encoded = local_encoded
        self.producers = Peers(engine_id, settings, auth, self.origin, local_payloads, clock, check_peer,
                               self._notifying, self._restarted)
        self.loads: dict[str, Loading] = {}
        self._regs = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsa-register")
        self._last_hb = 0.0
        self._heartbeats: list[tuple[str, list[ReqRef], Future]] = []  # (engine, refs, reply) in flight
        self._taken: OrderedDict[tuple[str, str], str] = OrderedDict()  # (P engine, P request) -> D request
        self._cancels = PendingCancels(self._send_cancel, engine_id)  # cancels P has not answered yet
        self._proven: dict[str, int] = {}  # P engine -> its start that delivered a load here (see budget)
        self.heartbeats_refused = 0  # heartbeats P answered with a refusal (each an error, logged)

    @property
    def peers(self) -> dict[str, Peer]:
        """The P engines this D knows, by engine id (:attr:`.peers.Peers.by_engine`)."""
        return self.producers.by_engine

    # ------------------------------------------------------------ peers

    def _notifying(self, fut: Future) -> Future:
        """``fut``, calling ``on_reply`` once it is done (the engine's idle pause ends: its next step reads it)."""
        if self._on_reply is not None:
            on_reply = self._on_reply
            fut.add_done_callback(lambda _f: on_reply())
        return fut

    def peer(self, engine: str, host: str, port: int, waiting_since: float | None = None, epoch: int = 0) -> Peer:
        """The peer, its handshake started, retried or redone as :meth:`.peers.Peers.peer` says."""
        return self.producers.peer(engine, host, port, waiting_since, epoch)

    def forget_idle(self) -> list[str]:
        """Forget the peers no load has used for ``peer_idle_s`` (no handshake, heartbeat, cancel or load in
        flight): their control thread stops once its queued cancels went out, and the returned engines are
        the ones the workers must drop (their plan). A later request to such an engine handshakes again;
        without this every P ever seen (each restart is a new engine) would keep a thread and its state."""
        busy = ({load.engine for load in self.loads.values()} | {engine for engine, _, _ in self._heartbeats}
                | self._cancels.engines())
        return self.producers.forget_idle(busy)

    def patient(self, waiting_since: float | None) -> bool:
        """Whether a request queued at ``waiting_since`` may still wait for a handshake to be retried."""
        return self.producers.patient(waiting_since)

    def waits_for(self, peer: Peer, waiting_since: float) -> bool:
        """Whether a request queued at ``waiting_since`` should ask again later: the handshake is in flight,
        or it went unanswered and will be retried inside the request's transfer budget."""
        return self.producers.waits_for(peer, waiting_since)

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

    # ------------------------------------------------------------ requests

    def taken_by(self, req_id: str, rp: RemoteParams) -> str | None:
        """The other D request that already loads (or loaded) the P request ``rp`` names, else ``None``.

        One P request feeds one D request: vLLM forks a request with ``n > 1`` into children that share its
        ``kv_transfer_params``, and a completion with a prompt list hands the first prompt's params to all
        of them. The first D request to come takes the KV; the caller computes the others itself."""
        other = self._taken.get((rp.remote_engine_id, rp.remote_request_id))
        return other if other is not None and other != req_id else None

    def claimed(self, rp: RemoteParams) -> bool:
        """Whether any D request (this one included) queued a load of the P request ``rp`` names: it then
        owns the lease's end (a finished load's lease ended on P; a given-up one was cancelled)."""
        return (rp.remote_engine_id, rp.remote_request_id) in self._taken

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
                 held_slots: Held, *, prompt_tokens: int = 0, prompt_digest: str = "") -> RecvJob:
        """Blocks are allocated and paired (``core.plan.peer_plan.BlockPairing``: tokens ``[first_token, +num_tokens)``
        in P's ``src_blocks`` and D's ``dst_blocks``): send the registration; the returned job goes to the
        workers. ``prompt_tokens``/``prompt_digest`` (D's prompt) let P refuse a registration for another
        prompt (required by an early registration, whose P has not said how many tokens it holds)."""
        assert peer.meta is not None
        now = self.clock()
        load = self.loads.setdefault(req_id, Loading(rp.remote_engine_id, rp.ref, req_id=req_id))
        load.epoch = load.epoch or peer.meta.epoch
        load.to(LoadState.REGISTERING)
        load.give_up_at = now + self.budget(rp.remote_engine_id, peer.meta.epoch)
        # no WRITE of this registration lands after it
        load.release_at = load.give_up_at + write_bound_s(peer.meta.write_timeout_s, self.settings.transfer_timeout_s)
        load.slots = held_slots
        # P posts at most its horizon (its write timeout + a margin) after the registration arrives and keeps the
        # tombstone of a cancel that long: a deadline inside it keeps a delayed copy refused after a cancel
        post_by = min(load.give_up_at, now + peer.meta.write_timeout_s + POST_DEADLINE_MARGIN_S) \
            if peer.meta.write_timeout_s > 0 else load.give_up_at
        reg = RegReq(rp.remote_request_id, rp.remote_token, self.engine_id, req_id, first_token, num_tokens,
                     dst_blocks, peer.meta.clock.to_peer_before(post_by, now),
                     self.settings.verify_transfers, routes, prompt_tokens=prompt_tokens,
                     prompt_digest=prompt_digest)
        load.reg_body = reg
        load.reg = self._notifying(self._regs.submit(self._register, peer, reg))
        return RecvJob(req_id=req_id, src_engine=rp.remote_engine_id, blocks=dst_blocks, expected=peer.expected,
                       timeout_s=load.release_at - now + 60.0, verify=self.settings.verify_transfers,
                       src_blocks=src_blocks, routes=routes, first_token=first_token, num_tokens=num_tokens,
                       src_epoch=peer.meta.epoch, early=rp.early)

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

    def budget(self, engine: str, epoch: int) -> float:
        """Seconds a new registration with P ``engine``'s start ``epoch`` may wait for its KV:
        ``transfer_timeout_s``, plus ``peer_setup_s`` until that start delivered a load here (:meth:`loaded`):
        its first loads also wait for P's one-time set-up of this engine, which is not the transfer's."""
        proven = self._proven.get(engine) == epoch
        return self.settings.transfer_timeout_s + (0.0 if proven else self.settings.peer_setup_s)

    def loaded(self, load: Loading) -> None:
        """``load`` landed: its P start has set this engine up (its later loads get ``transfer_timeout_s``)."""
        self._proven.pop(load.engine, None)
        self._proven[load.engine] = load.epoch
        while len(self._proven) > _PROVEN_CAP:
            del self._proven[next(iter(self._proven))]

    def writes_over_at(self, load: Loading) -> float:
        """From when no WRITE of P can land in this load's blocks or staging slots
        (:meth:`.loads.Loading.writes_over_at`). The workers may report a load failed before the scheduler
        gave up on it (a writer's failure notice, a bad notice): its slots wait for this bound, never for less."""
        return load.writes_over_at()

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
        load.release_at = load.give_up_at + write_bound_s(write, self.settings.transfer_timeout_s)
        load.cancel = self.cancel(load.engine, [load.ref], load=load)

    def cancel(self, engine: str, refs: list[ReqRef], *, load: Loading | None = None) -> Future | None:
        """Tell P to drop these requests (on the peer's own control thread); the future holds P's reply to the
        first attempt. Left unanswered, it is sent again (:class:`.cancels.PendingCancels`) until ``lease_s``
        after this attempt; ``load`` (given up) then follows the latest attempt."""
        fut = self._send_cancel(engine, refs)
        if fut is not None:
            now = self.clock()
            self._cancels.add(engine, refs, fut, now, now + self.settings.lease_s, load)
        return fut

    def _send_cancel(self, engine: str, refs: list[ReqRef]) -> Future | None:
        peer = self.peers.get(engine)
        if peer is None or peer.control is None:
            return None
        return self._notifying(peer.control.submit(exchange, peer.host, peer.port, CancelReq(refs),
                                                   self.settings.handshake_timeout_s, self.auth, None, self.origin))

    def in_flight(self) -> bool:
        """Whether a load needs the engine's next steps (its workers report the outcome of a registered
        load, or a give-up hands blocks back), rather than waiting for the handshake or P's reply."""
        return any(load.state not in (LoadState.QUEUED, LoadState.REGISTERING)
                   for load in list(self.loads.values()))

    def giving_up(self) -> bool:
        """Whether a given-up load still waits for its workers to hand its blocks back."""
        return any(load.state in (LoadState.GIVING_UP, LoadState.FAILED) for load in list(self.loads.values()))

    def cancelling(self) -> bool:
        """Whether a cancel awaits P's answer (it is sent again on the next steps while unanswered)."""
        return bool(self._cancels)

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
        return self.producers.get(engine)

    def finished(self, req_id: str) -> Loading | None:
        """The workers reported the request (loaded or failed): forget it."""
        return self.loads.pop(req_id, None)

    def step(self, fail: dict[str, str]) -> None:
        """Collect replies, apply timeouts and bounds; requests to hand back go into ``fail``."""
        now = self.clock()
        self._cancels.retry(now)
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
                self.producers.check_sender(load.engine, sender)
                if reply.ok:
                    load.to(LoadState.REGISTERED)
                    if (peer := self.peers.get(load.engine)) is not None:
                        peer.staging_full = reply.staging_full  # the next requests' routes (no bounce if full)
                else:  # P refused: it will never write this registration
                    logger.error("DSAConnector: P refused registration of %s: %s", req_id, reply.error)
                    self._fail(fail, req_id, load, f"P refused the registration: {reply.error}")
                    continue
            if load.state in (LoadState.REGISTERING, LoadState.REGISTERED) and now >= load.give_up_at:
                self.give_up(req_id, f"no KV after {self.settings.transfer_timeout_s:.1f} s")
            if load.state is LoadState.GIVING_UP:
                if load.cancel_confirmed():
                    self._fail(fail, req_id, load, load.reason + " (P confirmed nothing was written)")
                elif now >= load.release_at:
                    self._fail(fail, req_id, load, load.reason + " (write bound passed)")
        self._heartbeat(now)

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
            self.producers.check_sender(engine, sender)
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
        self._regs.shutdown(wait=False, cancel_futures=True)
        self.producers.shutdown()
