"""CPU DSA reference ops: fp8 arithmetic, indexer cache byte layout, top-k, sparse MLA (no engine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_dsa_connector.cpu_dsa.quant import (
    FP8_DTYPE,
    gather_indexer_k,
    indexer_cache_views,
    mqa_logits,
    quant_fp8_groups,
    quant_indexer_k,
    ue8m0_ceil,
    write_indexer_k,
)


def test_ue8m0_ceil_is_exact_power_of_two_ceiling():
    s = torch.tensor([1.0, 0.5, 0.75, 1.0000001, 3.0, 2.0**-20, 2.0**-20 * 1.5, 448.0])
    got = ue8m0_ceil(s)
    want = torch.tensor([1.0, 0.5, 1.0, 2.0, 4.0, 2.0**-20, 2.0**-19, 512.0])
    assert torch.equal(got, want)


def test_indexer_k_quant_matches_kernel_formula():
    torch.manual_seed(0)
    k = torch.randn(7, 128) * torch.tensor([0.001, 0.1, 1, 3, 10, 100, 1e-6]).unsqueeze(1)
    values, scale = quant_indexer_k(k)
    amax = k.abs().amax(-1).clamp(min=1e-4)
    want_scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    assert torch.equal(scale, want_scale)
    assert values.dtype == FP8_DTYPE
    assert torch.equal(values, (k / want_scale[:, None]).to(FP8_DTYPE))
    # Round trip error stays within e4m3 precision (3 mantissa bits).
    deq = values.float() * scale[:, None]
    assert ((deq - k).abs() <= k.abs() * 2**-3 + scale[:, None] * 2**-9).all()


def test_q_group_quant_scales_per_head():
    torch.manual_seed(1)
    q = torch.randn(3, 4, 128)
    q[1, 2] *= 50
    values, scale = quant_fp8_groups(q.reshape(-1, 128), 128)
    assert values.shape == (12, 128) and scale.shape == (12, 1)
    assert scale.reshape(3, 4)[1, 2] > 16 * scale.reshape(3, 4)[1, 1]
    assert (values.float().abs() <= 448).all()


def _shared_buffer(num_blocks: int, block_size: int, other_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An indexer layer view into a block-outermost multi-layer buffer (block stride > one page)."""
    page = block_size * 132
    raw = torch.zeros(num_blocks * (page + other_bytes), dtype=torch.uint8)
    view = raw.as_strided((num_blocks, block_size, 132), (page + other_bytes, 132, 1), other_bytes)
    return raw, view


def test_indexer_cache_write_is_block_split_at_exact_offsets():
    block_size, other = 16, 1000
    raw, cache = _shared_buffer(4, block_size, other)
    torch.manual_seed(2)
    k = torch.randn(5, 128)
    slots = torch.tensor([3, 16 + 15, -1, 2 * 16, 3 * 16 + 7])
    write_indexer_k(cache, k, slots)
    values, scale = quant_indexer_k(k)
    page = block_size * 132
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, off = divmod(slot, block_size)
        base = block * (page + other) + other
        vbytes = raw[base + off * 128 : base + off * 128 + 128]
        sbytes = raw[base + block_size * 128 + off * 4 : base + block_size * 128 + off * 4 + 4]
        assert torch.equal(vbytes, values[t].view(torch.uint8))
        assert sbytes.view(torch.float32).item() == scale[t].item()
    # Token 2 (slot -1) was skipped; the other layer's bytes are untouched.
    assert int(raw[:other].count_nonzero()) == 0
    written = sum(1 for s in slots.tolist() if s >= 0)
    assert int((raw != 0).sum()) <= written * 132


