"""Which layers own an indexer K cache: vLLM 0.32's IndexCache rule, as a pure function.

vLLM decides this inline in ``DeepseekV2MLAAttention.__init__`` (no callable to reuse): without a pattern,
layer ``i`` skips its indexer when ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0``
(offset default 2); with ``index_topk_pattern``, ``pattern[i] == "S"`` skips and layers past the pattern
keep theirs. MTP/nextn layers (``i >= num_hidden_layers``) always own one. Tests cross-check this against
transformers' ``GlmMoeDsaConfig.indexer_types``.
"""

from __future__ import annotations

from typing import Any

from vllm_dsa_connector.core.plan.pages import ModelId


class LayoutError(ValueError):
    """A model or parallel layout this package cannot describe; the message says why."""


def is_dsa(hf_config: Any) -> bool:
    """A DeepSeek-Sparse-Attention model (it has an indexer)."""
    return hasattr(hf_config, "index_topk")


def is_mla(hf_config: Any) -> bool:
    """An MLA model (latent KV: kv_lora_rank + qk_rope_head_dim per token)."""
    return bool(getattr(hf_config, "kv_lora_rank", None)) and bool(
        getattr(hf_config, "qk_rope_head_dim", None)
    )


def num_mtp_layers(hf_config: Any) -> int:
    """Number of MTP/nextn layers the checkpoint carries."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def _masking(hf_config: Any) -> tuple[int, int, str | None]:
    freq = getattr(hf_config, "index_topk_freq", 1)
    offset = getattr(hf_config, "index_skip_topk_offset", 2)
    pattern = getattr(hf_config, "index_topk_pattern", None)
    if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise LayoutError(f"index_topk_freq must be a positive integer, got {freq!r}")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise LayoutError(f"index_skip_topk_offset must be an integer, got {offset!r}")
    if pattern is not None:
        if isinstance(pattern, list | tuple):
            pattern = "".join(pattern)
        if not isinstance(pattern, str) or set(pattern) - {"S", "F"}:
            raise LayoutError(f"index_topk_pattern must be a string of 'F'/'S', got {pattern!r}")
    return freq, offset, pattern


def layer_owns_indexer(layer: int, hf_config: Any) -> bool:
    """vLLM's rule for one global layer id (backbone or MTP)."""
    if not is_dsa(hf_config):
        return False
    if layer >= hf_config.num_hidden_layers:
        return True
    freq, offset, pattern = _masking(hf_config)
    if pattern is None:
        return max(layer - offset + 1, 0) % freq == 0
    if 0 <= layer < len(pattern):
        return pattern[layer] != "S"
    return True


def owning_layers(hf_config: Any) -> tuple[int, ...]:
    """Global ids of every indexer-owning layer of the model, MTP layers included."""
    total = hf_config.num_hidden_layers + num_mtp_layers(hf_config)
    return tuple(i for i in range(total) if layer_owns_indexer(i, hf_config))


def packed_rows(layers: tuple[int, ...], owners: tuple[int, ...]) -> dict[int, int]:
    """Packed row of each owning layer of one stage: 0..k-1 in global-id order."""
    own = sorted(set(layers) & set(owners))
    return {layer: row for row, layer in enumerate(own)}


def model_id(hf_config: Any) -> ModelId:
    """The fingerprint peers compare before copying pages."""
    dsa = is_dsa(hf_config)
    freq, offset, pattern = _masking(hf_config) if dsa else (1, 2, None)
    archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")]
    return ModelId(
        architecture=str(archs[0]),
        num_hidden_layers=int(hf_config.num_hidden_layers),
        num_mtp_layers=num_mtp_layers(hf_config),
        kv_lora_rank=int(getattr(hf_config, "kv_lora_rank", 0) or 0),
        qk_rope_head_dim=int(getattr(hf_config, "qk_rope_head_dim", 0) or 0),
        index_head_dim=int(getattr(hf_config, "index_head_dim", 0) or 0) if dsa else 0,
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
        index_topk_pattern=pattern,
        owning_layers=owning_layers(hf_config),
    )
