"""DSAScheduler on real vLLM schedulers (tiny MLA model config, vLLM's NixlConnector scheduler side).

Requests carry the ``kv_transfer_params`` a P/D proxy sends to the decode instance; transfer completion
is reported through ``update_from_output`` (``kv_connector_output.finished_recving``), as the worker
side of the connector would. Nothing here is mocked: the scheduler, KV cache manager and connector are
vLLM's own classes. ``compat``: ``ci/compat.sh`` runs the module on each release's sources too (vLLM 0.34:
``ModelRunnerOutput`` has no ``req_id_to_index``; ``--max-num-inflight-kv-loads`` queues).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm_dsa_dev.admission.harness import (
    build_scheduler,
    build_vllm_config,
    drive,
    fixed_latency,
    remote_request,
)

from vllm_dsa_connector.admission import DSAAsyncScheduler, DSAScheduler
from vllm_dsa_connector.options import OptionError

pytestmark = pytest.mark.compat

BS = 16  # CPU MLA block size


@pytest.fixture(scope="module")
def vllm_config(tiny_mla_dir):
    return build_vllm_config(str(tiny_mla_dir), block_size=BS)


def budget(tokens: int, **more) -> dict:
    return {"admission": "budget", "admission_budget_tokens": tokens, **more}


Stream = Callable[[], dict[int, list[Request]]]


def stream_of(spec: list[tuple[int, str, int, bool]]) -> Stream:
    """spec: (arrival step, request id, prompt tokens, remote) -> a factory of fresh requests."""

    def make() -> dict[int, list[Request]]:
        arrivals: dict[int, list[Request]] = {}
        for step, rid, n, remote in spec:
            arrivals.setdefault(step, []).append(remote_request(n, request_id=rid, remote=remote))
        return arrivals

    return make


def reference_budget_trace(
    spec: list[tuple[int, str, int, bool]], budget_blocks: int, latency: dict[str, int]
) -> list[tuple[int, str]]:
    """Independent model of the specified policy: FCFS over remote requests in arrival order, cost =
    ceil(tokens / block), admit when nothing is in flight or when it fits; the first that does not fit
    stops admission behind it. A transfer started at step s is reported received at step s + latency
    and its blocks count until then (free for the next step's admission)."""
    arrival_order = sorted(spec, key=lambda x: x[0])  # stable: same-step arrivals keep list order
    queue = [(step, rid, -(-n // BS)) for step, rid, n, remote in arrival_order if remote]
    in_flight: dict[str, tuple[int, int]] = {}  # rid -> (blocks, done step)
    trace: list[tuple[int, str]] = []
    step = 0
    while queue or in_flight:
        step += 1
        in_flight = {r: v for r, v in in_flight.items() if v[1] >= step}
        used = sum(b for b, _ in in_flight.values())
        while queue and queue[0][0] <= step:
            _, rid, cost = queue[0]
            if used and used + cost > budget_blocks:
                break
            queue.pop(0)
            used += cost
            in_flight[rid] = (cost, step + latency[rid])
            trace.append((step, rid))
        assert step < 10_000
    return trace


# ---------------------------------------------------------------------------------------------
# class selection


def test_admission_scheduler_cls_resolves_and_picks_the_base(vllm_config) -> None:
    from vllm.config import SchedulerConfig

    sc = SchedulerConfig.default_factory(scheduler_cls="vllm_dsa_connector.admission.DSAScheduler")
    assert sc.get_scheduler_cls() is DSAScheduler

    sync = build_scheduler(vllm_config, DSAScheduler, extra_config={}, num_blocks=256)
    assert type(sync) is DSAScheduler and not isinstance(sync, AsyncScheduler)

    asyn = build_scheduler(
        vllm_config, DSAScheduler, extra_config={}, num_blocks=256, async_scheduling=True
    )
    assert type(asyn) is DSAAsyncScheduler
    assert isinstance(asyn, AsyncScheduler) and isinstance(asyn, DSAScheduler)

    with pytest.raises(ValueError, match="needs async scheduling on but it is off"):
        build_scheduler(vllm_config, DSAAsyncScheduler, extra_config={}, num_blocks=256)


def test_admission_invalid_option_fails_at_construction(vllm_config) -> None:
    with pytest.raises(OptionError, match=r"kv_connector_extra_config: admission_budget_tokens:"):
        build_scheduler(vllm_config, DSAScheduler, extra_config=budget(-5), num_blocks=256)
    with pytest.raises(OptionError, match=r"admission: must be one of passthrough, budget"):
        build_scheduler(vllm_config, DSAScheduler, extra_config={"admission": "x"}, num_blocks=256)


# ---------------------------------------------------------------------------------------------
# pass-through


def test_admission_passthrough_admits_everything_that_fits(vllm_config) -> None:
    make = stream_of([(1, f"r{i}", 100 + 7 * i, True) for i in range(24)])
    sched = build_scheduler(vllm_config, DSAScheduler, extra_config={}, num_blocks=1024)
    seen: list = []
    res = drive(sched, make(), on_step=lambda s, sc: seen.append(sc.admission_stats()))
    assert [r for s, r in res.started if s == 1] == [f"r{i}" for i in range(24)]  # all at once
    assert res.finished == {f"r{i}" for i in range(24)}
    first = seen[0]
    assert (first.step, first.admitted, first.deferred, first.in_flight_requests) == (1, 24, 0, 24)
    assert first.in_flight_blocks == sum(-(-(100 + 7 * i) // BS) for i in range(24))
    assert sched.admission_totals() == {
        "admitted": 24,
        "deferred": 0,
        "completed": 24,
        "expired": 0,
    }
    assert sched.admission_stats().in_flight_blocks == 0


@pytest.mark.parametrize("num_blocks", [40, 200])
def test_admission_passthrough_matches_stock_scheduler(vllm_config, num_blocks) -> None:
    """With KV blocks scarce (40) or not, pass-through admits exactly what vLLM's scheduler does."""
    rng = random.Random(7)
    spec = [
        (rng.randint(1, 12), f"r{i}", rng.randint(20, 180), rng.random() < 0.8) for i in range(40)
    ]
    make = stream_of(spec)
    latency = {f"r{i}": rng.randint(1, 4) for i in range(40)}

    def transfers(step, in_flight):
        return [r for r, s in in_flight.items() if step - s >= latency[r]]

    stock = drive(
        build_scheduler(vllm_config, Scheduler, num_blocks=num_blocks), make(), transfers=transfers
    )
    ours = drive(
        build_scheduler(vllm_config, DSAScheduler, extra_config={}, num_blocks=num_blocks),
        make(),
        transfers=transfers,
    )
    assert ours.started == stock.started
    assert ours.first_scheduled == stock.first_scheduled
    assert ours.steps == stock.steps
    assert ours.finished == stock.finished == {f"r{i}" for i in range(40)}


# ---------------------------------------------------------------------------------------------
# budget


def test_admission_budget_defers_fcfs_exactly(vllm_config) -> None:
    """Budget 10 blocks; costs in blocks a=4 b=4 c=4 d=1 e=12 f=2; a local request l behind them."""
    spec = [
        (1, "a", 4 * BS, True),
        (1, "b", 4 * BS - 5, True),
        (1, "c", 4 * BS, True),
        (1, "d", 1, True),
        (1, "l", 30, False),
        (1, "e", 12 * BS, True),
        (2, "f", 2 * BS, True),
    ]
    sched = build_scheduler(
        vllm_config, DSAScheduler, extra_config=budget(10 * BS - 3), num_blocks=1024
    )
    steps: dict[int, object] = {}
    res = drive(
        sched,
        stream_of(spec)(),
        transfers=fixed_latency(2),
        on_step=lambda s, sc: steps.setdefault(s, sc.admission_stats()),
    )
    # step 1: a+b = 8 blocks; c (4) does not fit -> c, d, e held back (d would fit: FCFS).
    # a, b reported received at step 3 -> step 4: c+d = 5, e (12) does not fit -> e, f wait.
    # c, d received at step 6 -> step 7: e is larger than the budget, nothing in flight -> admitted
    # alone. e received at step 9 -> step 10: f.
    assert res.started == [(1, "a"), (1, "b"), (4, "c"), (4, "d"), (7, "e"), (10, "f")]
    assert res.first_scheduled["l"] == 1  # a request that needs no transfer is not held back
    assert res.finished == {"a", "b", "c", "d", "e", "f", "l"}
    s1 = steps[1]
    assert (s1.admitted, s1.deferred, s1.in_flight_blocks, s1.in_flight_requests) == (2, 3, 8, 2)
    s4 = steps[4]
    assert (s4.admitted, s4.deferred, s4.in_flight_blocks) == (2, 2, 5)
    assert (steps[7].admitted, steps[7].in_flight_blocks) == (1, 12)
    assert sched.admission_totals()["admitted"] == 6
    assert sched.admission_stats().in_flight_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_admission_budget_never_starves_and_matches_model(vllm_config, async_scheduling) -> None:
    """A random stream with oversized requests and random transfer times: the trace equals the
    independent model of the policy, admission is FCFS, the budget holds, every request drains."""
    rng = random.Random(1234)
    n = 60
    spec = []
    for i in range(n):
        blocks = rng.choice([1, 2, 3, 5, 8, 13, 30])  # 30 > budget of 24 blocks
        spec.append(
            (
                rng.randint(1, 40),
                f"r{i:02d}",
                blocks * BS - rng.randint(0, BS - 1),
                rng.random() < 0.9,
            )
        )
    latency = {rid: rng.randint(1, 5) for _, rid, _, _ in spec}
    budget_blocks = 24

    def transfers(step, in_flight):
        return [r for r, s in in_flight.items() if step - s >= latency[r]]

    sched = build_scheduler(
        vllm_config,
        DSAScheduler,
        extra_config=budget(budget_blocks * BS),
        num_blocks=4096,
        async_scheduling=async_scheduling,
    )
    assert isinstance(sched, AsyncScheduler) == async_scheduling
    peak = []
    res = drive(
        sched,
        stream_of(spec)(),
        transfers=transfers,
        on_step=lambda s, sc: peak.append(sc.admission_stats()),
    )
    assert res.finished == {rid for _, rid, _, _ in spec}
    assert res.started == reference_budget_trace(spec, budget_blocks, latency)
    remote_in_arrival_order = [rid for _, rid, _, r in sorted(spec, key=lambda x: x[0]) if r]
    assert [r for _, r in res.started] == remote_in_arrival_order
    cost = {rid: -(-t // BS) for _, rid, t, _ in spec}
    for st in filter(None, peak):
        assert st.in_flight_blocks <= budget_blocks or (
            st.in_flight_requests == 1
            and st.in_flight_blocks in {c for c in cost.values() if c > budget_blocks}
        )
    assert sched.admission_totals()["deferred"] > 0


def test_admission_budget_abort_releases_budget(vllm_config) -> None:
    """An aborted in-flight transfer stops counting; the request behind it is admitted next step."""
    spec = [(1, "a", 2 * BS, True), (1, "b", 2 * BS, True)]
    released = {"a": 10}

    def transfers(step, in_flight):
        # b completes after 1 step; a is reported (freed on the worker) only at step 10.
        return [r for r, s in in_flight.items() if step - s >= released.get(r, 1)]

    def on_step(step, sc):
        if step == 3:
            sc.finish_requests("a", RequestStatus.FINISHED_ABORTED)

    sched = build_scheduler(vllm_config, DSAScheduler, extra_config=budget(3 * BS), num_blocks=256)
    res = drive(sched, stream_of(spec)(), transfers=transfers, on_step=on_step)
    assert res.started == [(1, "a"), (4, "b")]
    assert res.finished == {"a", "b"}
    assert sched.admission_stats().in_flight_blocks == 0


def test_admission_budget_timeout_stops_counting(vllm_config) -> None:
    """A transfer stuck past admission_timeout_s no longer blocks the request behind it."""
    timeout = 0.3
    spec = [(1, "stuck", 2 * BS, True), (1, "b", 2 * BS, True)]
    started_at: dict[str, float] = {}

    def transfers(step, in_flight):
        now = time.monotonic()
        for r in in_flight:
            started_at.setdefault(r, now)
        # "stuck" completes only once b has been admitted and received.
        return [r for r in in_flight if r == "b" and step - in_flight[r] >= 1] + (
            ["stuck"] if "b" in started_at and "b" not in in_flight else []
        )

    sched = build_scheduler(
        vllm_config,
        DSAScheduler,
        extra_config=budget(3 * BS, admission_timeout_s=timeout),
        num_blocks=256,
    )
    res = drive(
        sched,
        stream_of(spec)(),
        transfers=transfers,
        on_step=lambda s, sc: time.sleep(0.05),
        max_steps=200,
    )
    (s_stuck, _), (s_b, _) = res.started
    assert s_b > s_stuck + 1  # really held back for a while
    assert started_at["b"] - started_at["stuck"] >= timeout
    totals = sched.admission_totals()
    assert totals["expired"] == 1 and totals["admitted"] == 2 and totals["completed"] == 2
    assert res.finished == {"stuck", "b"}
    assert sched.admission_stats().in_flight_blocks == 0


# ---------------------------------------------------------------------------------------------
# vLLM 0.34's --max-num-inflight-kv-loads


@pytest.mark.parametrize(("cap", "budget_blocks", "most"), [(1, 10, 1), (3, 8, 2)])
def test_budget_and_inflight_load_cap_both_apply(
    tiny_mla_dir, cap: int, budget_blocks: int, most: int
) -> None:
    """Both limits hold at once, the tighter one binds: vLLM's count of requests holding blocks for
    a load (``--max-num-inflight-kv-loads``) and the budget's tokens in flight (0.34 only)."""
    from vllm.config import SchedulerConfig

    if "max_num_inflight_kv_loads" not in SchedulerConfig.__dataclass_fields__:
        pytest.skip("vLLM < 0.34 has no --max-num-inflight-kv-loads")
    spec = [(1, rid, 4 * BS, True) for rid in "abcdef"] + [(1, "l", 30, False)]
    config = build_vllm_config(str(tiny_mla_dir), block_size=BS)
    config.scheduler_config.max_num_inflight_kv_loads = cap
    sched = build_scheduler(
        config, DSAScheduler, extra_config=budget(budget_blocks * BS), num_blocks=1024
    )
    res = drive(sched, stream_of(spec)(), transfers=fixed_latency(2))
    assert res.finished == set("abcdefl")
    assert res.first_scheduled["l"] == 1
    # A transfer started at step s is in flight during steps s..s+1 (received at s+2).
    steps = {s for s, _ in res.started}
    concurrent = max(sum(1 for t, _ in res.started if t <= s < t + 2) for s in steps)
    assert concurrent == most, res.started
