"""The bounce transport: gather scattered runs into one registered staging slot, write once, scatter.

Pieces:

- :class:`StagingArena`: one buffer allocated (and registered by its user) once; first-fit, aligned,
  reuses freed holes (neighbours coalesce); ``reserve`` waits a bounded time, then returns ``None`` so
  the caller takes the direct path (no deadlock, no lost transfer). Regions whose transfer failed are
  quarantined, never reused (a late write cannot corrupt a later transfer).
- :func:`gather` / :func:`scatter`: torch index ops on int64 views (narrower only when the runs' offsets
  or lengths require it), never a Python loop per run. Same code on CPU and CUDA tensors.
- :class:`BounceSender` (the writer) and :class:`BounceReceiver` (the target): the receiver reserves ONE
  region for all writers of a request (fan-in), checks EVERY writer's layout (bounds and overlaps across
  writers) before it advertises slots, scatters each bounced writer's slot only after that writer's
  notification (NIXL delivers it after the data landed), and completes the request only after all
  writers arrived and every scatter finished (CUDA: synchronised).

Both sides must describe a writer's transfer with the same :class:`Runs`; both merge it with
:meth:`Runs.merged` (deterministic), which fixes the packed order in the staging slot.

Two more paths for :meth:`BounceSender.send` (chosen by :meth:`BounceGate.choose` when the caller lists
them, or forced): ``pipelined`` cuts the packed stream into chunks (:func:`plan_chunks`), gathers them
back to back and posts each chunk's WRITE as soon as its gather finished; the receiver scatters each
chunk when its notification arrives, so gather, wire and scatter overlap across GPUs or nodes.
``ipc`` (same node): one kernel writes the destination's pages through a CUDA IPC mapping of the
receiver's region (:mod:`vllm_dsa_connector.transport.ipc`). Completion signal (``ipc_signal``):
``"event"`` (default on CUDA) records an interprocess CUDA event behind the kernel and sends the NIXL
notification ``dsa1:e<writer>.<event handle>:<tag>`` right after the launch, so it travels while the
kernel runs; the receiver opens the event once per handle and completes when it has fired (no host
round trip after the copy). ``"event+notify"`` also sends ``dsa1:i<writer>:<tag>`` once the sender's
``wait`` saw the copy finish (a receiver that cannot open the event completes on that one; otherwise it
is dropped). ``"notify"``: only the notification after completion.

Gather and scatter use torch index ops over rows (the gcd of the runs' offsets and lengths); when that
index would exceed :data:`MAX_INDEX_ROWS` rows (e.g. the chunks of a pipelined bounce, cut at 4 KiB
multiples inside blocks: 256-byte rows, millions of them built on the host per chunk) they use the
Triton run copy on CUDA instead (a table of runs, no per-row index).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.transport.copy import (
    copy_arrays,
    copy_runs,
    default_impl,
    row_index,
    triton_available,
)
from vllm_dsa_connector.transport.engine import (
    NixlEngine,
    Region,
    RegionDesc,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.transport.gate import BounceGate, Decision
from vllm_dsa_connector.transport.runs import Chunk, Runs, plan_chunks

logger = logging.getLogger(__name__)

__all__ = [
    "BounceReceiver",
    "BounceSender",
    "LayoutError",
    "Reservation",
    "Send",
    "StagingArena",
    "StagingSlot",
    "check_fan_in",
    "IPC_SIGNALS",
    "MAX_INDEX_ROWS",
    "decode_chunk_notif",
    "decode_event_notif",
    "decode_notif",
    "encode_chunk_notif",
    "encode_event_notif",
    "encode_notif",
    "gather",
    "scatter",
]

_NOTIF_PREFIX = b"dsa1:"


class LayoutError(ValueError):
    """Writers' runs leave the destination or overlap each other; names the writer(s)."""


# -- arena -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """``size`` bytes (aligned up) at ``offset`` of an arena; ``nbytes`` were asked for."""

    offset: int
    size: int
    nbytes: int


