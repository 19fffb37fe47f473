"""Worker side of DSAConnector: register the KV pools with NIXL, WRITE (P) and await notices (D).

The worker knows its KV cache only as a :class:`~vllm_dsa_connector.core.plan.PageTable` (pools + per-role
views, MLA latent AND indexer K), so the indexer pages, for which vLLM's per-layer hooks never fire, move
with everything else: a transfer is the byte runs of the peer's plan (``core.plan.peer_plan.PeerPlan.runs``, built
once when the worker learns the peer: merged where contiguous on both sides), not a per-layer loop.

P (sender): :class:`~vllm_dsa_connector.core.worker.sending.SendSide`, owned by the worker, which hands it
its NIXL engine, counters, rank, pools, payload and destination records and delegates P's calls to it (push
jobs -> posts of the transport, their progress, failure notices, ``finished_sending``).

D (receiver): :class:`~vllm_dsa_connector.core.worker.receiving.ReceiveSide`, owned by the worker, which
hands it its NIXL engine, lock, counters, rank, pools and source records and delegates D's calls to it (the
transport's one :class:`Receiver`). Both sides are engine-free (``core/worker/``); they count into
``stats.counters``, which vLLM reads as this worker's :class:`DSAKVConnectorStats`.

Peer restarts: the worker keeps one record per peer engine id, of the start (epoch) its last
:class:`PeerInfo` named. A PeerInfo of another epoch replaces it (:meth:`DSAConnectorWorker._learn`): the old
start's NIXL remote agents are retired and removed once no post of this worker uses them any more (a WRITE
already posted to the old agent completes or fails there), the new start's are added. A push whose
``dst_epoch`` is not the record's start is failed, never written (its blocks are another start's), and a
receive armed for another start of its source expects no notice from the current one.

Lost connections: when NIXL reports that the connection to a destination's remote agent is gone (e.g. the
link between the hosts was down long enough for UCX to fail the endpoint) the transport marks that agent
disconnected and posts nothing more to it (:class:`~vllm_dsa_connector.core.transfer.nixl.agent.PeerReconnecting`); the
worker's set-up thread removes it and adds it again from the metadata of the handshake (the same start of the
peer: its pools are unchanged; :meth:`DSAConnectorWorker._reconnect`, outside the worker lock, recording the
new connection under it briefly), while the pushes to it wait in the send side as for a set-up and post once
it is over. A peer that stays unreachable backs off: its posts fail at once naming the next attempt. Each
reconnect is counted (``peer_reconnects``, ``vllm:dsa_kv_peer_reconnects_total``) and logged as a warning
naming the peer.

Peer set-up off the step path: learning a destination (P) validates its plan in the step (pure, fast) but loads its
NIXL remote agents (``add_remote_agent``) and maps its CUDA IPC exports on the worker's one set-up thread
(:class:`~vllm_dsa_connector.core.worker.peer_setup.PeerSetup`), outside the worker lock; only the recording of the
loaded agents takes the lock, briefly. Until a record is ready its pushes wait in the send side (bounded, counted,
posted by its progress thread once the set-up is over, failed only at their post deadline): no step and no receiver
thread ever waits on a peer's set-up.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata, DSAHandshakeMetadata
from vllm_dsa_connector.connector.options import ConnectorOptions
from vllm_dsa_connector.connector.stats import DSAKVConnectorStats
from vllm_dsa_connector.core.handoff.side_channel import HandshakeError, validate_peer
from vllm_dsa_connector.core.handoff.wire import (
    PeerInfo,
    RankPayload,
    decode_payload,
    encode,
)
from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
from vllm_dsa_connector.core.transfer.ipc import host_id
from vllm_dsa_connector.core.transfer.ipc_desc import IpcDesc
from vllm_dsa_connector.core.transfer.nixl.data import TransferError, metadata_agent_name
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.staging import StagingArena
from vllm_dsa_connector.core.worker.peer_setup import PeerSetup
from vllm_dsa_connector.core.worker.pool_bytes import pool_tensor
from vllm_dsa_connector.core.worker.receiving import ReceiveSide
from vllm_dsa_connector.core.worker.sending import SendSide

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.pages import PageTable
    from vllm_dsa_connector.core.transfer.nixl.data import Region

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it


@dataclass
class _RemoteEngine:
    """The worker's record of one peer engine start in one role (a
    :class:`~vllm_dsa_connector.core.worker.sending.DestRecord` or a
    :class:`~vllm_dsa_connector.core.worker.receiving.SourceRecord`)."""

    payloads: list[RankPayload]
    agents: dict[int, str]  # rank -> NIXL agent name
    plan: PeerPlan | None = None  # decoded page tables of both sides + transfer plan, built once
    error: str = ""
    epoch: int = 0  # the start of the peer engine these payloads belong to
    ready: bool = True  # a destination's NIXL agents are loaded (False while its set-up thread works)


class DSAConnectorWorker:
    """Connector worker state for one (pp, tp) rank: its pools and peer records here, P's sending in
    :attr:`send`, D's receiving in :attr:`recv`."""

    def __init__(self, engine_id: str, options: ConnectorOptions, compat: dict[str, str],
                 role: str = "kv_both") -> None:
        from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

        self.engine_id = engine_id
        self.role = role
        self.opts = options
        self.compat = dict(compat)
        self.nixl = NixlEngine(f"dsa-{engine_id}-{uuid.uuid4().hex[:8]}", (options.nixl_backend,),
                               telemetry=True, progress_thread=options.nixl_progress_thread,
                               on_reconnect=self._reconnected, reconnect_inline=False)
        self.table: PageTable | None = None
        self.regions: list[Region] = []
        self.payload: RankPayload | None = None
        self.local: list[RankPayload] = []
        # one record per peer engine and role: an engine of a kv_both pair is both P and D of the same peer
        self.remotes: dict[str, _RemoteEngine] = {}  # engines we write to (we are P): plan + NIXL agents
        self.sources: dict[str, _RemoteEngine] = {}  # engines that write to us (we are D): plan only
        self.stats = DSAKVConnectorStats()
        # NIXL agents are not thread-safe: every NIXL call below holds this lock.
        self._lock = threading.RLock()
        self.recv = ReceiveSide(self.nixl, self._lock, self.stats.counters, rank=lambda: self.rank,
                                regions=lambda: self.regions, sources=self.sources,
                                fence_timeout_s=options.fence_timeout_s)
        self.send = SendSide(self.nixl, self.stats.counters, options.transfer_timeout_s, engine_id=engine_id,
                             rank=lambda: self.rank, regions=lambda: self.regions, payload=lambda: self.payload,
                             remotes=self.remotes, lock=self._lock, reconnect=self._schedule_reconnect)
        self.setup = PeerSetup(f"dsa-peer-setup-{engine_id}")
        # per-request facts for the scheduler's records (connector.record): only when those are built
        self.send.records = self.recv.records = options.request_records != "off" or bool(
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))

    @property
    def rank(self) -> int:
        """This worker's global rank (its page table's)."""
        assert self.table is not None, "register_kv_caches first"
        return self.table.rank

    @property
    def receiver(self) -> Receiver:
        """The transport's one receiver of this worker (D), which :attr:`recv` arms."""
        return self.recv.receiver

    # ---------------------------------------------------------------- set-up

    def register(self, kv_caches: dict[str, torch.Tensor], table: PageTable) -> RankPayload:
        """Register every pool of ``table`` (views into ``kv_caches``) and build the handshake payload: with
        bouncing allowed a send staging arena (P) and a receive one (D, whose slots D's scheduler hands out);
        on CUDA this rank's GPU, the GPUs its kernels reach and (D, ``ipc_mode`` auto) its pools' CUDA IPC
        exports, so a P on the same host can be routed through them."""
        self.table = table
        # vLLM's save_kv_layer names the attention layer: its global layer carries every role's page of it
        self.layer_ids = {e.name: e.global_layer for v in table.views for e in v.entries}
        self.regions = [self.nixl.register(pool_tensor(kv_caches, p.base_ptr, p.nbytes)) for p in table.pools]
        staging = None
        send_arena = recv_arena = None
        settings = self.opts.bounce
        device = self.regions[0].tensor.device if self.regions else torch.device("cpu")
        if settings is not None and settings.mode != "never":
            if self.role in ("kv_producer", "kv_both"):
                send_arena = StagingArena(settings.arena_bytes, device=device)
            if self.role in ("kv_consumer", "kv_both"):
                recv_arena = StagingArena(settings.arena_bytes, device=device)
                staging = self.recv.attach_arena(recv_arena).desc()
        self.send.attach_arena(send_arena, reserve_timeout_s=settings.reserve_timeout_s if settings else 0.2)
        gpu, reach, ipc = self._cuda_identity(device)
        if device.type == "cpu":
            _warn_shared_cpu_binding(self.engine_id)
        if self.opts.prefault_kv_cache and self.role in ("kv_consumer", "kv_both"):
            self._prefault([r.tensor for r in self.regions] + ([recv_arena.buffer] if recv_arena else []))
        self.payload = RankPayload(
            engine_id=self.engine_id, rank=table.rank, pp_rank=table.pp_rank, tp_rank=table.tp_rank,
            agent_name=self.nixl.name, agent_metadata=self.nixl.metadata(), page_table=table,
            regions=[r.desc() for r in self.regions], compat=self.compat, staging=staging,
            host=host_id(), gpu=gpu, reach=reach, ipc=ipc)
        logger.info("DSAConnector %s rank %d: registered %d pool(s), %d B/block, views %s%s",
                    self.engine_id, table.rank, len(self.regions), table.bytes_per_block,
                    [(v.role.value, len(v.entries)) for v in table.views],
                    ", pools exported for CUDA IPC" if ipc else "")
        return self.payload

    def _cuda_identity(self, device: torch.device) -> tuple[str, list[str], list[IpcDesc] | None]:
        """(GPU UUID, UUIDs of the GPUs this rank's kernels can write, the pools' CUDA IPC exports or None)
        for CUDA pools; CPU pools have none of them. The exports are D's (a consumer's) and follow ``ipc_mode``."""
        if device.type != "cuda":
            return "", [], None
        from vllm_dsa_connector.core.transfer.ipc import device_uuid, export_region

        gpu = device_uuid(device)
        reach = [gpu] + [device_uuid(i) for i in range(torch.cuda.device_count())
                         if i != device.index and torch.cuda.can_device_access_peer(device.index or 0, i)]
        ipc = None
        if self.opts.exports_cuda_ipc(self.role):
            try:
                ipc = [export_region(r.tensor) for r in self.regions]
            except Exception as e:  # noqa: BLE001 - no ipc path then: NIXL carries every pair
                logger.warning("DSAConnector %s: cannot export the KV pools for CUDA IPC (%s); peers on this host "
                               "use NIXL", self.engine_id, e)
        return gpu, reach, ipc

    @staticmethod
    def _prefault(tensors: list[torch.Tensor]) -> None:
        """Touch one byte per page of CPU memory that peers write into: a WRITE into never-touched pages
        pays the receiver's page faults (measured 8x slower). Contents are unused at start-up."""
        t0 = time.perf_counter()
        nbytes = 0
        for t in tensors:
            if t.device.type == "cpu" and t.numel():
                t.view(torch.uint8).view(-1)[::4096].zero_()
                nbytes += t.numel() * t.element_size()
        if nbytes:
            logger.info("DSAConnector: pre-faulted %.0f MiB of receive memory in %.2f s", nbytes / 2**20,
                        time.perf_counter() - t0)

    def handshake_metadata(self) -> DSAHandshakeMetadata:
        """vLLM's container for this rank's payload."""
        assert self.payload is not None, "register_kv_caches first"
        return DSAHandshakeMetadata(encode(self.payload))

    def _learn(self, peer: PeerInfo) -> None:
        """The one place a peer record changes: ``peer`` becomes the record of its engine id in its role
        (``as_source``: it writes to us, :attr:`sources`; else we write to it, :attr:`remotes`); a PeerInfo
        of the start already known in that role changes nothing; a replaced start's NIXL agents are retired.
        The roles keep separate records: a kv_both engine is P of a peer for one request and its D for the
        next, and each role needs its own plan (the direction of the pages) and, as P, the peer's agents."""
        records = self.sources if peer.as_source else self.remotes
        old = records.get(peer.engine_id)
        if old is not None and old.epoch == peer.epoch and not old.error:
            return
        payloads = sorted((decode_payload(p) for p in peer.payloads), key=lambda p: p.rank)
        remote = _RemoteEngine(payloads, {}, epoch=peer.epoch)
        assert self.payload is not None, "register_kv_caches first"
        local = self.local or [self.payload]
        if old is not None:
            self.send.retire(old.agents.values())
        try:
            if peer.as_source:  # it writes to us: we only need the plan (to check and scatter its bytes)
                remote.plan = validate_peer(payloads, local)
            else:
                remote.plan = validate_peer(local, payloads)
                self._check_identity(peer.engine_id, payloads)
                todo = []
                for p in payloads:
                    if self.send.reclaim(p.agent_name):  # a retired agent still loaded: reuse it
                        remote.agents[p.rank] = p.agent_name
                    else:
                        todo.append(p)
                if todo:  # loaded on the set-up thread: the step goes on (pushes to it wait, see the docstring)
                    remote.ready = False
                    self.setup.submit(peer.engine_id, lambda: self._set_up(peer.engine_id, remote, todo))
        except (HandshakeError, Exception) as e:  # noqa: BLE001 - refuse the peer, keep serving
            remote.error = str(e)
            remote.ready = True
            logger.error("DSAConnector %s: peer %s refused: %s", self.engine_id, peer.engine_id, e)
        if old is not None:
            logger.warning("DSAConnector %s: peer %s (as %s) restarted (epoch %016x replaces %016x): NIXL agents "
                           "%s retired, %s %s", self.engine_id, peer.engine_id,
                           "source" if peer.as_source else "destination", peer.epoch, old.epoch,
                           sorted(old.agents.values()), sorted(p.agent_name for p in payloads),
                           "added" if remote.ready else "being added on the set-up thread")
        records[peer.engine_id] = remote
        self.send.remove_retired()

    def _check_identity(self, engine: str, payloads: list[RankPayload]) -> None:
        """Refuse destination payloads that are not ``engine``'s own (counted): an agent name another destination
        engine's record holds, or agent metadata that names another agent than the payload (NIXL would load it
        under the metadata's name: that agent's pools would take this engine's WRITEs)."""
        # the payloads, not the loaded agents: a record's agents are loaded on the set-up thread, later
        owners = {q.agent_name: e for e, r in self.remotes.items() if e != engine and not r.error for q in r.payloads}
        for p in payloads:
            named = metadata_agent_name(p.agent_metadata)
            why = ""
            if p.agent_name == self.nixl.name:
                why = f"NIXL agent {p.agent_name!r} is this worker's own"
            elif p.agent_name in owners:
                why = f"NIXL agent {p.agent_name!r} is destination engine {owners[p.agent_name]!r}'s"
            elif named is not None and named != p.agent_name:
                why = f"rank {p.rank}'s agent metadata is agent {named!r}'s, the payload says {p.agent_name!r}"
            if why:
                self.stats.add("refused_identities")
                raise HandshakeError(f"payloads of destination engine {engine!r} are not its own: {why}")

    def _set_up(self, engine: str, remote: _RemoteEngine, payloads: list[RankPayload]) -> None:
        """On the set-up thread: load the NIXL remote agents of ``payloads`` (no worker lock held: NIXL's own
        lock serialises ``add_remote_agent`` with the posts), map a same-host peer's CUDA IPC exports, then
        record the agents and mark ``remote`` ready under the worker lock (briefly). A record replaced or
        forgotten meanwhile gets nothing: the agents loaded for it are retired."""
        t0 = time.perf_counter()
        loaded: dict[int, tuple[str, bytes]] = {}
        error = ""
        try:
            for p in payloads:
                loaded[p.rank] = (self.nixl.load_peer(p.agent_metadata), p.agent_metadata)
                self.send.map_ahead(loaded[p.rank][0], p)  # its pushes wait until the record is ready
        except Exception as e:  # noqa: BLE001 - refuse the peer, keep serving
            error = f"loading the NIXL metadata of its rank {p.rank} failed: {e}"
        with self._lock:
            for rank, (agent, meta) in loaded.items():
                self.nixl.adopt_peer(agent, meta)
                remote.agents[rank] = agent
            current = self.remotes.get(engine) is remote
            if not current:
                self.send.retire(a for a, _ in loaded.values())
                self.send.remove_retired()
            remote.error = remote.error or error
            remote.ready = True
        self.send.wake()
        took = time.perf_counter() - t0
        if error:
            logger.error("DSAConnector %s: peer %s refused: %s", self.engine_id, engine, error)
        else:
            (logger.warning if took > 1.0 else logger.info)(
                "DSAConnector %s: set up peer %s (%d NIXL remote agent(s)) in %.3f s off the step path",
                self.engine_id, engine, len(loaded), took)

    def _schedule_reconnect(self, agent: str) -> None:
        """Under the worker lock: claim the reconnect of ``agent`` (its connection is gone) and run it on the
        set-up thread (:meth:`_reconnect`); nothing when one already runs or it is backing off."""
        meta = self.nixl.begin_reconnect(agent)
        if meta is None:
            return
        reason = self.nixl.disconnected(agent)
        self.setup.submit(f"reconnect of {agent}", lambda: self._reconnect(agent, meta, reason))

    def _reconnect(self, agent: str, meta: bytes, reason: str) -> None:
        """On the set-up thread: remove ``agent``'s remote agent and add it again (no worker lock held: NIXL's
        own lock serialises it with the posts), then record the new connection (or the failed attempt and its
        backoff) under the worker lock, briefly, and wake the send side (its held pushes post now)."""
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            self.nixl.reload_peer(agent, meta)
        except Exception as e:  # noqa: BLE001 - recorded below (backoff): its posts fail naming the next attempt
            error = e
        with self._lock:
            try:
                self.nixl.end_reconnect(agent, error, reason)
            except TransferError as e:
                logger.warning("DSAConnector %s: %s", self.engine_id, e)
        self.send.wake()
        took = time.perf_counter() - t0
        if took > 1.0:
            logger.warning("DSAConnector %s: reconnecting NIXL remote agent %s took %.3f s (off the step path)",
                           self.engine_id, agent, took)

    def _reconnected(self, agent: str, reason: str) -> None:
        """The transport removed and added ``agent`` again after its connection was lost: count and log it."""
        self.stats.add("peer_reconnects")
        engines = sorted(e for e, r in self.remotes.items() if agent in r.agents.values()) or ["(unknown engine)"]
        logger.warning("DSAConnector %s: NIXL connection to peer %s (remote agent %s) was lost (%s); removed the "
                       "remote agent and added it again from its handshake metadata", self.engine_id,
                       ", ".join(engines), agent, reason)

    def _forget(self, engine: str, as_source: bool) -> None:
        """The scheduler forgot an idle peer in one role: drop that record; a destination's NIXL remote
        agents are retired (removed once no post of this worker uses them: removing one earlier would abort
        that WRITE). A later handshake or registration brings the record back."""
        remote = (self.sources if as_source else self.remotes).pop(engine, None)
        if remote is None:
            return
        self.send.retire(remote.agents.values())
        self.send.remove_retired()
        logger.info("DSAConnector %s: forgot idle peer %s as %s (%d remote agents retired)", self.engine_id, engine,
                    "source" if as_source else "destination", len(remote.agents))

    # ---------------------------------------------------------------- per step

    def start_load_kv(self, meta: DSAConnectorMetadata) -> None:
        """Apply the scheduler's step metadata: learn peers, post WRITEs, arm receive expectations."""
        with self._lock:
            self._start_load_kv(meta)

    def _start_load_kv(self, meta: DSAConnectorMetadata) -> None:
        if meta.local is not None:
            self.local = sorted((decode_payload(p) for p in meta.local.payloads), key=lambda p: p.rank)
        for engine in meta.forget:
            self._forget(engine, as_source=False)
        for engine in meta.forget_sources:
            self._forget(engine, as_source=True)
        for peer in meta.peers:
            self._learn(peer)
        for job in meta.push:
            self.send.push(job)
        if meta.push:
            self.send.wake()  # its progress thread drives the WRITEs: the forward never waits on one
        for recv in meta.recv:
            self.recv.expect(recv)
        for req_id, reason in meta.fail_recv.items():
            if not self.recv.fail(req_id, fence=req_id not in meta.fail_unposted):
                continue  # it completed meanwhile: already reported
            # unusable kv_transfer_params: the scheduler logged what it got once per peer, not here per request
            log = logger.debug if req_id in meta.fail_quiet else logger.error
            log("DSAConnector: load of %s failed: %s", req_id, reason)
        for req_id in meta.fence_void:
            self.recv.unfence(req_id)
        self.send.release(meta.release)

    def save_layer(self, layer_name: str) -> None:
        """vLLM computed this attention layer in the current step: post its pages of the step's layer-by-layer
        jobs (its MLA latent and, for a layer owning one, its indexer K page are final now)."""
        layer = self.layer_ids.get(layer_name)
        if layer is None:
            return
        with self._lock:
            self.send.layer(layer)

    def wait_for_save(self) -> None:
        """The step's forward is over: close its layer-by-layer posts (adding the layers no save_kv_layer
        reported); the send side's progress thread drives them to DONE (nothing here waits on a WRITE)."""
        with self._lock:
            if self.send.finish_layers():
                self.send.wake()

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        with self._lock:
            self.send.finish_layers()
            self.send.poll()
            self.recv.poll()
        done_recving, failed_recving = self.recv.take_results()
        return self.send.take_done(), done_recving, failed_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose checksum did not match (reported once)."""
        return self.recv.take_error_blocks()

    def get_stats(self) -> DSAKVConnectorStats | None:
        """Stats since the last call, or None when nothing happened. Taken under the worker lock: the send and
        receive progress threads record into the same counters under it (new keys each step), so the copy is
        never torn and nothing recorded between the copy and the reset is lost."""
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        """Stop the set-up, send progress and receiver threads, release NIXL resources."""
        self.setup.stop()
        self.send.stop()
        self.recv.stop()
        with self._lock:
            self.nixl.close()


def _warn_shared_cpu_binding(engine_id: str) -> None:
    """On vLLM CPU with its default thread binding, say that every engine of the host started that way is bound
    to the same cores: a P and a D on one host then spin on the same core, starving each other's side channel
    and NIXL progress (measured on 2 cores: the first request's handshake took 31 s, and a WRITE never
    completed in 30 s; both pass with disjoint binds or ``nobind``)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind not in ("", "auto"):
        return
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    logger.warning(
        "DSAConnector %s: VLLM_CPU_OMP_THREADS_BIND is %r, so vLLM bound this worker to core(s) %s of %d, and binds "
        "every other engine of this host started the same way to the same cores; a P and a D sharing them starve "
        "each other's side channel and transfers (first requests then fail). Give each engine its own cores "
        "(e.g. VLLM_CPU_OMP_THREADS_BIND=0-3 for P, 4-7 for D) or 'nobind'.",
        engine_id, bind or "auto", ",".join(map(str, mine)), os.cpu_count() or 0)
