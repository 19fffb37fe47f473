"""Page tables built through vLLM's real spec/grouping/allocation code, checked against the tensors."""

from __future__ import annotations

import os

import pytest
import torch
from vllm_dsa_dev.tiny_models import glm5_2_shape_config, glm_dsa_config

from vllm_dsa_connector.connector.page_tables import allocate_offline, build_offline
from vllm_dsa_connector.core.plan.pages import PageTable, Role
from vllm_dsa_connector.core.plan.rules import LayoutError, owning_layers

CONFIGS = {
    "dense": dict(num_layers=6),
    "freq2": dict(num_layers=8, index_topk_freq=2, index_skip_topk_offset=1),
    "freq4_off2": dict(num_layers=10, index_topk_freq=4, index_skip_topk_offset=2),
    "pattern": dict(num_layers=8, index_topk_pattern="FFSSSSFS"),
    "freq2_mtp": dict(num_layers=6, index_topk_freq=2, num_nextn_predict_layers=1),
}


def _cfg(name: str):
    kw = dict(CONFIGS[name])
    return glm_dsa_config(kw.pop("num_layers"), **kw)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_owning_layers_match_transformers_indexer_types(name: str) -> None:
    cfg = _cfg(name)
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    mtp = list(range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
    assert list(owning_layers(cfg)) == full + mtp


def test_glm5_2_shape_owning_layers_and_bytes() -> None:
    cfg = glm5_2_shape_config()
    owners = owning_layers(cfg)
    assert owners == (0, 1) + tuple(range(5, 78, 4))
    assert len(owners) == 21
    (t,) = build_offline(cfg, kv_cache_dtype="fp8_ds_mla")
    # 78 MLA pages of 41,984 B + 21 indexer pages of 8,448 B per 64-token block.
    assert t.view(Role.MLA).bytes_per_layer == 41_984
    assert t.view(Role.INDEXER_K).bytes_per_layer == 8_448
    assert t.bytes_per_block == 3_452_160
    assert t.bytes_per_token == {"mla": 78 * 656, "indexer_k": 21 * 132}


def _check_against_tensors(table: PageTable, kv_caches: dict[str, torch.Tensor]) -> None:
    names = set()
    for view in table.views:
        pool = table.pools[view.pool]
        for e in view.entries:
            t = kv_caches[e.name]
            names.add(e.name)
            assert t.data_ptr() == pool.base_ptr + e.offset
            assert t.stride(0) * t.element_size() == pool.block_stride
            assert t[0].numel() * t.element_size() == e.nbytes == view.bytes_per_layer
            # block b of the entry is where the tensor says it is
            b = pool.num_blocks - 1
            assert t[b].data_ptr() == pool.base_ptr + e.offset + b * pool.block_stride
            assert pool.base_ptr <= t.data_ptr() and t[b].data_ptr() + e.nbytes <= pool.base_ptr + pool.nbytes
    assert names == set(kv_caches)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_offline_tables_match_allocated_tensors(name: str, pp_size: int) -> None:
    cfg = _cfg(name)
    offline = build_offline(cfg, pp_size=pp_size, kv_cache_dtype="auto", num_blocks=8)
    owners = set(owning_layers(cfg))
    covered: list[int] = []
    for pp in range(pp_size):
        kv_caches, kc, live = allocate_offline(cfg, pp_rank=pp, pp_size=pp_size, num_blocks=8)
        _check_against_tensors(live, kv_caches)
        off = offline[pp]
        assert off.layers == live.layers
        covered += list(live.layers)
        for role in (Role.MLA, Role.INDEXER_K):
            a, b = off.view(role), live.view(role)
            assert (a is None) == (b is None)
            if a is None:
                assert role is Role.INDEXER_K and not (owners & set(live.layers))
                continue
            assert [(e.name, e.offset, e.nbytes, e.row) for e in a.entries] == [
                (e.name, e.offset, e.nbytes, e.row) for e in b.entries
            ]
        idx = live.view(Role.INDEXER_K)
        if idx is not None:
            # masked rows: only owning layers, packed 0..k-1 in global order, equal to vLLM's row order
            assert set(idx.layers) == owners & set(live.layers)
            assert list(idx.rows) == list(range(len(idx.layers)))
            (tensor,) = [t for t in kc.kv_cache_tensors if t.layers[0].endswith("indexer.k_cache")]
            for e in idx.entries:
                assert tensor.layers[e.row] == e.name
                assert e.offset == tensor.offset + e.row * tensor.layer_stride
    n_total = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert sorted(covered) == list(range(n_total))


def test_fp8_ds_mla_page_sizes() -> None:
    cfg = _cfg("freq2")
    kv_caches, _, table = allocate_offline(cfg, kv_cache_dtype="fp8_ds_mla", num_blocks=4)
    _check_against_tensors(table, kv_caches)
    assert table.view(Role.MLA).bytes_per_token == 656
    assert table.view(Role.INDEXER_K).bytes_per_token == 132


def test_fully_masked_stage_has_no_indexer_pool() -> None:
    cfg = glm_dsa_config(9, index_topk_pattern="FFFSSSFFF")
    tables = build_offline(cfg, pp_size=3, num_blocks=4)
    assert tables[1].layers == (3, 4, 5)
    assert tables[1].view(Role.INDEXER_K) is None
    assert tables[0].view(Role.INDEXER_K).rows == (0, 1, 2)
    assert tables[2].view(Role.INDEXER_K).layers == (6, 7, 8)


def test_table_round_trips_through_dict() -> None:
    (t,) = build_offline(_cfg("pattern"), num_blocks=4)
    assert PageTable.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="malformed page table"):
        PageTable.from_dict({"rank": 0})


