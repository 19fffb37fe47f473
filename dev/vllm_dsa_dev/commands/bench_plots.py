"""The plots of ``docs/benchmarks.md``, drawn from the committed results (``vllm-dsa bench report``).

Optional: matplotlib is not a dependency (``pip install 'vllm-dsa-connector[plots]'``); without it
:func:`plot_all` says so and draws nothing, and the tables are generated all the same.

- ``transfer_vs_size.png``: transfer time against request size, per path on one H200 and over NVLink
  (``h200_gate``, ``h200_nvlink_gate``), and per connector in a GPU P/D pair (``gpu_pd_bounce_mtp``).
- ``tokenizer_vs_length.png``: prefix token cache time against prompt length, against a full encode and
  against encoding only the new text (``cpu_tokenizer``).
- ``gate_choice.png``: per link and request, each measured path's median over the fastest one, the
  gate's choice marked (``h200_gate``, ``h200_nvlink_gate``, ``cpu_gate``).

A plot whose results are missing is skipped with a line saying which file it needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PATH_STYLE = {"ipc": "tab:green", "direct": "tab:blue", "bounce": "tab:orange", "pipelined:4": "tab:purple"}


def _mid(v: Any) -> float:
    """A median or the middle of a ``[lo, hi]`` range."""
    return (v[0] + v[1]) / 2 if isinstance(v, list | tuple) else float(v)


def _err(v: Any) -> float:
    return (v[1] - v[0]) / 2 if isinstance(v, list | tuple) else 0.0


def _finish(ax: Any, **labels: Any) -> None:
    """A line plot's scales, labels and title (``ax.set``), its grid and legend: the look they all share."""
    ax.set(**labels)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, out: Path, name: str) -> str:
    """Lay out ``fig``, write it as ``out / name`` and close it; the line :func:`plot_all` reports."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return f"wrote {name}"


def plot_transfer(results: dict[str, dict[str, Any]], out: Path) -> str:
    """Transfer time vs request size per path (H200) and per connector (GPU P/D pair)."""
    import matplotlib.pyplot as plt

    need = [n for n in ("h200_gate", "gpu_pd_bounce_mtp") if n not in results]
    if need:
        return f"transfer_vs_size.png skipped: needs dev/bench/results/{', '.join(need)}.json"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, style, label in (("h200_gate", "-o", "one H200"), ("h200_nvlink_gate", "--s", "GPU 0 -> GPU 1")):
        if name not in results:
            continue
        shapes = sorted(results[name]["shapes"], key=lambda s: s["bytes"])
        for path, color in PATH_STYLE.items():
            pts = [(s["bytes"] / 1e6, s["measured_ms"][path]) for s in shapes if path in s["measured_ms"]]
            if len(pts) < 2:
                continue
            left.errorbar([p[0] for p in pts], [_mid(p[1]) for p in pts], yerr=[_err(p[1]) for p in pts],
                          fmt=style, color=color, capsize=3,
                          label=f"{path}, {label} ({results[name]['meta']['date']})")
    _finish(left, xscale="log", yscale="log", xlabel="request size (MB)", ylabel="transfer time (ms, median)",
            title="Transport paths on H200 (GLM-5.2-shaped requests)")
    pd = results["gpu_pd_bounce_mtp"]
    for pair_name, pair in pd["pairs"].items():
        summary = pair.get("timing", {}).get("summary", {})
        pts = sorted((s["bytes"] / 1e6, s["transfer_ms_median"]) for s in summary.values())
        if not pts:
            continue
        label = f"{pair_name} ({'NixlConnector' if pair['connector'] == 'nixl' else 'DSAConnector'}"
        label += f", {pair['kv_cache_dtype']})" if pair["kv_cache_dtype"] != "auto" else ")"
        right.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    _finish(right, yscale="log", xlabel="KV bytes per request (MB)", ylabel="connector transfer time (ms, median)",
            title=f"P/D pair on one H200, tiny GLM DSA, {pd['meta']['date']}")
    return _save(fig, out, "transfer_vs_size.png")


def plot_tokenizer(results: dict[str, dict[str, Any]], out: Path) -> str:
    """Prefix token cache time vs prompt length, against a full encode and delta-only."""
    import matplotlib.pyplot as plt

    if "cpu_tokenizer" not in results:
        return "tokenizer_vs_length.png skipped: needs dev/bench/results/cpu_tokenizer.json"
    data = results["cpu_tokenizer"]
    workloads = sorted({r["workload"] for r in data["results"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.4), squeeze=False)
    for ax, kind in zip(axes[0], workloads, strict=True):
        rows = sorted((r for r in data["results"] if r["workload"] == kind), key=lambda r: r["prompt_tokens_median"])
        x = [r["prompt_tokens_median"] / 1000 for r in rows]
        for key, label, color in (("full_ms", "full encode", "tab:red"), ("cache_ms", "prefix token cache", "tab:green"),
                                  ("delta_only_ms", "delta only (the new text alone)", "tab:gray")):
            ax.plot(x, [r[key] for r in rows], "-o", color=color, label=label)
        _finish(ax, yscale="log", xlabel="prompt length (k tokens)", ylabel="time per request (ms, median)",
                title=f"{kind}: Qwen3 tokenizer, {data['meta']['date']}")
    return _save(fig, out, "tokenizer_vs_length.png")


def plot_gate(results: dict[str, dict[str, Any]], out: Path) -> str:
    """Per shape: every measured path's median over the fastest, the gate's choice marked."""
    import matplotlib.pyplot as plt

    names = [n for n in ("h200_gate", "h200_nvlink_gate", "cpu_gate") if n in results]
    if not names:
        return "gate_choice.png skipped: needs dev/bench/results/h200_gate.json or cpu_gate.json"
    shapes = [s for n in names for s in results[n]["shapes"]]
    paths = [p for p in PATH_STYLE if any(p in s["measured_ms"] for s in shapes)]
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(paths)
    for i, s in enumerate(shapes):
        best = min(_mid(v) for v in s["measured_ms"].values())
        for j, path in enumerate(paths):
            if path not in s["measured_ms"]:
                continue
            chosen = path == s["choice"]
            ax.bar(i - 0.4 + (j + 0.5) * width, _mid(s["measured_ms"][path]) / best, width, bottom=0.0,
                   color=PATH_STYLE[path], edgecolor="black" if chosen else "none", linewidth=1.5 if chosen else 0,
                   hatch="//" if chosen else None)
    handles = [Patch(color=PATH_STYLE[p], label=p) for p in paths]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="the gate's choice"))
    ax.legend(handles=handles, fontsize=8, ncol=len(handles), loc="upper right")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{s['link']}\n{s['request'].split(',')[0]}" for s in shapes], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.7, 12)
    ax.set(ylabel="median / the fastest path's median",
           title="The gate's choice against the measured paths (1.0: the fastest; "
                 + ", ".join(f"{results[n]['meta']['date']} {n}" for n in names) + ")")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    return _save(fig, out, "gate_choice.png")


def plot_all(results: dict[str, dict[str, Any]], out: Path) -> list[str]:
    """Draw every plot into ``out``; one line per plot (written, or skipped and why)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install 'vllm-dsa-connector[plots]')"]
    out.mkdir(parents=True, exist_ok=True)
    return [plot(results, out) for plot in (plot_transfer, plot_tokenizer, plot_gate)]
