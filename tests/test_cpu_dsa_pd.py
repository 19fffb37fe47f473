"""P/D with DSAConnector on the tiny GLM-MoE-DSA model on vLLM CPU: ``vllm-dsa demo --model-kind dsa
--turns 6 --max-tokens 40 --check``.

Real servers (prefill, decode, one reference engine), slow. The decode outputs must equal one engine's,
with KV moved every turn; the bytes must be whole 64-token blocks of MLA latent pages (4 layers) plus
indexer pages (3 owning layers of 4, ``index_topk_freq=2``), i.e. the indexer pages travel too. Prompts
span several blocks and prefix caching is on, so from turn 3 D serves the conversation's first blocks
from its own cache and only the rest comes from P (fewer blocks moved than the prompt has).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BLOCK = 64
MLA_PAGE = BLOCK * 576 * 4  # float32 latent rows
INDEXER_PAGE = BLOCK * (128 + 4)  # fp8 values + fp32 scale per token


def test_dsa_pd_demo_check_passes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_dsa_connector.cli", "demo", "--turns", "6", "--check", "--max-tokens", "40",
         "--model-kind", "dsa", "--base-port", "22300", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CHECK OK" in out
    assert sum("reference turn" in line and "identical" in line for line in out.splitlines()) == 6
    assert "attention backend CPU_DSA_SPARSE_MLA on P and D" in out
    turns = [line for line in out.splitlines() if "P/D turn" in line]
    assert len(turns) == 6, turns
    per_block = 4 * MLA_PAGE + 3 * INDEXER_PAGE
    local_hits = 0
    for line in turns:
        prompt = int(re.search(r"prompt (\d+) tok", line).group(1))
        moved = int(re.search(r"KV ([\d,]+) B moved", line).group(1).replace(",", ""))
        assert prompt > 16  # longer than index_topk: the indexer really selects
        assert moved > 0 and moved % per_block == 0, (moved, per_block)
        blocks = moved // per_block
        local_hits += blocks < -(-prompt // BLOCK)  # D held the first blocks itself
        print(f"{blocks} block(s): MLA {blocks * 4 * MLA_PAGE:,} B + indexer {blocks * 3 * INDEXER_PAGE:,} B")
    assert local_hits >= 3, turns  # turns 3..6 at least reuse D's own prefix cache
