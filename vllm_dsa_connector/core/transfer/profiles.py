"""Transport cost profiles: what bouncing and posting runs directly cost, per transport.

:class:`CostModel` (per transport, :data:`PROFILES`) prices ``direct`` vs ``bounce`` for
:meth:`~vllm_dsa_connector.core.transfer.gate.BounceGate.decision`::

    direct_us = merged_runs * desc_us
    bounce_us = desc_us + fixed_us + 2 * bytes / copy_bandwidth      # one descriptor, gather + scatter

:func:`detect_profile` picks a profile from the memory and ``UCX_TLS``. No torch, no vLLM. The
measurements behind the values are in docs/cost-profiles.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PROFILES", "CostModel", "detect_profile"]


@dataclass(frozen=True)
class CostModel:
    """Cost of one extra descriptor vs the copy bandwidth of gather/scatter."""

    desc_us: float
    copy_gbps: float
    fixed_us: float

    def direct_us(self, num_runs: int, total_bytes: int) -> float:
        """Estimated extra time of posting ``num_runs`` descriptors."""
        return num_runs * self.desc_us

    def bounce_us(self, num_runs: int, total_bytes: int) -> float:
        """Estimated extra time of gather + one descriptor + scatter."""
        return self.desc_us + self.fixed_us + 2.0 * total_bytes / (self.copy_gbps * 1e3)


# Per transport (measurements: docs/cost-profiles.md): cma and tcp from the CPU hosts' `vllm-dsa bench
# transfer`, cuda from the H200's dev/bench/gpu_transfer.py, rdma an estimate (tune it with bounce_desc_cost_us
# & co. on such hardware).
PROFILES: dict[str, CostModel] = {
    "cma": CostModel(desc_us=7.0, copy_gbps=4.0, fixed_us=200.0),
    "tcp": CostModel(desc_us=25.0, copy_gbps=4.0, fixed_us=200.0),
    "rdma": CostModel(desc_us=2.0, copy_gbps=4.0, fixed_us=100.0),
    "cuda": CostModel(desc_us=8.0, copy_gbps=1700.0, fixed_us=500.0),
}


_RDMA_TLS = ("rc", "ud", "dc", "ib", "roce", "mlx")
_SHM_TLS = ("sm", "cma", "posix", "sysv", "xpmem", "knem", "shm", "all")


def detect_profile(device: str = "cpu", environ: Mapping[str, str] | None = None) -> str:
    """Pick a cost profile: ``cuda`` for GPU memory, else from ``UCX_TLS`` (``tcp`` only -> ``tcp``)."""
    if device.startswith("cuda"):
        return "cuda"
    environ = os.environ if environ is None else environ
    tls = [
        t.strip().lstrip("^").lower() for t in environ.get("UCX_TLS", "").split(",") if t.strip()
    ]
    if not tls:
        return "cma"
    if any(any(t.startswith(r) for r in _RDMA_TLS) for t in tls):
        return "rdma"
    if any(any(t.startswith(s) for s in _SHM_TLS) for t in tls):
        return "cma"
    return "tcp"
