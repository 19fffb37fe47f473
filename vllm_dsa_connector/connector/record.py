"""One record per request and side (P: its send; D: its load), emitted when the request is over.

The scheduler of each engine opens a record when the request starts to concern the connector (P: its
prefill finished and its blocks are leased; D: it asks for P's KV), adds phases (a name and the time) and
facts (route, blocks, bytes: the workers' facts come through the connector stats, key
:data:`~vllm_dsa_connector.core.worker.counters.RECORDS`), and closes it with the outcome and its reason. A
closed record is emitted:

- as ONE JSON log line (``DSAConnector request record {...}``) when option ``request_records`` is ``log``;
- as a span ``dsa_kv_transfer`` in the request's own trace when vLLM's tracing is on
  (``--otlp-traces-endpoint``): a child of the trace context vLLM passed down with the request
  (``Request.trace_headers``; a root span when the client sent none), the record as attributes and the
  phases as events, through the tracer provider vLLM's engine core set up.

Invariant: with both off, :func:`make_records` returns None and the scheduler builds nothing per request
(every call site is guarded by ``if self.records``); a record's size is bounded (at most :data:`_OPEN`
open records, :data:`_PHASES` phases and :data:`_RANKS` worker entries each, long texts cut).
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from typing import Any

from vllm.logger import init_logger

__all__ = ["GateEstimates", "RequestRecords", "external_id", "make_records"]

logger = init_logger("vllm." + __name__)

_OPEN = 4096  # open records kept; the oldest is emitted (outcome "unknown") beyond it
_PHASES = 32
_RANKS = 64
_TEXT = 400
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # vLLM makes its internal id "<external id>-<8 hex>"
SPAN_NAME = "dsa_kv_transfer"


def external_id(req_id: str) -> str:
    """The client-facing request id of vLLM's internal ``req_id`` (vLLM appends ``-<8 hex digits>``)."""
    return _SUFFIX.sub("", req_id)


def make_records(mode: str, tracing_endpoint: str | None, engine_id: str, role: str) -> RequestRecords | None:
    """The records of one engine's scheduler, or None when ``mode`` is ``off`` and tracing is off."""
    tracer = None
    if tracing_endpoint:
        try:
            from opentelemetry import trace

            tracer = trace.get_tracer("vllm_dsa_connector")
        except ImportError:  # vLLM's tracing needs it too: it logged why already
            tracer = None
    if mode == "off" and tracer is None:
        return None
    return RequestRecords(engine_id, role, log=mode == "log", tracer=tracer)


class GateEstimates:
    """The bounce gate's estimates of one request's pairs, for its record: the same cost model D's route planner
    asks (:class:`~vllm_dsa_connector.core.transfer.gate.BounceGate`), built once, asked only while records are on."""

    def __init__(self, settings: Any, device: str) -> None:
        from vllm_dsa_connector.core.transfer.gate import BounceGate

        self.gate = BounceGate(settings, device=device)

    def of(self, plan: Any, src_ranks: list[int], dst_ranks: list[int], src_blocks: list[int],
           dst_blocks: list[int], *, first_token: int, num_tokens: int | None) -> list[dict[str, Any]]:
        """Per (D rank, P rank) pair with bytes: the gate's path, reason and both estimates (microseconds)."""
        out = []
        for d in dst_ranks[:_RANKS]:
            for p in src_ranks:
                parts = [r.merged() for _, _, r in plan.runs(p, d, src_blocks, dst_blocks, first_token=first_token,
                                                              num_tokens=num_tokens)]
                total = sum(r.total_bytes for r in parts)
                if total:
                    dec = self.gate.decision_for(sum(r.num_runs for r in parts), total)
                    out.append({"pair": f"D{d}<-P{p}", "gate": dec.path, "why": dec.reason[:120],
                                "direct_us": round(dec.direct_us, 1), "bounce_us": round(dec.bounce_us, 1)})
        return out


