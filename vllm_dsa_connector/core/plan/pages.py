"""The immutable page-table model of a KV cache, as a transfer sees it.

A ``PageTable`` describes one worker (one PP stage x TP rank): the memory pools it registers, and per role
(MLA latent, indexer K, plain attention KV) a ``PoolView`` listing, per layer, where that layer's page of
block ``b`` lives::

    address(entry, b) = pool.base_ptr + entry.offset + b * pool.block_stride

Everything else (matching, transport, connector) reads this model; nothing here knows about transports.
Global layer ids are model layer indices (identical on every PP stage); MTP/nextn layers continue after
the backbone (``>= num_hidden_layers``). Each class is one msgspec struct, the same in memory and in the
handshake payload (``core.handoff.wire.RankPayload`` carries the ``PageTable`` as is), every list and string
bounded while it is decoded (:data:`MAX_ENTRIES`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import msgspec

__all__ = ["MAX_ENTRIES", "LayerEntry", "MapperKind", "ModelId", "PageFormat", "PageTable", "Pool", "PoolView", "Role"]

#: Most entries of a page table's lists (pools, views, a view's layers, layer ids) a peer may send
MAX_ENTRIES = 4096
_Name = Annotated[str, msgspec.Meta(max_length=64)]  # a memory kind or dtype name
_Str = Annotated[str, msgspec.Meta(max_length=4096)]  # a layer or architecture name
_Ints = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


class Role(StrEnum):
    """What a view's bytes are; equal roles on both sides are what peers match."""

    MLA = "mla"  # MLA latent (kv_lora_rank + rope) per token
    INDEXER_K = "indexer_k"  # DSA indexer K: fp8 values + fp32 scale per token, block-split in a page
    KV = "kv"  # plain attention K/V (non-MLA models)


class MapperKind(StrEnum):
    """How a view's bytes relate across TP ranks."""

    REPLICATED = "replicated"  # identical on every TP rank (MLA latent, indexer K)
    INDEXED = "indexed"  # sharded by KV head across TP ranks


class PageFormat(StrEnum):
    """Byte order inside one page; peers must agree before bytes can be copied page for page."""

    TOKEN_ROWS = "token_rows"  # [block_size x bytes_per_token]
    BLOCK_SPLIT = "block_split"  # indexer: [block_size x 128 fp8][block_size x fp32 scale]


class Pool(msgspec.Struct, frozen=True):
    """One strided memory region: block ``b`` of an entry is at ``base_ptr + offset + b*block_stride``."""

    base_ptr: int
    nbytes: int  # size of the region to register (the backing allocation)
    block_stride: int
    num_blocks: int
    device: _Name = "cpu"


class LayerEntry(msgspec.Struct, frozen=True):
    """One layer's page inside a pool: where block 0 starts, how many bytes, its packed row."""

    global_layer: int
    name: _Str
    offset: int
    nbytes: int
    row: int


class PoolView(msgspec.Struct, frozen=True):
    """One role's pages of the layers of this stage that own that role, in one pool."""

    role: Role
    mapper: MapperKind
    pool: int
    entries: Annotated[tuple[LayerEntry, ...], msgspec.Meta(max_length=MAX_ENTRIES)]
    bytes_per_token: int
    page_format: PageFormat = PageFormat.TOKEN_ROWS

    @property
    def layers(self) -> tuple[int, ...]:
        """Global layer ids, in entry order."""
        return tuple(e.global_layer for e in self.entries)

    @property
    def rows(self) -> tuple[int, ...]:
        """Packed row of each layer (same order as ``layers``)."""
        return tuple(e.row for e in self.entries)

    @property
    def bytes_per_layer(self) -> int:
        """Page bytes of one layer (every entry of a view has the same page size)."""
        return self.entries[0].nbytes if self.entries else 0

    def entry(self, global_layer: int) -> LayerEntry | None:
        """The entry of one global layer, or None if this view does not hold it."""
        for e in self.entries:
            if e.global_layer == global_layer:
                return e
        return None


class ModelId(msgspec.Struct, frozen=True):
    """What must be identical between peers for page-for-page copies to be meaningful."""

    architecture: _Str
    num_hidden_layers: int
    num_mtp_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int  # 0 for models without an indexer
    index_topk_freq: int
    index_skip_topk_offset: int
    index_topk_pattern: _Str | None
    owning_layers: _Ints  # indexer-owning global layers of the whole model (incl. MTP)


class PageTable(msgspec.Struct, frozen=True):
    """The KV cache of one worker, as published to peers."""

    rank: int
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    block_size: int
    kv_cache_dtype: _Name
    model: ModelId
    layers: _Ints  # global attention layers held by this stage
    pools: Annotated[tuple[Pool, ...], msgspec.Meta(max_length=MAX_ENTRIES)]
    views: Annotated[tuple[PoolView, ...], msgspec.Meta(max_length=MAX_ENTRIES)] = ()

    def view(self, role: Role | str) -> PoolView | None:
        """The view of one role, or None (e.g. a fully masked stage has no indexer view)."""
        for v in self.views:
            if v.role == role:
                return v
        return None

    @property
    def owning_layers(self) -> tuple[int, ...]:
        """Indexer-owning global layers on this stage."""
        v = self.view(Role.INDEXER_K)
        return v.layers if v else ()

    @property
    def bytes_per_token(self) -> dict[str, int]:
        """Bytes per token of each role summed over this stage's layers."""
        return {v.role.value: v.bytes_per_token * len(v.entries) for v in self.views}

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds on this stage, all roles."""
        return sum(e.nbytes for v in self.views for e in v.entries)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able: lists, enum values) where a plain JSON object carries the table (the KV
        probe, the benches' table files); the handshake carries the struct itself."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PageTable:
        """Inverse of ``to_dict``; validates the shape and bounds and names what is missing."""
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"malformed page table from peer: {e}") from e
