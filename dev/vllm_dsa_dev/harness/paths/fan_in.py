"""The bounce receiver of the benches and transport tests: :class:`~.receiver.Receiver` plus slot reservation.

``BounceReceiver.expect(tag, dst, writers)`` checks EVERY writer's layout (:func:`check_fan_in`: bounds and
overlaps within and across writers) before it advertises slots, reserves ONE region of its arena for all
writers (fan-in; slot ``i`` at an ``align``-aligned offset), and arms the request; writers ``0..n-1``.
Everything after that (scatter after the data landed, pipelined chunks, ipc events, completion) is the
one :class:`~.receiver.Receiver`, the same code the connector receives with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.copy.local_copy import byte_view
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.receiver_data import WriterSpec
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot

logger = logging.getLogger(__name__)

__all__ = ["BounceReceiver", "LayoutError", "check_fan_in"]


class LayoutError(ValueError):
    """Writers' runs leave the destination or overlap each other; names the writer(s)."""


def check_fan_in(writers: Sequence[Runs], dst_size: int) -> None:
    """Safety check over EVERY writer's layout: in bounds, and no byte written twice (within or across)."""
    if not writers:
        return
    lens = [w.lengths for w in writers]
    starts = np.concatenate([w.dst_offsets for w in writers])
    lengths = np.concatenate(lens)
    owner = np.repeat(np.arange(len(writers)), [x.size for x in lens])
    keep = lengths > 0
    starts, lengths, owner = starts[keep], lengths[keep], owner[keep]
    if starts.size == 0:
        return
    ends = starts + lengths
    bad = np.flatnonzero(ends > dst_size)
    if bad.size:
        i = int(bad[0])
        raise LayoutError(
            f"writer {int(owner[i])}: run [{int(starts[i])}, {int(ends[i])}) is outside "
            f"the {dst_size}-byte destination"
        )
    order = np.argsort(starts, kind="stable")
    s, e, o = starts[order], ends[order], owner[order]
    hit = np.flatnonzero(s[1:] < np.maximum.accumulate(e)[:-1])
    if hit.size:
        j = int(hit[0]) + 1
        prev = int(np.argmax(e[:j] > s[j]))
        a, b = sorted((int(o[prev]), int(o[j])))
        who = f"writer {a}" if a == b else f"writers {a} and {b}"
        raise LayoutError(
            f"{who}: destination bytes [{int(s[j])}, {int(min(e[prev], e[j]))}) written twice"
        )


class BounceReceiver(Receiver):
    """Target side: reserve one fan-in region, advertise slots; the rest is :class:`Receiver`."""

    def __init__(self, engine: NixlEngine, arena: StagingArena, reserve_timeout_s: float = 0.2) -> None:
        super().__init__(engine, arena)
        self.arena: StagingArena = arena
        self.reserve_timeout_s = reserve_timeout_s

    def expect(
        self, tag: bytes, dst: torch.Tensor, writers: Sequence[Runs], *, bounce: bool = True
    ) -> list[StagingSlot | None]:
        """Register a request written by ``len(writers)`` writers into ``dst``; returns one slot per writer.

        A ``None`` slot means "write directly" (empty part, ``bounce=False``, or no arena space within
        the bounded wait). Raises :class:`LayoutError` when any writer's runs leave ``dst`` or overlap.
        """
        if tag in self._expected:
            raise ValueError(f"BounceReceiver.expect: tag {tag!r} is already expected")
        merged = [w.merged() for w in writers]
        check_fan_in(merged, byte_view(dst, "expect dst").numel())
        sizes = [self.arena.slots.aligned(m.total_bytes) for m in merged]
        total = sum(sizes)
        res = None
        if bounce and total > 0:
            res = self.arena.reserve(total, self.reserve_timeout_s)
            if res is None:
                logger.info("bounce: receiver arena has no %d B within %.2fs; writers go direct", total,
                            self.reserve_timeout_s)
        assert self.region is not None
        slots: list[StagingSlot | None] = []
        specs: dict[int, WriterSpec] = {}
        off = res.offset if res is not None else 0
        for i, (m, size) in enumerate(zip(merged, sizes, strict=True)):
            slot = StagingSlot(self.region.desc(), off, m.total_bytes) if res and size else None
            slots.append(slot)
            specs[i] = WriterSpec(dst=dst, runs=m, slot=(slot.offset, slot.size) if slot else None)
            off += size
        self.arm(tag, specs, reservation=res)
        return slots
