"""Worker side of DSAConnector: register the KV pools with NIXL, WRITE (P) and await notices (D).

The worker knows its KV cache only as a :class:`~vllm_dsa_connector.layout.PageTable` (pools + per-role
views, MLA latent AND indexer K), so the indexer pages, for which vLLM's per-layer hooks never fire, move
with everything else: a transfer is the plan's byte runs (``matching.expand_runs``: merged where
contiguous on both sides), not a per-layer loop.

P (sender): a ``PushJob`` becomes, per destination rank this rank feeds in the plan, one NIXL WRITE of the
merged runs whose notification carries a :class:`~.metadata.Notice` (bytes, runs, and with
``verify_transfers`` a CRC32 per run). ``finished_sending`` is reported once every WRITE of the request
completed or failed; a failed WRITE also sends a failure notice so D does not wait for its timeout.

D (receiver): a ``RecvJob`` lists the source ranks expected per local rank. ``finished_recving`` when
all notices arrived; ``failed_recving`` too when one reports a failure or ``timeout_s`` passes. A
checksum mismatch reports the request's blocks through ``get_block_ids_with_load_errors`` (vLLM's
block-level path), so ``kv_load_failure_policy`` decides: recompute them or fail the request.
"""

from __future__ import annotations

import ctypes
import time
import uuid
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_dsa_connector.connector.handshake import HandshakeError, validate_peer
from vllm_dsa_connector.connector.metadata import (
    DSAConnectorMetadata,
    DSAHandshakeMetadata,
    Notice,
    PeerInfo,
    PushJob,
    RankPayload,
    RecvJob,
    decode_notice,
    decode_payload,
    encode,
    encode_notice,
)
from vllm_dsa_connector.connector.options import ConnectorOptions
from vllm_dsa_connector.connector.stats import DSAKVConnectorStats

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

_SPIN_S = 0.05  # after posting, poll the WRITEs this long before handing them to the engine's steps


def crc_at(addr: int, length: int) -> int:
    """CRC32 of ``length`` bytes of this process's memory at ``addr``."""
    return zlib.crc32(memoryview((ctypes.c_char * length).from_address(addr)))


def pool_tensor(kv_caches: dict[str, torch.Tensor], base_ptr: int, nbytes: int) -> torch.Tensor:
    """A contiguous uint8 tensor over ``[base_ptr, base_ptr + nbytes)`` of the KV caches' storage."""
    for t in kv_caches.values():
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start <= base_ptr and base_ptr + nbytes <= start + storage.nbytes():
            full = torch.empty(0, dtype=torch.uint8, device=t.device)
            full.set_(storage, 0, (storage.nbytes(),))
            return full[base_ptr - start : base_ptr - start + nbytes]
    raise ValueError(f"no KV cache tensor covers pool [{base_ptr:#x}, +{nbytes})")


@dataclass
class _Send:
    req_id: str
    dst_req: str
    xfers: list[tuple[Any, str, int]] = field(default_factory=list)  # (xfer, agent, dst rank)
    failed: bool = False


@dataclass
class _Recv:
    job: RecvJob
    pending: set[int]
    deadline: float
    started: float
    error: str = ""
    mismatch: bool = False


@dataclass
class _RemoteEngine:
    payloads: list[RankPayload]
    agents: dict[int, str]  # rank -> NIXL agent name
    plan: Any = None
    error: str = ""


