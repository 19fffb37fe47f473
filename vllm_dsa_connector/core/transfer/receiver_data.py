"""The receiver's plain data: what :meth:`~.receiver.Receiver.arm` takes, what it reports, the hooks it calls.

:class:`WriterSpec` (one writer of an armed request; :meth:`WriterSpec.for_bounce` builds a bounced writer's
slot layout, the same :func:`~.runs.packed_parts` the sender packs with), :data:`COMPLETES` (which
notification completes a writer of each route), the states (:class:`WriterState` of a writer,
:class:`RecvState` of a settled request, in :class:`RecvResult`) and the caller's hooks
(:class:`ReceiveHooks`, :class:`Verdict`, the default :class:`PlainTags`). Kept apart from the state machine
(:mod:`.receiver`) so that a caller building specs or reading results reads only this; all of it is
importable from :mod:`.receiver` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch

from vllm_dsa_connector.core.plan.runs import Runs, packed_parts
from vllm_dsa_connector.core.transfer.paths import PathName

__all__ = ["COMPLETES", "PlainTags", "ReceiveHooks", "RecvResult", "RecvState", "Verdict", "WriterSpec", "WriterState"]


class WriterState(Enum):
    """Where one writer of a request stands on the receiver."""

    EXPECTED = "expected"
    PARTIAL = "partial"
    LANDED = "landed"
    FAILED = "failed"
    CORRUPT = "corrupt"



class RecvState(Enum):
    """How a request ended on the receiver (``WAITING`` while armed)."""

    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    CORRUPT = "corrupt"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class Verdict(Enum):
    """What :meth:`ReceiveHooks.admit` makes of a writer's notification."""

    ACCEPT = "accept"
    IGNORE = "ignore"
    FAIL = "fail"


class ReceiveHooks(Protocol):
    """What a caller tells the receiver about its tags (see the module docstring)."""

    def split(self, tag: bytes) -> tuple[bytes, Any] | None:
        """``(request key, payload)`` of a notification's tag; ``None`` when malformed (ignored)."""

    def admit(self, context: Any, writer: int, payload: Any) -> tuple[Verdict, str]:
        """Accept, ignore or fail a writer's notification (with the reason)."""

    def landed(self, context: Any, writer: int, payload: Any) -> bool:
        """Check a writer's landed bytes; ``False`` marks it CORRUPT."""


class PlainTags:
    """Default hooks: the tag is the key, no payload, every notification accepted, no check."""

    def split(self, tag: bytes) -> tuple[bytes, Any] | None:
        """The tag itself, no payload."""
        return tag, None

    def admit(self, context: Any, writer: int, payload: Any) -> tuple[Verdict, str]:
        """Always accepted."""
        return Verdict.ACCEPT, ""

    def landed(self, context: Any, writer: int, payload: Any) -> bool:
        """Always fine."""
        return True


@dataclass(frozen=True, eq=False)
class WriterSpec:
    """One writer of an armed request.

    ``peer``: the only NIXL agent whose notifications count for this writer (``None``: any). A writer that
    may bounce has its ``slot`` (offset, size) in the receiver's staging buffer, the ``dst`` tensor and the
    ``runs`` to scatter into it (merged, the order the sender packed); ``error`` says why it cannot be
    scattered when that is known at arming time (a bounced write then fails the writer). A bounced writer
    of several parts (pool pairs) names them in ``parts`` instead: ``(dst tensor, runs, offset in the
    slot)`` each, the layout of :func:`~.runs.packed_parts` (:meth:`for_bounce`).
    """

    peer: str | None = None
    dst: torch.Tensor | None = None
    runs: Runs | None = None
    slot: tuple[int, int] | None = None
    error: str = ""
    parts: tuple[tuple[torch.Tensor, Runs, int], ...] = ()
    path: PathName | None = None  # the route the receiver chose; None: any path

    @classmethod
    def for_bounce(cls, peer: str | None, slot: tuple[int, int],
                   parts: Sequence[tuple[torch.Tensor, Runs]]) -> WriterSpec:
        """A bounced writer into ``slot`` (offset, size) of ``parts`` (``(dst tensor, runs)`` per pool pair, in
        the sender's order): each part's runs merged and placed at :func:`~.runs.packed_parts`'s offsets, the
        layout the sender packs (``RoutedTransport``). When they need more than the slot holds (or there are
        none) the spec carries that as its ``error`` and no parts: a bounced write then fails the writer."""
        merged, offsets, total = packed_parts([runs for _, runs in parts])
        if not parts or total > slot[1]:
            return cls(peer=peer, slot=slot, path=PathName.BOUNCE,
                       error=f"its parts need {total} B, the slot holds {slot[1]} B")
        return cls(peer=peer, slot=slot, path=PathName.BOUNCE,
                   parts=tuple((dst, r, off) for (dst, _), r, off in zip(parts, merged, offsets, strict=True)))


#: The notification kinds that complete a writer of each route (:class:`WriterSpec` ``path``); any other kind
#: fails the writer. A failure notice (the caller's ``admit`` says FAIL) counts whatever its kind.
COMPLETES: dict[str, frozenset[str]] = {
    PathName.DIRECT: frozenset({PathName.DIRECT}),
    PathName.BOUNCE: frozenset({PathName.BOUNCE, "pipelined"}),  # "pipelined": the benches' chunked bounce
    PathName.IPC: frozenset({PathName.IPC}),
}


@dataclass(frozen=True)
class RecvResult:
    """A settled request: its key, how it ended and why, what it was armed with."""

    key: bytes
    state: RecvState
    reason: str
    waited_s: float
    missing: tuple[int, ...]  # writers not final (TIMED_OUT / CANCELLED)
    context: Any = None
