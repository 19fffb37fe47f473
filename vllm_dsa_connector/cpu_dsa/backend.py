"""Reference DSA attention backends for vLLM's CPU platform.

Two backends share one metadata class:

- ``CpuDSAIndexerBackend`` for the indexer K cache layers (``<layer>.self_attn.indexer.k_cache``).
  vLLM's own ``DeepseekV32IndexerBackend`` builds its metadata with Triton kernels and only accepts
  64-token kernel blocks; ours builds plain torch metadata. The cache spec is untouched
  (``MLAAttentionSpec(head_size=132, uint8, cache_role=INDEXER)``), so the bytes are the GPU ones.
- ``CpuSparseMLABackend`` for the MLA latent layers (``<layer>.self_attn.attn``): the
  576-element latent rows in the model dtype (``kv_cache_dtype=auto``), the same page as a GPU
  bf16 sparse-MLA cache, and sparse attention over the top-k rows the indexer selected.

Every token goes through the top-k MQA path (prefill and decode alike), like vLLM's XPU sparse
backend; the indexer's indices are request-local token positions (``-1`` = no token), converted
to (block, offset) through the request's block table. Work is vectorised over tokens; the only
Python loops are over requests (indexer) and over fixed-size token chunks (attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.kv_cache_interface import AttentionSpec

logger = init_logger("vllm.plugins.vllm_dsa_connector.cpu_dsa")

# Tokens per attention chunk: bounds the [chunk, topk, 576] gather.
ATTN_TOKEN_CHUNK = 256


@dataclass
class CpuDSAMetadata(AttentionMetadata):
    """Per-step metadata for both CPU DSA backends (all tensors on CPU)."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    req_id_per_token: torch.Tensor  # [num_actual_tokens] int64
    positions: torch.Tensor  # [num_actual_tokens] int64, position of each token in its request
    block_size: int
    topk_tokens: int
    # The shared MLA layer splits tokens into MQA ("decode") and MHA ("prefill") parts; this
    # backend serves every token through the sparse MQA path.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0


