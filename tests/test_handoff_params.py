"""``kv_transfer_params`` typed once (``core/handoff/params.py``): what each side writes is what the next reads, and
every string and list in them is bounded."""

from __future__ import annotations

import json

import pytest

from vllm_dsa_connector.core.handoff.messages import transfer_ref
from vllm_dsa_connector.core.handoff.params import (
    EarlyParams,
    PrefillParams,
    RemoteParams,
    is_early_prefill,
)
from vllm_dsa_connector.proxy.bodies import prefill_body

TID = "a" * 32


def _p_answer() -> dict:
    """What P's scheduler hands out (``RemoteParams.to_dict``), as the proxy receives it (through JSON)."""
    out = RemoteParams(
        remote_engine_id="P",
        remote_request_id="p-1",
        remote_host="10.0.0.2",
        remote_port=5600,
        remote_block_ids=[3, 4],
        remote_num_tokens=20,
        remote_token="tok",
        remote_epoch=7,
        tp_size=2,
    ).to_dict()
    return json.loads(json.dumps(out))


def test_ps_answer_is_what_d_reads() -> None:
    answer = _p_answer()
    assert answer["kv_connector"] == "DSAConnector" and answer["transfer_mode"] == "dsa-push"
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    assert set(answer) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_epoch",
        "remote_request_id",
        "remote_token",
        "remote_host",
        "remote_port",
        "remote_block_ids",
        "remote_num_tokens",
        "tp_size",
        "pp_size",
        "transfer_mode",
        "kv_connector",
    }
    rp = RemoteParams.from_dict(answer)
    assert (rp.remote_engine_id, rp.remote_request_id, rp.remote_block_ids, rp.remote_epoch) == (
        "P",
        "p-1",
        [3, 4],
        7,
    )
    assert not rp.early


def test_the_prefill_leg_carries_the_routers_keys_and_an_early_transfer_id() -> None:
    plain = prefill_body({"prompt": "x"})["kv_transfer_params"]
    assert plain == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert not is_early_prefill(plain)
    early = prefill_body({"prompt": "x"}, TID)["kv_transfer_params"]
    assert early == {**plain, "transfer_id": TID} == PrefillParams(transfer_id=TID).to_dict()
    assert is_early_prefill(early)


def test_early_params_from_ps_answer_are_read_by_d_as_the_transfer_ids_request() -> None:
    ep = EarlyParams.from_answer(_p_answer(), TID)
    assert ep is not None
    sent = json.loads(json.dumps(ep.to_dict()))
    assert sent == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "transfer_id": TID,
        "transfer_mode": "dsa-push",
        "kv_connector": "DSAConnector",
    }
    rp = RemoteParams.from_dict(sent)
    assert rp.early and rp.ref == transfer_ref(TID) and rp.remote_block_ids == []
    assert EarlyParams.from_answer({**_p_answer(), "kv_connector": "NixlConnector"}, TID) is None
    assert EarlyParams.from_answer({**_p_answer(), "remote_port": None}, TID) is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_host", "h" * 600),
        ("transfer_mode", "m" * 600),
        ("remote_block_ids", list(range((1 << 18) + 1))),
    ],
)
def test_oversize_params_are_malformed_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"malformed kv_transfer_params: .*{key}"):
        RemoteParams.from_dict({**_p_answer(), key: value})


def test_keys_d_does_not_read_never_fail_its_load() -> None:
    """P's word to the router (sizes, connector name) is not D's to check: a router rewriting them leaves the
    load alone (the connector name is checked before, by ``core.handoff.params.other_connector``)."""
    rp = RemoteParams.from_dict(
        {**_p_answer(), "tp_size": "two", "pp_size": None, "kv_connector": 3}
    )
    assert rp.remote_request_id == "p-1"
