"""The bounce gate: per transfer, which path moves the bytes fastest over the link to the peer.

Two entry points. ``decision(runs)`` / ``decide(runs)``: bounce (gather + one write + scatter) or post
the runs directly, with the per-transport :class:`~vllm_dsa_connector.transport.profiles.CostModel`
(what the connector uses). ``choose(runs, paths=..., link=...)``: the fastest of ``direct`` / ``bounce`` /
``pipelined`` (chunked bounce, gather/WRITE/scatter overlapped) / ``ipc`` (one kernel through a CUDA IPC
mapping, same node) for one link, with the per-link
:class:`~vllm_dsa_connector.transport.profiles.LinkProfile` of ``LINKS``.

The gate bounces when ``bounce_us < direct_us`` (cost model: :mod:`.profiles`, with the measurements
behind the defaults) and the thresholds allow it: at least ``min_runs`` runs AFTER merging (never
blocks), at least ``min_bytes`` bytes, and an average run no longer than ``max_avg_run_bytes``. Every knob
is a ``bounce_*`` key of the connector's ``kv_connector_extra_config`` or a ``VLLM_DSA_BOUNCE_*``
environment variable (:class:`~vllm_dsa_connector.transport.gate_options.BounceSettings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from vllm_dsa_connector.transport.gate_options import BOUNCE_OPTION_KEYS, BounceSettings
from vllm_dsa_connector.transport.profiles import (
    LINK_OF_PROFILE,
    LINKS,
    PROFILES,
    CostModel,
    LinkProfile,
    detect_profile,
)
from vllm_dsa_connector.transport.runs import Runs

# The settings and profile names stay importable from here (they lived in this module).
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
_MIN_CHUNK_BYTES = 4 << 20


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
            link = LINK_OF_PROFILE[self.profile] if s.link == "auto" else s.link
        if link not in LINKS:
            raise ValueError(f"BounceGate: unknown link {link!r}; known: {', '.join(LINKS)}")
        self.link = link
        self.link_profile = self._link_profile(link)
        # choose() per (link, runs, bytes, paths): a pure function of the frozen settings, so a repeated
        # shape costs a lookup instead of ~30-130 us of Python (measured in the H200 bench's small shapes)
        self._chosen: dict[tuple[str, int, int, tuple[str, ...]], Decision] = {}

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