def test_bad_inputs_raise_layout_errors(tmp_path) -> None:
    with pytest.raises(LayoutError, match="no such file"):
        build_offline(tmp_path / "missing")
    with pytest.raises(LayoutError, match="pp size"):
        build_offline(_cfg("dense"), pp_size=7)
    with pytest.raises(LayoutError, match="index_topk_freq"):
        owning_layers(glm_dsa_config(4, index_topk_freq=0))


@pytest.mark.slow
@pytest.mark.parametrize("backend, block_size", [("CPU_MLA", 16), ("AMX_MLA", 32)])
def test_tables_from_a_real_cpu_engine(tiny_mla_dir, backend: str, block_size: int) -> None:
    """The runtime builder over the kv_caches of a real vLLM CPU engine (tiny MLA model, bf16), for each
    CPU MLA backend as users run it: CPU_MLA (block 16) everywhere, AMX_MLA (block 32) where AMX exists.
    The backend is requested and then checked: a vLLM that picks another one fails here."""
    from vllm_dsa_dev.harness.engines import cpu_has_amx

    if backend == "AMX_MLA" and not cpu_has_amx():
        pytest.skip("no AMX tiles on this CPU: vLLM runs AMX_MLA only where amx_tile exists")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    def probe(worker):
        from vllm_dsa_connector.connector.page_tables import build_from_kv_caches

        runner = worker.model_runner
        ctx = worker.vllm_config.compilation_config.static_forward_context
        kv_caches = {
            n: layer.kv_cache for n, layer in ctx.items() if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)
        }
        table = build_from_kv_caches(kv_caches, runner.kv_cache_config, worker.vllm_config.model_config.hf_config)
        backends = sorted({layer.get_attn_backend().get_name() for n, layer in ctx.items() if n in kv_caches})
        checks = []
        for v in table.views:
            pool = table.pools[v.pool]
            for e in v.entries:
                t = kv_caches[e.name]
                checks.append((t.data_ptr() == pool.base_ptr + e.offset,
                               t.stride(0) * t.element_size() == pool.block_stride,
                               t[0].numel() * t.element_size() == e.nbytes))
        return table.to_dict(), checks, backends

    llm = LLM(model=str(tiny_mla_dir), dtype="bfloat16", max_model_len=512, enforce_eager=True,
              attention_backend=backend, block_size=block_size)
    try:
        ((d, checks, backends),) = llm.collective_rpc(probe)
    finally:
        del llm
    assert backends == [backend], f"asked for {backend}, vLLM runs {backends}"
    table = PageTable.from_dict(d)
    assert table.block_size == block_size
    assert table.layers == (0, 1, 2, 3)
    assert table.view(Role.INDEXER_K) is None
    mla = table.view(Role.MLA)
    assert mla.layers == (0, 1, 2, 3) and mla.bytes_per_token == 1152  # 576 bf16 elements per token
    assert checks and all(all(c) for c in checks)


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
@pytest.mark.parametrize("dtype", ["auto", "fp8_ds_mla"])
def test_offline_table_equals_the_runtime_table_of_vllm_allocated_tensors(layout: str, dtype: str) -> None:
    """What ``vllm-dsa inspect`` predicts equals what a worker builds from vLLM's own allocation: pools in
    the same order (layer-name order, whatever order vLLM lists its tensors in), every offset, pointers aside.
    The H200 engine (LBNHC, indexer spec before MLA spec) showed the pools swapped before this held."""
    cfg = _cfg("freq2")
    _, _, runtime = allocate_offline(cfg, kv_cache_dtype=dtype, num_blocks=8, layout=layout)
    (offline,) = build_offline(cfg, kv_cache_dtype=dtype, num_blocks=8, layout=layout)

    def bare(t: PageTable) -> dict:
        d = t.to_dict()
        for p in d["pools"]:
            p.pop("base_ptr", None)
            p.pop("nbytes", None)
        return d

    assert bare(runtime) == bare(offline)
    if layout == "LBNHC":  # one pool per role; BLHNC keeps both roles in one pool
        assert offline.view(Role.MLA).pool == 0 and offline.view(Role.INDEXER_K).pool == 1
    assert [v.role for v in offline.views] == [Role.MLA, Role.INDEXER_K]
