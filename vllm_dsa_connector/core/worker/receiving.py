"""Receive side of a DSAConnector worker (D): the transport's one receiver, with the connector's notices.

A :class:`ReceiveSide` is owned by an adapter's worker (vLLM's:
:class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker`; composition): the worker hands it
what it shares (the NIXL engine, the lock every NIXL call holds, its counters, its rank and KV pool regions, the
records of the engines that write to it) and delegates D's calls to it (:meth:`ReceiveSide.expect`,
:meth:`ReceiveSide.fail`, :meth:`ReceiveSide.poll`, :meth:`ReceiveSide.take_results`). The receiving itself
is :class:`vllm_dsa_connector.core.transfer.receiver.Receiver` (the one tested by the transport tests): a
``RecvJob`` arms it with the source ranks expected by this rank (writers), each with the NIXL agent its
notifications must come from and, when the scheduler gave it a staging slot, the runs to scatter (from the
peer's plan, built once at the handshake). Every source rank's notification is
``dsa1:<path><rank>:<Notice>`` whatever the path; this module supplies the receiver's hooks: the tag is a
:class:`~vllm_dsa_connector.core.handoff.wire.Notice` keyed by D's request id (:meth:`ReceiveSide.split`),
a malformed notice is ignored, a failed or invalid one (any field out of range, checksum entries that
are not the runs the plan expects) fails its writer (:meth:`ReceiveSide.admit`), and with
``verify_transfers`` the landed bytes are checksummed (:meth:`ReceiveSide.landed`; a mismatch makes the
request CORRUPT: its blocks go through ``get_block_ids_with_load_errors``, vLLM's block-level path, so
``kv_load_failure_policy`` decides). ``finished_recving`` when the request settles; ``failed_recving`` too
when it FAILED or TIMED_OUT. Give-ups are the scheduler's decision (``fail_recv`` cancels); the job's own
timeout is only a safety net.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from vllm_dsa_connector.core.handoff.wire import (
    NOTICE_PREFIX,
    Notice,
    RankPayload,
    RecvJob,
    decode_notice,
    route_of,
)
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.receiver_data import RecvState, Verdict, WriterSpec
from vllm_dsa_connector.core.worker.counters import Counters, failure_key
from vllm_dsa_connector.core.worker.pool_bytes import crc_runs

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
    from vllm_dsa_connector.core.transfer.nixl.data import Region
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.staging import StagingArena

logger = logging.getLogger(__name__)

# Receiver progress period while transfers are expected: 0.2 ms at first (a WRITE into this worker completes
# only when the target progresses too), growing with the wait (5% of it) up to 2 ms (9.9 MB over CMA took
# 1.3 ms at a 2 ms period). A fixed 0.2 ms made every waiting D worker burn a core on NIXL progress: on a
# 2-core host two waiting tp2 D workers starved the P they waited for ("did not answer 'reg' within 10 s").
_RECV_POLL_S = 0.0002
_RECV_POLL_MAX_S = 0.002
_RECV_POLL_GROWTH = 0.05


def recv_poll_period(waited_s: float) -> float:
    """Seconds between two receiver progress calls after ``waited_s`` of waiting for an expected WRITE."""
    return min(_RECV_POLL_MAX_S, max(_RECV_POLL_S, waited_s * _RECV_POLL_GROWTH))


class ReportedIds:
    """Request ids already reported to vLLM (bounded: the oldest are forgotten): nothing is reported twice."""

    def __init__(self, cap: int = 65536) -> None:
        self._ids: dict[str, None] = {}
        self._cap = cap

    def add(self, req_id: str) -> bool:
        """Record ``req_id``; False when it was reported before."""
        if req_id in self._ids:
            return False
        self._ids[req_id] = None
        if len(self._ids) > self._cap:
            del self._ids[next(iter(self._ids))]
        return True

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._ids


class SourceRecord(Protocol):
    """What D knows of an engine that writes to it (the worker's record of that peer start)."""

    @property
    def payloads(self) -> list[RankPayload]:
        """The peer's worker payloads (their NIXL agent names)."""

    @property
    def plan(self) -> PeerPlan | None:
        """The transfer plan from the peer to this engine (None: the peer was refused)."""

    @property
    def epoch(self) -> int:
        """The peer start these payloads belong to."""


class ReceiveSide:
    """D's receiving for one worker rank: arms the transport's :class:`Receiver` (:attr:`receiver`) for each
    ``RecvJob``, supplies its hooks, progresses it from a thread while receives are expected, and keeps what
    is to be reported to vLLM (finished and failed loads, blocks of corrupt ones).

    ``nixl`` and ``lock``: the worker's NIXL engine and the lock every NIXL call holds (the progress thread
    takes it too); ``stats``: the worker's counters; ``rank`` and ``regions``: this rank and its registered KV
    pools (read when needed: both are known only once the worker registered its caches); ``sources``: the
    worker's records of the engines that write to it, by engine id (the worker keeps them current);
    ``fence_timeout_s``: how long a given-up load waits for P's fence at most (option ``fence_timeout_s``).
    """

    def __init__(self, nixl: NixlEngine, lock: threading.RLock, stats: Counters, *,
                 rank: Callable[[], int], regions: Callable[[], Sequence[Region]],
                 sources: Mapping[str, SourceRecord], fence_timeout_s: float = 960.0) -> None:
        self._lock = lock
        self.fence_timeout_s = fence_timeout_s
        self.stats = stats
        self._rank = rank
        self._regions = regions
        self.sources = sources
        self.receiver = Receiver(nixl, hooks=self)
        self.reported = ReportedIds()  # loads reported to vLLM (finished_recving), each once
        self._done: set[str] = set()  # finished_recving since the last take_results
        self._failed: set[str] = set()  # failed_recving since the last take_results
        self._fencing: set[str] = set()  # given up, reported once P fenced (or after fence_timeout_s)
        self._error_blocks: set[int] = set()  # blocks of CORRUPT loads since the last take_error_blocks
        self._progress_stop = threading.Event()
        self._progress_wake = threading.Event()
        self._progress_thread: threading.Thread | None = None
        self.records = False  # hand the scheduler per-request facts (connector.record; set by the worker)

    def _failed_load(self, req_id: str, reason: str, detail: str) -> None:
        """A load this worker saw fail (``reason``: of :data:`~vllm_dsa_connector.core.handoff.recompute.REASONS`):
        counted by reason once, logged with the fix's pointer, and handed to the scheduler's record."""
        self.stats.add(failure_key(reason))
        logger.info("DSAConnector: request %s not loaded from P (reason %s: %s); kv_load_failure_policy "
                       "applies; fix: vllm-dsa explain %s", req_id, reason, detail[:300], reason)
        if self.records:
            self.stats.record(
                {"req": req_id, "dst_rank": self._rank(), "outcome": "failed", "reason": reason,
                 "detail": detail[:200]})

    def attach_arena(self, arena: StagingArena) -> Region:
        """Register ``arena`` as the staging buffer bounced writes land in (its region goes in the payload)."""
        return self.receiver.attach(arena)

    # ---------------------------------------------------------------- the receiver's hooks

    def split(self, tag: bytes) -> tuple[bytes, Notice] | None:
        """A notification's tag is an encoded :class:`Notice`: keyed by D's request id."""
        n = decode_notice(NOTICE_PREFIX + tag)
        return (n.req_id.encode(), n) if n is not None else None

    def admit(self, job: RecvJob, writer: int, n: Notice) -> tuple[Verdict, str]:
        """Fail the writer on a failure notice or on a notice with any field out of range (its rank, counts,
        and with ``verify`` every checksum entry: exactly the runs D's plan expects from that rank, each
        inside its pool). The notification came from the writer's own agent (the receiver checked): a bad
        notice is that writer's failure, never ignored and never a crash in the engine's step."""
        problem = self._notice_problem(job, writer, n)
        if problem:
            logger.error("DSAConnector: %s: bad notice from rank %d: %s", job.req_id, writer, problem)
            return Verdict.FAIL, f"bad notice from rank {writer}: {problem}"
        if not n.ok:
            return Verdict.FAIL, n.error[:500] or "sender reported a failure"
        return Verdict.ACCEPT, ""

    def _notice_problem(self, job: RecvJob, writer: int, n: Notice) -> str:
        """What is wrong with notice ``n`` of ``writer`` for ``job`` (``""``: nothing), naming field and value."""
        if n.src_rank != writer:
            return f"src_rank {n.src_rank} != the notification's writer {writer}"
        if n.req_id != job.req_id:
            return f"req_id {n.req_id[:80]!r} != the armed request {job.req_id!r}"
        if not n.ok:
            return ""
        if n.nbytes < 0 or n.runs < 0:
            return f"nbytes {n.nbytes} / runs {n.runs}: counts must be >= 0"
        if not job.verify:
            return ""
        if len(n.checks) != n.runs:
            return f"{len(n.checks)} checksum entries for runs {n.runs}"
        total = 0
        regions = self._regions()
        for i, (pool, off, length, crc) in enumerate(n.checks):
            size = regions[pool].size if 0 <= pool < len(regions) else None
            if size is None:
                return f"checks[{i}]: pool {pool} not in 0..{len(regions) - 1}"
            if off < 0 or length <= 0 or off + length > size:
                return f"checks[{i}]: [offset {off}, length {length}) outside pool {pool} ({size} B)"
            if not 0 <= crc <= 0xFFFFFFFF:
                return f"checks[{i}]: crc32 {crc} out of range"
            total += length
        if total != n.nbytes:
            return f"checksum entries cover {total} B, nbytes {n.nbytes}"
        return self._expected_checks_problem(job, writer, n)

    def _expected_checks_problem(self, job: RecvJob, writer: int, n: Notice) -> str:
        """``""`` when the checksum entries name exactly the (pool, offset, length) runs of D's plan for
        ``writer`` (the sender's plan is the same one); else what differs. Without a plan nothing can be checked."""
        remote = self.sources.get(job.src_engine)
        if remote is None or remote.plan is None:
            return f"no transfer plan for {job.src_engine!r} to check the checksums against"
        try:
            parts = remote.plan.runs(writer, self._rank(), job.src_blocks, job.blocks,
                                     first_token=job.first_token, num_tokens=job.num_tokens)
        except Exception as e:  # noqa: BLE001 - the load fails, the step goes on
            return f"runs of rank {writer}: {e}"
        want = [(dp, int(o), int(ln)) for _, dp, runs in parts
                for o, ln in zip(runs.dst_offsets, runs.lengths, strict=True)]
        got = [(pool, off, length) for pool, off, length, _ in n.checks]
        if job.early:
            # D names P's blocks only by stand-ins before an early registration: P's runs are cut by P's real
            # blocks, so compare the destination bytes they cover (the same bytes, once each), not the cut
            if sum(x[2] for x in got) == sum(x[2] for x in want) and _coverage(got) == _coverage(want):
                return ""
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                         min(len(got), len(want)))
            return (f"checksum entries differ from the expected runs at entry {first} (notice "
                    f"{got[first] if first < len(got) else None}, expected {want[first] if first < len(want) else None}; "
                    f"{len(got)} vs {len(want)} runs)")
        return ""

    def landed(self, job: RecvJob, writer: int, n: Notice) -> bool:
        """Count the bytes; with ``verify`` check every run's CRC32 (``False``: corrupt). :meth:`admit` has
        validated every entry against the pools and the plan."""
        self.stats.add("recv_bytes", n.nbytes)
        self.stats.add_pair_bytes("recv", n.src_rank, self._rank(), n.nbytes)
        self.stats.add("recv_runs", n.runs)
        if self.records:
            self.stats.record(
                {"req": job.req_id, "src_rank": n.src_rank, "dst_rank": self._rank(), "bytes": n.nbytes,
                 "runs": n.runs})
        if not job.verify:
            return True
        ok = True
        by_pool: dict[int, list[tuple[int, int, int]]] = {}
        for pool, off, length, crc in n.checks:
            by_pool.setdefault(pool, []).append((off, length, crc))
        regions = self._regions()
        for pool, runs in by_pool.items():
            got = crc_runs(regions[pool].tensor, [r[0] for r in runs], [r[1] for r in runs])
            self.stats.add("checksummed_runs", len(runs))
            if any(g != r[2] for g, r in zip(got, runs, strict=True)):
                ok = False
        if not ok:
            self.stats.add("checksum_mismatches")
            logger.error("DSAConnector: checksum mismatch in %s from rank %d", n.req_id, n.src_rank)
        return ok

    # ---------------------------------------------------------------- arming and polling

    def _receiver_progress(self) -> None:
        """While receives are expected, progress NIXL every ``_RECV_POLL_S``: a WRITE into this worker
        completes only when the TARGET progresses too (measured, 9.9 MB over CMA: 9.4 ms when D polled
        every 10 ms, 1.3 ms every 2 ms), and the engine polls only between its steps; the period grows with
        the wait (:data:`_RECV_POLL_MAX_S`). Idle otherwise."""
        busy_since: float | None = None
        while not self._progress_stop.is_set():
            if not self.receiver.busy:
                busy_since = None
                self._progress_wake.wait(0.05)
                self._progress_wake.clear()
                continue
            now = time.monotonic()
            if busy_since is None or self._progress_wake.is_set():  # a new expectation: poll fast again
                self._progress_wake.clear()
                busy_since = now
            with self._lock:
                try:
                    self.receiver.pump()
                except Exception as e:  # noqa: BLE001 - keep the engine alive; the main thread polls too
                    logger.warning("DSAConnector receiver progress: %s", e)
            time.sleep(recv_poll_period(now - busy_since))

    def _source_agent(self, engine: str, rank: int, epoch: int = 0) -> str | None:
        """The NIXL agent of ``engine``'s ``rank`` in its start ``epoch`` (0: any); None when unknown."""
        remote = self.sources.get(engine)
        if remote is None or (epoch and remote.epoch != epoch):
            return None
        return next((p.agent_name for p in remote.payloads if p.rank == rank), None)

    def _writer(self, job: RecvJob, src_rank: int) -> WriterSpec:
        """What this rank expects from ``src_rank``: its agent, the route D chose for the pair and, for a
        bounce, where each part lies in the slot and where it is scattered to."""
        me = self._rank()
        # "": an unknown engine's (or another start's of it) notices never match
        peer = self._source_agent(job.src_engine, src_rank, job.src_epoch) or ""
        route = route_of(job.routes, me, src_rank)
        if route is None or route.path == PathName.IPC:
            return WriterSpec(peer=peer, path=PathName(route.path) if route else PathName.DIRECT)
        where = (int(route.offset), int(route.size))
        remote = self.sources.get(job.src_engine)
        if remote is None or remote.plan is None or self.receiver.arena is None:
            return WriterSpec(peer=peer, slot=where, path=PathName.BOUNCE,
                              error=f"bounced write from rank {src_rank} without a staging arena / peer plan")
        try:
            parts = remote.plan.runs(src_rank, me, job.src_blocks, job.blocks, first_token=job.first_token,
                                     num_tokens=job.num_tokens)
        except Exception as e:  # noqa: BLE001 - a bounced write then fails this writer
            return WriterSpec(peer=peer, slot=where, path=PathName.BOUNCE, error=f"runs of rank {src_rank}: {e}")
        regions = self._regions()
        spec = WriterSpec.for_bounce(peer, where, [(regions[dp].tensor, runs) for _, dp, runs in parts])
        return replace(spec, error=f"bounced write from rank {src_rank}: {spec.error}") if spec.error else spec

    def expect(self, job: RecvJob) -> None:
        """Arm the receiver for ``job``: the writers this rank expects, each with its route."""
        writers = {int(r): self._writer(job, int(r)) for r in job.expected.get(self._rank(), ())}
        key = job.req_id.encode()
        if key in self.receiver.pending:
            logger.warning("DSAConnector: %s expected twice; the first expectation is replaced", job.req_id)
            self.receiver.cancel(key)
        self.receiver.arm(key, writers, timeout_s=job.timeout_s, context=job)
        if self._progress_thread is None:
            self._progress_thread = threading.Thread(target=self._receiver_progress, daemon=True,
                                                     name="dsa-recv-progress")
            self._progress_thread.start()
        self._progress_wake.set()

    def fail(self, req_id: str, *, fence: bool = True) -> bool:
        """The scheduler gave the load of ``req_id`` up (``fail_recv``): stop expecting it and report it
        finished and failed; False when it was reported already (it completed meanwhile).

        ``fence``: a WRITE of P may still be in flight (P did not say it never posted): the report, which
        hands the blocks back to vLLM, waits until every writer that sent nothing yet sent its notice (P sends
        it only after fencing the connection, :mod:`~vllm_dsa_connector.core.transfer.fence`), at most
        ``fence_timeout_s``; :meth:`poll` reports it then."""
        key = req_id.encode()
        if fence and req_id not in self.reported and self.receiver.give_up(key, self.fence_timeout_s) is None \
                and key in self.receiver.pending:
            self._fencing.add(req_id)
            return True
        self.receiver.cancel(key)
        if not self.reported.add(req_id):
            return False
        self.stats.add("recv_failed")
        self._done.add(req_id)
        self._failed.add(req_id)
        return True

    def unfence(self, req_id: str) -> None:
        """The given-up load of ``req_id`` stops waiting for P's fence: P's start is gone (nothing of it can
        land any more), so it is reported finished and failed now."""
        if req_id not in self._fencing:
            return
        self._fencing.discard(req_id)
        self.receiver.cancel(req_id.encode())
        if self.reported.add(req_id):
            self.stats.add("recv_failed")
            self.stats.add("fence_peer_gone")
            self._done.add(req_id)
            self._failed.add(req_id)
            logger.info("DSAConnector: given-up load of %s handed back: its P is gone (no fence needed)", req_id)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call."""
        out = (self._done, self._failed)
        self._done, self._failed = set(), set()
        return out

    def take_error_blocks(self) -> set[int]:
        """Blocks whose checksum did not match since the last call (each reported once)."""
        out, self._error_blocks = self._error_blocks, set()
        return out

    def stop(self) -> None:
        """Stop the progress thread (the worker closes the NIXL engine after)."""
        self._progress_stop.set()
        self._progress_wake.set()
        if self._progress_thread is not None:
            self._progress_thread.join(timeout=2)

    def poll(self) -> None:
        """Progress the receiver and record the loads that settled (the caller holds the lock)."""
        self.receiver.pump()
        if self.receiver.other:  # notifications not of the transport's format: not ours
            logger.debug("DSAConnector: %d foreign notifications dropped", len(self.receiver.other))
            self.receiver.other.clear()
        for r in self.receiver.collect():
            job: RecvJob = r.context
            req_id = job.req_id
            if not self.reported.add(req_id):
                continue
            self._done.add(req_id)
            if req_id in self._fencing:  # given up: reported failed once no byte of P can land any more
                self._fencing.discard(req_id)
                fenced = r.state is not RecvState.TIMED_OUT
                self.stats.add("recv_failed")
                self.stats.add("fenced_loads" if fenced else "fence_timeouts")
                self._failed.add(req_id)
                (logger.info if fenced else logger.error)(
                    "DSAConnector: given-up load of %s handed back %s", req_id,
                    "after P fenced its connection" if fenced else
                    f"after {self.fence_timeout_s:.0f} s without P's fence (a late WRITE may still land)")
                continue
            if r.state is RecvState.TIMED_OUT:
                logger.error("DSAConnector: %s timed out after %.1f s waiting for rank(s) %s",
                             req_id, job.timeout_s, list(r.missing))
                self.stats.add("recv_timeout")
                self._failed.add(req_id)
                self._failed_load(req_id, "timeout", f"no notice from rank(s) {list(r.missing)} in "
                                  f"{job.timeout_s:.1f} s")
            elif r.state is RecvState.FAILED:
                logger.error("DSAConnector: load of %s failed: %s", req_id, r.reason)
                self.stats.add("recv_failed")
                self._failed.add(req_id)
                self._failed_load(req_id, "p_failed", r.reason)
            elif r.state is RecvState.CORRUPT:
                self.stats.add("recv_failed")
                self._error_blocks.update(job.blocks)
                self._failed_load(req_id, "checksum", "verify_transfers: checksum mismatch")
            else:
                self.stats.add("recv_ok")
                self.stats.observe("recv_wait_s", r.waited_s)


def _coverage(entries: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The destination byte ranges ``(pool, start, end)`` that ``(pool, offset, length)`` entries cover,
    sorted, adjacent ones joined."""
    out: list[tuple[int, int, int]] = []
    for pool, off, length in sorted(entries):
        if out and out[-1][0] == pool and out[-1][2] == off:
            out[-1] = (pool, out[-1][1], off + length)
        else:
            out.append((pool, off, off + length))
    return out
