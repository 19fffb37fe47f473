"""A worker's transfer counters: the plain accumulator the send and receive sides (and the scheduler) record into.

:class:`Counters` holds one dict of counters (ints), series (lists of samples) and keyed entries (load failures by
reason, bytes per rank pair, staging samples per rank, per-request records); the keys are built here
(:func:`failure_key`, :func:`pair_key`, :func:`staging_key`) and read back here
(:func:`pair_bytes`, :func:`staging_full`, :func:`latest_samples`). An adapter exports them: the vLLM one as
``KVConnectorStats`` and Prometheus series (:mod:`vllm_dsa_connector.connector.stats`).

Invariant: the dict is plain data (ints, floats, lists, dicts of plain values) under a fixed set of keys and key
shapes, never a label taken from a peer's input, and :class:`Counters` changes it in place (whoever holds the dict
sees every record).
"""

from __future__ import annotations

from typing import Any

from vllm_dsa_connector.core.handoff.recompute import REASONS

COUNTERS = (
    "send_bytes",
    "send_runs",
    "send_descriptors",
    "bounce_bytes",
    "ipc_bytes",
    "layered_bytes",
    "recv_bytes",
    "recv_runs",
    "send_ok",
    "send_failed",
    "send_expired",
    "send_late",
    "recv_ok",
    "recv_failed",
    "recv_timeout",
    "checksum_mismatches",
    "checksummed_runs",
    "unusable_other_connector",
    "unusable_malformed",
    "peer_reconnects",
    "refused_identities",
    "fenced_connections",
    "connection_resets",
    "fenced_loads",
    "fence_timeouts",
    "fence_peer_gone",
    "setup_waits",
)
#: gauges: a series of samples (the scheduler adds one when the value changed); the last one is the value
GAUGES = ("early_held",)
SERIES = ("transfer_s", "recv_wait_s", *GAUGES)
_STAGING = "staging"  # gauge samples, lists keyed "staging:<held|full>:<rank>" (the last one is current)
_FAILURE = "load_failure"  # counter keys "load_failure:<reason>" (a reason of handoff.recompute.REASONS)
#: per-request facts the workers hand their scheduler (only with request records on; popped there, never exported)
RECORDS = "records"
_PAIR = "pair_bytes"  # counter keys "pair_bytes:<side>:<src_rank>:<dst_rank>"
#: the ``side`` of byte counts: ``send`` on P, ``recv`` on D
SIDES = ("send", "recv")
def failure_key(reason: str) -> str:
    """Counter key of the D requests not loaded from P for ``reason`` (one of
    :data:`~vllm_dsa_connector.core.handoff.recompute.REASONS`)."""
    if reason not in REASONS:
        raise ValueError(f"load failure reason {reason!r}: expected one of {list(REASONS)}")
    return f"{_FAILURE}:{reason}"


def pair_key(side: str, src_rank: int, dst_rank: int) -> str:
    """Counter key of the bytes one (P rank, D rank) pair moved on ``side`` (``send`` on P, ``recv`` on D)."""
    if side not in SIDES:
        raise ValueError(f"pair bytes side {side!r}: expected one of {list(SIDES)}")
    return f"{_PAIR}:{side}:{int(src_rank)}:{int(dst_rank)}"


def staging_key(what: str, rank: int) -> str:
    """Key of the samples of a P worker's staging arena: ``what`` is ``held`` (bytes in use) or ``full``
    (1 when it is nearly full: D should route direct)."""
    if what not in ("held", "full"):
        raise ValueError(f"staging sample {what!r}: expected held or full")
    return f"{_STAGING}:{what}:{int(rank)}"


def latest_samples(data: dict[str, Any], what: str) -> dict[int, float]:
    """Rank -> the latest ``what`` sample (``held`` or ``full``) of the staging arenas in a counters dict."""
    out: dict[int, float] = {}
    for key, value in data.items():
        if key.startswith(f"{_STAGING}:{what}:") and isinstance(value, list) and value:
            out[int(key.rsplit(":", 1)[1])] = float(value[-1])
    return out


def staging_full(data: dict[str, Any]) -> bool | None:
    """Whether any worker's staging arena is nearly full by the latest samples of a counters dict (None: none)."""
    latest = latest_samples(data, "full")
    return any(v > 0 for v in latest.values()) if latest else None


def pair_bytes(data: dict[str, Any]) -> dict[tuple[str, int, int], int]:
    """``{(side, src_rank, dst_rank): bytes}`` of a counters dict (see :func:`pair_key`)."""
    out: dict[tuple[str, int, int], int] = {}
    for key, value in data.items():
        if key.startswith(_PAIR + ":"):
            _, side, src, dst = key.split(":")
            out[(side, int(src), int(dst))] = int(value)
    return out


class Counters:
    """Counters (ints) and series (lists of samples) over one plain dict, changed in place.

    ``data``: the dict to record into (kept, its missing keys added); a fresh one when None or empty.
    """

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = data if data is not None else {}
        if not self.data:
            self.reset()
        for k in COUNTERS:
            self.data.setdefault(k, 0)
        for k in SERIES:
            self.data.setdefault(k, [])

    def reset(self) -> None:
        """Empty every counter and series (in place)."""
        self.data.clear()
        self.data.update({k: 0 for k in COUNTERS} | {k: [] for k in SERIES})

    def add(self, key: str, value: int = 1) -> None:
        """Increment a counter."""
        self.data[key] = self.data.get(key, 0) + value

    def add_pair_bytes(self, side: str, src_rank: int, dst_rank: int, nbytes: int) -> None:
        """Count ``nbytes`` moved from P rank ``src_rank`` to D rank ``dst_rank`` (``side``: send or recv)."""
        self.add(pair_key(side, src_rank, dst_rank), int(nbytes))

    def observe(self, key: str, value: float) -> None:
        """Append to a series."""
        self.data.setdefault(key, []).append(float(value))

    def staging(self, rank: int, held: int, full: bool) -> None:
        """A sample of P worker ``rank``'s staging arena: ``held`` bytes in use, ``full`` nearly full."""
        self.observe(staging_key("held", rank), held)
        self.observe(staging_key("full", rank), int(full))

    def record(self, entry: dict[str, Any]) -> None:
        """Hand one per-request fact to the scheduler (under :data:`RECORDS`)."""
        self.data.setdefault(RECORDS, []).append(entry)

    def is_empty(self) -> bool:
        """True when nothing was recorded."""
        return not any(self.data.get(k) for k in COUNTERS) and not any(
            self.data.get(k) for k in SERIES
        ) and not any(k.startswith((_STAGING + ":", _FAILURE + ":", RECORDS)) and v for k, v in self.data.items())

    def merge(self, other: dict[str, Any]) -> None:
        """Sum counters and concatenate series of another counters dict (other workers, other steps)."""
        for k, v in other.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v

    def summary(self) -> dict[str, int | float]:
        """The non-zero counters, and the transfers' count, mean and max (ms) and the bounce and ipc shares."""
        ts = self.data.get("transfer_s", [])
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS if self.data.get(k)}
        if ts:
            out["num_transfers"] = len(ts)
            out["avg_transfer_ms"] = round(1000 * sum(ts) / len(ts), 3)
            out["max_transfer_ms"] = round(1000 * max(ts), 3)
        sent = self.data.get("send_bytes", 0)
        if sent:
            out["bounce_share"] = round(self.data.get("bounce_bytes", 0) / sent, 3)
            if self.data.get("ipc_bytes"):
                out["ipc_share"] = round(self.data["ipc_bytes"] / sent, 3)
        return out
