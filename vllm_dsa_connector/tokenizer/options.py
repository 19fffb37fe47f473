"""Validated options of the prefix token cache (explicit value > ``VLLM_DSA_TOKCACHE_*`` > default)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm_dsa_connector.options import option, options_of, parse_bool, parse_int, resolve_options

_positive = partial(parse_int, minimum=1)
_non_negative = partial(parse_int, minimum=0)


@dataclass(frozen=True)
class CacheOptions:
    """Settings of :class:`~vllm_dsa_connector.tokenizer.PrefixTokenCache`."""

    max_entries: int = option(
        "max_entries", _positive, 256, env="VLLM_DSA_TOKCACHE_MAX_ENTRIES", doc="cached prompts (LRU)",
    )
    max_chars: int = option(
        "max_chars", _positive, 32 << 20, env="VLLM_DSA_TOKCACHE_MAX_CHARS", doc="total cached characters (LRU)",
    )
    min_chars: int = option(
        "min_chars", _non_negative, 2048, env="VLLM_DSA_TOKCACHE_MIN_CHARS", doc="shorter texts bypass the cache",
    )
    chunk_chars: int = option(
        "chunk_chars", _positive, 2048, env="VLLM_DSA_TOKCACHE_CHUNK_CHARS", doc="prefix-hash granularity",
    )
    cut_spacing: int = option(
        "cut_spacing", _positive, 256, env="VLLM_DSA_TOKCACHE_CUT_SPACING",
        doc="min chars between kept restart points",
    )
    anchors: bool = option(
        "anchors", parse_bool, True, env="VLLM_DSA_TOKCACHE_ANCHORS", doc="restart at added special tokens",
    )
    line_cuts: bool = option(
        "line_cuts", parse_bool, True, env="VLLM_DSA_TOKCACHE_LINE_CUTS", doc="restart at proved line starts",
    )
    verify_every: int = option(
        "verify_every", _non_negative, 0, env="VLLM_DSA_TOKCACHE_VERIFY_EVERY",
        doc="re-check every Nth hit against a full encode (0: never); a mismatch disables the cache",
    )
    log_interval_s: int = option(
        "log_interval_s", _non_negative, 60, env="VLLM_DSA_TOKCACHE_LOG_INTERVAL_S",
        doc="seconds between stats log lines of the vLLM tokenizer mode (0: never)",
    )

    @classmethod
    def resolve(
        cls, config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> CacheOptions:
        """Validate ``config`` (unknown keys and bad values raise ``ValueError`` naming the key)."""
        return resolve_options(cls, config, environ, where="PrefixTokenCache options")

    @classmethod
    def describe(cls) -> str:
        """One line per option: key, environment variable, default, meaning."""
        return "\n".join(f"{o.key} ({o.env}, default {o.default}): {o.doc}" for _, o in options_of(cls))
