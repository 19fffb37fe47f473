"""Validated options of the prefix token cache (explicit value > environment variable > default)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from vllm_dsa_connector.options import Option, check_unknown, parse_bool, parse_int


def _positive(key: str, value: Any) -> int:
    return parse_int(key, value, minimum=1)


def _non_negative(key: str, value: Any) -> int:
    return parse_int(key, value, minimum=0)


_OPTIONS: dict[str, Option[Any]] = {
    o.key: o
    for o in (
        Option("max_entries", _positive, 256, "VLLM_DSA_TOKCACHE_MAX_ENTRIES", "cached prompts (LRU)"),
        Option(
            "max_chars", _positive, 32 << 20, "VLLM_DSA_TOKCACHE_MAX_CHARS", "total cached characters (LRU)"
        ),
        Option(
            "min_chars", _non_negative, 2048, "VLLM_DSA_TOKCACHE_MIN_CHARS", "shorter texts bypass the cache"
        ),
        Option(
            "chunk_chars", _positive, 2048, "VLLM_DSA_TOKCACHE_CHUNK_CHARS", "prefix-hash granularity"
        ),
        Option(
            "cut_spacing", _positive, 256, "VLLM_DSA_TOKCACHE_CUT_SPACING", "min chars between kept restart points"
        ),
        Option("anchors", parse_bool, True, "VLLM_DSA_TOKCACHE_ANCHORS", "restart at added special tokens"),
        Option("line_cuts", parse_bool, True, "VLLM_DSA_TOKCACHE_LINE_CUTS", "restart at proved line starts"),
        Option(
            "verify_every",
            _non_negative,
            0,
            "VLLM_DSA_TOKCACHE_VERIFY_EVERY",
            "re-check every Nth hit against a full encode (0: never); a mismatch disables the cache",
        ),
        Option(
            "log_interval_s",
            _non_negative,
            60,
            "VLLM_DSA_TOKCACHE_LOG_INTERVAL_S",
            "seconds between stats log lines of the vLLM tokenizer mode (0: never)",
        ),
    )
}


@dataclass(frozen=True)
class CacheOptions:
    """Settings of :class:`~vllm_dsa_connector.tokenizer.PrefixTokenCache`."""

    max_entries: int = 256
    max_chars: int = 32 << 20
    min_chars: int = 2048
    chunk_chars: int = 2048
    cut_spacing: int = 256
    anchors: bool = True
    line_cuts: bool = True
    verify_every: int = 0
    log_interval_s: int = 60

    @classmethod
    def resolve(
        cls, config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> CacheOptions:
        """Validate ``config`` (unknown keys and bad values raise ``ValueError`` naming the key)."""
        config = dict(config or {})
        check_unknown(config, set(_OPTIONS), "PrefixTokenCache")
        environ = os.environ if environ is None else environ
        values = {f.name: _OPTIONS[f.name].resolve(config, environ) for f in fields(cls)}
        return cls(**values)

    @classmethod
    def describe(cls) -> str:
        """One line per option: key, environment variable, default, meaning."""
        return "\n".join(f"{o.key} ({o.env}, default {o.default}): {o.doc}" for o in _OPTIONS.values())
