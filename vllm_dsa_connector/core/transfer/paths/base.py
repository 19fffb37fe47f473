"""The one contract of a transfer path (direct, bounce, ipc) and the post a path fills layer by layer.

A receiver (D) chooses one path per (destination rank, source rank) pair and arms its receive for it; the
writer (P) follows it through the path's object (:class:`Path`), never picking another. What every path
does, whatever moves the bytes:

- ``post``: one writer's whole ``parts`` in one go; what completes it on the receiver is ONE notice
  ``dsa1:<code><writer>:<tag>`` named after the path (:func:`~..notices.encode_notif` with the path's
  :class:`~vllm_dsa_connector.core.transfer.paths.PathName`; the receiver's :data:`~..receiver_data.COMPLETES`), sent by the path once every
  WRITE or copy is DONE (bounce: carried by its one WRITE);
- ``progress``: drives a post of ``post`` until it is DONE or FAILED (never raises);
- layer by layer (:mod:`..layered` drives it): ``open`` prepares a :class:`LayeredPost` of the whole
  request (bounce: reserves the packed slot; ipc: checks the mapping), ``add`` stages one layer's runs as
  :class:`LayerWork` (WRITEs to post once its CUDA event fired, or copies made), ``close`` records what the
  completion waits for beyond the WRITEs (ipc: an event behind every copy).

Invariant: a path object follows the route it is named for (:class:`~vllm_dsa_connector.core.transfer.paths.PathName`)
and only that one: it never picks another path; what it cannot follow is a FAILED post naming why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.fence import Fences
from vllm_dsa_connector.core.transfer.nixl.agent import PeerReconnecting
from vllm_dsa_connector.core.transfer.nixl.data import Region, RegionDesc
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import DirectTransport, Part, Post, PostState

__all__ = [
    "LayerPart",
    "LayerWork",
    "LayeredPost",
    "Located",
    "Path",
    "PathHost",
    "event_after",
    "follow",
    "settle_each",
]


class PathHost(Protocol):
    """What a path needs of the transport that owns it (:class:`~..routed.RoutedTransport` is one)."""

    engine: NixlEngine
    direct: DirectTransport
    arena: StagingArena | None
    region: Region | None
    timeout_s: float
    reserve_timeout_s: float
    clock: Callable[[], float]
    fences: Fences

    @property
    def paths(self) -> Mapping[str, Path]:
        """The host's path objects by :class:`~vllm_dsa_connector.core.transfer.paths.PathName`."""

    def mapping(self, peer: str) -> list[torch.Tensor] | None:
        """The peer's pools mapped here for ipc (``None``: not mapped)."""


@dataclass(eq=False)
class LayerPart:
    """One part of a layered post's open: where its bytes go, its whole merged runs and how much of each was
    added."""

    src: Region
    dst: RegionDesc | dict[str, Any]
    merged: Runs
    stage: np.ndarray  # start of each merged run inside the part's packed region (bounce)
    start: int = 0  # the part's packed region starts here in the slot (bounce)
    pool: int = -1  # the receiver's pool written into (ipc)
    got: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int64)
    )  # bytes added per merged run
    sent: int = 0  # merged runs whose packed bytes were written (bounce)
    added: tuple[np.ndarray, np.ndarray] = (
        field(  # source byte intervals added so far: sorted, disjoint
            default_factory=lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64))
        )
    )

    @property
    def complete(self) -> bool:
        """Whether every byte of the part was added."""
        return bool(np.array_equal(self.got, self.merged.lengths))


@dataclass(eq=False)
class LayerWork:
    """Work of one ``add`` waiting for its CUDA event (``None``: ready): WRITEs to post, or ipc copies."""

    event: Any
    writes: list[tuple[Region, RegionDesc | dict[str, Any], Runs]]
    deadline: float | None
    started: float
    copied: tuple[int, int] | None = (
        None  # ipc: (runs, bytes) copied, recorded as one TransferStats
    )


