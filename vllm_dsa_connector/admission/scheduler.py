"""The scheduler classes: vLLM's Scheduler / AsyncScheduler with the remote-KV admission hook."""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import KV_FETCH_IN_PROGRESS, KV_FETCH_WAITING_TO_START
from vllm.v1.request import Request, RequestStatus

from vllm_dsa_connector.admission.options import OPT_BUDGET_TOKENS, AdmissionConfig
from vllm_dsa_connector.admission.policy import AdmissionLedger, AdmissionStepStats
from vllm_dsa_connector.options import OptionError

# Under "vllm." so records go through vLLM's configured handler (a bare package name has none).
logger = init_logger("vllm.plugins." + __name__)


class DSAScheduler(Scheduler):
    """vLLM's scheduler with the remote-KV admission hook.

    Constructing ``DSAScheduler`` when async scheduling is on gives a :class:`DSAAsyncScheduler`
    (vLLM's ``AsyncScheduler`` base), so ``--scheduler-cls vllm_dsa_connector.admission.DSAScheduler``
    is right either way.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DSAScheduler:
        if cls is DSAScheduler and _async_scheduling_on(args, kwargs):
            cls = DSAAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        async_on = bool(vllm_config.scheduler_config.async_scheduling)
        if isinstance(self, AsyncScheduler) != async_on:
            raise ValueError(
                f"{type(self).__name__} needs async scheduling "
                f"{'on' if isinstance(self, AsyncScheduler) else 'off'} but it is "
                f"{'on' if async_on else 'off'}; use --scheduler-cls "
                f"vllm_dsa_connector.admission.DSAScheduler, which picks the right base"
            )
        try:
            config = AdmissionConfig.from_vllm_config(vllm_config)
        except OptionError as e:
            raise OptionError(f"kv_connector_extra_config: {e}") from None
        super().__init__(vllm_config, *args, **kwargs)
        self._admission = AdmissionLedger(config, self.block_size)
        self._admission_gated = config.policy == "budget"
        if not self._admission_gated:
            # Pass-through has no gate: bind vLLM's own method on the instance, so the per-request
            # peek in schedule() costs nothing extra.
            self._handle_blocked_waiting_request = super()._handle_blocked_waiting_request  # type: ignore[method-assign]
        self._admission_last: AdmissionStepStats | None = None
        self._admission_log_interval = config.log_interval_s
        self._admission_last_log = time.monotonic()
        self._admission_next_log = self._admission_last_log + config.log_interval_s
        self._admission_logged_totals = dict(self._admission.totals)
        if config.policy == "passthrough" and config.budget_tokens is not None:
            logger.info(
                "admission: passthrough; %s=%d is ignored (it applies to the budget policy)",
                OPT_BUDGET_TOKENS.key,
                config.budget_tokens,
            )
        logger.info(
            "admission: %s on %s%s",
            config.policy,
            "AsyncScheduler" if async_on else "Scheduler",
            (
                f" (budget {self._admission.budget_blocks} blocks of {self.block_size} tokens, "
                f"timeout {config.timeout_s:g} s)"
                if self._admission_gated
                else ""
            ),
        )

    @property
    def admission_config(self) -> AdmissionConfig:
        """The admission options in force."""
        return self._admission.config

    def admission_stats(self) -> AdmissionStepStats | None:
        """Counts of the latest step that had remote-KV activity (``None`` before any)."""
        return self._admission_last

    def admission_totals(self) -> dict[str, int]:
        """Counts since start: admitted, deferred, completed, expired."""
        return dict(self._admission.totals)

    # vLLM hooks -------------------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        ledger = self._admission
        ledger.begin_step()
        output = super().schedule(*args, **kwargs)
        stats = ledger.end_step(self.current_step)
        if stats is not None:
            self._admission_last = stats
            if stats.admitted or stats.deferred:
                logger.debug("admission step: %s", stats)
        if self._admission_log_interval > 0:
            now = time.monotonic()
            if now >= self._admission_next_log:
                self._admission_next_log = now + self._admission_log_interval
                self._log_interval(now)
        return output

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        if not self._admission_gated:
            return True
        if request.num_computed_tokens or request.status != RequestStatus.WAITING:
            return True  # resumed, or its transfer already finished
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return True  # needs no transfer: not subject to the transfer budget
        return self._admission.admit(request.request_id, request.num_prompt_tokens)

    def _set_kv_fetch_stage(self, request: Request, stage: str | None) -> None:
        super()._set_kv_fetch_stage(request, stage)
        if stage == KV_FETCH_IN_PROGRESS:
            self._admission.started(request.request_id, request.num_prompt_tokens)
        elif stage != KV_FETCH_WAITING_TO_START and self._admission.is_tracked(request.request_id):
            self._admission.ended(request.request_id)

    # logging ----------------------------------------------------------------------------------

    def _log_interval(self, now: float) -> None:
        totals = self._admission.totals
        last = self._admission_logged_totals
        delta = {k: totals[k] - last[k] for k in totals}
        ledger = self._admission
        if not any(delta.values()) and not ledger.in_flight_requests:
            self._admission_last_log = now
            return
        self._admission_logged_totals = dict(totals)
        elapsed, self._admission_last_log = now - self._admission_last_log, now
        logger.info(
            "admission (%s): admitted %d, deferred %d, completed %d, expired %d in the last "
            "%.0f s; in flight now: %d requests, %d blocks%s",
            ledger.config.policy,
            delta["admitted"],
            delta["deferred"],
            delta["completed"],
            delta["expired"],
            elapsed,
            ledger.in_flight_requests,
            ledger.in_flight_blocks,
            f" of {ledger.budget_blocks}" if ledger.budget_blocks is not None else "",
        )


class DSAAsyncScheduler(DSAScheduler, AsyncScheduler):
    """:class:`DSAScheduler` on vLLM's ``AsyncScheduler`` (async scheduling on)."""


def _async_scheduling_on(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler_config, "async_scheduling", False))