class StagingArena:
    """A staging buffer with a first-fit, ``align``-aligned allocator that reuses freed holes."""

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
        self.size = (buffer.numel() // align) * align
        self.align = align
        self._holes: list[list[int]] = [[0, self.size]]  # [offset, size], sorted, coalesced
        self._live: dict[int, Reservation] = {}
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

    def _try(self, need: int) -> Reservation | None:
        for i, (off, size) in enumerate(self._holes):
            if size >= need:
                if size == need:
                    del self._holes[i]
                else:
                    self._holes[i] = [off + need, size - need]
                return Reservation(off, need, 0)
        return None

    def reserve(self, nbytes: int, timeout_s: float = 0.0) -> Reservation | None:
        """First fit of ``nbytes``; waits up to ``timeout_s`` for a release, then ``None`` (go direct)."""
        if nbytes <= 0:
            raise ValueError(f"StagingArena.reserve: nbytes must be > 0, got {nbytes}")
        need = -(-int(nbytes) // self.align) * self.align
        if need > self.size:
            return None
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cv:
            while True:
                got = self._try(need)
                if got is not None:
                    res = Reservation(got.offset, need, int(nbytes))
                    self._live[res.offset] = res
                    return res
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)

    def release(self, res: Reservation) -> None:
        """Return a reservation's bytes; neighbouring holes coalesce."""
        with self._cv:
            if self._live.get(res.offset) != res:
                raise ValueError(f"StagingArena.release: {res} is not live (double release?)")
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
        """Never reuse this reservation (a failed transfer might still write into it)."""
        with self._cv:
            if self._live.pop(res.offset, None) is not None:
                self._quarantined += res.size

    def view(self, res: Reservation, nbytes: int | None = None) -> torch.Tensor:
        """The reservation's bytes (first ``nbytes``, default what was asked for)."""
        n = res.nbytes if nbytes is None else nbytes
        return self.buffer[res.offset : res.offset + n]


# -- gather / scatter -------------------------------------------------------------------------------


def _byte_view(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{what}: tensor must be contiguous")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# Widest first. complex128 is a 16-byte bit container here (index ops copy bits, no arithmetic): on this
# project's CPU host it scattered 576 B rows 3.4x faster than int64; uint8 only when a run needs it.
_WIDTHS = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def _rows(buf: torch.Tensor, row: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    n = (buf.numel() // row) * row
    return buf[:n].view(dtype).view(-1, row // width)


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
    sb = _byte_view(src, "gather src")
    runs.check_bounds(sb.numel(), 1 << 62, what="gather")
    if out.numel() < total or out.dtype != torch.uint8:
        raise ValueError(f"gather: out must be uint8 with >= {total} bytes")
    ob = out[:total]
    if _use_kernel(sb, ob, impl, runs.src_offsets, runs.lengths, total):
        copy_arrays(sb, ob, runs.src_offsets, runs.staging_offsets(), runs.lengths, impl)
        return
    row, w, dt = _plan(runs.src_offsets, runs.lengths, (sb.data_ptr(), ob.data_ptr()), max_width)
    idx = _index(row_index(runs.src_offsets, runs.lengths, row), sb.device)
    torch.index_select(_rows(sb, row, w, dt), 0, idx, out=ob.view(dt).view(-1, row // w))


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
    db = _byte_view(dst, "scatter dst")
    runs.check_bounds(1 << 62, db.numel(), what="scatter")
    if staging.numel() < total or staging.dtype != torch.uint8:
        raise ValueError(f"scatter: staging must be uint8 with >= {total} bytes")
    sb = staging[:total]
    if _use_kernel(sb, db, impl, runs.dst_offsets, runs.lengths, total):
        copy_arrays(sb, db, runs.staging_offsets(), runs.dst_offsets, runs.lengths, impl)
        return
    row, w, dt = _plan(runs.dst_offsets, runs.lengths, (db.data_ptr(), sb.data_ptr()), max_width)
    idx = _index(row_index(runs.dst_offsets, runs.lengths, row), db.device)
    _rows(db, row, w, dt).index_copy_(0, idx, sb.view(dt).view(-1, row // w))


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


# -- notifications ----------------------------------------------------------------------------------


_PATH_CODE = {"bounce": b"b", "direct": b"d", "ipc": b"i"}
_CODE_PATH = {v: k for k, v in _PATH_CODE.items()}


def encode_notif(path: str, writer: int, tag: bytes) -> bytes:
    """``dsa1:<b|d|i><writer>:<tag>``: which path a writer took, so the target knows whether to scatter.

    ``i`` (the IPC single copy) needs no scatter, like ``d``; any other path is encoded as ``d``.
    """
    return _NOTIF_PREFIX + _PATH_CODE.get(path, b"d") + str(int(writer)).encode() + b":" + tag


def decode_notif(msg: bytes) -> tuple[str, int, bytes] | None:
    """Inverse of :func:`encode_notif`; ``None`` for other messages (chunk notifications included)."""
    if not msg.startswith(_NOTIF_PREFIX):
        return None
    body = msg[len(_NOTIF_PREFIX) :]
    head, sep, tag = body.partition(b":")
    if not sep or len(head) < 2 or head[:1] not in _CODE_PATH or not head[1:].isdigit():
        return None
    return _CODE_PATH[head[:1]], int(head[1:]), tag


def encode_event_notif(writer: int, handle: bytes, tag: bytes) -> bytes:
    """``dsa1:e<writer>.<hex handle>:<tag>``: the ``ipc`` copy was launched; done when the event fires."""
    return _NOTIF_PREFIX + f"e{int(writer)}.".encode() + bytes(handle).hex().encode() + b":" + tag


def decode_event_notif(msg: bytes) -> tuple[int, bytes, bytes] | None:
    """Inverse of :func:`encode_event_notif`: ``(writer, handle, tag)``; ``None`` for other messages."""
    if not msg.startswith(_NOTIF_PREFIX + b"e"):
        return None
    head, sep, tag = msg[len(_NOTIF_PREFIX) + 1 :].partition(b":")
    w, dot, hexed = head.partition(b".")
    if not sep or not dot or not w.isdigit() or not hexed or len(hexed) % 2:
        return None
    try:
        handle = bytes.fromhex(hexed.decode())
    except ValueError:
        return None
    return int(w), handle, tag


def encode_chunk_notif(writer: int, index: int, count: int, tag: bytes) -> bytes:
    """``dsa1:c<writer>.<index>.<count>:<tag>``: chunk ``index`` of ``count`` of a pipelined bounce."""
    return _NOTIF_PREFIX + f"c{int(writer)}.{int(index)}.{int(count)}:".encode() + tag


def decode_chunk_notif(msg: bytes) -> tuple[int, int, int, bytes] | None:
    """Inverse of :func:`encode_chunk_notif`: ``(writer, index, count, tag)``; ``None`` otherwise."""
    if not msg.startswith(_NOTIF_PREFIX + b"c"):
        return None
    head, sep, tag = msg[len(_NOTIF_PREFIX) + 1 :].partition(b":")
    parts = head.split(b".")
    if not sep or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    writer, index, count = (int(p) for p in parts)
    if count < 1 or index >= count:
        return None
    return writer, index, count, tag


# -- sender -----------------------------------------------------------------------------------------


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


IPC_SIGNALS = ("event", "event+notify", "notify")


class _EventPool:
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


class BounceSender:
    """Writer side: gate, gather into the local arena, one WRITE into the receiver's slot (or direct).

    Also the ``pipelined`` (chunked bounce) and ``ipc`` (one kernel through a mapping) paths.
    """

    def __init__(
        self,
        engine: NixlEngine,
        arena: StagingArena,
        gate: BounceGate,
        reserve_timeout_s: float | None = None,
        ipc_signal: str = "event",
    ) -> None:
        if ipc_signal not in IPC_SIGNALS:
            raise ValueError(f"BounceSender: ipc_signal must be one of {IPC_SIGNALS}; got {ipc_signal!r}")
        self.engine = engine
        self.arena = arena
        self.gate = gate
        self.reserve_timeout_s = (
            gate.settings.reserve_timeout_s if reserve_timeout_s is None else reserve_timeout_s
        )
        self.region = engine.register(arena.buffer)
        self.ipc_signal = ipc_signal
        self._logged: set[str] = set()
        self._events: dict[str, _EventPool] = {}

    def _once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("bounce skipped: %s (logged once)", reason)

    def send(
        self,
        peer: str,
        src: Region,
        dst: RegionDesc | dict[str, Any],
        runs: Runs,
        tag: bytes,
        *,
        slot: StagingSlot | dict[str, Any] | None,
        writer: int = 0,
        path: str | None = None,
        paths: tuple[str, ...] | None = None,
        chunks: int | None = None,
        ipc: torch.Tensor | None = None,
        ipc_impl: str | None = None,
        ipc_signal: str | None = None,
    ) -> Send:
        """Send ``runs`` of ``src`` to ``dst`` on ``peer``; bounce through ``slot`` when the gate says so.

        ``path`` forces ``"bounce"``/``"direct"``/``"pipelined"``/``"ipc"`` (benchmarks). Without it the
        gate decides: :meth:`BounceGate.decision` (bounce or direct) unless ``paths`` lists the
        candidates for :meth:`BounceGate.choose`. ``ipc`` is the receiver's region (``dst``) mapped
        here (:func:`~vllm_dsa_connector.transport.ipc.open_region`); ``chunks`` overrides the gate's
        chunk count of a pipelined send; ``ipc_impl`` the copy of the ``ipc`` path (default: the Triton
        kernel, measured faster than one copy-engine DMA per run across GPUs too; ``"ce"`` forces those);
        ``ipc_signal`` overrides the sender's completion signal of the ``ipc`` path (``"event"`` /
        ``"event+notify"`` / ``"notify"``, see the module docstring). Pass the same ``runs`` object to send the same request
        again: its merge and the copy's launch plan are cached on it.
        Falls back to direct when the receiver gave no slot, the slot is too small, or the local arena
        has no room within the bounded wait.
        """
        merged = runs.merged()
        decision = None
        k = 1
        if path is None:
            if paths is None:
                decision = self.gate.decision(merged, merged=True)
            else:
                avail = tuple(
                    p
                    for p in paths
                    if (p != "ipc" or ipc is not None)
                    and (p not in ("bounce", "pipelined") or slot is not None)
                )
                decision = self.gate.choose(merged, merged=True, paths=avail or ("direct",))
                k = decision.chunks
            path, reason = decision.path, decision.reason
        else:
            reason = f"forced {path}"
        if chunks is not None:
            k = int(chunks)
        elif path == "pipelined" and decision is None:
            k = 4
        if path == "ipc":
            if ipc is None:
                path, reason = "direct", "no IPC mapping of the destination"
                self._once(reason)
            else:
                return self._send_ipc(
                    peer, src, merged, ipc, tag, writer, decision, reason, ipc_impl, ipc_signal
                )
        res = None
        staging: StagingSlot | None = None
        if path in ("bounce", "pipelined"):
            staging = StagingSlot.from_dict(slot) if slot is not None else None
            if merged.total_bytes == 0:
                path, reason = "direct", "empty transfer"
            elif staging is None:
                path, reason = "direct", "receiver advertised no staging slot"
            elif staging.size < merged.total_bytes:
                path, reason = "direct", f"slot of {staging.size} B < {merged.total_bytes} B"
            else:
                res = self.arena.reserve(merged.total_bytes, self.reserve_timeout_s)
                if res is None:
                    path, reason = "direct", "local staging arena full (backpressure)"
            if path == "direct":
                self._once(reason)
        if path == "pipelined":
            assert res is not None and staging is not None
            return self._send_pipelined(
                peer, src, merged, res, staging, tag, writer, k, decision, reason
            )
        notif = encode_notif(path, writer, tag)
        if path == "bounce":
            assert res is not None and staging is not None
            try:
                gather(src.tensor, merged, self.arena.view(res))
                _sync(self.arena.buffer)
                one = Runs(
                    np.array([res.offset]), np.array([staging.offset]), np.array([merged.total_bytes])
                )
                xfer = self.engine.write(peer, self.region, staging.region, one, notif)
            except BaseException:
                self.arena.release(res)
                raise
        else:
            xfer = self.engine.write(peer, src, dst, merged, notif)
        return Send(xfer, path, decision, reason, res)

    # -- ipc ----------------------------------------------------------------------------------------

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
            ev = _record(src.tensor)
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
            pool = _EventPool(device)
            pool.release(probe, handle)
            self._events[key] = pool
            return True
        except Exception as e:  # no interprocess events here: notify after completion
            self._logged.add(f"no-events:{key}")
            logger.info("ipc: no interprocess CUDA events on %s (%s); notifying after completion", key, e)
            return False

    # -- pipelined ----------------------------------------------------------------------------------

    def _send_pipelined(
        self,
        peer: str,
        src: Region,
        merged: Runs,
        res: Reservation,
        slot: StagingSlot,
        tag: bytes,
        writer: int,
        count: int,
        decision: Decision | None,
        reason: str,
    ) -> Send:
        t0 = time.perf_counter()
        plan = plan_chunks(merged, max(1, int(count)))
        events = []
        try:
            for ch in plan:  # gathers back to back on the stream; each chunk's event marks it done
                gather(src.tensor, ch.runs, self.arena.buffer[res.offset + ch.start :])
                events.append(_record(self.arena.buffer))
        except BaseException:
            self.arena.release(res)
            raise
        rec = Transfer(f"pipelined {tag[:48]!r}", peer, len(plan), merged.total_bytes, t0)
        send = Send(
            rec,
            "pipelined",
            decision,
            reason,
            res,
            chunks=len(plan),
            _peer=peer,
            _plan=plan,
            _events=events,
            _slot=slot,
            _writer=writer,
            _tag=tag,
        )
        self.progress(send)
        return send

    def progress(self, send: Send) -> bool:
        """Post the WRITEs of chunks whose gather finished (in order); ``True`` once all are posted.

        Call it from the worker's loop (``wait`` calls it too). No-op for other paths.
        """
        if send.path != "pipelined":
            return True
        res, slot = send._res, send._slot
        assert slot is not None
        while len(send._posted) < len(send._plan):
            i = len(send._posted)
            if not _done(send._events[i]):
                return False
            ch = send._plan[i]
            if res is None:
                raise TransferError(f"pipelined send {send._tag!r} lost its staging", peer=send._peer)
            one = Runs(
                np.array([res.offset + ch.start]), np.array([slot.offset + ch.start]), np.array([ch.nbytes])
            )
            notif = encode_chunk_notif(send._writer, i, len(send._plan), send._tag)
            send._posted.append(self.engine.write(send._peer, self.region, slot.region, one, notif))
            send.transfer = send._posted[-1]
        return True

    def wait(self, send: Send, timeout_s: float = 10.0) -> TransferStats:
        """Wait for the WRITE; frees the staging reservation (quarantines it on failure)."""
        if send.path == "ipc":
            return self._wait_ipc(send, timeout_s)
        try:
            if send.path == "pipelined":
                return self._wait_pipelined(send, timeout_s)
            stats = self.engine.wait(send.transfer, timeout_s)
        except BaseException:
            if send._res is not None:
                self.arena.quarantine(send._res)
                send._res = None
            raise
        if send._res is not None:
            self.arena.release(send._res)
            send._res = None
        return stats

    def _wait_ipc(self, send: Send, timeout_s: float) -> TransferStats:
        rec = send.transfer
        if rec.stats is not None:
            return rec.stats
        deadline = rec.started + timeout_s
        started = time.perf_counter()
        while not _done(send._event):
            if time.perf_counter() > deadline:
                raise TransferError(
                    f"ipc copy {rec.name} to {rec.peer!r} not done after {timeout_s} s",
                    peer=rec.peer,
                    transfer=rec.name,
                )
            _pause(started)
        if send.signal != "event":  # the bytes are there: tell D (after an event D usually drops it)
            self.engine.send_notification(send._peer, send._notif)
        if send._pool is not None and send._event is not None:
            send._pool.release(send._event, send._handle)
            send._pool = send._event = None
        rec.stats = TransferStats(rec.num_runs, rec.total_bytes, time.perf_counter() - rec.started, 0)
        return rec.stats

    def _wait_pipelined(self, send: Send, timeout_s: float) -> TransferStats:
        started = time.perf_counter()
        deadline = started + timeout_s
        spins = 0
        while not self.progress(send):
            if time.perf_counter() > deadline:
                raise TransferError(
                    f"pipelined send {send._tag!r}: gathers not done after {timeout_s} s",
                    peer=send._peer,
                )
            spins += 1
            time.sleep(0 if spins < 200 else 5e-5)
        descs = 0
        for xfer in send._posted:
            st = self.engine.wait(xfer, max(1e-3, deadline - time.perf_counter()))
            descs += max(0, st.desc_count)
        if send._res is not None:
            self.arena.release(send._res)
            send._res = None
        first = send._posted[0] if send._posted else None
        t0 = first.started if first is not None else started
        total = sum(x.total_bytes for x in send._posted)
        return TransferStats(
            len(send._posted),
            total,
            time.perf_counter() - t0,
            descs if self.engine.telemetry else -1,
        )


# -- receiver ---------------------------------------------------------------------------------------


def check_fan_in(writers: Sequence[Runs], dst_size: int) -> None:
    """Safety check over EVERY writer's layout: in bounds, and no byte written twice (within or across)."""
    if not writers:
        return
    lens = [w.lengths for w in writers]
    starts = np.concatenate([w.dst_offsets for w in writers])
    lengths = np.concatenate(lens)
    owner = np.repeat(np.arange(len(writers)), [x.size for x in lens])
    keep = lengths > 0
    starts, lengths, owner = starts[keep], lengths[keep], owner[keep]
    if starts.size == 0:
        return
    ends = starts + lengths
    bad = np.flatnonzero(ends > dst_size)
    if bad.size:
        i = int(bad[0])
        raise LayoutError(
            f"writer {int(owner[i])}: run [{int(starts[i])}, {int(ends[i])}) is outside "
            f"the {dst_size}-byte destination"
        )
    order = np.argsort(starts, kind="stable")
    s, e, o = starts[order], ends[order], owner[order]
    hit = np.flatnonzero(s[1:] < np.maximum.accumulate(e)[:-1])
    if hit.size:
        j = int(hit[0]) + 1
        prev = int(np.argmax(e[:j] > s[j]))
        a, b = sorted((int(o[prev]), int(o[j])))
        who = f"writer {a}" if a == b else f"writers {a} and {b}"
        raise LayoutError(
            f"{who}: destination bytes [{int(s[j])}, {int(min(e[prev], e[j]))}) written twice"
        )


@dataclass(eq=False)
class _Expected:
    tag: bytes
    dst: torch.Tensor
    runs: list[Runs]
    slots: list[StagingSlot | None]
    res: Reservation | None
    arrived: dict[int, str] = field(default_factory=dict)
    chunks: dict[int, tuple[list[Chunk], set[int]]] = field(default_factory=dict)  # pipelined
    events: dict[int, Any] = field(default_factory=dict)  # ipc event signal: writer -> opened event


class BounceReceiver:
    """Target side: reserve one fan-in region, advertise slots, scatter after data landed, complete."""

    def __init__(
        self, engine: NixlEngine, arena: StagingArena, reserve_timeout_s: float = 0.2
    ) -> None:
        self.engine = engine
        self.arena = arena
        self.reserve_timeout_s = reserve_timeout_s
        self.region = engine.register(arena.buffer)
        self._expected: dict[bytes, _Expected] = {}
        # writer, path, chunk, count, event handle
        self._early: dict[bytes, list[tuple[int, str, int, int, bytes]]] = {}
        self._ipc_events: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._bad_events: set[bytes] = set()
        self._closed: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # recent tags
        self.other: list[tuple[str, bytes]] = []  # notifications that are not ours

    def expect(
        self, tag: bytes, dst: torch.Tensor, writers: Sequence[Runs], *, bounce: bool = True
    ) -> list[StagingSlot | None]:
        """Register a request written by ``len(writers)`` writers into ``dst``; returns one slot per writer.

        A ``None`` slot means "write directly" (empty part, ``bounce=False``, or no arena space within
        the bounded wait). Raises :class:`LayoutError` when any writer's runs leave ``dst`` or overlap.
        """
        if tag in self._expected:
            raise ValueError(f"BounceReceiver.expect: tag {tag!r} is already expected")
        merged = [w.merged() for w in writers]
        check_fan_in(merged, _byte_view(dst, "expect dst").numel())
        sizes = [-(-m.total_bytes // self.arena.align) * self.arena.align for m in merged]
        total = sum(sizes)
        res = None
        if bounce and total > 0:
            res = self.arena.reserve(total, self.reserve_timeout_s)
            if res is None:
                logger.info(
                    "bounce: receiver arena has no %d B within %.2fs; writers go direct",
                    total,
                    self.reserve_timeout_s,
                )
        slots: list[StagingSlot | None] = []
        off = res.offset if res is not None else 0
        for m, size in zip(merged, sizes, strict=True):
            slots.append(
                StagingSlot(self.region.desc(), off, m.total_bytes) if res and size else None
            )
            off += size
        exp = _Expected(tag, dst, merged, slots, res)
        self._expected[tag] = exp
        for writer, path, index, count, handle in self._early.pop(tag, []):
            if path == "pipelined":
                self._chunk(exp, writer, index, count)
            else:
                self._arrive(exp, writer, path, handle)
        return slots

    def _open_event(self, handle: bytes, dst: torch.Tensor) -> Any:
        """The sender's interprocess event for ``handle`` (opened once); ``None`` when it cannot be."""
        ev = self._ipc_events.get(handle)
        if ev is not None or handle in self._bad_events:
            return ev
        devices = [dst.device] if dst.is_cuda else []
        if torch.cuda.is_available():
            devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        err: Exception | None = None
        for dev in devices:
            try:
                ev = torch.cuda.Event.from_ipc_handle(dev, handle)
                break
            except Exception as e:  # try the next device context
                err = e
        if ev is None:
            if not self._bad_events:
                logger.warning("ipc: cannot open the sender's CUDA event (%s); completing on the "
                               "sender's notification after the copy instead", err)
            self._bad_events.add(handle)
            return None
        self._ipc_events[handle] = ev
        while len(self._ipc_events) > 4096:
            self._ipc_events.popitem(last=False)
        return ev

    def _arrive(self, exp: _Expected, writer: int, path: str, handle: bytes = b"") -> None:
        if not 0 <= writer < len(exp.runs):
            logger.warning("bounce: tag %r has no writer %d; ignored", exp.tag, writer)
            return
        if writer in exp.arrived:
            if path == "ipc":  # the other half of the ipc event signal: the sender saw the copy done
                if not handle:
                    exp.events.pop(writer, None)
                return
            logger.warning("bounce: duplicate notification from writer %d of %r", writer, exp.tag)
            return
        if handle:  # ipc, launched: complete once the sender's event fired
            ev = self._open_event(handle, exp.dst)
            if ev is None:
                return  # the sender's notification after completion will come
            exp.events[writer] = ev
        if path == "bounce":
            slot = exp.slots[writer]
            if slot is None:
                raise RuntimeError(f"writer {writer} of {exp.tag!r} bounced without a slot")
            scatter(
                self.arena.buffer[slot.offset : slot.offset + slot.size], exp.dst, exp.runs[writer]
            )
        exp.arrived[writer] = path

    def _chunk(self, exp: _Expected, writer: int, index: int, count: int) -> None:
        """Chunk ``index`` of a pipelined writer landed: scatter it now (asynchronously on CUDA)."""
        if not 0 <= writer < len(exp.runs) or writer in exp.arrived:
            logger.warning("bounce: chunk %d of writer %d of %r unexpected; ignored", index, writer, exp.tag)
            return
        slot = exp.slots[writer]
        if slot is None:
            raise RuntimeError(f"writer {writer} of {exp.tag!r} pipelined without a slot")
        plan, seen = exp.chunks.setdefault(writer, (plan_chunks(exp.runs[writer], count), set()))
        if index >= len(plan) or index in seen:
            logger.warning("bounce: chunk %d/%d of writer %d of %r invalid or repeated", index, count,
                           writer, exp.tag)
            return
        ch = plan[index]
        base = slot.offset + ch.start
        scatter(self.arena.buffer[base : base + ch.nbytes], exp.dst, ch.runs)
        seen.add(index)
        if len(seen) == len(plan):
            exp.arrived[writer] = "pipelined"

    def handle(self, peer: str, msg: bytes) -> bool:
        """Feed one notification; ``True`` when it was a bounce-protocol message."""
        handle = b""
        index = count = 0
        chunk = decode_chunk_notif(msg)
        if chunk is not None:
            writer, index, count, tag = chunk
            path = "pipelined"
        else:
            launched = decode_event_notif(msg)
            if launched is not None:
                writer, handle, tag = launched
                path = "ipc"
            else:
                parsed = decode_notif(msg)
                if parsed is None:
                    self.other.append((peer, msg))
                    return False
                path, writer, tag = parsed
        exp = self._expected.get(tag)
        if exp is None:
            if tag in self._closed:  # a late writer of a finished or cancelled request
                if path == "ipc":  # the sender's "copy done" after D completed on its event
                    logger.debug("bounce: ipc notification for finished %r dropped", tag)
                else:
                    logger.warning("bounce: late notification for finished/cancelled %r dropped", tag)
            else:
                self._early.setdefault(tag, []).append((writer, path, index, count, handle))
        elif path == "pipelined":
            self._chunk(exp, writer, index, count)
        else:
            self._arrive(exp, writer, path, handle)
        return True

    def _events_fired(self, exp: _Expected) -> bool:
        """Whether every ipc writer's event fired (a writer whose event cannot be queried waits for the
        sender's notification after completion instead)."""
        for writer, ev in list(exp.events.items()):
            try:
                fired = bool(ev.query())
            except Exception as e:
                logger.warning("ipc: querying writer %d's CUDA event failed (%s); waiting for its "
                               "notification", writer, e)
                del exp.events[writer]
                exp.arrived.pop(writer, None)
                return False
            if not fired:
                return False
            del exp.events[writer]
        return True

    def _finish(self) -> list[bytes]:
        done = []
        for tag, exp in list(self._expected.items()):
            if len(exp.arrived) == len(exp.runs) and self._events_fired(exp):
                _sync(exp.dst)
                if exp.res is not None:
                    self.arena.release(exp.res)
                del self._expected[tag]
                self._remember(tag)
                done.append(tag)
        return done

    def poll(self) -> list[bytes]:
        """Process new notifications; returns the tags now complete (all writers in, scatters done)."""
        for peer, msg in self.engine.poll_notifications():
            self.handle(peer, msg)
        return self._finish()

    def wait(self, tag: bytes, timeout_s: float = 10.0) -> None:
        """Poll until ``tag`` completes; ``TimeoutError`` naming the missing writers otherwise."""
        started = time.perf_counter()
        deadline = started + timeout_s
        while tag in self._expected:
            if tag in self.poll():
                return
            if time.perf_counter() > deadline:
                exp = self._expected[tag]
                missing = sorted(set(range(len(exp.runs))) - set(exp.arrived))
                raise TimeoutError(
                    f"bounce receive {tag!r}: writers {missing} did not arrive in {timeout_s}s"
                )
            _pause(started)

    def cancel(self, tag: bytes) -> None:
        """Abandon ``tag``; its staging region is quarantined (a late writer may still write into it)."""
        exp = self._expected.pop(tag, None)
        self._early.pop(tag, None)
        self._remember(tag)
        if exp is not None and exp.res is not None:
            self.arena.quarantine(exp.res)

    def _remember(self, tag: bytes) -> None:
        self._closed[tag] = None
        while len(self._closed) > 4096:
            self._closed.popitem(last=False)

    @property
    def pending(self) -> frozenset[bytes]:
        """Tags expected but not complete."""
        return frozenset(self._expected)
