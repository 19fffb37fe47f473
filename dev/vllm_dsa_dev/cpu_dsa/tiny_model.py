"""A tiny random GLM-MoE-DSA model and its transformers reference.

``make_tiny_glm_dsa`` writes a deterministic (seeded) ``GlmMoeDsaForCausalLM`` checkpoint with the
real DeepSeek tokenizer: hidden 256, 4 layers, IndexCache masking with ``index_topk_freq=2``
(layers F F S F: layer 2 reuses layer 1's top-k), ``index_topk=16`` (smaller than the test
prompts, so the indexer really selects), 16 indexer heads, interleaved indexer RoPE (GLM-5).

``num_mtp_layers=1`` adds a DeepSeek MTP (nextn) layer after the backbone, as DeepSeek-V3.2/GLM-5
checkpoints carry it: ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.*}`` plus a full decoder layer
with its own indexer (vLLM's MTP layers always own one), in a second safetensors file beside the
backbone's. vLLM runs it as the draft model of ``--speculative-config '{"method": "mtp", ...}'``;
transformers ignores it (the reference below is the backbone alone).

``transformers_greedy`` runs transformers' own ``GlmMoeDsaForCausalLM`` (eager, no KV cache,
full recompute each step) as the reference. vLLM's indexer stores K in fp8 e4m3 with a power-of-two
per-token scale and quantizes Q the same way per head; transformers scores with unquantized
q/k. With ``emulate_fp8_indexer=True`` (the default) the reference indexer rounds q and k through
exactly that fp8 quantization (``cpu_dsa.quant``) and is otherwise transformers' code, so top-k
selections are comparable token for token; everything else runs in float32 on both sides.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_dsa_connector.cpu_dsa.quant import fake_quant_fp8_groups, fake_quant_indexer_k
from vllm_dsa_dev.tiny_models import default_model_root, glm_dsa_config, save_tokenizer

TINY_GLM_DSA_SEED = 4321
# Weight init std. transformers' default (0.02) makes attention nearly uniform in a random model,
# so which tokens the indexer keeps would barely matter; a larger std makes outputs depend on it.
TINY_GLM_DSA_INIT_STD = 0.15


def tiny_glm_dsa_config(
    *,
    num_layers: int = 4,
    index_topk_freq: int = 2,
    index_topk: int = 16,
    index_n_heads: int = 16,
    **overrides: Any,
) -> Any:
    """The ``GlmMoeDsaConfig`` of the tiny model (dense MLPs, interleaved indexer RoPE)."""
    kw: dict[str, Any] = dict(
        index_topk=index_topk,
        index_n_heads=index_n_heads,
        indexer_rope_interleave=True,
        initializer_range=TINY_GLM_DSA_INIT_STD,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return glm_dsa_config(num_layers, index_topk_freq=index_topk_freq, **kw)


def make_tiny_glm_dsa(
    path: str | Path | None = None,
    *,
    index_topk_freq: int = 2,
    num_layers: int = 4,
    index_topk: int = 16,
    index_n_heads: int = 16,
    num_mtp_layers: int = 0,
    force: bool = False,
) -> Path:
    """Create (once) the tiny random GLM-MoE-DSA model directory and return its path.

    Deterministic: the same arguments give the same weights (bf16 on disk); ``num_mtp_layers`` MTP layers
    are added without changing the backbone's weights. An existing complete directory is reused unless
    ``force``.
    """
    from transformers import GlmMoeDsaForCausalLM

    if num_mtp_layers < 0:
        raise ValueError(f"num_mtp_layers must be >= 0, got {num_mtp_layers}")
    name = f"tiny-glm-dsa-{num_layers}l-f{index_topk_freq}-k{index_topk}-h{index_n_heads}"
    name += f"-mtp{num_mtp_layers}" if num_mtp_layers else ""
    path = Path(path) if path else default_model_root() / name
    done = path / ".complete"
    if done.exists() and not force:
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_glm_dsa_config(
        num_layers=num_layers,
        index_topk_freq=index_topk_freq,
        index_topk=index_topk,
        index_n_heads=index_n_heads,
        num_nextn_predict_layers=num_mtp_layers,
        # vLLM makes every layer from first_k_dense_replace on an MoE layer, MTP layers included
        first_k_dense_replace=num_layers + num_mtp_layers,
    )
    torch.manual_seed(TINY_GLM_DSA_SEED)
    model = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    if num_mtp_layers:
        _save_mtp_layers(path, cfg, num_mtp_layers)
    save_tokenizer(path)
    done.write_text("ok\n")
    return path


def _save_mtp_layers(path: Path, cfg: Any, count: int) -> None:
    """Write ``count`` random MTP layers (global ids ``num_hidden_layers`` on) as ``mtp.safetensors``.

    Each is a full decoder layer that owns its indexer (taken from a seeded model whose every layer computes
    its own top-k) plus DeepSeek's MTP projections; names follow the DeepSeek-V3/GLM-5 checkpoints that
    vLLM's ``DeepSeekMTP.load_weights`` reads.
    """
    from safetensors.torch import save_file
    from transformers import GlmMoeDsaForCausalLM

    n = cfg.num_hidden_layers
    hidden = cfg.hidden_size
    std = cfg.initializer_range
    full = tiny_glm_dsa_config(
        num_layers=n + count, index_topk_freq=1, index_topk=cfg.index_topk,
        index_n_heads=cfg.index_n_heads,
    )
    torch.manual_seed(TINY_GLM_DSA_SEED + 1)
    donor = GlmMoeDsaForCausalLM(full).to(torch.bfloat16)
    tensors: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(TINY_GLM_DSA_SEED + 2)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    for layer in range(n, n + count):
        prefix = f"model.layers.{layer}."
        for key, value in donor.model.layers[layer].state_dict().items():
            tensors[prefix + key] = value.contiguous()
        tensors[prefix + "enorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "hnorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "eh_proj.weight"] = normal(hidden, 2 * hidden)
        tensors[prefix + "shared_head.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "shared_head.head.weight"] = normal(cfg.vocab_size, hidden)
    save_file(tensors, str(path / "mtp.safetensors"), metadata={"format": "pt"})


def _fp8_indexer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    past_key_values: Any = None,
) -> torch.Tensor:
    """transformers' ``GlmMoeDsaIndexer.forward`` with vLLM's fp8 rounding of q and k added."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    batch_size, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(
        q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1
    )
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(
        k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1
    )
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    # vLLM: Q per (token, head) group of head_dim, K per token, fp8 e4m3 with ue8m0 scales.
    q = fake_quant_fp8_groups(q, self.head_dim)
    k = fake_quant_indexer_k(k)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
    scores = torch.nn.functional.relu(scores)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (
        self.n_heads**-0.5
    )
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    return index_scores.topk(topk, dim=-1).indices.to(torch.int32)


