"""Same-node single copy: map a peer's GPU region through CUDA IPC and write its pages in one kernel.

On one node (same GPU, or two GPUs with peer access over NVLink) the decode side exports its registered
KV pools once (:func:`export_region`, sent in the handshake as a plain dict); the prefill side opens them
once (:func:`open_region`) and from then on a transfer is ONE kernel per pool that reads P's scattered pages
and writes D's scattered pages (:func:`vllm_dsa_connector.core.transfer.copy.local_copy.copy_runs`): one pass over
the bytes, no staging buffer, no per-descriptor cost. The notification still goes over NIXL once the copy
completed (:mod:`.routed`), so the receiver side is the same as for a direct WRITE. Between nodes NIXL stays
the engine.

Export and open use torch's own CUDA IPC sharing (the calls ``torch.multiprocessing`` makes for CUDA
tensors): the exporting process must keep the region alive while peers use it (a KV pool lives as long
as its engine). A descriptor names its host (hostname + boot id) and its GPU (UUID), so a peer on another
node or without the GPU gets :class:`IpcUnavailable` and uses NIXL instead.
"""

from __future__ import annotations

import collections
import functools
import logging
import socket
import threading
from typing import Any

import torch

from vllm_dsa_connector.core.transfer.ipc_desc import IpcDesc

logger = logging.getLogger(__name__)

__all__ = [
    "PeerEvents",
    "IpcUnavailable",
    "device_uuid",
    "enable_peer_access",
    "export_region",
    "host_id",
    "open_region",
]


class IpcUnavailable(RuntimeError):
    """The region cannot be mapped here (other host, GPU not visible, no peer access, not CUDA)."""


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This machine: hostname + kernel boot id (two containers with one hostname still differ)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def device_uuid(device: torch.device | str | int) -> str:
    """The GPU's UUID (stable across processes, unlike its index under CUDA_VISIBLE_DEVICES)."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return str(torch.cuda.get_device_properties(dev).uuid)


def _local_index(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def export_region(tensor: torch.Tensor) -> IpcDesc:
    """Export a contiguous CUDA tensor's bytes (keep the tensor alive while peers may write to it)."""
    if not tensor.is_cuda:
        raise IpcUnavailable("export_region: only CUDA tensors can be shared through CUDA IPC")
    if not tensor.is_contiguous():
        raise ValueError("export_region: tensor must be contiguous")
    storage = tensor.untyped_storage()
    (
        _dev,
        handle,
        storage_size,
        storage_offset,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = storage._share_cuda_()
    return IpcDesc(
        host_id(),
        device_uuid(tensor.device),
        tensor.numel() * tensor.element_size(),
        int(tensor.storage_offset()) * tensor.element_size(),
        bytes(handle).hex(),
        int(storage_size),
        int(storage_offset),
        bytes(ref_handle or b"").hex(),
        int(ref_offset),
        bytes(event_handle or b"").hex(),
        bool(event_sync),
    )


_OPENED: dict[tuple[bytes, int, int], torch.UntypedStorage] = {}
_OPEN_LOCK = threading.Lock()


def open_region(
    desc: IpcDesc | dict[str, Any], device: torch.device | str | int | None = None
) -> torch.Tensor:
    """Map a peer's exported region here: a 1-D uint8 tensor (cached per handle and device).

    ``device``: the GPU whose kernels will write through the mapping (the sender's own GPU); the
    handle is opened in that GPU's context with peer access, so its kernels and copies can use the
    pointer (a mapping opened in the owning GPU's context is not usable from another GPU's kernels).
    The tensor reports ``device`` although its bytes live on the peer's GPU. Default: the owner's GPU.
    Raises :class:`IpcUnavailable` when the region is on another host or its GPU is not visible here.
    """
    d = IpcDesc.from_dict(desc)
    if d.host != host_id():
        raise IpcUnavailable(f"region is on host {d.host!r}, this is {host_id()!r}")
    if not torch.cuda.is_available():
        raise IpcUnavailable("no CUDA here")
    owner = _local_index(d.uuid)
    if owner is None:
        raise IpcUnavailable(f"GPU {d.uuid} is not visible in this process")
    if device is None:
        index = owner
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index != owner:
            enable_peer_access(torch.device("cuda", index), torch.device("cuda", owner))
    handle, ref_counter_handle, event_handle = d.handles()
    key = (handle, d.storage_offset, index)
    with _OPEN_LOCK:
        storage = _OPENED.get(key)
        if storage is None:
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index,
                    handle,
                    d.storage_size,
                    d.storage_offset,
                    ref_counter_handle,
                    d.ref_counter_offset,
                    event_handle,
                    d.event_sync_required,
                )
            except Exception as e:  # e.g. the same process, or IPC refused by the driver
                raise IpcUnavailable(f"cannot open the CUDA IPC handle: {e}") from e
            _OPENED[key] = storage
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    out.set_(storage, d.offset, (d.size,), (1,))
    return out


def enable_peer_access(src: torch.device | str, dst: torch.device | str) -> None:
    """Let kernels on ``src`` access memory of ``dst`` (no-op on one GPU); IpcUnavailable if impossible."""
    a, b = torch.device(src), torch.device(dst)
    if a == b:
        return
    if not torch.cuda.can_device_access_peer(a.index or 0, b.index or 0):
        raise IpcUnavailable(f"{a} cannot access {b} (no peer-to-peer path)")
    # torch enables peer access (cudaDeviceEnablePeerAccess, both ways) on its first copy between two
    # devices that can reach each other; a one-byte copy each way triggers it.
    x = torch.zeros(1, dtype=torch.uint8, device=a)
    y = torch.zeros(1, dtype=torch.uint8, device=b)
    y.copy_(x)
    x.copy_(y)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


class PeerEvents:
    """Interprocess CUDA events that senders recorded behind their ipc copies, opened once per handle.

    :meth:`open` returns the event of a handle (``None`` when no visible GPU's context can open it: the
    receiver then completes on the sender's notification after the copy; warned once). At most ``cap``
    handles are kept (a sender reuses its events, so the set stays small)."""

    def __init__(self, cap: int = 4096) -> None:
        self.cap = cap
        self._events: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._bad: set[bytes] = set()

    def open(self, handle: bytes, device: torch.device | None = None) -> Any:
        """The event of ``handle``, tried in ``device``'s context first, then every visible GPU's."""
        ev = self._events.get(handle)
        if ev is not None or handle in self._bad:
            return ev
        devices = [device] if device is not None and device.type == "cuda" else []
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
            if not self._bad:
                logger.warning("ipc: cannot open the sender's CUDA event (%s); completing on the sender's "
                               "notification after the copy instead", err)
            self._bad.add(handle)
            return None
        self._events[handle] = ev
        while len(self._events) > self.cap:
            self._events.popitem(last=False)
        return ev
