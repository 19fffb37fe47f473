"""The handful of plain values the handoff protocol runs on (the adapter maps its own options onto them)."""

from __future__ import annotations

from dataclasses import dataclass

#: P's post-deadline horizon is ``transfer_timeout_s`` plus this (s): P clamps a registration's later deadline to
#: it (posting earlier than D asked is always safe for D's blocks), D states none later, and P keeps the
#: tombstone of a transfer D cancelled before P saw it that long
POST_DEADLINE_MARGIN_S = 10.0


@dataclass(frozen=True)
class HandoffSettings:
    """Timeouts and switches of one engine's producer and consumer.

    The vLLM adapter builds it from ``ConnectorOptions`` (``kv_connector_extra_config``); another
    adapter fills it from its own configuration. All times are seconds.
    """

    lease_s: float = 30.0  #: P keeps a finished request's blocks this long without news from D
    transfer_timeout_s: float = 30.0  #: D gives up on a load after this; P's workers' write timeout
    handshake_timeout_s: float = 10.0  #: one side-channel request/reply
    heartbeat_s: float = 5.0  #: D renews P's leases this often
    verify_transfers: bool = False  #: checksum every transferred run
    peer_idle_s: float = 300.0  #: a peer with no request for this long is forgotten (handshakes again on use)
    early_held_per_peer: int = 1024  #: P holds at most this many early registrations of one D engine
    early_held_bytes_per_peer: int = 64 << 20  #: ... and at most this many bytes of them
    #: added to a load's budget while its P start has delivered no load to this engine yet: P's one-time
    #: set-up of this D (NIXL remote agents, the first connection) is not spent from ``transfer_timeout_s``
    peer_setup_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("lease_s", "transfer_timeout_s", "handshake_timeout_s", "heartbeat_s", "peer_idle_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"HandoffSettings.{name} must be > 0 seconds, got {value!r}")
        for name in ("early_held_per_peer", "early_held_bytes_per_peer"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"HandoffSettings.{name} must be an int >= 1, got {value!r}")
        if not self.peer_setup_s >= 0:
            raise ValueError(f"HandoffSettings.peer_setup_s must be >= 0 seconds, got {self.peer_setup_s!r}")
