"""``vllm-dsa bench pd`` without engines: the three pairs' configurations, --help and argument errors.

The bench itself starts seven vLLM servers (minutes); it is run by hand (docs/benchmarks.md), never timed here.
"""

from __future__ import annotations

import argparse

import pytest

from vllm_dsa_connector.commands import bench_pd


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    bench_pd.add_arguments(p)
    return p


@pytest.mark.parametrize("key", sorted(bench_pd.CONNECTORS))
def test_pair_configs_differ_only_in_the_connector(key: str) -> None:
    p_cfg, d_cfg, env = bench_pd._pair_configs(key, 24410)
    assert p_cfg["kv_connector"] == d_cfg["kv_connector"] == bench_pd.CONNECTORS[key]["name"]
    assert (p_cfg["kv_role"], d_cfg["kv_role"]) == ("kv_producer", "kv_consumer")
    for cfg in (p_cfg, d_cfg):
        assert cfg["kv_connector_extra_config"]["kv_lease_duration"] == 120
    if key == "dsa":
        assert env == {}
        assert p_cfg["kv_connector_extra_config"]["side_channel_port"] == 24413
        assert d_cfg["kv_connector_extra_config"]["side_channel_port"] == 24414
    else:
        assert env == {"prefill": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "24413"},
                       "decode": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "24414"}}
    if key == "nixl_push":  # its D fails a registration after this long without the WRITE
        assert d_cfg["kv_connector_extra_config"]["push_registration_timeout"] == 120


def test_help_says_how_transfer_time_is_measured() -> None:
    text = " ".join(_parser().format_help().split())
    assert "xferDuration" in text and "NixlPushConnector" in text and "--together" in text


def test_unknown_connector_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["--connectors", "dsa,bogus", "--model", "/nonexistent"])
    assert bench_pd.run(args) == 2
    assert "bogus" in capsys.readouterr().err
