"""No collective and no blocking wait anywhere in the admission code path.

Two checks: a source scan of every module of ``vllm_dsa_connector.admission`` (no distributed import,
no group or collective call, no sleep/wait/join), and a runtime check that drives both policies
through a real vLLM scheduler with counting wrappers around torch.distributed's collectives and
vLLM's GroupCoordinator methods. The wrappers are instrumentation (they call through); they are the
only way to observe "no call" from outside.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

import vllm_dsa_connector.admission as admission_pkg

COLLECTIVE_NAMES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "get_world_group",
    "get_tp_group",
    "get_dp_group",
    "get_pp_group",
    "get_ep_group",
    "coordinate_batch_across_dp",
    "has_unfinished_dp",
}
BLOCKING_NAMES = {"sleep", "wait", "acquire", "Event", "Condition", "Barrier", "Future", "result"}


def _modules() -> list[Path]:
    files = sorted(Path(admission_pkg.__file__).parent.glob("*.py"))
    assert len(files) >= 3
    return files


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_admission_source_has_no_collective_or_wait(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for m in mods:
                if m.startswith(("torch.distributed", "vllm.distributed")) or m.split(".")[0] in {
                    "threading",
                    "multiprocessing",
                    "asyncio",
                    "concurrent",
                    "zmq",
                }:
                    problems.append(f"line {node.lineno}: import {m}")
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name in COLLECTIVE_NAMES | BLOCKING_NAMES:
                        problems.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr in COLLECTIVE_NAMES | BLOCKING_NAMES:
            problems.append(f"line {node.lineno}: .{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "join"
            and not isinstance(node.value, ast.Constant)  # ", ".join(...) is str.join
        ):
            problems.append(f"line {node.lineno}: .join (thread/process join)")
        elif isinstance(node, ast.Name) and node.id in COLLECTIVE_NAMES | BLOCKING_NAMES:
            problems.append(f"line {node.lineno}: {node.id}")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_admission_runtime_calls_no_collective(tiny_mla_dir, monkeypatch) -> None:
    import torch.distributed as dist
    from vllm.distributed import parallel_state
    from vllm_dsa_dev.admission.harness import (
        build_scheduler,
        build_vllm_config,
        drive,
        remote_request,
    )

    from vllm_dsa_connector.admission import DSAScheduler

    calls: list[str] = []

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in sorted(COLLECTIVE_NAMES):
        if callable(getattr(dist, name, None)):
            spy(dist, name)
        if callable(getattr(parallel_state.GroupCoordinator, name, None)):
            spy(parallel_state.GroupCoordinator, name)
        if callable(getattr(parallel_state, name, None)):
            spy(parallel_state, name)
    spy(time, "sleep")
    assert len(calls) == 0

    vllm_config = build_vllm_config(str(tiny_mla_dir))
    for extra in ({}, {"admission": "budget", "admission_budget_tokens": 64}):
        sched = build_scheduler(vllm_config, DSAScheduler, extra_config=extra, num_blocks=512)
        arrivals: dict[int, list] = {}
        for i in range(20):
            arrivals.setdefault(1 + i // 4, []).append(
                remote_request(40 + 9 * i, remote=i % 5 != 0)
            )
        res = drive(sched, arrivals)
        assert len(res.finished) == 20
        assert sched.admission_totals()["admitted"] == 16
    assert calls == []
    # The wrappers do see calls (so an empty list is meaningful).
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError)):
        dist.barrier()
    assert calls and calls[-1].endswith(".barrier")
