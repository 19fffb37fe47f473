"""The operator's view on a real P/D pair (issue 47, slow): a record per request, why a request recomputed,
and the Grafana dashboard's every query run on a real Prometheus.

ONE module-scoped pair on the tiny GLM-MoE-DSA model (CPU DSA backend): P and D with option
``request_records=log`` and vLLM's tracing on (``--otlp-traces-endpoint`` to an OTLP/HTTP receiver started
here, decoding opentelemetry-proto's ``ExportTraceServiceRequest``), D with ``kv_load_failure_policy``
recompute; Prometheus (Debian's package; skipped with the reason when it is not installed) scrapes both
engines' ``/metrics`` every second from before the traffic. The traffic, once for the module: a few P/D
requests sent leg by leg (each with a W3C ``traceparent`` and an ``X-Request-Id``), then one whose
``kv_transfer_params`` lack ``remote_num_tokens``, as a router that drops it sends them (D recomputes).
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, processes_on_ports
from vllm_dsa_dev.harness.client import metric, scrape
from vllm_dsa_dev.harness.engines import (
    choose_backend,
    connector_config,
    engine_env,
    start_engine,
)
from vllm_dsa_dev.harness.procs import Proc, cluster

pytestmark = pytest.mark.slow

BASE = 25600  # P, D HTTP: BASE, BASE+1; side channels BASE+3, BASE+4
DTYPE = "float32"
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "vllm-dsa-connector.json"
PROMPTS = [f"Record {i}: the dragon painted the sky in colours nobody had seen before, " * 3 for i in range(3)]
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes here (4 scrapes at least)


# ------------------------------------------------------------------ an OTLP/HTTP trace receiver


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[str]


@dataclass
class Receiver:
    url: str
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def find(self, name: str, **attrs: Any) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _otlp_receiver() -> tuple[ThreadingHTTPServer, Receiver]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    port = free_port()
    rec = Receiver(f"http://127.0.0.1:{port}/v1/traces")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest.FromString(body)
            got = []
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        got.append(Span(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes}, [e.name for e in s.events]))
            with rec.lock:
                rec.spans.extend(got)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, rec


# ------------------------------------------------------------------ Prometheus


class Prometheus:
    """A real Prometheus scraping ``targets`` every second (its binary, a temp config and data dir)."""

    def __init__(self, binary: str, targets: list[str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "prometheus.yml"
        cfg.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}]}))
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            out = json.loads(r.read())
        assert out["status"] == "success", out
        return out["data"]

    def query(self, promql: str) -> dict[str, Any]:
        return self.api("query", query=promql)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"prometheus not ready: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------ the pair and its traffic


@dataclass
class Traffic:
    p: Proc
    d: Proc
    p_url: str
    d_url: str
    otlp: Receiver
    prom: Prometheus | None
    prom_skip: str
    ok: list[tuple[str, str, str]] = field(default_factory=list)  # (D request id, trace id, parent span id)
    p_ids: list[str] = field(default_factory=list)  # P's (internal) request ids of the ok requests
    recompute_id: str = ""


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=300) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def _trace_headers(request_id: str) -> tuple[dict[str, str], str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return {"traceparent": f"00-{trace_id}-{span_id}-01", "X-Request-Id": request_id}, trace_id, span_id


def _is(external: Any, response_id: str) -> bool:
    """Whether vLLM's client-facing request id ``external`` is the request that answered ``response_id`` (a
    completion's prompt ``i`` is ``<response id>-<i>``)."""
    return isinstance(external, str) and (external == response_id or external.startswith(response_id + "-"))


def _records(proc: Proc) -> list[dict[str, Any]]:
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        if "DSAConnector request record " in line:
            out.append(json.loads(line.split("DSAConnector request record ", 1)[1]))
    return out


