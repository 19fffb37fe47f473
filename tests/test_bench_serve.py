"""``vllm-dsa bench serve`` smoke run: vLLM's serving benchmark through the proxy to a DSAConnector pair (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import listening, processes_on_ports

pytestmark = pytest.mark.slow

BASE = 25040  # HTTP base..base+2, side channels base+3, base+4


def _ours(base: int) -> list[str]:
    return processes_on_ports(base, 3)


def test_bench_serve_smoke(tiny_mla_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "bench", "serve", "--num-prompts", "6", "--concurrency",
         "3", "--input-len", "300", "--output-len", "8", "--model", str(tiny_mla_dir), "--base-port", str(BASE),
         "--workdir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["failed"] == 0 and s["completed"] == 6, s
    assert s["kv_ok"] >= 6 and s["kv_failed"] == 0 and s["kv_checksum_mismatches"] == 0, s
    assert s["kv_bytes"] > 0 and s["kv_transfers_timed"] >= 6, s
    assert s["total_output_tokens"] == 6 * 8 and s["mean_ttft_ms"] > 0, s
    assert "Serving Benchmark Result" in proc.stdout  # vLLM's own report ran
    deadline = time.monotonic() + 15
    while _ours(BASE) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ours(BASE), f"left behind: {_ours(BASE)}"
    assert not any(listening(BASE + i) for i in range(5))
