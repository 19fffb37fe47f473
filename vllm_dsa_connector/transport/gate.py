"""The bounce gate: per transfer, which path moves the bytes fastest over the link to the peer.

Two entry points. ``decision(runs)`` / ``decide(runs)``: bounce (gather + one write + scatter) or post
the runs directly, with the per-transport :class:`CostModel` below (what the connector uses).
``choose(runs, paths=..., link=...)``: the fastest of ``direct`` / ``bounce`` / ``pipelined`` (chunked
bounce, gather/WRITE/scatter overlapped) / ``ipc`` (one kernel through a CUDA IPC mapping, same node) for
one link, with the per-link :class:`LinkProfile` of :data:`LINKS` (see :meth:`LinkProfile.estimates`).

Cost model, per transport profile (numbers are microseconds and GB/s; wire time is common to both paths
and left out)::

    direct_us = merged_runs * desc_us
    bounce_us = desc_us + fixed_us + 2 * bytes / copy_bandwidth      # one descriptor, gather + scatter

The gate bounces when ``bounce_us < direct_us`` and the thresholds allow it: at least ``min_runs`` runs
AFTER merging (never blocks), at least ``min_bytes`` bytes, and an average run no longer than
``max_avg_run_bytes``. Every knob is settable in the connector's ``kv_connector_extra_config`` (keys in
:data:`BOUNCE_OPTION_KEYS`) and by ``VLLM_DSA_BOUNCE_*`` environment variables; explicit config > env >
defaults; a bad value raises :class:`~vllm_dsa_connector.options.OptionError` naming the key at start-up.

Default profiles were measured on a 2-vCPU KVM guest (two processes, NIXL 1.5.1 UCX, torch CPU) and on an
H200 (VRAM->VRAM over cuda_ipc); see the comment above :data:`PROFILES`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from vllm_dsa_connector.options import (
    Option,
    OptionError,
    parse_choice,
    parse_float,
    parse_int,
)
from vllm_dsa_connector.transport.runs import Runs

__all__ = [
    "BOUNCE_OPTION_KEYS",
    "LINKS",
    "PATHS",
    "PROFILES",
    "BounceGate",
    "BounceSettings",
    "CostModel",
    "Decision",
    "LinkProfile",
    "detect_profile",
]

Path = Literal["bounce", "direct", "pipelined", "ipc"]
#: Every path :meth:`BounceGate.choose` knows.
PATHS: tuple[str, ...] = ("direct", "bounce", "pipelined", "ipc")


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


# Tuned on this project's hosts (2026-11-29; ``vllm-dsa bench transfer`` and bench/gpu_transfer.py):
# - cma (UCX default on one host): extra cost per descriptor 5-15 us (grows with run size), gather +
#   scatter at ~3-6 GB/s effective with one thread; bounce won up to 8 KiB runs, tied at 16 KiB, lost
#   at 64 KiB -> break-even run ~ desc_us * copy_gbps / 2 = 14 KB.
# - tcp (UCX_TLS=tcp): 14-21 us per descriptor for runs <= 16 KiB, 18-94 us at 64 KiB (rendezvous
#   messages; grows with host load). 64 KiB runs: bounce 1.2-1.3x faster on the loaded host (medians of
#   20-30), 1.27x slower once when idle -> 40 us, so the gate bounces up to ~80 KB runs on tcp.
# - cuda (H200, VRAM->VRAM cuda_ipc): 593 descriptors cost ~5 ms more than one; gather/scatter ~1.8 TB/s
#   of payload; ~0.5 ms fixed (post + notification + completion) -> bounce pays below ~6 MB per run.
# - rdma: an estimate (no RDMA NIC here); tune it on such hardware with bounce_desc_cost_us & co.
PROFILES: dict[str, CostModel] = {
    "cma": CostModel(desc_us=7.0, copy_gbps=4.0, fixed_us=200.0),
    "tcp": CostModel(desc_us=40.0, copy_gbps=4.0, fixed_us=200.0),
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


# Per link, measured 2026-11-30 on H200s (bench/gpu_transfer.py, bench/gpu_two_gpu.py; GLM-5.2-shaped
# request, 2.05 GB, 593 merged runs, and 64- / 8-block requests; NIXL 1.5.1 UCX cuda_ipc):
# - same_gpu (two processes): one-descriptor WRITE ~1.0 ms (~2 TB/s); 593 descriptors 5.0-7.9 ms
#   -> ~9 us each, added to the wire time; ~0.45 ms fixed per NIXL transfer (8 blocks: 0.6 ms end to
#   end); bounce 4.2-4.9 ms -> ~0.8 ms fixed besides gather + scatter; pipelining on one GPU only adds
#   chunk costs; the IPC kernel 1.04 ms of GPU time (~1.95 TB/s of payload) + ~0.6 ms of launch,
#   completion and notification (1.6-2.0 ms end to end).
# - nvlink (H200 -> H200, NV18): one-descriptor WRITE 5.24 ms (391 GB/s); 593 descriptors 7.05-7.46 ms
#   -> ~3.5 us each, added; 58,806 descriptors 247-335 ms; bounce 8.4-9.2 ms; pipelined x4 7.4-8.9 ms
#   (gather/scatter overlap the wire; 0.15-0.6 ms per chunk, mostly host launches); the IPC kernel
#   storing through the mapping 5.52 ms of GPU time (371 GB/s; a plain peer copy 387-394 GB/s, one
#   copy-engine DMA per run 304 GB/s) + ~0.85 ms fixed (6.53 ms end to end); with the launch plan
#   cached on the runs (CUDA graph replay) and the completion on an interprocess event whose
#   notification leaves at launch: 5.85-5.97 ms end to end, ~0.33-0.45 ms fixed (ipc_us); 64 and 8
#   blocks: ipc 0.80-0.92 / 0.46-0.56 ms vs merged direct 1.07 / 0.53.
# - rdma: GPUDirect over one 400 Gb/s NIC, an estimate (no such NIC here).
# - cma/tcp: host memory on this project's CPU hosts (the bounce numbers are those of PROFILES, so
#   the two models agree there).
LINKS: dict[str, LinkProfile] = {
    "same_gpu": LinkProfile(
        9.0, 2000.0, 1900.0, 800.0, 150.0, False, False, 1950.0, 600.0, post_us=450.0
    ),
    "nvlink": LinkProfile(3.5, 391.0, 1900.0, 700.0, 400.0, False, True, 371.0, 400.0, post_us=450.0),
    "rdma": LinkProfile(2.0, 45.0, 1900.0, 100.0, 30.0, True, True, post_us=50.0),
    "cma": LinkProfile(7.0, 2.8, 4.0, 200.0, 50.0, False, False),
    "tcp": LinkProfile(40.0, 1.7, 4.0, 200.0, 60.0, False, False),
}
_LINK_OF_PROFILE = {"cuda": "same_gpu", "cma": "cma", "tcp": "tcp", "rdma": "rdma"}
_MIN_CHUNK_BYTES = 4 << 20

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


def _pos_float(key: str, value: Any) -> float:
    return parse_float(key, value, minimum=0.0)


def _bandwidth(key: str, value: Any) -> float:
    out = parse_float(key, value, minimum=0.0)
    if out <= 0:
        raise OptionError(f"{key}: must be > 0, got {value!r}")
    return out


def _opt_float(parse):  # noqa: ANN001, ANN202 - tiny adapter
    def inner(key: str, value: Any) -> float | None:
        if isinstance(value, str) and value.strip().lower() in ("", "auto", "none"):
            return None
        return parse(key, value)

    return inner


def _env(key: str) -> str:
    return "VLLM_DSA_" + key.upper()


_OPTIONS: tuple[Option[Any], ...] = (
    Option(
        "bounce_mode",
        lambda k, v: parse_choice(k, v, ("auto", "always", "never")),
        "auto",
        _env("bounce_mode"),
        "auto: the gate decides; always/never force a path",
    ),
    Option(
        "bounce_profile",
        lambda k, v: parse_choice(k, v, ("auto", *PROFILES)),
        "auto",
        _env("bounce_profile"),
        "cost profile; auto: cuda for GPU memory, else from UCX_TLS",
    ),
    Option(
        "bounce_min_runs",
        lambda k, v: parse_int(k, v, minimum=1),
        8,
        _env("bounce_min_runs"),
        "bounce only with at least this many runs after merging",
    ),
    Option(
        "bounce_min_bytes",
        lambda k, v: parse_int(k, v, minimum=0),
        0,
        _env("bounce_min_bytes"),
        "bounce only with at least this many bytes",
    ),
    Option(
        "bounce_max_avg_run_bytes",
        lambda k, v: parse_int(k, v, minimum=1),
        1 << 30,
        _env("bounce_max_avg_run_bytes"),
        "bounce only when the average run is at most this long",
    ),
    Option(
        "bounce_desc_cost_us",
        _opt_float(_pos_float),
        None,
        _env("bounce_desc_cost_us"),
        "override the profile's cost per descriptor (us)",
    ),
    Option(
        "bounce_copy_gbps",
        _opt_float(_bandwidth),
        None,
        _env("bounce_copy_gbps"),
        "override the profile's gather/scatter bandwidth (GB/s)",
    ),
    Option(
        "bounce_fixed_us",
        _opt_float(_pos_float),
        None,
        _env("bounce_fixed_us"),
        "override the profile's fixed bounce overhead (us)",
    ),
    Option(
        "bounce_link",
        lambda k, v: parse_choice(k, v, ("auto", *LINKS)),
        "auto",
        _env("bounce_link"),
        "link profile for choose(); auto: same_gpu for GPU memory, else from the cost profile",
    ),
    Option(
        "bounce_wire_gbps",
        _opt_float(_bandwidth),
        None,
        _env("bounce_wire_gbps"),
        "override the link profile's engine bandwidth (GB/s)",
    ),
    Option(
        "bounce_ipc_gbps",
        _opt_float(_bandwidth),
        None,
        _env("bounce_ipc_gbps"),
        "override the link profile's IPC single-copy bandwidth (GB/s)",
    ),
    Option(
        "bounce_max_chunks",
        lambda k, v: parse_int(k, v, minimum=1, maximum=256),
        16,
        _env("bounce_max_chunks"),
        "most chunks of a pipelined bounce (1: never pipeline)",
    ),
    Option(
        "bounce_arena_bytes",
        lambda k, v: parse_int(k, v, minimum=4096),
        256 << 20,
        _env("bounce_arena_bytes"),
        "staging arena size (bytes; k/m/g suffixes)",
    ),
    Option(
        "bounce_reserve_timeout_s",
        lambda k, v: parse_float(k, v, minimum=0.0, maximum=60.0),
        0.2,
        _env("bounce_reserve_timeout_s"),
        "bounded wait for staging space before the direct path",
    ),
)

#: Keys of ``kv_connector_extra_config`` read by :meth:`BounceSettings.from_config`.
BOUNCE_OPTION_KEYS: frozenset[str] = frozenset(o.key for o in _OPTIONS)


@dataclass(frozen=True)
class BounceSettings:
    """Resolved bounce options (see :data:`BOUNCE_OPTION_KEYS`)."""

    mode: str = "auto"
    profile: str = "auto"
    min_runs: int = 8
    min_bytes: int = 0
    max_avg_run_bytes: int = 1 << 30
    desc_cost_us: float | None = None
    copy_gbps: float | None = None
    fixed_us: float | None = None
    link: str = "auto"
    wire_gbps: float | None = None
    ipc_gbps: float | None = None
    max_chunks: int = 16
    arena_bytes: int = 256 << 20
    reserve_timeout_s: float = 0.2

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> BounceSettings:
        """Resolve from ``kv_connector_extra_config`` (other keys ignored) > ``VLLM_DSA_BOUNCE_*`` > defaults.

        A key starting with ``bounce_`` that is not known is refused (a typo must not fall back silently).
        """
        config = dict(config or {})
        unknown = sorted(
            k for k in config if k.startswith("bounce_") and k not in BOUNCE_OPTION_KEYS
        )
        if unknown:
            raise OptionError(
                f"unknown bounce option(s) {', '.join(unknown)}; known: {', '.join(sorted(BOUNCE_OPTION_KEYS))}"
            )
        values = {o.key.removeprefix("bounce_"): o.resolve(config, environ) for o in _OPTIONS}
        return cls(**values)


@dataclass(frozen=True)
class Decision:
    """What the gate chose and why (estimates in microseconds).

    ``chunks``: chunks of a pipelined bounce (1 otherwise); ``link``: the link profile used by
    :meth:`BounceGate.choose` (empty for :meth:`BounceGate.decision`); ``estimates``: every candidate
    path's estimate, ``(name, us)`` pairs, ``pipelined:K`` for K chunks.
    """

    path: Path
    num_runs: int
    total_bytes: int
    reason: str
    direct_us: float
    bounce_us: float
    chunks: int = 1
    link: str = ""
    estimates: tuple[tuple[str, float], ...] = ()


class BounceGate:
    """Decide per transfer: ``decide(runs) -> "bounce" | "direct"``."""

    def __init__(
        self,
        settings: BounceSettings | None = None,
        *,
        device: str = "cpu",
        environ: Mapping[str, str] | None = None,
        link: str | None = None,
    ) -> None:
        self.settings = settings or BounceSettings()
        s = self.settings
        self.device = str(device)
        self.profile = detect_profile(device, environ) if s.profile == "auto" else s.profile
        base = PROFILES[self.profile]
        self.cost = CostModel(
            desc_us=base.desc_us if s.desc_cost_us is None else s.desc_cost_us,
            copy_gbps=base.copy_gbps if s.copy_gbps is None else s.copy_gbps,
            fixed_us=base.fixed_us if s.fixed_us is None else s.fixed_us,
        )
        if link is None:
            link = _LINK_OF_PROFILE[self.profile] if s.link == "auto" else s.link
        if link not in LINKS:
            raise ValueError(f"BounceGate: unknown link {link!r}; known: {', '.join(LINKS)}")
        self.link = link
        self.link_profile = self._link_profile(link)

    def _link_profile(self, link: str) -> LinkProfile:
        s = self.settings
        lp = LINKS[link].for_memory(self.device.startswith("cuda"))
        changes: dict[str, Any] = {}
        if s.desc_cost_us is not None:
            changes["desc_us"] = s.desc_cost_us
        if s.copy_gbps is not None:
            changes["copy_gbps"] = s.copy_gbps
        if s.fixed_us is not None:
            changes["bounce_us"] = s.fixed_us
        if s.wire_gbps is not None:
            changes["wire_gbps"] = s.wire_gbps
        if s.ipc_gbps is not None and lp.ipc_gbps is not None:
            changes["ipc_gbps"] = s.ipc_gbps
        return replace(lp, **changes) if changes else lp

    def for_link(self, link: str) -> BounceGate:
        """The same settings with another link profile (one gate per peer link)."""
        out = object.__new__(BounceGate)
        out.__dict__.update(self.__dict__)
        if link not in LINKS:
            raise ValueError(f"BounceGate: unknown link {link!r}; known: {', '.join(LINKS)}")
        out.link = link
        out.link_profile = self._link_profile(link)
        return out

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | None = None,
        *,
        device: str = "cpu",
        environ: Mapping[str, str] | None = None,
        link: str | None = None,
    ) -> BounceGate:
        """Build from ``kv_connector_extra_config`` + env (explicit > env > defaults).

        ``link`` (a :data:`LINKS` name) overrides ``bounce_link``/auto for :meth:`choose`.
        """
        return cls(
            BounceSettings.from_config(config, environ), device=device, environ=environ, link=link
        )

    def decision(self, runs: Runs, *, merged: bool = False) -> Decision:
        """Full decision record; ``merged=True`` when ``runs`` are already merged."""
        r = runs if merged else runs.merged()
        n, total = r.num_runs, r.total_bytes
        d_us, b_us = self.cost.direct_us(n, total), self.cost.bounce_us(n, total)
        s = self.settings

        def out(path: Path, reason: str) -> Decision:
            return Decision(path, n, total, reason, d_us, b_us)

        if total == 0:
            return out("direct", "empty transfer")
        if s.mode == "never":
            return out("direct", "bounce_mode=never")
        if s.mode == "always":
            return out("bounce", "bounce_mode=always")
        if n < s.min_runs:
            return out("direct", f"{n} runs < bounce_min_runs={s.min_runs}")
        if total < s.min_bytes:
            return out("direct", f"{total} bytes < bounce_min_bytes={s.min_bytes}")
        if total / n > s.max_avg_run_bytes:
            return out("direct", f"average run {total // n} B > bounce_max_avg_run_bytes")
        if b_us < d_us:
            return out("bounce", f"cost model ({self.profile}): {b_us:.0f} us < {d_us:.0f} us")
        return out("direct", f"cost model ({self.profile}): {b_us:.0f} us >= {d_us:.0f} us")

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
        lp = self.link_profile if link is None or link == self.link else self._link_profile(link)
        name = self.link if link is None else link
        r = runs if merged else runs.merged()
        n, total = r.num_runs, r.total_bytes
        s = self.settings
        ks = tuple(
            k
            for k in (2, 4, 8, 16, 32, 64, 128, 256)
            if k <= s.max_chunks and total // k >= _MIN_CHUNK_BYTES
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

    def decide(self, runs: Runs, *, merged: bool = False) -> Path:
        """``"bounce"`` or ``"direct"`` from the number of runs after merging and the bytes."""
        return self.decision(runs, merged=merged).path

    def __repr__(self) -> str:
        return (
            f"BounceGate(profile={self.profile!r}, cost={self.cost}, link={self.link!r}, "
            f"settings={self.settings})"
        )
