"""The bounce gate: the one cost model that decides, per transfer, bounce or direct.

``decision(runs)`` / ``decide(runs)`` / ``decision_for(num_runs, total_bytes)``: bounce (gather + one write
+ scatter) or post the runs directly, with the per-transport
:class:`~vllm_dsa_connector.core.transfer.profiles.CostModel`. D's route planner asks it once per (D rank, P rank)
pair of a request (:mod:`vllm_dsa_connector.core.handoff.routes`); P follows the route.

The gate bounces when ``bounce_us < direct_us`` and the thresholds allow it: at least ``min_runs`` runs AFTER
merging (never blocks), at least ``min_bytes`` bytes, and an average run no longer than
``max_avg_run_bytes``. Every knob is a ``bounce_*`` key of the connector's ``kv_connector_extra_config`` or a
``VLLM_DSA_BOUNCE_*`` environment variable (:class:`~vllm_dsa_connector.core.transfer.gate_options.BounceSettings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_dsa_connector.core.plan.runs import Runs
from vllm_dsa_connector.core.transfer.gate_options import BounceSettings
from vllm_dsa_connector.core.transfer.profiles import PROFILES, CostModel, detect_profile

__all__ = ["BounceGate", "Decision"]

#: A path a decision names (the gate's are bounce and direct; the benches' chooser also names the others)
Path = Literal["bounce", "direct", "pipelined", "ipc"]


@dataclass(frozen=True)
class Decision:
    """What was chosen and why (estimates in microseconds).

    ``chunks``: chunks of a pipelined bounce (1 otherwise); ``link``: the link profile a path chooser used
    (empty for the gate); ``estimates``: every candidate path's estimate, ``(name, us)`` pairs.
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
        return self.decision_for(r.num_runs, r.total_bytes)

    def decision_for(self, n: int, total: int) -> Decision:
        """The decision for ``n`` merged runs of ``total`` bytes: one part, or all the parts (pool pairs) of a
        writer that one bounce would carry together (their runs and bytes summed)."""
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
        return (
            f"BounceGate(profile={self.profile!r}, cost={self.cost}, "
            f"settings={self.settings})"
        )
