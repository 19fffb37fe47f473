"""The options mechanism itself (vllm_dsa_connector.options): declaration, one resolution path, messages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from vllm_dsa_connector.options import (
    OptionError,
    group,
    option,
    option_keys,
    options_markdown,
    parse_bool,
    parse_int,
    resolve_options,
    runtime_fixes_disabled,
)


@dataclass(frozen=True)
class _Inner:
    depth: int = option("inner_depth", partial(parse_int, minimum=1), 2, doc="nested value")


@dataclass(frozen=True)
class _Settings:
    count: int = option("count", partial(parse_int, minimum=0, maximum=10), 3, doc="a count")
    flag: bool = option("flag", parse_bool, False, env="MY_FLAG", doc="a flag")
    token: str = option("token", lambda k, v: str(v), "", secret=True, doc="a secret")
    inner: _Inner | None = group(_Inner)

    def validate_options(self) -> None:
        if self.flag and self.count == 0:
            raise OptionError("count: must be > 0 when flag is on")


def test_declared_defaults_and_precedence() -> None:
    s = resolve_options(_Settings, None, {}, where="test config")
    assert s == _Settings(inner=_Inner()) and s.count == 3 and s.inner == _Inner(2)
    env = {"VLLM_DSA_COUNT": "7", "MY_FLAG": "yes", "VLLM_DSA_INNER_DEPTH": "4"}
    s = resolve_options(_Settings, {"count": 5, "flag": None}, env, where="test config")
    assert (s.count, s.flag, s.inner.depth) == (5, True, 4)  # explicit > env > default; None = unset
    assert option_keys(_Settings) == {"count", "flag", "token", "inner_depth"}


def test_errors_name_key_value_and_source() -> None:
    with pytest.raises(OptionError, match=r"^count: must be <= 10; got 11 from test config$"):
        resolve_options(_Settings, {"count": 11}, {}, where="test config")
    with pytest.raises(OptionError, match=r"^flag: expected a boolean .*got 'maybe' from environment variable MY_FLAG"):
        resolve_options(_Settings, {}, {"MY_FLAG": "maybe"}, where="test config")
    with pytest.raises(OptionError, match=r"^inner_depth: must be >= 1; got 0 from test config"):
        resolve_options(_Settings, {"inner_depth": 0}, {}, where="test config")
    with pytest.raises(OptionError, match="count: must be > 0 when flag is on"):  # cross-field check
        resolve_options(_Settings, {"count": 0, "flag": True}, {}, where="test config")


def test_secret_values_are_never_shown() -> None:
    @dataclass(frozen=True)
    class _S:
        key: str = option("key", partial(parse_int), "", secret=True, doc="x")

    with pytest.raises(OptionError) as err:
        resolve_options(_S, {"key": "hunter2-is-my-password"}, {}, where="c")
    assert "hunter2" not in str(err.value) and "<hidden>" in str(err.value)


def test_unknown_keys_refused_listing_the_known_ones() -> None:
    with pytest.raises(OptionError, match=r"^cuont: unknown option cuont in test config; known: count, flag, "
                                          r"inner_depth, token$"):
        resolve_options(_Settings, {"cuont": 1}, {}, where="test config")
    # also_known: keys other owners validate; scope: only keys starting with it are ours
    resolve_options(_Settings, {"theirs": 1}, {}, where="c", also_known={"theirs"})
    resolve_options(_Inner, {"count": 1, "other": 2}, {}, where="c", scope="inner_")
    with pytest.raises(OptionError, match="inner_deep: unknown option inner_deep in c; known: inner_depth$"):
        resolve_options(_Inner, {"inner_deep": 1}, {}, where="c", scope="inner_")


def test_markdown_rows_come_from_the_declarations() -> None:
    md = options_markdown([("Test:", _Settings)])
    assert "| `count` | `VLLM_DSA_COUNT` | `3` | a count |" in md
    assert "| `flag` | `MY_FLAG` | `false` | a flag |" in md
    assert "| `inner_depth` | `VLLM_DSA_INNER_DEPTH` | `2` | nested value |" in md


def test_runtime_fixes_switch() -> None:
    assert not runtime_fixes_disabled({})
    assert runtime_fixes_disabled({"VLLM_DSA_DISABLE_RUNTIME_FIXES": "on"})
    assert not runtime_fixes_disabled({"VLLM_DSA_DISABLE_RUNTIME_FIXES": "0"})
    with pytest.raises(OptionError, match="VLLM_DSA_DISABLE_RUNTIME_FIXES"):
        runtime_fixes_disabled({"VLLM_DSA_DISABLE_RUNTIME_FIXES": "sometimes"})


def test_copy_switches_go_through_the_mechanism() -> None:
    """VLLM_DSA_COPY_*: parsed by CopySettings; a bad value names the variable, the value and what is allowed."""
    from vllm_dsa_connector.core.transfer.copy.kernels import (
        DEFAULT_CONFIG,
        CopySettings,
        copy_settings,
    )

    assert copy_settings({}) == CopySettings() and CopySettings().config is DEFAULT_CONFIG
    s = copy_settings({"VLLM_DSA_COPY_IMPL": " CE ", "VLLM_DSA_COPY_GRAPH": "off",
                       "VLLM_DSA_COPY_CONFIG": "131072,8192,4"})
    assert (s.impl, s.graphs, str(s.config)) == ("ce", False, "131072,8192,4")
    assert copy_settings({"VLLM_DSA_COPY_GRAPH": ""}).graphs  # set but empty: the default (on)
    for env, value, allowed in (("VLLM_DSA_COPY_IMPL", "dma", "auto, triton, index, ce"),
                                ("VLLM_DSA_COPY_GRAPH", "maybe", "true/false"),
                                ("VLLM_DSA_COPY_CONFIG", "1,3,4", "piece_bytes,block_bytes,num_warps")):
        with pytest.raises(OptionError) as err:
            copy_settings({env: value})
        assert env in str(err.value) and repr(value) in str(err.value) and allowed in str(err.value)


def test_cache_directories_go_through_the_mechanism(tmp_path: Path) -> None:
    from vllm_dsa_dev.tiny_models import default_model_root
    from vllm_dsa_dev.tokenizer.assets import cache_dir

    assert default_model_root({"VLLM_DSA_MODEL_DIR": str(tmp_path)}) == tmp_path
    assert default_model_root({"VLLM_DSA_MODEL_DIR": ""}) == Path.home() / ".cache" / "vllm-dsa-connector"
    assert cache_dir({"VLLM_DSA_TOKENIZER_CACHE": str(tmp_path)}) == tmp_path
    assert cache_dir({}) == Path.home() / ".cache" / "vllm-dsa-connector" / "tokenizers"
