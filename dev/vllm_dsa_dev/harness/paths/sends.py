"""The benches' send handle (:class:`Send`: one in-flight send of :class:`~.sender.BounceSender`, any of its
paths) and the CUDA event helpers its paths share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Chunk
from vllm_dsa_connector.core.transfer.gate import Decision
from vllm_dsa_connector.core.transfer.nixl.data import Transfer
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingSlot

__all__ = ["Send", "event_done", "pause", "record_event"]


@dataclass(eq=False)
class Send:
    """One writer's in-flight send; ``path`` is what was actually used.

    ``transfer`` is the (last posted) NIXL WRITE, or a record without a NIXL handle for ``ipc`` and for
    a ``pipelined`` send whose chunks are not all posted yet; ``chunks`` > 1 for ``pipelined``.
    """

    transfer: Transfer
    path: str
    decision: Decision | None
    reason: str
    _res: Reservation | None = field(default=None, repr=False)
    chunks: int = 1
    _peer: str = field(default="", repr=False)
    _notif: bytes = field(default=b"", repr=False)
    _event: Any = field(default=None, repr=False)  # ipc: the copy kernel's completion
    _plan: list[Chunk] = field(default_factory=list, repr=False)  # pipelined: chunks to post
    _events: list[Any] = field(default_factory=list, repr=False)  # pipelined: gather i done
    _posted: list[Transfer] = field(default_factory=list, repr=False)
    _slot: StagingSlot | None = field(default=None, repr=False)
    _writer: int = 0
    _tag: bytes = b""
    launch_s: float = 0.0  # ipc: host time of the copy launch (plan lookup or build, launch)
    signal: str = ""  # ipc: "event" (notification at launch) or "notify" (after completion)
    _handle: bytes = field(default=b"", repr=False)  # ipc event signal: the event's IPC handle
    _pool: Any = field(default=None, repr=False)  # ipc event signal: where the event goes back


def record_event(t: torch.Tensor) -> Any:
    """A CUDA event recorded on ``t``'s current stream (``None`` for host tensors)."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def event_done(ev: Any) -> bool:
    """Whether ``ev`` fired (``None``: nothing to wait for)."""
    return ev is None or bool(ev.query())


def pause(started: float, spin_s: float = 0.02) -> None:
    """Between polls: yield only for the first ``spin_s`` (completions seen within microseconds), then
    sleep 50 us (a long wait does not burn a core)."""
    time.sleep(0 if time.perf_counter() - started < spin_s else 5e-5)
