"""Why D did not load a request from P (issue 47 item 2), without engines: the reason of each failure text D's
code writes, ``vllm-dsa explain``, the docs' table, and a real D scheduler counting, logging and recording a
load whose ``kv_transfer_params`` lack a key -- with records off it builds none (no per-request cost)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_dsa_connector.core.handoff.messages import MessageError
from vllm_dsa_connector.core.handoff.recompute import (
    FIXES,
    REASONS,
    classify,
    missing_key,
    params_reason,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("why", "reason"), [
    (f"DSAConnector handshake with P failed: {MessageError('bad HMAC: the peer' + chr(39) + 's auth_secret differs')!r}",
     "auth_failed"),
    (f"DSAConnector handshake with P failed: {MessageError('protocol mismatch: peer speaks 7, this side 8')!r}",
     "version_mismatch"),
    ("DSAConnector peer 10.0.0.1:5600 refused the handshake: not ready", "handshake_failed"),
    ("the handshake with P p0 is being redone (P restarted?)", "peer_restarted"),
    ("kv_transfer_params name P p0's start 00000000000000ab, P is now 00000000000000cd (restarted: the lease is gone)",
     "peer_restarted"),
    ("P refused the registration: unknown or expired lease", "p_refused"),
    ("P p0 refused the heartbeat: unknown lease", "p_refused"),
    ("registration unanswered: timed out (P confirmed nothing was written)", "p_unreachable"),
    ("block pairing: remote_block_ids outside P's pools (0..9)", "block_pairing"),
    ("no KV after 30.0 s (write bound passed)", "timeout"),
    ("something new", "other"),
])
def test_each_failure_text_has_its_reason(why: str, reason: str) -> None:
    assert classify(why) == reason


def test_params_reasons_name_the_missing_key() -> None:
    from vllm_dsa_connector.core.handoff.params import RemoteParams

    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_token": "t",
              "remote_host": "h", "remote_port": 1, "remote_block_ids": [1]}
    with pytest.raises(ValueError) as e:
        RemoteParams.from_dict(params)
    assert missing_key(str(e.value)) == "remote_num_tokens"
    assert params_reason("malformed", str(e.value)) == "params_missing_key"
    with pytest.raises(ValueError) as e:
        RemoteParams.from_dict({**params, "remote_num_tokens": "16"})
    assert params_reason("malformed", str(e.value)) == "params_malformed"
    assert params_reason("other_connector", "transfer_mode 'pull'") == "params_other_connector"


def _explain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_dsa_connector.cli", "explain", *args], capture_output=True,
                          text=True, timeout=120)


def test_explain_prints_each_reason_s_fix() -> None:
    every = _explain()
    assert every.returncode == 0, every.stderr
    for reason in REASONS:
        assert f"\n{reason}\n" in f"\n{every.stdout}", reason
    one = _explain("params_missing_key")
    assert one.returncode == 0 and "remote_num_tokens" in one.stdout and "fix:" in one.stdout, one.stdout
    bad = _explain("no_such_reason")
    assert bad.returncode == 2 and "params_missing_key" in bad.stderr, bad.stderr


def test_docs_list_every_reason() -> None:
    """docs/deployment.md's table says what ``vllm-dsa explain`` says: every reason, nothing else."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    assert set(REASONS) <= rows, set(REASONS) - rows
    assert set(FIXES) == set(REASONS)


# ------------------------------------------------------------------ a real D scheduler


def _scheduler(model: Path, extra: dict):
    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    vllm.plugins.load_general_plugins()
    cfg = EngineArgs(model=str(model), enforce_eager=True, dtype="float32", max_model_len=2048,
                     kv_transfer_config=KVTransferConfig(kv_connector="DSAConnector", kv_role="kv_consumer",
                                                         kv_connector_extra_config=extra)).create_engine_config()
    return DSAConnectorScheduler(cfg, "D", ConnectorOptions.from_config(extra))


@pytest.fixture(scope="module")
def schedulers(tiny_mla_dir: Path):
    on, off = _scheduler(tiny_mla_dir, {"request_records": "log"}), _scheduler(tiny_mla_dir, {})
    yield on, off
    on.shutdown()
    off.shutdown()


def _dropped_key_load(d, req_id: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p-1", "remote_token": "t",
              "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [1, 2]}  # no remote_num_tokens
    req = Request(req_id, list(range(100, 132)), SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                  None)
    assert d.get_num_new_matched_tokens(req, 0) == (32, True)  # claimed: the load fails, the policy decides
    d.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(block_id=7), KVCacheBlock(block_id=8)],)), 32)
    assert req_id in d.build_connector_meta(None).fail_recv


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(d, req_id: str) -> list[str]:
    handler = _Lines()
    loggers = [logging.getLogger(f"vllm.vllm_dsa_connector.connector.{m}") for m in ("scheduler", "record")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        _dropped_key_load(d, req_id)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    return handler.lines


def test_a_dropped_key_is_counted_logged_and_recorded(schedulers) -> None:
    from vllm_dsa_connector.core.worker.counters import failure_key

    on, _ = schedulers
    on.get_stats()
    lines = _logged(on, "d-dropped-0")
    assert on.get_stats().data[failure_key("params_missing_key")] == 1
    (line,) = [x for x in lines if "not loaded from P" in x]
    assert "reason params_missing_key" in line and "remote_num_tokens" in line
    assert "vllm-dsa explain params_missing_key" in line
    (rec,) = [json.loads(x.split("request record ", 1)[1]) for x in lines if "request record " in x]
    assert rec["request_id"] == "d-dropped-0" and rec["side"] == "load" and rec["outcome"] == "failed"
    assert rec["reason"] == "params_missing_key" and rec["missing_key"] == "remote_num_tokens"
    assert rec["p_engine"] == "P" and rec["p_request_id"] == "p-1" and "start" in rec["phases_ms"]


def test_records_off_build_nothing_per_request(schedulers) -> None:
    """``request_records`` off and no tracing: no record object exists (``records`` is None: a use the flow
    reaches unguarded would raise), no record line; the failure is still counted and logged."""
    from vllm_dsa_connector.core.worker.counters import failure_key

    _, off = schedulers
    assert off.records is None
    off.get_stats()
    lines = _logged(off, "d-dropped-1")
    assert off.get_stats().data[failure_key("params_missing_key")] == 1
    assert any("not loaded from P" in x for x in lines) and not any("request record" in x for x in lines)
