"""Admission of remote-KV (P/D) requests on the decode side: one switch, two policies.

Use it with ``--scheduler-cls vllm_dsa_connector.admission.DSAScheduler``; the policy is read from
``kv_transfer_config.kv_connector_extra_config``:

- ``"admission": "passthrough"`` (default): every remote-KV request that vLLM's scheduler can fit is
  admitted, exactly as the stock scheduler does. The only addition is bookkeeping for the per-step
  counts (transitions observed through the scheduler's own KV-fetch stage hook).
- ``"admission": "budget"`` with ``"admission_budget_tokens": N``: at most ``ceil(N / block_size)``
  blocks of remote KV are in flight. FCFS: the cost of a request is ``ceil(prompt_tokens / block_size)``
  blocks; the first remote-KV request that does not fit stops the admission of every remote-KV request
  queued behind it for this step (requests that need no transfer are not held back); a request larger
  than the whole budget is admitted when nothing is in flight, so nothing starves. A transfer in flight
  longer than ``"admission_timeout_s"`` stops counting against the budget (a stuck peer must not block
  admission forever); it is still tracked until it completes or is aborted.

Rank uniformity: vLLM runs one scheduler per engine core (per data-parallel rank); tensor-parallel
workers receive its decisions through the ``SchedulerOutput``, so there is nothing to agree on between
ranks. Neither policy issues a collective or a blocking wait: the decision reads the scheduler's own
queue and ledger (plus, for ``budget`` only, the engine process's monotonic clock for the timeout). The
data-parallel collectives vLLM already runs (the unfinished-requests all-reduce, the per-forward token
count all-reduce) are untouched.

Counts (admitted, deferred, completed, expired, in-flight requests/blocks) are kept per step
(``DSAScheduler.admission_stats()``), logged at INFO every ``"admission_log_interval_s"`` seconds when
there was remote-KV activity, and at DEBUG every step that admitted or deferred. Deferred requests also
appear in vLLM's own ``num_skipped_waiting_reqs`` scheduler stat (they go through vLLM's skip path).
"""

from vllm_dsa_connector.admission.options import ADMISSION_OPTION_KEYS, POLICIES, AdmissionConfig
from vllm_dsa_connector.admission.policy import AdmissionLedger, AdmissionStepStats
from vllm_dsa_connector.admission.scheduler import DSAAsyncScheduler, DSAScheduler

__all__ = [
    "ADMISSION_OPTION_KEYS",
    "POLICIES",
    "AdmissionConfig",
    "AdmissionLedger",
    "AdmissionStepStats",
    "DSAAsyncScheduler",
    "DSAScheduler",
]
