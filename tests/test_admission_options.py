"""Admission options: parsing, clear errors naming the key, and the keys exported for the connector."""

from __future__ import annotations

import pytest

from vllm_dsa_connector.admission.options import ADMISSION_OPTION_KEYS, AdmissionConfig
from vllm_dsa_connector.admission.policy import AdmissionLedger
from vllm_dsa_connector.options import OptionError


def test_admission_defaults_are_passthrough() -> None:
    cfg = AdmissionConfig.from_extra_config({}, environ={})
    assert cfg.policy == "passthrough"
    assert cfg.budget_blocks(16) is None
    assert AdmissionConfig.from_extra_config(None, environ={}) == cfg


def test_admission_budget_parses_and_rounds_up_to_blocks() -> None:
    cfg = AdmissionConfig.from_extra_config(
        {"admission": "budget", "admission_budget_tokens": "4k", "admission_timeout_s": "2.5"},
        environ={},
    )
    assert (cfg.policy, cfg.budget_tokens, cfg.timeout_s) == ("budget", 4096, 2.5)
    assert cfg.budget_blocks(16) == 256
    assert AdmissionConfig("budget", 17).budget_blocks(16) == 2


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"admission": "fifo"}, "admission"),
        ({"admission": "budget"}, "admission_budget_tokens"),
        ({"admission": "budget", "admission_budget_tokens": 0}, "admission_budget_tokens"),
        ({"admission": "budget", "admission_budget_tokens": "lots"}, "admission_budget_tokens"),
        ({"admission": "budget", "admission_budget_tokens": True}, "admission_budget_tokens"),
        ({"admission_timeout_s": 0}, "admission_timeout_s"),
        ({"admission_timeout_s": "nan"}, "admission_timeout_s"),
        ({"admission_log_interval_s": -1}, "admission_log_interval_s"),
        ({"admission_budget_token": 64}, "admission_budget_token"),  # a typo is not ignored
    ],
)
def test_admission_invalid_values_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(OptionError) as err:
        AdmissionConfig.from_extra_config(extra, environ={})
    assert str(err.value).startswith(key + ":"), str(err.value)


def test_admission_env_is_below_explicit_config() -> None:
    env = {"VLLM_DSA_ADMISSION": "budget", "VLLM_DSA_ADMISSION_BUDGET_TOKENS": "64"}
    assert AdmissionConfig.from_extra_config({}, environ=env).budget_tokens == 64
    assert AdmissionConfig.from_extra_config({"admission": "passthrough"}, environ=env).policy == (
        "passthrough"
    )
    with pytest.raises(OptionError, match="VLLM_DSA_ADMISSION"):
        AdmissionConfig.from_extra_config({}, environ={"VLLM_DSA_ADMISSION": "nope"})


def test_admission_option_keys_cover_every_key_read() -> None:
    assert isinstance(ADMISSION_OPTION_KEYS, frozenset)
    assert ADMISSION_OPTION_KEYS == {
        "admission",
        "admission_budget_tokens",
        "admission_timeout_s",
        "admission_log_interval_s",
    }
    # Unknown keys (the connector's own) are not this module's business.
    AdmissionConfig.from_extra_config({"some_connector_key": 1}, environ={})


def test_admission_ledger_fcfs_stop_and_oversized_first() -> None:
    """The decision alone (the scheduler tests drive it through real vLLM schedulers)."""
    ledger = AdmissionLedger(AdmissionConfig("budget", 10 * 16), block_size=16)
    ledger.begin_step()
    assert ledger.admit("a", 6 * 16)
    ledger.started("a", 6 * 16)
    assert not ledger.admit("b", 5 * 16)  # 6 + 5 > 10: stops admission behind it
    assert not ledger.admit("c", 1)  # would fit, but FCFS
    stats = ledger.end_step(1)
    assert stats is not None and (stats.admitted, stats.deferred, stats.in_flight_blocks) == (
        1,
        2,
        6,
    )
    ledger.begin_step()
    ledger.ended("a")
    assert ledger.admit("big", 40 * 16)  # larger than the budget, nothing in flight
    assert not ledger.admit("c", 1)
    ledger.end_step(2)  # "big" never started (e.g. not allocated): its reservation is released
    assert ledger.in_flight_blocks == 0
