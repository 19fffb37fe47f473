"""Descriptor lists prepared once (NixlConnector style): the handles behind ``NixlEngine.prepare_*``.

A :class:`~.nixl_data.PreparedList` names a region's entries (offsets, lengths); its NIXL handle is made once and
reused for every WRITE that picks entries of it (``NixlEngine.write_prepared``). A peer's lists belong to one
connection: after a reconnect the engine asks :meth:`PreparedLists.reprepare` to make their handles again.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_dsa_connector.core.transfer.nixl.data import PreparedList, TransferError

logger = logging.getLogger(__name__)

__all__ = ["LOCAL_AGENT", "PreparedLists", "descriptors"]

#: NIXL's name for this agent's own side of a descriptor list
LOCAL_AGENT = "NIXL_INIT_AGENT"


def descriptors(base: int, offsets: np.ndarray, lengths: np.ndarray, dev: int) -> np.ndarray:
    """NIXL's ``(address, length, device)`` rows for the byte runs ``offsets``/``lengths`` of a region at ``base``."""
    arr = np.empty((offsets.size, 3), np.uint64)
    arr[:, 0] = offsets + base
    arr[:, 1] = lengths
    arr[:, 2] = dev
    return arr


class PreparedLists:
    """The prepared lists of one NIXL agent (``agent``: the raw ``nixl_agent``), per peer for reconnects."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self._remote: dict[str, list[PreparedList]] = {}  # peer -> its live prepared lists

    def prepare(self, owner: str, addr: int, size: int, mem: str, dev: int, offsets: Any,
                lengths: Any) -> PreparedList:
        """A list over ``[addr, addr + size)`` of ``owner`` (:data:`LOCAL_AGENT` or a peer); entries checked."""
        offs = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        lens = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if offs.shape != lens.shape or offs.size == 0:
            raise ValueError("prepare: offsets and lengths must be non-empty and of equal length")
        if offs.min() < 0 or lens.min() <= 0 or int((offs + lens).max()) > size:
            raise ValueError(f"prepare: entries must lie inside the {size}-byte region")
        plist = PreparedList(owner, offs, lens, _region=(addr, mem, dev))
        self.remake(plist)
        if owner != LOCAL_AGENT:
            self._remote.setdefault(owner, []).append(plist)
        return plist

    def remake(self, plist: PreparedList) -> None:
        """(Re)make ``plist``'s NIXL handle from its entries (the old handle, if any, is released)."""
        assert plist._region is not None
        addr, mem, dev = plist._region
        if plist._handle is not None:
            try:
                self.agent.release_dlist_handle(plist._handle)
            except Exception as e:  # a handle of the old connection: NIXL may have dropped it already
                logger.debug("release dlist of %s: %s", plist.agent, e)
            plist._handle = None
        try:
            plist._handle = self.agent.prep_xfer_dlist(plist.agent, descriptors(addr, plist.offsets, plist.lengths,
                                                                                dev), mem)
        except Exception as e:
            raise TransferError(f"prepare for {plist.agent!r} failed: {e}", peer=plist.agent) from e

    def reprepare(self, peer: str) -> None:
        """``peer`` was reconnected: its lists' handles belonged to the old connection."""
        for plist in self._remote.get(peer, []):
            self.remake(plist)

    def forget(self, peer: str) -> None:
        """``peer`` was removed: its lists are no longer tracked."""
        self._remote.pop(peer, None)

    def release(self, plist: PreparedList) -> None:
        """Free a prepared list (no transfer may still use it)."""
        lists = self._remote.get(plist.agent)
        if lists is not None and plist in lists:
            lists.remove(plist)
        if plist._handle is not None:
            self.agent.release_dlist_handle(plist._handle)
            plist._handle = None
