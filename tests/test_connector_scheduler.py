"""Scheduler side of DSAConnector with a real VllmConfig, real vLLM Requests and the real side channel:
leases, heartbeats, registrations, cancellation, aborts (P side); the D side's refusal of a dead peer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

LEASE_S = 0.6


@pytest.fixture(scope="module")
def producer(tiny_mla_dir: Path):
    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    vllm.plugins.load_general_plugins()
    extra = {"kv_lease_duration": LEASE_S, "side_channel_port": 24970, "handshake_timeout_s": 2}
    cfg = EngineArgs(model=str(tiny_mla_dir), enforce_eager=True, dtype="float32", max_model_len=2048,
                     kv_transfer_config=KVTransferConfig(kv_connector="DSAConnector", kv_role="kv_producer",
                                                         kv_connector_extra_config=extra)).create_engine_config()
    sched = DSAConnectorScheduler(cfg, "P-test", ConnectorOptions.from_config(extra))
    yield sched
    sched.shutdown()


def _finished(req_id: str, status_name: str = "FINISHED_LENGTH_CAPPED", params: dict | None = None):
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params or {"do_remote_decode": True}})
    r = Request(req_id, list(range(40)), sp, None)
    r.status = getattr(RequestStatus, status_name)
    return r


def _output(sending: set[str]):
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_sending=sending)


def test_lease_heartbeat_and_expiry(producer) -> None:
    from vllm_dsa_connector.connector.handshake import request

    delay, params = producer.request_finished(_finished("r-lease"), ([4, 5, 6],))
    assert delay is True and params["remote_block_ids"] == [4, 5, 6]
    assert params["remote_port"] == producer.server.port and params["transfer_mode"] == "push"
    assert producer.has_pending_push_work()
    for _ in range(3):  # D's heartbeats keep the lease alive past its duration
        time.sleep(LEASE_S / 2)
        assert request("127.0.0.1", producer.server.port, "hb", ["r-lease"], 2.0)["ok"]
        assert "r-lease" not in producer.build_connector_meta(None).release
    time.sleep(LEASE_S + 0.1)  # no heartbeat: the lease expires, the workers release the blocks
    assert producer.build_connector_meta(None).release == ["r-lease"]
    assert producer.build_connector_meta(None).release == []  # once
    producer.update_connector_output(_output({"r-lease"}))
    assert not producer.has_pending_push_work()


def test_registration_becomes_one_push_job(producer) -> None:
    from vllm_dsa_connector.connector.handshake import request

    producer.request_finished(_finished("r-reg"), ([7, 8],))
    port = producer.server.port
    unknown = request("127.0.0.1", port, "reg", {"p_req": "nope", "d_engine": "D", "d_req": "x", "d_blocks": [1]}, 2)
    assert not unknown["ok"] and "no KV for request nope" in unknown["error"]
    body = {"p_req": "r-reg", "d_engine": "D1", "d_req": "d-1", "d_blocks": [30, 31], "d_payloads": [b"x"],
            "slots": {0: {0: [512, 4096]}}}
    assert request("127.0.0.1", port, "reg", body, 2)["ok"]
    again = request("127.0.0.1", port, "reg", body, 2)
    assert not again["ok"] and "already registered" in again["error"]
    meta = producer.build_connector_meta(None)
    assert [p.engine_id for p in meta.peers] == ["D1"]
    (job,) = meta.push
    assert (job.req_id, job.dst_req_id, job.src_blocks, job.dst_blocks) == ("r-reg", "d-1", [7, 8], [30, 31])
    assert job.slots == {0: {0: [512, 4096]}}
    assert not producer.build_connector_meta(None).push  # dispatched once
    producer.update_connector_output(_output({"r-reg"}))
    assert "r-reg" not in producer._leases


def test_cancel_and_abort_free_blocks(producer) -> None:
    from vllm_dsa_connector.connector.handshake import request

    producer.request_finished(_finished("r-cancel"), ([9],))
    assert request("127.0.0.1", producer.server.port, "cancel", ["r-cancel"], 2)["ok"]
    assert producer.build_connector_meta(None).release == ["r-cancel"]
    producer.update_connector_output(_output({"r-cancel"}))
    # an aborted prefill is not handed to D: its blocks are freed at once
    assert producer.request_finished(_finished("r-abort", "FINISHED_ABORTED"), ([3],)) == (False, None)
    assert not producer.has_pending_push_work()


def test_decode_side_dead_producer_is_a_load_failure(producer) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "P-dead", "remote_request_id": "x",
              "remote_host": "127.0.0.1", "remote_port": 24971, "remote_block_ids": [1, 2, 3],
              "transfer_mode": "push"}
    req = _finished("d-dead", "WAITING", params)
    assert producer.get_num_new_matched_tokens(req, 0) == (None, False)  # handshake in flight: ask later
    deadline = time.monotonic() + 10
    while (res := producer.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # policy fail (the default): the tokens are claimed, the load fails at once, reported to the workers
    assert res == (40, True)
    assert "did not answer" in producer._peers["P-dead"].error
