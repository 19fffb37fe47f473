"""Validated options: explicit config > environment variable > default.

Shared by every layer (no vLLM import here) so that each option is parsed once, at start-up, and a bad
value becomes one clear ``ValueError`` naming the key, never a silent default or a crash later.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class OptionError(ValueError):
    """A configuration value that cannot be used; the message names the key and the value."""


def parse_bool(key: str, value: Any) -> bool:
    """Parse a bool from a bool or a common string spelling."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise OptionError(f"{key}: expected a boolean (true/false/1/0), got {value!r}")


def parse_int(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Parse an int (an int, or a string of digits with optional k/m/g binary suffix)."""
    if isinstance(value, bool):
        raise OptionError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        out = value
    elif isinstance(value, float) and value.is_integer():
        out = int(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        mult = 1
        for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
            if text.endswith(suffix) or text.endswith(suffix + "ib"):
                text = text[: -len(suffix)] if text.endswith(suffix) else text[: -len(suffix) - 2]
                mult = m
                break
        try:
            out = int(text) * mult
        except ValueError:
            raise OptionError(f"{key}: expected an integer, got {value!r}") from None
    else:
        raise OptionError(f"{key}: expected an integer, got {value!r}")
    if minimum is not None and out < minimum:
        raise OptionError(f"{key}: must be >= {minimum}, got {out}")
    if maximum is not None and out > maximum:
        raise OptionError(f"{key}: must be <= {maximum}, got {out}")
    return out


def parse_float(
    key: str, value: Any, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Parse a finite float."""
    if isinstance(value, bool):
        raise OptionError(f"{key}: expected a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{key}: expected a number, got {value!r}") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise OptionError(f"{key}: expected a finite number, got {value!r}")
    if minimum is not None and out < minimum:
        raise OptionError(f"{key}: must be >= {minimum}, got {out}")
    if maximum is not None and out > maximum:
        raise OptionError(f"{key}: must be <= {maximum}, got {out}")
    return out


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """Parse one of a fixed set of strings."""
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{key}: must be one of {', '.join(choices)}; got {value!r}")
    return value


@dataclass(frozen=True)
class Option(Generic[T]):
    """One option: its key in ``kv_connector_extra_config``, an optional env variable, a default."""

    key: str
    parse: Callable[[str, Any], T]
    default: T
    env: str | None = None
    doc: str = ""

    def resolve(self, config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> T:
        """Explicit config wins over the environment, which wins over the default."""
        environ = os.environ if environ is None else environ
        if self.key in config and config[self.key] is not None:
            return self.parse(self.key, config[self.key])
        if self.env and self.env in environ:
            return self.parse(self.env, environ[self.env])
        return self.default


def check_unknown(config: Mapping[str, Any], known: set[str], where: str) -> None:
    """Refuse keys nobody reads: a typo must not silently fall back to a default."""
    unknown = sorted(set(config) - known)
    if unknown:
        raise OptionError(
            f"{where}: unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
        )
