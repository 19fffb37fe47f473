"""Byte-level helpers over registered memory: CRC32 of a range, a uint8 view of a KV pool.

Per-request byte runs come from the peer's plan (``matching.PeerPlan.runs``), built once at the handshake.
"""

from __future__ import annotations

import ctypes
import zlib

import torch

__all__ = ["crc_at", "pool_tensor"]


def crc_at(addr: int, length: int) -> int:
    """CRC32 of ``length`` bytes of this process's memory at ``addr``."""
    return zlib.crc32(memoryview((ctypes.c_char * length).from_address(addr)))


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
