"""DSAConnector transfer statistics and their Prometheus export (through vLLM's connector hooks).

The counters themselves are the core's (:mod:`vllm_dsa_connector.core.worker.counters`); this module is their
vLLM face. Workers record into :class:`DSAKVConnectorStats`, and so does the scheduler for what only it sees
(``kv_transfer_params`` it cannot use: vLLM's scheduler asks its own connector for stats too, the
scheduler-side ``get_kv_connector_stats``); vLLM aggregates the stats of every worker and the scheduler's
(:meth:`aggregate`) and hands them to the frontend, where :class:`DSAPromMetrics` (built by
``DSAConnector.build_prom_metrics``) exports them:

- ``vllm:dsa_kv_bytes_total{side}``: bytes written (side="send", on P) or received (side="recv", on D)
- ``vllm:dsa_kv_runs_total{side}`` / ``vllm:dsa_kv_descriptors_total``: byte runs after merging / NIXL descriptors
- ``vllm:dsa_kv_bounce_bytes_total``: bytes that went through the bounce staging path
- ``vllm:dsa_kv_ipc_bytes_total``: bytes P copied into D's pools through CUDA IPC (same host)
- ``vllm:dsa_kv_layered_bytes_total``: bytes P posted layer by layer while its prefill ran (``layer_push``)
- ``vllm:dsa_kv_transfer_seconds``: histogram, ONE observation per (request, destination rank) that completed:
  P's clock from the post to its last part's completion (every WRITE or copy of every pool pair; a
  layer-by-layer post from its close, the forward's last layer, on), on every route (direct, bounce, ipc)
- ``vllm:dsa_kv_requests_total{side,outcome}``: requests sent/received ok, failed, timed out, expired
- ``vllm:dsa_kv_checksum_mismatches_total``: verify_transfers mismatches (each is a load failure)
- ``vllm:dsa_kv_unusable_params_total{reason}``: D requests whose ``kv_transfer_params`` D could not use
  (each is a load failure), by :data:`UNUSABLE_REASONS`: ``other_connector`` (another producer's params,
  e.g. NixlConnector's ``transfer_mode``), ``malformed`` (missing keys, wrong types or values)
- ``vllm:dsa_kv_peer_reconnects_total``: NIXL remote agents removed and added again after their connection was
  lost (P side; the next post to that peer then makes a new connection)
- ``vllm:dsa_kv_refused_identities_total``: D registrations P refused because their payloads were not their
  sender's (a NIXL agent bound to another engine, agent metadata naming another agent, payloads other than those
  the engine start registered with first), and peers a P worker refused for the same reason
- ``vllm:dsa_kv_early_held``: gauge, early registrations P holds now for requests it has not seen yet
- ``vllm:dsa_kv_fenced_connections_total{outcome}``: connections P fenced after an aborted WRITE
  (outcome="fenced": the fence was confirmed; "reset": the connection was closed instead), and D's given-up
  loads handed back (outcome="load_fenced": after P's fence; "load_timeout": after option ``fence_timeout_s``
  without it; "load_peer_gone": P's start is gone, its side channel refuses connections or it restarted)
- ``vllm:dsa_kv_staging_held_bytes`` (gauge): bytes of P's staging arenas in use (reserved by bounces in
  flight, or held for an aborted bounce until its connection is fenced), summed over P's workers
- ``vllm:dsa_kv_setup_waits_total``: pushes P held because their destination's set-up (its NIXL remote
  agents, loaded on the worker's set-up thread) was not over yet; posted once it is, without blocking a step
- ``vllm:dsa_kv_load_failures_total{reason}``: D requests not loaded from P, by why
  (:data:`~vllm_dsa_connector.core.handoff.recompute.REASONS`; each falls back to ``kv_load_failure_policy``:
  recompute = D prefills it; ``vllm-dsa explain REASON`` gives the fix), counted once where D decides it
- ``vllm:dsa_kv_pair_bytes_total{side,src_rank,dst_rank}``: the bytes above per (P rank, D rank) pair: which
  P rank sent what (replicated layers come from the one elected sender, ``core.plan.segments.elected_sender``)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vllm_dsa_connector.core.handoff.recompute import REASONS
from vllm_dsa_connector.core.worker.counters import (
    SIDES,
    Counters,
    failure_key,
    latest_samples,
    pair_bytes,
)

#: Why D could not use a request's kv_transfer_params: the ``reason`` label of ``vllm:dsa_kv_unusable_params_total``
UNUSABLE_REASONS = ("other_connector", "malformed")


def unusable_key(reason: str) -> str:
    """Counter key of the D requests whose kv_transfer_params were unusable for ``reason`` (one of
    :data:`UNUSABLE_REASONS`: a fixed label set, never a value taken from the params)."""
    if reason not in UNUSABLE_REASONS:
        raise ValueError(f"unusable params reason {reason!r}: expected one of {list(UNUSABLE_REASONS)}")
    return f"unusable_{reason}"


#: (stats key, side, outcome) of ``vllm:dsa_kv_requests_total``
_REQUEST_OUTCOMES = (
    ("send_ok", "send", "ok"),
    ("send_failed", "send", "failed"),
    ("send_expired", "send", "expired"),
    ("send_late", "send", "late"),
    ("recv_ok", "recv", "ok"),
    ("recv_failed", "recv", "failed"),
    ("recv_timeout", "recv", "timeout"),
)
#: (stats key, outcome) of ``vllm:dsa_kv_fenced_connections_total``
_FENCE_OUTCOMES = (("fenced_connections", "fenced"), ("connection_resets", "reset"),
                   ("fenced_loads", "load_fenced"), ("fence_timeouts", "load_timeout"),
                   ("fence_peer_gone", "load_peer_gone"))


@dataclass
class DSAKVConnectorStats(KVConnectorStats):
    """vLLM's view of a worker's (or the scheduler's) :class:`~vllm_dsa_connector.core.worker.counters.Counters`:
    ``data`` is the counters' dict (serialisable as a plain dict), recorded into through :attr:`counters`."""

    def __post_init__(self) -> None:
        self.counters = Counters(self.data)

    def reset(self) -> None:
        """Empty every counter and series."""
        self.counters.reset()

    def add(self, key: str, value: int = 1) -> None:
        """Increment a counter."""
        self.counters.add(key, value)

    def add_pair_bytes(self, side: str, src_rank: int, dst_rank: int, nbytes: int) -> None:
        """Count ``nbytes`` moved from P rank ``src_rank`` to D rank ``dst_rank`` (``side``: send or recv)."""
        self.counters.add_pair_bytes(side, src_rank, dst_rank, nbytes)

    def observe(self, key: str, value: float) -> None:
        """Append to a series."""
        self.counters.observe(key, value)

    def staging(self, rank: int, held: int, full: bool) -> None:
        """A sample of P worker ``rank``'s staging arena: ``held`` bytes in use, ``full`` nearly full."""
        self.counters.staging(rank, held, full)

    def clone_and_reset(self) -> DSAKVConnectorStats:
        """A copy of the current stats; this object starts over."""
        out = DSAKVConnectorStats(data=copy.deepcopy(self.data))
        self.reset()
        return out

    def is_empty(self) -> bool:
        """True when nothing was recorded."""
        return self.counters.is_empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum counters and concatenate series (other workers, other steps)."""
        self.counters.merge(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summary for vLLM's periodic log line."""
        return self.counters.summary()


class DSAPromMetrics(KVConnectorPromMetrics):
    """Prometheus series of DSAConnector (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames + list(extra))
            return metric, extra

        self._bytes, _ = counter("vllm:dsa_kv_bytes", "KV bytes moved by DSAConnector", ("side",))
        self._runs, _ = counter("vllm:dsa_kv_runs", "Byte runs (after merging) moved", ("side",))
        self._descs, _ = counter("vllm:dsa_kv_descriptors", "NIXL descriptors posted")
        self._bounce, _ = counter("vllm:dsa_kv_bounce_bytes", "Bytes sent through the bounce path")
        self._ipc, _ = counter("vllm:dsa_kv_ipc_bytes", "Bytes copied into D's pools through CUDA IPC")
        self._layered, _ = counter("vllm:dsa_kv_layered_bytes", "Bytes posted layer by layer during the prefill")
        self._reqs, _ = counter("vllm:dsa_kv_requests", "Requests by side and outcome", ("side", "outcome"))
        self._mismatch, _ = counter("vllm:dsa_kv_checksum_mismatches", "verify_transfers mismatches")
        self._checked, _ = counter("vllm:dsa_kv_checksummed_runs", "Runs verified by checksum")
        self._unusable, _ = counter("vllm:dsa_kv_unusable_params",
                                    "D requests whose kv_transfer_params D could not use, by reason", ("reason",))
        self._reconnects, _ = counter("vllm:dsa_kv_peer_reconnects",
                                      "NIXL remote agents removed and added again after a lost connection")
        self._refused, _ = counter("vllm:dsa_kv_refused_identities",
                                   "D registrations/peers refused: payloads not their sender's")
        self._held = self._gauge_cls(name="vllm:dsa_kv_early_held", documentation="Early registrations P holds for "
                                     "requests it has not seen yet", labelnames=labelnames,
                                     multiprocess_mode="mostrecent")
        self._fences, _ = counter("vllm:dsa_kv_fenced_connections",
                                  "Connections fenced after an aborted WRITE, and given-up loads handed back",
                                  ("outcome",))
        self._staging = create_metric_per_engine(
            self._gauge_cls(name="vllm:dsa_kv_staging_held_bytes",
                            documentation="Bytes of P's staging arenas in use (bounces in flight, or held for an "
                                          "aborted bounce until its connection is fenced)",
                            labelnames=labelnames, multiprocess_mode="mostrecent"),
            per_engine_labelvalues)
        self._staging_held: dict[int, dict[int, float]] = {}  # engine -> rank -> bytes
        self._setup_waits, _ = counter("vllm:dsa_kv_setup_waits",
                                       "Pushes held until their destination's peer set-up was over")
        self._failures, _ = counter("vllm:dsa_kv_load_failures",
                                    "D requests not loaded from P (kv_load_failure_policy applies), by reason",
                                    ("reason",))
        self._pairs, _ = counter("vllm:dsa_kv_pair_bytes", "KV bytes moved per (P rank, D rank) pair",
                                 ("side", "src_rank", "dst_rank"))
        hist = self._histogram_cls(
            name="vllm:dsa_kv_transfer_seconds",
            documentation="Post to last part's completion per (request, destination rank), P side",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
            labelnames=labelnames,
        )
        self._hist = create_metric_per_engine(hist, per_engine_labelvalues)
        self._labels = per_engine_labelvalues
        # Every series with a known label set exists from the start at 0 (Prometheus' advice): a panel shows 0,
        # not "No data", before the first event, and increase()/rate() count the first event too.
        for values in per_engine_labelvalues.values():
            fixed: list[tuple[Any, tuple[str, ...]]] = [(self._bytes, (s,)) for s in SIDES]
            fixed += [(self._runs, (s,)) for s in SIDES]
            fixed += [(m, ()) for m in (self._descs, self._bounce, self._ipc, self._layered, self._mismatch,
                                        self._checked, self._reconnects, self._refused, self._setup_waits)]
            fixed += [(self._reqs, (side, outcome)) for _, side, outcome in _REQUEST_OUTCOMES]
            fixed += [(self._fences, (outcome,)) for _, outcome in _FENCE_OUTCOMES]
            fixed += [(self._unusable, (r,)) for r in UNUSABLE_REASONS]
            fixed += [(self._failures, (r,)) for r in REASONS]
            for metric, extra in fixed:
                metric.labels(*values, *extra)
            self._held.labels(*values).set(0)

    def _inc(self, metric: Any, engine_idx: int, value: float, *extra: str) -> None:
        if value:
            metric.labels(*self._labels[engine_idx], *extra).inc(value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's aggregated stats."""
        d = transfer_stats_data
        self._inc(self._bytes, engine_idx, d.get("send_bytes", 0), "send")
        self._inc(self._bytes, engine_idx, d.get("recv_bytes", 0), "recv")
        self._inc(self._runs, engine_idx, d.get("send_runs", 0), "send")
        self._inc(self._runs, engine_idx, d.get("recv_runs", 0), "recv")
        self._inc(self._descs, engine_idx, d.get("send_descriptors", 0))
        self._inc(self._bounce, engine_idx, d.get("bounce_bytes", 0))
        self._inc(self._ipc, engine_idx, d.get("ipc_bytes", 0))
        self._inc(self._layered, engine_idx, d.get("layered_bytes", 0))
        self._inc(self._mismatch, engine_idx, d.get("checksum_mismatches", 0))
        self._inc(self._checked, engine_idx, d.get("checksummed_runs", 0))
        self._inc(self._reconnects, engine_idx, d.get("peer_reconnects", 0))
        self._inc(self._refused, engine_idx, d.get("refused_identities", 0))
        if d.get("early_held"):
            self._held.labels(*self._labels[engine_idx]).set(d["early_held"][-1])
        for key, outcome in _FENCE_OUTCOMES:
            self._inc(self._fences, engine_idx, d.get(key, 0), outcome)
        self._inc(self._setup_waits, engine_idx, d.get("setup_waits", 0))
        for key, side, outcome in _REQUEST_OUTCOMES:
            self._inc(self._reqs, engine_idx, d.get(key, 0), side, outcome)
        for reason in UNUSABLE_REASONS:
            self._inc(self._unusable, engine_idx, d.get(unusable_key(reason), 0), reason)
        for reason in REASONS:
            self._inc(self._failures, engine_idx, d.get(failure_key(reason), 0), reason)
        for (side, src, dst), nbytes in pair_bytes(d).items():
            self._inc(self._pairs, engine_idx, nbytes, side, str(src), str(dst))
        held = latest_samples(d, "held")
        if held:
            self._staging_held.setdefault(engine_idx, {}).update(held)
            self._staging[engine_idx].set(sum(self._staging_held[engine_idx].values()))
        for s in d.get("transfer_s", []):
            self._hist[engine_idx].observe(s)
