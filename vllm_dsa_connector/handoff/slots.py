"""D's staging slots: which (destination rank, source rank) pairs of a request are bounced, and where.

A bounced writer gathers its runs into its own arena, WRITEs them once into a slot of the receiver's
staging arena, and the receiver scatters them (:mod:`vllm_dsa_connector.transport`). D's scheduler owns
the slot bookkeeping (a torch-free :class:`~vllm_dsa_connector.transport.slots.SlotAllocator` per
destination rank; the bytes live in D's workers) and puts the slots in the registration, so P's workers
know where to write. A pair gets no slot (= a direct WRITE) when its runs do not fit one write, the
bounce gate prefers direct, or the arena has no room right now. After a failed transfer a slot is
quarantined until the consumer's bound says no WRITE can land in it any more (P's word, or give-up time +
P's write timeout + margin: :meth:`~vllm_dsa_connector.handoff.consumer.Consumer.writes_over_at`), then
:meth:`StagingSlots.step` hands it back; before that a late WRITE could still land in it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from vllm_dsa_connector.handoff.wire import RankPayload, Slots
from vllm_dsa_connector.transport.slots import Reservation, SlotAllocator

#: (destination rank, reservation) pairs a request holds until its transfer is over
Held = list[tuple[int, Reservation]]


def plan_slots(plan: Any, src: Sequence[RankPayload], dst: Sequence[RankPayload], src_blocks: Sequence[int],
               dst_blocks: Sequence[int], gate: Any, arenas: dict[int, SlotAllocator], *, first_token: int = 0,
               num_tokens: int | None = None) -> tuple[Slots, Held]:
    """Staging slots for one request: per (destination rank, source rank) pair the gate wants bounced.

    ``plan`` is the peer's ``matching.PeerPlan`` from the handshake (its runs come from tables decoded
    once; ``first_token``/``num_tokens`` the request's token span, as ``PeerPlan.runs`` takes it);
    ``arenas`` maps a destination rank to the allocator of its staging arena. Returns the slots and the
    reservations to free once the transfer is over.
    """
    slots: Slots = {}
    held: Held = []
    for d in dst:
        arena = arenas.get(d.rank)
        if arena is None or d.staging is None:
            continue
        for s in src:
            parts = plan.runs(s.rank, d.rank, list(src_blocks), list(dst_blocks), first_token=first_token,
                              num_tokens=num_tokens)
            if len(parts) != 1 or parts[0][2].total_bytes == 0 or gate.decide(parts[0][2], merged=True) != "bounce":
                continue
            res = arena.reserve(parts[0][2].total_bytes, 0.0)
            if res is None:
                continue
            slots.setdefault(d.rank, {})[s.rank] = [res.offset, parts[0][2].total_bytes]
            held.append((d.rank, res))
    return slots, held


class StagingSlots:
    """The slot bookkeeping of one consumer engine (built on first use, once the local payloads are known).

    ``bounce`` is the transport's ``BounceSettings`` (``None`` or mode ``never``: no slots, every WRITE is
    direct); ``local`` returns this engine's worker payloads (their staging arena sizes).
    """

    def __init__(self, bounce: Any, local: Callable[[], list[RankPayload]]) -> None:
        self.bounce = bounce
        self._local = local
        self._gate: Any = None
        self._arenas: dict[int, SlotAllocator] | None = None
        # (safe from, tie-break, rank, reservation): quarantined slots, at most one per live slot of an arena
        self._quarantine: list[tuple[float, int, int, Reservation]] = []
        self._seq = 0

    @property
    def enabled(self) -> bool:
        """Whether D offers staging slots (the gate is not off and the workers have staging arenas)."""
        if self.bounce is None or self.bounce.mode == "never":
            return False
        if self._arenas is None:
            from vllm_dsa_connector.transport.gate import BounceGate

            local = self._local()
            device = local[0].page_table["pools"][0].get("device", "cpu") if local else "cpu"
            self._gate = BounceGate(self.bounce, device=device)
            self._arenas = {p.rank: SlotAllocator(int(p.staging["size"])) for p in local if p.staging}
        return bool(self._arenas)

    def plan(self, plan: Any, src: Sequence[RankPayload], src_blocks: Sequence[int],
             dst_blocks: Sequence[int], *, first_token: int = 0,
             num_tokens: int | None = None) -> tuple[Slots, Held]:
        """Slots for one request from the peer ``src`` (none when disabled)."""
        if not self.enabled:
            return {}, []
        return plan_slots(plan, src, self._local(), src_blocks, dst_blocks, self._gate, self._arenas or {},
                          first_token=first_token, num_tokens=num_tokens)

    def free(self, held: Held, failed: bool, *, safe_at: float = math.inf) -> None:
        """The transfer is over: release its slots; when it failed, quarantine them until ``safe_at`` (from
        then no WRITE can land in them; ``inf``: never known, never reused) and let :meth:`step` return them."""
        for rank, res in held:
            arena = (self._arenas or {}).get(rank)
            if arena is None:
                continue
            if failed:  # a late WRITE could still land there: not before ``safe_at``
                arena.quarantine(res)
                if safe_at < math.inf:
                    self._seq += 1
                    heapq.heappush(self._quarantine, (safe_at, self._seq, rank, res))
            else:
                arena.release(res)

    def step(self, now: float) -> int:
        """Hand back the quarantined slots whose ``safe_at`` has come; returns how many."""
        n = 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, _, rank, res = heapq.heappop(self._quarantine)
            (self._arenas or {})[rank].restore(res)
            n += 1
        return n

    @property
    def quarantined(self) -> int:
        """Slots waiting for their ``safe_at`` (diagnostics, tests)."""
        return len(self._quarantine)
