"""Two builders, one model: page tables from a live worker's tensors, or offline from a config.

(a) ``build_from_kv_caches``: what a connector's ``register_kv_caches`` receives. Tensors are strided
    views into one shared buffer; only ``data_ptr()``, ``stride(0)`` and page bytes are trusted, never
    dict order or contiguity.
(b) ``build_offline`` / ``allocate_offline``: from a HF config + parallel sizes, through vLLM's own code
    (``get_pp_indices``, ``MLAAttentionSpec``, ``get_kv_cache_configs`` through
    :mod:`vllm_dsa_connector.compat`, ``allocate_kv_cache``), so the two builders agree by construction
    (tests check they do).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vllm_dsa_connector.core.plan.pages import (
    LayerEntry,
    MapperKind,
    PageFormat,
    PageTable,
    Pool,
    PoolView,
    Role,
)
from vllm_dsa_connector.core.plan.rules import (
    LayoutError,
    is_dsa,
    is_mla,
    model_id,
    num_mtp_layers,
    owning_layers,
    packed_rows,
)

INDEXER_SUFFIX = ".indexer.k_cache"
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")


def layer_of(name: str) -> int:
    """Global layer id of a vLLM layer name (``model.layers.{i}.self_attn...``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return extract_layer_index(name)
    except (AssertionError, ValueError) as e:
        raise LayoutError(f"cannot read a layer index from KV cache layer name {name!r}") from e


def role_of(name: str, spec: Any) -> tuple[Role, MapperKind, PageFormat]:
    """Role, mapper and page format of one KV cache layer."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if name.endswith(INDEXER_SUFFIX):
        return Role.INDEXER_K, MapperKind.REPLICATED, PageFormat.BLOCK_SPLIT
    if isinstance(spec, MLAAttentionSpec):
        return Role.MLA, MapperKind.REPLICATED, PageFormat.TOKEN_ROWS
    return Role.KV, MapperKind.INDEXED, PageFormat.TOKEN_ROWS


class _PlacedLayer(NamedTuple):
    """Where one KV cache layer's page sits, as both builders find it (the input of :func:`_assemble`)."""

    name: str  # vLLM's layer name
    role: Role
    mapper: MapperKind
    page_format: PageFormat
    layer: int  # global layer id
    pool: int  # index into the table's pools
    offset: int  # bytes from the pool's base to this layer's page in block 0
    page_bytes: int  # bytes of one block's page of this layer


def _layer_specs(kv_cache_config: Any) -> tuple[dict[str, Any], int]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    specs: dict[str, Any] = {}
    block_sizes = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            s = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            specs[name] = s
            block_sizes.add(s.block_size)
    if len(block_sizes) != 1:
        raise LayoutError(f"expected one block size across KV cache groups, got {sorted(block_sizes)}")
    return specs, block_sizes.pop()


def _assemble(
    hf_config: Any,
    placed: list[_PlacedLayer],
    pools: list[Pool],
    *,
    block_size: int,
    kv_cache_dtype: str,
    rank: int,
    pp_rank: int,
    pp_size: int,
    tp_rank: int,
    tp_size: int,
) -> PageTable:
    """Common tail of both builders: one view per role over the ``placed`` layers."""
    owners = owning_layers(hf_config)
    layers = tuple(sorted({p.layer for p in placed if p.role != Role.INDEXER_K}))
    idx_layers = {p.layer for p in placed if p.role == Role.INDEXER_K}
    expected = set(layers) & set(owners)
    if is_dsa(hf_config) and idx_layers != expected:
        raise LayoutError(
            f"stage {pp_rank}: indexer caches exist for layers {sorted(idx_layers)} but the model's "
            f"IndexCache rule gives owning layers {sorted(expected)}"
        )
    rows_by_role = {
        Role.INDEXER_K: packed_rows(layers, owners),
        Role.MLA: {g: i for i, g in enumerate(layers)},
        Role.KV: {g: i for i, g in enumerate(layers)},
    }
    views = []
    for role in (Role.MLA, Role.INDEXER_K, Role.KV):
        mine = sorted((p for p in placed if p.role == role), key=lambda p: p.layer)
        if not mine:
            continue  # e.g. a fully masked stage: no indexer view at all
        pool_ids = {p.pool for p in mine}
        pages = {p.page_bytes for p in mine}
        if len(pool_ids) != 1 or len(pages) != 1:
            raise LayoutError(
                f"{role.value} layers span pools {sorted(pool_ids)} with page sizes {sorted(pages)}; "
                "expected one pool and one page size per role"
            )
        page = pages.pop()
        if page % block_size:
            raise LayoutError(f"{role.value} page of {page} B is not a multiple of block {block_size}")
        entries = tuple(
            LayerEntry(global_layer=p.layer, name=p.name, offset=p.offset, nbytes=p.page_bytes,
                       row=rows_by_role[role][p.layer])
            for p in mine
        )
        views.append(
            PoolView(
                role=role,
                mapper=mine[0].mapper,
                pool=pool_ids.pop(),
                entries=entries,
                bytes_per_token=page // block_size,
                page_format=mine[0].page_format,
            )
        )
    return PageTable(
        rank=rank,
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        model=model_id(hf_config),
        layers=layers,
        pools=tuple(pools),
        views=tuple(views),
    )


def build_from_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    kv_cache_config: Any,
    hf_config: Any,
    *,
    kv_cache_dtype: str = "auto",
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    rank: int | None = None,
) -> PageTable:
    """Page table of a live worker from the ``kv_caches`` a connector receives."""
    specs, block_size = _layer_specs(kv_cache_config)
    pool_index: dict[tuple[int, int], int] = {}
    pools: list[Pool] = []
    placed: list[_PlacedLayer] = []
    for name in sorted(kv_caches):
        if name not in specs:
            continue  # e.g. cross-group aliases vLLM adds; we only describe spec'd layers
        t = kv_caches[name]
        if t.dim() < 2 or not t[0].is_contiguous():
            raise LayoutError(f"{name}: a page (one block) must be contiguous, got strides {t.stride()}")
        esize = t.element_size()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.stride(0) * esize)
        if key not in pool_index:
            pool_index[key] = len(pools)
            pools.append(
                Pool(
                    base_ptr=key[0],
                    nbytes=storage.nbytes(),
                    block_stride=key[1],
                    num_blocks=t.shape[0],
                    device=t.device.type,
                )
            )
        role, mapper, fmt = role_of(name, specs[name])
        page = t[0].numel() * esize
        placed.append(_PlacedLayer(name, role, mapper, fmt, layer_of(name), pool_index[key],
                                   t.data_ptr() - key[0], page))
    if not placed:
        raise LayoutError("no KV cache layers to describe (kv_caches and kv_cache_config share no names)")
    return _assemble(
        hf_config, placed, pools, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        rank=pp_rank * tp_size + tp_rank if rank is None else rank,
        pp_rank=pp_rank, pp_size=pp_size, tp_rank=tp_rank, tp_size=tp_size,
    )


