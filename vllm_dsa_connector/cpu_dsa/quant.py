"""FP8 arithmetic and the indexer K-cache byte layout of vLLM's DSA indexer, in plain torch.

Everything here reproduces the semantics of vLLM's GPU kernels so that a CPU engine writes and
reads exactly the bytes a GPU engine would:

- ``indexer_k_quant_and_cache`` (csrc/cache_kernels.cu, mirrored by the ROCm Triton kernel in
  ``v1/attention/ops/rocm_aiter_mla_sparse.py``): one scale per token over the 128-element K,
  ``scale = max(amax, 1e-4) / 448``, rounded UP to a power of two when the scale format is
  ``ue8m0``; values ``(k / scale).to(float8_e4m3fn)``.
- ``per_token_group_quant_fp8`` (``fp8_utils.py``): the indexer Q, per (token, head) group of 128,
  ``scale = max(amax, 1e-10) * (1 / 448)``, ue8m0-rounded, values clamped to +-448.
- The indexer cache page of ``block_size`` tokens is block-split: ``[block_size x 128 fp8 values]``
  then ``[block_size x 4-byte fp32 scales]`` (not per-token 132-byte rows).
- Logits follow DeepGEMM's ``fp8_mqa_logits``: ``sum_h w[h] * relu(q_fp8[h] . k_fp8 * k_scale)``
  (the Q scale, softmax scale and 1/sqrt(n_heads) are already folded into ``w``).

The power-of-two rounding is exact (``frexp``), not ``exp2(ceil(log2(x)))``, so the result does
not depend on a platform's ``log2`` approximation.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
K_SCALE_EPS = 1e-4  # indexer_k_quant_and_cache
Q_SCALE_EPS = 1e-10  # per_token_group_quant_fp8
SCALE_BYTES = 4


def ue8m0_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to the next power of two (exactly ``2**ceil(log2(s))``)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def quant_indexer_k(k: torch.Tensor, use_ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize indexer keys ``[T, D]`` like ``indexer_k_quant_and_cache``: fp8 ``[T, D]``, fp32 ``[T]``."""
    kf = k.to(torch.float32)
    amax = kf.abs().amax(dim=-1).clamp(min=K_SCALE_EPS)
    scale = amax / FP8_MAX
    if use_ue8m0:
        scale = ue8m0_ceil(scale)
    values = (kf / scale.unsqueeze(-1)).to(FP8_DTYPE)
    return values, scale


def quant_fp8_groups(
    x: torch.Tensor, group_size: int, use_ue8m0: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant_fp8`` (row-major scales): fp8 like ``x``, fp32 ``x.shape[:-1] + (G,)``."""
    if x.shape[-1] % group_size != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of group {group_size}")
    groups = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = groups.abs().amax(dim=-1).clamp(min=Q_SCALE_EPS)
    scale = amax * (1.0 / FP8_MAX)
    if use_ue8m0:
        scale = ue8m0_ceil(scale)
    values = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.reshape(x.shape), scale


def fake_quant_indexer_k(k: torch.Tensor, use_ue8m0: bool = True) -> torch.Tensor:
    """Dequantized ``quant_indexer_k`` (fp32), for references that emulate the fp8 cache."""
    values, scale = quant_indexer_k(k.reshape(-1, k.shape[-1]), use_ue8m0)
    return (values.to(torch.float32) * scale.unsqueeze(-1)).reshape(k.shape)


def fake_quant_fp8_groups(x: torch.Tensor, group_size: int, use_ue8m0: bool = True) -> torch.Tensor:
    """Dequantized ``quant_fp8_groups`` (fp32)."""
    values, scale = quant_fp8_groups(x, group_size, use_ue8m0)
    grouped = values.to(torch.float32).reshape(*x.shape[:-1], -1, group_size)
    return (grouped * scale.unsqueeze(-1)).reshape(x.shape)


def indexer_cache_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an indexer cache ``[num_blocks, block_size, head_dim + 4]`` (uint8) into its two parts.

    Returns ``values [num_blocks, block_size, head_dim]`` (uint8 view of the fp8 bytes) and
    ``scales [num_blocks, block_size, 4]`` (uint8 view of the fp32 bytes). Both alias the cache;
    the block stride is taken from the tensor, so per-layer views into a shared multi-layer
    buffer (block stride larger than one page) work.
    """
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8:
        raise ValueError(
            f"indexer cache must be a 3-D uint8 tensor, got {tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    num_blocks, block_size, width = kv_cache.shape
    if width != head_dim + SCALE_BYTES:
        raise ValueError(f"indexer cache rows are {width} bytes, expected {head_dim + SCALE_BYTES}")
    if kv_cache.stride(1) != width or kv_cache.stride(2) != 1:
        raise ValueError("indexer cache pages must be contiguous inside a block")
    stride0 = kv_cache.stride(0)
    base = kv_cache.storage_offset()
    values = kv_cache.as_strided((num_blocks, block_size, head_dim), (stride0, head_dim, 1), base)
    scales = kv_cache.as_strided(
        (num_blocks, block_size, SCALE_BYTES),
        (stride0, SCALE_BYTES, 1),
        base + block_size * head_dim,
    )
    return values, scales


def write_indexer_k(
    kv_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, use_ue8m0: bool = True
) -> None:
    """Quantize ``k [T, head_dim]`` and store it at ``slot_mapping [T]`` (negative slots skipped)."""
    head_dim = k.shape[-1]
    values_view, scales_view = indexer_cache_views(kv_cache, head_dim)
    block_size = kv_cache.shape[1]
    slots = slot_mapping.reshape(-1).to(torch.int64)
    k = k[: slots.shape[0]]
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k = slots[keep], k[keep]
    if slots.numel() == 0:
        return
    values, scale = quant_indexer_k(k, use_ue8m0)
    blocks, offsets = slots // block_size, slots % block_size
    values_view[blocks, offsets] = values.view(torch.uint8)
    scales_view[blocks, offsets] = scale.contiguous().view(torch.uint8).view(-1, SCALE_BYTES)


def gather_indexer_k(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read tokens ``0..num_tokens-1`` of one request: fp8 values ``[N, head_dim]``, fp32 ``[N]``."""
    values_view, scales_view = indexer_cache_views(kv_cache, head_dim)
    block_size = kv_cache.shape[1]
    pos = torch.arange(num_tokens, dtype=torch.int64, device=kv_cache.device)
    blocks = block_ids.to(torch.int64)[pos // block_size]
    offsets = pos % block_size
    values = values_view[blocks, offsets].view(FP8_DTYPE)
    scales = scales_view[blocks, offsets].contiguous().view(torch.float32).reshape(num_tokens)
    return values, scales


def mqa_logits(
    q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """DeepGEMM ``fp8_mqa_logits`` semantics: ``[M, H, D] x [N, D] -> [M, N]`` fp32 (no masking)."""
    k = k_fp8.to(torch.float32) * k_scale.unsqueeze(-1)
    scores = torch.einsum("mhd,nd->mhn", q_fp8.to(torch.float32), k).relu_()
    return torch.einsum("mhn,mh->mn", scores, weights.to(torch.float32))