def _wait_for(what: str, cond: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def traffic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traffic]:
    from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

    model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    workdir = tmp_path_factory.mktemp("records")
    server, otlp = _otlp_receiver()
    extra = {"request_records": "log"}
    p_cfg = connector_config("kv_producer", True, extra, BASE + 3)
    d_cfg = {**connector_config("kv_consumer", True, extra, BASE + 4), "kv_load_failure_policy": "recompute"}
    trace_env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    tracing = ["--otlp-traces-endpoint", otlp.url]
    backend = choose_backend(model, DTYPE)
    binary = shutil.which("prometheus")
    prom = None
    try:
        with cluster(workdir) as c:
            p = start_engine(c, "prefill", model, BASE, DTYPE, p_cfg, backend, {**engine_env("0"), **trace_env},
                             extra=tracing)
            d = start_engine(c, "decode", model, BASE + 1, DTYPE, d_cfg, backend, {**engine_env("1"), **trace_env},
                             extra=tracing)
            p.ready(900, watch=[d.proc])
            d.ready(900, watch=[p.proc])
            if binary is not None:  # scraping from before the traffic: every increase is seen
                prom = Prometheus(binary, [f"127.0.0.1:{BASE}", f"127.0.0.1:{BASE + 1}"], workdir)
                prom.wait_ready()
                _wait_for("Prometheus' first scrape of both engines",
                          lambda: len(prom.query("up == 1")["result"]) == 2, 120)  # (discovery takes ~5 s)
            t = Traffic(p.proc, d.proc, p.url, d.url, otlp, prom,
                        "" if binary else "prometheus is not installed (ci/setup.sh installs Debian's package; "
                                          "apt-get install prometheus)")
            model_name = str(model)
            for i, prompt in enumerate(PROMPTS):
                pre = _post(p.url, {"model": model_name, "prompt": prompt, "max_tokens": 1,
                                    "kv_transfer_params": {"do_remote_decode": True}}, {"X-Request-Id": f"rec-p-{i}"})
                params = pre["kv_transfer_params"]
                t.p_ids.append(params["remote_request_id"])
                headers, trace_id, parent = _trace_headers(f"rec-d-{i}")
                last = i == len(PROMPTS) - 1
                if last:  # a router that drops remote_num_tokens: D recomputes
                    params = {k: v for k, v in params.items() if k != "remote_num_tokens"}
                out = _post(d.url, {"model": model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                    "kv_transfer_params": params}, headers)
                assert out["choices"][0]["text"] is not None and "rec-d" in out["id"], out
                if last:
                    t.recompute_id = out["id"]
                    t.p_ids.pop()  # its lease expires on P unused
                else:
                    t.ok.append((out["id"], trace_id, parent))
            yield t
            if prom is not None:
                prom.stop()
    finally:
        server.shutdown()
    assert not processes_on_ports(BASE, 5), "engines left behind"


# ------------------------------------------------------------------ 1. a record per request


def test_each_request_has_one_record_on_each_side(traffic: Traffic) -> None:
    """D logs one JSON record per load (ids, route, blocks, bytes, phases, outcome), P one per send, with D's
    request id, P's request id and the engine ids linking the two."""
    d_recs = _wait_for("D's records", lambda: (r := [x for x in _records(traffic.d) if x["side"] == "load"])
                       and len(r) >= len(PROMPTS) and r)
    p_recs = _wait_for("P's records", lambda: (r := [x for x in _records(traffic.p) if x["side"] == "send"
                                                     and x["outcome"] == "ok"]) and len(r) >= len(traffic.ok) and r)
    for (d_id, _, _), p_id in zip(traffic.ok, traffic.p_ids, strict=True):
        (rec,) = [r for r in d_recs if _is(r["external_request_id"], d_id)]
        assert rec["outcome"] == "ok" and rec["reason"] == "" and rec["p_request_id"] == p_id, rec
        assert rec["blocks"] > 0 and rec["bytes"] > 0 and rec["runs"] > 0 and rec["routes"], rec
        assert rec["gate"] and all(g["gate"] in ("direct", "bounce") and g["direct_us"] > 0 and g["bounce_us"] > 0
                                   for g in rec["gate"]), rec  # the gate's estimate per pair
        phases = rec["phases_ms"]
        assert list(phases)[:1] == ["start"] and {"registered", "notice", "end"} <= set(phases), phases
        assert phases["start"] <= phases["registered"] <= phases["notice"] <= phases["end"], phases
        (send,) = [r for r in p_recs if r["request_id"] == p_id]
        assert send["d_request_id"] == rec["request_id"] and send["d_engine"] == rec["d_engine"], send
        assert send["p_engine"] == rec["p_engine"] and send["blocks"] > 0, send
        assert send["bytes"] == rec["bytes"] and send["descriptors"] > 0, (send, rec)
        assert {r["route"] for r in send["ranks"] if "route" in r} <= {"direct", "bounce", "ipc"}, send
        assert {"dispatched", "completed"} <= set(send["phases_ms"]), send
    # a push P held for its peer's set-up (the first to a fresh D) says how long, in its record
    waits = metric(scrape(traffic.p_url), "vllm:dsa_kv_setup_waits_total")
    held = [e for r in p_recs for e in r.get("ranks", []) if "setup_wait_ms" in e]
    assert bool(held) == (waits > 0) and all(e["setup_wait_ms"] >= 0 for e in held), (waits, held)