# ---------------------------------------------------------------- offline (vLLM's own spec/alloc code)


def load_hf_config(source: str | Path | Any) -> Any:
    """A HF config from a model directory, a config.json path, or a config object (returned as is)."""
    if not isinstance(source, str | Path):
        return source
    from vllm.transformers_utils.config import get_config

    path = Path(source)
    if not path.exists():
        raise LayoutError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise LayoutError(f"{path}: no config.json in this directory")
    with tempfile.TemporaryDirectory(prefix="vllm-dsa-cfg-") as tmp:
        if path.is_file():  # vLLM loads configs from a directory
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise LayoutError(f"{path}: not valid JSON ({e})") from e
            (Path(tmp) / "config.json").write_text(json.dumps(data))
            path = Path(tmp)
        try:
            return get_config(str(path), trust_remote_code=False)
        except (ValueError, KeyError, OSError) as e:
            raise LayoutError(f"{source}: cannot load the model config ({e})") from e


def stage_layers(hf_config: Any, pp_rank: int, pp_size: int) -> tuple[int, ...]:
    """Global layers of one PP stage (vLLM's ``get_pp_indices``); MTP layers sit on the last stage."""
    from vllm.distributed.utils import get_pp_indices

    n = hf_config.num_hidden_layers
    if pp_size < 1 or pp_size > n:
        raise LayoutError(f"pp size {pp_size} must be between 1 and the model's {n} layers")
    start, end = get_pp_indices(n, pp_rank, pp_size)
    layers = list(range(start, end))
    if pp_rank == pp_size - 1:
        layers += list(range(n, n + num_mtp_layers(hf_config)))
    return tuple(layers)


