"""The ``ipc`` path of :class:`~.sender.BounceSender`: one kernel writes the receiver's pages through a
CUDA IPC mapping of its region (same node; :mod:`vllm_dsa_connector.core.transfer.ipc` maps it).

Completion signal (``ipc_signal``): ``"event"`` (default on CUDA) records an interprocess CUDA event
behind the kernel and sends ``dsa1:e<writer>.<event handle>:<tag>`` right after the launch, so it travels
while the kernel runs; the receiver opens the event once per handle and completes when it has fired (no
host round trip after the copy). ``"event+notify"`` also sends ``dsa1:i<writer>:<tag>`` once the sender's
``wait`` saw the copy finish (a receiver that cannot open the event completes on that one; otherwise it
is dropped). ``"notify"``: only the notification after completion.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs
from vllm_dsa_connector.core.transfer.gate import Decision
from vllm_dsa_connector.core.transfer.nixl.data import (
    Region,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_event_notif, encode_notif
from vllm_dsa_dev.harness.paths.sends import Send, event_done, pause, record_event

logger = logging.getLogger(__name__)

__all__ = ["IPC_SIGNALS", "IpcSendPath"]

IPC_SIGNALS = ("event", "event+notify", "notify")


class EventPool:
    """Interprocess CUDA events of one device, each with its IPC handle; an event is reused only after
    the sender saw it fire (a receiver still holding it then sees a later record: never early)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: list[tuple[Any, bytes]] = []

    def acquire(self) -> tuple[Any, bytes | None]:
        """A recorded-later event and its handle (``None``: handle comes after the first record)."""
        if self.free:
            return self.free.pop()
        return torch.cuda.Event(interprocess=True), None

    def release(self, ev: Any, handle: bytes) -> None:
        if len(self.free) < 64:
            self.free.append((ev, handle))


class IpcSendPath:
    """The ``ipc`` send path, mixed into :class:`~.sender.BounceSender` (uses its engine and log-once set)."""

    engine: NixlEngine
    ipc_signal: str
    _logged: set[str]
    _events: dict[str, EventPool]

    def _send_ipc(
        self,
        peer: str,
        src: Region,
        merged: Runs,
        mapped: torch.Tensor,
        tag: bytes,
        writer: int,
        decision: Decision | None,
        reason: str,
        impl: str | None = None,
        signal: str | None = None,
    ) -> Send:
        if peer not in self.engine.peers:
            raise TransferError(f"ipc send {tag!r}: unknown peer {peer!r}", peer=peer)
        signal = self.ipc_signal if signal is None else signal
        if signal not in IPC_SIGNALS:
            raise ValueError(f"ipc_signal must be one of {IPC_SIGNALS}; got {signal!r}")
        t0 = time.perf_counter()
        copy_runs(src.tensor, mapped, merged, impl=impl)
        ev: Any = None
        handle = b""
        pool = None
        if src.tensor.is_cuda and signal != "notify" and self._ipc_events_ok(src.tensor.device):
            pool = self._events[str(src.tensor.device)]
            ev, h = pool.acquire()
            ev.record(torch.cuda.current_stream(src.tensor.device))
            handle = h if h is not None else bytes(ev.ipc_handle())
        else:
            signal = "notify"
            ev = record_event(src.tensor)
        launch = time.perf_counter() - t0
        rec = Transfer(f"ipc {tag[:48]!r}", peer, merged.num_runs, merged.total_bytes, t0)
        send = Send(
            rec,
            "ipc",
            decision,
            reason,
            None,
            _peer=peer,
            _notif=encode_notif("ipc", writer, tag),
            _event=ev,
            launch_s=launch,
            signal=signal,
            _handle=handle,
            _pool=pool,
        )
        if signal != "notify":  # tell D now: the notification travels while the kernel runs
            self.engine.send_notification(peer, encode_event_notif(writer, handle, tag))
        return send

    def _ipc_events_ok(self, device: torch.device) -> bool:
        key = str(device)
        if key in self._events:
            return True
        if f"no-events:{key}" in self._logged:
            return False
        try:
            with torch.cuda.device(device):
                probe = torch.cuda.Event(interprocess=True)
                probe.record()
                handle = bytes(probe.ipc_handle())
            pool = EventPool(device)
            pool.release(probe, handle)
            self._events[key] = pool
            return True
        except Exception as e:  # no interprocess events here: notify after completion
            self._logged.add(f"no-events:{key}")
            logger.info("ipc: no interprocess CUDA events on %s (%s); notifying after completion", key, e)
            return False

    def _wait_ipc(self, send: Send, timeout_s: float) -> TransferStats:
        rec = send.transfer
        if rec.stats is not None:
            return rec.stats
        deadline = rec.started + timeout_s
        started = time.perf_counter()
        while not event_done(send._event):
            self.engine.progress()  # the launch notification may still wait on UCX (send_notification)
            if time.perf_counter() > deadline:
                raise TransferError(
                    f"ipc copy {rec.name} to {rec.peer!r} not done after {timeout_s} s",
                    peer=rec.peer,
                    transfer=rec.name,
                )
            pause(started)
        if send.signal != "event":  # the bytes are there: tell D (after an event D usually drops it)
            self.engine.send_notification(send._peer, send._notif)
        else:
            self.engine.progress()
        if send._pool is not None and send._event is not None:
            send._pool.release(send._event, send._handle)
            send._pool = send._event = None
        rec.stats = TransferStats(rec.num_runs, rec.total_bytes, time.perf_counter() - rec.started, 0)
        return rec.stats
