"""``vllm-dsa bench pd`` without engines: the pairs' configurations, ports, --help, argument errors and the
TTFT comparison against the one engine.

The bench itself starts seven vLLM servers (minutes); it is run by hand (docs/benchmarks.md), never timed here.
"""

from __future__ import annotations

import argparse

import pytest
from vllm_dsa_dev.commands import bench_pd


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
    if key.startswith("dsa"):
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
    assert "one per (request, destination rank)" in text


def test_unknown_connector_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["--connectors", "dsa,bogus", "--model", "/nonexistent"])
    assert bench_pd.run(args) == 2
    assert "bogus" in capsys.readouterr().err


def test_early_pairs_differ_from_dsa_only_in_the_mode() -> None:
    """dsa_early: the proxy's --early-registration and D recomputing a failed load; dsa_layered: the same and
    P's layer_push."""
    dsa_p, dsa_d, _ = bench_pd._pair_configs("dsa", 24410)
    early_p, early_d, _ = bench_pd._pair_configs("dsa_early", 24410)
    layered_p, layered_d, _ = bench_pd._pair_configs("dsa_layered", 24410)
    assert early_p == dsa_p and "layer_push" not in early_p["kv_connector_extra_config"]
    assert early_d == layered_d == {**dsa_d, "kv_load_failure_policy": "recompute"}
    assert layered_p["kv_connector_extra_config"] == {**dsa_p["kv_connector_extra_config"], "layer_push": True}
    assert "proxy_args" not in bench_pd.CONNECTORS["dsa"]
    for key in ("dsa_early", "dsa_layered"):
        assert bench_pd.CONNECTORS[key]["proxy_args"] == ("--early-registration",)


def test_every_pair_and_the_one_engine_have_their_own_ports() -> None:
    assert set(bench_pd.SLOTS) == {*bench_pd.CONNECTORS, bench_pd.SINGLE}
    assert len(set(bench_pd.SLOTS.values())) == len(bench_pd.SLOTS)
    assert bench_pd.SLOTS[bench_pd.SINGLE] == 4  # base + 40, as before the early pairs


def test_pairs_and_prefill_chunks_parse() -> None:
    args = _parser().parse_args(["--pairs", "dsa,dsa_early,dsa_layered", "--prefill-max-batched-tokens", "128",
                                 "--model-kind", "dsa"])
    assert (args.connectors, args.prefill_max_batched_tokens, args.model_kind) == (
        "dsa,dsa_early,dsa_layered", 128, "dsa")
    assert _parser().parse_args([]).prefill_max_batched_tokens is None


def test_ttft_against_the_one_engine_pairs_requests_by_index() -> None:
    rows = [{"ttft_ms": t} for t in (300.0, 200.0, 900.0)]
    single = [{"ttft_ms": t} for t in (100.0, 200.0, 300.0)]
    out = bench_pd.vs_single(rows, single)
    # ratios 3, 1, 3 -> 3; differences 200, 0, 600 -> 200 (not median 300 - median 200)
    assert out == {"ttft_ms": 300.0, "ttft_p90_ms": 900.0, "ttft_ratio_vs_single": 3.0, "overhead_ms": 200.0}
    with pytest.raises(ValueError):
        bench_pd.vs_single(rows, single[:2])


def test_layered_share_is_over_the_bytes_p_sent() -> None:
    assert bench_pd.layered_share([{"sent": 100.0, "layered": 100.0}, {"sent": 300.0, "layered": 0.0}]) == 0.25
    assert bench_pd.layered_share([{"sent": 0.0, "layered": 0.0}]) is None
