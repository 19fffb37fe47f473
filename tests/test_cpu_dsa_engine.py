"""A tiny GLM-MoE-DSA model on vLLM CPU through the plugin's reference DSA backends.

Starts ONE real vLLM engine for the module (in-process; default mode, i.e. torch.compile'd, so the
reference ops run as opaque custom ops inside the compiled graph) and checks it against
transformers' own ``GlmMoeDsaForCausalLM`` on the same weights, float32 on both sides, with the
reference indexer rounding q/k through vLLM's fp8 quantization (see ``vllm_dsa_dev.cpu_dsa.tiny_model``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts a real vLLM engine

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill and "
    "dreams of fish swimming in a silver river under the moon.",
    "In a distant galaxy, a small robot named Pip discovered an ancient library full of glowing "
    "books about the stars, the oceans and the forgotten languages of its makers.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "\nprint([fibonacci(i) for i in range(10)])",
    "Ledger: Monday 14 apples, Tuesday 9 pears, Wednesday 31 plums, Thursday 2 melons, Friday 17 "
    "figs; the total count of fruit delivered this week was",
]
MAX_NEW = 8
INDEX_TOPK = 16


@pytest.fixture(scope="module")
def glm_dsa_dir() -> Path:
    from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

    return make_tiny_glm_dsa(index_topk_freq=2, index_topk=INDEX_TOPK)


@pytest.fixture(scope="module")
def prompt_ids(glm_dsa_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(glm_dsa_dir))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(len(i) >= INDEX_TOPK + 12 for i in ids), [len(i) for i in ids]
    return ids


@pytest.fixture(scope="module")
def llm(glm_dsa_dir: Path) -> Iterator[object]:
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process: the tests reach the model directly
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model with local functions
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM

    engine = LLM(model=str(glm_dsa_dir), dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0)
    try:
        yield engine
    finally:
        del engine
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _generate(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": i} for i in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _layout(model) -> dict:
    layers = model.model.layers
    info = {"indexer_layers": [], "block_size": None}
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        mla_cache = attn.mla_attn.mla_attn.kv_cache
        info.setdefault("mla", (tuple(mla_cache.shape[1:]), str(mla_cache.dtype), attn.mla_attn.mla_attn.attn_backend.get_name()))
        if attn.indexer is not None:
            cache = attn.indexer.k_cache.kv_cache
            info["indexer_layers"].append(i)
            info["indexer"] = (tuple(cache.shape[1:]), str(cache.dtype), attn.indexer.k_cache.get_attn_backend().get_name())
            info["block_size"] = cache.shape[1]
    return info


def test_engine_uses_reference_backends_and_gpu_cache_layout(llm):
    (info,) = llm.apply_model(_layout)
    # index_topk_freq=2, offset 2: layers 0, 1, 3 own an indexer, layer 2 reuses layer 1's top-k.
    assert info["indexer_layers"] == [0, 1, 3]
    assert info["block_size"] == 64  # as the GPU sparse backends, not CPU MLA's 16
    assert info["indexer"] == ((64, 132), "torch.uint8", "CPU_DSA_INDEXER")
    assert info["mla"] == ((64, 576), "torch.float32", "CPU_DSA_SPARSE_MLA")


def test_greedy_tokens_equal_transformers(llm, glm_dsa_dir, prompt_ids):
    from vllm_dsa_dev.cpu_dsa.tiny_model import transformers_greedy

    got = _generate(llm, prompt_ids)
    want = transformers_greedy(glm_dsa_dir, prompt_ids, MAX_NEW, emulate_fp8_indexer=True)
    assert got == want


def _indexer_cache_ptr(layer_idx: int):
    def get(model) -> int:
        return model.model.layers[layer_idx].self_attn.indexer.k_cache.kv_cache.data_ptr()

    return get


def test_corrupting_one_owning_layers_indexer_cache_changes_output(llm, prompt_ids, monkeypatch):
    """At the first decode step, reverse the order of the prefill tokens' rows (fp8 values and
    scales) in layer 1's indexer cache, what a misrouted page transfer would leave behind; the MLA
    latent cache is untouched. Done inside the indexer op (runs eagerly, also in a compiled model)."""
    from vllm_dsa_connector.cpu_dsa import indexer_op
    from vllm_dsa_connector.cpu_dsa.quant import indexer_cache_views

    (target,) = llm.apply_model(_indexer_cache_ptr(1))
    clean = _generate(llm, prompt_ids)
    real_select = indexer_op.select_topk
    state = {"corrupted": 0}

    def select_after_corruption(md, kv_cache, q_fp8, weights, out, topk_tokens):
        if state["corrupted"] == 0 and kv_cache.data_ptr() == target and md.max_query_len == 1:
            values, scales = indexer_cache_views(kv_cache, q_fp8.shape[-1])
            bs = kv_cache.shape[1]
            for r in range(md.num_reqs):
                pos = torch.arange(int(md.seq_lens[r]) - 1)
                blocks, offs = md.block_table[r][pos // bs], pos % bs
                values[blocks, offs] = values[blocks, offs].flip(0).clone()
                scales[blocks, offs] = scales[blocks, offs].flip(0).clone()
                state["corrupted"] += 1
        return real_select(md, kv_cache, q_fp8, weights, out, topk_tokens)

    monkeypatch.setattr(indexer_op, "select_topk", select_after_corruption)
    corrupted = _generate(llm, prompt_ids)
    monkeypatch.undo()
    assert state["corrupted"] == len(prompt_ids)
    assert _generate(llm, prompt_ids) == clean  # patch gone: deterministic again
    # Layer 1 owns the top-k that layers 1 and 2 use; wrong indexer pages pick other tokens.
    assert [c[0] for c in corrupted] == [c[0] for c in clean]  # first token comes from the prefill
    assert corrupted != clean
