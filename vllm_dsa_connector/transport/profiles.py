"""Link cost profiles: what moving bytes to a peer costs per path, measured per transport and per link.

:class:`CostModel` (per transport, :data:`PROFILES`) prices ``direct`` vs ``bounce`` for
:meth:`~vllm_dsa_connector.transport.gate.BounceGate.decision`::

    direct_us = merged_runs * desc_us
    bounce_us = desc_us + fixed_us + 2 * bytes / copy_bandwidth      # one descriptor, gather + scatter

:class:`LinkProfile` (per link, :data:`LINKS`) prices every path for
:meth:`~vllm_dsa_connector.transport.gate.BounceGate.choose` (see :meth:`LinkProfile.estimates`).
:func:`detect_profile` picks a transport profile from the memory and ``UCX_TLS``. No torch, no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["LINKS", "LINK_OF_PROFILE", "PROFILES", "CostModel", "LinkProfile", "detect_profile"]


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


# Fitted to ``vllm-dsa bench transfer`` (CPU hosts) and bench/gpu_transfer.py (H200); the runs are in
# docs/benchmarks.md and bench/results/:
# - cma (UCX default on one host): extra cost per descriptor 5-15 us (grows with run size), gather +
#   scatter at ~3-6 GB/s effective with one thread; bounce wins up to 8 KiB runs, ties at 16 KiB, loses
#   at 64 KiB -> break-even run ~ desc_us * copy_gbps / 2 = 14 KB.
# - tcp (UCX_TLS=tcp): 14-25 us per descriptor for runs <= 16 KiB, more at 64 KiB (rendezvous messages;
#   grows with host load). 25 us puts the break-even near 50 KB runs: 256 x 64 KiB go direct (1.58x
#   faster than bounced), 512 x 16 KiB bounce (1.5-1.6x faster than direct).
# - cuda (H200, VRAM->VRAM cuda_ipc): 593 descriptors cost ~5 ms more than one; gather/scatter ~1.8 TB/s
#   of payload; ~0.5 ms fixed (post + notification + completion) -> bounce pays below ~6 MB per run.
# - rdma: an estimate (no RDMA NIC here); tune it on such hardware with bounce_desc_cost_us & co.
PROFILES: dict[str, CostModel] = {
    "cma": CostModel(desc_us=7.0, copy_gbps=4.0, fixed_us=200.0),
    "tcp": CostModel(desc_us=25.0, copy_gbps=4.0, fixed_us=200.0),
    "rdma": CostModel(desc_us=2.0, copy_gbps=4.0, fixed_us=100.0),
    "cuda": CostModel(desc_us=8.0, copy_gbps=1700.0, fixed_us=500.0),
}


@dataclass(frozen=True)
class LinkProfile:
    """What moving bytes to a peer over one link costs (microseconds, GB/s of payload).

    ``desc_us``: engine cost per descriptor; ``wire_gbps``: the engine's bandwidth for one large
    descriptor; ``copy_gbps``: one local gather or scatter (GPU memory; ``cpu_copy_gbps`` for host
    memory); ``bounce_us``: fixed extra of a bounce (slot, launches, synchronisation); ``chunk_us``:
    extra per pipelined chunk (post + notification); ``async_post``: posting overlaps the wire (GPU copy
    engines, NICs) instead of adding to it (CPU-driven copies); ``overlap``: gather/scatter and the wire
    use different resources (two GPUs, a NIC), so pipelining chunks overlaps them; on one GPU all three
    share its memory and pipelining only adds chunk costs; ``ipc_gbps``: the one-kernel copy through a
    CUDA IPC mapping (``None``: no such path on this link) with ``ipc_us`` fixed (launch, notification);
    ``post_us``: fixed cost of one engine transfer (prepare, post, completion, notification), so small
    transfers compare right against ``ipc``.
    """

    desc_us: float
    wire_gbps: float
    copy_gbps: float
    bounce_us: float
    chunk_us: float
    async_post: bool
    overlap: bool
    ipc_gbps: float | None = None
    ipc_us: float = 0.0
    cpu_copy_gbps: float = 4.0
    post_us: float = 0.0

    def for_memory(self, gpu: bool) -> LinkProfile:
        """The profile for host memory (``gpu=False``): CPU copies, no overlap, no IPC."""
        if gpu:
            return self
        return replace(self, copy_gbps=self.cpu_copy_gbps, overlap=False, ipc_gbps=None)

    def pipelined_us(self, total_bytes: int, chunks: int) -> float:
        """Chunked bounce: three stages (gather, WRITE, scatter) over ``chunks`` equal chunks."""
        g = total_bytes / (self.copy_gbps * 1e3)
        w = total_bytes / (self.wire_gbps * 1e3)
        stages = 2 * g + w
        if self.overlap and chunks > 1:
            stages = stages / chunks + (chunks - 1) / chunks * max(g, w)
        return self.post_us + self.bounce_us + chunks * (self.chunk_us + self.desc_us) + stages

    def estimates(
        self, num_runs: int, total_bytes: int, chunks: tuple[int, ...] = (2, 4, 8, 16)
    ) -> dict[str, float]:
        """Estimated time of each path (us; a cost common to all paths is left out)::

        direct     = post + n * desc + wire        (post + max(n * desc, wire) + desc with async_post)
        bounce     = post + bounce + desc + wire + 2 * bytes / copy
        pipelined  = post + bounce + k * (chunk + desc) + pipeline(gather, wire, scatter; k chunks)
        ipc        = ipc_us + bytes / ipc_gbps
        """
        wire = total_bytes / (self.wire_gbps * 1e3)
        post = num_runs * self.desc_us
        direct = max(post, wire) + self.desc_us if self.async_post else post + wire
        copy2 = 2.0 * total_bytes / (self.copy_gbps * 1e3)
        out = {
            "direct": self.post_us + direct,
            "bounce": self.post_us + self.bounce_us + self.desc_us + wire + copy2,
        }
        for k in chunks:
            out[f"pipelined:{k}"] = self.pipelined_us(total_bytes, k)
        if self.ipc_gbps:
            out["ipc"] = self.ipc_us + total_bytes / (self.ipc_gbps * 1e3)
        return out


# Per link, fitted to bench/gpu_transfer.py and bench/gpu_two_gpu.py on H200s (GLM-5.2-shaped request,
# 2.05 GB, 593 merged runs, and 64- / 8-block requests; NIXL 1.5.1 UCX cuda_ipc; docs/benchmarks.md):
# - same_gpu (two processes): one-descriptor WRITE ~1.0 ms (~2 TB/s); 593 descriptors 5.0-7.9 ms
#   -> ~9 us each, added to the wire time; ~0.45 ms fixed per NIXL transfer; bounce 4.2-4.9 ms -> ~0.8 ms
#   fixed besides gather + scatter; pipelining on one GPU only adds chunk costs. `ipc` (cached plan, graph
#   replay, event completion): 594 / 64 / 8 blocks (2.051 / 0.221 / 0.028 GB) in 1.571 / 0.569 / 0.451 ms
#   end to end -> a line through them: ~0.44 ms fixed + 1,800 GB/s (ipc_us 440, ipc_gbps 1800), which
#   prices 8 blocks below direct (0.564 ms measured; model 0.54). Direct at those shapes: 6.689 / 1.129 /
#   0.564 ms (model: 6.81 / 1.14 / 0.54).
# - nvlink (H200 -> H200, NV18): one-descriptor WRITE 5.24 ms (391 GB/s); 593 descriptors 7.05-7.46 ms
#   -> ~3.5 us each, added; 58,806 descriptors 247-335 ms; bounce 8.4-9.2 ms; pipelined x4 7.4-8.9 ms
#   (gather/scatter overlap the wire; 0.15-0.6 ms per chunk, mostly host launches); the IPC kernel
#   storing through the mapping 5.52 ms of GPU time (371 GB/s; a plain peer copy 387-394 GB/s, one
#   copy-engine DMA per run 304 GB/s); with the launch plan cached on the runs (CUDA graph replay) and the
#   completion on an interprocess event whose notification leaves at launch: 5.85-5.97 ms end to end,
#   ~0.33-0.45 ms fixed (ipc_us); 64 and 8 blocks: ipc 0.80-0.92 / 0.46-0.56 ms vs merged direct 1.07 / 0.53.
# - rdma: GPUDirect over one 400 Gb/s NIC, an estimate (no such NIC here).
# - cma/tcp: host memory on this project's CPU hosts (the bounce numbers are those of PROFILES, so
#   the two models agree there).
LINKS: dict[str, LinkProfile] = {
    "same_gpu": LinkProfile(
        9.0, 2000.0, 1900.0, 800.0, 150.0, False, False, 1800.0, 440.0, post_us=450.0
    ),
    "nvlink": LinkProfile(3.5, 391.0, 1900.0, 700.0, 400.0, False, True, 371.0, 400.0, post_us=450.0),
    "rdma": LinkProfile(2.0, 45.0, 1900.0, 100.0, 30.0, True, True, post_us=50.0),
    "cma": LinkProfile(7.0, 2.8, 4.0, 200.0, 50.0, False, False),
    "tcp": LinkProfile(25.0, 1.7, 4.0, 200.0, 60.0, False, False),
}
#: The link profile :class:`~vllm_dsa_connector.transport.gate.BounceGate` uses per transport profile
#: when ``bounce_link`` is ``auto``.
LINK_OF_PROFILE: dict[str, str] = {"cuda": "same_gpu", "cma": "cma", "tcp": "tcp", "rdma": "rdma"}

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
