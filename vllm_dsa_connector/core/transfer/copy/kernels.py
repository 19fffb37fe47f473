"""The Triton run copy: one kernel on a 2-D grid (run x piece) over a runs table.

Each program copies one piece of at most ``piece_bytes`` of one run (an unmasked loop of ``BLOCK``-element
steps plus one masked tail); the table is uploaded through a reused pinned ring (runs far longer than the
mean are split first), on the widest element the offsets, lengths and pointers allow, with 16-byte
alignment hints when every offset and length is 16-byte aligned. ``dst`` may live on another GPU (a peer
mapping): the kernel runs on ``src``'s device and writes through NVLink. :mod:`.launches` caches prepared
launches per :class:`Runs`; :mod:`.copy` is the entry point.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.core.transfer.copy.widths import element_width
from vllm_dsa_connector.options import (
    OptionError,
    option,
    options_of,
    parse_bool,
    parse_choice,
    resolve_options,
)

logger = logging.getLogger(__name__)

__all__ = [
    "COPY_IMPLS",
    "DEFAULT_CONFIG",
    "CopyConfig",
    "CopySettings",
    "copy_settings",
    "default_config",
    "FAILED_LAUNCHES",
    "LAUNCH_LOCK",
    "LaunchPlan",
    "kernel_error",
    "kernel_width",
    "launch_triton",
    "plan_pieces",
    "prepare_triton",
    "triton_available",
]

COPY_IMPLS = ("auto", "triton", "index", "ce")

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

    def __str__(self) -> str:
        """``piece_bytes,block_bytes,num_warps`` (the ``VLLM_DSA_COPY_CONFIG`` spelling)."""
        return f"{self.piece_bytes},{self.block_bytes},{self.num_warps}"


# Best of the launch-shape sweep on H200 (2.05 GB, 593 runs): 64 KiB pieces, 16 KiB steps, 8 warps ran the
# scattered -> scattered copy at 0.925-0.932 of a device copy (256 KiB: 0.907; 4 MiB: 0.864).
DEFAULT_CONFIG = CopyConfig()
def _parse_impl(key: str, value: Any) -> str:
    return parse_choice(key, str(value).strip().lower() or "auto", COPY_IMPLS)


def _parse_on(key: str, value: Any) -> bool:
    return True if isinstance(value, str) and not value.strip() else parse_bool(key, value)


def _parse_config(key: str, value: Any) -> CopyConfig:
    if isinstance(value, CopyConfig):
        return value
    text = str(value).strip()
    if not text:
        return DEFAULT_CONFIG
    try:
        pb, bk, nw = (int(x) for x in text.split(","))
        return CopyConfig(pb, bk, nw)
    except ValueError:
        raise OptionError(
            f"{key}: expected piece_bytes,block_bytes,num_warps (integers, block_bytes a power of two)"
        ) from None


@dataclass(frozen=True)
class CopySettings:
    """Process-wide switches of the run copy (environment only; read through :func:`copy_settings`)."""

    impl: str = option(
        "copy_impl", _parse_impl, "auto", env_only=True,
        doc="run copies: `auto` (Triton on CUDA when it loads, else torch index ops), `triton`, `index` or "
            "`ce` (one copy-engine copy per run)",
    )
    graphs: bool = option(
        "copy_graph", _parse_on, True, env_only=True,
        doc="replay a cached launch plan's Triton launch from a CUDA graph (`0`: plain launches, plans stay)",
    )
    config: CopyConfig = option(
        "copy_config", _parse_config, DEFAULT_CONFIG, env_only=True,
        doc="Triton copy launch shape `piece_bytes,block_bytes,num_warps` (default: best of the H200 sweep)",
    )


_ENV_NAMES = tuple(o.env for _, o in options_of(CopySettings) if o.env)
_RESOLVED: tuple[tuple[str | None, ...], CopySettings] | None = None


def copy_settings(environ: Any = None) -> CopySettings:
    """:class:`CopySettings` from ``environ`` (default ``os.environ``), re-resolved only when one of its
    variables changed (the copy path reads it per call). A bad value raises :class:`OptionError`
    naming the variable, the value and what is allowed."""
    global _RESOLVED
    env = os.environ if environ is None else environ
    raw = tuple(env.get(name) for name in _ENV_NAMES)
    last = _RESOLVED
    if last is not None and last[0] == raw:
        return last[1]
    settings = resolve_options(CopySettings, None, env, where="the run copy")
    _RESOLVED = (raw, settings)
    return settings


def default_config(environ: Any = None) -> CopyConfig:
    """``VLLM_DSA_COPY_CONFIG`` = ``piece_bytes,block_bytes,num_warps`` (a tuned shape), else the default."""
    return copy_settings(environ).config


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
LAUNCH_LOCK = threading.Lock()
FAILED_LAUNCHES: set[tuple[Any, ...]] = set()


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
        n = tl.multiple_of(n, ALIGN)  # lengths share the offsets' alignment (see launch_triton)
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
        with LAUNCH_LOCK:
            up = _UPLOADERS.setdefault(device, _Uploader(device))
    return up


def kernel_error() -> str | None:
    """Why the Triton copy kernel could not be built here (``None``: it was, or was not tried yet)."""
    return _KERNEL_ERROR


def triton_available() -> bool:
    """Whether the Triton copy kernel can be built here (the build is attempted once)."""
    global _KERNEL, _KERNEL_ERROR
    if _KERNEL is not None:
        return True
    if _KERNEL_ERROR is not None:
        return False
    with LAUNCH_LOCK:
        if _KERNEL is None and _KERNEL_ERROR is None:
            try:
                _KERNEL = _build_kernel()
            except Exception as e:  # no Triton, or a Triton that cannot build it
                _KERNEL_ERROR = f"{type(e).__name__}: {e}"
                logger.info("Triton copy kernel unavailable (%s); using torch index ops", e)
    return _KERNEL is not None


def kernel_width(values: np.ndarray, ptrs: tuple[int, ...]) -> tuple[int, torch.dtype, int]:
    """(element bytes, dtype, gcd of the values and pointers capped at 16): the kernel's widest view (at
    most int64, :func:`~.widths.element_width`) and its alignment hint."""
    g = int(np.gcd.reduce(values)) if values.size else 16
    for p in ptrs:
        g = math.gcd(g, int(p))
    g = math.gcd(g, 16) if g else 16
    w, dt = element_width(g, (), max_width=8)
    return w, dt, g


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


class LaunchPlan:
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


def prepare_triton(
    sb: torch.Tensor,
    db: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
    cfg: CopyConfig,
    own_table: bool = False,
) -> LaunchPlan | None:
    """Plan one launch (``None``: nothing to copy). ``own_table``: the table gets its own device tensor
    (a cached plan), else a ring slot (``plan.slot``; call ``_uploader(dev).done(slot)`` after the launch).
    """
    vals = np.concatenate([src_off, dst_off, lens])
    w, dt, g = kernel_width(vals, (sb.data_ptr(), db.data_ptr()))
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
        return LaunchPlan((s, d, torch.from_numpy(flat), n, piece, per_run), grid, meta, dev)
    up = _uploader(dev)
    with torch.cuda.device(dev):
        if own_table:
            out = torch.empty(flat.size, dtype=torch.int64, device=dev)
            idx, slot = up.upload(flat, out=out)
            up.done(slot)  # the pinned slot is free once this copy ran
            plan = LaunchPlan((s, d, idx, n, piece, per_run), grid, meta, dev)
            plan.stream = torch.cuda.current_stream(dev)
            plan.ready = torch.cuda.Event()
            plan.ready.record(plan.stream)
            return plan
        idx, slot = up.upload(flat)
    plan = LaunchPlan((s, d, idx, n, piece, per_run), grid, meta, dev)
    plan.slot = slot
    return plan


def launch_triton(
    sb: torch.Tensor,
    db: torch.Tensor,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    lens: np.ndarray,
    cfg: CopyConfig,
) -> None:
    plan = prepare_triton(sb, db, src_off, dst_off, lens, cfg)
    if plan is None:
        return
    if plan.device.type != "cuda":
        plan.launch()
        return
    with torch.cuda.device(plan.device):
        plan.launch()
        _uploader(plan.device).done(plan.slot)
