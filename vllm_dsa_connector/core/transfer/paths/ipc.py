"""The ipc path (same host, CUDA pools): copies into this process's mapping of the receiver's pools.

One copy per part (:func:`~..local_copy.copy_runs`) into the receiver's pool mapped here through CUDA IPC
(:meth:`~..routed.RoutedTransport.map_peer`, once per peer), a CUDA event behind the copies, and
``dsa1:i<writer>:<tag>`` once it fired (polled from ``progress``, never waited on in a step). No WRITE
crosses the connection, so on a cold one the post stays IN_FLIGHT after the notice until it can be presumed
delivered (:meth:`~..agent.NixlAgent.notification_pending`). Layer by layer each layer's runs are copied as
they are added and the close records the event behind every copy; :mod:`..layered` sends the notice once it
fired.

Invariant: a copy that is late fails its post only once the copies are over (they write into the receiver's
blocks): the notice never goes before the event fired.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs
from vllm_dsa_connector.core.transfer.nixl.data import TransferError, TransferStats
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
from vllm_dsa_connector.core.transfer.staging import StagingSlot
from vllm_dsa_connector.core.transfer.transports import Part, Post, PostState, check_deadline

__all__ = ["IpcPath"]


@dataclass(eq=False)
class _Copied:
    """The copies of an ipc post: the event behind them and the notification to send once it fired."""

    event: Any
    notif: bytes
    num_runs: int
    total_bytes: int
    started: float = field(default_factory=time.perf_counter)
    sent: bool = (
        False  # the notification went out (it may still wait in the agent on a cold connection)
    )
    late: bool = False  # past the timeout: the post fails, once the copies are over (never before)


class IpcPath:
    """The ipc path of ``host`` (see the module docstring); the receiver's pools mapped by the host."""

    name = PathName.IPC

    def __init__(self, host: PathHost) -> None:
        self.host = host

    def _maps(self, peer: str, pools: Sequence[int], nparts: int) -> list[torch.Tensor]:
        maps = self.host.mapping(peer)
        if maps is None:
            raise TransferError("the receiver's pools are not mapped here", peer=peer)
        if len(pools) != nparts or any(not 0 <= q < len(maps) for q in pools):
            raise TransferError(
                f"pools {list(pools)} do not name {nparts} of the {len(maps)} mapped pools",
                peer=peer,
            )
        return maps

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
        """Copy every part into its mapped pool; the notice once the copies' event fired."""
        post = Post(peer, writer, tag, self.name, started=self.host.clock())
        return follow(post, lambda: self._start(peer, parts, writer, tag, pools, deadline))

    def _start(
        self,
        peer: str,
        parts: Sequence[Part],
        writer: int,
        tag: bytes,
        pools: Sequence[int],
        deadline: float | None,
    ) -> _Copied:
        maps = self._maps(peer, pools, len(parts))
        check_deadline(deadline, f"ipc copy to {peer!r}")
        nruns = nbytes = 0
        device = None
        for (src, _, runs), pool in zip(parts, pools, strict=True):
            merged = runs.merged()
            merged.check_bounds(
                src.size, maps[pool].numel(), what=f"ipc copy to pool {pool} of {peer!r}"
            )
            copy_runs(src.tensor, maps[pool], merged)
            nruns += merged.num_runs
            nbytes += merged.total_bytes
            device = src.tensor.device
        event = None
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return _Copied(event, encode_notif(self.name, writer, tag), nruns, nbytes)

    def progress(self, post: Post) -> bool:
        """The copies' event fired, the notice sent and presumed delivered."""
        return settle_each(post, self._settle)

    def _settle(self, post: Post, x: _Copied) -> bool:
        host = self.host
        now = host.clock()
        if x.sent:
            return not host.engine.notification_pending(post.peer)
        if x.event is not None and not x.event.query():
            if now - x.started >= host.timeout_s and not x.late:
                x.late = True  # fails the post, but only once the copies are over: they write into D's blocks
                post.error = (
                    post.error or f"ipc copy to {post.peer!r} not done after {host.timeout_s} s"
                )
            return False
        if x.late:
            raise TransferError(post.error, peer=post.peer)
        x.sent = host.engine.send_notification(post.peer, x.notif)
        post.completed(TransferStats(x.num_runs, x.total_bytes, now - x.started, 0), now)
        return not x.sent

    # -- layer by layer --------------------------------------------------------------------------------

    def open(self, post: LayeredPost, pools: Sequence[int]) -> None:
        """Check the mapping and each part's bounds in its pool."""
        maps = self._maps(post.peer, pools, len(post._parts))
        for p, q in zip(post._parts, pools, strict=True):
            p.merged.check_bounds(
                p.src.size, maps[q].numel(), what=f"ipc copy to pool {q} of {post.peer!r}"
            )
            p.pool = q

    def add(self, post: LayeredPost, located: Sequence[Located], deadline: float | None) -> None:
        """Copy this layer's runs into the mapped pools now; counted once their event fired."""
        now = self.host.clock()
        srcs = [post._parts[idx].src.tensor for idx, *_ in located]
        maps = self.host.mapping(post.peer)
        if maps is None:
            raise TransferError("the receiver's pools are no longer mapped here", peer=post.peer)
        nruns = nbytes = 0
        for idx, runs, k in located:
            p = post._parts[idx]
            copy_runs(p.src.tensor, maps[p.pool], runs)
            np.add.at(p.got, k, runs.lengths)
            nruns, nbytes = nruns + runs.num_runs, nbytes + runs.total_bytes
        if nbytes:
            post._pending.append(LayerWork(event_after(srcs), [], deadline, now, (nruns, nbytes)))

    def close(self, post: LayeredPost) -> None:
        """A CUDA event behind every copy, recorded now: the notice waits for it."""
        if post.state is PostState.IN_FLIGHT:
            post._close_event = event_after([p.src.tensor for p in post._parts])
