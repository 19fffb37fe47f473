"""Admission options, the in-flight ledger and the admission decision (no vLLM scheduler imports)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm.logger import init_logger

from vllm_dsa_connector.options import (
    Option,
    OptionError,
    parse_choice,
    parse_float,
    parse_int,
)

# Under "vllm." so records go through vLLM's configured handler (a bare package name has none).
logger = init_logger("vllm.plugins." + __name__)

POLICIES: tuple[str, ...] = ("passthrough", "budget")

OPT_POLICY = Option(
    "admission",
    partial(parse_choice, choices=POLICIES),
    "passthrough",
    env="VLLM_DSA_ADMISSION",
    doc="admission policy for remote-KV requests: passthrough (default) or budget",
)
OPT_BUDGET_TOKENS = Option(
    "admission_budget_tokens",
    partial(parse_int, minimum=1),
    None,
    env="VLLM_DSA_ADMISSION_BUDGET_TOKENS",
    doc="budget policy: tokens of remote KV allowed in flight (rounded up to whole blocks)",
)
OPT_TIMEOUT_S = Option(
    "admission_timeout_s",
    partial(parse_float, minimum=0.001),
    60.0,
    env="VLLM_DSA_ADMISSION_TIMEOUT_S",
    doc="budget policy: a transfer in flight longer than this stops counting against the budget",
)
OPT_LOG_INTERVAL_S = Option(
    "admission_log_interval_s",
    partial(parse_float, minimum=0.0),
    10.0,
    env="VLLM_DSA_ADMISSION_LOG_INTERVAL_S",
    doc="seconds between INFO lines of admission counts (0 disables them)",
)
_OPTIONS = (OPT_POLICY, OPT_BUDGET_TOKENS, OPT_TIMEOUT_S, OPT_LOG_INTERVAL_S)

#: Keys of ``kv_connector_extra_config`` read by the admission hook (the connector accepts them as known).
ADMISSION_OPTION_KEYS: frozenset[str] = frozenset(o.key for o in _OPTIONS)


@dataclass(frozen=True)
class AdmissionConfig:
    """The validated admission options."""

    policy: str = "passthrough"
    budget_tokens: int | None = None
    timeout_s: float = 60.0
    log_interval_s: float = 10.0

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> AdmissionConfig:
        """Read the admission keys of ``kv_connector_extra_config`` (other keys are ignored here).

        Raises:
            OptionError: a value is invalid, or ``budget`` is chosen without a budget.
        """
        extra = extra or {}
        environ = os.environ if environ is None else environ
        typos = sorted(
            k for k in extra if k.startswith("admission") and k not in ADMISSION_OPTION_KEYS
        )
        if typos:
            raise OptionError(
                f"{typos[0]}: unknown admission option; known: {', '.join(sorted(ADMISSION_OPTION_KEYS))}"
            )
        policy = OPT_POLICY.resolve(extra, environ)
        budget = OPT_BUDGET_TOKENS.resolve(extra, environ)
        timeout_s = OPT_TIMEOUT_S.resolve(extra, environ)
        log_interval_s = OPT_LOG_INTERVAL_S.resolve(extra, environ)
        if policy == "budget" and budget is None:
            raise OptionError(
                f"{OPT_BUDGET_TOKENS.key}: required when admission is 'budget' "
                f"(tokens of remote KV allowed in flight, e.g. 65536)"
            )
        return cls(policy, budget, timeout_s, log_interval_s)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AdmissionConfig:
        """The admission options of a ``VllmConfig`` (defaults when it has no KV transfer config).

        The keys are read where users put them: the top-level ``kv_connector_extra_config`` and, under
        vLLM's MultiConnector, each child's (e.g. next to DSAConnector's options); the same key with two
        different values is an error.
        """
        from vllm_dsa_connector.connector.compose import admission_keys

        kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        if kv_transfer_config is None:
            return cls.from_extra_config(None)
        try:
            extra = admission_keys(kv_transfer_config)
        except ValueError as e:
            raise OptionError(str(e)) from None
        return cls.from_extra_config(extra)

    def budget_blocks(self, block_size: int) -> int | None:
        """The budget in whole KV blocks (``None`` for pass-through)."""
        if self.policy != "budget" or self.budget_tokens is None:
            return None
        return -(-self.budget_tokens // block_size)


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
