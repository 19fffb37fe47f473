"""One-pass copies of byte runs between two tensors: ``copy_runs(src, dst, runs)``.

``runs.lengths[i]`` bytes go from byte ``runs.src_offsets[i]`` of ``src`` to byte ``runs.dst_offsets[i]``
of ``dst``, in ONE pass over the bytes whatever the layout on either side: scattered -> packed is the
bounce gather, packed -> scattered its scatter, scattered -> scattered the same-node single copy (``dst``
a peer's KV pool mapped through CUDA IPC, see :mod:`vllm_dsa_connector.transport.ipc`).

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
import math
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.transport.runs import Runs

logger = logging.getLogger(__name__)

__all__ = [
    "COPY_IMPLS",
    "CopyConfig",
    "copy_arrays",
    "ce_available",
    "copy_runs",
    "default_config",
    "default_impl",
    "graphs_enabled",
    "plan_pieces",
    "plan_stats",
    "trace_launches",
    "triton_available",
]

COPY_IMPLS = ("auto", "triton", "index", "ce")

_WIDTHS = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


class CopyConfig:
    """Launch shape of the Triton copy: piece size (bytes), step size (bytes) and warps per program."""

    __slots__ = ("piece_bytes", "block_bytes", "num_warps")

    def __init__(
        self, piece_bytes: int = 64 << 10, block_bytes: int = 16 << 10, num_warps: int = 8
    ) -> None:
        if piece_bytes <= 0 or block_bytes <= 0 or block_bytes & (block_bytes - 1):
            raise ValueError("CopyConfig: piece_bytes > 0 and block_bytes a power of two")
        self.piece_bytes = int(piece_bytes)
        self.block_bytes = int(block_bytes)
        self.num_warps = int(num_warps)

    def __repr__(self) -> str:
        return (
            f"CopyConfig(piece_bytes={self.piece_bytes}, block_bytes={self.block_bytes}, "
            f"num_warps={self.num_warps})"
        )


# Best of the launch-shape sweep on H200 (2.05 GB, 593 runs): 64 KiB pieces, 16 KiB steps, 8 warps ran the
# scattered -> scattered copy at 0.925-0.932 of a device copy (256 KiB: 0.907; 4 MiB: 0.864).
DEFAULT_CONFIG = CopyConfig()
_ENV_CONFIG: tuple[str, CopyConfig] | None = None


def default_config(environ: Any = None) -> CopyConfig:
    """``VLLM_DSA_COPY_CONFIG`` = ``piece_bytes,block_bytes,num_warps`` (a tuned shape), else the default."""
    global _ENV_CONFIG
    env = os.environ if environ is None else environ
    raw = str(env.get("VLLM_DSA_COPY_CONFIG", "")).strip()
    if not raw:
        return DEFAULT_CONFIG
    if _ENV_CONFIG is not None and _ENV_CONFIG[0] == raw:
        return _ENV_CONFIG[1]
    try:
        pb, bk, nw = (int(x) for x in raw.split(","))
        cfg = CopyConfig(pb, bk, nw)
    except ValueError as e:
        raise ValueError(f"VLLM_DSA_COPY_CONFIG={raw!r}: expected piece_bytes,block_bytes,num_warps") from e
    _ENV_CONFIG = (raw, cfg)
    return cfg


def plan_pieces(
    src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray, piece: int
) -> np.ndarray:
    """Cut runs into pieces of at most ``piece`` units; returns an int64 ``[3, P]`` (src, dst, length).

    Pieces start at multiples of ``piece`` from their run's start, so they keep the run's alignment.
    Empty runs produce no piece. Vectorised.
    """
    if piece <= 0:
        raise ValueError(f"plan_pieces: piece must be > 0, got {piece}")
    lens = np.asarray(lengths, np.int64).reshape(-1)
    keep = lens > 0
    src = np.asarray(src_offsets, np.int64).reshape(-1)[keep]
    dst = np.asarray(dst_offsets, np.int64).reshape(-1)[keep]
    lens = lens[keep]
    counts = -(-lens // piece)
    total = int(counts.sum())
    out = np.empty((3, total), np.int64)
    if total == 0:
        return out
    first = np.zeros(counts.size, np.int64)
    if counts.size > 1:
        np.cumsum(counts[:-1], out=first[1:])
    k = np.arange(total, dtype=np.int64) - np.repeat(first, counts)  # piece number inside its run
    base = k * piece
    out[0] = np.repeat(src, counts) + base
    out[1] = np.repeat(dst, counts) + base
    out[2] = np.minimum(np.repeat(lens, counts) - base, piece)
    return out


# -- Triton ---------------------------------------------------------------------------------------

_KERNEL: Any = None
_KERNEL_ERROR: str | None = None
_LOCK = threading.Lock()
_FAILED_LAUNCH: set[tuple[Any, ...]] = set()


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_runs_kernel(
        src, dst, table, n_runs, piece, per_run, BLOCK: tl.constexpr, ALIGN: tl.constexpr
    ):
        # Program p copies piece j = p % per_run of run r = p // per_run: elements
        # [j * piece, min((j + 1) * piece, len)); neighbouring programs stream one run in order.
        p = tl.program_id(0).to(tl.int64)
        r = p // per_run
        start = (p % per_run) * piece
        ln = tl.load(table + 2 * n_runs + r)
        n = tl.minimum(tl.maximum(ln - start, 0), piece)
        so = tl.multiple_of(tl.load(table + r) + start, ALIGN)
        do = tl.multiple_of(tl.load(table + n_runs + r) + start, ALIGN)
        n = tl.multiple_of(n, ALIGN)  # lengths share the offsets' alignment (see _launch_triton)
        lane = tl.arange(0, BLOCK)
        full = n // BLOCK
        for i in range(full):
            o = i * BLOCK
            v = tl.load(src + so + o + lane)
            tl.store(dst + do + o + lane, v)
        o = full * BLOCK
        m = o + lane < n
        v = tl.load(src + so + o + lane, mask=m)
        tl.store(dst + do + o + lane, v, mask=m)

    return _copy_runs_kernel


class _Uploader:
    """A ring of pinned host + device buffers for the runs tables (no pinned allocation per call).

    Slot ``i`` is reused only after the event recorded behind the kernel (or the copy) that read it
    completed.
    """

    SLOTS = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.next = 0
        self.host: list[torch.Tensor | None] = [None] * self.SLOTS
        self.dev: list[torch.Tensor | None] = [None] * self.SLOTS
        self.events: list[Any] = [None] * self.SLOTS

    def upload(self, arr: np.ndarray, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Copy ``arr`` to the device (asynchronously, on the current stream); returns (tensor, slot).

        ``out``: a device tensor of ``arr.size`` int64 to copy into (a plan's own table) instead of the
        slot's device buffer. Call :meth:`done` with the slot once the consumer is enqueued.
        """
        with self.lock:
            i = self.next
            self.next = (i + 1) % self.SLOTS
            ev = self.events[i]
            if ev is not None:
                ev.synchronize()
                self.events[i] = None
            n = arr.size
            host, dev = self.host[i], self.dev[i]
            if host is None or dev is None or host.numel() < n:
                cap = max(1024, 1 << (n - 1).bit_length())
                host = torch.empty(cap, dtype=torch.int64).pin_memory()
                dev = torch.empty(cap, dtype=torch.int64, device=self.device)
                self.host[i], self.dev[i] = host, dev
            host[:n].numpy()[:] = arr
            target = dev[:n] if out is None else out
            target.copy_(host[:n], non_blocking=True)
            return target, i

    def done(self, i: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.events[i] = ev


_UPLOADERS: dict[torch.device, _Uploader] = {}


def _uploader(device: torch.device) -> _Uploader:
    up = _UPLOADERS.get(device)
    if up is None:
        with _LOCK:
            up = _UPLOADERS.setdefault(device, _Uploader(device))
    return up


def triton_available() -> bool:
    """Whether the Triton copy kernel can be built here (the build is attempted once)."""
    global _KERNEL, _KERNEL_ERROR
    if _KERNEL is not None:
        return True
    if _KERNEL_ERROR is not None:
        return False
    with _LOCK:
        if _KERNEL is None and _KERNEL_ERROR is None:
            try:
                _KERNEL = _build_kernel()
            except Exception as e:  # no Triton, or a Triton that cannot build it
                _KERNEL_ERROR = f"{type(e).__name__}: {e}"
                logger.info("Triton copy kernel unavailable (%s); using torch index ops", e)
    return _KERNEL is not None


def default_impl(environ: Any = None) -> str:
    """``VLLM_DSA_COPY_IMPL`` (auto/triton/index), ``auto`` when unset."""
    env = os.environ if environ is None else environ
    v = str(env.get("VLLM_DSA_COPY_IMPL", "auto")).strip().lower() or "auto"
    if v not in COPY_IMPLS:
        raise ValueError(f"VLLM_DSA_COPY_IMPL must be one of {', '.join(COPY_IMPLS)}; got {v!r}")
    return v


def _byte_view(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _width(values: np.ndarray, ptrs: tuple[int, ...]) -> tuple[int, torch.dtype, int]:
    """(element bytes, dtype, gcd of the values and pointers capped at 16) for the widest fitting view."""
    g = int(np.gcd.reduce(values)) if values.size else 16
    for p in ptrs:
        g = math.gcd(g, int(p))
    g = math.gcd(g, 16) if g else 16
    for w, dt in _WIDTHS:
        if g % w == 0:
            return w, dt, g
    return 1, torch.uint8, g


_MAX_GRID_Y = 1 << 20  # pieces per run (bounds the grid's waste for one huge run)


def _runs_table(
    src: np.ndarray, dst: np.ndarray, lens: np.ndarray, piece: int
) -> tuple[np.ndarray, int]:
    """Table ``[3, R]`` (src, dst, len) and pieces per run for the 2-D grid (R x pieces).

    Runs much longer than the mean are split first (into sub-runs of a multiple of ``piece``), so the
    grid stays within about twice the pieces actually needed and under the grid's y limit.
    """
    keep = lens > 0
    if not keep.all():
        src, dst, lens = src[keep], dst[keep], lens[keep]
    n = lens.size
    if n == 0:
        return np.empty((3, 0), np.int64), 0
    mean = int(lens.sum()) // n
    cap = piece * min(_MAX_GRID_Y, max(1, -(-mean // piece)))
    longest = int(lens.max())
    if longest > 2 * cap or longest > piece * _MAX_GRID_Y:
        table = plan_pieces(src, dst, lens, cap)
        longest = int(table[2].max())
    else:
        table = np.stack([src, dst, lens])
    return table, -(-longest // piece)


class _Plan:
    """One prepared Triton launch: typed views, the runs table (on the device for CUDA), grid, meta."""

    __slots__ = ("args", "grid", "meta", "device", "ready", "stream", "uses", "graph", "slot")

    def __init__(self, args: tuple[Any, ...], grid: tuple[int], meta: dict[str, int],
                 device: torch.device) -> None:
        self.args = args
        self.grid = grid
        self.meta = meta
        self.device = device
        self.ready: Any = None  # event behind the table upload (a cached plan on another stream waits)
        self.stream: Any = None  # the stream the table was uploaded on
        self.uses = 0
        self.graph: Any = None  # CUDAGraph once captured; False when capture failed
        self.slot = -1  # ring slot of an uncached plan's table

    def launch(self) -> None:
        _KERNEL[self.grid](*self.args, **self.meta)


def _prepare_triton(
    sb: torch.Tensor,
    db: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
    cfg: CopyConfig,
    own_table: bool = False,
) -> _Plan | None:
    """Plan one launch (``None``: nothing to copy). ``own_table``: the table gets its own device tensor
    (a cached plan), else a ring slot (``plan.slot``; call ``_uploader(dev).done(slot)`` after the launch).
    """
    vals = np.concatenate([src_off, dst_off, lens])
    w, dt, g = _width(vals, (sb.data_ptr(), db.data_ptr()))
    align = max(1, g // w)  # elements; offsets and lengths are multiples of this (16 bytes at most)
    block = cfg.block_bytes // w
    piece = max(block, (cfg.piece_bytes // w) // block * block)
    table, per_run = _runs_table(src_off // w, dst_off // w, lens // w, piece)
    n = table.shape[1]
    if n == 0:
        return None
    s = sb[: (sb.numel() // w) * w].view(dt)
    d = db[: (db.numel() // w) * w].view(dt)
    grid = (n * per_run,)
    dev = sb.device
    meta = {"BLOCK": block, "ALIGN": align, "num_warps": cfg.num_warps}
    flat = np.ascontiguousarray(table).reshape(-1)
    if dev.type != "cuda":  # only under TRITON_INTERPRET=1 (tests)
        return _Plan((s, d, torch.from_numpy(flat), n, piece, per_run), grid, meta, dev)
    up = _uploader(dev)
    with torch.cuda.device(dev):
        if own_table:
            out = torch.empty(flat.size, dtype=torch.int64, device=dev)
            idx, slot = up.upload(flat, out=out)
            up.done(slot)  # the pinned slot is free once this copy ran
            plan = _Plan((s, d, idx, n, piece, per_run), grid, meta, dev)
            plan.stream = torch.cuda.current_stream(dev)
            plan.ready = torch.cuda.Event()
            plan.ready.record(plan.stream)
            return plan
        idx, slot = up.upload(flat)
    plan = _Plan((s, d, idx, n, piece, per_run), grid, meta, dev)
    plan.slot = slot
    return plan


def _launch_triton(
    sb: torch.Tensor,
    db: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
    cfg: CopyConfig,
) -> None:
    plan = _prepare_triton(sb, db, src_off, dst_off, lens, cfg)
    if plan is None:
        return
    if plan.device.type != "cuda":
        plan.launch()
        return
    with torch.cuda.device(plan.device):
        plan.launch()
        _uploader(plan.device).done(plan.slot)


# -- launch plans cached per Runs, CUDA graphs ---------------------------------------------------------

# Runs -> {(pointers, sizes, devices, launch shape): plan}; weak, so a plan goes with its request's runs.
_PLANS: weakref.WeakKeyDictionary[Runs, dict[tuple[Any, ...], _Plan]] = weakref.WeakKeyDictionary()
_PLANS_PER_RUNS = 4
_NO_GRAPH: set[str] = set()  # devices where a capture failed (plain launches there)
_CAPTURE_STREAMS: dict[str, Any] = {}
_STATS = {"plans": 0, "plan_hits": 0, "graphs": 0, "graph_replays": 0, "graph_failures": 0}


_TRACE: list[float] | None = None  # benchmarks: perf_counter stamps of the last planned copy


def trace_launches(on: bool = True) -> list[float] | None:
    """Benchmarks: stamp the last planned copy (``perf_counter`` at copy_runs entry, plan found, launch
    or replay issued, returned); returns the list that is refilled per copy (``None`` when off)."""
    global _TRACE
    _TRACE = [] if on else None
    return _TRACE


def plan_stats() -> dict[str, int]:
    """Counters of this process: plans built, cached-plan launches, graphs captured / replayed / failed."""
    return dict(_STATS)


def graphs_enabled(environ: Any = None) -> bool:
    """``VLLM_DSA_COPY_GRAPH`` (default on): replay a cached plan's launch from a CUDA graph."""
    env = os.environ if environ is None else environ
    return str(env.get("VLLM_DSA_COPY_GRAPH", "1")).strip().lower() not in ("0", "false", "off", "no")


def _plan_key(sb: torch.Tensor, db: torch.Tensor, cfg: CopyConfig) -> tuple[Any, ...]:
    return (sb.data_ptr(), sb.numel(), db.data_ptr(), db.numel(), str(sb.device), str(db.device),
            cfg.piece_bytes, cfg.block_bytes, cfg.num_warps)


def _capture(plan: _Plan) -> Any:
    """Capture the plan's launch into a CUDA graph on a side stream; ``False`` when that fails."""
    dev = plan.device
    key = str(dev)
    try:
        side = _CAPTURE_STREAMS.get(key)
        if side is None:
            side = _CAPTURE_STREAMS.setdefault(key, torch.cuda.Stream(dev))
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # thread_local: NIXL/UCX threads of this process may issue CUDA calls meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                plan.launch()
            finally:
                graph.capture_end()
        _STATS["graphs"] += 1
        return graph
    except Exception as e:  # capture refused: plain launches on this device from now on
        _NO_GRAPH.add(key)
        _STATS["graph_failures"] += 1
        logger.warning("copy_runs: CUDA graph capture failed on %s (%s); plain launches", dev, e)
        return False


def _run_plan(plan: _Plan) -> None:
    """Launch a cached plan on the current stream (graph replay from its second use)."""
    dev = plan.device
    if dev.type != "cuda":  # only under TRITON_INTERPRET=1 (tests): no streams, no graphs
        plan.uses += 1
        plan.launch()
        return
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        if plan.ready is not None and stream != plan.stream:
            stream.wait_event(plan.ready)  # the table upload ran on another stream
            plan.args[2].record_stream(stream)  # and its memory is not reused under this launch
        plan.uses += 1
        if plan.graph is None and plan.uses >= 2:
            if graphs_enabled() and str(dev) not in _NO_GRAPH:
                plan.graph = _capture(plan)
        tr = _TRACE
        if tr is not None:
            tr.append(time.perf_counter())
        if plan.graph:
            plan.graph.replay()
            _STATS["graph_replays"] += 1
        else:
            plan.launch()
        if tr is not None:
            tr.append(time.perf_counter())


def _copy_planned(runs: Runs, sb: torch.Tensor, db: torch.Tensor, cfg: CopyConfig) -> None:
    """The Triton copy of ``runs`` through the plan cached on ``runs`` (built on first use)."""
    key = _plan_key(sb, db, cfg)
    per = _PLANS.get(runs)
    plan = per.get(key) if per is not None else None
    if plan is None:
        runs.check_bounds(sb.numel(), db.numel(), what="copy_runs")
        plan = _prepare_triton(sb, db, runs.src_offsets, runs.dst_offsets, runs.lengths, cfg,
                               own_table=True)
        if plan is None:
            return
        with _LOCK:
            per = _PLANS.setdefault(runs, {})
            if len(per) >= _PLANS_PER_RUNS:
                per.pop(next(iter(per)))
            per[key] = plan
        _STATS["plans"] += 1
    else:
        _STATS["plan_hits"] += 1
    if _TRACE is not None:
        _TRACE.append(time.perf_counter())
    _run_plan(plan)


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


def _rows(buf: torch.Tensor, row: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    n = (buf.numel() // row) * row
    return buf[:n].view(dtype).view(-1, row // width)


def _copy_index(
    sb: torch.Tensor, db: torch.Tensor, src_off: np.ndarray, dst_off: np.ndarray, lens: np.ndarray
) -> None:
    vals = np.concatenate([src_off, dst_off, lens])
    row = int(np.gcd.reduce(vals)) or 1
    w, dt, _ = _width(np.asarray([row], np.int64), (sb.data_ptr(), db.data_ptr()))
    sidx = torch.from_numpy(row_index(src_off, lens, row))
    didx = torch.from_numpy(row_index(dst_off, lens, row))
    if sb.device.type != "cpu":
        sidx = sidx.to(sb.device, non_blocking=True)
    if db.device.type != "cpu":
        didx = didx.to(db.device, non_blocking=True)
    packed = torch.index_select(_rows(sb, row, w, dt), 0, sidx)
    if packed.device != db.device:
        packed = packed.to(db.device)
    _rows(db, row, w, dt).index_copy_(0, didx, packed)


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
    tr = _TRACE
    if tr is not None:
        tr.clear()
        tr.append(time.perf_counter())
    if runs.total_bytes == 0:
        return "none"
    sb = _byte_view(src, "copy_runs src")
    db = _byte_view(dst, "copy_runs dst")
    mode = default_impl() if impl is None else impl
    if (
        mode in ("auto", "triton")
        and sb.is_cuda
        and db.is_cuda
        and triton_available()
        and (mode == "triton" or (sb.device, db.device) not in _FAILED_LAUNCH)
    ):
        try:
            _copy_planned(runs, sb, db, config or default_config())
            return "triton"
        except ValueError:
            raise
        except Exception as e:
            if mode == "triton":
                raise
            _FAILED_LAUNCH.add((sb.device, db.device))
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
        if mode == "triton" or key not in _FAILED_LAUNCH:
            try:
                _launch_triton(sb, db, src_off, dst_off, lens, config or default_config())
                return "triton"
            except Exception as e:
                if mode == "triton":
                    raise
                _FAILED_LAUNCH.add(key)
                logger.warning("Triton copy failed on %s -> %s (%s); using index ops", *key, e)
    elif mode == "triton":
        raise RuntimeError(f"copy_runs: Triton copy kernel unavailable ({_KERNEL_ERROR})")
    _copy_index(sb, db, src_off, dst_off, lens)
    return "index"