def load_reference_model(model_dir: str | Path, *, emulate_fp8_indexer: bool = True) -> Any:
    """transformers' ``GlmMoeDsaForCausalLM`` in float32 (eager attention), optionally with the
    fp8 indexer rounding of vLLM (see module docstring)."""
    from transformers import GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    model = GlmMoeDsaForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    if emulate_fp8_indexer:
        for module in model.modules():
            if isinstance(module, GlmMoeDsaIndexer):
                module.forward = types.MethodType(_fp8_indexer_forward, module)
    return model


@torch.no_grad()
def transformers_greedy(
    model_or_dir: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    emulate_fp8_indexer: bool = True,
) -> list[list[int]]:
    """Greedy continuations (token ids) of each prompt, recomputing the full sequence each step."""
    model = (
        load_reference_model(model_or_dir, emulate_fp8_indexer=emulate_fp8_indexer)
        if isinstance(model_or_dir, (str, Path))
        else model_or_dir
    )
    outputs: list[list[int]] = []
    for prompt in prompts:
        seq = list(prompt)
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False, logits_to_keep=1).logits[0, -1]
            token = int(torch.argmax(logits))
            new.append(token)
            seq.append(token)
        outputs.append(new)
    return outputs


if __name__ == "__main__":
    print(make_tiny_glm_dsa())
