"""The DSA indexer on CPU: K into the fp8 indexer cache, logits from the cache, top-k per token.

``CpuReferenceSparseAttnIndexer`` replaces vLLM's ``SparseAttnIndexer`` custom op (registered as an
out-of-tree op by ``registration.register_cpu_dsa`` on the CPU platform only). For the V3.2/GLM-5
indexer (fp8 cache, K inserted by the op itself) it runs ``vllm_dsa::cpu_sparse_attn_indexer``;
anything else (DeepSeek-V4's own CPU path, fp4 caches, context parallel) falls through to vLLM.

Semantics follow the CUDA op (``model_executor/layers/sparse_attn_indexer.py``):

1. ``indexer_k_quant_and_cache``: K quantized per token into the cache at ``slot_mapping``.
2. Logits for each query token over its request's tokens ``[0, position]`` read back from the
   cache (``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``).
3. Top ``index_topk`` per row as request-local positions, ``-1`` padding when fewer tokens are
   visible (``top_k_per_row_prefill`` / ``_decode``), written to the shared top-k buffer.

Both ops are torch custom ops so a compiled model graph treats them as opaque.
"""

from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

from vllm_dsa_connector.cpu_dsa.backend import CpuDSAMetadata
from vllm_dsa_connector.cpu_dsa.quant import (
    FP8_DTYPE,
    gather_indexer_k,
    mqa_logits,
    quant_fp8_groups,
    write_indexer_k,
)

logger = init_logger("vllm.plugins.vllm_dsa_connector.cpu_dsa")

# Query rows per logits chunk: bounds the [rows, heads, seq_len] fp32 intermediate.
LOGITS_ROW_CHUNK = 128


@torch.library.custom_op("vllm_dsa::quant_fp8_groups", mutates_args=())
def _quant_fp8_groups_op(
    x: torch.Tensor, group_size: int, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    values, scale = quant_fp8_groups(x, group_size, use_ue8m0)
    return values, scale


@_quant_fp8_groups_op.register_fake
def _(x: torch.Tensor, group_size: int, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scale_shape = (*x.shape[:-1], x.shape[-1] // group_size)
    return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty(scale_shape, dtype=torch.float32)


def make_cpu_per_token_group_quant_fp8(original):
    """Wrap vLLM's ``per_token_group_quant_fp8``: CPU tensors take the torch path (vLLM's only
    non-CUDA path is a Triton kernel, which the CPU build cannot run); others go to ``original``."""

    def per_token_group_quant_fp8(
        x: torch.Tensor,
        group_size: int,
        eps: float = 1e-10,
        dtype: torch.dtype | None = None,
        column_major_scales: bool = False,
        tma_aligned_scales: bool = False,
        out_q: torch.Tensor | None = None,
        use_ue8m0: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plain = (
            x.device.type == "cpu"
            and not column_major_scales
            and not tma_aligned_scales
            and out_q is None
            and eps == 1e-10
            and dtype in (None, FP8_DTYPE)
        )
        if not plain:
            return original(
                x,
                group_size,
                eps=eps,
                dtype=dtype,
                column_major_scales=column_major_scales,
                tma_aligned_scales=tma_aligned_scales,
                out_q=out_q,
                use_ue8m0=use_ue8m0,
            )
        return torch.ops.vllm_dsa.quant_fp8_groups(x, group_size, bool(use_ue8m0))

    per_token_group_quant_fp8.__wrapped__ = original  # type: ignore[attr-defined]
    return per_token_group_quant_fp8


def select_topk(
    md: CpuDSAMetadata,
    kv_cache: torch.Tensor,
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    topk_tokens: int,
) -> None:
    """Top-k request-local positions for every token of ``md`` into ``out[:T, :topk]`` (-1 = none)."""
    head_dim = q_fp8.shape[-1]
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    for r in range(md.num_reqs):
        start, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        if end <= start or seq_len <= 0:
            continue
        k_fp8, k_scale = gather_indexer_k(kv_cache, md.block_table[r], seq_len, head_dim)
        key_pos = torch.arange(seq_len, dtype=torch.int64)
        width = min(topk_tokens, seq_len)
        for row in range(start, end, LOGITS_ROW_CHUNK):
            row_end = min(row + LOGITS_ROW_CHUNK, end)
            logits = mqa_logits(q_fp8[row:row_end], k_fp8, k_scale, weights[row:row_end])
            causal = key_pos.unsqueeze(0) > md.positions[row:row_end].unsqueeze(1)
            logits.masked_fill_(causal, float("-inf"))
            values, indices = logits.topk(width, dim=-1)
            indices = indices.masked_fill(values == float("-inf"), -1)
            out[row:row_end, :width] = indices.to(out.dtype)


@torch.library.custom_op("vllm_dsa::cpu_sparse_attn_indexer", mutates_args=("topk_indices_buffer",))
def cpu_sparse_attn_indexer(
    hidden_states: torch.Tensor,
    q_fp8: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_cache_prefix: str,
    topk_indices_buffer: torch.Tensor,
    topk_tokens: int,
    use_ue8m0: bool,
) -> None:
    """Insert K into the layer's indexer cache, then fill the top-k buffer (see module doc)."""
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if not isinstance(attn_metadata, dict):
        return  # profiling / dummy run: nothing to index
    md = attn_metadata.get(k_cache_prefix)
    if not isinstance(md, CpuDSAMetadata):
        raise RuntimeError(
            f"{k_cache_prefix}: expected CPU DSA indexer metadata, got {type(md).__name__}; "
            "the CPU DSA backends were not selected (VLLM_DSA_DISABLE_RUNTIME_FIXES set?)"
        )
    kv_cache = forward_context.no_compile_layers[k_cache_prefix].kv_cache
    num_tokens = md.num_actual_tokens
    write_indexer_k(kv_cache, k[:num_tokens], md.slot_mapping, use_ue8m0)
    topk_indices_buffer[: hidden_states.shape[0]] = -1
    select_topk(
        md, kv_cache, q_fp8[:num_tokens], weights[:num_tokens], topk_indices_buffer, topk_tokens
    )


@cpu_sparse_attn_indexer.register_fake
def _(
    hidden_states: torch.Tensor,
    q_fp8: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_cache_prefix: str,
    topk_indices_buffer: torch.Tensor,
    topk_tokens: int,
    use_ue8m0: bool,
) -> None:
    return None


class CpuReferenceSparseAttnIndexer(SparseAttnIndexer):
    """``SparseAttnIndexer`` whose CPU forward runs the torch reference indexer."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.cpu_reference = (
            not self.skip_k_cache_insert
            and not self.use_fp4_cache
            and self.compress_ratio == 1
            and self.candidate_blocks is None
            and self.dcp_world_size <= 1
            and not self.use_pcp
            and self.quant_block_size == self.head_dim
        )

    def forward_native(self, hidden_states, q_quant, k, weights):  # type: ignore[override]
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return self.forward_cpu(hidden_states, q_quant, k, weights)
        return super().forward_native(hidden_states, q_quant, k, weights)

    def forward_cpu(self, hidden_states, q_quant, k, weights):  # type: ignore[override]
        if not self.cpu_reference or isinstance(q_quant, tuple) or k is None:
            return super().forward_cpu(hidden_states, q_quant, k, weights)
        torch.ops.vllm_dsa.cpu_sparse_attn_indexer(
            hidden_states,
            q_quant,
            k,
            weights,
            self.k_cache.prefix,
            self.topk_indices_buffer,
            self.topk_tokens,
            self.scale_fmt == "ue8m0",
        )
        return self.topk_indices_buffer
