"""docs/benchmarks.md's tables are generated from dev/bench/results/ (``vllm-dsa bench report``): regenerated here,
a difference fails; every result names its machine, date and versions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from vllm_dsa_dev.commands.bench_report import (
    add_arguments,
    check,
    fmt,
    load_results,
    record,
    regenerate,
    render,
    run,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "dev" / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def test_benchmarks_doc_is_what_the_results_give() -> None:
    ok, diff = check(DOC, RESULTS)
    assert ok, "docs/benchmarks.md is stale: run `vllm-dsa bench report`\n" + diff[-6000:]


def test_the_report_command_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm-dsa bench report --check``: 0 on the committed files, 1 with the diff on a stale copy."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--check", "--doc", str(DOC), "--results", str(RESULTS)])) == 0
    stale = tmp_path / "benchmarks.md"
    stale.write_text(DOC.read_text().replace("| dsa | dsa |", "| dsa | dsx |", 1))
    assert run(parser.parse_args(["--check", "--doc", str(stale), "--results", str(RESULTS)])) == 1
    assert "dsx" in capsys.readouterr().err


def test_every_result_names_machine_date_and_versions() -> None:
    results = load_results(RESULTS)
    assert results, "no committed results"
    for name, data in results.items():
        meta = data["meta"]
        assert len(meta["date"]) == 10 and meta["date"][4] == "-", name
        assert meta["versions"] and meta["machine"], name
        assert render(name, data).count("|") > 0, name  # every file has a renderer


def test_a_stale_or_missing_block_is_reported(tmp_path: Path) -> None:
    results = {"x": {"meta": {"bench": "b", "machine": "m", "date": "2026-01-01", "versions": {"v": "1"}},
                     "kind": "table", "columns": ["a", "b"], "rows": [[1, [2, 3]]]}}
    doc = "intro\n<!-- results:begin x -->\nold\n<!-- results:end x -->\n<!-- results:begin y -->\n<!-- results:end y -->\n"
    new, problems = regenerate(doc, results)
    assert "| 1 | 2-3 |" in new and "old" not in new
    assert problems == ["block 'y' has no dev/bench/results/y.json"]
    _, problems = regenerate("no blocks\n", results)
    assert problems and "has no block" in problems[0]
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x.json").write_text(json.dumps(results["x"]))
    (tmp_path / "doc.md").write_text(doc.replace("<!-- results:begin y -->\n<!-- results:end y -->\n", ""))
    ok, diff = check(tmp_path / "doc.md", tmp_path / "r")
    assert not ok and "-old" in diff


def test_a_result_without_meta_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="machine, date and versions"):
        load_results(tmp_path)


def test_record_wraps_a_bench_json_line_with_this_machine(tmp_path: Path) -> None:
    path = record("t", "some text\n{\"bench\": \"tokenizer\", \"results\": []}\n", "tokenizer", "cmd", tmp_path)
    data = json.loads(path.read_text())
    assert data["meta"]["bench"] == "tokenizer" and data["meta"]["command"] == "cmd"
    assert data["meta"]["date"] and data["meta"]["machine"] and data["results"] == []


def test_cells() -> None:
    assert fmt([1.5, 2.25]) == "1.5-2.25" and fmt(None) == "" and fmt(12345) == "12,345"
    assert fmt(0.0058) == "0.0058" and fmt(True) == "yes" and fmt("a|b") == "a\\|b"


def test_plots_render(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib not installed (the [plots] extra): plots not drawn")
    from vllm_dsa_dev.commands.bench_plots import plot_all

    lines = plot_all(load_results(RESULTS), tmp_path)
    assert all(line.startswith("wrote") for line in lines), lines
    for png in ("transfer_vs_size.png", "tokenizer_vs_length.png", "gate_choice.png"):
        assert (tmp_path / png).stat().st_size > 10_000
