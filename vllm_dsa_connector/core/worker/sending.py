"""Send side of a DSAConnector worker (P): push jobs become posts of the transport, polled until done.

A :class:`SendSide` is owned by an adapter's worker (vLLM's:
:class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker`; composition), as
:class:`~.receiving.ReceiveSide` is for D: the worker hands it what it shares (the NIXL engine, its counters,
its rank, KV pool regions and handshake payload, the records of the engines it writes to) and delegates
P's calls to it (:meth:`SendSide.push`, :meth:`SendSide.poll`, :meth:`SendSide.release`,
:meth:`SendSide.take_done`). Every NIXL call it makes happens under the worker's lock (the worker takes it
around each of these calls, the progress thread around each of its rounds).

Nothing waits on a WRITE: posting returns at once, and the side's progress thread (started at the first
:meth:`SendSide.wake`) polls the posts in flight every 0.2 ms, growing with the wait to 2 ms
(:func:`~.receiving.recv_poll_period`), taking the worker lock for one round at a time; a post is over when
NIXL says DONE (or ERR), its request is reported ``finished_sending`` from the engine's next
``get_finished`` (vLLM frees the blocks then), and the notice rules are the transport's, unchanged. Without
it UCX would copy only while a step polls (NIXL runs without its own busy progress thread).

Pushes to a destination whose set-up is not over (:attr:`DestRecord.ready` false: the worker's set-up thread
is loading its NIXL agents) wait here, at most :data:`MAX_WAITING_PUSHES` per worker (counted,
``setup_waits``), and are posted by the progress thread once the record is ready; one still waiting at its
post deadline is failed as late. A layer-by-layer job that waited is posted whole, once its step's forward is
over (its pages are final then).

A ``PushJob`` becomes, per destination rank this rank feeds in the plan, one post of the transport
(:class:`~vllm_dsa_connector.core.transfer.routed.RoutedTransport`, along the route D named for the pair:
direct, bounce through D's staging slot, or CUDA IPC into D's exported pools; polled from the engine's
steps; never after the job's post deadline) whose tag is a
:class:`~vllm_dsa_connector.core.handoff.wire.Notice` (bytes, runs, and with ``verify_transfers`` a CRC32 per
run): D gets it once the data landed. The job's post deadline is checked before every destination rank's
post and, inside the transport, before every WRITE (after any staging wait). ``finished_sending`` is
reported once, when every WRITE of the request completed, failed or was aborted; a failure notice goes
only when no part of that destination's post is in flight any more.

Layer by layer (``PushJob.layered``, the step that finishes P's prefill): :meth:`SendSide.push` opens one
post per destination rank (``RoutedTransport.open``, nothing written yet), :meth:`SendSide.layer` adds one
global layer's pages to each (``RoutedTransport.add``) as vLLM's ``save_kv_layer`` reports that layer
computed, and closes a post once its last layer is in; :meth:`SendSide.finish_layers` (``wait_for_save``, and
again before every poll) adds whatever no ``save_kv_layer`` reported (the forward is over: every page is
final) and closes the rest. D gets the same single notice per writer as for a whole-request post. A job
with ``error`` writes nothing: each destination rank it feeds gets that reason as its failure notice.

Retired agents: the NIXL remote agents of a destination's replaced start (or of a forgotten one) are
removed only once no post of this side uses them any more (:meth:`SendSide.remove_retired`; removing one
earlier would abort that WRITE).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from vllm_dsa_connector.core.handoff.wire import Notice, PushJob, RankPayload, encode, route_of
from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.ipc import host_id
from vllm_dsa_connector.core.transfer.nixl.agent import PeerReconnecting
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.routed import RoutedTransport
from vllm_dsa_connector.core.transfer.staging import StagingSlot
from vllm_dsa_connector.core.transfer.transports import Post, PostState
from vllm_dsa_connector.core.worker.counters import Counters
from vllm_dsa_connector.core.worker.pool_bytes import crc_runs
from vllm_dsa_connector.core.worker.receiving import ReportedIds, recv_poll_period

if TYPE_CHECKING:
    from vllm_dsa_connector.core.transfer.nixl.data import Region
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.staging import StagingArena

logger = logging.getLogger(__name__)

#: P's staging arena counts as full (D routes P's next requests direct) with less than this share of it free
_STAGING_FULL = 0.125
#: Pushes that may wait for their destination's set-up per worker; one more fails at once (D's load fails,
#: its kv_load_failure_policy applies), so a peer that never gets ready costs bounded memory.
MAX_WAITING_PUSHES = 1024
#: Failure notices kept per worker while their destination's connection is made again (sent once it is: D keeps a
#: given-up load's blocks until every writer's notice); the oldest is dropped beyond it (D then waits for its
#: fence timeout), and one older than :data:`UNSENT_NOTICE_S` too.
MAX_UNSENT_NOTICES = 4096
UNSENT_NOTICE_S = 1000.0


class DestRecord(Protocol):
    """What P knows of an engine it writes to (the worker's record of that peer start)."""

    @property
    def payloads(self) -> list[RankPayload]:
        """The peer's worker payloads (their regions, staging and IPC exports)."""

    @property
    def agents(self) -> dict[int, str]:
        """Rank -> the NIXL remote agent loaded for it."""

    @property
    def plan(self) -> PeerPlan | None:
        """The transfer plan from this engine to the peer (None: the peer was refused)."""

    @property
    def error(self) -> str:
        """Why the peer was refused (``""``: it was not)."""

    @property
    def epoch(self) -> int:
        """The peer start these payloads belong to."""

    @property
    def ready(self) -> bool:
        """Its NIXL agents are loaded (false while the worker's set-up thread loads them)."""


@dataclass
class _Group:
    """The post of one request to one destination rank (the transport notifies D once it is DONE; a
    failure notice goes once no part of it is in flight any more)."""

    agent: str
    rank: int
    post: Post


@dataclass
class _Layers:
    """An open layer-by-layer post of one request to one destination rank: the layers still to add."""

    group: _Group
    job: PushJob
    plan: PeerPlan
    src_rank: int
    dst_rank: int
    parts: list[tuple[int, int, Runs]]  # the whole request's, in the post's part order
    todo: set[int]  # global layers not added yet
    notice: Notice

    def index(self, sp: int, dp: int) -> int:
        """The post's part index of pools (``sp``, ``dp``)."""
        for i, (a, b, _) in enumerate(self.parts):
            if (a, b) == (sp, dp):
                return i
        raise ValueError(f"layer runs between pools {sp} -> {dp}, which the whole request does not use")


@dataclass
class _Send:
    """One request's push: its posts, one per destination rank, until every one is over."""

    req_id: str
    dst_req: str
    groups: list[_Group] = field(default_factory=list)
    failed: bool = False
    fenced: set[str] = field(default_factory=set)  # agents its failure notice went to as a fence
    waiting: bool = False  # held until its destination's set-up is over (nothing posted yet)


@dataclass
class _Waiting:
    """A push held until its destination is ready; ``final``: its pages are computed (a layered job's once
    its step's forward is over)."""

    job: PushJob
    send: _Send
    final: bool
    since: float = field(default_factory=time.monotonic)  # when it was held


class SendSide:
    """P's sending for one worker rank: posts each ``PushJob`` (:meth:`push`), polls the posts
    (:meth:`poll`), sends failure notices, and keeps the requests to report as ``finished_sending``.

    ``nixl``: the worker's NIXL engine; ``stats``: the worker's counters; ``transfer_timeout_s``: the
    transport's WRITE timeout; ``engine_id``: names this engine in logs; ``rank``, ``regions`` and
    ``payload``: this rank, its registered KV pools and its handshake payload (read when needed: known only
    once the worker registered its caches); ``remotes``: the worker's records of the engines it writes to,
    by engine id (the worker keeps them current); ``lock``: the worker's lock, which the progress thread takes
    around each round; ``reconnect(agent)``: schedules the reconnect of a remote agent whose connection is
    gone on the worker's set-up thread (under the lock; a no-op when one runs or it is backing off).
    """

    def __init__(self, nixl: NixlEngine, stats: Counters, transfer_timeout_s: float, *,
                 engine_id: str, rank: Callable[[], int], regions: Callable[[], Sequence[Region]],
                 payload: Callable[[], RankPayload | None], remotes: Mapping[str, DestRecord],
                 lock: threading.RLock | None = None, reconnect: Callable[[str], None] | None = None) -> None:
        self.nixl = nixl
        self._reconnect = reconnect  # schedules a lost connection's reconnect off the step (the worker's)
        self._lock = lock if lock is not None else threading.RLock()
        self.stats = stats
        self.engine_id = engine_id
        self._rank = rank
        self._regions = regions
        self._payload = payload
        self.remotes = remotes
        self.reported = ReportedIds()  # requests reported to vLLM (finished_sending), each once
        self.transfer_timeout_s = transfer_timeout_s
        self.transport = RoutedTransport(nixl, transfer_timeout_s)  # replaced by attach_arena at register
        self._sends: dict[str, _Send] = {}
        self._layers: list[_Layers] = []  # open layer-by-layer posts of this step
        self._layered_step = False  # this step opened layer-by-layer posts (wait_for_save drives them)
        self._done: set[str] = set()  # finished_sending since the last take_done
        self.retired: set[str] = set()  # NIXL agents of replaced peer starts, removed once no post uses them
        self._staging_last: tuple[int, bool] = (0, False)  # the staging arena's last sample (held bytes, full)
        self._waiting: dict[str, _Waiting] = {}  # pushes held until their destination is ready
        # failure notices met by a lost connection: (agent, D request, error, when), sent after the reconnect
        self._unsent: collections.deque[tuple[str, str, str, float]] = collections.deque()
        self.records = False  # hand the scheduler per-request facts (connector.record; set by the worker)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def attach_arena(self, arena: StagingArena | None, reserve_timeout_s: float) -> None:
        """The transport this side posts with: bounced posts stage through ``arena`` (None: no bouncing),
        waiting up to ``reserve_timeout_s`` for room in it."""
        self.transport = RoutedTransport(self.nixl, self.transfer_timeout_s, arena=arena,
                                         reserve_timeout_s=reserve_timeout_s)

    # ---------------------------------------------------------------- retired agents

    def retire(self, agents: Iterable[str]) -> None:
        """These remote agents belong to a replaced or forgotten peer start: remove them once no post uses
        them (:meth:`remove_retired`)."""
        self.retired.update(agents)

    def reclaim(self, agent: str) -> bool:
        """Take a retired ``agent`` back when it is still loaded (a new record names it again): True if so."""
        if agent in self.retired and agent in self.nixl.peers:
            self.retired.discard(agent)
            return True
        return False

    def remove_retired(self) -> None:
        """Remove the retired NIXL agents no post of this worker uses any more."""
        if not self.retired:
            return
        busy = {g.agent for send in self._sends.values() for g in send.groups}
        for agent in sorted(self.retired - busy):
            self.transport.unmap_peer(agent)
            self.nixl.remove_peer(agent)
            self.retired.discard(agent)
            logger.info("DSAConnector %s: removed NIXL remote agent %s (its engine restarted)", self.engine_id, agent)

    # ---------------------------------------------------------------- per step

    def push(self, job: PushJob) -> None:
        """Post ``job`` to every destination rank this rank feeds, or fail it (late, unknown or refused
        peer, another start's registration): a failed push is still reported as finished_sending once."""
        send = _Send(job.req_id, job.dst_req_id)
        self._sends[job.req_id] = send
        if time.monotonic() >= job.post_deadline:
            # D has given up (or will before a WRITE could land): posting now could hit reused blocks
            logger.error("DSAConnector: push of %s reached the workers after its post deadline; not writing",
                         job.req_id)
            send.failed = True
            self.stats.add("send_late")
            self._notify_unposted(job, "P's post deadline passed before the push reached its workers")
            return
        remote = self.remotes.get(job.dst_engine)
        if remote is None or remote.error or remote.plan is None:
            logger.error("DSAConnector: cannot push %s to %s: %s", job.req_id, job.dst_engine,
                         (remote.error or "no plan") if remote else "unknown peer")
            send.failed = True
            return
        if job.dst_epoch and job.dst_epoch != remote.epoch:
            # registered by another start of that engine: its blocks are not the current start's
            logger.error("DSAConnector: not pushing %s to %s: registered by its start %016x, this worker knows "
                         "%016x (restarted)", job.req_id, job.dst_engine, job.dst_epoch, remote.epoch)
            send.failed = True
            return
        if not remote.ready:  # its set-up thread still loads its NIXL agents: hold it, never block the step
            self._hold(job, send)
            return
        if self._reconnecting(remote):  # a lost connection is being made again off the step: likewise
            self._hold(job, send)
            return
        plan = remote.plan
        me = self._payload()
        assert me is not None, "register_kv_caches first"
        if job.error:
            # P will never write this registration: tell every destination rank this rank feeds, so D fails the
            # load now instead of at its timeout
            send.failed = True
            for dst in remote.payloads:
                if plan.for_pair(me.rank, dst.rank) and dst.rank in remote.agents:
                    self._notify_failure(remote.agents[dst.rank], job.dst_req_id, job.error)
            logger.warning("DSAConnector: not writing %s: %s", job.req_id, job.error)
            return
        for dst in remote.payloads:
            if dst.rank not in remote.agents:  # never silently "sent": D would wait for bytes that never come
                logger.error("DSAConnector: cannot push %s to %s rank %d: no NIXL agent of that rank is loaded",
                             job.req_id, job.dst_engine, dst.rank)
                send.failed = True
                continue
            agent = remote.agents[dst.rank]
            if (now := time.monotonic()) >= job.post_deadline:
                # an earlier rank's post (its staging wait) took the job past the deadline: no later rank posts
                logger.error("DSAConnector: push of %s to %s rank %d: post deadline passed %.3f s ago; not "
                             "writing", job.req_id, job.dst_engine, dst.rank, now - job.post_deadline)
                send.failed = True
                self.stats.add("send_late")
                self._notify_failure(agent, job.dst_req_id, "P's post deadline passed before the post")
                continue
            try:
                parts = plan.runs(me.rank, dst.rank, job.src_blocks, job.dst_blocks, first_token=job.first_token,
                                  num_tokens=job.num_tokens)
                if parts:
                    self._write(job, send, dst, agent, parts, plan)
            except PeerReconnecting as e:  # the post met a lost connection: nothing of it was posted
                self._schedule(agent)
                if not send.groups and not send.failed:  # nothing of the job posted: it waits for the reconnect
                    self._hold(job, send)
                    return
                logger.error("DSAConnector: push %s -> %s rank %d failed: %s", job.req_id, job.dst_engine,
                             dst.rank, e)
                send.failed = True
            except Exception as e:  # noqa: BLE001 - a failed WRITE is a failed transfer, never a crash
                logger.error("DSAConnector: push %s -> %s rank %d failed: %s", job.req_id, job.dst_engine,
                             dst.rank, e)
                send.failed = True
                self._notify_failure(agent, job.dst_req_id, str(e))

    def _notify_unposted(self, job: PushJob, why: str) -> None:
        """Tell every destination rank this rank feeds that ``job`` was not written (D's workers keep a given-up
        load's blocks until each writer's notice: :mod:`~vllm_dsa_connector.core.transfer.fence`)."""
        remote = self.remotes.get(job.dst_engine)
        me = self._payload()
        if remote is None or remote.plan is None or me is None or (job.dst_epoch and job.dst_epoch != remote.epoch):
            return
        for dst in remote.payloads:
            if remote.plan.for_pair(me.rank, dst.rank) and dst.rank in remote.agents:
                self._notify_failure(remote.agents[dst.rank], job.dst_req_id, why)

    def _hold(self, job: PushJob, send: _Send) -> None:
        """Hold ``job`` until its destination is ready (bounded: :data:`MAX_WAITING_PUSHES`)."""
        if len(self._waiting) >= MAX_WAITING_PUSHES:
            logger.error("DSAConnector: cannot push %s to %s: %d pushes already wait for peer set-up", job.req_id,
                         job.dst_engine, len(self._waiting))
            send.failed = True
            return
        send.waiting = True
        self._waiting[job.req_id] = _Waiting(job, send, final=not job.layered)
        self.stats.add("setup_waits")

    def _reconnecting(self, remote: DestRecord) -> bool:
        """Whether a post to ``remote`` would wait for a reconnect of one of its agents (scheduling the due
        ones on the set-up thread)."""
        pending = [a for a in remote.agents.values() if self.nixl.reconnect_pending(a)]
        for agent in pending:
            self._schedule(agent)
        return bool(pending)

    def _schedule(self, agent: str) -> None:
        """Have ``agent``'s reconnect run on the worker's set-up thread (once; not while it backs off)."""
        if self._reconnect is not None and self.nixl.reconnect_pending(agent):
            self._reconnect(agent)

    def retry_waiting(self) -> None:
        """Post the held pushes whose destination is ready now (or fail them, its set-up refused it); fail
        the ones whose post deadline passed while they waited."""
        now = time.monotonic()
        for req_id, w in list(self._waiting.items()):
            late = now >= w.job.post_deadline
            remote = self.remotes.get(w.job.dst_engine)
            if not late and (not w.final or (remote is not None and (not remote.ready or self._reconnecting(remote)))):
                continue
            del self._waiting[req_id]
            if self._sends.get(req_id) is not w.send:
                continue  # replaced by a later push of the same request
            del self._sends[req_id]
            if self.records:  # the set-up wait, for the request's record
                self.stats.record(
                    {"req": req_id, "src_rank": self._rank(), "setup_wait_ms": round(1000 * (now - w.since), 3)})
            if late:
                logger.error("DSAConnector: push of %s waited for the set-up of %s past its post deadline; not "
                             "writing", req_id, w.job.dst_engine)
            self.push(msgspec.structs.replace(w.job, layered=False))  # a late one fails as late there

    def map_ahead(self, agent: str, dst: RankPayload) -> None:
        """On the set-up thread, before ``dst``'s record is ready: map its CUDA IPC exports when it is on this
        host and the pools are on CUDA, so no push maps them in a step (a failure is logged and met again by
        a push routed through ipc, which then fails naming why)."""
        regions = self._regions()
        if not dst.ipc or not regions or regions[0].tensor.device.type != "cuda" or dst.host != host_id():
            return
        self._map(agent, dst)

    def _checks(self, parts: list[tuple[int, int, Runs]]) -> list[tuple[int, int, int, int]]:
        """``verify_transfers``: a CRC32 of every run (destination pool, offset, length, crc)."""
        regions = self._regions()
        checks: list[tuple[int, int, int, int]] = []
        for sp, dp, runs in parts:
            crcs = crc_runs(regions[sp].tensor, runs.src_offsets, runs.lengths)
            checks.extend((dp, int(o), int(n), crc) for o, n, crc in zip(runs.dst_offsets, runs.lengths, crcs,
                                                                          strict=True))
        return checks

    def _write(self, job: PushJob, send: _Send, dst: RankPayload, agent: str,
               parts: list[tuple[int, int, Runs]], plan: PeerPlan) -> None:
        """Post one writer's parts (one per (source pool, destination pool)) along the route D chose for the
        pair (direct when it named none); D gets the notice either way. A layered job's post is opened here
        and fed by :meth:`layer`."""
        me = self._rank()
        regions = self._regions()
        nbytes = sum(r.total_bytes for _, _, r in parts)
        nruns = sum(r.num_runs for _, _, r in parts)
        # a layered post's pages are not computed yet: its checksums are taken when it closes
        checks = self._checks(parts) if job.verify and not job.layered else []
        notice = Notice(job.dst_req_id, me, True, nbytes, nruns, checks=checks)
        route = route_of(job.routes, dst.rank, me)
        path = PathName(route.path) if route is not None else PathName.DIRECT
        slot = None
        if path == PathName.BOUNCE and route is not None and dst.staging is not None:
            slot = StagingSlot(dst.staging, int(route.offset), int(route.size))
        if path == PathName.IPC:
            self._map(agent, dst)
        send_parts = [(regions[sp], dst.regions[dp], runs) for sp, dp, runs in parts]
        how = self.transport.open if job.layered else self.transport.post
        post = how(agent, send_parts, writer=me, tag=encode(notice), path=path, slot=slot,
                   pools=[dp for _, dp, _ in parts], deadline=job.post_deadline)
        if job.layered and post.state is not PostState.FAILED:
            self._layered_step = True
            self._layers.append(_Layers(_Group(agent, dst.rank, post), job, plan, me, dst.rank, parts,
                                        set(plan.layers_of(me, dst.rank)), notice))
        if post.state is not PostState.FAILED:
            if path != PathName.DIRECT:
                self.stats.add(f"{path}_bytes", nbytes)
            if job.layered:
                self.stats.add("layered_bytes", nbytes)
        send.groups.append(self._layers[-1].group if job.layered and post.state is not PostState.FAILED
                           else _Group(agent, dst.rank, post))
        self.stats.add("send_bytes", nbytes)
        self.stats.add_pair_bytes("send", me, dst.rank, nbytes)
        self.stats.add("send_runs", nruns)

    def _map(self, agent: str, dst: RankPayload) -> None:
        """Map ``dst``'s exported pools here once (ipc route); a failure leaves them unmapped and the post then
        fails naming why (D armed its receive for the ipc path: no other path may be taken)."""
        if self.transport.mapped(agent) or not dst.ipc:
            return
        try:
            self.transport.map_peer(agent, dst.ipc, self._regions()[0].tensor.device)
            logger.info("DSAConnector %s: mapped the %d KV pool(s) of %s rank %d through CUDA IPC", self.engine_id,
                        len(dst.ipc), dst.engine_id, dst.rank)
        except Exception as e:  # noqa: BLE001 - the post fails with this reason
            logger.error("DSAConnector %s: cannot map the KV pools of %s rank %d through CUDA IPC: %s",
                         self.engine_id, dst.engine_id, dst.rank, e)

    def layer(self, global_layer: int) -> None:
        """vLLM computed ``global_layer`` of this step: add its pages to every open layer-by-layer post that
        still needs them (closing a post once its last layer is in), then drive the posts once."""
        if not self._layers:
            return
        for entry in list(self._layers):
            if global_layer in entry.todo:
                self._add(entry, {global_layer})
        self.poll_layers()

    def finish_layers(self) -> bool:
        """The step's forward is over: add every layer no ``save_kv_layer`` reported and close every open
        layer-by-layer post (the pages are all final now). Whether this step had any."""
        had = bool(self._layers) or self._layered_step
        self._layered_step = False
        for w in self._waiting.values():
            w.final = True  # the forward is over: a held layered job's pages are computed
        for entry in list(self._layers):
            self._add(entry, set(entry.todo))
        return had

    def poll_layers(self) -> None:
        """Drive the posts of the open layer-by-layer jobs once (WRITEs waiting on CUDA events, bounce
        prefixes)."""
        for entry in self._layers:
            self.transport.progress(entry.group.post)

    def _add(self, entry: _Layers, layers: set[int]) -> None:
        """Add ``layers`` of ``entry`` to its post; close it when none is left (a failure fails the post: its
        failure notice goes from :meth:`poll` once nothing of it is in flight)."""
        post, job = entry.group.post, entry.job
        try:
            if layers and post.state is PostState.IN_FLIGHT:
                runs = entry.plan.runs(entry.src_rank, entry.dst_rank, job.src_blocks, job.dst_blocks,
                                       first_token=job.first_token, num_tokens=job.num_tokens, layers=layers)
                items = [(entry.index(sp, dp), r) for sp, dp, r in runs]
                if items:
                    self.transport.add(post, items, deadline=job.post_deadline)
        except Exception as e:  # noqa: BLE001 - a failed layer fails the post, never the forward pass
            logger.error("DSAConnector: layer push of %s to rank %d failed: %s", job.req_id, entry.dst_rank, e)
            post.error = post.error or f"layer push failed: {e}"
            entry.todo.clear()
        entry.todo -= layers
        if entry.todo:
            return
        self._layers.remove(entry)
        if job.verify and not post.error:
            post.tag = encode(msgspec.structs.replace(entry.notice, checks=self._checks(entry.parts)))
        self.transport.close(post)

    def wake(self) -> None:
        """Something was posted or became ready: (start and) wake the progress thread, which polls the posts
        in flight and posts held pushes whose destination is ready (see the module docstring)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._progress_loop, daemon=True, name="dsa-send-progress")
            self._thread.start()
        self._wake.set()

    def _progress_loop(self) -> None:
        """While posts are in flight or pushes held, one :meth:`retry_waiting` + :meth:`poll` round under the
        worker lock every :func:`~.receiving.recv_poll_period` (0.2 ms, growing with the wait to 2 ms); idle
        otherwise."""
        busy_since: float | None = None
        while not self._stop.is_set():
            if not self._sends and not self._waiting and not self._unsent:
                busy_since = None
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            now = time.monotonic()
            if busy_since is None or self._wake.is_set():  # something new: poll fast again
                self._wake.clear()
                busy_since = now
            with self._lock:
                try:
                    self.retry_waiting()
                    self._resend_unsent()
                    self.poll()
                except Exception as e:  # noqa: BLE001 - keep the engine alive; its steps poll too
                    logger.warning("DSAConnector send progress: %s", e)
            time.sleep(recv_poll_period(now - busy_since))

    def stop(self) -> None:
        """Stop the progress thread (the worker closes the NIXL engine after)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _notify_failure(self, agent: str, d_req: str, error: str, since: float | None = None) -> bool:
        """Send D's request ``d_req`` a failure notice; one met by a connection being made again is kept and
        sent after the reconnect (:meth:`_resend_unsent`). Whether it went out."""
        rank = self._rank()
        try:
            self.transport.notify(agent, rank, encode(Notice(d_req, rank, False, error=error[:500])))
            return True
        except Exception as e:  # noqa: BLE001 - D waits for its fence timeout instead
            if isinstance(e, PeerReconnecting):
                self._schedule(agent)
                if len(self._unsent) >= MAX_UNSENT_NOTICES:
                    _, old_req, _, _ = self._unsent.popleft()
                    logger.warning("DSAConnector: %d failure notices wait for reconnects; dropped the one for %s",
                                   MAX_UNSENT_NOTICES, old_req)
                self._unsent.append((agent, d_req, error, time.monotonic() if since is None else since))
                logger.info("DSAConnector: failure notice for %s waits for the reconnect of %s", d_req, agent)
            else:
                logger.warning("DSAConnector: failure notice for %s not sent: %s", d_req, e)
            return False

    def _resend_unsent(self) -> None:
        """Send the kept failure notices whose destination is no longer being reconnected (each once more; one
        that meets a reconnect again is kept again), dropping those older than :data:`UNSENT_NOTICE_S`."""
        now = time.monotonic()
        for _ in range(len(self._unsent)):
            agent, d_req, error, since = self._unsent.popleft()
            if now - since > UNSENT_NOTICE_S or agent not in self.nixl.peers:
                logger.warning("DSAConnector: failure notice for %s dropped: its destination %s was not reachable "
                               "for %.0f s", d_req, agent, now - since)
            elif self.nixl.disconnected(agent):  # being made again, or backing off: its reconnect comes first
                self._schedule(agent)
                self._unsent.append((agent, d_req, error, since))
            elif self._notify_failure(agent, d_req, error, since):
                logger.info("DSAConnector: failure notice for %s sent after the reconnect of %s", d_req, agent)

    def poll(self) -> None:
        """Progress every post; a request whose posts are all over is finished_sending (once), a failed post
        sends its failure notice; then remove the retired agents no post uses any more."""
        self._poll_fences()
        for req_id, send in list(self._sends.items()):
            if send.waiting:
                continue  # nothing posted yet: retry_waiting posts or fails it
            for group in list(send.groups):
                if not self.transport.progress(group.post):
                    continue
                send.groups.remove(group)
                self._observe(group.post)
                if self.records:
                    self._record(req_id, group)
                if group.post.state is PostState.FAILED:  # every part is over: D may give up now
                    logger.error("DSAConnector: %s", group.post.error)
                    send.failed = True
                    if self.transport.fences.needed(group.agent):
                        send.fenced.add(group.agent)
                    self._notify_failure(group.agent, send.dst_req, group.post.error)
            if not send.groups and not any(self.transport.fences.pending_for(a) for a in send.fenced):
                # (a failure notice that went as a fence: the request is over once D got it, P steps meanwhile)
                del self._sends[req_id]
                self.stats.add("send_failed" if send.failed else "send_ok")
                if self.records:
                    self.stats.record(
                        {"req": req_id, "src_rank": self._rank(), "outcome": "failed" if send.failed else "ok"})
                if self.reported.add(req_id):
                    self._done.add(req_id)
        self.remove_retired()

    def _observe(self, post: Post) -> None:
        """Record one finished post: its NIXL descriptors, and (DONE) ONE ``transfer_s`` observation, the
        post's span from posting to its last part's completion (``Post.seconds``), whatever the route and
        however many WRITEs or copies it took (one per pool pair, per layer): one per (request, destination
        rank), the unit of NixlConnector's ``nixl_xfer_time`` (one READ per request and remote rank)."""
        for st in post.stats:
            if st.desc_count >= 0:
                self.stats.add("send_descriptors", st.desc_count)
        if post.state is PostState.DONE and (seconds := post.seconds) is not None:
            self.stats.observe("transfer_s", seconds)

    def _record(self, req_id: str, group: _Group) -> None:
        """One finished post's facts for the scheduler's record of ``req_id`` (:mod:`..record`)."""
        post = group.post
        seconds = post.seconds
        self.stats.record({
            "req": req_id, "src_rank": self._rank(), "dst_rank": group.rank, "route": post.path,
            "bytes": sum(st.total_bytes for st in post.stats), "runs": sum(st.num_runs for st in post.stats),
            "descriptors": sum(max(st.desc_count, 0) for st in post.stats),
            "post_to_done_ms": None if seconds is None else round(1000 * seconds, 3),
            "state": post.state.name.lower(), "error": post.error[:200]})

    def _poll_fences(self) -> None:
        """Confirm the fences of connections with an aborted WRITE (:mod:`~vllm_dsa_connector.core.transfer.fence`)
        and count them."""
        fences = self.transport.fences
        before = (fences.fenced, fences.resets)
        fences.poll()
        for agent in fences.unposted():  # a fence waits for a new connection: have it made
            self._schedule(agent)
        self.stats.add("fenced_connections", fences.fenced - before[0])
        self.stats.add("connection_resets", fences.resets - before[1])
        arena = self.transport.arena
        if arena is not None:  # a sample when it changed: the gauge, and whether D should route direct
            free = arena.free_bytes
            now = (arena.size - free, free < arena.size * _STAGING_FULL)
            if now != self._staging_last:
                self._staging_last = now
                self.stats.staging(self._rank(), *now)

    def release(self, req_ids: Iterable[str]) -> None:
        """P's scheduler released these leases without a push (expired): report each as finished_sending
        once, unless a push of it is still in flight (:meth:`poll` reports that one)."""
        for req_id in req_ids:
            if req_id not in self._sends and self.reported.add(req_id):
                self.stats.add("send_expired")
                self._done.add(req_id)

    def take_done(self) -> set[str]:
        """The requests finished_sending since the last call."""
        out, self._done = self._done, set()
        return out
