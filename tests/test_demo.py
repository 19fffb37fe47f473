"""``vllm-dsa demo --check`` end to end (real vLLM servers, slow), its clean-up on Ctrl-C, and its layout flags
(``--prefill-tp/--prefill-pp/--decode-tp/--decode-pp``; the reshard itself is tests/test_engine_reshard.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import listening, processes_on_ports


def _our_engines(port_base: int) -> list[str]:
    return processes_on_ports(port_base, 6)


@pytest.mark.slow
def test_demo_check_passes(tiny_mla_dir: Path, tmp_path: Path) -> None:
    base = 24500
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--turns", "2", "--check", "--max-tokens", "12",
         "--model", str(tiny_mla_dir), "--base-port", str(base), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CHECK OK" in out
    assert sum("reference turn" in line and "identical" in line for line in out.splitlines()) == 2
    turns = [line for line in out.splitlines() if "P/D turn" in line]
    assert len(turns) == 2 and all("runs checksummed" in t and " 0 B moved" not in t for t in turns), turns
    assert not _our_engines(base), "demo left processes behind"
    assert not any(listening(base + i) for i in range(6))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_demo_cleans_up_on_ctrl_c(tiny_mla_dir: Path, tmp_path: Path) -> None:
    """A SIGINT while the servers start stops every one of them, also when the demo was started with SIGINT
    ignored: bash gives a background job (``cmd &`` with job control off, as in a CI script) SIG_IGN and
    Python keeps it; the demo's :func:`~vllm_dsa_dev.harness.procs.cluster` installs its own handler.
    (Before it did, the demo ignored this SIGINT in the sharded CI and was SIGKILLed, its servers left.)"""
    base = 24600
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--turns", "1", "--check",
         "--model", str(tiny_mla_dir), "--base-port", str(base), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_ignore_sigint,
    )
    left: list[str] = []
    try:
        try:
            deadline = time.monotonic() + 120
            while len(_our_engines(base)) < 3 and time.monotonic() < deadline:  # P, D, reference started
                time.sleep(0.5)
            assert len(_our_engines(base)) >= 3, "demo did not start its servers"
            time.sleep(3)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)  # hang guard: all servers are stopped at once
        finally:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 30
        while _our_engines(base) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _our_engines(base)
        assert not left, f"left behind after Ctrl-C: {left}"
        assert proc.returncode == 130 and "vllm-dsa: interrupted" in out, out[-3000:]
    finally:
        for line in left:  # never leave servers running for the rest of the suite
            with contextlib.suppress(OSError):
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)


def test_layout_flags_parse_and_refuse_zero(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_dsa_dev.commands import demo
    from vllm_dsa_dev.harness.engines import NOBIND, Layout, engine_env

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--prefill-tp", "2", "--decode-pp", "2"])
    assert (args.prefill_tp, args.prefill_pp, args.decode_tp, args.decode_pp) == (2, 1, 1, 2)
    assert Layout(args.decode_tp, args.decode_pp).args()[-4:] == ["--pipeline-parallel-size", "2",
                                                                   "--distributed-executor-backend", "mp"]
    assert Layout(1, 2).label == "pp2" and Layout().args() == []
    ncpu = os.cpu_count() or 1
    if ncpu >= 2:  # one core per rank while the host's ranks fit its cores ...
        assert Layout(2, 1).bind(0) == "0|1" and Layout(2, 1).bind(1, host_ranks=2) == "1|0"
    # ... else every engine leaves placement to the kernel, one OpenMP thread per rank
    assert Layout(2, 1).bind(0, host_ranks=ncpu + 1) == NOBIND == Layout().bind(1, host_ranks=ncpu + 1)
    assert engine_env(NOBIND)["OMP_NUM_THREADS"] == "1" and engine_env("0").get("OMP_NUM_THREADS") == \
        os.environ.get("OMP_NUM_THREADS")
    assert demo.run(parser.parse_args(["--decode-tp", "0"])) == 2  # refused before anything starts
    assert "tp=0" in capsys.readouterr().err


def test_pp_partition_starts_every_stage_with_an_owning_layer(tmp_path: Path) -> None:
    import json

    from vllm_dsa_dev.harness.engines import pp_layer_partition

    (tmp_path / "config.json").write_text(json.dumps({"indexer_types": ["full", "full", "shared", "full"]}))
    assert pp_layer_partition(tmp_path, 2) == "3,1"  # vLLM's even 2,2 would start stage 1 on a shared layer
    assert pp_layer_partition(tmp_path, 1) is None
    with pytest.raises(ValueError, match="too few 'full' layers to start 4"):
        pp_layer_partition(tmp_path, 4)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    assert pp_layer_partition(tmp_path, 2) is None  # no indexer: vLLM's even split
