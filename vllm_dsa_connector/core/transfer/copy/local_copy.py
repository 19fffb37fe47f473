"""Local copies of byte runs: ``copy_runs(src, dst, runs)``, and the bounce's :func:`gather` / :func:`scatter`.

The one module that moves bytes inside a process: the implementation (Triton kernel, copy engine, torch
index ops) is chosen here (:func:`default_impl`, ``VLLM_DSA_COPY_IMPL``), the element width by the one
planner of :mod:`.widths`. :func:`gather` packs runs into a staging buffer and :func:`scatter` unpacks them:
torch index ops on the widest view (never a Python loop per run), or the Triton run copy on CUDA when the
row index would exceed :data:`MAX_INDEX_ROWS` rows (e.g. the chunks of a pipelined bounce, cut at 4 KiB
multiples inside blocks: millions of 256-byte rows built on the host per chunk).


``runs.lengths[i]`` bytes go from byte ``runs.src_offsets[i]`` of ``src`` to byte ``runs.dst_offsets[i]``
of ``dst``, in ONE pass over the bytes whatever the layout on either side: scattered -> packed is the
bounce gather, packed -> scattered its scatter, scattered -> scattered the same-node single copy (``dst``
a peer's KV pool mapped through CUDA IPC, see :mod:`vllm_dsa_connector.core.transfer.ipc`).

On CUDA the copy is one Triton kernel on a 2-D grid (run x piece of at most ``piece_bytes``; each
program an unmasked loop of ``BLOCK``-element steps plus one masked tail) over a runs table uploaded
through a reused pinned ring (runs far longer than the mean are split first), on the widest element the
offsets, lengths and pointers allow, with 16-byte alignment hints when every offset and length is
16-byte aligned (so loads and stores are 16-byte vectors). ``dst`` may live on another
GPU (a peer mapping): the kernel runs on ``src``'s device and writes through NVLink.

``impl="ce"``: one copy-engine copy per run (``cuMemcpyDtoDAsync``; DMA instead of SMs), the faster
way across GPUs over NVLink when runs are few and large. Elsewhere (CPU tensors, no Triton, or
``impl="index"``) it falls back to torch index ops on the widest integer view (``index_select`` +
``index_copy_``: two passes, used for CPU hosts and tests).
``VLLM_DSA_COPY_IMPL`` = ``auto`` (default: Triton on CUDA when it loads) | ``triton`` | ``index`` | ``ce``.

Launch plans: :func:`copy_runs` keeps, per :class:`Runs` object (weakly, so a plan dies with its request's
runs) and per (source, destination, launch shape), what one launch needs: the runs table already on the
GPU, the grid and the typed views. A repeated copy of the same runs then skips the numpy planning, the
bounds check and the table upload; from its second use the launch is replayed from a CUDA graph
captured once (one ``cudaGraphLaunch`` instead of Triton's launcher). ``VLLM_DSA_COPY_GRAPH=0`` turns the
graphs off (plans stay). ``copy_arrays`` (gather / scatter on derived arrays) plans every call.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.copy import kernels, launches
from vllm_dsa_connector.core.transfer.copy.kernels import (
    COPY_IMPLS,
    FAILED_LAUNCHES,
    CopyConfig,
    copy_settings,
    default_config,
    launch_triton,
    triton_available,
)
from vllm_dsa_connector.core.transfer.copy.launches import copy_planned
from vllm_dsa_connector.core.transfer.copy.widths import element_width

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_INDEX_ROWS",
    "byte_view",
    "copy_arrays",
    "ce_available",
    "copy_runs",
    "default_impl",
    "gather",
    "row_index",
    "row_view",
    "scatter",
    "sync",
]


def default_impl(environ: Any = None) -> str:
    """``VLLM_DSA_COPY_IMPL`` (auto/triton/index/ce), ``auto`` when unset (:class:`CopySettings`)."""
    return copy_settings(environ).impl


def byte_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (``t`` must be contiguous; ``what`` names it in the error)."""
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# -- copy engine -----------------------------------------------------------------------------------

