"""The bounce gate's options (``bounce_*`` keys of ``kv_connector_extra_config``, ``VLLM_DSA_BOUNCE_*``).

Declared once with :func:`vllm_dsa_connector.options.option`; explicit config > env > defaults; a bad
value raises :class:`~vllm_dsa_connector.options.OptionError` naming the key, the value and its source.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm_dsa_connector.core.transfer.profiles import PROFILES
from vllm_dsa_connector.options import (
    OptionError,
    option,
    option_keys,
    parse_choice,
    parse_float,
    parse_int,
    resolve_options,
)

__all__ = ["BOUNCE_OPTION_KEYS", "BounceSettings"]


def _bandwidth(key: str, value: Any) -> float:
    out = parse_float(key, value, minimum=0.0)
    if out <= 0:
        raise OptionError(f"{key}: must be > 0")
    return out


def _unset_or(parse: Callable[[str, Any], float]) -> Callable[[str, Any], float | None]:
    """``""``/``auto``/``none`` -> ``None`` (use the profile's value), else ``parse``."""

    def inner(key: str, value: Any) -> float | None:
        if isinstance(value, str) and value.strip().lower() in ("", "auto", "none"):
            return None
        return parse(key, value)

    return inner


_non_negative = partial(parse_float, minimum=0.0)


@dataclass(frozen=True)
class BounceSettings:
    """Resolved bounce options (keys :data:`BOUNCE_OPTION_KEYS`)."""

    mode: str = option(
        "bounce_mode", partial(parse_choice, choices=("auto", "always", "never")), "auto",
        doc="auto: the gate decides; always/never force a path",
    )
    profile: str = option(
        "bounce_profile", partial(parse_choice, choices=("auto", *PROFILES)), "auto",
        doc=f"cost profile ({', '.join(PROFILES)}); auto: cuda for GPU memory, else from UCX_TLS",
    )
    min_runs: int = option(
        "bounce_min_runs", partial(parse_int, minimum=1), 8,
        doc="bounce only with at least this many runs after merging",
    )
    min_bytes: int = option(
        "bounce_min_bytes", partial(parse_int, minimum=0), 0, doc="bounce only with at least this many bytes",
    )
    max_avg_run_bytes: int = option(
        "bounce_max_avg_run_bytes", partial(parse_int, minimum=1), 1 << 30,
        doc="bounce only when the average run is at most this long",
    )
    desc_cost_us: float | None = option(
        "bounce_desc_cost_us", _unset_or(_non_negative), None,
        doc="override the profile's cost per descriptor (us)",
    )
    copy_gbps: float | None = option(
        "bounce_copy_gbps", _unset_or(_bandwidth), None,
        doc="override the profile's gather/scatter bandwidth (GB/s)",
    )
    fixed_us: float | None = option(
        "bounce_fixed_us", _unset_or(_non_negative), None, doc="override the profile's fixed bounce overhead (us)",
    )
    arena_bytes: int = option(
        "bounce_arena_bytes", partial(parse_int, minimum=4096), 256 << 20,
        doc="staging arena size (bytes; k/m/g suffixes)",
    )
    reserve_timeout_s: float = option(
        "bounce_reserve_timeout_s", partial(parse_float, minimum=0.0, maximum=60.0), 0.2,
        doc="bounded wait for staging space before the direct path (s)",
    )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> BounceSettings:
        """Resolve from ``kv_connector_extra_config`` > ``VLLM_DSA_BOUNCE_*`` > defaults.

        Keys not starting with ``bounce_`` belong to others and are ignored; an unknown ``bounce_*`` key
        is refused (a typo must not fall back silently).
        """
        return resolve_options(cls, config, environ, where="kv_connector_extra_config", scope="bounce_")


#: Keys of ``kv_connector_extra_config`` read by :meth:`BounceSettings.from_config`.
BOUNCE_OPTION_KEYS: frozenset[str] = option_keys(BounceSettings)
