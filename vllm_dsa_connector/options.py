"""The options mechanism: each settings dataclass declares its options once; one function resolves them.

Declare a frozen dataclass whose fields are :func:`option` (key, parser, default, environment variable,
doc: the default is written once, as the field's default) or :func:`group` (a nested settings class read
from the same mapping)::

    @dataclass(frozen=True)
    class GateSettings:
        min_runs: int = option("bounce_min_runs", positive_int, 8, doc="bounce only with >= this many runs")

    settings = resolve_options(GateSettings, extra_config, where="kv_connector_extra_config")

:func:`resolve_options` is the one resolution path: explicit config > environment variable > default;
every value is parsed (validated) when the settings are built, at start-up; unknown keys are refused
listing the known ones; an error names the key, the value and where it came from. :func:`options_markdown`
renders the option tables of docs/configuration.md from the same declarations (``tests/test_options_doc.py`` checks them).

No project or vLLM import here: every layer, ``core/transfer/`` included, may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "Option",
    "OptionError",
    "RuntimeFixesOptions",
    "all_options",
    "group",
    "option",
    "option_keys",
    "option_spec",
    "options_markdown",
    "options_of",
    "parse_bool",
    "parse_choice",
    "parse_float",
    "parse_int",
    "resolve_options",
    "runtime_fixes_disabled",
]

T = TypeVar("T")
S = TypeVar("S")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_OPTION = "vllm_dsa_option"
_GROUP = "vllm_dsa_option_group"
_AUTO_ENV = "<auto>"


class OptionError(ValueError):
    """A configuration value that cannot be used; the message names the key, the value and its source."""


# ---------------------------------------------------------------------------------------------- parsers
# A parser takes (key, raw value) and returns the typed value or raises OptionError("<key>: <reason>");
# resolve_options adds the value and where it came from.


def parse_bool(key: str, value: Any) -> bool:
    """Parse a bool from a bool or a common string spelling (1/0, true/false, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise OptionError(f"{key}: expected a boolean (true/false/1/0)")


def parse_int(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Parse an int (an int, or a string of digits with an optional k/m/g binary suffix)."""
    if isinstance(value, bool):
        raise OptionError(f"{key}: expected an integer")
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
            raise OptionError(f"{key}: expected an integer") from None
    else:
        raise OptionError(f"{key}: expected an integer")
    if minimum is not None and out < minimum:
        raise OptionError(f"{key}: must be >= {minimum}")
    if maximum is not None and out > maximum:
        raise OptionError(f"{key}: must be <= {maximum}")
    return out


def parse_float(
    key: str, value: Any, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Parse a finite float."""
    if isinstance(value, bool):
        raise OptionError(f"{key}: expected a number")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{key}: expected a number") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise OptionError(f"{key}: expected a finite number")
    if minimum is not None and out < minimum:
        raise OptionError(f"{key}: must be >= {minimum}")
    if maximum is not None and out > maximum:
        raise OptionError(f"{key}: must be <= {maximum}")
    return out


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """Parse one of a fixed set of strings."""
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{key}: must be one of {', '.join(choices)}")
    return value


def parse_path(key: str, value: Any) -> str:
    """A directory or file path, taken as given (empty: the caller's default location)."""
    return str(value)


# ---------------------------------------------------------------------------------------- declaration


@dataclass(frozen=True)
class Option(Generic[T]):
    """One option: its config key, parser, default, environment variable and meaning.

    ``secret``: the value is never shown in errors or docs. ``env_only``: read from the environment
    only (a process-wide switch, not a config key).
    """

    key: str
    parse: Callable[[str, Any], T]
    default: T
    env: str | None = None
    doc: str = ""
    secret: bool = False
    env_only: bool = False


def option(
    key: str,
    parse: Callable[[str, Any], T],
    default: T,
    *,
    doc: str,
    env: str | None = _AUTO_ENV,
    secret: bool = False,
    env_only: bool = False,
) -> Any:
    """A settings field for ``key``; ``env`` defaults to ``VLLM_DSA_<KEY>`` (``None``: no variable)."""
    env_name = "VLLM_DSA_" + key.upper() if env == _AUTO_ENV else env
    spec = Option(key, parse, default, env_name, doc, secret, env_only)
    return field(default=default, metadata={_OPTION: spec})


def group(settings_cls: type, *, default: Any = None) -> Any:
    """A settings field holding a nested settings class, resolved from the same mapping."""
    return field(default=default, metadata={_GROUP: settings_cls})


def options_of(settings_cls: type) -> tuple[tuple[str, Option[Any]], ...]:
    """``(field name, Option)`` of a settings class's own options, in declaration order."""
    _check_settings(settings_cls)
    return tuple((f.name, f.metadata[_OPTION]) for f in fields(settings_cls) if _OPTION in f.metadata)


def _groups_of(settings_cls: type) -> tuple[tuple[str, type], ...]:
    return tuple((f.name, f.metadata[_GROUP]) for f in fields(settings_cls) if _GROUP in f.metadata)


def all_options(settings_cls: type) -> list[Option[Any]]:
    """Every option of a settings class, its groups' included, in declaration order."""
    out = [o for _, o in options_of(settings_cls)]
    for _, sub in _groups_of(settings_cls):
        out.extend(all_options(sub))
    return out


def option_keys(settings_cls: type) -> frozenset[str]:
    """Every config key a settings class reads (its groups' included, environment-only switches not)."""
    return frozenset(o.key for o in all_options(settings_cls) if not o.env_only)


def option_spec(settings_cls: type, name: str) -> Option[Any]:
    """The :class:`Option` behind field ``name``."""
    for field_name, spec in options_of(settings_cls):
        if field_name == name:
            return spec
    raise KeyError(f"{settings_cls.__name__} has no option field {name!r}")


def _check_settings(settings_cls: type) -> None:
    if not (isinstance(settings_cls, type) and is_dataclass(settings_cls)):
        raise TypeError(f"{settings_cls!r} is not a settings dataclass")
    for f in fields(settings_cls):
        spec = f.metadata.get(_OPTION)
        if spec is None and _GROUP not in f.metadata and f.default is MISSING and f.default_factory is MISSING:
            raise TypeError(f"{settings_cls.__name__}.{f.name}: not an option and no default")


# ----------------------------------------------------------------------------------------- resolution


def resolve_options(
    settings_cls: type[S],
    config: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
    *,
    where: str,
    scope: str | None = None,
    also_known: Iterable[str] = (),
) -> S:
    """Build ``settings_cls`` from ``config`` > ``environ`` (default ``os.environ``) > declared defaults.

    ``where`` names the config in messages (e.g. ``"DSAConnector kv_connector_extra_config"``). Unknown
    keys are refused: every key of ``config`` (or, with ``scope``, every key starting with ``scope``:
    the rest belongs to other owners) must be one of ``settings_cls``'s keys or ``also_known``. A key
    whose value is ``None`` counts as unset. After construction, a ``validate_options()`` method of the
    settings class (cross-field checks) runs.

    Raises:
        OptionError: an unknown key, or a value its parser refuses (naming key, value and source).
    """
    config = dict(config or {})
    environ = os.environ if environ is None else environ
    known = option_keys(settings_cls) | frozenset(also_known)
    if scope is not None:
        known = frozenset(k for k in known if k.startswith(scope))
    unknown = sorted(k for k in config if (scope is None or k.startswith(scope)) and k not in known)
    if unknown:
        raise OptionError(
            f"{unknown[0]}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)} in {where}; known: {', '.join(sorted(known))}"
        )
    out = _build(settings_cls, config, environ, where)
    check = getattr(out, "validate_options", None)
    if check is not None:
        check()
    return out


def _build(settings_cls: type[S], config: Mapping[str, Any], environ: Mapping[str, str], where: str) -> S:
    values: dict[str, Any] = {name: _value(o, config, environ, where) for name, o in options_of(settings_cls)}
    for name, sub in _groups_of(settings_cls):
        values[name] = _build(sub, config, environ, where)
    return settings_cls(**values)


def _value(o: Option[T], config: Mapping[str, Any], environ: Mapping[str, str], where: str) -> T:
    if not o.env_only and config.get(o.key) is not None:
        raw, source = config[o.key], where
    elif o.env and o.env in environ:
        raw, source = environ[o.env], f"environment variable {o.env}"
    else:
        return o.default
    try:
        return o.parse(o.key, raw)
    except (OptionError, TypeError, ValueError) as e:
        reason = str(e).removeprefix(f"{o.key}: ")
        shown = "<hidden>" if o.secret else repr(raw)
        raise OptionError(f"{o.key}: {reason}; got {shown} from {source}") from None


# --------------------------------------------------------------------------------------------- docs


def _show_default(o: Option[Any]) -> str:
    value = o.default
    if o.secret and value:
        return "(hidden)"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1 << 20:
        for suffix, m in (("g", 1 << 30), ("m", 1 << 20)):
            if value % m == 0:
                return f"{value // m}{suffix}"
    if value == "":
        return '""'
    return str(value)


def options_markdown(sections: Iterable[tuple[str, type]]) -> str:
    """Markdown tables (key, environment variable, default, meaning), one per ``(title, settings class)``."""
    parts: list[str] = []
    for title, settings_cls in sections:
        rows = [f"{title}\n", "| key | environment variable | default | meaning |", "|---|---|---|---|"]
        for o in all_options(settings_cls):
            key = "(environment only)" if o.env_only else f"`{o.key}`"
            env = f"`{o.env}`" if o.env else "-"
            doc = o.doc.replace("|", "\\|")
            rows.append(f"| {key} | {env} | `{_show_default(o)}` | {doc} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------ process-wide switches


@dataclass(frozen=True)
class RuntimeFixesOptions:
    """Switches of the plugin's runtime patches of vLLM (read by ``fixes`` and ``cpu_dsa``; here because
    both sit below the plugin and must not import it)."""

    disabled: bool = option(
        "disable_runtime_fixes",
        parse_bool,
        False,
        env="VLLM_DSA_DISABLE_RUNTIME_FIXES",
        env_only=True,
        doc="turn off every runtime patch of vLLM (the fixes, the MultiConnector guard, the CPU DSA backends)",
    )


def runtime_fixes_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_DSA_DISABLE_RUNTIME_FIXES=1`` turns off every runtime patch of vLLM (a bad value raises)."""
    return resolve_options(RuntimeFixesOptions, None, environ, where="the vLLM plugin").disabled