def _model_dtype(hf_config: Any) -> torch.dtype:
    d = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "bfloat16"
    if isinstance(d, torch.dtype):
        return d
    return {"float32": torch.float32, "float16": torch.float16}.get(str(d), torch.bfloat16)


def kv_cache_specs(
    hf_config: Any, layers: tuple[int, ...], *, block_size: int, kv_cache_dtype: str
) -> dict[str, Any]:
    """The KV cache spec of each layer exactly as vLLM's MLA and indexer-cache layers declare them."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

    from vllm_dsa_connector.compat import dataclass_has_field

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise LayoutError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if not is_mla(hf_config):
        raise LayoutError(
            f"{getattr(hf_config, 'model_type', '?')}: not an MLA/DSA model (no kv_lora_rank/qk_rope_head_dim)"
        )
    if kv_cache_dtype.startswith("fp8"):
        dtype = torch.uint8
    elif kv_cache_dtype == "bfloat16":
        dtype = torch.bfloat16
    else:
        dtype = _model_dtype(hf_config)
    head = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    owners = set(owning_layers(hf_config))
    idx_head = getattr(hf_config, "index_head_dim", 128)
    # vLLM 0.33's sparse MLA layers declare the width of the shared top-k buffer (index_topk
    # columns for V3.2/GLM-5); it takes part in spec equality, not in page sizes.
    sparse_extra: dict[str, Any] = {}
    if is_dsa(hf_config) and dataclass_has_field(MLAAttentionSpec, "topk_buffer_width"):
        sparse_extra["topk_buffer_width"] = int(hf_config.index_topk)
    specs: dict[str, Any] = {}
    for i in layers:
        # vLLM registers a layer's indexer K cache before its MLA attention (DeepseekV2MLAAttention builds
        # its Indexer first), and the KV cache tensors follow that order: the offsets predicted here
        # match an engine's only in the same order.
        if i in owners:
            specs[f"model.layers.{i}{'.self_attn'}{INDEXER_SUFFIX}"] = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=idx_head + idx_head // 128 * 4,
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head,
            dtype=dtype,
            cache_dtype_str=kv_cache_dtype,
            kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_cache_dtype),
            is_index_group_leader=i in owners,
            **sparse_extra,
        )
    return specs


def _vllm_config(hf_config: Any, block_size: int, layout: str, tmp: Path) -> Any:
    """A real VllmConfig for ``hf_config`` (written to ``tmp``, which vLLM reads it from)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    (tmp / "config.json").write_text(hf_config.to_json_string())
    mc = ModelConfig(model=str(tmp), skip_tokenizer_init=True, max_model_len=block_size, dtype=_model_dtype(hf_config))
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size))
    # The CPU platform forces block 16 for its MLA kernels; offline tables describe the target's layout.
    vc.cache_config.block_size = block_size
    vc.cache_config.kv_cache_layout = layout
    return vc


