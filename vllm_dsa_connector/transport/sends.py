"""Handles of the sending side: where a writer may put its packed bytes, and one in-flight send."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsa_connector.transport.engine import RegionDesc, Transfer
from vllm_dsa_connector.transport.gate import Decision
from vllm_dsa_connector.transport.runs import Chunk
from vllm_dsa_connector.transport.slots import Reservation

__all__ = ["Send", "StagingSlot"]


@dataclass(frozen=True)
class StagingSlot:
    """Where one writer may put its packed bytes in the receiver's arena (serialisable)."""

    region: RegionDesc
    offset: int
    size: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the handshake."""
        return {"region": self.region.to_dict(), "offset": self.offset, "size": self.size}

    @classmethod
    def from_dict(cls, d: StagingSlot | dict[str, Any]) -> StagingSlot:
        """Inverse of :meth:`to_dict`."""
        if isinstance(d, StagingSlot):
            return d
        return cls(RegionDesc.from_dict(d["region"]), int(d["offset"]), int(d["size"]))


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


def _record(t: torch.Tensor) -> Any:
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def _done(ev: Any) -> bool:
    return ev is None or bool(ev.query())


def _pause(started: float, spin_s: float = 0.02) -> None:
    """Between polls: yield only for the first ``spin_s`` (completions seen within microseconds), then
    sleep 50 us (a long wait does not burn a core)."""
    time.sleep(0 if time.perf_counter() - started < spin_s else 5e-5)
