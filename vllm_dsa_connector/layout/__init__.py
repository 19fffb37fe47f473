"""Page-table model of DSA/MLA KV caches (pools, roles, global layer ids, indexer masks, packed rows).

Public API::

    Role, MapperKind, PageFormat, Pool, LayerEntry, PoolView, ModelId, PageTable   # frozen data
    owning_layers(hf_config), layer_owns_indexer(i, hf_config), packed_rows(...)    # IndexCache rule
    build_from_kv_caches(kv_caches, kv_cache_config, hf_config, ...)  -> PageTable  # runtime builder
    build_offline(source, pp_size=, tp_size=, block_size=, kv_cache_dtype=) -> list[PageTable]
    allocate_offline(source, pp_rank=, ...) -> (kv_caches, kv_cache_config, PageTable)
    LayoutError                                                                      # bad model/layout

Address of block ``b`` of an entry: ``pool.base_ptr + entry.offset + b * pool.block_stride``.
No transport code here; the builders import vLLM lazily.
"""

from vllm_dsa_connector.layout.model import (
    LayerEntry,
    MapperKind,
    ModelId,
    PageFormat,
    PageTable,
    Pool,
    PoolView,
    Role,
)
from vllm_dsa_connector.layout.rules import (
    LayoutError,
    is_dsa,
    is_mla,
    layer_owns_indexer,
    model_id,
    owning_layers,
    packed_rows,
)

__all__ = [
    "LayerEntry", "LayoutError", "MapperKind", "ModelId", "PageFormat", "PageTable", "Pool", "PoolView",
    "Role", "allocate_offline", "build_from_kv_caches", "build_offline", "is_dsa", "is_mla",
    "layer_owns_indexer", "model_id", "owning_layers", "packed_rows",
]


def __getattr__(name: str):  # the builders import vLLM and torch: load them on first use
    if name in {"allocate_offline", "build_from_kv_caches", "build_offline", "load_hf_config",
                "stage_layers", "kv_cache_specs", "kv_cache_configs"}:
        from vllm_dsa_connector.layout import build

        return getattr(build, name)
    raise AttributeError(name)
