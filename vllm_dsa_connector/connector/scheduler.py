"""Scheduler side of DSAConnector: leases on P, registrations/heartbeats/timeouts on D.

Flow of one request (push; see :mod:`vllm_dsa_connector.connector.connector` for why push):

1. The proxy sends the prompt to P with ``kv_transfer_params={"do_remote_decode": true}`` and
   ``max_tokens=1``. P prefills; :meth:`DSAConnectorScheduler.request_finished` keeps the blocks (a lease of
   ``kv_lease_duration`` s) and returns the ``kv_transfer_params`` the proxy forwards to D
   (``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port`` = P's side channel, ...).
2. D: :meth:`get_num_new_matched_tokens` answers "ask later" until the handshake with P (a background
   thread, page tables + NIXL metadata of every P worker) is done and validated; a refused peer is a load
   failure (``kv_load_failure_policy``: recompute = prefill locally, fail = the request fails).
3. D: :meth:`update_state_after_alloc` tells its workers which notices to expect (``RecvJob``) and sends
   the registration (its block ids) to P's side channel; P answers at once whether it still holds the KV.
4. P: the registration becomes a ``PushJob`` for P's workers on the next step; they WRITE into D's
   blocks with a completion notice per (source rank, destination rank) and report ``finished_sending``
   when the WRITE completed (or failed): P frees the blocks. A lease that ends without a registration
   (expiry without heartbeats, D's cancel) is released the same way.
5. D's workers report ``finished_recving`` when every expected notice arrived, or
   ``finished_recving`` + ``failed_recving`` on a failed notice or after ``transfer_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_dsa_connector.connector.handshake import (
    HandshakeError,
    SideChannelServer,
    fetch_payloads,
    request,
    validate_peer,
)
from vllm_dsa_connector.connector.metadata import (
    TRANSFER_MODE,
    DSAConnectorMetadata,
    PeerInfo,
    PushJob,
    RankPayload,
    RecvJob,
    Slots,
    decode_payload,
    encode,
)
from vllm_dsa_connector.connector.options import ConnectorOptions

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

_RETRY_UNREACHABLE_S = 5.0
_IDLE_SLEEP_S = 0.001


def plan_slots(plan: Any, src: list[RankPayload], dst: list[RankPayload], src_blocks: list[int],
               dst_blocks: list[int], gate: Any, arenas: dict[int, Any]) -> tuple[Slots, list[tuple[int, Any]]]:
    """Staging slots for one request: per (destination rank, source rank) pair the gate wants bounced.

    ``arenas`` maps a destination rank to an allocator over its staging arena (a ``StagingArena`` on a
    ``meta`` buffer: bookkeeping only, the bytes live in D's worker). Returns the slots and the
    reservations to free once the transfer is over. A pair gets no slot (= direct WRITE) when its runs do
    not fit one write, the gate prefers direct, or the arena has no room right now.
    """
    from vllm_dsa_connector.connector.worker import pair_runs

    slots: Slots = {}
    held: list[tuple[int, Any]] = []
    for d in dst:
        arena = arenas.get(d.rank)
        if arena is None or d.staging is None:
            continue
        for s in src:
            parts = pair_runs(plan, s, d, src_blocks, dst_blocks)
            if len(parts) != 1 or parts[0][2].total_bytes == 0 or gate.decide(parts[0][2], merged=True) != "bounce":
                continue
            res = arena.reserve(parts[0][2].total_bytes, 0.0)
            if res is None:
                continue
            slots.setdefault(d.rank, {})[s.rank] = [res.offset, parts[0][2].total_bytes]
            held.append((d.rank, res))
    return slots, held


@dataclass
class _Lease:
    blocks: list[int]
    deadline: float
    registered: bool = False
    dispatched: bool = False
    released: bool = False
    cancelled: bool = False


@dataclass
class _Peer:
    host: str
    port: int
    future: Future | None = None
    payloads: list[bytes] = field(default_factory=list)
    remote: list[RankPayload] = field(default_factory=list)
    plan: Any = None
    expected: dict[int, list[int]] = field(default_factory=dict)
    error: str | None = None
    failed_at: float = 0.0


@dataclass
class _Inflight:
    engine: str
    host: str
    port: int
    p_req: str


class DSAConnectorScheduler:
    """Scheduler-side state of one engine (both roles: an engine may produce and consume)."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, options: ConnectorOptions) -> None:
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.engine_id = engine_id
        self.opts = options
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.recompute = kvc.kv_load_failure_policy == "recompute"
        self._lock = threading.Lock()
        self.server = SideChannelServer(options.side_channel_host, options.side_channel_port, self._handle)
        logger.info(
            "DSAConnector %s: side channel on %s:%d (role %s)",
            engine_id, self.server.host, self.server.port, kvc.kv_role,
        )
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsa-sched")
        self._local_payloads: list[bytes] = []
        self._local_sent = False
        # P side
        self._leases: dict[str, _Lease] = {}
        self._regs: deque[dict[str, Any]] = deque()
        self._peer_payloads: dict[str, list[bytes]] = {}
        self._peers_sent: set[str] = set()
        # D side
        self._peers: dict[str, _Peer] = {}
        self._pending_recv: list[RecvJob] = []
        self._inflight: dict[str, _Inflight] = {}
        self._reg_futures: dict[str, Future] = {}
        self._fail: dict[str, str] = {}
        self._last_hb = 0.0
        self._sources_sent: set[str] = set()
        self._new_sources: list[PeerInfo] = []
        self._slot_res: dict[str, list[tuple[int, Any]]] = {}
        self._arenas: dict[int, Any] | None = None
        self._gate: Any = None

    # ---------------------------------------------------------------- handshake data

    def set_local_payloads(self, payloads: list[bytes]) -> None:
        """Every worker's encoded :class:`RankPayload` (from vLLM's handshake collection)."""
        self._local_payloads = sorted(payloads, key=lambda p: decode_payload(p).rank)

    @property
    def local_payloads(self) -> list[RankPayload]:
        """Decoded local payloads."""
        return [decode_payload(p) for p in self._local_payloads]

    # ---------------------------------------------------------------- side channel (its own thread)

    def _handle(self, kind: str, body: Any) -> dict[str, Any]:
        now = time.monotonic()
        if kind == "meta":
            if not self._local_payloads:
                return {"ok": False, "error": "workers have not registered their KV caches yet"}
            return {"ok": True, "payloads": self._local_payloads, "engine_id": self.engine_id}
        if kind == "reg":
            p_req = str(body["p_req"])
            with self._lock:
                lease = self._leases.get(p_req)
                if lease is None or lease.released:
                    return {"ok": False, "error": f"P holds no KV for request {p_req} "
                                                  "(lease expired, released or unknown)"}
                if lease.registered:
                    return {"ok": False, "error": f"request {p_req} was already registered"}
                lease.registered = True
                lease.deadline = now + self.opts.kv_lease_duration + self.opts.transfer_timeout_s
                d_engine = str(body["d_engine"])
                if d_engine not in self._peer_payloads and body.get("d_payloads"):
                    self._peer_payloads[d_engine] = list(body["d_payloads"])
                if d_engine not in self._peer_payloads:
                    lease.registered = False
                    return {"ok": False, "need_payloads": True, "error": "unknown decode engine"}
                self._regs.append(body)
            return {"ok": True}
        if kind == "hb":
            with self._lock:
                for r in body or ():
                    lease = self._leases.get(str(r))
                    if lease is not None and not lease.registered:
                        lease.deadline = max(lease.deadline, now + self.opts.kv_lease_duration)
            return {"ok": True}
        if kind == "cancel":
            with self._lock:
                for r in body or ():
                    lease = self._leases.get(str(r))
                    if lease is not None:
                        lease.cancelled = True
            return {"ok": True}
        return {"ok": False, "error": f"unknown request kind {kind!r}"}

    # ---------------------------------------------------------------- D side

    def _handshake(self, peer: _Peer) -> tuple[list[RankPayload], Any]:
        remote = fetch_payloads(peer.host, peer.port, self.opts.handshake_timeout_s)
        return remote, validate_peer(remote, self.local_payloads)

    def _peer(self, engine: str, host: str, port: int) -> _Peer:
        peer = self._peers.get(engine)
        now = time.monotonic()
        if peer is not None and peer.error and peer.failed_at and now - peer.failed_at > _RETRY_UNREACHABLE_S:
            peer = None  # unreachable before: try again
        if peer is None:
            peer = _Peer(host, port)
            peer.future = self._pool.submit(self._handshake, peer)
            self._peers[engine] = peer
        if peer.future is not None and peer.future.done():
            try:
                peer.remote, peer.plan = peer.future.result()
                peer.payloads = [encode(p) for p in peer.remote]
                peer.expected = {p.rank: list(peer.plan.senders_for(p.rank)) for p in self.local_payloads}
                logger.info("DSAConnector %s: handshake with %s done (%d workers, plan %s)",
                            self.engine_id, engine, len(peer.payloads), peer.expected)
            except HandshakeError as e:
                peer.error = str(e)
                # an unreachable peer may come back; a refused layout will not
                peer.failed_at = now if "did not answer" in str(e) or "failed:" in str(e) else 0.0
                logger.error("%s", e)
            except Exception as e:  # noqa: BLE001 - any handshake bug becomes a load failure, not a crash
                peer.error = f"DSAConnector handshake with {engine} failed: {e!r}"
                peer.failed_at = now
                logger.exception("DSAConnector handshake with %s failed", engine)
            peer.future = None
        return peer

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """D: all prompt tokens come from P (once the handshake is done); None = ask again later."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get("transfer_mode", TRANSFER_MODE) != TRANSFER_MODE:
            logger.warning("DSAConnector: request %s comes from a %r producer; computing locally",
                           request.request_id, params.get("transfer_mode"))
            return 0, False
        try:
            peer = self._peer(str(params["remote_engine_id"]), str(params["remote_host"]),
                              int(params["remote_port"]))
        except (KeyError, TypeError, ValueError) as e:
            logger.error("DSAConnector: request %s has malformed kv_transfer_params (%s); computing locally",
                         request.request_id, e)
            return 0, False
        if peer.future is not None:
            return None, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        if peer.error and self.recompute:
            logger.warning("DSAConnector: request %s: %s; recomputing locally (kv_load_failure_policy=recompute)",
                           request.request_id, peer.error)
            params["do_remote_prefill"] = False
            self._cancel_async(peer.host, peer.port, [str(params.get("remote_request_id"))])
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """D: expect the transfer and register our blocks with P."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once
        engine = str(params["remote_engine_id"])
        peer = self._peers.get(engine)
        p_req = str(params.get("remote_request_id"))
        if num_external_tokens <= 0 or peer is None:
            if peer is not None:
                self._cancel_async(peer.host, peer.port, [p_req])
            return
        req_id = request.request_id
        if peer.error:
            self._fail[req_id] = peer.error
            return
        n_blocks = -(-(num_external_tokens + request.num_computed_tokens) // self.block_size)
        ids = list(blocks.get_unhashed_block_ids_all_groups()[0])[:n_blocks]
        src_blocks = [int(b) for b in params.get("remote_block_ids") or []]
        n = min(len(ids), len(src_blocks)) if src_blocks else len(ids)
        ids, src_blocks = ids[:n], src_blocks[:n]
        slots: Slots = {}
        if src_blocks and self._bouncing():
            try:
                slots, held = plan_slots(peer.plan, peer.remote, self.local_payloads, src_blocks, ids,
                                         self._gate, self._arenas or {})
                self._slot_res[req_id] = held
            except Exception as e:  # noqa: BLE001 - no slot means a direct WRITE, never a failure
                logger.warning("DSAConnector: no staging slots for %s: %s", req_id, e)
        if engine not in self._sources_sent:
            self._sources_sent.add(engine)
            self._new_sources.append(PeerInfo(engine, list(peer.payloads), as_source=True))
        self._pending_recv.append(RecvJob(
            req_id=req_id, src_engine=engine, blocks=ids, expected=peer.expected,
            timeout_s=self.opts.transfer_timeout_s, verify=self.opts.verify_transfers,
            src_blocks=src_blocks, slots=slots))
        self._inflight[req_id] = _Inflight(engine, peer.host, peer.port, p_req)
        body = {"p_req": p_req, "d_engine": self.engine_id, "d_req": req_id, "d_blocks": ids,
                "verify": self.opts.verify_transfers, "slots": slots}
        self._reg_futures[req_id] = self._pool.submit(self._register, peer, body)

    def _bouncing(self) -> bool:
        """Whether D offers staging slots (the gate is not off and the workers have staging arenas)."""
        settings = self.opts.bounce
        if settings is None or settings.mode == "never":
            return False
        if self._arenas is None:
            import torch

            from vllm_dsa_connector.transport.bounce import StagingArena
            from vllm_dsa_connector.transport.gate import BounceGate

            local = self.local_payloads
            device = local[0].page_table["pools"][0].get("device", "cpu") if local else "cpu"
            self._gate = BounceGate(settings, device=device)
            self._arenas = {
                p.rank: StagingArena(0, buffer=torch.empty(int(p.staging["size"]), dtype=torch.uint8,
                                                           device="meta"))
                for p in local if p.staging
            }
        return bool(self._arenas)

    def _free_slots(self, req_id: str, failed: bool) -> None:
        for rank, res in self._slot_res.pop(req_id, ()):
            arena = (self._arenas or {}).get(rank)
            if arena is None:
                continue
            if failed:  # a late WRITE could still land there: never reuse it
                arena.quarantine(res)
            else:
                arena.release(res)

    def _register(self, peer: _Peer, body: dict[str, Any]) -> None:
        reply = request(peer.host, peer.port, "reg", body, self.opts.handshake_timeout_s)
        if not reply.get("ok") and reply.get("need_payloads"):
            reply = request(peer.host, peer.port, "reg", {**body, "d_payloads": self._local_payloads},
                            self.opts.handshake_timeout_s)
        if not reply.get("ok"):
            raise HandshakeError(f"P refused registration of {body['p_req']}: {reply.get('error')}")

    def _cancel_async(self, host: str, port: int, p_reqs: list[str]) -> None:
        def run() -> None:
            try:
                request(host, port, "cancel", p_reqs, self.opts.handshake_timeout_s)
            except HandshakeError as e:
                logger.debug("DSAConnector cancel: %s", e)

        self._pool.submit(run)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if not self._inflight or now - self._last_hb < self.opts.heartbeat_s:
            return
        self._last_hb = now
        by_engine: dict[tuple[str, int], list[str]] = {}
        for inf in self._inflight.values():
            by_engine.setdefault((inf.host, inf.port), []).append(inf.p_req)

        def run(host: str, port: int, reqs: list[str]) -> None:
            try:
                request(host, port, "hb", reqs, self.opts.handshake_timeout_s)
            except HandshakeError as e:
                logger.warning("DSAConnector heartbeat: %s", e)

        for (host, port), reqs in by_engine.items():
            self._pool.submit(run, host, port, reqs)

    # ---------------------------------------------------------------- P side

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks under a lease and hand out the kv_transfer_params for D."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        inf = self._inflight.get(request.request_id)
        if params.get("do_remote_prefill") or inf is not None:
            # D side, aborted (before or while waiting for KV): let P free its blocks now.
            host, port = (inf.host, inf.port) if inf else (params.get("remote_host"), params.get("remote_port"))
            p_req = inf.p_req if inf else params.get("remote_request_id")
            if host and port and p_req:
                self._cancel_async(str(host), int(port), [str(p_req)])
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = list(block_ids[0]) if block_ids else []
        if not blocks:
            return False, None
        with self._lock:
            self._leases[request.request_id] = _Lease(blocks, time.monotonic() + self.opts.kv_lease_duration)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.server.host,
            "remote_port": self.server.port,
            "remote_block_ids": blocks,
            "remote_num_tokens": request.num_computed_tokens,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "transfer_mode": TRANSFER_MODE,
            "kv_connector": "DSAConnector",
        }

    # ---------------------------------------------------------------- every step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DSAConnectorMetadata:
        """Package this step's work for the workers."""
        meta = DSAConnectorMetadata()
        if not self._local_sent and self._local_payloads:
            meta.local = PeerInfo(self.engine_id, list(self._local_payloads))
            self._local_sent = True
        # D side
        meta.peers.extend(self._new_sources)
        self._new_sources = []
        meta.recv, self._pending_recv = self._pending_recv, []
        for req_id, fut in list(self._reg_futures.items()):
            if not fut.done():
                continue
            del self._reg_futures[req_id]
            err = fut.exception()
            if err is not None:
                logger.error("DSAConnector: request %s: %s", req_id, err)
                self._fail[req_id] = str(err)
        meta.fail_recv, self._fail = self._fail, {}
        self._heartbeat()
        # P side
        now = time.monotonic()
        with self._lock:
            while self._regs:
                reg = self._regs.popleft()
                lease = self._leases.get(str(reg["p_req"]))
                if lease is None or lease.released or lease.dispatched:
                    continue
                d_engine = str(reg["d_engine"])
                if d_engine not in self._peers_sent:
                    meta.peers.append(PeerInfo(d_engine, self._peer_payloads[d_engine]))
                    self._peers_sent.add(d_engine)
                n = min(len(lease.blocks), len(reg["d_blocks"]))
                slots = {int(r): {int(s): [int(v) for v in sl] for s, sl in per.items()}
                         for r, per in (reg.get("slots") or {}).items()}
                meta.push.append(PushJob(str(reg["p_req"]), d_engine, str(reg["d_req"]), lease.blocks[:n],
                                         [int(b) for b in reg["d_blocks"][:n]], bool(reg.get("verify")),
                                         slots))
                lease.dispatched = True
            for req_id, lease in self._leases.items():
                if lease.released:
                    continue
                if (lease.cancelled and not lease.dispatched) or now > lease.deadline:
                    if not lease.dispatched:
                        logger.warning("DSAConnector: releasing KV of %s (%s)", req_id,
                                       "cancelled by D" if lease.cancelled else "lease expired")
                    meta.release.append(req_id)
                    lease.released = True
        if (meta.is_empty() and getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
                and (self._leases or self._inflight)):
            # Only waiting on the peer: vLLM steps in a tight loop (has_pending_push_work, requests
            # waiting for remote KV); yield the core the other engine may need.
            time.sleep(_IDLE_SLEEP_S)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Forget finished transfers; cancel at P what D gave up on."""
        if output.finished_sending:
            with self._lock:
                for req_id in output.finished_sending:
                    self._leases.pop(req_id, None)
        failed = getattr(output, "failed_recving", None) or set()
        for req_id in output.finished_recving or ():
            inf = self._inflight.pop(req_id, None)
            self._free_slots(req_id, failed=req_id in failed)
            if inf is not None and req_id in failed:
                self._cancel_async(inf.host, inf.port, [inf.p_req])

    def has_pending_push_work(self) -> bool:
        """P keeps stepping while it holds leased blocks (their release needs steps)."""
        return bool(self._leases)

    def shutdown(self) -> None:
        """Stop the side channel and the background threads."""
        self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
