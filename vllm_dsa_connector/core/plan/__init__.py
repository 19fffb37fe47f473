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
