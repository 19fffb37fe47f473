"""``vllm-dsa bench admission``: admission hook overhead and the two policies side by side.

Part 1 (``sched``): scheduler CPU time per step (``schedule`` + ``update_from_output``) of vLLM's
stock ``Scheduler`` vs ``DSAScheduler`` (passthrough, and budget for reference) driven through the same
remote-KV request stream (real schedulers, vLLM's NixlConnector scheduler side, simulated workers).
Times are this thread's CPU time (``time.thread_time``), so other processes on the machine do not
count; runs are interleaved (stock and passthrough adjacent in every rep); the ratio is the median of
the per-rep ratios (with quartiles) and best run vs best run.

Part 2 (``pd``, :mod:`vllm_dsa_dev.commands.bench_admission_pd`): a CPU P/D pair of real ``api_server`` processes with NixlConnector and the tiny MLA
model: one prefill server and two decode servers (``DSAScheduler`` with ``passthrough``, and with
``budget``), started once. A burst of N requests goes through an in-process proxy (the data flow of
vLLM's toy P/D proxy: prefill with ``max_tokens=1`` returning ``kv_transfer_params``, then a streamed
decode carrying them); rounds alternate between the policies. Reports the burst's wall time and the
mean/p50/p90 TTFT and end-to-end latency per policy. The policies differ only when the budget binds
(the decode log lines count the deferrals); with a budget that never binds, the difference between the
two servers is the noise floor of the machine.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``vllm-dsa bench admission``."""
    parser.add_argument("--part", choices=("sched", "pd", "both"), default="both")
    parser.add_argument("--model", default=None, help="model dir (default: the tiny MLA model)")
    g = parser.add_argument_group("scheduler step time")
    g.add_argument("--requests", type=int, default=300, help="requests in the stream")
    g.add_argument("--reps", type=int, default=21, help="interleaved runs per scheduler")
    g = parser.add_argument_group("P/D pair")
    g.add_argument("--burst", type=int, default=32, help="requests per burst")
    g.add_argument("--rounds", type=int, default=2, help="bursts per policy (alternating)")
    g.add_argument("--prompt-tokens", type=int, default=512)
    g.add_argument("--max-tokens", type=int, default=16, help="decode tokens per request")
    g.add_argument(
        "--budget-tokens",
        type=int,
        default=None,
        help="admission_budget_tokens of the budget server (default: one prompt, so it binds)",
    )
    g.add_argument("--start-timeout", type=float, default=420.0, help="seconds to wait for servers")
    g.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    """Run the selected parts and print their results."""
    from vllm_dsa_dev.tiny_models import make_tiny_mla

    model = str(args.model or make_tiny_mla())
    if args.part in ("sched", "both"):
        bench_scheduler(model, args.requests, args.reps)
    if args.part in ("pd", "both"):
        from vllm_dsa_dev.commands.bench_admission_pd import bench_pd

        return bench_pd(model, args, args.budget_tokens or args.prompt_tokens)
    return 0


# --------------------------------------------------------------------------------------------
# Part 1: scheduler step time


def _stream(n: int, seed: int = 0) -> dict[int, list[Any]]:
    from vllm_dsa_dev.admission.harness import remote_request

    rng = random.Random(seed)
    arrivals: dict[int, list[Any]] = {}
    for i in range(n):
        arrivals.setdefault(1 + i // 6, []).append(
            remote_request(
                rng.randint(64, 1024),
                max_tokens=rng.randint(16, 48),
                request_id=f"r{i}",
                remote=rng.random() < 0.9,
            )
        )
    return arrivals


