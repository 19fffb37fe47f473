"""Route DSA (sparse attention) models to the CPU reference backends on vLLM's CPU platform.

``register_cpu_dsa`` is a step of the plugin's table (``plugin.STEPS``). On any platform other than
CPU it does nothing. On CPU, unless ``VLLM_DSA_DISABLE_RUNTIME_FIXES=1``, it applies these guarded
runtime patches once per process (logged once):

1. ``CpuPlatform.get_attn_backend_cls``: ``use_sparse`` selections (vLLM raises "Sparse Attention
   is not supported on CPU.") return ``CpuSparseMLABackend``; every other selection is unchanged.
2. ``CpuPlatform.check_and_update_config``: for a DSA model (``index_topk`` in the HF config,
   DeepSeek-V4 excluded: it has its own CPU path) the KV block size becomes 64, the size the GPU
   sparse backends and the GPU indexer use, instead of the 16 forced for CPU MLA (that constraint
   comes from the dense CPU MLA decode kernel, which DSA does not use). An explicit
   ``--block-size`` is kept: the CPU backends accept any block size. Prefix caching stays as the user
   set it (vLLM turns it off for every CPU MLA model whose backend is not AMX_MLA; ours attends over
   cached context through the block table like the GPU backends). vLLM 0.33 sets the block size
   again from the backends once the model is built (``update_block_size_for_backend``, 128 here);
   that hook keeps 64 for DSA models too.
3. ``DeepseekV32IndexerCache.get_attn_backend`` returns ``CpuDSAIndexerBackend`` (torch metadata
   instead of Triton kernels); the cache spec and bytes are unchanged.
4. ``SparseAttnIndexer`` gets an out-of-tree replacement (``CpuReferenceSparseAttnIndexer``) that
   runs the torch indexer for the V3.2/GLM-5 fp8 cache and defers to vLLM otherwise.
5. ``deepseek_v2.per_token_group_quant_fp8`` (indexer Q quantization) gets a torch path for CPU
   tensors (vLLM's non-CUDA path is a Triton kernel the CPU build cannot run).
6. ``RotaryEmbedding.forward_cpu``: vLLM's CPU ``rotary_embedding`` kernel only handles 2-D
   ``[tokens, heads * head_size]`` inputs (it takes ``num_heads = size(-1) / head_size`` and the token
   stride from ``stride(-2)``). MLA passes 3-D ``[tokens, heads, rope_dim]`` views (``q[..., nope:]``,
   ``k_pe`` inside the fused ``qkv_a`` output), for which it rotates the wrong memory: every token
   after the first gets a wrong RoPE (found comparing against transformers; it affects CPU MLA
   too). Such inputs now go through ``forward_native``, written back in place.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_dsa_connector.options import runtime_fixes_disabled

_LOCK = threading.Lock()
_APPLIED = False
BACKEND_PATH = "vllm_dsa_connector.cpu_dsa.backend.CpuSparseMLABackend"
SPARSE_BACKEND_NAME = "CPU_DSA_SPARSE_MLA"  # CpuSparseMLABackend.get_name()
DSA_BLOCK_SIZE = 64


def is_dsa_model_config(model_config: Any) -> bool:
    """Whether a vLLM ModelConfig describes a V3.2/GLM-5 style DSA model (not DeepSeek-V4)."""
    if model_config is None:
        return False
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if hf is None or getattr(hf, "model_type", None) == "deepseek_v4":
        return False
    return getattr(hf, "index_topk", None) is not None and bool(
        getattr(model_config, "use_mla", False)
    )


def cpu_dsa_active() -> bool:
    """Whether the CPU DSA patches are applied in this process."""
    return _APPLIED


def register_cpu_dsa() -> None:
    """Apply the CPU DSA routing patches (CPU platform only; idempotent)."""
    global _APPLIED
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    logger = init_logger("vllm.plugins.vllm_dsa_connector.cpu_dsa")
    if not current_platform.is_cpu():
        return
    if runtime_fixes_disabled():
        logger.info_once(
            "vllm-dsa-connector: CPU DSA backends disabled (VLLM_DSA_DISABLE_RUNTIME_FIXES)"
        )
        return
    with _LOCK:
        if _APPLIED:
            return
        _patch_backend_selection()
        _patch_block_size()
        _patch_indexer()
        _patch_rotary_cpu()
        _APPLIED = True
    logger.info_once(
        "vllm-dsa-connector: CPU DSA enabled: sparse-attention models use %s and the torch "
        "reference indexer (block size %d unless --block-size is given)",
        BACKEND_PATH,
        DSA_BLOCK_SIZE,
    )


def _patch_backend_selection() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls.__func__  # type: ignore[attr-defined]
    if getattr(original, "_vllm_dsa_cpu", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            from vllm.logger import init_logger

            # Same words as vLLM's own selection line, so logs name the backend either way.
            init_logger("vllm.plugins.vllm_dsa_connector.cpu_dsa").info_once(
                "Using %s backend.", SPARSE_BACKEND_NAME)
            return BACKEND_PATH
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._vllm_dsa_cpu = True  # type: ignore[attr-defined]
    get_attn_backend_cls.__wrapped__ = original  # type: ignore[attr-defined]
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[method-assign]


def _patch_block_size() -> None:
    from vllm.logger import init_logger
    from vllm.platforms.cpu import CpuPlatform

    logger = init_logger("vllm.plugins.vllm_dsa_connector.cpu_dsa")
    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]
    if getattr(original, "_vllm_dsa_cpu", False):
        return

    def check_and_update_config(cls, vllm_config):
        cache_config = vllm_config.cache_config
        user_block_size = (
            cache_config.block_size
            if cache_config is not None and cache_config.user_specified_block_size
            else None
        )
        prefix_caching = getattr(cache_config, "enable_prefix_caching", None)
        original(cls, vllm_config)
        if cache_config is None or not is_dsa_model_config(vllm_config.model_config):
            return
        cache_config.block_size = user_block_size or DSA_BLOCK_SIZE
        # vLLM turns prefix caching off for MLA on CPU because the dense CPU MLA kernels cannot attend
        # over cached context; the DSA backends here address every token through the block table (as on
        # GPU), so a DSA model keeps what the user asked for (on by default, as on GPU).
        if prefix_caching is not None:
            cache_config.enable_prefix_caching = prefix_caching
        logger.info_once(
            "vllm-dsa-connector: DSA model on CPU: KV block size %d, prefix caching %s",
            cache_config.block_size, "on" if cache_config.enable_prefix_caching else "off",
        )

    check_and_update_config._vllm_dsa_cpu = True  # type: ignore[attr-defined]
    check_and_update_config.__wrapped__ = original  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]

    # vLLM 0.33 sets the block size again, from the attention backends, after the model is
    # built (update_block_size_for_backend: 128 for the CPU DSA backends, which accept any
    # size). 0.32's version returns early for non-hybrid models. Keep 64 for DSA models.
    update = getattr(CpuPlatform.update_block_size_for_backend, "__func__", None)
    if update is None or getattr(update, "_vllm_dsa_cpu", False):
        return

    def update_block_size_for_backend(cls, vllm_config):
        cache_config = vllm_config.cache_config
        update(cls, vllm_config)
        if (
            cache_config is None
            or cache_config.user_specified_block_size
            or not is_dsa_model_config(vllm_config.model_config)
        ):
            return
        cache_config.block_size = DSA_BLOCK_SIZE

    update_block_size_for_backend._vllm_dsa_cpu = True  # type: ignore[attr-defined]
    update_block_size_for_backend.__wrapped__ = update  # type: ignore[attr-defined]
    CpuPlatform.update_block_size_for_backend = classmethod(update_block_size_for_backend)  # type: ignore[method-assign]


def _patch_indexer() -> None:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.models import deepseek_v2

    from vllm_dsa_connector.cpu_dsa.backend import CpuDSAIndexerBackend
    from vllm_dsa_connector.cpu_dsa.indexer_op import (
        CpuReferenceSparseAttnIndexer,
        make_cpu_per_token_group_quant_fp8,
    )

    if "SparseAttnIndexer" not in op_registry_oot:
        CustomOp.register_oot(CpuReferenceSparseAttnIndexer, name="SparseAttnIndexer")

    cache_cls = deepseek_v2.DeepseekV32IndexerCache
    if not getattr(cache_cls.get_attn_backend, "_vllm_dsa_cpu", False):

        def get_attn_backend(self):
            return CpuDSAIndexerBackend

        get_attn_backend._vllm_dsa_cpu = True  # type: ignore[attr-defined]
        cache_cls.get_attn_backend = get_attn_backend  # type: ignore[method-assign]

    quant = deepseek_v2.per_token_group_quant_fp8
    if not hasattr(quant, "__wrapped__"):
        deepseek_v2.per_token_group_quant_fp8 = make_cpu_per_token_group_quant_fp8(quant)


def rope_kernel_layout_ok(x: Any, head_size: int) -> bool:
    """Whether vLLM's CPU rotary kernel addresses ``x`` correctly: 2-D, unit stride in the last
    dimension, whole heads per row (token stride = ``stride(0)``, head ``h`` at ``h * head_size``)."""
    return x.dim() == 2 and x.stride(-1) == 1 and x.size(-1) % head_size == 0


def _patch_rotary_cpu() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_vllm_dsa_cpu", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if rope_kernel_layout_ok(query, self.head_size) and (
            key is None or rope_kernel_layout_ok(key, self.head_size)
        ):
            return original(self, positions, query, key)
        q_out, k_out = self.forward_native(positions, query, key)
        query.copy_(q_out.reshape(query.shape))
        if key is not None and k_out is not None:
            key.copy_(k_out.reshape(key.shape))
        return query, key

    forward_cpu._vllm_dsa_cpu = True  # type: ignore[attr-defined]
    forward_cpu.__wrapped__ = original  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]
