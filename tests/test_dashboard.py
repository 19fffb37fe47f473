"""dashboards/vllm-dsa-connector.json queries only what DSAConnector exports: every series, label and label
value in its PromQL is declared in ``vllm_dsa_connector/connector/stats.py`` (read from its source, so the
test needs no vLLM)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "vllm-dsa-connector.json"
STATS = ROOT / "vllm_dsa_connector" / "connector" / "stats.py"
#: Labels every series has besides its own: vLLM's per-engine labels and Prometheus' target labels
COMMON_LABELS = {"model_name", "engine", "instance", "job"}


def exported() -> dict[str, set[str]]:
    """``{series name: its labels}`` as Prometheus exposes them: counters with ``_total``, gauges as named, the histogram's
    ``_bucket`` (with ``le``), ``_sum`` and ``_count``."""
    series: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(STATS.read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if fn == "counter" and node.args and isinstance(node.args[0], ast.Constant):
            labels: set[str] = set()
            if len(node.args) > 2 and isinstance(node.args[2], ast.Tuple):
                labels = {e.value for e in node.args[2].elts if isinstance(e, ast.Constant)}
            series[f"{node.args[0].value}_total"] = labels | COMMON_LABELS
        elif fn == "_gauge_cls":
            series[next(k.value.value for k in node.keywords if k.arg == "name")] = set(COMMON_LABELS)
        elif fn == "_histogram_cls":
            name = next(k.value.value for k in node.keywords if k.arg == "name")
            for suffix in ("_sum", "_count"):
                series[name + suffix] = set(COMMON_LABELS)
            series[name + "_bucket"] = COMMON_LABELS | {"le"}
    return series


def label_values() -> dict[str, set[str]]:
    """The values stats.py gives its labels (``side``, ``outcome``, ``reason``)."""
    text = STATS.read_text()
    outcomes = set(re.findall(r'\("(?:send|recv)_\w+", "(?:send|recv)", "(\w+)"\)', text))
    reasons: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "UNUSABLE_REASONS" for t in node.targets):
            reasons = {e.value for e in node.value.elts}  # type: ignore[attr-defined]
    assert outcomes and reasons, "stats.py's outcome/reason declarations changed shape: update this test"
    return {"side": {"send", "recv"}, "outcome": outcomes, "reason": reasons}


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out


def test_stats_exports_what_the_docstring_lists() -> None:
    """The parse above finds the series of stats.py's own docstring (a stale parser would pass anything)."""
    names = exported()
    doc = ast.get_docstring(ast.parse(STATS.read_text())) or ""
    for listed in set(re.findall(r"vllm:dsa_\w+", doc)):
        assert listed in names or f"{listed}_bucket" in names, listed
    assert "vllm:dsa_kv_transfer_seconds_bucket" in names and len(names) >= 12


def test_every_queried_series_exists() -> None:
    names = exported()
    used = {m for q in queries() for m in re.findall(r"vllm:[a-z_:]+", q)}
    missing = sorted(used - set(names))
    assert not missing, f"the dashboard queries series stats.py does not export: {missing}"
    # every counter stats.py exports is on the dashboard
    unused = sorted(n for n in names if n.endswith("_total") and n not in used)
    assert not unused, f"series stats.py exports that the dashboard does not show: {unused}"


def test_every_label_and_value_exists() -> None:
    names = exported()
    values = label_values()
    for q in queries():
        for metric, body in re.findall(r"(vllm:[a-z_:]+)\{([^}]*)\}", q):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
                assert label in names[metric], f"{metric} has no label {label!r}: {q}"
                if label in values and not value.startswith("$"):
                    wanted = set(value.split("|")) if op == "=~" else {value}
                    assert wanted <= values[label], f"{label} values {wanted - values[label]} never set: {q}"
        for group in re.findall(r"by \(([^)]*)\)", q):
            metrics = re.findall(r"vllm:[a-z_:]+", q)
            for label in (g.strip() for g in group.split(",")):
                assert all(label in names[m] for m in metrics), f"'by ({group})' over {metrics}: {q}"


def test_dashboard_is_importable() -> None:
    """Grafana's import needs valid JSON, unique panel ids, a uid and a data source on every query."""
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    assert any(v["type"] == "datasource" for v in dash["templating"]["list"])
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] and panel["targets"] and panel["description"], panel["title"]
