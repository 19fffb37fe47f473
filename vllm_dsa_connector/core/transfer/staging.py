"""The staging arena of the bounce path, and where a writer may put its packed bytes in a receiver's.

- :class:`StagingArena`: one buffer allocated (and registered by its user) once, with a
  :class:`~.slots.SlotAllocator` over it (first fit, aligned, freed holes reused, bounded wait, quarantine
  of ranges whose transfer failed). The allocator is torch-free and usable without a buffer (a scheduler
  planning the slots of an arena that lives in a worker).
- :class:`StagingSlot`: a range of a receiver's registered arena, as a writer names it in its WRITE.

The bytes go in and out with :func:`~.local_copy.gather` / :func:`~.local_copy.scatter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc
from vllm_dsa_connector.core.transfer.slots import Reservation, SlotAllocator

__all__ = ["Reservation", "StagingArena", "StagingSlot"]


class StagingArena:
    """A staging buffer (a 1-D uint8 tensor, allocated once) and the :class:`SlotAllocator` over it."""

    def __init__(
        self,
        size: int,
        align: int = 512,
        device: str | torch.device = "cpu",
        buffer: torch.Tensor | None = None,
    ) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"StagingArena: align must be a power of two, got {align}")
        if buffer is None:
            if size <= 0:
                raise ValueError(f"StagingArena: size must be > 0, got {size}")
            buffer = torch.empty(int(size), dtype=torch.uint8, device=device)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("StagingArena: buffer must be a contiguous 1-D uint8 tensor")
        self.buffer = buffer
        self.slots = SlotAllocator(buffer.numel(), align)
        self.size = self.slots.size
        self.align = align

    @property
    def free_bytes(self) -> int:
        """Bytes in holes."""
        return self.slots.free_bytes

    @property
    def quarantined_bytes(self) -> int:
        """Bytes never to be reused (their transfer failed)."""
        return self.slots.quarantined_bytes

    def reserve(self, nbytes: int, timeout_s: float = 0.0) -> Reservation | None:
        """First fit of ``nbytes``; waits up to ``timeout_s`` for a release, then ``None`` (go direct)."""
        return self.slots.reserve(nbytes, timeout_s)

    def release(self, res: Reservation) -> None:
        """Return a reservation's bytes; neighbouring holes coalesce."""
        self.slots.release(res)

    def quarantine(self, res: Reservation) -> None:
        """Never reuse this reservation (a failed transfer might still write into it)."""
        self.slots.quarantine(res)

    def view(self, res: Reservation, nbytes: int | None = None) -> torch.Tensor:
        """The reservation's bytes (first ``nbytes``, default what was asked for)."""
        n = res.nbytes if nbytes is None else nbytes
        return self.buffer[res.offset : res.offset + n]


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
