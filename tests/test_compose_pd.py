"""MultiConnector[DSAConnector, vLLM's ExampleConnector] as a real P/D pair on CPU (slow).

One P/D pair plus the demo's reference engine, through ``vllm-dsa demo --compose --check``: decode output
identical to one engine without a connector, KV moved and checksummed every turn (read from the
``vllm:dsa_*`` Prometheus series, which MultiConnector must still report), ExampleConnector stored every
prompt, and on D it had a hit for every prompt it got from P, which DSAConnector (first) still served.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BASE = 25220  # P, D, proxy, side channels, reference: BASE..BASE+5


def _live(base: int) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(f"--port {base + i}" in cmd for i in range(6)):
            out.append(f"{pid}: {cmd[:120]}")
    return out


def test_compose_demo_check_passes(tiny_mla_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--compose", "--check", "--turns", "2",
         "--max-tokens", "12", "--model", str(tiny_mla_dir), "--base-port", str(BASE), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "MultiConnector[DSAConnector, ExampleConnector]" in out and "CHECK OK" in out, out[-2000:]
    assert sum("reference turn" in line and "identical" in line for line in out.splitlines()) == 2
    turns = [line for line in out.splitlines() if "P/D turn" in line]
    assert len(turns) == 2 and all("runs checksummed" in t and " 0 B moved" not in t for t in turns), turns
    assert "ExampleConnector stored 2 prompts" in out, out[-2000:]
    p_log, d_log = (tmp_path / "prefill.log").read_text(), (tmp_path / "decode.log").read_text()
    for log in (p_log, d_log):
        assert "Creating v1 connector with name: MultiConnector" in log
    # D's ExampleConnector found P's stored prompt every turn; DSAConnector, first, still loaded from P
    assert d_log.count("External Cache Hit!") >= 2, d_log[-3000:]
    assert "Inject KV cache" not in d_log
    assert not _live(BASE), "demo left processes behind"
    for i in range(6):
        with socket.socket() as s:
            s.settimeout(0.5)
            assert s.connect_ex(("127.0.0.1", BASE + i)) != 0, BASE + i


def test_compose_demo_refuses_a_dsa_model_up_front(tmp_path: Path) -> None:
    """ExampleConnector stores KV from per-layer hooks: refused for DSA models before anything starts."""
    model = tmp_path / "dsa"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 16}')
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--compose", "--model", str(model),
         "--base-port", str(BASE), "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot store KV of a DSA model" in proc.stderr and "indexer" in proc.stderr, proc.stderr
    assert not _live(BASE)