def test_the_record_is_a_span_in_the_request_s_trace(traffic: Traffic) -> None:
    """With vLLM's tracing on, D's record is a span ``dsa_kv_transfer`` in the request's trace: the trace and
    parent of the client's ``traceparent`` (as vLLM's own ``llm_request`` span), the same request id."""
    for d_id, trace_id, parent in traffic.ok:
        (span,) = _wait_for(f"span of {d_id}", lambda d_id=d_id: [
            s for s in traffic.otlp.find("dsa_kv_transfer") if _is(s.attributes.get("gen_ai.request.id"), d_id)])
        assert span.trace_id == trace_id and span.parent_span_id == parent, span
        assert span.attributes["vllm_dsa.outcome"] == "ok" and span.attributes["vllm_dsa.side"] == "load", span
        assert span.attributes["vllm_dsa.bytes"] > 0 and {"registered", "notice"} <= set(span.events), span
        vllm_span = _wait_for(f"vLLM's span of {d_id}", lambda d_id=d_id: [
            s for s in traffic.otlp.spans if s.name != "dsa_kv_transfer"
            and _is(s.attributes.get("gen_ai.request.id"), d_id)])
        assert all(s.trace_id == trace_id for s in vllm_span), vllm_span


# ------------------------------------------------------------------ 2. why did it recompute


def test_a_dropped_key_is_counted_logged_and_recorded_by_reason(traffic: Traffic) -> None:
    """A router dropped ``remote_num_tokens``: D prefilled locally, counted it under
    ``vllm:dsa_kv_load_failures_total{reason="params_missing_key"}``, logged the request with the reason and
    the fix's command, and its record and span name the reason and the missing key."""
    d_id = traffic.recompute_id
    m = scrape(traffic.d_url)
    assert metric(m, "vllm:dsa_kv_load_failures_total", reason="params_missing_key") == 1, m
    assert sum(v for k, v in m.items() if k.startswith("vllm:dsa_kv_load_failures_total")) == 1
    log = traffic.d.log.read_text(errors="replace")
    (line,) = [x for x in log.splitlines() if "not loaded from P" in x and f"{d_id}-" in x]
    assert "reason params_missing_key" in line and "remote_num_tokens" in line, line
    assert "vllm-dsa explain params_missing_key" in line, line
    (rec,) = [r for r in _records(traffic.d) if _is(r["external_request_id"], d_id)]
    assert rec["outcome"] == "failed" and rec["reason"] == "params_missing_key", rec
    assert rec["missing_key"] == "remote_num_tokens", rec
    (span,) = _wait_for("its span", lambda: [s for s in traffic.otlp.find("dsa_kv_transfer")
                                             if _is(s.attributes.get("gen_ai.request.id"), d_id)])
    assert span.attributes["vllm_dsa.reason"] == "params_missing_key", span


# ------------------------------------------------------------------ 3. the dashboard on a real Prometheus


def _panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _concrete(expr: str) -> str:
    """Grafana's variables as the dashboard's "All" sends them."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", ".*")
            .replace("$instance", ".*"))


def test_every_dashboard_query_returns_data_on_prometheus(traffic: Traffic) -> None:
    """Every panel's PromQL, run through Prometheus' HTTP API after the traffic (scraped every second), returns
    a non-empty vector: every series the dashboard reads exists from the engine's start (at 0 until its first
    event), so no panel shows "No data" on a healthy pair; the variables' label queries find both engines."""
    if traffic.prom is None:
        pytest.skip(traffic.prom_skip)
    prom = traffic.prom
    # the recompute's failure has been scraped (and a sample after it: rates over the window see it)
    _wait_for("the failure scraped", lambda: prom.query(
        'sum(vllm:dsa_kv_load_failures_total{reason="params_missing_key"})')["result"], 60)
    time.sleep(3)
    empty = []
    for title, expr in _panel_queries():
        data = prom.query(_concrete(expr))
        assert data["resultType"] == "vector", (title, data)
        if not data["result"]:
            empty.append(f"{title}: {expr}")
        print(f"[dashboard] {title}: {[(r['metric'], r['value'][1]) for r in data['result']]}"[:300])
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    # what the traffic must show, not only exist
    # Prometheus scraped both engines before the traffic: increase() sees each series' first event (it exists
    # at 0 from the start)
    failures = prom.query('sum by (reason) (increase(vllm:dsa_kv_load_failures_total[10m]))')
    by_reason = {r["metric"]["reason"]: float(r["value"][1]) for r in failures["result"]}
    assert by_reason["params_missing_key"] > 0 and sum(by_reason.values()) == by_reason["params_missing_key"], \
        by_reason
    ok = prom.query('sum(vllm:dsa_kv_requests_total{side="recv",outcome="ok"})')["result"]
    assert float(ok[0]["value"][1]) == len(traffic.ok), ok
    instances = prom.api("label/instance/values", **{"match[]": "vllm:dsa_kv_bytes_total"})
    assert set(instances) == {f"127.0.0.1:{BASE}", f"127.0.0.1:{BASE + 1}"}, instances
    models = prom.api("label/model_name/values", **{"match[]": "vllm:dsa_kv_bytes_total"})
    assert len(models) == 1 and re.search("dsa|glm", models[0], re.I), models
