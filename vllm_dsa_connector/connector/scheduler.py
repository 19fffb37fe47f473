"""Scheduler side of DSAConnector: vLLM's scheduler calls mapped onto the core's roles,
:mod:`vllm_dsa_connector.core.handoff.producer` (P) and :mod:`vllm_dsa_connector.core.handoff.consumer` (D).

Flow of one request (push; see :mod:`vllm_dsa_connector.connector.connector` for why push):

1. The proxy sends the prompt to P with ``kv_transfer_params={"do_remote_decode": true}`` and
   ``max_tokens=1``. P prefills; :meth:`DSAConnectorScheduler.request_finished` keeps the blocks (a lease of
   ``kv_lease_duration`` s) and returns the ``kv_transfer_params`` the proxy forwards to D
   (``remote_engine_id``, ``remote_request_id``, ``remote_token``, ``remote_host``/``remote_port`` = P's side
   channel, ``remote_block_ids``, ``remote_num_tokens``).
2. D: :meth:`get_num_new_matched_tokens` answers "ask later" until the handshake with P (a background
   thread, page tables + NIXL metadata of every P worker) is done and validated; a refused or unreachable
   peer is a load failure like any other: D claims the tokens and fails the load, and vLLM's scheduler
   applies the top-level ``kv_load_failure_policy`` (recompute = prefill locally, fail = the request
   fails). The connector never reads the policy itself: under vLLM's MultiConnector a child's copy of it
   is not the one vLLM applies (:mod:`.compose`). ``kv_transfer_params`` D cannot use (another
   connector's, or malformed: missing keys, wrong types) are such a failure too, never a silent local
   prefill: counted (``vllm:dsa_kv_unusable_params_total{reason}``) and logged once per peer with what was
   received (:meth:`DSAConnectorScheduler._unusable_params`).
3. D: :meth:`update_state_after_alloc` pairs D's new blocks with P's blocks of the SAME token positions
   (``core.plan.peer_plan.pair_blocks_by_position``: D's own prefix-cache hits are skipped on P's side too; P's token
   count must match D's prompt; P's block size, from its page tables, may differ from D's), tells its
   workers which notices to expect and registers the token span with P.
4. P: the registration becomes a ``PushJob`` for P's workers on the next step (before its post deadline);
   they WRITE into D's blocks and report ``finished_sending``: P frees the blocks.
5. D's workers report ``finished_recving`` when every expected notice arrived. Give-ups (timeout, refusal,
   abort) are decided here, on the scheduler, and reach the workers as ``fail_recv`` only once no WRITE
   can land any more (the argument is in :mod:`vllm_dsa_connector.core.handoff.loads`).

Each engine start draws one epoch (``self.epoch``): every side-channel message and reply names it, the
``kv_transfer_params`` P hands out name it (``remote_epoch``), and the :class:`PeerInfo` this scheduler hands
its workers names the peer start it belongs to, handed again whenever that start changes (a restart with the
same engine id), so the workers replace their record and NIXL remote agents of it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_dsa_connector.connector.early import EarlyPrefills
from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
from vllm_dsa_connector.connector.options import ConnectorOptions
from vllm_dsa_connector.connector.pacing import IdlePacer
from vllm_dsa_connector.connector.record import GateEstimates, make_records
from vllm_dsa_connector.connector.stats import DSAKVConnectorStats, unusable_key
from vllm_dsa_connector.core.handoff.consumer import Consumer
from vllm_dsa_connector.core.handoff.fence_waits import FenceWaits
from vllm_dsa_connector.core.handoff.ids import prompt_digest
from vllm_dsa_connector.core.handoff.loads import LoadState
from vllm_dsa_connector.core.handoff.messages import (
    Authenticator,
    Origin,
    Reply,
    Request,
    new_epoch,
)
from vllm_dsa_connector.core.handoff.params import (
    DSA_CONNECTOR,
    RemoteParams,
    is_early_prefill,
    other_connector,
    params_summary,
    peer_key,
)
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.recompute import classify, missing_key, params_reason
from vllm_dsa_connector.core.handoff.routes import Held, RoutePlanner
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import SideChannelServer
from vllm_dsa_connector.core.handoff.wire import (
    TRANSFER_MODE,
    PeerInfo,
    RankPayload,
    RecvJob,
    Routes,
    decode_payload,
)
from vllm_dsa_connector.core.plan.pairing import PairingError, pair_blocks_by_position
from vllm_dsa_connector.core.worker.counters import RECORDS, failure_key, staging_full

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request as VllmRequest

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

#: (peer, reason) pairs whose unusable kv_transfer_params were logged, remembered at most this many (least
#: recently seen forgotten first): each peer is logged once, and engine ids that change with every P start
#: (vLLM's default) or a hostile proxy's made-up ids cannot grow the set without bound.
_UNUSABLE_LOGGED = 1024


def route_summary(routes: Routes) -> str:
    """``routes`` as one short text: ``"D0<-P0:bounce,D1<-P0:ipc"`` (pairs it does not name go direct)."""
    pairs = [f"D{d}<-P{p}:{r.path}" for d, by_src in sorted(routes.items()) for p, r in sorted(by_src.items())]
    return ",".join(pairs[:16]) or "direct"


def handoff_settings(options: ConnectorOptions) -> HandoffSettings:
    """The core's settings from the connector's options."""
    return HandoffSettings(lease_s=options.kv_lease_duration, transfer_timeout_s=options.transfer_timeout_s,
                           handshake_timeout_s=options.handshake_timeout_s, heartbeat_s=options.heartbeat_s,
                           verify_transfers=options.verify_transfers, peer_idle_s=options.peer_idle_s,
                           early_held_per_peer=options.early_held_per_peer,
                           early_held_bytes_per_peer=options.early_held_bytes_per_peer,
                           peer_setup_s=options.peer_setup_timeout_s)


class DSAConnectorScheduler:
    """Scheduler-side state of one engine (both roles: an engine may produce and consume)."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, options: ConnectorOptions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.engine_id = engine_id
        self.opts = options
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.clock = clock
        self.epoch = new_epoch()  # this engine start's instance id (named in every message it sends)
        self.auth = Authenticator(options.auth_secret or None)
        self._local_payloads: list[bytes] = []
        self._local_sent = False
        settings = handoff_settings(options)
        self.pacer = IdlePacer()
        self.producer = Producer(engine_id, settings, clock, block_size=self.block_size, epoch=self.epoch)
        self.consumer = Consumer(engine_id, settings, self.auth, lambda: self.local_payloads,
                                 lambda: list(self._local_payloads), clock, on_reply=self.pacer.wake, epoch=self.epoch)
        self.server = SideChannelServer(options.side_channel_host, options.side_channel_port, self._handle,
                                        self.auth, clock, origin=Origin(engine_id, self.epoch),
                                        allow_unauthenticated=options.allow_unauthenticated_side_channel)
        logger.info("DSAConnector %s: side channel on %s:%d (role %s%s; epoch %016x)", engine_id, self.server.host,
                    self.server.port, kvc.kv_role, ", authenticated" if self.auth.secret else "", self.epoch)
        self._pending_recv: list[RecvJob] = []
        self._fail: dict[str, str] = {}
        self._fail_quiet: set[str] = set()  # of _fail: already logged (unusable params, once per peer)
        self.fence_waits = FenceWaits()  # given-up loads whose workers wait for P's fence (moot once P is gone)
        self._unusable: dict[str, str] = {}  # D req claimed with unusable kv_transfer_params -> why (until alloc)
        self._unusable_logged: OrderedDict[tuple[str, str], None] = OrderedDict()  # (peer, reason) logged
        self.stats = DSAKVConnectorStats()  # what only the scheduler sees (unusable params, P's refusals)
        self._refused_seen = 0  # the producer's refused identities counted into stats so far
        self._held_seen = 0  # the held early registrations last reported
        self._sources_sent: dict[str, int] = {}  # P engine id -> the epoch whose PeerInfo the workers have
        self._new_sources: list[PeerInfo] = []
        self.routes = RoutePlanner(options.bounce, lambda: self.local_payloads, ipc=options.ipc_mode != "never")
        self.early = EarlyPrefills(self.producer, options.layer_push)  # P: prefills D may register first
        self._fail_reason: dict[str, str] = {}  # of _fail: the reason when known where it was decided
        # per-request records (None: off, nothing built per request; connector.record)
        self.records = make_records(options.request_records, vllm_config.observability_config.otlp_traces_endpoint,
                                    engine_id, kvc.kv_role)
        self._estimates: GateEstimates | None = None  # the gate's estimates for the records (built on first use)

    # ---------------------------------------------------------------- handshake data

    def set_local_payloads(self, payloads: list[bytes]) -> None:
        """Every worker's encoded :class:`RankPayload` (from vLLM's handshake collection)."""
        self._local_payloads = sorted(payloads, key=lambda p: decode_payload(p).rank)

    @property
    def local_payloads(self) -> list[RankPayload]:
        """Decoded local payloads."""
        return [decode_payload(p) for p in self._local_payloads]

    # ---------------------------------------------------------------- side channel (its own thread)

    def _handle(self, req: Request, sender: Origin) -> Reply:
        try:
            return self.producer.handle(req, self._local_payloads, sender)
        finally:
            self.pacer.wake()  # a registration or cancel is handled by the next step

    # ---------------------------------------------------------------- D side

    def get_num_new_matched_tokens(self, request: VllmRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """D: all remaining prompt tokens come from P (once the handshake is done); None = ask again later."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if self.records is not None and request.request_id not in self.records:
            self.records.open(request.request_id, "load", request.trace_headers, d_engine=self.engine_id,
                              p_engine=str(params.get("remote_engine_id"))[:128],
                              p_request_id=str(params.get("remote_request_id"))[:128],
                              prompt_tokens=len(request.prompt_token_ids or ()))
        if request.request_id in self._unusable:  # asked again (no blocks for it last step): counted once
            return self._claim(request, num_computed_tokens)
        if problem := other_connector(params):
            return self._unusable_params(request, num_computed_tokens, "other_connector", problem)
        try:
            rp = RemoteParams.from_dict(params)
        except ValueError as e:
            return self._unusable_params(request, num_computed_tokens, "malformed",
                                         str(e).removeprefix("malformed kv_transfer_params: "))
        if (other := self.consumer.taken_by(request.request_id, rp)) is not None:
            logger.warning("DSAConnector: request %s names P request %s of %s, which D request %s already takes "
                           "(n > 1, or a prompt list sent as one request); computing it locally",
                           request.request_id, rp.remote_request_id, rp.remote_engine_id, other)
            params["do_remote_prefill"] = False
            self._local_prefill(request.request_id, "already_taken", f"D request {other} already loads it")
            return 0, False
        since = self.consumer.queue(request.request_id, rp)
        peer = self.consumer.peer(rp.remote_engine_id, rp.remote_host, rp.remote_port, waiting_since=since,
                                  epoch=rp.remote_epoch)
        if self.consumer.waits_for(peer, since) and not self.consumer.load_error(request.request_id):
            return None, False
        # P refused a heartbeat for it, or the lease is another start's of P (restarted): the load fails
        self.consumer.epoch_error(request.request_id, rp, peer)
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            params["do_remote_prefill"] = False
            self.consumer.give_up(request.request_id, "not loading from P")
            if self.records is not None:
                self.records.close(request.request_id, "local", "", "D had every prompt token cached")
            return 0, False
        # A refused/unreachable peer or heartbeat too: claimed here, failed at allocation (update_state_after_alloc),
        # so vLLM applies its (top-level) kv_load_failure_policy, the one place the policy is read.
        return count, True

    def _unusable_params(self, request: VllmRequest, num_computed_tokens: int, reason: str,
                         problem: str) -> tuple[int, bool]:
        """D cannot load from this request's ``kv_transfer_params`` (``reason``: ``other_connector`` or
        ``malformed``, see :data:`~.stats.UNUSABLE_REASONS`). Like every load D cannot do, the tokens are
        claimed here and the load fails at allocation, so vLLM's ``kv_load_failure_policy`` decides
        (recompute: D prefills; fail: the request fails): prefilling locally without a word would hide a
        misrouted or broken proxy behind slow, P-less prefills. Counted per request
        (``vllm:dsa_kv_unusable_params_total{reason}``); logged once per peer (:func:`peer_key`) and reason,
        with what was received (:func:`params_summary`)."""
        params = request.kv_transfer_params
        assert params is not None
        why = f"kv_transfer_params D cannot use ({reason}): {problem}"
        self.stats.add(unusable_key(reason))
        key = (peer_key(params), reason)
        if key in self._unusable_logged:
            self._unusable_logged.move_to_end(key)
            logger.debug("DSAConnector: request %s: %s", request.request_id, why)
        else:
            self._unusable_logged[key] = None
            while len(self._unusable_logged) > _UNUSABLE_LOGGED:
                self._unusable_logged.popitem(last=False)
            logger.error("DSAConnector: request %s: %s; received from peer %s: %s. Every such request's load fails "
                         "(vLLM's kv_load_failure_policy decides: recompute = D prefills it, fail = the request "
                         "fails), counted in vllm:dsa_kv_unusable_params_total{reason=%r}; not logged again for "
                         "this peer and reason", request.request_id, why, key[0], params_summary(params), reason)
        self._unusable[request.request_id] = why
        self._fail_reason[request.request_id] = params_reason(reason, problem)
        if self.records is not None and (key_missing := missing_key(problem)):
            self.records.set(request.request_id, missing_key=key_missing)
        return self._claim(request, num_computed_tokens)

    def _local_prefill(self, req_id: str, reason: str, why: str) -> None:
        """D prefills ``req_id`` locally at once (no load failure): counted and logged by ``reason``."""
        self.stats.add(failure_key(reason))
        logger.info("DSAConnector: request %s not loaded from P (reason %s: %s); D prefills it; fix: vllm-dsa "
                    "explain %s", req_id, reason, why, reason)
        if self.records is not None:
            self.records.close(req_id, "local_prefill", reason, why)

    def _claim(self, request: VllmRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Claim the prompt tokens D has not computed of a request whose load will fail at allocation
        (:meth:`update_state_after_alloc`); nothing to claim means nothing to fail (``(0, False)``)."""
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count > 0:
            return count, True
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False
        self._unusable.pop(request.request_id, None)
        self._fail_reason.pop(request.request_id, None)
        if self.records is not None:
            self.records.close(request.request_id, "local", "", "D had every prompt token cached")
        return 0, False

    def update_state_after_alloc(self, request: VllmRequest, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """D: pair blocks by position, expect the transfer and register our blocks with P. P: a prefill whose
        ``kv_transfer_params`` carry the proxy's ``transfer_id`` opens its early lease (D may register first)."""
        params = request.kv_transfer_params
        if is_early_prefill(params):
            self.early.open(request, blocks)
            return
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once
        req_id = request.request_id
        if (why := self._unusable.pop(req_id, None)) is not None:
            if num_external_tokens > 0:  # else vLLM loads nothing (and waits for nothing): nothing to fail
                logger.debug("DSAConnector: request %s: %s; failing the load (vLLM applies "
                             "kv_load_failure_policy)", req_id, why)
                self._fail[req_id] = why
                self._fail_quiet.add(req_id)
            else:
                self._fail_reason.pop(req_id, None)
            return
        load = self.consumer.load(req_id)
        if load is None:
            return
        peer = self.consumer.known_peer(load.engine)
        if num_external_tokens <= 0 or peer is None:
            self.consumer.give_up(req_id, "no external tokens")
            return
        self.consumer.forget_queued(req_id)
        if self.records is not None:
            self.records.phase(req_id, "handshake_done")
        if peer.error or load.error or peer.meta is None:
            why = peer.error or load.error or f"the handshake with P {load.engine} is being redone (P restarted?)"
            logger.warning("DSAConnector: request %s: %s; failing the load (vLLM applies "
                           "kv_load_failure_policy)", req_id, why)
            self._fail[req_id] = why
            self.consumer.cancel(load.engine, [load.ref])
            return
        rp = RemoteParams.from_dict(params)
        try:
            prompt_tokens = len(request.prompt_token_ids or ())
            src_block_size = peer.plan.src_block_size if peer.plan is not None else self.block_size
            remote_blocks, remote_tokens = rp.remote_block_ids, rp.remote_num_tokens
            if rp.early:
                # P has not said which blocks hold the prompt (it is still prefilling): P takes its own blocks of
                # the span; these stand in for them (the planner sizes bounce slots by bytes, not block ids)
                remote_tokens = prompt_tokens
                remote_blocks = list(range(min(-(-prompt_tokens // src_block_size), peer.max_block)))
            if any(b >= peer.max_block for b in remote_blocks):
                raise PairingError(f"remote_block_ids outside P's pools (0..{peer.max_block - 1})")
            # vLLM updates request.num_computed_tokens after this call: D's local hits are the rest
            pairing = pair_blocks_by_position(
                src_block_size=src_block_size,
                dst_block_size=self.block_size, prompt_tokens=prompt_tokens,
                local_computed_tokens=prompt_tokens - num_external_tokens,
                local_new_blocks=list(blocks.get_unhashed_block_ids_all_groups()[0]),
                remote_block_ids=remote_blocks, remote_num_tokens=remote_tokens)
        except PairingError as e:
            logger.error("DSAConnector: request %s: cannot pair blocks with P's: %s", req_id, e)
            self._fail[req_id] = f"block pairing: {e}"
            self.consumer.cancel(load.engine, [load.ref])
            return
        src, dst = list(pairing.src_blocks), list(pairing.dst_blocks)
        routes: Routes = {}
        held: Held = []
        if peer.meta is not None and peer.plan is not None:
            try:
                # an early registration's src blocks stand in for P's: D could not scatter a bounce by them
                routes, held = self.routes.plan(peer.plan, peer.meta.payloads, src, dst,
                                              first_token=pairing.first_token, num_tokens=pairing.num_tokens,
                                              bounce=not rp.early and not peer.staging_full)
            except Exception as e:  # noqa: BLE001 - no route means a direct WRITE, never a failure
                logger.warning("DSAConnector: no routes planned for %s (every pair direct): %s", req_id, e)
        epoch = peer.meta.epoch if peer.meta is not None else 0
        if self._sources_sent.get(load.engine) != epoch:  # new to the workers, or a new start of that P
            self._sources_sent[load.engine] = epoch
            self._new_sources.append(PeerInfo(load.engine, list(peer.payloads), as_source=True, epoch=epoch))
        self._pending_recv.append(self.consumer.register(
            req_id, rp, peer, pairing.first_token, pairing.num_tokens, src, dst, routes, held,
            prompt_tokens=prompt_tokens, prompt_digest=prompt_digest(request.prompt_token_ids)))
        if self.records is not None:
            self.records.phase(req_id, "registered")
            self.records.set(req_id, blocks=len(dst), tokens=pairing.num_tokens, routes=route_summary(routes),
                             route_why=("early registration: direct" if rp.early else
                                        "P's staging full: direct" if peer.staging_full else
                                        f"bounce_mode {self.opts.bounce.mode}" if self.opts.bounce is not None
                                        else "bounce off: direct"))
            if self.opts.bounce is not None and peer.plan is not None:
                try:
                    if self._estimates is None:
                        local = self.local_payloads
                        self._estimates = GateEstimates(self.opts.bounce, local[0].page_table.pools[0].device
                                                        if local else "cpu")
                    self.records.set(req_id, gate=self._estimates.of(
                        peer.plan, [p.rank for p in peer.meta.payloads], [p.rank for p in self.local_payloads], src, dst,
                        first_token=pairing.first_token, num_tokens=pairing.num_tokens))
                except Exception as e:  # noqa: BLE001 - a record never fails a load
                    self.records.set(req_id, gate=f"no estimate: {e}"[:200])

    # ---------------------------------------------------------------- P side and aborts

    def request_finished(self, request: VllmRequest, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks under a lease and hand out the kv_transfer_params for D. D: an aborted load
        keeps its blocks until no WRITE can land in them (reported later as finished_recving); a request that
        never queued its load cancels P's lease (:meth:`_cancel_unqueued`)."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        unusable = self._unusable.pop(request.request_id, None)  # claimed, never allocated: nothing was loading
        if unusable is not None:
            self._fail_reason.pop(request.request_id, None)
        if self.records is not None and (params or {}).get("do_remote_prefill") is not None:
            # D: a record still open now is a request that finished before its load did (aborted)
            self.records.close(request.request_id, "aborted", "", "the request finished before its load")
        if not params:
            return False, None
        load = self.consumer.load(request.request_id)
        if load is not None:
            if load.state is LoadState.QUEUED:
                self.consumer.give_up(request.request_id, "aborted while queued")
                return False, None
            self.consumer.give_up(request.request_id, "aborted")
            return True, None
        if params.get("do_remote_prefill"):
            if unusable is None:
                self._cancel_unqueued(request)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        blocks = list(block_ids[0]) if block_ids else []
        if request.request_id in self.early:
            keep = self.early.finished(request, blocks, ok)
            if not keep or not ok:
                return keep, None
            lease = self.producer.lease(request.request_id)
            return True, self._params_out(request, blocks, lease.token if lease is not None else "")
        if not ok:
            return False, None
        if not blocks:
            return False, None
        token = self.producer.add_lease(request.request_id, blocks, prompt_tokens=request.num_prompt_tokens,
                                        digest=prompt_digest(request.prompt_token_ids))
        if self.records is not None:
            self.records.open(request.request_id, "send", request.trace_headers, p_engine=self.engine_id,
                              blocks=len(blocks), tokens=request.num_computed_tokens)
        return True, self._params_out(request, blocks, token)

    def _cancel_unqueued(self, request: VllmRequest) -> None:
        """D: a request that names P's KV finished before vLLM ever asked the connector for it (aborted while
        it waited to be scheduled, so no load was queued): tell P to drop the lease now rather than keep it
        for ``kv_lease_duration`` (an early registration's: for that long after P's prefill). Only to a P
        D holds a record of (a cancel needs no handshake), and never for a lease a D request loads or loaded
        (this one after a finished load, or n > 1 siblings sharing the params)."""
        params = request.kv_transfer_params
        assert params is not None
        if other_connector(params):
            return
        try:
            rp = RemoteParams.from_dict(params)
        except ValueError:
            return
        if not self.consumer.claimed(rp):
            self.consumer.cancel(rp.remote_engine_id, [rp.ref])

    def _params_out(self, request: VllmRequest, blocks: list[int], token: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` P hands out for D (after an early registration they only tell the
        proxy where P's side channel is now)."""
        return RemoteParams(
            remote_engine_id=self.engine_id, remote_request_id=request.request_id, remote_host=self.server.host,
            remote_port=self.server.port, remote_block_ids=blocks, remote_num_tokens=request.num_computed_tokens,
            remote_token=token, transfer_mode=TRANSFER_MODE, remote_epoch=self.epoch, tp_size=self.tp_size,
            pp_size=self.pp_size, kv_connector=DSA_CONNECTOR).to_dict()

    # ---------------------------------------------------------------- every step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DSAConnectorMetadata:
        """Package this step's work for the workers."""
        meta = DSAConnectorMetadata()
        if not self._local_sent and self._local_payloads:
            meta.local = PeerInfo(self.engine_id, list(self._local_payloads))
            self._local_sent = True
        meta.peers.extend(self._new_sources)
        self._new_sources = []
        meta.recv, self._pending_recv = self._pending_recv, []
        self.consumer.step(self._fail)
        for req_id, why in self._fail.items():
            self._failed_load(req_id, why)
        meta.fail_recv, self._fail = self._fail, {}
        meta.fail_unposted = {r for r in meta.fail_recv if (load := self.consumer.load(r)) is not None
                              and (load.release_at == 0.0 or load.cancel_confirmed())}
        for req_id in meta.fail_recv.keys() - meta.fail_unposted:  # the workers wait for P's fence
            if (load := self.consumer.load(req_id)) is not None and (
                    peer := self.consumer.known_peer(load.engine)) is not None:
                self.fence_waits.add(req_id, load.engine, peer.host, peer.port, load.epoch)
        if len(self.fence_waits):
            meta.fence_void = self.fence_waits.step(self._epoch_of)
        meta.fail_quiet, self._fail_quiet = self._fail_quiet & meta.fail_recv.keys(), set()
        self.routes.step(self.clock())
        if self.early:
            self.early.track(scheduler_output, meta)
        for engine in self.consumer.forget_idle():
            if self._sources_sent.pop(engine, None) is not None:  # the workers know its plan: they drop it
                meta.forget_sources.append(engine)
        dispatch = self.producer.step()
        meta.forget.extend(dispatch.forget)
        meta.peers.extend(dispatch.peers)
        meta.push.extend(dispatch.push)
        meta.release.extend(dispatch.release)
        if self.records is not None:
            for job in dispatch.push:
                self.records.phase(job.req_id, "dispatched")
                self.records.set(job.req_id, d_engine=job.dst_engine, d_request_id=job.dst_req_id,
                                 routes=route_summary(job.routes), layered=job.layered,
                                 **({"refused": job.error[:200]} if job.error else {}))
            for req_id in dispatch.release:  # a lease released unsent (expired, cancelled)
                self.records.close(req_id, "released", "", "P released the lease without a finished send")
        if (meta.is_empty() and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
                and (self.producer.pending() or self.consumer.pending())):
            # Only waiting on the peer: vLLM steps in a tight loop (has_pending_push_work, requests waiting
            # for remote KV); pause, longer while nothing needs the workers (see connector.pacing).
            self.pacer.pause(urgent=self.producer.in_flight() or self.consumer.in_flight())
        else:
            self.pacer.busy()
        return meta

    def _failed_load(self, req_id: str, why: str) -> None:
        """A load this scheduler fails (``fail_recv``): counted by reason once, logged, its record closed; an
        aborted request's (the client went away: nothing recomputes) is none of that."""
        reason = self._fail_reason.pop(req_id, None)
        if reason is None and why.startswith("aborted"):
            return
        reason = reason or classify(why)
        self.stats.add(failure_key(reason))
        logger.info("DSAConnector: request %s not loaded from P (reason %s: %s); kv_load_failure_policy "
                    "applies; fix: vllm-dsa explain %s", req_id, reason, why[:300], reason)
        if self.records is not None:
            self.records.close(req_id, "failed", reason, why)

    def _epoch_of(self, engine: str) -> int | None:
        """The start of P ``engine`` D knows now (None: not known)."""
        peer = self.consumer.known_peer(engine)
        return peer.meta.epoch if peer is not None and peer.meta is not None else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Forget finished transfers (P: leases; D: loads and their staging slots: a failed load's slots
        come back once no WRITE can land in them, :meth:`Consumer.writes_over_at`)."""
        stats = output.kv_connector_stats
        entries = stats.data.pop(RECORDS, None) if stats is not None else None
        if entries and self.records is not None:
            self.records.workers(entries)
        sending = set(output.finished_sending or ())
        if self.early:
            # an early prefill's workers may be done before vLLM finished the request (it frees the blocks of
            # finished_sending at once): such reports wait until request_finished kept the blocks
            sending = self.early.hold_back(sending)
            output.finished_sending = sending
        if sending:
            self.producer.finished_sending(sending)
            if self.records is not None:
                for req_id in sending:
                    self.records.phase(req_id, "completed")
                    self.records.close(req_id, *self._send_outcome(entries, req_id))
        if output.kv_connector_stats is not None:  # the workers' staging arenas (P)
            full = staging_full(output.kv_connector_stats.data)
            if full is not None:
                self.producer.staging_full = full
        failed = getattr(output, "failed_recving", None) or set()
        for req_id in output.finished_recving or ():
            self.fence_waits.done(req_id)
            load = self.consumer.finished(req_id)
            if load is not None and req_id not in failed:
                self.consumer.loaded(load)
            if self.records is not None:
                self.records.phase(req_id, "notice")
                self.records.close(req_id, *self._load_outcome(entries, req_id, req_id in failed))
            if load is not None:
                self.routes.free(load.slots, failed=req_id in failed, safe_at=self.consumer.writes_over_at(load))

    @staticmethod
    def _send_outcome(entries: list[dict[str, Any]] | None, req_id: str) -> tuple[str, str, str]:
        """P: (outcome, reason, detail) of a finished send from its workers' facts."""
        bad = [e for e in entries or () if e.get("req") == req_id and (e.get("outcome") == "failed"
                                                                       or e.get("state") == "failed")]
        if bad:
            return "failed", "", "; ".join(str(e.get("error", "")) for e in bad if e.get("error"))
        return "ok", "", ""

    @staticmethod
    def _load_outcome(entries: list[dict[str, Any]] | None, req_id: str, failed: bool) -> tuple[str, str, str]:
        """D: (outcome, reason, detail) of a load its workers reported finished."""
        if not failed:
            return "ok", "", ""
        for e in entries or ():
            if e.get("req") == req_id and e.get("reason"):
                return "failed", str(e["reason"]), str(e.get("detail", ""))
        return "failed", "other", "reported failed by D's workers"

    def get_stats(self) -> DSAKVConnectorStats | None:
        """The scheduler's stats since the last call (vLLM's scheduler aggregates them with the workers'),
        or None when nothing happened."""
        refused = self.producer.refused_identities
        if refused != self._refused_seen:
            self.stats.add("refused_identities", refused - self._refused_seen)
            self._refused_seen = refused
        held = self.producer.held()
        if held != self._held_seen:  # a gauge: a sample when it changed
            self.stats.observe("early_held", held)
            self._held_seen = held
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def has_pending_push_work(self) -> bool:
        """P keeps stepping while it holds leased blocks (their release needs steps); D while it waits to
        hand back blocks of a give-up. An unanswered cancel is sent again on the steps D takes anyway: stepping
        for it alone would progress D's agent after the write bound, and apply bytes a dead link's TCP socket
        still delivers late (tests/test_two_hosts.py: a WRITE landed in blocks D had given back)."""
        return self.producer.pending() or self.consumer.giving_up()

    def shutdown(self) -> None:
        """Stop the side channel and the background threads."""
        self.server.close()
        self.consumer.shutdown()
        self.fence_waits.shutdown()