def bench_scheduler(model: str, n: int, reps: int) -> dict[str, float]:
    """Interleaved runs of the stock scheduler and DSAScheduler on one stream; prints the ratio."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dsa_connector.admission import DSAScheduler
    from vllm_dsa_dev.admission.harness import (
        build_scheduler,
        build_vllm_config,
        drive,
        fixed_latency,
    )

    vllm_config = build_vllm_config(model, max_num_seqs=256)
    variants: dict[str, tuple[type, dict[str, Any]]] = {
        "stock Scheduler": (Scheduler, {}),
        "DSAScheduler passthrough": (DSAScheduler, {"admission_log_interval_s": 0}),
        "DSAScheduler budget": (
            DSAScheduler,
            {
                "admission": "budget",
                "admission_budget_tokens": 8192,
                "admission_log_interval_s": 0,
            },
        ),
    }
    totals: dict[str, list[float]] = {k: [] for k in variants}
    steps: dict[str, int] = {}
    traces: dict[str, Any] = {}
    names = list(variants)
    for rep in range(reps + 1):  # rep 0 warms up (imports, caches) and is not counted
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            cls, extra = variants[name]
            sched = build_scheduler(vllm_config, cls, extra_config=extra, num_blocks=8192)
            arrivals = _stream(n)
            gc.collect()
            res = drive(sched, arrivals, transfers=fixed_latency(3), clock=time.thread_time)
            if rep:
                totals[name].append(sum(res.step_seconds))
            steps[name] = res.steps
            traces[name] = res.started
            sched.shutdown()
    same = traces["stock Scheduler"] == traces["DSAScheduler passthrough"]
    print(f"\n== scheduler step time: {n} requests (90% remote KV), {reps} interleaved runs ==")
    print(f"{'scheduler':28s} {'steps':>6s} {'best ms/step':>13s} {'median ms/step':>15s}")
    for name in names:
        b = min(totals[name]) / steps[name] * 1e3
        m = statistics.median(totals[name]) / steps[name] * 1e3
        print(f"{name:28s} {steps[name]:6d} {b:13.4f} {m:15.4f}")
    base, ours = totals["stock Scheduler"], totals["DSAScheduler passthrough"]
    ratio_best = min(ours) / min(base)
    pairs = sorted(o / b for o, b in zip(ours, base, strict=True))  # runs of one rep are adjacent
    ratio_pairs = statistics.median(pairs)
    q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
    print(
        f"passthrough / stock: {ratio_pairs:.4f} median of {len(pairs)} paired runs "
        f"(quartiles {q1:.4f}..{q3:.4f}), {ratio_best:.4f} best vs best; goal <= 1.02; "
        f"same admission trace as stock: {same}"
    )
    per_step = _hook_cost_per_step(vllm_config, n)
    stock_step = statistics.median(base) / steps["stock Scheduler"]
    print(
        f"hook cost, timed in isolation: {per_step * 1e6:.2f} us per step = "
        f"{per_step / stock_step * 100:.3f}% of the stock step ({stock_step * 1e3:.3f} ms)"
    )
    return {
        "ratio_best": ratio_best,
        "ratio_pairs": ratio_pairs,
        "hook_share": per_step / stock_step,
    }


def _hook_cost_per_step(vllm_config: Any, n: int) -> float:
    """What DSAScheduler adds per step, without machine noise: count its hook calls on the stream,
    time each hook against the stock method it wraps (``timeit``, best of 5), and combine."""
    import timeit

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_dsa_connector.admission import DSAScheduler
    from vllm_dsa_dev.admission.harness import (
        build_scheduler,
        drive,
        fixed_latency,
        remote_request,
    )

    counts = {"peek": 0, "stage": 0}

    class Counting(DSAScheduler):
        def _handle_blocked_waiting_request(self, request):  # type: ignore[no-untyped-def]
            counts["peek"] += 1
            return super()._handle_blocked_waiting_request(request)

        def _set_kv_fetch_stage(self, request, stage):  # type: ignore[no-untyped-def]
            counts["stage"] += 1
            super()._set_kv_fetch_stage(request, stage)

    extra = {"admission_log_interval_s": 0}
    res = drive(
        build_scheduler(vllm_config, Counting, extra_config=extra, num_blocks=8192),
        _stream(n),
        transfers=fixed_latency(3),
    )
    ours = build_scheduler(vllm_config, DSAScheduler, extra_config=extra, num_blocks=8192)
    req = remote_request(100, remote=False)
    ours.requests[req.request_id] = req
    number = 20000

    def best(stmt: Any) -> float:
        return min(timeit.repeat(stmt, number=number, repeat=5)) / number

    peek = best(lambda: ours._handle_blocked_waiting_request(req)) - best(
        lambda: Scheduler._handle_blocked_waiting_request(ours, req)
    )
    stage = best(lambda: ours._set_kv_fetch_stage(req, None)) - best(
        lambda: Scheduler._set_kv_fetch_stage(ours, req, None)
    )
    ledger = ours._admission

    def step_wrapper() -> None:  # what DSAScheduler.schedule adds around super().schedule()
        ledger.begin_step()
        ledger.end_step(1)

    step = best(step_wrapper)
    ours.shutdown()
    per_peek, per_stage = counts["peek"] / res.steps, counts["stage"] / res.steps
    print(
        f"  per step: wrapper {step * 1e6:.2f} us; {per_peek:.1f} gate calls x "
        f"{peek * 1e9:.0f} ns; {per_stage:.1f} stage calls x {stage * 1e9:.0f} ns"
    )
    return step + max(peek, 0.0) * per_peek + max(stage, 0.0) * per_stage
