"""The transfer core in two real processes, without vLLM (``bench/core_pd.py``, small pools on CPU): P and D
allocate GLM-5.2-shaped KV pools in vLLM's layout, handshake over the core's side channel, push requests
with scattered, out-of-order block ids through NIXL, and D checks every byte of its pools. The same script
runs full size on an H200 with ``--device cuda`` (docs/benchmarks.md, "The transfer core without vLLM")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_core_pushes_every_byte_between_two_processes(tmp_path: Path) -> None:
    from vllm_dsa_connector.layout import build_offline

    (table,) = build_offline(ROOT / "vllm_dsa_connector" / "examples" / "glm5_2_shape.json",
                             kv_cache_dtype="fp8_ds_mla", num_blocks=12)
    (tmp_path / "table.json").write_text(json.dumps(table.to_dict()))
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "core_pd.py"), "--table", str(tmp_path / "table.json"),
                        "--requests", "4,3,2,1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    res = json.loads(out.read_text())
    stride = table.pools[0].block_stride
    assert res["ok"] and not res["vllm_in_p_or_d"]  # the two processes never imported vLLM
    assert [q["blocks"] for q in res["requests"]] == [4, 2, 2, 1]  # request 1: D already held one block
    assert res["bytes_moved"] == 9 * stride == sum(q["bytes"] for q in res["requests"])
    assert res["bytes_checked"] == 12 * stride  # the whole pool: moved bytes and untouched zeros
    assert all(q["post_ms"] > 0 and q["e2e_ms"] > 0 for q in res["requests"])
