"""Slot bookkeeping for a staging arena, without the arena: a torch-free first-fit allocator.

:class:`SlotAllocator` hands out ``align``-aligned byte ranges of an arena of ``size`` bytes: first fit,
freed holes reused (neighbours coalesce), a bounded wait for space, and quarantine (a range whose
transfer failed is not reused while a late write could still land in it: a caller that knows when that
transfer is over hands it back with :meth:`SlotAllocator.restore`, otherwise it stays out for good). It holds no memory, so a
scheduler can plan slots of an arena that lives in another process; :class:`~.staging.StagingArena`
pairs one with the buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Reservation", "SlotAllocator"]

_WAIT_SLICE_S = 0.05


@dataclass(frozen=True)
class Reservation:
    """``size`` bytes (aligned up) at ``offset`` of an arena; ``nbytes`` were asked for."""

    offset: int
    size: int
    nbytes: int


class SlotAllocator:
    """First-fit, ``align``-aligned allocator over ``[0, size)`` (``size`` rounded down to ``align``).

    Thread-safe; ``reserve`` may wait (bounded) for a release. ``clock`` is the time source of that wait
    (injected in tests).
    """

    def __init__(self, size: int, align: int = 512, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"SlotAllocator: align must be a power of two, got {align}")
        if size < 0:
            raise ValueError(f"SlotAllocator: size must be >= 0, got {size}")
        self.size = (int(size) // align) * align
        self.align = align
        self.clock = clock
        self._holes: list[list[int]] = [[0, self.size]] if self.size else []  # sorted, coalesced
        self._live: dict[int, Reservation] = {}
        self._held_back: dict[int, Reservation] = {}  # quarantined, until restored
        self._quarantined = 0
        self._cv = threading.Condition()

    @property
    def free_bytes(self) -> int:
        """Bytes in holes."""
        with self._cv:
            return sum(h[1] for h in self._holes)

    @property
    def quarantined_bytes(self) -> int:
        """Bytes never to be reused (their transfer failed)."""
        return self._quarantined

    def aligned(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment (what a reservation of it occupies)."""
        return -(-int(nbytes) // self.align) * self.align

    def _take(self, need: int) -> int | None:
        for i, (off, size) in enumerate(self._holes):
            if size >= need:
                if size == need:
                    del self._holes[i]
                else:
                    self._holes[i] = [off + need, size - need]
                return off
        return None

    def reserve(self, nbytes: int, timeout_s: float = 0.0) -> Reservation | None:
        """First fit of ``nbytes``; waits up to ``timeout_s`` for a release, then ``None`` (go direct)."""
        if nbytes <= 0:
            raise ValueError(f"SlotAllocator.reserve: nbytes must be > 0, got {nbytes}")
        need = self.aligned(nbytes)
        if need > self.size:
            return None
        deadline = self.clock() + max(0.0, timeout_s)
        with self._cv:
            while True:
                off = self._take(need)
                if off is not None:
                    res = Reservation(off, need, int(nbytes))
                    self._live[off] = res
                    return res
                left = deadline - self.clock()
                if left <= 0:
                    return None
                self._cv.wait(min(left, _WAIT_SLICE_S))  # a release wakes it; slices keep ``clock`` in charge

    def release(self, res: Reservation) -> None:
        """Return a reservation's bytes; neighbouring holes coalesce."""
        with self._cv:
            if self._live.get(res.offset) != res:
                raise ValueError(f"SlotAllocator.release: {res} is not live (double release?)")
            del self._live[res.offset]
            holes = self._holes
            i = 0
            while i < len(holes) and holes[i][0] < res.offset:
                i += 1
            holes.insert(i, [res.offset, res.size])
            if i + 1 < len(holes) and holes[i][0] + holes[i][1] == holes[i + 1][0]:
                holes[i][1] += holes[i + 1][1]
                del holes[i + 1]
            if i > 0 and holes[i - 1][0] + holes[i - 1][1] == holes[i][0]:
                holes[i - 1][1] += holes[i][1]
                del holes[i]
            self._cv.notify_all()

    def quarantine(self, res: Reservation) -> None:
        """Do not reuse this reservation (a failed transfer might still write into it) until :meth:`restore`."""
        with self._cv:
            if self._live.pop(res.offset, None) is not None:
                self._held_back[res.offset] = res
                self._quarantined += res.size

    def restore(self, res: Reservation) -> None:
        """Hand a quarantined reservation back: its transfer is known to be over (no write can land any more)."""
        with self._cv:
            if self._held_back.get(res.offset) != res:
                raise ValueError(f"SlotAllocator.restore: {res} is not quarantined")
            del self._held_back[res.offset]
            self._quarantined -= res.size
            self._live[res.offset] = res
        self.release(res)
