"""A GPU region exported through CUDA IPC as its owner describes it to a peer: one msgspec struct.

:class:`IpcDesc` is the type in memory and on the wire (the handshake payload carries it as is; the
benches' JSON channel through ``to_dict``/``from_dict``): the CUDA handles hex-encoded, every string
bounded while it is decoded. Torch-free, so the side channel's wire types can name it;
:mod:`.ipc` exports and opens the regions. Invariant: a handle is only used as bytes through
:meth:`IpcDesc.handles`, which refuses one that is not hex.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = ["IpcDesc"]

_Ident = Annotated[str, msgspec.Meta(max_length=512)]  # a host id or GPU UUID
_Hex = Annotated[str, msgspec.Meta(max_length=1024)]  # a CUDA IPC handle, hex-encoded


class IpcDesc(msgspec.Struct, frozen=True):
    """An exported GPU region as a peer sees it (handles hex-encoded: :meth:`handles` gives the bytes)."""

    host: _Ident
    uuid: _Ident
    size: int  # bytes of the region
    offset: int  # byte offset of the region in its storage
    handle: _Hex
    storage_size: int
    storage_offset: int
    ref_counter_handle: _Hex
    ref_counter_offset: int
    event_handle: _Hex
    event_sync_required: bool

    def handles(self) -> tuple[bytes, bytes, bytes]:
        """The storage, reference-counter and event handles as bytes; ``ValueError`` naming a bad one."""
        try:
            return (
                bytes.fromhex(self.handle),
                bytes.fromhex(self.ref_counter_handle),
                bytes.fromhex(self.event_handle),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid IPC region description: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (ints, bools and hex strings) for a JSON channel."""
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: IpcDesc | dict[str, Any]) -> IpcDesc:
        """Inverse of :meth:`to_dict` (an ``IpcDesc`` passes through); ``ValueError`` naming the problem."""
        if isinstance(d, IpcDesc):
            return d
        try:
            desc = msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid IPC region description: {e}") from None
        desc.handles()
        return desc
