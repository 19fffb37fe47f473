"""Byte-level helpers over registered memory: CRC32 of byte runs of a pool (host or device), a uint8 view
of a KV pool.

Per-request byte runs come from the peer's plan (``core.plan.peer_plan.PeerPlan.runs``), built once at the handshake.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["crc_runs", "pool_tensor"]

#: Device bytes copied to the host per batch of runs when checksumming device memory.
CRC_BATCH_BYTES = 64 << 20


def crc_runs(pool: torch.Tensor, offsets: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray,
             gather: bool | None = None) -> list[int]:
    """CRC32 of each run ``pool[offset : offset + length]`` of the 1-D uint8 tensor ``pool``.

    Host memory is read in place. Device memory (a GPU KV pool, which the host cannot dereference) is
    gathered on the device with one int64 index op per batch of runs (at most :data:`CRC_BATCH_BYTES`
    bytes, or one longer run), copied to the host once per batch, and checksummed there: the bytes as
    they are once the device's pending work on them is done. ``gather`` forces one way or the other
    (default: gather exactly when ``pool`` is not host memory).
    """
    if len(offsets) != len(lengths):
        raise ValueError(f"crc_runs: {len(offsets)} offsets but {len(lengths)} lengths")
    if not (pool.device.type != "cpu" if gather is None else gather):
        view = pool.numpy().data
        return [zlib.crc32(view[int(o):int(o) + int(n)]) for o, n in zip(offsets, lengths, strict=True)]
    out: list[int] = []
    i = 0
    while i < len(offsets):
        j, total = i, 0
        while j < len(offsets) and (j == i or total + int(lengths[j]) <= CRC_BATCH_BYTES):
            total += int(lengths[j])
            j += 1
        offs = torch.as_tensor(list(offsets[i:j]), dtype=torch.int64)
        lens = torch.as_tensor(list(lengths[i:j]), dtype=torch.int64)
        # byte k of the batch is pool[offs[r] + (k - first byte of run r in the batch)]
        shift = torch.repeat_interleave(offs - (torch.cumsum(lens, 0) - lens), lens)
        index = (shift + torch.arange(total, dtype=torch.int64)).to(pool.device, non_blocking=True)
        host = pool[index].cpu().numpy().data
        pos = 0
        for n in lens.tolist():
            out.append(zlib.crc32(host[pos:pos + n]))
            pos += n
        i = j
    return out


def pool_tensor(kv_caches: dict[str, torch.Tensor], base_ptr: int, nbytes: int) -> torch.Tensor:
    """A contiguous uint8 tensor over ``[base_ptr, base_ptr + nbytes)`` of the KV caches' storage."""
    for t in kv_caches.values():
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start <= base_ptr and base_ptr + nbytes <= start + storage.nbytes():
            full = torch.empty(0, dtype=torch.uint8, device=t.device)
            full.set_(storage, 0, (storage.nbytes(),), (1,))
            return full[base_ptr - start : base_ptr - start + nbytes]
    raise ValueError(f"no KV cache tensor covers pool [{base_ptr:#x}, +{nbytes})")
