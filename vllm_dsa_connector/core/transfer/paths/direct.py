"""The direct path: every part as its own NIXL WRITE of the merged runs, then ``dsa1:d<writer>:<tag>``.

In one go it is the host's :class:`~..transports.DirectTransport` (the notice once every WRITE is DONE);
layer by layer each layer's runs of a part go out as one WRITE once the kernels that computed them
finished (:func:`~.base.event_after`), without a notice: :mod:`..layered` sends the one notice at the end.
Invariant: nothing is staged; the WRITEs read P's pools directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_dsa_connector.core.plan.runs import merge_runs
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.paths.base import (
    LayeredPost,
    LayerWork,
    Located,
    PathHost,
    event_after,
)
from vllm_dsa_connector.core.transfer.staging import StagingSlot
from vllm_dsa_connector.core.transfer.transports import Part, Post

__all__ = ["DirectPath"]


class DirectPath:
    """The direct path of ``host`` (see the module docstring)."""

    name = PathName.DIRECT

    def __init__(self, host: PathHost) -> None:
        self.host = host

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
        """One WRITE per part, all posted now (:meth:`~..transports.DirectTransport.post`)."""
        return self.host.direct.post(peer, parts, writer=writer, tag=tag, deadline=deadline)

    def progress(self, post: Post) -> bool:
        """The WRITEs completed, then the notice (:meth:`~..transports.DirectTransport.progress`)."""
        return self.host.direct.progress(post)

    def open(self, post: LayeredPost, pools: Sequence[int]) -> None:
        """Nothing to prepare: each layer's WRITEs read P's pools."""

    def add(self, post: LayeredPost, located: Sequence[Located], deadline: float | None) -> None:
        """One WRITE per part of this layer's runs, queued behind the kernels that computed them."""
        now = self.host.clock()
        writes = []
        for idx, runs, k in located:
            p = post._parts[idx]
            writes.append(
                (p.src, p.dst, merge_runs(runs.src_offsets, runs.dst_offsets, runs.lengths))
            )
            np.add.at(p.got, k, runs.lengths)
        srcs = [post._parts[idx].src.tensor for idx, *_ in located]
        post._pending.append(LayerWork(event_after(srcs), writes, deadline, now))

    def close(self, post: LayeredPost) -> None:
        """Nothing beyond the WRITEs."""
