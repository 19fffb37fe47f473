"""The transfer core in two real processes, without vLLM (``dev/bench/core_pd.py``, small pools on CPU): P and D
allocate GLM-5.2-shaped KV pools in vLLM's layout, handshake over the core's side channel, push requests
with scattered, out-of-order block ids through NIXL, and D checks every byte of its pools. The same script
runs full size on an H200 with ``--device cuda`` (docs/benchmarks.md, "The transfer core without vLLM")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("path", "layout"), [("direct", None), ("bounce", "LBNHC")])
def test_core_pushes_every_byte_between_two_processes(tmp_path: Path, path: str, layout: str | None) -> None:
    """``bounce``: D routes every pair through its staging arena (the gate forced) on vLLM's GPU layout, two
    pools per side: each writer's two parts share one slot, and P follows the route on every post."""
    from vllm_dsa_connector.connector.page_tables import build_offline

    (table,) = build_offline(ROOT / "vllm_dsa_connector" / "examples" / "glm5_2_shape.json",
                             kv_cache_dtype="fp8_ds_mla", num_blocks=12, layout=layout)
    assert len(table.pools) == (2 if layout else 1)
    (tmp_path / "table.json").write_text(json.dumps(table.to_dict()))
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "core_pd.py"), "--table", str(tmp_path / "table.json"),
                        "--requests", "4,3,2,1", "--out", str(out), "--path", path, "--arena-bytes", str(64 << 20)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    res = json.loads(out.read_text())
    stride = table.bytes_per_block
    assert res["ok"] and not res["vllm_in_p_or_d"]  # the two processes never imported vLLM
    assert res["posts_per_path"] == {path: 4}, res  # P followed D's route for every request
    assert [q["blocks"] for q in res["requests"]] == [4, 2, 2, 1]  # request 1: D already held one block
    assert res["bytes_moved"] == 9 * stride == sum(q["bytes"] for q in res["requests"])
    assert res["bytes_checked"] == sum(p.nbytes for p in table.pools)  # the whole pools: moved bytes and zeros
    assert all(q["post_ms"] > 0 and q["e2e_ms"] > 0 for q in res["requests"])
