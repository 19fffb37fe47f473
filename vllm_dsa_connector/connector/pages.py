"""Byte-level helpers over page tables and registered memory, shared by sender, receiver and scheduler."""

from __future__ import annotations

import ctypes
import zlib
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.handoff.wire import RankPayload

__all__ = ["crc_at", "pair_runs", "pool_tensor"]


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


def pair_runs(plan: Any, src: RankPayload, dst: RankPayload, src_blocks: Any, dst_blocks: Any) -> list[Any]:
    """``[(src_pool, dst_pool, Runs)]`` one source rank writes to one destination rank for these blocks.

    Runs are merged with sorting (``transport.merge_runs``): blocks listed out of order (vLLM's free list
    hands them out in reverse) and layer-outermost layouts still collapse into long runs. Sender and
    receiver compute the same runs in the same order (a bounced write is packed in that order).
    """
    from vllm_dsa_connector.layout import PageTable
    from vllm_dsa_connector.matching import expand_runs
    from vllm_dsa_connector.transport.runs import merge_runs

    segs = plan.for_pair(src.rank, dst.rank)
    if not segs:
        return []
    pool_runs = expand_runs(segs, PageTable.from_dict(src.page_table), PageTable.from_dict(dst.page_table),
                            np.asarray(src_blocks, np.int64), np.asarray(dst_blocks, np.int64))
    return [(pr.src_pool, pr.dst_pool, merge_runs(pr.src_offsets, pr.dst_offsets, pr.lengths).merged())
            for pr in pool_runs]
