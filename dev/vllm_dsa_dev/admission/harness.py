"""Drive a real vLLM scheduler through a remote-KV (P/D decode side) request stream, without workers.

Used by the admission tests and ``vllm-dsa bench admission``. The scheduler, its KV cache manager and
its scheduler-side KV connector (vLLM's ``NixlConnector`` by default: the scheduler side needs no NIXL
traffic) are the real classes; only the worker side is simulated: each step returns a
``ModelRunnerOutput`` with one sampled token per request that finished its prompt, and reports a
transfer as received (``kv_connector_output.finished_recving``) when the caller's transfer model says so.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

SAMPLED_TOKEN = 7  # any non-EOS id: requests finish by length


def build_vllm_config(
    model_dir: str,
    *,
    kv_connector: str = "NixlConnector",
    kv_role: str = "kv_consumer",
    extra_config: Mapping[str, Any] | None = None,
    max_num_seqs: int = 256,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 4096,
    block_size: int = 16,
    scheduler_cls: str | type | None = None,
) -> Any:
    """A CPU ``VllmConfig`` for ``model_dir`` with a KV transfer config (async scheduling off)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=False,
        scheduler_cls=scheduler_cls,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    kv_transfer_config = KVTransferConfig(
        kv_connector=kv_connector,
        kv_role=kv_role,
        kv_connector_extra_config=dict(extra_config or {}),
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config_for(vllm_config: Any, num_blocks: int) -> Any:
    """One MLA KV cache group over every decoder layer of the model, ``num_blocks`` blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    mc = vllm_config.model_config
    spec = MLAAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=mc.get_head_size(),
        dtype=mc.dtype,
    )
    layers = [
        f"model.layers.{i}.self_attn.attn"
        for i in range(mc.get_num_layers(vllm_config.parallel_config))
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def build_scheduler(
    vllm_config: Any,
    scheduler_cls: type,
    *,
    extra_config: Mapping[str, Any] | None = None,
    num_blocks: int = 4096,
    async_scheduling: bool = False,
    log_stats: bool = True,
) -> Scheduler:
    """Construct ``scheduler_cls`` the way vLLM's EngineCore does (keyword arguments).

    ``extra_config`` replaces ``kv_connector_extra_config`` (the config object is reused across
    schedulers; each reads its options at construction).
    """
    from vllm.v1.structured_output import StructuredOutputManager

    if extra_config is not None:
        vllm_config.kv_transfer_config.kv_connector_extra_config = dict(extra_config)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config_for(vllm_config, num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False,
        log_stats=log_stats,
        block_size=vllm_config.cache_config.block_size,
    )


_ids = itertools.count()


def remote_request(
    num_tokens: int,
    *,
    max_tokens: int = 4,
    request_id: str | None = None,
    remote: bool = True,
    block_size: int = 16,
) -> Request:
    """A decode-side request as a P/D proxy sends it (``do_remote_prefill`` with the prefiller's
    blocks), or a plain local request when ``remote`` is false."""
    from vllm import SamplingParams

    rid = request_id if request_id is not None else f"req-{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(
        request_id=rid,
        prompt_token_ids=[(i * 31 + len(rid)) % 30000 + 100 for i in range(num_tokens)],
        sampling_params=params,
        pooling_params=None,
    )
    if remote:
        req.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill-engine",
            "remote_request_id": f"prefill-{rid}",
            "remote_block_ids": list(range(-(-num_tokens // block_size))),
            "remote_host": "127.0.0.1",
            "remote_port": 23999,
            "tp_size": 1,
        }
    return req


@dataclass
class DriveResult:
    """What happened while driving a scheduler."""

    steps: int = 0
    started: list[tuple[int, str]] = field(default_factory=list)  # (step, req id) transfer starts
    finished: set[str] = field(default_factory=set)
    first_scheduled: dict[str, int] = field(default_factory=dict)  # req id -> first step it ran
    step_seconds: list[float] = field(default_factory=list)  # schedule + update_from_output

    def started_at(self, step: int) -> list[str]:
        """Request ids whose transfer started at ``step``."""
        return [r for s, r in self.started if s == step]


TransferModel = Callable[[int, dict[str, int]], Iterable[str]]


def fixed_latency(steps: int) -> TransferModel:
    """Transfers complete ``steps`` steps after they started (reported in that step's output)."""

    def done(step: int, in_flight: dict[str, int]) -> Iterable[str]:
        return [r for r, s in in_flight.items() if step - s >= steps]

    return done


def drive(
    scheduler: Scheduler,
    arrivals: Mapping[int, list[Request]],
    *,
    transfers: TransferModel | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[int, Scheduler], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> DriveResult:
    """Run ``scheduler`` step by step until every request has finished.

    ``arrivals[step]`` are added before that step's ``schedule()`` (steps count from 1). A transfer
    started at step s is reported received in the output of the step that ``transfers`` names
    (default: two steps later).
    Raises ``RuntimeError`` when requests remain after ``max_steps`` (starvation or a stall).
    ``step_seconds`` is measured with ``clock`` (``time.thread_time`` counts only this thread's CPU
    time, which is steadier than wall time on a shared machine).
    """
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from vllm_dsa_connector.compat import dataclass_has_field

    has_row_index = dataclass_has_field(ModelRunnerOutput, "req_id_to_index")
    transfers = transfers if transfers is not None else fixed_latency(2)
    res = DriveResult()
    tracked: dict[str, Request] = {}
    in_flight: dict[str, int] = {}  # req id -> step its transfer started
    last_arrival = max(arrivals, default=0)
    perf = clock
    for step in range(1, max_steps + 1):
        for req in arrivals.get(step, ()):
            tracked[req.request_id] = req
            scheduler.add_request(req)
        t0 = perf()
        out = scheduler.schedule()
        t1 = perf()
        for rid, req in tracked.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in in_flight:
                in_flight[rid] = step
                res.started.append((step, rid))
        done = set(transfers(step, in_flight)) & set(in_flight)
        for rid in done:
            del in_flight[rid]
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            res.first_scheduled.setdefault(rid, step)
            # schedule() already advanced num_computed_tokens and set is_prefill_chunk
            sampled.append([] if scheduler.requests[rid].is_prefill_chunk else [SAMPLED_TOKEN])
        rows: dict[str, Any] = {}
        if has_row_index:  # vLLM 0.32, 0.33 (0.34 dropped the field: rows follow req_ids)
            rows["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=done) if done else None,
            **rows,
        )
        t2 = perf()
        scheduler.update_from_output(out, mro)
        t3 = perf()
        res.step_seconds.append((t1 - t0) + (t3 - t2))
        for rid in [r for r, q in tracked.items() if q.is_finished()]:
            res.finished.add(rid)
            del tracked[rid]
        if on_step is not None:
            on_step(step, scheduler)
        res.steps = step
        if step >= last_arrival and not tracked and not scheduler.has_requests():
            return res
    raise RuntimeError(
        f"{len(tracked)} request(s) still unfinished after {max_steps} steps: "
        f"{sorted(tracked)[:8]} (statuses {[tracked[r].status.name for r in sorted(tracked)[:8]]})"
    )
