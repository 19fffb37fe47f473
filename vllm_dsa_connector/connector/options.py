"""DSAConnector options: ``kv_connector_extra_config`` keys, validated once at start-up.

Declared once with :func:`vllm_dsa_connector.options.option`; explicit config > ``VLLM_DSA_*``
environment variable > default. The bounce gate's ``bounce_*`` keys are a nested group
(:class:`~vllm_dsa_connector.core.transfer.gate_options.BounceSettings`, validated here too); the admission
keys (:data:`~vllm_dsa_connector.admission.options.ADMISSION_OPTION_KEYS`) are accepted and validated by
the admission scheduler, which reads them wherever MultiConnector puts them. Any other key is refused
with the list of known keys, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from vllm_dsa_connector.admission.options import ADMISSION_OPTION_KEYS
from vllm_dsa_connector.core.handoff.leases import EARLY_HELD
from vllm_dsa_connector.core.handoff.side_channel import is_loopback
from vllm_dsa_connector.core.transfer.gate_options import BounceSettings
from vllm_dsa_connector.options import (
    OptionError,
    group,
    option,
    option_keys,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
    resolve_options,
)

__all__ = ["ConnectorOptions", "known_keys"]

WHERE = "DSAConnector kv_connector_extra_config"


def _secret(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{key}: must be a string, got {type(value).__name__}")
    if value and len(value) < 16:
        raise OptionError(f"{key}: must be at least 16 characters (got {len(value)})")
    return value


_port = partial(parse_int, minimum=0, maximum=65535)
_seconds = partial(parse_float, minimum=0.01, maximum=86400.0)


@dataclass(frozen=True)
class ConnectorOptions:
    """Resolved DSAConnector options (``bounce``: the gate's settings; ``None`` only when built by hand)."""

    side_channel_host: str = option(
        "side_channel_host", lambda k, v: str(v), "127.0.0.1",
        doc="address the ZMQ side channel binds to and advertises",
    )
    side_channel_port: int = option(
        "side_channel_port", _port, 0,
        doc="side channel port (0: a free port; the proxy carries it in kv_transfer_params)",
    )
    kv_lease_duration: float = option(
        "kv_lease_duration", _seconds, 30.0,
        doc="P keeps a finished request's blocks this long without a registration/heartbeat (s)",
    )
    transfer_timeout_s: float = option(
        "transfer_timeout_s", _seconds, 30.0,
        doc="D gives up on a transfer (load failure, kv_load_failure_policy applies) after this (s)",
    )
    fence_timeout_s: float = option(
        "fence_timeout_s", _seconds, 960.0,
        doc="D keeps a given-up load's blocks until P's fence (its notice after an aborted WRITE) arrives, at "
        "most this long; the default is above Linux's TCP retransmission give-up (tcp_retries2=15, ~924 s), after "
        "which a partitioned connection cannot deliver queued bytes any more; shorter risks a late WRITE in a "
        "reused block (s)",
    )
    handshake_timeout_s: float = option(
        "handshake_timeout_s", _seconds, 10.0,
        doc="side-channel request timeout (s); an unanswered handshake is tried again while the waiting "
        "request is inside transfer_timeout_s",
    )
    peer_setup_timeout_s: float = option(
        "peer_setup_timeout_s", partial(parse_float, minimum=0.0, maximum=86400.0), 30.0,
        doc="D: added to transfer_timeout_s for the loads of a P start that has delivered none to this D yet: "
        "P's one-time set-up of a fresh peer (NIXL remote agents, first connection; off P's step path) is not "
        "spent from the transfer's budget (s; 0: none)",
    )
    peer_idle_s: float = option(
        "peer_idle_s", _seconds, 300.0,
        doc="a peer engine with no request for this long is forgotten: its control thread, worker remotes "
        "and NIXL agents go; its next request handshakes again (s)",
    )
    verify_transfers: bool = option(
        "verify_transfers", parse_bool, False,
        doc="checksum every transferred run on both sides; a mismatch is a load failure",
    )
    nixl_backend: str = option(
        "nixl_backend", partial(parse_choice, choices=("UCX",)), "UCX", doc="NIXL backend",
    )
    heartbeat_interval_s: float = option(
        "heartbeat_interval_s", partial(parse_float, minimum=0.0, maximum=86400.0), 0.0,
        doc="D renews P's lease this often (s; 0: kv_lease_duration / 6)",
    )
    nixl_progress_thread: bool = option(
        "nixl_progress_thread", parse_bool, False,
        doc="run NIXL's progress thread (busy-polls a core) instead of progressing from the engine's steps",
    )
    prefault_kv_cache: bool = option(
        "prefault_kv_cache", parse_bool, True,
        doc="receiver: touch every page of the CPU KV pools and staging arena at start-up, so WRITEs never "
        "pay first-touch page faults",
    )
    auth_secret: str = option(
        "auth_secret", _secret, "", secret=True,
        doc="shared secret (at least 16 characters, the same on P and D): every side-channel message is "
        "HMAC-authenticated with replay protection (empty: off; then a side channel on a non-loopback "
        "address refuses to start unless allow_unauthenticated_side_channel is set)",
    )
    allow_unauthenticated_side_channel: bool = option(
        "allow_unauthenticated_side_channel", parse_bool, False,
        doc="let a side channel bound to a non-loopback address run without auth_secret: anyone who reaches "
        "it can then register writes into, or cancel, this engine's transfers (only for a network nobody "
        "else reaches)",
    )
    early_held_per_peer: int = option(
        "early_held_per_peer", partial(parse_int, minimum=1, maximum=EARLY_HELD), 1024,
        doc=f"P: early registrations of one D engine held for requests P has not seen yet (at most {EARLY_HELD} "
        "of all D engines together); beyond it that D's next early registration is refused",
    )
    early_held_bytes_per_peer: int = option(
        "early_held_bytes_per_peer", partial(parse_int, minimum=1 << 16, maximum=1 << 40), 64 << 20,
        doc="P: bytes of one D engine's held early registrations (block lists, ids, routes; its payloads are "
        "kept once per engine, not per registration); beyond it that D's next one is refused",
    )
    ipc_mode: str = option(
        "ipc_mode", partial(parse_choice, choices=("auto", "never")), "never",
        doc="auto: when P and D run on one host with CUDA pools and P's GPU can reach D's, D routes the "
        "pair through CUDA IPC (P copies into its mapping of D's pools, one kernel, no NIXL WRITE); "
        "never: NIXL only. Read on D, which exports its pools and chooses the route; opt-in: P's process "
        "must be able to open D's CUDA IPC handles (containers sharing the host's IPC namespace), else "
        "each such load fails naming why",
    )
    layer_push: bool = option(
        "layer_push", parse_bool, False,
        doc="P: when D registered before P's prefill finished (the proxy's early registration), post each "
        "layer's pages from save_kv_layer as the final prefill step computes them, instead of the whole "
        "request after the step; off until the measurements say on (docs/benchmarks.md)",
    )
    request_records: str = option(
        "request_records", partial(parse_choice, choices=("off", "log")), "off",
        doc="log: one JSON log line per request and side when it is over (P: its send; D: its load): ids, route, "
        "blocks, bytes, each phase's time, outcome and why (docs/deployment.md, What to watch); off: none. "
        "Independent of it, where vLLM's tracing is on (--otlp-traces-endpoint) the same record is a span "
        "dsa_kv_transfer in the request's trace",
    )
    bounce: BounceSettings | None = group(BounceSettings)

    def validate_options(self) -> None:
        """Cross-field checks (run once at start-up by ``resolve_options``)."""
        if not self.auth_secret and not self.allow_unauthenticated_side_channel \
                and not is_loopback(self.side_channel_host):
            raise OptionError(
                f"side_channel_host: {self.side_channel_host!r} is not a loopback address and auth_secret is "
                "empty: anyone who reaches it could register writes into or cancel this engine's transfers. Set "
                "auth_secret (or VLLM_DSA_AUTH_SECRET) to the same secret of at least 16 characters on P and D, "
                "or set allow_unauthenticated_side_channel=true (VLLM_DSA_ALLOW_UNAUTHENTICATED_SIDE_CHANNEL=1) "
                f"if no one else can reach {self.side_channel_host}")

    @property
    def heartbeat_s(self) -> float:
        """Effective heartbeat period."""
        return self.heartbeat_interval_s or max(self.kv_lease_duration / 6.0, 0.05)

    def exports_cuda_ipc(self, kv_role: str) -> bool:
        """Whether a worker of this ``kv_role`` exports its KV pools through CUDA IPC: a D
        (``kv_consumer``/``kv_both``) with ``ipc_mode`` on."""
        return self.ipc_mode != "never" and kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorOptions:
        """Validate ``kv_connector_extra_config`` (unknown keys refused; the gate's keys checked too)."""
        return resolve_options(cls, config, environ, where=WHERE, also_known=ADMISSION_OPTION_KEYS)


def known_keys() -> set[str]:
    """Every key ``kv_connector_extra_config`` may hold for DSAConnector."""
    return set(option_keys(ConnectorOptions) | ADMISSION_OPTION_KEYS)