_CE: Any = None
_CE_ERROR: str | None = None


def ce_available() -> bool:
    """Whether per-run copy-engine copies can be issued (``cuda.bindings`` driver API, else CuPy)."""
    global _CE, _CE_ERROR
    if _CE is not None:
        return True
    if _CE_ERROR is not None:
        return False
    try:
        from cuda.bindings import driver

        def issue(dst: int, src: int, n: int, stream: int) -> None:
            (err,) = driver.cuMemcpyDtoDAsync(dst, src, n, stream)
            if int(err) != 0:
                raise RuntimeError(f"cuMemcpyDtoDAsync failed: {err}")

        _CE = issue
    except Exception as e1:
        try:
            import cupy

            kind = cupy.cuda.runtime.memcpyDeviceToDevice

            def issue(dst: int, src: int, n: int, stream: int) -> None:
                cupy.cuda.runtime.memcpyAsync(dst, src, n, kind, stream)

            _CE = issue
        except Exception as e2:
            _CE_ERROR = f"{e1}; {e2}"
    return _CE is not None


def _copy_ce(
    sb: torch.Tensor, db: torch.Tensor, src_off: np.ndarray, dst_off: np.ndarray, lens: np.ndarray
) -> None:
    """One asynchronous copy-engine copy per run on ``src``'s current stream (DMA, not SMs).

    Across GPUs this is the NVLink copy path (a plain peer copy's speed) at ~1-3 us of host time per
    run: for a few hundred large runs, not for tens of thousands of small ones.
    """
    if not ce_available():
        raise RuntimeError(f"copy engine path unavailable ({_CE_ERROR})")
    stream = torch.cuda.current_stream(sb.device).cuda_stream
    s0, d0 = sb.data_ptr(), db.data_ptr()
    with torch.cuda.device(sb.device):
        for so, do, n in zip(src_off.tolist(), dst_off.tolist(), lens.tolist(), strict=True):
            if n:
                _CE(d0 + do, s0 + so, n, stream)


# -- torch index ops --------------------------------------------------------------------------------


def row_index(offsets: np.ndarray, lengths: np.ndarray, row: int) -> np.ndarray:
    """Row numbers (of ``row`` bytes) covered by the runs, in run order (vectorised; the gather/scatter
    index of the bounce transport and of the index-op copy here)."""
    counts = lengths // row
    first = offsets // row
    total = int(counts.sum())
    starts = np.zeros(counts.size, np.int64)
    if counts.size > 1:
        np.cumsum(counts[:-1], out=starts[1:])
    return np.repeat(first - starts, counts) + np.arange(total, dtype=np.int64)


