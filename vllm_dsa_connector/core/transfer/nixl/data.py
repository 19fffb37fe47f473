"""What the NIXL engine hands out and takes: region descriptions, transfers, their stats and errors.

Plain data (no NIXL import): :class:`RegionDesc` travels in handshakes (a msgspec struct, as is),
:class:`Region` is a local registered tensor, :class:`Transfer` an in-flight WRITE, :class:`TransferStats`
its completion record, :class:`PreparedList` a descriptor list prepared once; :class:`TransferError`
names the peer and the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

__all__ = ["PreparedList", "Region", "RegionDesc", "Transfer", "TransferError", "TransferStats", "metadata_agent_name"]


class TransferError(RuntimeError):
    """A transfer failed, timed out, or its peer is unknown/gone. ``peer`` and ``transfer`` name it."""

    def __init__(
        self, message: str, *, peer: str | None = None, transfer: str | None = None
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.transfer = transfer


#: Bounds of a region description from a peer (an agent name as long as any id of the side channel)
_AgentName = Annotated[str, msgspec.Meta(max_length=512)]
_MemKind = Annotated[str, msgspec.Meta(max_length=64)]


class RegionDesc(msgspec.Struct, frozen=True):
    """A registered region as a peer sees it: the one type in memory and in the handshake (``RankPayload``
    carries it as is, its strings bounded while decoding); ``to_dict``/``from_dict`` only where a plain JSON
    object carries it (the benches' control channel)."""

    agent: _AgentName
    addr: int
    size: int
    mem: _MemKind  # "DRAM" | "VRAM"
    dev: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (ints and strings only)."""
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, d: RegionDesc | dict[str, Any]) -> RegionDesc:
        """Inverse of :meth:`to_dict` (a ``RegionDesc`` passes through); ``ValueError`` naming the field."""
        if isinstance(d, RegionDesc):
            return d
        try:
            return msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid region description {d!r}: {e}") from None


@dataclass(eq=False)
class Region:
    """A local registered tensor (kept alive here while registered)."""

    tensor: Any
    addr: int
    size: int
    mem: str
    dev: int
    agent: str
    _reg: Any = field(default=None, repr=False)

    def desc(self) -> RegionDesc:
        """What to send to peers."""
        return RegionDesc(self.agent, self.addr, self.size, self.mem, self.dev)


@dataclass(frozen=True)
class TransferStats:
    """Completion record; ``desc_count`` etc. only with ``telemetry=True`` (else -1)."""

    num_runs: int
    total_bytes: int
    seconds: float
    desc_count: int = -1
    post_us: int = -1
    xfer_us: int = -1


@dataclass(eq=False)
class Transfer:
    """An in-flight WRITE returned by :meth:`NixlEngine.write`; pass it to :meth:`NixlEngine.wait`."""

    name: str
    peer: str
    num_runs: int
    total_bytes: int
    started: float
    _xfer: Any = field(default=None, repr=False)
    _dlists: tuple[Any, ...] = field(default=(), repr=False)
    stats: TransferStats | None = None
    _error: str = field(default="", repr=False)  # what NIXL raised when its state was read (ERR)
    _conn: int = field(default=0, repr=False)  # the engine's connection to the peer it was posted on


@dataclass(eq=False)
class PreparedList:
    """A descriptor list prepared once (``prep_xfer_dlist``); transfers pick entries by index.

    ``offsets``/``lengths`` are the entries (relative to the region); NIXL merges entries picked in a
    row that are contiguous on both sides, as it does for vLLM's per-block lists.
    """

    agent: str  # "NIXL_INIT_AGENT" for local lists, else the peer's name
    offsets: np.ndarray
    lengths: np.ndarray
    _handle: Any = field(default=None, repr=False)
    # (addr, mem, dev) of the region: a peer's list is prepared again after a reconnect to that peer
    _region: tuple[int, str, int] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Number of entries."""
        return int(self.lengths.size)


#: How NIXL's agent metadata begins: its serializer's header, the ``Agent`` tag, an 8-byte little-endian length,
#: then the agent's name (``nixlAgent.get_agent_metadata``)
_MD_AGENT_TAG = b"nixlSerDes|Agent"


def metadata_agent_name(meta: bytes) -> str | None:
    """The agent name NIXL's metadata ``meta`` carries (what ``add_remote_agent`` would load it as), or None
    when ``meta`` is not in the layout this NIXL writes (empty, truncated, another serializer)."""
    if not meta.startswith(_MD_AGENT_TAG) or len(meta) < len(_MD_AGENT_TAG) + 8:
        return None
    start = len(_MD_AGENT_TAG) + 8
    size = int.from_bytes(meta[len(_MD_AGENT_TAG):start], "little")
    if size > len(meta) - start:
        return None
    try:
        return meta[start:start + size].decode()
    except UnicodeDecodeError:
        return None
