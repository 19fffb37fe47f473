"""KV lands at the right token positions: D's pages equal P's, block by block, across multi-turn prefix hits.

Real servers (slow): a DSAConnector prefill and decode engine with the :mod:`vllm_dsa_dev.kv_probe`
worker extension. Each turn sends a prompt of whole blocks plus one token through P (``max_tokens=1``)
and D (P's ``kv_transfer_params``); while D's request runs, the probe returns D's block list (from D's
scheduler) and a CRC32 per full prompt block over every KV layer (MLA latent and indexer K). The same
prompt sent to P alone (its blocks are prefix-cache hits of the prefill) gives P's digests. They must be
equal for every block. Turn 2 and 3 reuse a prefix, so D serves the first blocks from its own prefix
cache and only the rest comes from P: a connector pairing D's remaining blocks with P's FIRST blocks
(instead of the blocks of the same positions) fails here, although its byte checksums pass.

Cases (each states the backend it expects; the engines' logs must report it):
- ``dsa``: the tiny GLM-MoE-DSA model on the plugin's CPU_DSA_SPARSE_MLA, float32, block 64, prefix caching
  on (every CPU).
- ``amx_mla``: the tiny MLA model as AMX users run it: AMX_MLA, bf16, block 32, prefix caching on. Needs AMX
  tiles (``amx_bf16``/``amx_tile``): skipped elsewhere, since vLLM refuses AMX_MLA there. A check by digests
  does not depend on bf16 argmax luck.
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port
from vllm_dsa_dev.harness.client import metric, probe_running, scrape
from vllm_dsa_dev.harness.engines import (
    BackendChoice,
    check_backend,
    choose_backend,
    cpu_has_amx,
    engine_cmd,
    engine_env,
)
from vllm_dsa_dev.harness.procs import Cluster, cluster, wait_healthy

pytestmark = pytest.mark.slow

PROBE = ["--worker-extension-cls", "vllm_dsa_dev.kv_probe.KVProbe"]


@dataclass
class Pair:
    p_url: str
    d_url: str
    model: str
    block_size: int


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _start(c: Cluster, tmp: Path, model: Path, dtype: str, backend: BackendChoice, extra: list[str]) -> Pair:
    p_port, d_port, p_side, d_side = (free_port() for _ in range(4))
    env = {"VLLM_SERVER_DEV_MODE": "1"}

    def cfg(role: str, side: int) -> dict[str, Any]:
        return {"kv_connector": "DSAConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"verify_transfers": True, "side_channel_port": side}}

    p = c.start("prefill", engine_cmd(model, p_port, dtype, cfg("kv_producer", p_side), backend=backend,
                                      extra=PROBE + extra), {**engine_env("0"), **env})
    d = c.start("decode", engine_cmd(model, d_port, dtype, cfg("kv_consumer", d_side), backend=backend,
                                     extra=PROBE + extra), {**engine_env("1"), **env})
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    for url in (p_url, d_url):
        wait_healthy(url, [p, d], 900)
    for proc in (p, d):
        check_backend(proc, backend)
    models = json.loads(urllib.request.urlopen(p_url + "/v1/models", timeout=10).read())
    block = 64 if backend.expected == "CPU_DSA_SPARSE_MLA" else 32
    return Pair(p_url, d_url, models["data"][0]["id"], block)


@pytest.fixture(scope="module", params=["dsa", "amx_mla"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp(f"placement-{request.param}")
    if request.param == "dsa":
        from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

        model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
        dtype, extra = "float32", []
        backend = choose_backend(model, dtype)
    else:
        if not cpu_has_amx():
            pytest.skip("no AMX tiles on this CPU: vLLM runs AMX_MLA only where amx_tile exists "
                        "(CI covers it on AMX machines)")
        from vllm_dsa_dev.tiny_models import make_tiny_mla

        model = make_tiny_mla()
        dtype, extra = "bfloat16", ["--block-size", "32"]
        backend = choose_backend(model, dtype, "AMX_MLA")
    with cluster(tmp) as c:
        yield _start(c, tmp, model, dtype, backend, extra)


def _turn(pair: Pair, ids: list[int]) -> tuple[dict, dict]:
    out = _post(pair.p_url, "/v1/completions", {"model": pair.model, "prompt": ids, "max_tokens": 1,
                                                "kv_transfer_params": {"do_remote_decode": True}})
    params = out["kv_transfer_params"]
    assert params and params["remote_block_ids"], out
    (d,) = probe_running(pair.d_url, pair.model, ids, params)
    (p,) = probe_running(pair.p_url, pair.model, ids, None)
    return p, d


def test_kv_lands_at_the_same_positions(pair: Pair) -> None:
    b = pair.block_size
    rng = random.Random(7)
    new = lambda n: [rng.randrange(100, 1000) for _ in range(n)]  # noqa: E731
    x = new(3 * b + 1)
    y = x[: 3 * b] + new(2 * b + 1)  # D holds x's 3 full blocks: only blocks 3.. come from P
    z = y[: 2 * b] + new(3 * b + 1)  # D holds 2 blocks; P too
    recv_before = metric(scrape(pair.d_url), "vllm:dsa_kv_bytes_total", side="recv")
    moved = []
    for turn, ids in enumerate((x, y, z), 1):
        p, d = _turn(pair, ids)
        full = (len(ids) - 1) // b
        assert len(p["digests"]) == len(d["digests"]) == full, (turn, p, d)
        bad = [j for j in range(full) if p["digests"][j] != d["digests"][j]]
        assert not bad, (f"turn {turn}: D's blocks at positions {[(j * b, (j + 1) * b) for j in bad]} differ "
                         f"from P's (P blocks {p['block_ids']}, D blocks {d['block_ids']})")
        recv = metric(scrape(pair.d_url), "vllm:dsa_kv_bytes_total", side="recv")
        moved.append(recv - recv_before)
        recv_before = recv
    # D's own prefix cache served part of turns 2 and 3: fewer bytes than turn 1's blocks would need
    per_block = moved[0] / 4  # turn 1 moved 3 full blocks + the one-token block
    assert moved[1] < 6 * per_block and moved[2] < 6 * per_block, moved
