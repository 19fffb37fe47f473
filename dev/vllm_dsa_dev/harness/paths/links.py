"""The benches' path chooser: the fastest of direct / bounce / pipelined / ipc over one link, per transfer.

The connector does not use it: D routes each pair with the one cost model of
:class:`~vllm_dsa_connector.core.transfer.gate.BounceGate` (bounce or direct), or through ipc when it can
(:mod:`vllm_dsa_connector.core.handoff.routes`). The benches compare every path over a link with this model:
:class:`LinkProfile` (per link, :data:`LINKS`) prices each path (:meth:`LinkProfile.estimates`) and
:class:`PathChooser` picks the cheapest that the transfer can take, under the gate's bounce thresholds.
The measurements behind the link profiles are in docs/cost-profiles.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.gate import BounceGate, Decision
from vllm_dsa_connector.core.transfer.ipc import device_uuid, host_id

__all__ = [
    "LINKS",
    "LINK_OF_PROFILE",
    "PATHS",
    "LinkProfile",
    "LinkSettings",
    "PathChooser",
    "link_between",
]

#: Every path :meth:`PathChooser.choose` knows (ties go to the earlier one).
PATHS: tuple[str, ...] = ("direct", "bounce", "pipelined", "ipc")
_MIN_CHUNK_BYTES = 4 << 20


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



LINKS: dict[str, LinkProfile] = {
    "same_gpu": LinkProfile(
        9.0, 2000.0, 1900.0, 800.0, 150.0, False, False, 1800.0, 440.0, post_us=450.0
    ),
    "nvlink": LinkProfile(3.5, 391.0, 1900.0, 700.0, 400.0, False, True, 371.0, 400.0, post_us=450.0),
    "rdma": LinkProfile(2.0, 45.0, 1900.0, 100.0, 30.0, True, True, post_us=50.0),
    "cma": LinkProfile(7.0, 2.8, 4.0, 200.0, 50.0, False, False),
    "tcp": LinkProfile(25.0, 1.7, 4.0, 200.0, 60.0, False, False),
}
#: The link profile :class:`~vllm_dsa_connector.core.transfer.gate.BounceGate` uses per transport profile
#: when ``bounce_link`` is ``auto``.
LINK_OF_PROFILE: dict[str, str] = {"cuda": "same_gpu", "cma": "cma", "tcp": "tcp", "rdma": "rdma"}



@dataclass(frozen=True)
class LinkSettings:
    """What the chooser takes beyond the gate's settings: the link (``auto``: from the gate's cost
    profile, :data:`LINK_OF_PROFILE`), overrides of its engine and IPC bandwidth (GB/s), and the most chunks
    of a pipelined bounce (1: never pipeline)."""

    link: str = "auto"
    wire_gbps: float | None = None
    ipc_gbps: float | None = None
    max_chunks: int = 16

    def __post_init__(self) -> None:
        if self.link != "auto" and self.link not in LINKS:
            raise ValueError(f"LinkSettings: unknown link {self.link!r}; known: auto, {', '.join(LINKS)}")
        if not 1 <= self.max_chunks <= 256:
            raise ValueError(f"LinkSettings: max_chunks must be 1..256, got {self.max_chunks}")
        for name in ("wire_gbps", "ipc_gbps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"LinkSettings: {name} must be > 0, got {value}")


class PathChooser:
    """:meth:`choose`: the fastest path for a transfer over a link (``gate``: the bounce thresholds, the
    mode and the cost overrides of ``bounce_*``; ``settings``: the link and its overrides)."""

    def __init__(self, gate: BounceGate, settings: LinkSettings | None = None, *, link: str | None = None) -> None:
        self.gate = gate
        self.settings = settings or LinkSettings()
        if link is None:
            link = LINK_OF_PROFILE[gate.profile] if self.settings.link == "auto" else self.settings.link
        if link not in LINKS:
            raise ValueError(f"PathChooser: unknown link {link!r}; known: {', '.join(LINKS)}")
        self.link = link
        self.link_profile = self._link_profile(link)
        # choose() per (link, runs, bytes, paths): a pure function of the frozen settings, so a repeated shape
        # costs a lookup instead of tens of microseconds of Python
        self._chosen: dict[tuple[str, int, int, tuple[str, ...]], Decision] = {}

    def _link_profile(self, link: str) -> LinkProfile:
        s, ls = self.gate.settings, self.settings
        lp = LINKS[link].for_memory(self.gate.device.startswith("cuda"))
        changes: dict[str, Any] = {}
        if s.desc_cost_us is not None:
            changes["desc_us"] = s.desc_cost_us
        if s.copy_gbps is not None:
            changes["copy_gbps"] = s.copy_gbps
        if s.fixed_us is not None:
            changes["bounce_us"] = s.fixed_us
        if ls.wire_gbps is not None:
            changes["wire_gbps"] = ls.wire_gbps
        if ls.ipc_gbps is not None and lp.ipc_gbps is not None:
            changes["ipc_gbps"] = ls.ipc_gbps
        return replace(lp, **changes) if changes else lp

    def for_link(self, link: str) -> PathChooser:
        """The same settings over another link (one chooser per peer link)."""
        return PathChooser(self.gate, self.settings, link=link)

    def choose(
        self,
        runs: Runs,
        *,
        merged: bool = False,
        paths: tuple[str, ...] = ("direct", "bounce"),
        link: str | None = None,
    ) -> Decision:
        """The fastest of ``paths`` for ``runs`` over ``link`` (default: the gate's link).

        ``paths`` lists what is possible for this transfer: ``bounce``/``pipelined`` need a staging
        slot, ``ipc`` an opened CUDA IPC mapping of the destination (same node). The bounce thresholds
        (``bounce_min_runs`` & co.) and ``bounce_mode`` apply to ``bounce`` and ``pipelined``;
        ``ipc`` is a single copy with no threshold. Ties go to the earlier entry of :data:`PATHS`.
        """
        unknown = [p for p in paths if p not in PATHS]
        if unknown:
            raise ValueError(f"choose: unknown path(s) {unknown}; known: {', '.join(PATHS)}")
        name = self.link if link is None else link
        r = runs if merged else runs.merged()
        n, total = r.num_runs, r.total_bytes
        memo = (name, n, total, tuple(paths))
        hit = self._chosen.get(memo)
        if hit is not None:
            return hit
        if len(self._chosen) >= 4096:
            self._chosen.clear()
        self._chosen[memo] = out = self._choose(name, n, total, memo[3])
        return out

    def _choose(self, name: str, n: int, total: int, paths: tuple[str, ...]) -> Decision:
        lp = self.link_profile if name == self.link else self._link_profile(name)
        s = self.gate.settings
        ks = tuple(
            k
            for k in (2, 4, 8, 16, 32, 64, 128, 256)
            if k <= self.settings.max_chunks and total // k >= _MIN_CHUNK_BYTES
        )
        est = lp.estimates(n, total, ks)
        staged = [p for p in paths if p in ("bounce", "pipelined")]
        why = ""
        if staged:
            if total == 0:
                why = "empty transfer"
            elif s.mode == "never":
                why = "bounce_mode=never"
            elif s.mode != "always":
                if n < s.min_runs:
                    why = f"{n} runs < bounce_min_runs={s.min_runs}"
                elif total < s.min_bytes:
                    why = f"{total} bytes < bounce_min_bytes={s.min_bytes}"
                elif total / n > s.max_avg_run_bytes:
                    why = f"average run {total // n} B > bounce_max_avg_run_bytes"
        cands: list[tuple[float, int, str, int]] = []
        for p in paths:
            if p in ("bounce", "pipelined") and why:
                continue
            if s.mode == "always" and p in ("direct", "ipc") and staged:
                continue
            if p == "pipelined":
                cands.extend((est[f"pipelined:{k}"], PATHS.index(p), p, k) for k in ks)
            elif p in est:
                cands.append((est[p], PATHS.index(p), p, 1))
        if total == 0 or not cands:
            cands = [(est["direct"], 0, "direct", 1)]
        us, _, path, k = min(cands)
        shown = ", ".join(
            f"{p}{'x' + str(kk) if p == 'pipelined' else ''} {u:.0f}"
            for u, _, p, kk in sorted(cands)[:4]
        )
        reason = f"link {name}: {shown} us" + (f"; no bounce: {why}" if why else "")
        if total == 0:
            reason = "empty transfer"
        return Decision(
            path,  # type: ignore[arg-type]
            n,
            total,
            reason,
            est["direct"],
            est["bounce"],
            k,
            name,
            tuple(sorted(est.items())),
        )



def link_between(
    local: torch.device | str,
    remote_host: str | None = None,
    remote_uuid: str | None = None,
    *,
    cpu_link: str = "cma",
    remote_link: str = "rdma",
) -> str:
    """The gate's link name for a peer: ``same_gpu`` / ``nvlink`` / ``remote_link`` / ``cpu_link``.

    ``remote_host``/``remote_uuid`` come from the peer's :class:`IpcDesc` (None: unknown peer, treated
    as another node). CPU memory gets ``cpu_link`` (``cma`` or ``tcp``, from UCX_TLS).
    """
    dev = torch.device(local)
    if dev.type != "cuda":
        return cpu_link
    if remote_host is None or remote_host != host_id():
        return remote_link
    if remote_uuid is not None and remote_uuid == device_uuid(dev):
        return "same_gpu"
    return "nvlink"