class DSAConnectorWorker:
    """Connector worker state for one (pp, tp) rank."""

    def __init__(self, engine_id: str, options: ConnectorOptions, compat: dict[str, str]) -> None:
        from vllm_dsa_connector.transport.engine import NixlEngine

        self.engine_id = engine_id
        self.opts = options
        self.compat = dict(compat)
        self.nixl = NixlEngine(f"dsa-{engine_id}-{uuid.uuid4().hex[:8]}", (options.nixl_backend,),
                               telemetry=True)
        self.table: Any = None
        self.regions: list[Any] = []
        self.payload: RankPayload | None = None
        self.local: list[RankPayload] = []
        self.remotes: dict[str, _RemoteEngine] = {}
        self.stats = DSAKVConnectorStats()
        self._sends: dict[str, _Send] = {}
        self._done_sending: set[str] = set()
        self._recvs: dict[str, _Recv] = {}
        self._early: dict[str, list[tuple[float, Notice]]] = defaultdict(list)
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._error_blocks: set[int] = set()

    # ---------------------------------------------------------------- set-up

    def register(self, kv_caches: dict[str, torch.Tensor], table: Any) -> RankPayload:
        """Register every pool of ``table`` (views into ``kv_caches``) and build the handshake payload."""
        self.table = table
        self.regions = [self.nixl.register(pool_tensor(kv_caches, p.base_ptr, p.nbytes)) for p in table.pools]
        self.payload = RankPayload(
            engine_id=self.engine_id, rank=table.rank, pp_rank=table.pp_rank, tp_rank=table.tp_rank,
            agent_name=self.nixl.name, agent_metadata=self.nixl.metadata(), page_table=table.to_dict(),
            regions=[r.desc().to_dict() for r in self.regions], compat=self.compat)
        logger.info("DSAConnector %s rank %d: registered %d pool(s), %d B/block, views %s",
                    self.engine_id, table.rank, len(self.regions), table.bytes_per_block,
                    [(v.role.value, len(v.entries)) for v in table.views])
        return self.payload

    def handshake_metadata(self) -> DSAHandshakeMetadata:
        """vLLM's container for this rank's payload."""
        assert self.payload is not None, "register_kv_caches first"
        return DSAHandshakeMetadata(encode(self.payload))

    def _learn(self, peer: PeerInfo) -> None:
        payloads = sorted((decode_payload(p) for p in peer.payloads), key=lambda p: p.rank)
        remote = _RemoteEngine(payloads, {})
        try:
            remote.plan = validate_peer(self.local or [self.payload], payloads)
            for p in payloads:
                remote.agents[p.rank] = self.nixl.add_peer(p.agent_metadata)
        except (HandshakeError, Exception) as e:  # noqa: BLE001 - refuse the peer, keep serving
            remote.error = str(e)
            logger.error("DSAConnector %s: peer %s refused: %s", self.engine_id, peer.engine_id, e)
        self.remotes[peer.engine_id] = remote

    # ---------------------------------------------------------------- per step

    def start_load_kv(self, meta: DSAConnectorMetadata) -> None:
        """Apply the scheduler's step metadata: learn peers, post WRITEs, arm receive expectations."""
        if meta.local is not None:
            self.local = sorted((decode_payload(p) for p in meta.local.payloads), key=lambda p: p.rank)
        for peer in meta.peers:
            self._learn(peer)
        for job in meta.push:
            self._push(job)
        if meta.push:
            self._progress_sends()
        for job in meta.recv:
            self._expect(job)
        for req_id, reason in meta.fail_recv.items():
            self._recvs.pop(req_id, None)
            logger.error("DSAConnector: load of %s failed: %s", req_id, reason)
            self.stats.add("recv_failed")
            self._done_recving.add(req_id)
            self._failed_recving.add(req_id)
        for req_id in meta.release:
            if req_id not in self._sends:
                self.stats.add("send_expired")
                self._done_sending.add(req_id)

    def _push(self, job: PushJob) -> None:
        from vllm_dsa_connector.layout import PageTable
        from vllm_dsa_connector.matching import expand_runs

        send = _Send(job.req_id, job.dst_req_id)
        self._sends[job.req_id] = send
        remote = self.remotes.get(job.dst_engine)
        me = self.table.rank
        if remote is None or remote.error:
            logger.error("DSAConnector: cannot push %s to %s: %s", job.req_id, job.dst_engine,
                         remote.error if remote else "unknown peer")
            send.failed = True
            return
        src_blocks = np.asarray(job.src_blocks, np.int64)
        dst_blocks = np.asarray(job.dst_blocks, np.int64)
        for dst in remote.payloads:
            segs = remote.plan.for_pair(me, dst.rank)
            if not segs:
                continue
            agent = remote.agents[dst.rank]
            try:
                dst_table = PageTable.from_dict(dst.page_table)
                pool_runs = expand_runs(segs, self.table, dst_table, src_blocks, dst_blocks)
                self._write(job, send, dst, agent, pool_runs)
            except Exception as e:  # noqa: BLE001 - a failed WRITE is a failed transfer, never a crash
                logger.error("DSAConnector: push %s -> %s rank %d failed: %s", job.req_id, job.dst_engine,
                             dst.rank, e)
                send.failed = True
                self._notify_failure(agent, job.dst_req_id, str(e))

    def _write(self, job: PushJob, send: _Send, dst: RankPayload, agent: str, pool_runs: list[Any]) -> None:
        """One WRITE per (source pool, destination pool); the notice rides on the last one."""
        from vllm_dsa_connector.transport.runs import merge_runs

        checks: list[tuple[int, int, int, int]] = []
        nbytes = sum(pr.total_bytes for pr in pool_runs)
        nruns = 0
        for k, pr in enumerate(pool_runs):
            # sorted merge: blocks listed out of order (vLLM's free list hands them out in reverse) and
            # layer-outermost layouts (one page per layer per block) still collapse into long runs
            runs = merge_runs(pr.src_offsets, pr.dst_offsets, pr.lengths)
            region = self.regions[pr.src_pool]
            if job.verify:
                checks.extend(
                    (pr.dst_pool, int(o), int(n), crc_at(region.addr + int(a), int(n)))
                    for a, o, n in zip(runs.src_offsets, runs.dst_offsets, runs.lengths, strict=True)
                )
            nruns += runs.num_runs
            last = k == len(pool_runs) - 1
            notice = b""
            if last:
                notice = encode_notice(Notice(job.dst_req_id, self.table.rank, True, nbytes, nruns,
                                              checks=checks))
            xfer = self.nixl.write(agent, region, dst.regions[pr.dst_pool], runs, notice)
            if not last:  # earlier WRITEs must be complete before the notice goes out
                self.nixl.wait(xfer, self.opts.transfer_timeout_s)
            else:
                send.xfers.append((xfer, agent, dst.rank))
        self.stats.add("send_bytes", nbytes)
        self.stats.add("send_runs", nruns)

    def _progress_sends(self) -> None:
        """Drive the just-posted WRITEs for up to ``_SPIN_S``: NIXL runs without a progress thread
        (it would busy-poll a core the engine needs), so UCX copies only while someone polls; without
        this the copy would wait for the next engine step."""
        deadline = time.perf_counter() + _SPIN_S
        while time.perf_counter() < deadline:
            if all(self.nixl.state(x) != "PROC" for s in self._sends.values() for x, _, _ in s.xfers):
                return

    def _notify_failure(self, agent: str, d_req: str, error: str) -> None:
        try:
            self.nixl.send_notification(agent, encode_notice(Notice(d_req, self.table.rank, False,
                                                                    error=error[:500])))
        except Exception as e:  # noqa: BLE001 - D times out instead
            logger.warning("DSAConnector: failure notice for %s not sent: %s", d_req, e)

    def _expect(self, job: RecvJob) -> None:
        me = self.table.rank
        now = time.monotonic()
        state = _Recv(job, set(job.expected.get(me, ())), now + job.timeout_s, now)
        self._recvs[job.req_id] = state
        for _, notice in self._early.pop(job.req_id, ()):
            self._apply(state, notice)

    def _apply(self, state: _Recv, n: Notice) -> None:
        if n.src_rank not in state.pending:
            logger.warning("DSAConnector: unexpected notice for %s from rank %d", n.req_id, n.src_rank)
            return
        state.pending.discard(n.src_rank)
        if not n.ok:
            state.error = n.error or "sender reported a failure"
            return
        self.stats.add("recv_bytes", n.nbytes)
        self.stats.add("recv_runs", n.runs)
        if state.job.verify:
            if not n.checks and n.nbytes:
                state.mismatch = True
                logger.error("DSAConnector: %s: sender sent no checksums", n.req_id)
            for pool, off, length, crc in n.checks:
                region = self.regions[pool] if 0 <= pool < len(self.regions) else None
                if region is None or off < 0 or off + length > region.size:
                    state.mismatch = True
                    continue
                self.stats.add("checksummed_runs")
                if crc_at(region.addr + off, length) != crc:
                    state.mismatch = True
            if state.mismatch:
                self.stats.add("checksum_mismatches")
                logger.error("DSAConnector: checksum mismatch in %s from rank %d", n.req_id, n.src_rank)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._poll_sends()
        self._poll_recvs()
        out = (self._done_sending, self._done_recving, self._failed_recving)
        self._done_sending, self._done_recving, self._failed_recving = set(), set(), set()
        return out

    def _poll_sends(self) -> None:
        from vllm_dsa_connector.transport.engine import TransferError

        now = time.perf_counter()
        for req_id, send in list(self._sends.items()):
            remaining = []
            for xfer, agent, rank in send.xfers:
                state = self.nixl.state(xfer)
                if state == "PROC" and now - xfer.started < self.opts.transfer_timeout_s:
                    remaining.append((xfer, agent, rank))
                    continue
                try:
                    st = self.nixl.wait(xfer, self.opts.transfer_timeout_s)
                    secs = st.xfer_us / 1e6 if st.xfer_us >= 0 else st.seconds
                    self.stats.observe("transfer_s", secs)
                    if st.desc_count >= 0:
                        self.stats.add("send_descriptors", st.desc_count)
                except TransferError as e:
                    logger.error("DSAConnector: %s", e)
                    send.failed = True
                    self._notify_failure(agent, send.dst_req, str(e))
            send.xfers = remaining
            if not remaining:
                del self._sends[req_id]
                self.stats.add("send_failed" if send.failed else "send_ok")
                self._done_sending.add(req_id)

    def _poll_recvs(self) -> None:
        now = time.monotonic()
        for _peer, msg in self.nixl.poll_notifications():
            n = decode_notice(msg)
            if n is None:
                continue
            state = self._recvs.get(n.req_id)
            if state is None:
                self._early[n.req_id].append((now, n))
                continue
            self._apply(state, n)
        for req_id in [r for r, v in self._early.items() if v and now - v[0][0] > 600]:
            del self._early[req_id]
        for req_id, state in list(self._recvs.items()):
            if state.pending and now < state.deadline:
                continue
            del self._recvs[req_id]
            self._done_recving.add(req_id)
            if state.pending:
                logger.error("DSAConnector: %s timed out after %.1f s waiting for rank(s) %s",
                             req_id, state.job.timeout_s, sorted(state.pending))
                self.stats.add("recv_timeout")
                self._failed_recving.add(req_id)
            elif state.error:
                logger.error("DSAConnector: load of %s failed: %s", req_id, state.error)
                self.stats.add("recv_failed")
                self._failed_recving.add(req_id)
            elif state.mismatch:
                self.stats.add("recv_failed")
                self._error_blocks.update(state.job.blocks)
            else:
                self.stats.add("recv_ok")
                self.stats.observe("recv_wait_s", now - state.started)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose checksum did not match (reported once)."""
        out, self._error_blocks = self._error_blocks, set()
        return out

    def get_stats(self) -> DSAKVConnectorStats | None:
        """Stats since the last call, or None when nothing happened."""
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        """Release NIXL resources."""
        self.nixl.close()
