"""DSAConnector options: ``kv_connector_extra_config`` keys, validated once at start-up.

Explicit config > ``VLLM_DSA_*`` environment variable > default (see :mod:`vllm_dsa_connector.options`).
Keys owned by other parts are accepted and validated by their owners: the bounce gate's ``bounce_*``
keys (:data:`vllm_dsa_connector.transport.gate.BOUNCE_OPTION_KEYS`) and the admission keys
(:data:`vllm_dsa_connector.admission.ADMISSION_OPTION_KEYS`). Any other key is refused with the list of
known keys, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_dsa_connector.options import (
    Option,
    OptionError,
    check_unknown,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
)

__all__ = ["ConnectorOptions", "OptionError", "known_keys"]


def _port(key: str, value: Any) -> int:
    return parse_int(key, value, minimum=0, maximum=65535)


def _secret(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{key} must be a string, got {type(value).__name__}")
    if value and len(value) < 16:
        raise OptionError(f"{key} must be at least 16 characters (got {len(value)})")
    return value


def _pos(key: str, value: Any) -> float:
    return parse_float(key, value, minimum=0.01, maximum=86400.0)


_OPTIONS: tuple[Option[Any], ...] = (
    Option("side_channel_host", lambda k, v: str(v), "127.0.0.1", "VLLM_DSA_SIDE_CHANNEL_HOST",
           "address the ZMQ side channel binds to and advertises"),
    Option("side_channel_port", _port, 0, "VLLM_DSA_SIDE_CHANNEL_PORT",
           "side channel port (0: a free port; the proxy carries it in kv_transfer_params)"),
    Option("kv_lease_duration", _pos, 30.0, "VLLM_DSA_KV_LEASE_DURATION",
           "P keeps a finished request's blocks this long without a registration/heartbeat (s)"),
    Option("transfer_timeout_s", _pos, 30.0, "VLLM_DSA_TRANSFER_TIMEOUT_S",
           "D gives up on a transfer (load failure, kv_load_failure_policy applies) after this (s)"),
    Option("handshake_timeout_s", _pos, 10.0, "VLLM_DSA_HANDSHAKE_TIMEOUT_S",
           "side-channel request timeout (s)"),
    Option("verify_transfers", parse_bool, False, "VLLM_DSA_VERIFY_TRANSFERS",
           "checksum every transferred run on both sides; a mismatch is a load failure"),
    Option("nixl_backend", lambda k, v: parse_choice(k, v, ("UCX",)), "UCX", "VLLM_DSA_NIXL_BACKEND",
           "NIXL backend"),
    Option("heartbeat_interval_s", _pos, 0.0, "VLLM_DSA_HEARTBEAT_INTERVAL_S",
           "D renews P's lease this often (s; 0: kv_lease_duration / 6)"),
    Option("nixl_progress_thread", parse_bool, False, "VLLM_DSA_NIXL_PROGRESS_THREAD",
           "run NIXL's progress thread (busy-polls a core) instead of progressing from the engine's steps"),
    Option("auth_secret", _secret, "", "VLLM_DSA_AUTH_SECRET",
           "shared secret: every side-channel message is HMAC-authenticated with replay protection "
           "(both engines need the same one; empty: off, and a non-loopback side channel warns)"),
    Option("prefault_kv_cache", parse_bool, True, "VLLM_DSA_PREFAULT_KV_CACHE",
           "receiver: touch every page of the CPU KV pools and staging arena at start-up, so WRITEs never "
           "pay first-touch page faults (9.9 MB into fresh pages: 8.0 ms vs 1.05 ms)"),
)


def _foreign_keys() -> set[str]:
    """Keys validated by other modules (bounce gate, admission); absent modules contribute none."""
    keys: set[str] = set()
    for module, attr in (
        ("vllm_dsa_connector.transport.gate", "BOUNCE_OPTION_KEYS"),
        ("vllm_dsa_connector.admission", "ADMISSION_OPTION_KEYS"),
    ):
        try:
            keys |= set(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return keys


def known_keys() -> set[str]:
    """Every key ``kv_connector_extra_config`` may hold for DSAConnector."""
    return {o.key for o in _OPTIONS} | _foreign_keys()


@dataclass(frozen=True)
class ConnectorOptions:
    """Resolved DSAConnector options (see the table in this module)."""

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    kv_lease_duration: float = 30.0
    transfer_timeout_s: float = 30.0
    handshake_timeout_s: float = 10.0
    verify_transfers: bool = False
    nixl_backend: str = "UCX"
    heartbeat_interval_s: float = 0.0
    nixl_progress_thread: bool = False
    prefault_kv_cache: bool = True
    auth_secret: str = ""
    bounce: Any = None  # transport.gate.BounceSettings (None: transport absent or never bounce)

    @property
    def heartbeat_s(self) -> float:
        """Effective heartbeat period."""
        return self.heartbeat_interval_s or max(self.kv_lease_duration / 6.0, 0.05)

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        """Validate ``kv_connector_extra_config`` (unknown keys refused; owners' keys checked too)."""
        config = dict(config or {})
        check_unknown(config, known_keys(), "DSAConnector kv_connector_extra_config")
        values = {o.key: o.resolve(config, environ) for o in _OPTIONS}
        # Validate the keys owned by other parts now, so a bad value fails at start-up.
        try:
            from vllm_dsa_connector.transport.gate import BounceSettings
        except ImportError:
            pass
        else:
            values["bounce"] = BounceSettings.from_config(config, environ)
        return cls(**values)
