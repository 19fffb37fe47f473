"""The bounce path: a writer's parts gathered into ONE staging slot of the receiver, one WRITE.

Every part is packed back to back at the offsets of :func:`~..runs.packed_offsets` (each part in its merged
run order) in a reservation of the local staging arena, then written into the receiver's slot
(``[slot.offset, slot.offset + size)`` of its arena) in one WRITE that carries ``dsa1:b<writer>:<tag>``;
the receiver scatters each part from the same offsets (:func:`~..runs.packed_parts`). Layer by layer the
whole packed size is reserved at the open, each layer's runs are gathered at their packed positions and the
newly complete prefix of each part's packed region is written to the same offsets of the slot (no notice:
:mod:`..layered` sends it at the end), so the receiver sees the same slot either way.

Invariant: the local reservation goes back to the arena only once no WRITE can read it any more (released
after its WRITE completed; after an aborted one, held by the fences until the connection is fenced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dsa_connector.core.plan.runs import Runs, merge_runs, packed_offsets
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs, gather, sync
from vllm_dsa_connector.core.transfer.nixl.data import Transfer, TransferError
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.paths.base import (
    LayeredPost,
    LayerWork,
    Located,
    PathHost,
    event_after,
    follow,
    settle_each,
)
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingSlot
from vllm_dsa_connector.core.transfer.transports import Part, Post, check_deadline

__all__ = ["BouncePath"]


@dataclass(eq=False)
class _Bounced:
    """The one WRITE of a bounced post and the local staging it was gathered into."""

    transfer: Transfer
    res: Reservation | None
    remote: Any = None  # the receiver's slot region (what a fence READs)


class BouncePath:
    """The bounce path of ``host`` (see the module docstring); needs the host's staging arena."""

    name = PathName.BOUNCE

    def __init__(self, host: PathHost) -> None:
        self.host = host

    def _check(self, peer: str, slot: StagingSlot | None) -> StagingSlot:
        if self.host.arena is None or self.host.region is None:
            raise TransferError(
                "this writer has no staging arena (bounce_mode=never here)", peer=peer
            )
        if slot is None:
            raise TransferError("the receiver named a bounce without a staging slot", peer=peer)
        return slot

    def _reserve(
        self, peer: str, slot: StagingSlot, sizes: list[int]
    ) -> tuple[list[int], int, Reservation]:
        """The packed offsets of parts of ``sizes``, their total and a local reservation of it."""
        arena = self.host.arena
        assert arena is not None
        offsets, total = packed_offsets(sizes)
        if total > slot.size:
            raise TransferError(
                f"its slot holds {slot.size} B, the parts need {total} B", peer=peer
            )
        res = arena.reserve(total, self.host.reserve_timeout_s)
        if res is None:
            raise TransferError(
                f"no {total} B free in the local staging arena within "
                f"{self.host.reserve_timeout_s} s ({arena.free_bytes} B free)",
                peer=peer,
            )
        return offsets, total, res

    # -- in one go -------------------------------------------------------------------------------------

    def post(
        self,
        peer: str,
        parts: Sequence[Part],
        *,
        writer: int,
        tag: bytes,
        slot: StagingSlot | None = None,
        pools: Sequence[int] = (),
        deadline: float | None = None,
    ) -> Post:
        """Gather every part into one reservation, one WRITE into ``slot`` carrying the notice."""
        post = Post(peer, writer, tag, self.name, started=self.host.clock())
        return follow(post, lambda: self._start(peer, parts, writer, tag, slot, deadline))

    def _start(
        self,
        peer: str,
        parts: Sequence[Part],
        writer: int,
        tag: bytes,
        slot: StagingSlot | None,
        deadline: float | None,
    ) -> _Bounced:
        slot = self._check(peer, slot)
        arena, region = self.host.arena, self.host.region
        assert arena is not None and region is not None
        merged = [runs.merged() for _, _, runs in parts]
        offsets, total, res = self._reserve(peer, slot, [r.total_bytes for r in merged])
        try:
            view = arena.view(res)
            for (src, _, _), runs, off in zip(parts, merged, offsets, strict=True):
                gather(src.tensor, runs, view[off:])
            sync(arena.buffer)
            check_deadline(deadline, f"bounce to {peer!r}")
            one = Runs(np.array([res.offset]), np.array([slot.offset]), np.array([total]))
            return _Bounced(
                self.host.engine.write(
                    peer,
                    region,
                    slot.region,
                    one,
                    encode_notif(self.name, writer, tag),
                    deadline=deadline,
                ),
                res,
                slot.region,
            )
        except BaseException:
            arena.release(res)  # nothing was posted from it
            raise

    def progress(self, post: Post) -> bool:
        """The one WRITE completed (its reservation released) or failed (held until fenced)."""
        return settle_each(post, self._settle)

    def _settle(self, post: Post, x: _Bounced) -> bool:
        host = self.host
        st = host.engine.state(x.transfer)
        if st == "PROC" and host.clock() - x.transfer.started < host.timeout_s:
            return False
        try:
            post.completed(host.engine.wait(x.transfer, host.timeout_s), host.clock())
        except BaseException:
            if st == "PROC" and x.remote is not None:
                host.fences.aborted(post.peer, x.remote)  # its bytes may still land: fence first
            if x.res is not None and host.arena is not None:
                host.fences.hold(post.peer, x.res)  # the WRITE may still read it: until fenced
                x.res = None
            raise
        if x.res is not None and host.arena is not None:
            host.arena.release(x.res)
            x.res = None
        return True

    # -- layer by layer --------------------------------------------------------------------------------

    def open(self, post: LayeredPost, pools: Sequence[int]) -> None:
        """Reserve the whole packed size now; each part's packed region as the one-go bounce lays it out."""
        slot = self._check(post.peer, post.slot)
        offsets, _, post._res = self._reserve(
            post.peer, slot, [p.merged.total_bytes for p in post._parts]
        )
        for p, off in zip(post._parts, offsets, strict=True):
            p.start = off

    def add(self, post: LayeredPost, located: Sequence[Located], deadline: float | None) -> None:
        """Gather this layer's runs at their packed positions; queue the WRITE of each part's newly complete
        packed prefix (up to its first merged run not fully gathered) to the same offsets of the slot."""
        host = self.host
        now = host.clock()
        srcs = [post._parts[idx].src.tensor for idx, *_ in located]
        assert (
            host.arena is not None
            and host.region is not None
            and post._res is not None
            and post.slot is not None
        )
        base = post._res.offset
        for idx, runs, k in located:  # gather at the packed positions of the whole request's layout
            p = post._parts[idx]
            packed = base + p.start + p.stage[k] + (runs.src_offsets - p.merged.src_offsets[k])
            copy_runs(p.src.tensor, host.arena.buffer, Runs(runs.src_offsets, packed, runs.lengths))
            np.add.at(p.got, k, runs.lengths)
        local, remote, lens = [], [], []
        for p in post._parts:  # the newly complete prefix of each part's packed region
            done = p.got[p.sent :] == p.merged.lengths[p.sent :]
            front = p.sent + (int(np.argmin(done)) if not done.all() else done.size)
            if front == p.sent:
                continue
            a = int(p.stage[p.sent])
            b = int(p.stage[front]) if front < p.merged.num_runs else p.merged.total_bytes
            local.append(base + p.start + a)
            remote.append(post.slot.offset + p.start + a)
            lens.append(b - a)
            p.sent = front
        if lens:
            one = merge_runs(local, remote, lens)
            post._pending.append(
                LayerWork(
                    event_after([host.arena.buffer, *srcs]),
                    [(host.region, post.slot.region, one)],
                    deadline,
                    now,
                )
            )

    def close(self, post: LayeredPost) -> None:
        """Nothing beyond the WRITEs."""
