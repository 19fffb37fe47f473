"""Launch plans of the Triton run copy cached per :class:`Runs`, replayed from CUDA graphs.

:func:`~.copy.copy_runs` keeps, per :class:`Runs` object (weakly, so a plan dies with its request's runs) and
per (source, destination, launch shape), what one launch needs: the runs table already on the GPU, the grid
and the typed views. A repeated copy of the same runs then skips the numpy planning, the bounds check and
the table upload; from its second use the launch is replayed from a CUDA graph captured once (one
``cudaGraphLaunch`` instead of Triton's launcher). ``VLLM_DSA_COPY_GRAPH=0`` turns the graphs off.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.copy.kernels import (
    LAUNCH_LOCK,
    CopyConfig,
    LaunchPlan,
    copy_settings,
    prepare_triton,
)

logger = logging.getLogger(__name__)

__all__ = ["copy_planned", "current_trace", "graphs_enabled", "plan_stats", "trace_launches"]


# Runs -> {(pointers, sizes, devices, launch shape): plan}; weak, so a plan goes with its request's runs.
_PLANS: weakref.WeakKeyDictionary[Runs, dict[tuple[Any, ...], LaunchPlan]] = weakref.WeakKeyDictionary()
_PLANS_PER_RUNS = 4
_NO_GRAPH: set[str] = set()  # devices where a capture failed (plain launches there)
_CAPTURE_STREAMS: dict[str, Any] = {}
_STATS = {"plans": 0, "plan_hits": 0, "graphs": 0, "graph_replays": 0, "graph_failures": 0}


_TRACE: list[float] | None = None  # benchmarks: perf_counter stamps of the last planned copy


def trace_launches(on: bool = True) -> list[float] | None:
    """Benchmarks: stamp the last planned copy (``perf_counter`` at copy_runs entry, plan found, launch
    or replay issued, returned); returns the list that is refilled per copy (``None`` when off)."""
    global _TRACE
    _TRACE = [] if on else None
    return _TRACE


def current_trace() -> list[float] | None:
    """The stamps list :func:`trace_launches` turned on (``None`` when off)."""
    return _TRACE


def plan_stats() -> dict[str, int]:
    """Counters of this process: plans built, cached-plan launches, graphs captured / replayed / failed."""
    return dict(_STATS)


def graphs_enabled(environ: Any = None) -> bool:
    """``VLLM_DSA_COPY_GRAPH`` (default on): replay a cached plan's launch from a CUDA graph."""
    return copy_settings(environ).graphs


def _plan_key(sb: torch.Tensor, db: torch.Tensor, cfg: CopyConfig) -> tuple[Any, ...]:
    return (sb.data_ptr(), sb.numel(), db.data_ptr(), db.numel(), str(sb.device), str(db.device),
            cfg.piece_bytes, cfg.block_bytes, cfg.num_warps)


def _capture(plan: LaunchPlan) -> Any:
    """Capture the plan's launch into a CUDA graph on a side stream; ``False`` when that fails."""
    dev = plan.device
    key = str(dev)
    try:
        side = _CAPTURE_STREAMS.get(key)
        if side is None:
            side = _CAPTURE_STREAMS.setdefault(key, torch.cuda.Stream(dev))
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # thread_local: NIXL/UCX threads of this process may issue CUDA calls meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                plan.launch()
            finally:
                graph.capture_end()
        _STATS["graphs"] += 1
        return graph
    except Exception as e:  # capture refused: plain launches on this device from now on
        _NO_GRAPH.add(key)
        _STATS["graph_failures"] += 1
        logger.warning("copy_runs: CUDA graph capture failed on %s (%s); plain launches", dev, e)
        return False


def _run_plan(plan: LaunchPlan) -> None:
    """Launch a cached plan on the current stream (graph replay from its second use)."""
    dev = plan.device
    if dev.type != "cuda":  # only under TRITON_INTERPRET=1 (tests): no streams, no graphs
        plan.uses += 1
        plan.launch()
        return
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        if plan.ready is not None and stream != plan.stream:
            stream.wait_event(plan.ready)  # the table upload ran on another stream
            plan.args[2].record_stream(stream)  # and its memory is not reused under this launch
        plan.uses += 1
        if plan.graph is None and plan.uses >= 2:
            if graphs_enabled() and str(dev) not in _NO_GRAPH:
                plan.graph = _capture(plan)
        tr = _TRACE
        if tr is not None:
            tr.append(time.perf_counter())
        if plan.graph:
            plan.graph.replay()
            _STATS["graph_replays"] += 1
        else:
            plan.launch()
        if tr is not None:
            tr.append(time.perf_counter())


def copy_planned(runs: Runs, sb: torch.Tensor, db: torch.Tensor, cfg: CopyConfig) -> None:
    """The Triton copy of ``runs`` through the plan cached on ``runs`` (built on first use)."""
    key = _plan_key(sb, db, cfg)
    per = _PLANS.get(runs)
    plan = per.get(key) if per is not None else None
    if plan is None:
        runs.check_bounds(sb.numel(), db.numel(), what="copy_runs")
        plan = prepare_triton(sb, db, runs.src_offsets, runs.dst_offsets, runs.lengths, cfg,
                               own_table=True)
        if plan is None:
            return
        with LAUNCH_LOCK:
            per = _PLANS.setdefault(runs, {})
            if len(per) >= _PLANS_PER_RUNS:
                per.pop(next(iter(per)))
            per[key] = plan
        _STATS["plans"] += 1
    else:
        _STATS["plan_hits"] += 1
    if _TRACE is not None:
        _TRACE.append(time.perf_counter())
    _run_plan(plan)
