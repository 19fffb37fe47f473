"""The admission options (``admission*`` keys of ``kv_connector_extra_config``, ``VLLM_DSA_ADMISSION*``).

Declared once with :func:`vllm_dsa_connector.options.option`. No vLLM import and nothing from the
connector: DSAConnector imports :data:`ADMISSION_OPTION_KEYS` from here to accept these keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm_dsa_connector.options import (
    OptionError,
    option,
    option_keys,
    option_spec,
    parse_choice,
    parse_float,
    parse_int,
    resolve_options,
)

__all__ = ["ADMISSION_OPTION_KEYS", "POLICIES", "AdmissionConfig", "admission_keys"]

POLICIES: tuple[str, ...] = ("passthrough", "budget")
_MULTI_CONNECTOR = "MultiConnector"


@dataclass(frozen=True)
class AdmissionConfig:
    """The validated admission options."""

    policy: str = option(
        "admission", partial(parse_choice, choices=POLICIES), "passthrough",
        doc="admission policy for remote-KV requests: passthrough or budget",
    )
    budget_tokens: int | None = option(
        "admission_budget_tokens", partial(parse_int, minimum=1), None,
        doc="budget policy: tokens of remote KV allowed in flight (rounded up to whole blocks)",
    )
    timeout_s: float = option(
        "admission_timeout_s", partial(parse_float, minimum=0.001), 60.0,
        doc="budget policy: a transfer in flight longer than this stops counting against the budget (s)",
    )
    log_interval_s: float = option(
        "admission_log_interval_s", partial(parse_float, minimum=0.0), 10.0,
        doc="seconds between INFO lines of admission counts (0 disables them)",
    )

    def validate_options(self) -> None:
        """The budget policy needs a budget."""
        if self.policy == "budget" and self.budget_tokens is None:
            raise OptionError(
                "admission_budget_tokens: required when admission is 'budget' "
                "(tokens of remote KV allowed in flight, e.g. 65536)"
            )

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> AdmissionConfig:
        """Read the ``admission*`` keys of ``kv_connector_extra_config`` (other keys are not ours).

        Raises:
            OptionError: an unknown ``admission*`` key, an invalid value, or ``budget`` without a budget.
        """
        return resolve_options(cls, extra, environ, where="kv_connector_extra_config", scope="admission")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AdmissionConfig:
        """The admission options of a ``VllmConfig`` (defaults when it has no KV transfer config).

        The keys are read where users put them: the top-level ``kv_connector_extra_config`` and, under
        vLLM's MultiConnector, each child's (e.g. next to DSAConnector's options); the same key with two
        different values is an error.
        """
        kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        if kv_transfer_config is None:
            return cls.from_extra_config(None)
        return cls.from_extra_config(admission_keys(kv_transfer_config))

    def budget_blocks(self, block_size: int) -> int | None:
        """The budget in whole KV blocks (``None`` for pass-through)."""
        if self.policy != "budget" or self.budget_tokens is None:
            return None
        return -(-self.budget_tokens // block_size)


#: Keys of ``kv_connector_extra_config`` read by the admission hook (the connector accepts them as known).
ADMISSION_OPTION_KEYS: frozenset[str] = option_keys(AdmissionConfig)
#: The budget option (the scheduler names its key in log lines).
OPT_BUDGET_TOKENS = option_spec(AdmissionConfig, "budget_tokens")


def admission_keys(kv_transfer_config: Any, prefix: str = "admission") -> dict[str, Any]:
    """The admission keys wherever the user put them: the top-level ``kv_connector_extra_config`` and,
    for MultiConnector, every child's (``connectors`` list). The same key with different values in two
    places is an error.

    Raises:
        OptionError: one key set to two different values.
    """
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    places: list[tuple[str, Mapping[str, Any]]] = [("the top level", extra)]
    if getattr(kv_transfer_config, "kv_connector", None) == _MULTI_CONNECTOR:
        children = [c for c in extra.get("connectors") or [] if isinstance(c, Mapping)]
        places += [
            (f"connectors[{i}] ({c.get('kv_connector')})", c.get("kv_connector_extra_config") or {})
            for i, c in enumerate(children)
        ]
    found: dict[str, tuple[str, Any]] = {}
    for where, cfg in places:
        for key, value in cfg.items():
            if not key.startswith(prefix):
                continue
            if key in found and found[key][1] != value:
                raise OptionError(
                    f"{key} is set in {found[key][0]} ({found[key][1]!r}) and in {where} ({value!r}); set it once"
                )
            found.setdefault(key, (where, value))
    return {k: v for k, (_, v) in found.items()}
