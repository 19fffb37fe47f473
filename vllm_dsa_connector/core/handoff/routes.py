"""D's routes: the one place the path of each (destination rank, source rank) pair of a request is chosen.

D chooses when it registers the request, and P follows (:mod:`vllm_dsa_connector.core.transfer.routed`):

1. ``ipc`` when D's rank exported its pools (CUDA, ``ipc_mode`` not ``never``), P's rank runs on the same host
   (``RankPayload.host``) and can reach D's GPU (``RankPayload.reach``): one copy kernel per part, no NIXL WRITE.
2. ``bounce`` when the bounce gate (one cost model: :meth:`BounceGate.decision_for` on the runs and bytes of
   every part of the pair together) prefers it and D's staging arena has room for the parts packed back to
   back (:func:`~vllm_dsa_connector.core.plan.runs.packed_offsets`): P gathers them, WRITEs once, D scatters.
3. otherwise direct (no route named): one NIXL WRITE per part.

D's scheduler owns the slot bookkeeping (a torch-free :class:`~vllm_dsa_connector.core.transfer.slots.SlotAllocator`
per destination rank; the bytes live in D's workers). After a failed transfer a slot is quarantined until the
consumer's bound says no WRITE can land in it any more (P's word, or give-up time + P's write timeout + margin:
:meth:`~vllm_dsa_connector.core.handoff.consumer.Consumer.writes_over_at`), then :meth:`RoutePlanner.step` hands it
back; before that a late WRITE could still land in it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm_dsa_connector.core.handoff.wire import RankPayload, Route, Routes
from vllm_dsa_connector.core.plan.runs import packed_offsets
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.slots import Reservation, SlotAllocator

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
    from vllm_dsa_connector.core.transfer.gate import BounceGate
    from vllm_dsa_connector.core.transfer.gate_options import BounceSettings

#: (destination rank, reservation) pairs a request holds until its transfer is over
Held = list[tuple[int, Reservation]]


def ipc_reachable(src: RankPayload, dst: RankPayload) -> bool:
    """Whether ``src`` can write ``dst``'s pools through CUDA IPC: ``dst`` exported them, both run on one
    host, and ``dst``'s GPU is one ``src`` reaches (its own, or a peer it has access to)."""
    return bool(dst.ipc) and bool(src.host) and src.host == dst.host and bool(dst.gpu) and dst.gpu in src.reach


def plan_routes(plan: PeerPlan, src: Sequence[RankPayload], dst: Sequence[RankPayload], src_blocks: Sequence[int],
                dst_blocks: Sequence[int], gate: BounceGate | None, arenas: dict[int, SlotAllocator], *,
                first_token: int = 0,
                num_tokens: int | None = None, ipc: bool = True) -> tuple[Routes, Held]:
    """The routes of one request: per (destination rank, source rank) pair with bytes to move.

    ``plan`` is the peer's ``core.plan.peer_plan.PeerPlan`` from the handshake (``first_token``/``num_tokens`` the
    request's token span, as ``PeerPlan.runs`` takes it); ``gate`` the bounce gate (``None``: no bounce);
    ``arenas`` maps a destination rank to the allocator of its staging arena; ``ipc``: whether D allows the
    ipc path. Returns the routes and the slot reservations to free once the transfer is over.
    """
    routes: Routes = {}
    held: Held = []
    for d in dst:
        arena = arenas.get(d.rank) if d.staging is not None else None
        for s in src:
            if ipc and ipc_reachable(s, d):
                routes.setdefault(d.rank, {})[s.rank] = Route(PathName.IPC)
                continue
            if arena is None or gate is None:
                continue
            parts = [r.merged() for _, _, r in plan.runs(s.rank, d.rank, list(src_blocks), list(dst_blocks),
                                                          first_token=first_token, num_tokens=num_tokens)]
            _, total = packed_offsets([r.total_bytes for r in parts])
            if total == 0:
                continue
            if gate.decision_for(sum(r.num_runs for r in parts), sum(r.total_bytes for r in parts)).path != PathName.BOUNCE:
                continue
            res = arena.reserve(total, 0.0)
            if res is None:
                continue
            routes.setdefault(d.rank, {})[s.rank] = Route(PathName.BOUNCE, res.offset, total)
            held.append((d.rank, res))
    return routes, held


class RoutePlanner:
    """The routes and slot bookkeeping of one consumer engine (built on first use, once the local payloads
    are known).

    ``bounce`` is the transport's ``BounceSettings`` (``None`` or mode ``never``: no slots, no bounce);
    ``local`` returns this engine's worker payloads (their staging arena sizes, their ipc exports);
    ``ipc``: whether the ipc path may be chosen (``ipc_mode``).
    """

    def __init__(self, bounce: BounceSettings | None, local: Callable[[], list[RankPayload]], *,
                 ipc: bool = True) -> None:
        self.bounce = bounce
        self.ipc = ipc
        self._local = local
        self._gate: BounceGate | None = None  # built with the arenas, on first use
        self._arenas: dict[int, SlotAllocator] | None = None
        # (safe from, tie-break, rank, reservation): quarantined slots, at most one per live slot of an arena
        self._quarantine: list[tuple[float, int, int, Reservation]] = []
        self._seq = 0

    @property
    def bouncing(self) -> bool:
        """Whether D offers staging slots (the gate is not off and the workers have staging arenas)."""
        if self.bounce is None or self.bounce.mode == "never":
            return False
        if self._arenas is None:
            from vllm_dsa_connector.core.transfer.gate import BounceGate

            local = self._local()
            device = local[0].page_table.pools[0].device if local else "cpu"
            self._gate = BounceGate(self.bounce, device=device)
            self._arenas = {p.rank: SlotAllocator(p.staging.size) for p in local if p.staging}
        return bool(self._arenas)

    def plan(self, plan: PeerPlan, src: Sequence[RankPayload], src_blocks: Sequence[int],
             dst_blocks: Sequence[int], *, first_token: int = 0, num_tokens: int | None = None,
             bounce: bool = True) -> tuple[Routes, Held]:
        """The routes of one request from the peer ``src`` (none: every pair direct). ``bounce`` False: no pair
        bounces (D scatters a bounce by the runs of P's blocks, which an early registration does not know)."""
        bouncing = bounce and self.bouncing
        if not bouncing and not self.ipc:
            return {}, []
        return plan_routes(plan, src, self._local(), src_blocks, dst_blocks, self._gate if bouncing else None,
                           self._arenas or {}, first_token=first_token, num_tokens=num_tokens, ipc=self.ipc)

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
