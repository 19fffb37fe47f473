"""The staging buffer of the bounce transport, and the gather/scatter that pack runs into it and out.

- :class:`StagingArena`: one buffer allocated (and registered by its user) once, with a
  :class:`~.slots.SlotAllocator` over it (first fit, aligned, freed holes reused, bounded wait, quarantine
  of ranges whose transfer failed). The allocator is torch-free and usable without a buffer (a scheduler
  planning the slots of an arena that lives in a worker).
- :func:`gather` / :func:`scatter`: torch index ops on the widest integer view (narrower only when the
  runs' offsets or lengths require it), never a Python loop per run. Same code on CPU and CUDA tensors.
  When the row index would exceed :data:`MAX_INDEX_ROWS` rows (e.g. the chunks of a pipelined bounce, cut
  at 4 KiB multiples inside blocks: 256-byte rows, millions of them built on the host per chunk) they use
  the Triton run copy on CUDA instead (a table of runs, no per-row index).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_dsa_connector.transport.copy import (
    byte_view,
    copy_arrays,
    default_impl,
    row_index,
    row_view,
    triton_available,
)
from vllm_dsa_connector.transport.runs import Runs
from vllm_dsa_connector.transport.slots import Reservation, SlotAllocator

__all__ = ["MAX_INDEX_ROWS", "Reservation", "StagingArena", "gather", "scatter", "sync"]


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


# -- gather / scatter -------------------------------------------------------------------------------


# Widest first. complex128 is a 16-byte bit container here (index ops copy bits, no arithmetic): on this
# project's CPU host it scattered 576 B rows 3.4x faster than int64; uint8 only when a run needs it.
_WIDTHS = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def _plan(
    offsets: np.ndarray, lengths: np.ndarray, ptrs: Sequence[int], max_width: int
) -> tuple[int, int, torch.dtype]:
    """Row size (bytes) = gcd of offsets and lengths; element width = widest dividing row and pointers."""
    g = int(np.gcd.reduce(np.concatenate([offsets, lengths]))) if lengths.size else 1
    g = g or 1
    for w, dt in _WIDTHS:
        if w <= max_width and g % w == 0 and all(p % w == 0 for p in ptrs):
            return g, w, dt
    return g, 1, torch.uint8  # width 1 always fits


def _index(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(idx)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


#: Above this many index rows gather/scatter use the Triton run copy on CUDA (see the module docstring).
MAX_INDEX_ROWS = 1 << 16


def _use_kernel(
    a: torch.Tensor, b: torch.Tensor, impl: str | None, offsets: np.ndarray, lengths: np.ndarray,
    total: int,
) -> bool:
    # Packed <-> scattered: torch's index ops measured faster than the Triton run copy on H200 (0.935 /
    # 0.971 of a device copy vs 0.91), so the kernel only when asked for (impl or VLLM_DSA_COPY_IMPL),
    # or when the row index would be large (its host-side construction then dominates).
    mode = default_impl() if impl is None else impl
    if mode not in ("auto", "triton") or not (a.is_cuda and b.is_cuda):
        return False
    if mode == "auto":
        row = int(np.gcd.reduce(np.concatenate([offsets, lengths]))) if lengths.size else 1
        if total // max(1, row) <= MAX_INDEX_ROWS:
            return False
    return triton_available()


def gather(
    src: torch.Tensor, runs: Runs, out: torch.Tensor, *, max_width: int = 16, impl: str | None = None
) -> None:
    """Pack ``runs`` (their ``src_offsets``/``lengths``, bytes of ``src``) into ``out`` in run order.

    ``out`` is a 1-D uint8 tensor (e.g. :meth:`StagingArena.view`) of at least ``runs.total_bytes``.
    One ``torch.index_select`` on the widest view the runs allow (16-byte, else int64, ..., uint8;
    ``max_width`` caps it); ``impl="triton"`` (or ``VLLM_DSA_COPY_IMPL=triton``) uses the Triton run
    copy (:func:`copy_runs`) on CUDA instead, and so does the default when the index would have more
    than :data:`MAX_INDEX_ROWS` rows.
    """
    total = runs.total_bytes
    if total == 0:
        return
    sb = byte_view(src, "gather src")
    runs.check_bounds(sb.numel(), 1 << 62, what="gather")
    if out.numel() < total or out.dtype != torch.uint8:
        raise ValueError(f"gather: out must be uint8 with >= {total} bytes")
    ob = out[:total]
    if _use_kernel(sb, ob, impl, runs.src_offsets, runs.lengths, total):
        copy_arrays(sb, ob, runs.src_offsets, runs.staging_offsets(), runs.lengths, impl)
        return
    row, w, dt = _plan(runs.src_offsets, runs.lengths, (sb.data_ptr(), ob.data_ptr()), max_width)
    idx = _index(row_index(runs.src_offsets, runs.lengths, row), sb.device)
    torch.index_select(row_view(sb, row, w, dt), 0, idx, out=ob.view(dt).view(-1, row // w))


def scatter(
    staging: torch.Tensor,
    dst: torch.Tensor,
    runs: Runs,
    *,
    max_width: int = 16,
    impl: str | None = None,
) -> None:
    """Unpack ``staging`` (packed in run order) to ``runs.dst_offsets`` of ``dst``.

    One ``index_copy_``; ``impl="triton"`` the Triton run copy on CUDA (see :func:`gather`).
    """
    total = runs.total_bytes
    if total == 0:
        return
    db = byte_view(dst, "scatter dst")
    runs.check_bounds(1 << 62, db.numel(), what="scatter")
    if staging.numel() < total or staging.dtype != torch.uint8:
        raise ValueError(f"scatter: staging must be uint8 with >= {total} bytes")
    sb = staging[:total]
    if _use_kernel(sb, db, impl, runs.dst_offsets, runs.lengths, total):
        copy_arrays(sb, db, runs.staging_offsets(), runs.dst_offsets, runs.lengths, impl)
        return
    row, w, dt = _plan(runs.dst_offsets, runs.lengths, (db.data_ptr(), sb.data_ptr()), max_width)
    idx = _index(row_index(runs.dst_offsets, runs.lengths, row), db.device)
    row_view(db, row, w, dt).index_copy_(0, idx, sb.view(dt).view(-1, row // w))


def sync(t: torch.Tensor) -> None:
    """Wait for work queued on ``t``'s CUDA stream (no-op on CPU)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
