"""Part 2 of ``vllm-dsa bench admission``: a CPU P/D trio with NixlConnector and two admission policies.

One prefill server and two decode servers (``DSAScheduler`` with ``passthrough``, and with ``budget``),
real ``api_server`` processes started through :class:`~vllm_dsa_dev.harness.procs.Cluster` (own
process groups, killed as groups). Bursts of requests go through an in-process proxy (the data flow of
vLLM's toy P/D proxy); rounds alternate between the policies.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dsa_connector.core.handoff.params import PrefillParams
from vllm_dsa_dev.harness.engines import BackendChoice, Engine, engine_env, start_engine
from vllm_dsa_dev.harness.procs import Cluster, cluster

_COUNTS = re.compile(r"admitted (\d+), deferred (\d+), completed")
# Pinned on every CPU: the comparison is about admission, and AMX_MLA (vLLM's pick where AMX tiles
# exist) would change block size and kernels between machines.
ADMISSION_BACKEND = BackendChoice("CPU_MLA", "CPU_MLA", "pinned for the admission comparison")
PD_PORTS = {"prefill": 23100, "passthrough": 23101, "budget": 23102}
SIDE_CHANNEL_PORTS = {"prefill": 23110, "passthrough": 23111, "budget": 23112}


def start_server(c: Cluster, name: str, model: str, kv_config: dict[str, Any], cpu: str,
                 extra: list[str]) -> Engine:
    """Start one NixlConnector engine of the trio (port and side channel from the tables above)."""
    env = engine_env(cpu)
    env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_CHANNEL_PORTS[name]))
    return start_engine(c, name, Path(model), PD_PORTS[name], None, kv_config, ADMISSION_BACKEND, env,
                        extra=["--max-num-seqs", "64", *extra])


_PREFILL_PARAMS = PrefillParams().to_dict()  # the proxy's prefill leg


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
    base = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    sched = ["--scheduler-cls", "vllm_dsa_connector.admission.DSAScheduler"]
    policies = {
        "passthrough": {"admission": "passthrough"},
        "budget": {"admission": "budget", "admission_budget_tokens": budget_tokens},
    }
    with cluster(log_dir) as c:
        try:
            engines = [start_server(c, "prefill", model, base, "0", [])]
            for name, extra in policies.items():
                engines.append(start_server(c, name, model, dict(base, kv_connector_extra_config=extra), "1", sched))
            print(f"\n== P/D pair: starting prefill + 2 decode servers (logs in {log_dir}) ==", flush=True)
            t0 = time.monotonic()
            for e in engines:
                e.ready(args.start_timeout, watch=c.procs, poll_s=2.0)
            print(f"servers ready in {time.monotonic() - t0:.0f} s", flush=True)
            summary = run_bursts(model, args, budget_tokens, list(policies))
        except RuntimeError as e:
            print(f"bench admission (P/D): {e}", file=sys.stderr)
            return 1
        print(f"budget / passthrough burst wall time: {summary['budget'] / summary['passthrough']:.3f}")
        for s in c.procs[1:]:  # the decode servers' periodic admission lines, summed
            counts = [tuple(map(int, m)) for m in _COUNTS.findall(s.log.read_text(errors="replace"))]
            adm, dfr = sum(x[0] for x in counts), sum(x[1] for x in counts)
            print(f"{s.name:12s} admission log lines: admitted {adm}, deferred {dfr} request-steps "
                  f"(warm-up included; the last interval may not be logged yet)")
    return 0


def run_bursts(model: str, args: argparse.Namespace, budget_tokens: int, policies: list[str]) -> dict[str, float]:
    """Warm up each decode server, then alternate bursts between the policies; print the table and
    return the mean burst wall time per policy."""
    rng = random.Random(0)
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    warm = [[rng.randint(1000, 100000) for _ in range(args.prompt_tokens)] for _ in range(2)]
    for name in policies:  # warm-up: first NIXL handshake per decode server
        asyncio.run(_burst(model, warm, PD_PORTS[name], 2))
    for rnd in range(args.rounds):
        for name in policies if rnd % 2 == 0 else policies[::-1]:
            prompts = [[rng.randint(1000, 100000) for _ in range(args.prompt_tokens)] for _ in range(args.burst)]
            r = asyncio.run(_burst(model, prompts, PD_PORTS[name], args.max_tokens))
            results[name].append(r)
            print(f"round {rnd} {name:11s}: burst wall {r['wall']:.2f} s, "
                  f"mean TTFT {statistics.mean(r['ttft']):.3f} s", flush=True)
    print(f"\n== P/D burst: {args.burst} requests x {args.rounds} rounds, prompt {args.prompt_tokens} tokens, "
          f"{args.max_tokens} decode tokens; budget {budget_tokens} tokens ==")
    print(f"{'policy':12s} {'wall s':>8s} {'TTFT mean':>10s} {'p50':>7s} {'p90':>7s} {'e2e mean':>9s} {'p90':>7s}")
    summary = {}
    for name, runs in results.items():
        wall = statistics.mean(r["wall"] for r in runs)
        ttft = [x for r in runs for x in r["ttft"]]
        e2e = [x for r in runs for x in r["e2e"]]
        summary[name] = wall
        print(f"{name:12s} {wall:8.2f} {statistics.mean(ttft):10.3f} {_pct(ttft, 0.5):7.3f} "
              f"{_pct(ttft, 0.9):7.3f} {statistics.mean(e2e):9.3f} {_pct(e2e, 0.9):7.3f}")
    return summary
