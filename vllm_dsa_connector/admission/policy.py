"""The in-flight ledger and the admission decision (no vLLM scheduler imports; options in :mod:`.options`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger

from vllm_dsa_connector.admission.options import AdmissionConfig

__all__ = ["AdmissionLedger", "AdmissionStepStats"]

# Under "vllm." so records go through vLLM's configured handler (a bare package name has none).
logger = init_logger("vllm.plugins." + __name__)


@dataclass(frozen=True)
class AdmissionStepStats:
    """Remote-KV admission counts of one scheduler step."""

    step: int
    policy: str
    admitted: int  # transfers started this step
    deferred: int  # remote-KV requests held back by the policy this step
    completed: int  # transfers that ended this step (received, failed or aborted)
    expired: int  # transfers that passed the timeout this step and stopped counting
    in_flight_requests: int  # transfers in progress after this step (expired ones included)
    in_flight_blocks: int  # blocks counted against the budget after this step (expired excluded)


@dataclass
class _InFlight:
    blocks: int
    started: float
    expired: bool = False


class AdmissionLedger:
    """The in-flight ledger and the admission decision; plain Python, no collectives, no waits.

    ``admit`` is the gate (always true for pass-through). ``started``/``ended`` record transitions
    the scheduler reports; ``begin_step``/``end_step`` bracket one ``schedule()`` call.
    """

    def __init__(
        self,
        config: AdmissionConfig,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.budget_blocks = config.budget_blocks(block_size)
        self._clock = clock
        self._timed = self.budget_blocks is not None
        self._inflight: dict[str, _InFlight] = {}  # insertion order == start order
        self._pending: dict[str, int] = {}  # admitted by the gate this step, transfer not started
        self._counted_blocks = 0  # non-expired in-flight + pending
        self._blocked = False  # FCFS: a remote-KV request did not fit this step
        self.admitted = self.deferred = self.completed = self.expired = 0
        self.totals = {"admitted": 0, "deferred": 0, "completed": 0, "expired": 0}

    def cost(self, num_prompt_tokens: int) -> int:
        """Blocks of KV a remote prefill of ``num_prompt_tokens`` tokens brings in."""
        return max(1, -(-num_prompt_tokens // self.block_size))

    @property
    def in_flight_blocks(self) -> int:
        """Blocks counted against the budget now (expired transfers excluded)."""
        return self._counted_blocks

    @property
    def in_flight_requests(self) -> int:
        """Transfers in progress (expired ones included)."""
        return len(self._inflight)

    def begin_step(self) -> None:
        """Start a step: reset the FCFS stop and expire timed-out transfers (budget policy)."""
        self._blocked = False
        if self._timed and self._inflight:
            deadline = self._clock() - self.config.timeout_s
            for req_id, entry in self._inflight.items():
                if entry.started > deadline:
                    break  # entries are in start order
                if not entry.expired:
                    entry.expired = True
                    self._counted_blocks -= entry.blocks
                    self.expired += 1
                    logger.warning(
                        "admission: KV transfer of %s in flight for more than %.1f s; "
                        "its %d blocks stop counting against the budget",
                        req_id,
                        self.config.timeout_s,
                        entry.blocks,
                    )

    def admit(self, req_id: str, num_prompt_tokens: int) -> bool:
        """Budget gate for one remote-KV request, in queue order (FCFS)."""
        budget = self.budget_blocks
        if budget is None:
            return True
        if self._blocked:
            self.deferred += 1
            return False
        cost = self.cost(num_prompt_tokens)
        if self._counted_blocks == 0 or self._counted_blocks + cost <= budget:
            self._pending[req_id] = cost
            self._counted_blocks += cost
            return True
        self._blocked = True
        self.deferred += 1
        return False

    def started(self, req_id: str, num_prompt_tokens: int) -> None:
        """A transfer started (the request entered WAITING_FOR_REMOTE_KVS)."""
        cost = self._pending.pop(req_id, None)
        if cost is None:  # not gated (pass-through)
            cost = self.cost(num_prompt_tokens)
            self._counted_blocks += cost
        self._inflight[req_id] = _InFlight(cost, self._clock() if self._timed else 0.0)
        self.admitted += 1

    def ended(self, req_id: str) -> None:
        """A transfer ended (received, failed or aborted), or a gated request needed none."""
        entry = self._inflight.pop(req_id, None)
        if entry is not None:
            if not entry.expired:
                self._counted_blocks -= entry.blocks
            self.completed += 1
            return
        cost = self._pending.pop(req_id, None)
        if cost is not None:
            self._counted_blocks -= cost

    def is_tracked(self, req_id: str) -> bool:
        """Whether ``req_id`` has a transfer in flight or a reservation pending this step."""
        return req_id in self._inflight or req_id in self._pending

    def end_step(self, step: int) -> AdmissionStepStats | None:
        """Close a step; return its counts when anything happened or is in flight, else ``None``."""
        if self._pending:  # gated this step but neither started nor released (e.g. not allocated)
            for cost in self._pending.values():
                self._counted_blocks -= cost
            self._pending.clear()
        if not (self.admitted or self.deferred or self.completed or self.expired or self._inflight):
            return None
        stats = AdmissionStepStats(
            step=step,
            policy=self.config.policy,
            admitted=self.admitted,
            deferred=self.deferred,
            completed=self.completed,
            expired=self.expired,
            in_flight_requests=len(self._inflight),
            in_flight_blocks=self._counted_blocks,
        )
        totals = self.totals
        totals["admitted"] += self.admitted
        totals["deferred"] += self.deferred
        totals["completed"] += self.completed
        totals["expired"] += self.expired
        self.admitted = self.deferred = self.completed = self.expired = 0
        return stats
