"""Engine-level failure handling: the prefill engine is killed while decode engines wait for its KV.

Starts real vLLM servers (marked slow): one prefill engine (DSAConnector, ``kv_producer``) and two decode
engines, one with ``kv_load_failure_policy=recompute`` and one with ``fail``. A first request per decode
engine goes through normally (handshake done, KV moved). Then P prefills two more requests (their KV is
held under P's lease) and is SIGKILLed before D could take the KV; the decode engines get those requests:

- recompute: D computes the prompt locally and answers, within the connector's timeouts;
- fail: the request fails, within the timeouts;
- both decode engines keep serving afterwards, and count the failed load in their metrics.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_dsa_connector.commands.demo import (
    check_backend,
    choose_backend,
    cluster,
    engine_cmd,
    engine_env,
    metric,
    scrape,
    wait_healthy,
)

pytestmark = pytest.mark.slow

BASE = 24300
TIMEOUTS = {"handshake_timeout_s": 2.0, "transfer_timeout_s": 5.0, "kv_lease_duration": 20.0}


def _cfg(role: str, side_port: int, policy: str = "fail") -> dict:
    return {"kv_connector": "DSAConnector", "kv_role": role, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"verify_transfers": True, "side_channel_port": side_port, **TIMEOUTS}}


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def test_prefill_killed_mid_transfer(tiny_mla_dir: Path, tmp_path: Path) -> None:
    model = str(tiny_mla_dir)
    p_url, dr_url, df_url = (f"http://127.0.0.1:{BASE + i}" for i in range(3))
    prompt = {"model": model, "prompt": "The dragon painted the sky in colours nobody had seen " * 4,
              "max_tokens": 8, "temperature": 0.0}
    with cluster(tmp_path) as c:
        p = c.start("prefill", engine_cmd(tiny_mla_dir, BASE, "float32", _cfg("kv_producer", BASE + 10)),
                    engine_env("0"))
        dr = c.start("decode-recompute", engine_cmd(tiny_mla_dir, BASE + 1, "float32",
                                                    _cfg("kv_consumer", BASE + 11, "recompute")), engine_env("1"))
        df = c.start("decode-fail", engine_cmd(tiny_mla_dir, BASE + 2, "float32",
                                               _cfg("kv_consumer", BASE + 12, "fail")), engine_env("1"))
        for url in (p_url, dr_url, df_url):
            wait_healthy(url, [p, dr, df], 900)
        for proc in (p, dr, df):  # float32 asks for CPU_MLA on every CPU (AMX_MLA takes bf16 only)
            check_backend(proc, choose_backend(tiny_mla_dir, "float32"))

        def prefill() -> dict:
            status, out = _post(p_url, {**prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert status == 200, out
            return out["kv_transfer_params"]

        # 1. normal P/D on both decode engines (handshakes cached, KV moved)
        for url in (dr_url, df_url):
            status, out = _post(url, {**prompt, "kv_transfer_params": prefill()})
            assert status == 200, out
            assert metric(scrape(url), "vllm:dsa_kv_requests_total", side="recv", outcome="ok") == 1
        reference = out["choices"][0]["text"]

        # 2. P prefills two requests, then dies while holding their KV
        params_r, params_f = prefill(), prefill()
        c.stop(p, grace_s=0)  # SIGTERM then SIGKILL of the whole process group
        assert not p.alive()

        t0 = time.monotonic()
        status, out = _post(dr_url, {**prompt, "kv_transfer_params": params_r})
        elapsed_r = time.monotonic() - t0
        assert status == 200, out
        assert out["choices"][0]["text"] == reference  # recomputed locally, same greedy output
        assert elapsed_r < TIMEOUTS["transfer_timeout_s"] + 10, elapsed_r

        t0 = time.monotonic()
        status, out = _post(df_url, {**prompt, "kv_transfer_params": params_f})
        elapsed_f = time.monotonic() - t0
        failed = status != 200 or out["choices"][0].get("finish_reason") == "error"
        assert failed, out
        assert elapsed_f < TIMEOUTS["transfer_timeout_s"] + 10, elapsed_f

        # 3. both decode engines keep serving, and counted the failed load
        for url in (dr_url, df_url):
            status, out = _post(url, prompt)
            assert status == 200 and out["choices"][0]["text"], out
            m = scrape(url)
            assert metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="failed") >= 1
