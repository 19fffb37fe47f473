"""The bounce gate: per transfer, bounce (gather + one write + scatter) or post the runs directly.

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
from dataclasses import dataclass
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
    "PROFILES",
    "BounceGate",
    "BounceSettings",
    "CostModel",
    "Decision",
    "detect_profile",
]

Path = Literal["bounce", "direct"]


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
    """What the gate chose and why (estimates in microseconds)."""

    path: Path
    num_runs: int
    total_bytes: int
    reason: str
    direct_us: float
    bounce_us: float


class BounceGate:
    """Decide per transfer: ``decide(runs) -> "bounce" | "direct"``."""

    def __init__(
        self,
        settings: BounceSettings | None = None,
        *,
        device: str = "cpu",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings or BounceSettings()
        s = self.settings
        self.profile = detect_profile(device, environ) if s.profile == "auto" else s.profile
        base = PROFILES[self.profile]
        self.cost = CostModel(
            desc_us=base.desc_us if s.desc_cost_us is None else s.desc_cost_us,
            copy_gbps=base.copy_gbps if s.copy_gbps is None else s.copy_gbps,
            fixed_us=base.fixed_us if s.fixed_us is None else s.fixed_us,
        )

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | None = None,
        *,
        device: str = "cpu",
        environ: Mapping[str, str] | None = None,
    ) -> BounceGate:
        """Build from ``kv_connector_extra_config`` + env (explicit > env > defaults)."""
        return cls(BounceSettings.from_config(config, environ), device=device, environ=environ)

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

    def decide(self, runs: Runs, *, merged: bool = False) -> Path:
        """``"bounce"`` or ``"direct"`` from the number of runs after merging and the bytes."""
        return self.decision(runs, merged=merged).path

    def __repr__(self) -> str:
        return f"BounceGate(profile={self.profile!r}, cost={self.cost}, settings={self.settings})"
