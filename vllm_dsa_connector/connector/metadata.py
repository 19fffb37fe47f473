"""vLLM's containers for DSAConnector's data: the handshake payload and the per-step metadata.

The structs themselves (payloads, jobs, notices) are vLLM-free and live in
:mod:`vllm_dsa_connector.core.handoff.wire`; this module wraps them in the classes vLLM's connector API
passes around:

- :class:`DSAHandshakeMetadata`: one worker's encoded :class:`~vllm_dsa_connector.core.handoff.wire.RankPayload`,
  collected by vLLM's ``get_handshake_metadata`` -> ``set_xfer_handshake_metadata_pp_aware`` path.
- :class:`DSAConnectorMetadata`: what the scheduler tells its workers each step (push jobs on P,
  receive expectations on D, releases and failures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, RecvJob


@dataclass
class DSAHandshakeMetadata(KVConnectorHandshakeMetadata):
    """vLLM's handshake container: the msgpack-encoded ``RankPayload``."""

    payload: bytes


@dataclass
class DSAConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    peers: list[PeerInfo] = field(default_factory=list)
    local: PeerInfo | None = None  # this engine's own payloads (all ranks), sent once
    push: list[PushJob] = field(default_factory=list)
    recv: list[RecvJob] = field(default_factory=list)
    fail_recv: dict[str, str] = field(default_factory=dict)  # D req -> reason
    # fail_recv entries the scheduler already logged (unusable kv_transfer_params: once per peer, not per request)
    fail_quiet: set[str] = field(default_factory=set)
    # fail_recv entries P never posted (it refused the registration or confirmed the cancel): no fence to wait for
    fail_unposted: set[str] = field(default_factory=set)
    # given-up loads whose workers wait for P's fence, moot now: P's start is gone (handoff/fence_waits.py)
    fence_void: set[str] = field(default_factory=set)
    release: list[str] = field(default_factory=list)  # P reqs whose lease ended without a push
    forget: list[str] = field(default_factory=list)  # idle D engines we write to: drop them (before ``peers``)
    forget_sources: list[str] = field(default_factory=list)  # idle P engines that write to us: drop them

    def is_empty(self) -> bool:
        """Nothing for the workers to do."""
        return not (
            self.peers or self.local or self.push or self.recv or self.fail_recv or self.release or self.forget
            or self.forget_sources or self.fence_void
        )
