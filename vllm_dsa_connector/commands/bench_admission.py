"""``vllm-dsa bench admission``: admission hook overhead and the two policies side by side.

Part 1 (``sched``): scheduler CPU time per step (``schedule`` + ``update_from_output``) of vLLM's
stock ``Scheduler`` vs ``DSAScheduler`` (passthrough, and budget for reference) driven through the same
remote-KV request stream (real schedulers, vLLM's NixlConnector scheduler side, simulated workers).
Times are this thread's CPU time (``time.thread_time``), so other processes on the machine do not
count; runs are interleaved (stock and passthrough adjacent in every rep); the ratio is the median of
the per-rep ratios (with quartiles) and best run vs best run.

Part 2 (``pd``): a CPU P/D pair of real ``api_server`` processes with NixlConnector and the tiny MLA
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
import asyncio
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dsa_connector.commands.demo import backends_in_log

_COUNTS = re.compile(r"admitted (\d+), deferred (\d+), completed")
ADMISSION_BACKEND = "CPU_MLA"
PD_PORTS = {"prefill": 23100, "passthrough": 23101, "budget": 23102}
SIDE_CHANNEL_PORTS = {"prefill": 23110, "passthrough": 23111, "budget": 23112}


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
    from vllm_dsa_connector.tiny_models import make_tiny_mla

    model = str(args.model or make_tiny_mla())
    if args.part in ("sched", "both"):
        bench_scheduler(model, args.requests, args.reps)
    if args.part in ("pd", "both"):
        budget = args.budget_tokens or args.prompt_tokens
        return bench_pd(model, args, budget)
    return 0


# --------------------------------------------------------------------------------------------
# Part 1: scheduler step time


def _stream(n: int, seed: int = 0) -> dict[int, list[Any]]:
    from vllm_dsa_connector.admission.harness import remote_request

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
    from vllm_dsa_connector.admission.harness import (
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
    from vllm_dsa_connector.admission.harness import (
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


# --------------------------------------------------------------------------------------------
# Part 2: P/D pair


class _Server:
    def __init__(
        self, name: str, model: str, kv_config: dict, log_dir: Path, cpu: str, extra: list[str]
    ):
        self.name = name
        self.port = PD_PORTS[name]
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_CPU_OMP_THREADS_BIND=cpu,
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_CHANNEL_PORTS[name]),
        )
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
            "--max-model-len", "2048", "--max-num-seqs", "64", "--enforce-eager",
            "--kv-transfer-config", json.dumps(kv_config),
            # Pinned on every CPU: the comparison is about admission, and AMX_MLA (vLLM's pick where
            # AMX tiles exist) would change block size and kernels between machines.
            "--attention-backend", ADMISSION_BACKEND, *extra,
        ]  # fmt: skip
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


async def _wait_ready(servers: list[_Server], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    pending = list(servers)
    async with httpx.AsyncClient(timeout=5) as client:
        while pending:
            for s in list(pending):
                if not s.alive():
                    raise RuntimeError(f"{s.name} server exited:\n{s.tail()}")
                try:
                    r = await client.get(f"http://127.0.0.1:{s.port}/health")
                    if r.status_code == 200:
                        pending.remove(s)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"servers not ready after {timeout:.0f} s: {[s.name for s in pending]}"
                )
            if pending:
                await asyncio.sleep(2)


_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def _one(
    client: Any, model: str, prompt: list[int], decode_port: int, max_tokens: int
) -> tuple[float, float]:
    """Proxy one request: prefill (max_tokens=1) then streamed decode. Returns (TTFT, end-to-end)."""
    t0 = time.perf_counter()
    r = await client.post(
        f"http://127.0.0.1:{PD_PORTS['prefill']}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": _PREFILL_PARAMS,
        },
    )
    r.raise_for_status()
    params = r.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill returned no kv_transfer_params: {r.text[:300]}")
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "kv_transfer_params": params,
    }
    ttft = None
    async with client.stream(
        "POST", f"http://127.0.0.1:{decode_port}/v1/completions", json=body
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]" and ttft is None:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("decode stream returned no token")
    return ttft, time.perf_counter() - t0


async def _burst(
    model: str, prompts: list[list[int]], decode_port: int, max_tokens: int
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) * 2 + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_one(client, model, p, decode_port, max_tokens) for p in prompts)
        )
        wall = time.perf_counter() - t0
    return {"wall": wall, "ttft": [r[0] for r in results], "e2e": [r[1] for r in results]}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def bench_pd(model: str, args: argparse.Namespace, budget_tokens: int) -> int:
    """Start the P/D trio, run alternating bursts, print per-policy numbers; servers are stopped."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-dsa-bench-admission-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    sched = ["--scheduler-cls", "vllm_dsa_connector.admission.DSAScheduler"]
    policies = {
        "passthrough": {"admission": "passthrough"},
        "budget": {"admission": "budget", "admission_budget_tokens": budget_tokens},
    }
    servers: list[_Server] = []
    try:
        servers.append(_Server("prefill", model, base, log_dir, "0", []))
        for name, extra in policies.items():
            cfg = dict(base, kv_connector_extra_config=extra)
            servers.append(_Server(name, model, cfg, log_dir, "1", sched))
        print(
            f"\n== P/D pair: starting prefill + 2 decode servers (logs in {log_dir}) ==", flush=True
        )
        t0 = time.monotonic()
        asyncio.run(_wait_ready(servers, args.start_timeout))
        for s in servers:
            found = backends_in_log(s.log_path.read_text(errors="replace"))
            if found != {ADMISSION_BACKEND}:
                raise RuntimeError(
                    f"{s.name}: expected attention backend {ADMISSION_BACKEND}, the engine reported "
                    f"{sorted(found) or 'none'}; log {s.log_path}"
                )
        print(f"servers ready in {time.monotonic() - t0:.0f} s", flush=True)
        rng = random.Random(0)
        results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        warm = [[rng.randint(1000, 100000) for _ in range(args.prompt_tokens)] for _ in range(2)]
        for name in policies:  # warm-up: first NIXL handshake per decode server
            asyncio.run(_burst(model, warm, PD_PORTS[name], 2))
        for rnd in range(args.rounds):
            order = list(policies) if rnd % 2 == 0 else list(policies)[::-1]
            for name in order:
                prompts = [
                    [rng.randint(1000, 100000) for _ in range(args.prompt_tokens)]
                    for _ in range(args.burst)
                ]
                r = asyncio.run(_burst(model, prompts, PD_PORTS[name], args.max_tokens))
                results[name].append(r)
                print(
                    f"round {rnd} {name:11s}: burst wall {r['wall']:.2f} s, "
                    f"mean TTFT {statistics.mean(r['ttft']):.3f} s",
                    flush=True,
                )
        print(
            f"\n== P/D burst: {args.burst} requests x {args.rounds} rounds, prompt "
            f"{args.prompt_tokens} tokens, {args.max_tokens} decode tokens; budget "
            f"{budget_tokens} tokens =="
        )
        print(
            f"{'policy':12s} {'wall s':>8s} {'TTFT mean':>10s} {'p50':>7s} {'p90':>7s} "
            f"{'e2e mean':>9s} {'p90':>7s}"
        )
        summary = {}
        for name, runs in results.items():
            wall = statistics.mean(r["wall"] for r in runs)
            ttft = [x for r in runs for x in r["ttft"]]
            e2e = [x for r in runs for x in r["e2e"]]
            summary[name] = wall
            print(
                f"{name:12s} {wall:8.2f} {statistics.mean(ttft):10.3f} {_pct(ttft, 0.5):7.3f} "
                f"{_pct(ttft, 0.9):7.3f} {statistics.mean(e2e):9.3f} {_pct(e2e, 0.9):7.3f}"
            )
        print(
            f"budget / passthrough burst wall time: {summary['budget'] / summary['passthrough']:.3f}"
        )
        for s in servers[1:]:  # the decode servers' periodic admission lines, summed
            text = s.log_path.read_text(errors="replace")
            counts = [tuple(map(int, m)) for m in _COUNTS.findall(text)]
            adm, dfr = sum(c[0] for c in counts), sum(c[1] for c in counts)
            print(
                f"{s.name:12s} admission log lines: admitted {adm}, deferred {dfr} request-steps "
                f"(warm-up included; the last interval may not be logged yet)"
            )
        return 0
    except RuntimeError as e:
        print(f"bench admission (P/D): {e}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            s.stop()
