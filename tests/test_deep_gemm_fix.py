"""Runtime fix ``deep-gemm-mqa-logits-api``: vLLM's older MQA-logits wrappers over DeepGEMM's newer kernels.

vLLM's own ``vllm.utils.deep_gemm`` module (the CPU build has it, without DeepGEMM) gets the fix; the
DeepGEMM kernels cannot run on a CPU, so the newer-API kernel is a torch stand-in with the newer contract
(compressed rows ``[M, max_seqlen_k]``, row ``i`` starting at key ``ks[i]``, tail garbage): the one fault
this file cannot cause with the real kernel. On the GPU, ``dev/bench/gpu_pd.py`` checks the real kernel through
the fix against the same torch reference.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from vllm_dsa_connector.fixes import deep_gemm_api as fix


def _reference(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """DSA indexer logits ``[M, N]``: sum over heads of relu(q . k) * weight, times the key's scale."""
    scores = torch.einsum("mhd,nd->mhn", q.float(), k.float()).relu()
    return (scores * w.float().unsqueeze(-1)).sum(1) * k_scale.float().view(1, -1)


def _newer_kernel(q, kv, weights, ks, ke, max_seqlen_k, schedule_meta=None):  # noqa: ANN001, ANN202
    """Stand-in with the newer DeepGEMM contract: compressed rows, tail not cleaned (set to 7.0 here)."""
    full = _reference(q[0], kv[0], kv[1], weights)
    cols = torch.arange(max_seqlen_k).view(1, -1) + ks.to(torch.int64).view(-1, 1)
    out = torch.gather(full, 1, cols.clamp(max=full.shape[1] - 1))
    return out.masked_fill(cols >= ke.to(torch.int64).view(-1, 1), 7.0)


def _ranges(m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, n, (m,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(0, n, (m,), generator=g, dtype=torch.int32), torch.tensor(n))
    ks[0], ke[0] = 0, n  # a row over every key
    ks[1] = ke[1] = n // 2  # an empty row
    return ks, ke


def test_expand_puts_every_row_back_at_its_key_columns() -> None:
    m, n, width = 9, 37, 37
    ks, ke = _ranges(m, n, 1)
    full = torch.randn(m, n)
    cols = torch.arange(width).view(1, -1) + ks.to(torch.int64).view(-1, 1)
    compressed = torch.gather(full, 1, cols.clamp(max=n - 1))
    out = fix.expand_compressed_logits(compressed, ks, ke, n)
    mask = torch.zeros(m, n, dtype=torch.bool)
    for i in range(m):
        mask[i, ks[i]:ke[i]] = True
    assert torch.equal(out[mask], full[mask])
    assert bool((out[~mask] == float("-inf")).all())
    assert fix.expand_compressed_logits(compressed[:0], ks[:0], ke[:0], n).shape == (0, n)


@pytest.fixture
def deep_gemm_module():
    """vLLM's vllm.utils.deep_gemm without the fix, its resolved kernels restored afterwards."""
    module = importlib.import_module(fix.MODULE)
    saved = (module._fp8_fp4_mqa_logits_impl, module._fp8_fp4_paged_mqa_logits_impl)
    fix.uninstall(module)
    yield module
    fix.uninstall(module)
    module._fp8_fp4_mqa_logits_impl, module._fp8_fp4_paged_mqa_logits_impl = saved
    from vllm_dsa_connector.fixes import apply_runtime_fixes

    apply_runtime_fixes()


def test_vllm_wrapper_calls_a_newer_kernel_through_the_fix(deep_gemm_module) -> None:
    """vLLM's own wrapper (clean_logits=) over a kernel that takes max_seqlen_k returns the [M, N] logits."""
    module = deep_gemm_module
    assert fix.caller_takes_clean_logits(module), "vLLM 0.32's wrapper takes clean_logits"
    assert fix.kernel_takes_max_seqlen_k(_newer_kernel)
    m, n, heads, dim = 11, 29, 4, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(m, heads, dim, generator=g)
    k = torch.randn(n, dim, generator=g)
    scale = torch.rand(n, generator=g) + 0.5
    w = torch.randn(m, heads, generator=g)
    ks, ke = _ranges(m, n, 4)
    module._fp8_fp4_mqa_logits_impl = _newer_kernel  # what _lazy_init resolves from the newer DeepGEMM
    with pytest.raises(TypeError, match="clean_logits"):  # the failure the engine died of
        module.fp8_fp4_mqa_logits((q, None), (k, scale), w, ks, ke, clean_logits=False)
    from vllm_dsa_connector.fixes import report_for, revert_runtime_fixes

    revert_runtime_fixes()
    module._fp8_fp4_mqa_logits_impl = _newer_kernel
    from vllm_dsa_connector.fixes import apply_runtime_fixes

    report = report_for(apply_runtime_fixes(), fix.FIX_NAME)
    assert report.status == "applied", report
    out = module.fp8_fp4_mqa_logits((q, None), (k, scale), w, ks, ke, clean_logits=False)
    ref = _reference(q, k, scale, w)
    assert out.shape == (m, n)
    for i in range(m):
        torch.testing.assert_close(out[i, ks[i]:ke[i]], ref[i, ks[i]:ke[i]])
        assert bool((out[i, :ks[i]] == float("-inf")).all()) and bool((out[i, ke[i]:] == float("-inf")).all())
    assert report_for(apply_runtime_fixes(), fix.FIX_NAME).status == "already-applied"
    assert fix.uninstall(module)
    assert module._fp8_fp4_mqa_logits_impl is _newer_kernel


def test_paged_adapter_drops_clean_logits_and_cleans_when_asked() -> None:
    calls = []

    def newer_paged(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,  # noqa: ANN001, ANN202
                    indices=None):
        calls.append(indices)
        return torch.ones(context_lens.numel(), max_context_len)

    adapted = fix.adapt_paged_kernel(newer_paged)
    lens = torch.tensor([[3], [5]], dtype=torch.int32)
    out = adapted((None, None), None, None, lens, None, None, 8, clean_logits=False)
    assert torch.equal(out, torch.ones(2, 8)) and calls == [None]
    out = adapted((None, None), None, None, lens, None, None, 8, clean_logits=True, indices=torch.tensor([0]))
    assert out[0, :3].eq(1).all() and out[0, 3:].eq(float("-inf")).all() and out[1, 5:].eq(float("-inf")).all()
    assert calls[-1] is not None


def test_a_kernel_with_the_older_api_is_left_alone(deep_gemm_module) -> None:
    def older(q, kv, weights, ks, ke, clean_logits):  # noqa: ANN001, ANN202
        return "older"

    module = deep_gemm_module
    fix.install(module)
    module._fp8_fp4_mqa_logits_impl = older
    module._lazy_init()
    assert module._fp8_fp4_mqa_logits_impl is older
