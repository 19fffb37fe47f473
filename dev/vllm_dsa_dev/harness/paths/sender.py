"""The writer of the bounce transport: gate, gather into the local arena, one WRITE into the receiver's
slot (or a direct WRITE of the runs).

Both sides must describe a writer's transfer with the same :class:`Runs`; both merge it with
:meth:`Runs.merged` (deterministic), which fixes the packed order in the staging slot.

Two more paths for :meth:`BounceSender.send` (chosen by :meth:`~.links.PathChooser.choose` when the caller
lists them, or forced): ``pipelined`` cuts the packed stream into chunks (:func:`plan_chunks`), gathers them
back to back and posts each chunk's WRITE as soon as its gather finished; the receiver scatters each
chunk when its notification arrives, so gather, wire and scatter overlap across GPUs or nodes.
``ipc`` (same node): see :mod:`.ipc_send`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs, plan_chunks
from vllm_dsa_connector.core.transfer.copy.local_copy import gather, sync
from vllm_dsa_connector.core.transfer.gate import BounceGate, Decision
from vllm_dsa_connector.core.transfer.nixl.data import (
    Region,
    RegionDesc,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_chunk_notif, encode_notif
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import DirectTransport, Part, Post, check_deadline
from vllm_dsa_dev.harness.paths.ipc_send import IPC_SIGNALS, EventPool, IpcSendPath
from vllm_dsa_dev.harness.paths.links import PathChooser
from vllm_dsa_dev.harness.paths.sends import Send, event_done, record_event

logger = logging.getLogger(__name__)

__all__ = ["BounceSender", "BounceTransport"]


class BounceSender(IpcSendPath):
    """Writer side: gate, gather into the local arena, one WRITE into the receiver's slot (or direct).

    Also the ``pipelined`` (chunked bounce) and ``ipc`` (one kernel through a mapping) paths.
    """

    def __init__(
        self,
        engine: NixlEngine,
        arena: StagingArena,
        gate: BounceGate | PathChooser,
        reserve_timeout_s: float | None = None,
        ipc_signal: str = "event",
    ) -> None:
        if ipc_signal not in IPC_SIGNALS:
            raise ValueError(f"BounceSender: ipc_signal must be one of {IPC_SIGNALS}; got {ipc_signal!r}")
        self.engine = engine
        self.arena = arena
        # the bounce/direct gate, and the chooser of every path over a link (``paths=`` of :meth:`send`)
        self.chooser = gate if isinstance(gate, PathChooser) else PathChooser(gate)
        self.gate = self.chooser.gate
        self.reserve_timeout_s = (
            self.gate.settings.reserve_timeout_s if reserve_timeout_s is None else reserve_timeout_s
        )
        self.region = engine.register(arena.buffer)
        self.ipc_signal = ipc_signal
        self._logged: set[str] = set()
        self._events: dict[str, EventPool] = {}

    def _once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("bounce skipped: %s (logged once)", reason)

    def send(
        self,
        peer: str,
        src: Region,
        dst: RegionDesc | dict[str, Any],
        runs: Runs,
        tag: bytes,
        *,
        slot: StagingSlot | dict[str, Any] | None,
        writer: int = 0,
        path: str | None = None,
        paths: tuple[str, ...] | None = None,
        chunks: int | None = None,
        ipc: torch.Tensor | None = None,
        ipc_impl: str | None = None,
        ipc_signal: str | None = None,
        deadline: float | None = None,
    ) -> Send:
        """Send ``runs`` of ``src`` to ``dst`` on ``peer``; bounce through ``slot`` when the gate says so.

        ``path`` forces ``"bounce"``/``"direct"``/``"pipelined"``/``"ipc"`` (benchmarks). Without it the
        gate decides: :meth:`BounceGate.decision` (bounce or direct) unless ``paths`` lists the
        candidates for :meth:`BounceGate.choose`. ``ipc`` is the receiver's region (``dst``) mapped
        here (:func:`~vllm_dsa_connector.core.transfer.ipc.open_region`); ``chunks`` overrides the gate's
        chunk count of a pipelined send; ``ipc_impl`` the copy of the ``ipc`` path (default: the Triton
        kernel, measured faster than one copy-engine DMA per run across GPUs too; ``"ce"`` forces those);
        ``ipc_signal`` overrides the sender's completion signal of the ``ipc`` path (``"event"`` /
        ``"event+notify"`` / ``"notify"``, see the module docstring). Pass the same ``runs`` object to send the same request
        again: its merge and the copy's launch plan are cached on it. ``deadline`` (``time.monotonic()``):
        the bounce and direct WRITEs are not posted at or after it (checked after the wait for staging
        space, right before posting; :class:`TransferError`).
        Falls back to direct when the receiver gave no slot, the slot is too small, or the local arena
        has no room within the bounded wait.
        """
        merged = runs.merged()
        decision = None
        k = 1
        if path is None:
            if paths is None:
                decision = self.gate.decision(merged, merged=True)
            else:
                avail = tuple(
                    p
                    for p in paths
                    if (p != "ipc" or ipc is not None)
                    and (p not in ("bounce", "pipelined") or slot is not None)
                )
                decision = self.chooser.choose(merged, merged=True, paths=avail or ("direct",))
                k = decision.chunks
            path, reason = decision.path, decision.reason
        else:
            reason = f"forced {path}"
        if chunks is not None:
            k = int(chunks)
        elif path == "pipelined" and decision is None:
            k = 4
        if path == "ipc":
            if ipc is None:
                path, reason = "direct", "no IPC mapping of the destination"
                self._once(reason)
            else:
                return self._send_ipc(
                    peer, src, merged, ipc, tag, writer, decision, reason, ipc_impl, ipc_signal
                )
        res = None
        staging: StagingSlot | None = None
        if path in ("bounce", "pipelined"):
            staging = StagingSlot.from_dict(slot) if slot is not None else None
            if merged.total_bytes == 0:
                path, reason = "direct", "empty transfer"
            elif staging is None:
                path, reason = "direct", "receiver advertised no staging slot"
            elif staging.size < merged.total_bytes:
                path, reason = "direct", f"slot of {staging.size} B < {merged.total_bytes} B"
            else:
                res = self.arena.reserve(merged.total_bytes, self.reserve_timeout_s)
                if res is None:
                    path, reason = "direct", "local staging arena full (backpressure)"
            if path == "direct":
                self._once(reason)
        if path == "pipelined":
            assert res is not None and staging is not None
            return self._send_pipelined(
                peer, src, merged, res, staging, tag, writer, k, decision, reason
            )
        notif = encode_notif(path, writer, tag)
        if path == "bounce":
            assert res is not None and staging is not None
            try:
                gather(src.tensor, merged, self.arena.view(res))
                sync(self.arena.buffer)
                check_deadline(deadline, f"bounce to {peer!r}")
                one = Runs(
                    np.array([res.offset]), np.array([staging.offset]), np.array([merged.total_bytes])
                )
                xfer = self.engine.write(peer, self.region, staging.region, one, notif, deadline=deadline)
            except BaseException:
                self.arena.release(res)
                raise
        else:
            check_deadline(deadline, f"direct write to {peer!r}")
            xfer = self.engine.write(peer, src, dst, merged, notif, deadline=deadline)
        return Send(xfer, path, decision, reason, res)

    # -- pipelined ----------------------------------------------------------------------------------

    def _send_pipelined(
        self,
        peer: str,
        src: Region,
        merged: Runs,
        res: Reservation,
        slot: StagingSlot,
        tag: bytes,
        writer: int,
        count: int,
        decision: Decision | None,
        reason: str,
    ) -> Send:
        t0 = time.perf_counter()
        plan = plan_chunks(merged, max(1, int(count)))
        events = []
        try:
            for ch in plan:  # gathers back to back on the stream; each chunk's event marks it done
                gather(src.tensor, ch.runs, self.arena.buffer[res.offset + ch.start :])
                events.append(record_event(self.arena.buffer))
        except BaseException:
            self.arena.release(res)
            raise
        rec = Transfer(f"pipelined {tag[:48]!r}", peer, len(plan), merged.total_bytes, t0)
        send = Send(
            rec,
            "pipelined",
            decision,
            reason,
            res,
            chunks=len(plan),
            _peer=peer,
            _plan=plan,
            _events=events,
            _slot=slot,
            _writer=writer,
            _tag=tag,
        )
        self.progress(send)
        return send

    def progress(self, send: Send) -> bool:
        """Post the WRITEs of chunks whose gather finished (in order); ``True`` once all are posted.

        Call it from the worker's loop (``wait`` calls it too). No-op for other paths.
        """
        if send.path != "pipelined":
            return True
        res, slot = send._res, send._slot
        assert slot is not None
        while len(send._posted) < len(send._plan):
            i = len(send._posted)
            if not event_done(send._events[i]):
                return False
            ch = send._plan[i]
            if res is None:
                raise TransferError(f"pipelined send {send._tag!r} lost its staging", peer=send._peer)
            one = Runs(
                np.array([res.offset + ch.start]), np.array([slot.offset + ch.start]), np.array([ch.nbytes])
            )
            notif = encode_chunk_notif(send._writer, i, len(send._plan), send._tag)
            send._posted.append(self.engine.write(send._peer, self.region, slot.region, one, notif))
            send.transfer = send._posted[-1]
        return True

    def wait(self, send: Send, timeout_s: float = 10.0) -> TransferStats:
        """Wait for the WRITE; frees the staging reservation (quarantines it on failure)."""
        if send.path == "ipc":
            return self._wait_ipc(send, timeout_s)
        try:
            if send.path == "pipelined":
                return self._wait_pipelined(send, timeout_s)
            stats = self.engine.wait(send.transfer, timeout_s)
        except BaseException:
            if send._res is not None:
                self.arena.quarantine(send._res)
                send._res = None
            raise
        if send._res is not None:
            self.arena.release(send._res)
            send._res = None
        return stats

    def _wait_pipelined(self, send: Send, timeout_s: float) -> TransferStats:
        started = time.perf_counter()
        deadline = started + timeout_s
        spins = 0
        while not self.progress(send):
            if time.perf_counter() > deadline:
                raise TransferError(
                    f"pipelined send {send._tag!r}: gathers not done after {timeout_s} s",
                    peer=send._peer,
                )
            spins += 1
            time.sleep(0 if spins < 200 else 5e-5)
        descs = 0
        for xfer in send._posted:
            st = self.engine.wait(xfer, max(1e-3, deadline - time.perf_counter()))
            descs += max(0, st.desc_count)
        if send._res is not None:
            self.arena.release(send._res)
            send._res = None
        first = send._posted[0] if send._posted else None
        t0 = first.started if first is not None else started
        total = sum(x.total_bytes for x in send._posted)
        return TransferStats(
            len(send._posted),
            total,
            time.perf_counter() - t0,
            descs if self.engine.telemetry else -1,
        )


class BounceTransport(DirectTransport):
    """Gather into the local arena, one WRITE into the receiver's staging slot, scatter there.

    A post with one part and a slot goes through :class:`BounceSender` (its gate may still choose a direct
    WRITE, or fall back to one when the local arena stays full; the notification then rides on that
    WRITE). Anything else (several pool pairs, no slot) is a :class:`DirectTransport` post.
    """

    def __init__(self, sender: BounceSender, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(sender.engine, timeout_s, clock)
        self.sender = sender

    def post(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes,
             slot: StagingSlot | None = None, deadline: float | None = None) -> Post:
        """Bounce a one-part post with a slot; post anything else directly."""
        if slot is None or len(parts) != 1:
            return super().post(peer, parts, writer=writer, tag=tag, deadline=deadline)
        src, dst, runs = parts[0]
        try:
            send = self.sender.send(peer, src, dst, runs, tag, slot=slot, writer=writer, deadline=deadline)
        except Exception as e:  # noqa: BLE001 - the sender released its staging: nothing in flight
            return Post(peer, writer, tag, "bounce", error=str(e))
        return Post(peer, writer, tag, send.path, _inflight=[send])

    def transfer_of(self, x: Any) -> Transfer:
        """The WRITE behind a handle: a :class:`Send`'s last posted WRITE, or the WRITE itself."""
        return x.transfer if isinstance(x, Send) else x

    def _wait(self, x: Any) -> TransferStats:
        if isinstance(x, Send):  # waiting also frees (or quarantines) its staging space
            return self.sender.wait(x, self.timeout_s)
        return self.engine.wait(x, self.timeout_s)