class CpuDSAMetadataBuilder(AttentionMetadataBuilder[CpuDSAMetadata]):
    """Builds ``CpuDSAMetadata`` from the common metadata with torch ops on the host."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
        **kwargs: object,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        hf = vllm_config.model_config.hf_text_config
        self.topk_tokens = int(getattr(hf, "index_topk", 0))
        self.block_size = kv_cache_spec.block_size

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CpuDSAMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        num_tokens = cm.num_actual_tokens
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        seq_lens = cm.seq_lens[:num_reqs].to("cpu", torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        req_id = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int64), query_lens)
        # Token i of request r sits at position seq_len[r] - query_len[r] + (i - start[r]).
        first_pos = seq_lens - query_lens - qsl[:-1]
        positions = first_pos[req_id] + torch.arange(req_id.shape[0], dtype=torch.int64)
        return CpuDSAMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor[:num_reqs].to("cpu", torch.int64),
            slot_mapping=cm.slot_mapping[:num_tokens].to("cpu", torch.int64),
            req_id_per_token=req_id[:num_tokens],
            positions=positions[:num_tokens],
            block_size=self.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=num_reqs,
            num_prefills=0,
            num_decode_tokens=num_tokens,
            num_prefill_tokens=0,
        )


class CpuDSAIndexerBackend(DeepseekV32IndexerBackend):
    """Indexer K cache backend: same spec and bytes as the GPU indexer, torch metadata."""

    @staticmethod
    def get_name() -> str:
        return "CPU_DSA_INDEXER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False

    @classmethod
    def supports_pcp(cls) -> bool:
        return False

    @staticmethod
    def get_builder_cls() -> type[CpuDSAMetadataBuilder]:  # type: ignore[override]
        return CpuDSAMetadataBuilder


class CpuSparseMLABackend(AttentionBackend):
    """Sparse MLA over the latent cache, top-k rows chosen by the indexer."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "CPU_DSA_SPARSE_MLA"

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        # As FlashMLA-sparse with a bf16 cache on GPU: blocks are whole pages apart.
        return align_blocks_to_rows(spec)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_metadata_cls() -> type[CpuDSAMetadata]:
        return CpuDSAMetadata

    @staticmethod
    def get_builder_cls() -> type[CpuDSAMetadataBuilder]:
        return CpuDSAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CpuSparseMLAImpl]:
        return CpuSparseMLAImpl

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    md: CpuDSAMetadata,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Attend each token over its top-k latent rows.

    ``q [T, N, 576]`` (absorbed nope part + rope part), ``kv_cache [blocks, block_size, 576]``,
    ``topk_indices [T, K]`` request-local positions (``-1`` = none). Returns ``[T, N, kv_lora_rank]``
    in ``q``'s dtype. Math in fp32.
    """
    num_tokens, num_heads, _ = q.shape
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    block_size = kv_cache.shape[1]
    for start in range(0, num_tokens, ATTN_TOKEN_CHUNK):
        end = min(start + ATTN_TOKEN_CHUNK, num_tokens)
        idx = topk_indices[start:end].to(torch.int64)
        valid = idx >= 0
        pos = idx.clamp(min=0)
        req = md.req_id_per_token[start:end].unsqueeze(1)
        blocks = md.block_table[req, pos // block_size]
        rows = kv_cache[blocks, pos % block_size].to(torch.float32)  # [t, K, 576]
        scores = torch.einsum("tnd,tkd->tnk", q[start:end].to(torch.float32), rows) * scale
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # A token always selects itself, so no row is all -inf; guard anyway.
        probs = torch.nan_to_num(probs, nan=0.0)
        out[start:end] = torch.einsum("tnk,tkl->tnl", probs, rows[..., :kv_lora_rank]).to(q.dtype)
    return out


class CpuSparseMLAImpl(MLAAttentionImpl[CpuDSAMetadata], SharedTopkIndicesBuffer):
    """Sparse MLA implementation for the CPU platform (torch reference)."""

    is_sparse = True
    supports_dense_mha_prefill = False
    supports_quant_query_input = False
    can_return_lse_for_decode = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: object | None = None,
        **mla_args: object,
    ) -> None:
        if kv_sharing_target_layer_name is not None:
            raise ValueError("CPU sparse MLA does not support KV sharing")
        if attn_type != AttentionType.DECODER:
            raise ValueError("CPU sparse MLA supports decoder self-attention only")
        if alibi_slopes or sliding_window or logits_soft_cap:
            raise ValueError("CPU sparse MLA does not support alibi / sliding window / soft cap")
        if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            raise ValueError(
                f"CPU sparse MLA stores the latent cache in the model dtype; "
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported (use 'auto')"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = int(mla_args["kv_lora_rank"])  # type: ignore[call-overload]
        self.q_pad_num_heads = None
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        self.index_group = None
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    def record_logical_topk_ready(self) -> None:
        """Index groups (HiSparse) are a GPU feature; nothing to record."""

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write ``[kv_c | k_pe]`` rows at their slots; the cache may be a strided layer view.

        ``skip_scale`` (passed by vLLM >= 0.33 for fp8 caches with a unit scale) has no effect:
        this cache holds the model dtype, never scaled values.
        """
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.reshape(-1).to(torch.int64)
        n = slots.shape[0]
        rows = torch.cat([kv_c_normed[:n], k_pe[:n].reshape(n, -1)], dim=-1)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, rows = slots[keep], rows[keep]
        block_size = kv_cache.shape[1]
        kv_cache[slots // block_size, slots % block_size] = rows.to(kv_cache.dtype)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: CpuDSAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        buffer = self.topk_indices_buffer
        if buffer is None:
            raise RuntimeError("CPU sparse MLA: no top-k index buffer (is the model a DSA model?)")
        num_tokens = q.shape[0]
        out = sparse_mla_attention(
            q,
            kv_c_and_k_pe_cache,
            buffer[:num_tokens, : attn_metadata.topk_tokens],
            attn_metadata,
            self.scale,
            self.kv_lora_rank,
        )
        return out, None