class RequestRecords:
    """Open records of one engine (keyed by vLLM's request id) and their emission."""

    def __init__(self, engine_id: str, role: str, *, log: bool, tracer: Any = None) -> None:
        self.engine_id, self.role = engine_id, role
        self.log, self.tracer = log, tracer
        self._open: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._headers: dict[str, dict[str, str]] = {}
        self.emitted = 0

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._open

    def open(self, req_id: str, side: str, trace_headers: Any = None, **facts: Any) -> None:
        """Start the record of ``req_id`` (``side``: ``send`` on P, ``load`` on D); idempotent."""
        if req_id in self._open:
            return
        now = time.time()
        self._open[req_id] = {"request_id": req_id, "external_request_id": external_id(req_id), "side": side,
                              "engine_id": self.engine_id, "role": self.role, "start": now,
                              "phases": [("start", now)], **facts}
        if trace_headers:
            self._headers[req_id] = dict(trace_headers)
        while len(self._open) > _OPEN:
            old = next(iter(self._open))
            self.close(old, "unknown", "record evicted (too many open requests)")

    def set(self, req_id: str, **facts: Any) -> None:
        """Add facts to the open record of ``req_id`` (nothing when none is open)."""
        rec = self._open.get(req_id)
        if rec is not None:
            rec.update(facts)

    def phase(self, req_id: str, name: str, at: float | None = None) -> None:
        """Mark phase ``name`` of ``req_id`` at wall time ``at`` (now)."""
        rec = self._open.get(req_id)
        if rec is not None and len(rec["phases"]) < _PHASES:
            rec["phases"].append((name, time.time() if at is None else at))

    def workers(self, entries: list[dict[str, Any]]) -> None:
        """The workers' facts (one entry per request and rank pair, from the stats'
        :data:`~vllm_dsa_connector.core.worker.counters.RECORDS`)."""
        for e in entries:
            rec = self._open.get(str(e.get("req", "")))
            if rec is None:
                continue
            ranks = rec.setdefault("ranks", [])
            if len(ranks) < _RANKS:
                ranks.append({k: v for k, v in e.items() if k != "req"})

    def close(self, req_id: str, outcome: str, reason: str = "", detail: str = "") -> None:
        """Emit and forget the record of ``req_id`` (``outcome``: ok, failed, expired...; ``reason``: one of
        :data:`~vllm_dsa_connector.core.handoff.recompute.REASONS` for a load that failed)."""
        rec = self._open.pop(req_id, None)
        headers = self._headers.pop(req_id, None)
        if rec is None:
            return
        end = time.time()
        rec["phases"].append(("end", end))
        rec.update(outcome=outcome, reason=reason, detail=detail[:_TEXT])
        self.emitted += 1
        if self.log:
            logger.info("DSAConnector request record %s", json.dumps(self.as_json(rec), separators=(",", ":")))
        if self.tracer is not None:
            self._span(rec, headers, end)

    @staticmethod
    def as_json(rec: dict[str, Any]) -> dict[str, Any]:
        """The log form: phases as milliseconds since the start, totals per worker entry summed."""
        start = rec["start"]
        out = {k: v for k, v in rec.items() if k not in ("phases", "start")}
        out["phases_ms"] = {name: round(1000 * (t - start), 3) for name, t in rec["phases"]}
        ranks = rec.get("ranks") or []
        if ranks:
            for key in ("bytes", "descriptors", "runs"):
                if any(key in r for r in ranks):  # (D's workers count no descriptors: P posts them)
                    out[key] = sum(int(r.get(key, 0)) for r in ranks)
        return out

    def _span(self, rec: dict[str, Any], headers: dict[str, str] | None, end: float) -> None:
        """The record as a span in the request's trace (events: its phases)."""
        try:
            from vllm.tracing import extract_trace_context

            flat = self.as_json(rec)
            attrs: dict[str, Any] = {"gen_ai.request.id": rec["external_request_id"]}
            for key, value in flat.items():
                if key == "phases_ms":
                    continue
                if isinstance(value, (str, bool, int, float)):
                    attrs[f"vllm_dsa.{key}"] = value
                elif value is not None:
                    attrs[f"vllm_dsa.{key}"] = json.dumps(value, separators=(",", ":"))[:_TEXT * 4]
            span = self.tracer.start_span(SPAN_NAME, context=extract_trace_context(headers),
                                          start_time=int(rec["start"] * 1e9), attributes=attrs)
            for name, t in rec["phases"]:
                span.add_event(name, timestamp=int(t * 1e9))
            span.end(end_time=int(end * 1e9))
        except Exception as e:  # noqa: BLE001 - tracing never fails a request
            logger.warning("DSAConnector: request %s: no trace span: %s", rec.get("request_id"), e)
