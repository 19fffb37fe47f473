"""The two-process transfer harness (``vllm_dsa_dev.harness.pair``): real NIXL agents in two spawned
processes on the CPU, one control channel; and the GPU bench scripts that run on it, small, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_dsa_dev.harness.channel import Channel, Kind, run_two
from vllm_dsa_dev.harness.pair import ConsumerSide, PairSpec, ProducerSide, SideSpec, run_pair

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 96


def _runs(seed: int, blocks: int = 40, pool_blocks: int = 128) -> Any:
    from vllm_dsa_connector.core.plan.runs import Runs

    rng = np.random.default_rng(seed)
    src = rng.choice(pool_blocks, blocks, replace=False) * BLOCK
    dst = rng.choice(pool_blocks, blocks, replace=False) * BLOCK
    return Runs(src, dst, np.full(blocks, BLOCK))


def _consumer_keys(side: ConsumerSide, prefix: str) -> list[str]:
    return sorted(k for k in side.runs if k.startswith(prefix))


def _boom(side: ConsumerSide) -> None:
    raise ValueError("consumer-side failure on purpose")


def _drive_paths(side: ProducerSide, args: dict[str, Any]) -> dict[str, Any]:
    """Direct and bounce over the real sender; a send with the wrong source bytes must fail verification."""
    from vllm_dsa_dev.harness.paths.sender import BounceSender

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.gate import BounceGate

    d = side.consumer
    assert d is not None
    runs = _runs(args["seed"])
    d.runs("req", runs)
    snd = BounceSender(side.engine, side.arena, BounceGate.from_config({}))
    out: dict[str, Any] = {"keys": d.call(_consumer_keys, prefix="re")}
    for path in ("direct", "bounce"):
        tag = path.encode()
        slot = d.expect(tag, "req", bounce=path == "bounce")
        send = snd.send(side.peer, side.region, side.remote_region, runs, tag, slot=slot, path=path)
        snd.wait(send, 30)
        t = d.done()
        out[path] = {"used": send.path, "verified": d.verified(), "t_rcv": t}
    wrong = Runs(runs.src_offsets + 1, runs.dst_offsets, runs.lengths)  # one byte off on P's side
    d.expect(b"wrong", "req", bounce=False)
    snd.wait(snd.send(side.peer, side.region, side.remote_region, wrong, b"wrong", slot=None, path="direct"), 30)
    d.done()
    out["wrong_verified"] = d.verified()
    return out


def _drive_remote_failure(side: ProducerSide, args: Any) -> None:
    assert side.consumer is not None
    side.consumer.call(_boom)


def _drive_sleep(side: ProducerSide, args: Any) -> None:
    time.sleep(600)


SPEC = PairSpec(producer=SideSpec(pool_bytes=128 * BLOCK, arena_bytes=1 << 16),
                consumer=SideSpec(pool_bytes=128 * BLOCK, arena_bytes=1 << 16), seed=5, transfer_timeout_s=30)


def _children() -> set[int]:
    """Live spawned worker processes of this test process (not multiprocessing's resource tracker)."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"spawn_main" in cmd:
                out.add(int(pid))
    return out


def test_direct_and_bounce_verified_byte_for_byte() -> None:
    before = _children()
    out = run_pair(SPEC, _drive_paths, {"seed": 1}, timeout_s=180)
    assert out["keys"] == ["req"]
    for path in ("direct", "bounce"):
        assert out[path]["used"] == path and out[path]["verified"] is True, out
        assert out[path]["t_rcv"] > 0
    assert out["wrong_verified"] is False, "verification accepted bytes from the wrong source offsets"
    assert _children() <= before, "run_pair left processes behind"


def test_a_consumer_failure_reaches_the_caller() -> None:
    t0 = time.monotonic()
    # the cause first, then P's echo of it
    with pytest.raises(RuntimeError, match=r"(?s)^pair run failed: consumer: ValueError: consumer-side failure on "
                                           r"purpose.*producer: RemoteError: consumer: ValueError"):
        run_pair(SPEC, _drive_remote_failure, None, timeout_s=180)
    assert time.monotonic() - t0 < 120


def test_timeout_kills_both_processes() -> None:
    before = _children()
    with pytest.raises(RuntimeError, match="no result after 10 s"):
        run_pair(SPEC, _drive_sleep, None, timeout_s=10)
    assert _children() <= before


def _ping(ch: Channel, n: int) -> dict[str, Any]:
    ch.send(Kind.DATA, n=n)
    return {"pid": os.getpid(), "back": ch.recv(Kind.DATA).body["n"]}


def _pong(ch: Channel, add: int) -> int:
    n = ch.recv(Kind.DATA).body["n"]
    ch.send(Kind.DATA, n=n + add)
    if os.environ.get("PAIR_TEST_ENV") != "set":
        raise AssertionError("run_two's env did not reach the child")
    return os.getpid()


def test_run_two_roles_exchange_and_return_both_values() -> None:
    """The process part alone (no NIXL): two roles, one channel, both values, env applied in the children."""
    p, d = run_two(_ping, _pong, 40, 2, env={"PAIR_TEST_ENV": "set"}, timeout_s=120)
    assert p["back"] == 42 and p["pid"] != d != os.getpid()
    with pytest.raises(RuntimeError, match=r"(?s)consumer: AssertionError: run_two's env did not reach"):
        run_two(_ping, _pong, 1, 1, timeout_s=120)


def _script(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("script", ["dev/bench/gpu_transfer.py", "dev/bench/gpu_two_gpu.py", "dev/bench/gpu_mtp_graph.py"])
def test_gpu_scripts_help_on_cpu(script: str) -> None:
    proc = _script(script, "--help", timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_gpu_transfer_runs_small_on_cpu() -> None:
    """dev/bench/gpu_transfer.py's two-process path (the harness) on the CPU with a tiny request."""
    proc = _script("dev/bench/gpu_transfer.py", "--src-device", "cpu", "--dst-device", "cpu", "--pool-blocks", "32",
                   "--shapes", "8", "--mla-pages", "4", "--mla-page-bytes", "64", "--idx-pages", "2",
                   "--idx-page-bytes", "32", "--reps", "1", "--paths", "per_page,merged,direct,bounce,auto")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "shape 8 blocks" in proc.stdout and "bytes differ" not in proc.stdout
    for path in ("per_page", "merged", "direct", "bounce", "auto"):
        assert f"  {path} " in proc.stdout, proc.stdout[-2000:]
