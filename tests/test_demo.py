"""``vllm-dsa demo --check`` end to end (real vLLM servers, slow), and its clean-up on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import listening, processes_on_ports

pytestmark = pytest.mark.slow


def _our_engines(port_base: int) -> list[str]:
    return processes_on_ports(port_base, 6)


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


def test_demo_cleans_up_on_ctrl_c(tiny_mla_dir: Path, tmp_path: Path) -> None:
    base = 24600
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--turns", "1", "--check",
         "--model", str(tiny_mla_dir), "--base-port", str(base), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_our_engines(base)) < 3 and time.monotonic() < deadline:  # P, D, reference started
            time.sleep(0.5)
        assert len(_our_engines(base)) >= 3, "demo did not start its servers"
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while _our_engines(base) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _our_engines(base), f"left behind after Ctrl-C: {_our_engines(base)}"
    assert proc.returncode != 0
