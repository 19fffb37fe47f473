"""The one element-width planner of every local copy (index ops and the Triton kernel alike).

A copy of byte runs reads and writes through a typed view of the bytes: the widest element that divides
every offset, every length and both base pointers, so a run of 576 B moves as 36 16-byte elements instead
of 576 bytes. ``complex128`` is only a 16-byte bit container (index ops copy bits, no arithmetic; on the
project's CPU hosts it scattered 576 B rows 3.4x faster than int64); the Triton kernel stops at int64 and
gets 16-byte vector accesses from alignment hints instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["WIDTHS", "element_width"]

#: (bytes, dtype), widest first
WIDTHS: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def element_width(g: int, ptrs: Sequence[int] = (), max_width: int = 16) -> tuple[int, torch.dtype]:
    """The widest ``(bytes, dtype)`` of at most ``max_width`` bytes dividing ``g`` (the gcd of the offsets and
    lengths) and every pointer of ``ptrs``; ``(1, uint8)`` always fits."""
    for w, dt in WIDTHS:
        if w <= max_width and g % w == 0 and all(int(p) % w == 0 for p in ptrs):
            return w, dt
    return 1, torch.uint8
