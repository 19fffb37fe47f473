"""The sending side's interface (:class:`Transport`, :class:`Post`) and its direct path (:class:`DirectTransport`).

The connector posts through :class:`~.routed.RoutedTransport`, which follows each pair's route and uses
:class:`DirectTransport` for the direct one; the benches' bounce sender adds its own paths on the same
interface (``vllm_dsa_dev.harness.paths``).

A caller describes one writer's part of a request as ``parts``: ``[(local Region, remote region, Runs)]``
(one per pool pair), and calls every transport the same way::

    post = transport.post(peer, parts, writer=rank, tag=tag, slot=slot_or_None, deadline=t_or_None)
    while not transport.progress(post): ...      # from the engine's loop; never raises
    post.state, post.error, post.stats           # DONE or FAILED, why, the WRITEs' TransferStats
    post.seconds                                 # the post to its last part's completion (one span)

The receiver (:class:`~.receiver.Receiver`) learns of the writer through ONE ``dsa1:`` notification
carrying ``tag``, whatever the path: the direct transport sends ``dsa1:d<writer>:<tag>`` on its own once
every WRITE is DONE (NIXL's DONE means the data landed; a notification riding on the WRITE would make its
completion wait for the TARGET to progress), a bounce's one WRITE into the receiver's staging slot carries
``dsa1:b<writer>:<tag>``, an ipc copy's notification ``dsa1:i<writer>:<tag>`` follows once the copy is done. A failure is never notified by the transport: the caller decides what
its failure notice says (:meth:`Transport.notify`) once :meth:`progress` reports FAILED, i.e. once no part
of the post is in flight any more.

Sent on a connection that has not carried a completed message yet, a notification is untracked by NIXL and
leaves only while the sender's agent progresses (:mod:`.agent`): the post then stays IN_FLIGHT, each
:meth:`~Transport.progress` progressing the agent, until :data:`~.agent.NOTIFY_FLUSH_S` passed
(:meth:`~.agent.NixlAgent.notification_pending`), so the caller keeps driving it; :meth:`~Transport.notify`
progresses for that window itself (no later call would).

``deadline`` (``time.monotonic()``): no WRITE is posted at or after it. It is checked before each WRITE,
after any wait for staging space, and again by :meth:`~.engine.NixlEngine.write` immediately before every
post attempt (after a reconnect, which can take seconds), so a post that waited past it fails
(``post.error`` says so) instead of writing into blocks the receiver may have given back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.nixl.agent import PeerReconnecting
from vllm_dsa_connector.core.transfer.nixl.data import (
    Region,
    RegionDesc,
    Transfer,
    TransferError,
    TransferStats,
)
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.staging import StagingSlot

if TYPE_CHECKING:
    from vllm_dsa_connector.core.transfer.fence import Fences

logger = logging.getLogger(__name__)

__all__ = ["DirectTransport", "Part", "Post", "PostState", "Transport", "check_deadline"]

Part = tuple[Region, "RegionDesc | dict[str, Any]", Runs]


def check_deadline(deadline: float | None, what: str) -> None:
    """:class:`TransferError` when ``deadline`` (``time.monotonic()``) has passed: ``what`` must not be posted."""
    if deadline is not None and (now := time.monotonic()) >= deadline:
        raise TransferError(f"{what}: post deadline passed {now - deadline:.3f} s ago; not writing")


class PostState(Enum):
    """Where one writer's post stands."""

    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class Post:
    """One writer's part of a request, posted: the handle every transport returns.

    ``path`` is what was used (``"direct"`` / ``"bounce"``, or the bounce sender's fallback); ``stats`` the
    completed WRITEs; ``error`` why it FAILED (the first failure). ``started`` is the post (the transport's
    clock; a layer-by-layer post: its close, when its last layer was added) and ``finished`` when its last
    part (WRITE or copy) was seen complete (0.0: none yet): :attr:`seconds` is the post's one span, however
    many parts it has.
    """

    peer: str
    writer: int
    tag: bytes
    path: str
    state: PostState = PostState.IN_FLIGHT
    error: str = ""
    stats: list[TransferStats] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0
    _inflight: list[Any] = field(default_factory=list, repr=False)  # the path's handles (Transfer for direct)
    _notify: bool = field(default=False, repr=False)  # send dsa1:d<writer>:<tag> once all parts are DONE
    _noticed: bool = field(default=False, repr=False)  # its completion notice was sent (may still be flushing)
    _dst: Any = field(default=None, repr=False)  # a region of the peer its WRITEs go to (what a fence READs)

    def completed(self, stats: TransferStats, now: float) -> None:
        """One part (a WRITE or a copy) was seen complete at ``now`` (the transport's clock)."""
        self.stats.append(stats)
        self.finished = max(self.finished, now)

    @property
    def seconds(self) -> float | None:
        """From the post to its last part's completion (``None``: no part completed): one span per post, i.e.
        per (request, destination rank), whatever the route and however many parts (pools, layers) it had."""
        return max(0.0, self.finished - self.started) if self.finished else None