def test_gather_round_trip_through_block_table():
    block_size = 8
    _, cache = _shared_buffer(6, block_size, 264)
    torch.manual_seed(3)
    k = torch.randn(20, 128)
    block_ids = torch.tensor([4, 1, 5])
    pos = torch.arange(20)
    slots = block_ids[pos // block_size] * block_size + pos % block_size
    write_indexer_k(cache, k, slots)
    values, scales = gather_indexer_k(cache, block_ids, 20, 128)
    want_values, want_scales = quant_indexer_k(k)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales)
    v, s = indexer_cache_views(cache, 128)
    assert v.shape == (6, block_size, 128) and s.shape == (6, block_size, 4)


def test_mqa_logits_matches_deepgemm_reference():
    torch.manual_seed(4)
    q = torch.randn(3, 4, 128).to(FP8_DTYPE)
    k = torch.randn(9, 128).to(FP8_DTYPE)
    ks = torch.rand(9) + 0.5
    w = torch.randn(3, 4)
    got = mqa_logits(q, k, ks, w)
    score = torch.einsum("mhd,nd->hmn", q.float(), k.float() * ks[:, None])
    want = (score.relu() * w.t().unsqueeze(-1)).sum(0)
    torch.testing.assert_close(got, want)


def _metadata(query_lens: list[int], seq_lens: list[int], block_size: int, blocks_per_req: int):
    from vllm_dsa_connector.cpu_dsa.backend import CpuDSAMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    first = torch.tensor(seq_lens) - torch.tensor(query_lens) - qsl[:-1]
    positions = first[req] + torch.arange(req.shape[0])
    table = torch.arange(len(query_lens) * blocks_per_req).reshape(len(query_lens), -1).flip(1)
    slots = table[req, positions // block_size] * block_size + positions % block_size
    return CpuDSAMetadata(
        num_reqs=len(query_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=qsl, seq_lens=torch.tensor(seq_lens),
        block_table=table, slot_mapping=slots, req_id_per_token=req, positions=positions,
        block_size=block_size, topk_tokens=0, num_decodes=len(query_lens),
        num_decode_tokens=int(qsl[-1]),
    )


def test_topk_selection_is_causal_request_local_and_padded():
    from vllm_dsa_connector.cpu_dsa.indexer_op import select_topk

    block_size, topk = 4, 6
    # Request 0: prefill of 10 tokens; request 1: one decode token at position 12 (13 cached).
    md = _metadata([10, 1], [10, 13], block_size, 4)
    _, cache = _shared_buffer(8, block_size, 0)
    torch.manual_seed(5)
    k_all = {0: torch.randn(10, 128), 1: torch.randn(13, 128)}
    for r in (0, 1):
        pos = torch.arange(k_all[r].shape[0])
        write_indexer_k(cache, k_all[r], md.block_table[r][pos // block_size] * block_size + pos % block_size)
    # 16 heads and positive weights: an all-zero (relu) score, hence a tie, is practically impossible.
    q = torch.randn(11, 16, 128).to(FP8_DTYPE)
    w = torch.rand(11, 16) + 0.1
    out = torch.full((11, topk), -1, dtype=torch.int32)  # the op clears the buffer to -1 first
    select_topk(md, cache, q, w, out, topk)
    for t in range(11):
        r = int(md.req_id_per_token[t])
        p = int(md.positions[t])
        kq, ks = quant_indexer_k(k_all[r][: p + 1])
        logits = mqa_logits(q[t : t + 1], kq, ks, w[t : t + 1])[0]
        n = min(topk, p + 1)
        want = set(torch.topk(logits, n).indices.tolist())
        row = out[t].tolist()
        assert set(row[:n]) == want, (t, row, want)
        assert row[n:] == [-1] * (topk - n)
        assert all(x <= p for x in row)


def test_sparse_attention_over_all_rows_equals_dense_attention():
    from vllm_dsa_connector.cpu_dsa.backend import sparse_mla_attention

    block_size = 4
    md = _metadata([5], [5], block_size, 2)
    torch.manual_seed(6)
    cache = torch.zeros(2, block_size, 576)
    rows = torch.randn(5, 576)
    slots = md.slot_mapping
    cache[slots // block_size, slots % block_size] = rows
    q = torch.randn(5, 3, 576)
    topk = torch.full((5, 8), -1, dtype=torch.int32)
    for t in range(5):
        topk[t, : t + 1] = torch.arange(t, -1, -1)
    got = sparse_mla_attention(q, cache, topk, md, 0.1, 512)
    scores = torch.einsum("tnd,jd->tnj", q, rows) * 0.1
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool().unsqueeze(1), float("-inf"))
    want = torch.einsum("tnj,jl->tnl", scores.softmax(-1), rows[:, :512])
    torch.testing.assert_close(got, want)


_REGISTRATION_PROBE = r"""
import json, os
import torch
from vllm.platforms import current_platform
from vllm.v1.attention.selector import AttentionSelectorConfig

def state():
    from vllm.model_executor.models import deepseek_v2
    from vllm.platforms.cpu import CpuPlatform
    sparse = AttentionSelectorConfig(576, torch.float32, "auto", None, use_mla=True, use_sparse=True)
    dense = AttentionSelectorConfig(576, torch.float32, "auto", None, use_mla=True, use_sparse=False)
    try:
        s = CpuPlatform.get_attn_backend_cls(None, sparse)
    except NotImplementedError as e:
        s = "error: " + str(e)
    return {"cpu": current_platform.is_cpu(), "sparse": s,
            "dense": CpuPlatform.get_attn_backend_cls(None, dense),
            "indexer": deepseek_v2.DeepseekV32IndexerCache.get_attn_backend(None).get_name()}

os.environ["VLLM_DSA_DISABLE_RUNTIME_FIXES"] = "1"
from vllm_dsa_connector.plugin import register
register()  # the plugin entry point: with the switch set, nothing is patched
off = state()
os.environ["VLLM_DSA_DISABLE_RUNTIME_FIXES"] = "0"
from vllm_dsa_connector.cpu_dsa.registration import register_cpu_dsa
register_cpu_dsa()
register_cpu_dsa()  # idempotent
print(json.dumps({"off": off, "on": state()}))
"""


def test_registration_routes_only_sparse_selection_and_can_be_disabled():
    import json

    out = subprocess.run([sys.executable, "-c", _REGISTRATION_PROBE], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    on, off = probe["on"], probe["off"]
    assert on["cpu"] is True
    assert on["sparse"] == "vllm_dsa_connector.cpu_dsa.backend.CpuSparseMLABackend"
    assert on["dense"].endswith(("CPUMLABackend", "AMXMLABackend"))
    assert on["indexer"] == "CPU_DSA_INDEXER"
    assert off["sparse"].startswith("error: Sparse Attention is not supported on CPU")
    assert off["dense"] == on["dense"]
    assert off["indexer"] == "DEEPSEEK_V32_INDEXER"


@pytest.mark.parametrize("is_neox", [False, True])
def test_rope_fix_matches_native_for_3d_mla_views(is_neox):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_dsa_connector.cpu_dsa.registration import _patch_rotary_cpu, rope_kernel_layout_ok

    _patch_rotary_cpu()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=512, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=is_neox)
    torch.manual_seed(7)
    t = 9
    q = torch.randn(t, 4, 128)
    fused = torch.randn(t, 832)  # [q_c 256 | kv_c 512 | k_pe 64] as in the fused qkv_a output
    q_view, k_view = q[..., 64:], fused[:, 768:].unsqueeze(1)
    assert not rope_kernel_layout_ok(q_view, 64) and not rope_kernel_layout_ok(k_view, 64)
    pos = torch.arange(t) * 3
    want_q, want_k = rope.forward_native(pos, q_view.clone(), k_view.clone())
    got_q, got_k = rope.forward_cpu(pos, q_view, k_view)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    torch.testing.assert_close(q[..., 64:], want_q)  # written in place, like the kernel
    torch.testing.assert_close(fused[:, 768:], want_k.reshape(t, 64))