def row_view(buf: torch.Tensor, row: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole ``row``-byte rows of a flat uint8 ``buf`` as ``[rows, row // width]`` of ``dtype``."""
    n = (buf.numel() // row) * row
    return buf[:n].view(dtype).view(-1, row // width)


def _copy_index(
    sb: torch.Tensor, db: torch.Tensor, src_off: np.ndarray, dst_off: np.ndarray, lens: np.ndarray
) -> None:
    vals = np.concatenate([src_off, dst_off, lens])
    row = int(np.gcd.reduce(vals)) or 1
    w, dt = element_width(row, (sb.data_ptr(), db.data_ptr()))
    sidx = torch.from_numpy(row_index(src_off, lens, row))
    didx = torch.from_numpy(row_index(dst_off, lens, row))
    if sb.device.type != "cpu":
        sidx = sidx.to(sb.device, non_blocking=True)
    if db.device.type != "cpu":
        didx = didx.to(db.device, non_blocking=True)
    packed = torch.index_select(row_view(sb, row, w, dt), 0, sidx)
    if packed.device != db.device:
        packed = packed.to(db.device)
    row_view(db, row, w, dt).index_copy_(0, didx, packed)


# -- entry point ------------------------------------------------------------------------------------


def copy_runs(
    src: torch.Tensor,
    dst: torch.Tensor,
    runs: Runs,
    *,
    impl: str | None = None,
    config: CopyConfig | None = None,
) -> str:
    """Copy ``runs`` from ``src`` to ``dst`` (bytes of contiguous tensors); returns the impl used.

    Asynchronous on CUDA (enqueued on the current stream of ``src``'s device). Runs must not overlap
    on the destination (the kernel's programs run in any order). Raises ``ValueError`` when a run
    leaves either tensor. The Triton copy on CUDA keeps its launch plan on ``runs`` (see the module
    docstring): copy the same request again through the same ``Runs`` object to reuse it.
    """
    tr = launches.current_trace()
    if tr is not None:
        tr.clear()
        tr.append(time.perf_counter())
    if runs.total_bytes == 0:
        return "none"
    sb = byte_view(src, "copy_runs src")
    db = byte_view(dst, "copy_runs dst")
    mode = default_impl() if impl is None else impl
    if (
        mode in ("auto", "triton")
        and sb.is_cuda
        and db.is_cuda
        and triton_available()
        and (mode == "triton" or (sb.device, db.device) not in FAILED_LAUNCHES)
    ):
        try:
            copy_planned(runs, sb, db, config or default_config())
            return "triton"
        except ValueError:
            raise
        except Exception as e:
            if mode == "triton":
                raise
            FAILED_LAUNCHES.add((sb.device, db.device))
            logger.warning("Triton copy failed on %s -> %s (%s); using index ops", sb.device,
                           db.device, e)
    runs.check_bounds(sb.numel(), db.numel(), what="copy_runs")
    return copy_arrays(sb, db, runs.src_offsets, runs.dst_offsets, runs.lengths, impl, config)


def copy_arrays(
    sb: torch.Tensor,
    db: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
    impl: str | None = None,
    config: CopyConfig | None = None,
) -> str:
    """:func:`copy_runs` on checked inputs: 1-D uint8 tensors and int64 arrays already in bounds."""
    mode = default_impl() if impl is None else impl
    if mode not in COPY_IMPLS:
        raise ValueError(f"copy_runs: impl must be one of {', '.join(COPY_IMPLS)}; got {mode!r}")
    cuda = sb.is_cuda and db.is_cuda
    if mode in ("triton", "ce") and not cuda:
        raise ValueError(f"copy_runs: impl={mode!r} needs CUDA tensors")
    if mode == "ce":
        _copy_ce(sb, db, src_off, dst_off, lens)
        return "ce"
    if mode in ("auto", "triton") and cuda and triton_available():
        key = (sb.device, db.device)
        if mode == "triton" or key not in FAILED_LAUNCHES:
            try:
                launch_triton(sb, db, src_off, dst_off, lens, config or default_config())
                return "triton"
            except Exception as e:
                if mode == "triton":
                    raise
                FAILED_LAUNCHES.add(key)
                logger.warning("Triton copy failed on %s -> %s (%s); using index ops", *key, e)
    elif mode == "triton":
        raise RuntimeError(f"copy_runs: Triton copy kernel unavailable ({kernels.kernel_error()})")
    _copy_index(sb, db, src_off, dst_off, lens)
    return "index"


# -- gather / scatter ----------------------------------------------------------------------------


def _plan(
    offsets: np.ndarray, lengths: np.ndarray, ptrs: Sequence[int], max_width: int
) -> tuple[int, int, torch.dtype]:
    """Row size (bytes) = gcd of offsets and lengths; element width = widest dividing row and pointers."""
    g = int(np.gcd.reduce(np.concatenate([offsets, lengths]))) if lengths.size else 1
    g = g or 1
    w, dt = element_width(g, ptrs, max_width)
    return g, w, dt


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