def kv_cache_configs(
    source: str | Path | Any,
    *,
    pp_size: int = 1,
    block_size: int = 64,
    kv_cache_dtype: str = "auto",
    num_blocks: int = 64,
    layout: str | None = None,
) -> tuple[Any, list[Any]]:
    """(hf_config, one vLLM ``KVCacheConfig`` per PP stage) from vLLM's grouping/allocation planning."""
    from vllm_dsa_connector.compat import get_kv_cache_configs

    hf_config = load_hf_config(source)
    if block_size < 1 or num_blocks < 1:
        raise LayoutError(f"block size and number of blocks must be positive ({block_size}, {num_blocks})")
    layout = layout or ("BLHNC" if is_dsa(hf_config) else "LBNHC")
    specs = [
        kv_cache_specs(hf_config, stage_layers(hf_config, r, pp_size), block_size=block_size,
                       kv_cache_dtype=kv_cache_dtype)
        for r in range(pp_size)
    ]
    per_block = [sum(s.page_size_bytes for s in st.values()) for st in specs]
    with tempfile.TemporaryDirectory(prefix="vllm-dsa-model-") as tmp:
        vc = _vllm_config(hf_config, block_size, layout, Path(tmp))
        try:
            configs = get_kv_cache_configs(vc, specs, [num_blocks * pb for pb in per_block])
        except ValueError as e:
            raise LayoutError(f"vLLM cannot plan {num_blocks} blocks for this model: {e}") from e
    return hf_config, configs


def _table_from_config(hf_config: Any, kc: Any, **ranks: Any) -> PageTable:
    specs, block_size = _layer_specs(kc)
    entries = [(name, t, li) for t in kc.kv_cache_tensors for li, name in enumerate(t.layers)]
    # Pools are numbered in layer-name order, as build_from_kv_caches numbers them on a live worker
    # (vLLM's tensor order is its own: a layer's indexer spec before its MLA spec).
    entries.sort(key=lambda e: e[0])
    pool_index: dict[int, int] = {}
    pools: list[Pool] = []
    placed: list[_PlacedLayer] = []
    for name, t, li in entries:
        if t.block_stride not in pool_index:
            pool_index[t.block_stride] = len(pools)
            pools.append(Pool(base_ptr=0, nbytes=t.size, block_stride=t.block_stride,
                              num_blocks=kc.num_blocks_of(t)))
        role, mapper, fmt = role_of(name, specs[name])
        page = specs[name].page_size_bytes
        placed.append(_PlacedLayer(name, role, mapper, fmt, layer_of(name), pool_index[t.block_stride],
                                   t.offset + li * t.layer_stride, page))
    return _assemble(hf_config, placed, pools, block_size=block_size, **ranks)


def build_offline(
    source: str | Path | Any,
    *,
    pp_size: int = 1,
    tp_size: int = 1,
    block_size: int = 64,
    kv_cache_dtype: str = "auto",
    num_blocks: int = 64,
    layout: str | None = None,
) -> list[PageTable]:
    """Page tables of every rank (rank = pp_rank * tp_size + tp_rank), base pointers 0."""
    if tp_size < 1:
        raise LayoutError(f"tp size must be >= 1, got {tp_size}")
    hf_config, configs = kv_cache_configs(
        source, pp_size=pp_size, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        num_blocks=num_blocks, layout=layout,
    )
    return [
        _table_from_config(
            hf_config, configs[pp], kv_cache_dtype=kv_cache_dtype, rank=pp * tp_size + tp,
            pp_rank=pp, pp_size=pp_size, tp_rank=tp, tp_size=tp_size,
        )
        for pp in range(pp_size)
        for tp in range(tp_size)
    ]


def allocate_offline(
    source: str | Path | Any,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    block_size: int = 64,
    kv_cache_dtype: str = "auto",
    num_blocks: int = 64,
    layout: str | None = None,
) -> tuple[dict[str, torch.Tensor], Any, PageTable]:
    """Allocate one worker's KV cache on CPU with vLLM's ``allocate_kv_cache``; return its page table.

    The table comes from the runtime builder over the allocated tensors, exactly as a connector sees it.
    """
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    hf_config, configs = kv_cache_configs(
        source, pp_size=pp_size, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        num_blocks=num_blocks, layout=layout,
    )
    kc = configs[pp_rank]
    lay = KVCacheLayout[layout or ("BLHNC" if is_dsa(hf_config) else "LBNHC")]
    kv_caches = allocate_kv_cache(kc, torch.device("cpu"), lay)
    table = build_from_kv_caches(
        kv_caches, kc, hf_config, kv_cache_dtype=kv_cache_dtype, pp_rank=pp_rank, pp_size=pp_size,
        tp_rank=tp_rank, tp_size=tp_size,
    )
    return kv_caches, kc, table