@dataclass(eq=False)
class LayeredPost(Post):
    """A post fed layer by layer (:mod:`..layered`); ``stats``: one TransferStats per WRITE / copy;
    ``seconds``: one span, from its close (the last layer added) or, on CUDA, the post of a layer whose kernels
    finished after the close (the CPU runs ahead of the device) to its last part's completion, i.e. the
    transfer time left after P's last layer was computed."""

    slot: StagingSlot | None = None
    deadline: float | None = None
    closed: bool = False
    _parts: list[LayerPart] = field(default_factory=list, repr=False)
    _res: Reservation | None = field(default=None, repr=False)
    _pending: list[LayerWork] = field(default_factory=list, repr=False)
    _close_event: Any = field(default=None, repr=False)
    _closed_at: float = field(default=0.0, repr=False)
    _poisoned: bool = field(
        default=False, repr=False
    )  # a failed WRITE or unfinished gather: quarantine


#: One layer's runs of one part, located: (part index of the open, the runs, the merged run each lies in)
Located = tuple[int, Runs, np.ndarray]


class Path(Protocol):
    """One transfer path (see the module docstring); a path object belongs to one :class:`PathHost`."""

    name: PathName

    def post(
        self,
        peer: str,
        parts: Sequence[Part],
        *,
        writer: int,
        tag: bytes,
        slot: StagingSlot | None,
        pools: Sequence[int],
        deadline: float | None,
    ) -> Post:
        """Post one writer's ``parts`` in one go; raises only :class:`~..agent.PeerReconnecting` (nothing was
        posted), any other failure is a FAILED post naming why. ``slot``: the receiver's staging slot
        (bounce); ``pools``: the receiver's pool of each part (ipc)."""

    def progress(self, post: Post) -> bool:
        """Drive a post of :meth:`post`; ``True`` once it is over (DONE or FAILED). Never raises."""

    def open(self, post: LayeredPost, pools: Sequence[int]) -> None:
        """Prepare a layered post of the whole request (its parts set); raises what makes it unfollowable."""

    def add(self, post: LayeredPost, located: Sequence[Located], deadline: float | None) -> None:
        """Stage one layer's runs: queue its :class:`LayerWork` on ``post._pending`` (and count the bytes
        in each part's ``got``); raises what fails."""

    def close(self, post: LayeredPost) -> None:
        """No more layers: record what the completion must wait for besides the WRITEs."""


def follow(post: Post, start: Callable[[], Any]) -> Post:
    """Start ``post``'s one piece of in-flight work (``start()``, tracked in ``post._inflight``): a path that
    cannot be followed fails the post naming why, never a crash; :class:`~..agent.PeerReconnecting` (nothing
    posted) propagates to the caller, who posts again after the reconnect."""
    try:
        post._inflight.append(start())
    except PeerReconnecting:
        raise
    except Exception as e:  # noqa: BLE001 - a path that cannot be followed fails the post, never a crash
        post.error = f"cannot follow the receiver's {post.path} route to {post.peer!r}: {e}"
        post.state = PostState.FAILED
    return post


def settle_each(post: Post, settle: Callable[[Post, Any], bool]) -> bool:
    """Drive every in-flight piece of ``post`` once (``settle``: ``True`` when it is over; raises what made it
    fail); ``True`` once none is left (the post DONE, or FAILED with the first error)."""
    remaining: list[Any] = []
    for x in post._inflight:
        try:
            if not settle(post, x):
                remaining.append(x)
        except Exception as e:  # noqa: BLE001 - a failed WRITE or copy fails the post
            post.error = post.error or str(e)
    post._inflight = remaining
    if remaining:
        return False
    post.state = PostState.FAILED if post.error else PostState.DONE
    return True


def event_after(tensors: Sequence[torch.Tensor]) -> Any:
    """A CUDA event recorded on the current stream of the first CUDA tensor (``None``: all on CPU)."""
    for t in tensors:
        if t.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            return ev
    return None