class Transport(Protocol):
    """What a connector calls to move one writer's part of a request (see the module docstring)."""

    def post(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes,
             slot: StagingSlot | None = None, deadline: float | None = None) -> Post:
        """Post every part before ``deadline``; never raises (a failure to post is ``post.error``, the posted
        parts stay tracked)."""

    def progress(self, post: Post) -> bool:
        """Drive the post; ``True`` once it is over (``post.state`` DONE or FAILED). Never raises."""

    def notify(self, peer: str, writer: int, tag: bytes) -> None:
        """A notification ``dsa1:d<writer>:<tag>`` on its own (e.g. the caller's failure notice); on a cold
        connection it progresses until the notification can be presumed delivered (see the module docstring)."""


class DirectTransport:
    """Every part as its own NIXL WRITE of the merged runs; one notification once all are DONE.

    ``timeout_s``: a WRITE still in flight after it is aborted (released) and the post FAILED; with
    ``fences`` (:class:`~.fence.Fences`) its connection is fenced by the next :meth:`notify` to that peer.
    """

    path: str = PathName.DIRECT

    def __init__(self, engine: NixlEngine, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.perf_counter, *, fences: Fences | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.clock = clock
        self.fences = fences

    def post(self, peer: str, parts: Sequence[Part], *, writer: int, tag: bytes,
             slot: StagingSlot | None = None, deadline: float | None = None) -> Post:
        """Post every part at once (a multi-part post never blocks a step), none at or after ``deadline``.
        :class:`~.agent.PeerReconnecting` when the first part met a lost connection (nothing was posted)."""
        post = Post(peer, writer, tag, self.path, started=self.clock(), _notify=True,
                    _dst=parts[0][1] if parts else None)
        for src, dst, runs in parts:  # a part that fails to post leaves the posted ones tracked
            try:
                check_deadline(deadline, f"post to {peer!r}")
                post._inflight.append(self.engine.write(peer, src, dst, runs, deadline=deadline))
            except PeerReconnecting as e:
                if not post._inflight:  # nothing posted: the caller posts it again after the reconnect
                    raise
                post.error = str(e)
                break
            except Exception as e:  # noqa: BLE001 - a failed post is a failed transfer, never a crash
                post.error = str(e)
                break
        return post

    def progress(self, post: Post) -> bool:
        """Complete the WRITEs that are DONE, ERR or past the timeout; notify once all are DONE."""
        if post.state is not PostState.IN_FLIGHT:
            return True
        now = self.clock()
        remaining = []
        for x in post._inflight:
            t = self.transfer_of(x)
            st = self.engine.state(t)
            if st == "PROC" and now - t.started < self.timeout_s:
                remaining.append(x)
                continue
            try:  # DONE, ERR or past the write timeout (then released, i.e. aborted)
                post.completed(self._wait(x), self.clock())
            except TransferError as e:
                post.error = post.error or str(e)
                if st == "PROC" and self.fences is not None and post._dst is not None:
                    self.fences.aborted(post.peer, post._dst)  # its bytes may still land: fence first
        post._inflight = remaining
        if remaining:
            return False
        if not post.error and post._notify and not post._noticed:
            post._noticed = True
            try:
                self.engine.send_notification(post.peer, encode_notif(PathName.DIRECT, post.writer, post.tag))
            except Exception as e:  # noqa: BLE001 - the receiver gives up after its timeout instead
                logger.warning("transport: completion notification to %r not sent: %s", post.peer, e)
        if self.engine.notification_pending(post.peer):
            return False  # on a cold connection: keep progressing until it can be presumed delivered
        post.state = PostState.FAILED if post.error else PostState.DONE
        return True

    def transfer_of(self, x: Any) -> Transfer:
        """The NIXL WRITE behind one handle of a post (here the handle is the WRITE)."""
        return x

    def _wait(self, x: Any) -> TransferStats:
        return self.engine.wait(self.transfer_of(x), self.timeout_s)

    def notify(self, peer: str, writer: int, tag: bytes) -> None:
        """``dsa1:d<writer>:<tag>`` on its own, progressed until it can be presumed delivered (a failure
        notice: no later call progresses it). After an aborted WRITE to ``peer`` it goes as a fence
        (:class:`~.fence.Fences`): it arrives only once no byte of that WRITE can land any more."""
        if self.fences is not None and self.fences.needed(peer):
            self.fences.send(peer, encode_notif(PathName.DIRECT, writer, tag))
            return
        self.engine.send_notification(peer, encode_notif(PathName.DIRECT, writer, tag))
        self.engine.flush_notifications(peer)
