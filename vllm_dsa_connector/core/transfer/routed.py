"""The connector's sending side: each writer's post follows the path the receiver chose for it.

The receiver (D) picks one path per (destination rank, source rank) pair when it registers a request and
arms its receive for that path; the writer follows it and never picks another (a path it cannot follow
fails the post with the reason, and the caller's failure notice tells D):

- ``direct``: one NIXL WRITE per part, ``dsa1:d<writer>:<tag>`` once every WRITE is DONE;
- ``bounce``: every part packed into ONE slot of the receiver's staging arena, one WRITE carrying
  ``dsa1:b<writer>:<tag>``;
- ``ipc`` (same host, CUDA pools): copies into this process's mapping of the receiver's pools
  (:meth:`RoutedTransport.map_peer`, opened once per peer), ``dsa1:i<writer>:<tag>`` once they are done.

Each path is one module of :mod:`.paths` behind one contract (:class:`~.paths.base.Path`); this class
owns what they share (the engine, the staging arena, the fences, the ipc mappings) and dispatches by the
path's :class:`~.paths.base.PathName`.

A writer may also push layer by layer (:mod:`.layered`): :meth:`RoutedTransport.open` the whole request's
parts, :meth:`RoutedTransport.add` each layer's runs as its attention ran, :meth:`RoutedTransport.close`;
the receiver sees the same notice and (bounce) the same packed slot as from one :meth:`RoutedTransport.post`.

No vLLM imports: the caller passes the route as plain values (``path``, and the slot for a bounce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer import layered
from vllm_dsa_connector.core.transfer.fence import Fences
from vllm_dsa_connector.core.transfer.ipc import IpcUnavailable, open_region
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.paths import ROUTE_PATHS, PathName
from vllm_dsa_connector.core.transfer.paths.base import LayeredPost, Path
from vllm_dsa_connector.core.transfer.paths.bounce import BouncePath
from vllm_dsa_connector.core.transfer.paths.direct import DirectPath
from vllm_dsa_connector.core.transfer.paths.ipc import IpcPath
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import DirectTransport, Part, Post, PostState

logger = logging.getLogger(__name__)

__all__ = ["RoutedTransport"]
class RoutedTransport:
    """Posts that follow their route: ``post(peer, parts, writer=, tag=, path=, slot=, deadline=)``.

    ``arena``: the local staging arena of bounced posts (``None``: a bounce route fails; this writer offered
    none); ``timeout_s``: a WRITE or copy still running after it is FAILED (a WRITE is released, i.e.
    aborted). ``reserve_timeout_s``: bounded wait for local staging space before a bounce fails.
    """

    def __init__(self, engine: NixlEngine, timeout_s: float = 30.0, *, arena: StagingArena | None = None,
                 reserve_timeout_s: float = 0.2, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.direct = DirectTransport(engine, timeout_s, clock)
        self.timeout_s = timeout_s
        self.clock = clock
        self.arena = arena
        self.reserve_timeout_s = reserve_timeout_s
        self.region = engine.register(arena.buffer) if arena is not None else None
        self.fences = Fences(engine, timeout_s, arena)  # connections with an aborted WRITE (:mod:`.fence`)
        self.direct.fences = self.fences
        self._maps: dict[str, list[torch.Tensor]] = {}  # peer agent -> its pools mapped here (ipc)
        self.paths: dict[str, Path] = {p.name: p for p in (DirectPath(self), BouncePath(self), IpcPath(self))}

    # -- ipc mappings ---------------------------------------------------------------------------------

    def map_peer(self, peer: str, exports: Sequence[Any], device: torch.device | str) -> None:
        """Open the peer's exported pools (``IpcDesc``, or their dicts, pool order) for kernels on ``device``, once per
        peer agent; :class:`~.ipc.IpcUnavailable` naming the pool when one cannot be opened here."""
        if peer in self._maps:
            return
        maps = []
        for i, desc in enumerate(exports):
            try:
                maps.append(open_region(desc, device))
            except IpcUnavailable as e:
                raise IpcUnavailable(f"pool {i} of peer {peer!r}: {e}") from None
        self._maps[peer] = maps

    def unmap_peer(self, peer: str) -> None:
        """Drop the mappings of ``peer`` (its engine restarted or was forgotten)."""
        self._maps.pop(peer, None)

    def mapped(self, peer: str) -> bool:
        """Whether the pools of ``peer`` are mapped here."""
        return peer in self._maps

    def mapping(self, peer: str) -> list[torch.Tensor] | None:
        """The pools of ``peer`` mapped here (pool order), ``None`` when not mapped."""
        return self._maps.get(peer)

    # -- posting -------------------------------------------------------------------------------------

    def post(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str = PathName.DIRECT,
             slot: StagingSlot | None = None, pools: Sequence[int] = (), deadline: float | None = None) -> Post:
        """Post one writer's ``parts`` along ``path``; raises only :class:`~.agent.PeerReconnecting` (nothing was
        posted: post again once the peer's reconnect is over), any other failure is ``post.error``.

        ``slot``: the receiver's staging slot of a bounce; ``pools``: for ipc, the receiver's pool index of
        each part (the mapping written into).
        """
        follow = self.paths.get(path)
        if follow is None:
            post = Post(peer, writer, tag, path, started=self.clock())
            post.error = (f"cannot follow the receiver's {path} route to {peer!r}: unknown path {path!r} "
                          f"(known: {', '.join(ROUTE_PATHS)})")
            post.state = PostState.FAILED
            return post
        return follow.post(peer, parts, writer=writer, tag=tag, slot=slot, pools=pools, deadline=deadline)

    # -- layer by layer (:mod:`.layered`) ------------------------------------------------------------

    def open(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes, path: str,
             slot: StagingSlot | None = None, pools: Sequence[int] = (),
             deadline: float | None = None) -> Post:
        """Open a layer-by-layer post of the WHOLE request's ``parts`` (as for :meth:`post`); nothing is
        written yet (a bounce reserves its whole packed size now). Never raises: FAILED with the reason."""
        return layered.open_post(self, peer, parts, writer=writer, tag=tag, path=path, slot=slot, pools=pools,
                                 deadline=deadline)

    def add(self, post: Post, layer_parts: Sequence[tuple[int, Runs]], *, deadline: float | None = None) -> None:
        """Post one layer's runs, ``(part index of the open, Runs)`` each, no notice; ``ValueError`` for
        runs outside the open's parts or an add after :meth:`close` (:func:`.layered.add_layer`)."""
        layered.add_layer(self, post, layer_parts, deadline=deadline)  # type: ignore[arg-type]

    def close(self, post: Post) -> None:
        """No more layers: :meth:`progress` sends the route's one notice once everything is DONE."""
        layered.close_post(self, post)  # type: ignore[arg-type]

    # -- progress ------------------------------------------------------------------------------------

    def progress(self, post: Post) -> bool:
        """Drive the post; ``True`` once it is over (``post.state`` DONE or FAILED). Never raises."""
        self.fences.poll()
        if post.state is not PostState.IN_FLIGHT:
            return True
        if isinstance(post, LayeredPost):
            return layered.progress(self, post)
        return self.paths[post.path].progress(post)

    def poll_fences(self) -> None:
        """Confirm posted fences (:class:`~.fence.Fences`); call while any is pending (:attr:`Fences.pending`)."""
        self.fences.poll()

    def notify(self, peer: str, writer: int, tag: bytes) -> None:
        """A notification ``dsa1:d<writer>:<tag>`` on its own (the caller's failure notice); as a fence after
        an aborted WRITE to ``peer`` (:mod:`.fence`)."""
        self.direct.notify(peer, writer, tag)
