"""The text summary of a dev/bench/gpu_transfer.py result (printed after the JSON line)."""

from __future__ import annotations

from typing import Any


def summary(res: dict[str, Any]) -> str:
    """Human-readable lines: per shape and path medians, phases, kernels and the goals."""
    lines = [f"link {res.get('link')} ipc={res.get('ipc')} {res.get('ipc_error', '')}"]
    for blocks, sh in res.get("shapes", {}).items():
        lines.append(f"shape {blocks} blocks ({sh['total_bytes'] / 1e9:.3f} GB, {sh['page_runs']} page runs, "
                     f"{sh['merged_runs']} merged): gate -> {sh['gate_path']}; best {sh['best_path']} "
                     f"{sh['best_ms']:.3f} ms; auto/best {sh.get('auto_over_best', float('nan')):.3f}")
        for p, v in sh["paths"].items():
            ph = v["phases_ms"]
            lines.append(f"  {p:22s} {v['median_ms']:9.3f} ms (rcv {v.get('rcv_median_ms', float('nan')):.3f}) "
                         f"{v['gb_per_s']:7.1f} GB/s  send {ph['send']:.3f} "
                         f"(launch {ph.get('launch', float('nan')):.3f}) wait {ph['wait']:.3f} "
                         f"recv {ph['receiver']:.3f}  used {v['used']} desc {v['desc_count']}")
    t = res.get("tune", {})
    if t:
        lines.append(f"device copy {t['copy_ms']:.3f} ms ({t['copy_tbps_rw']:.2f} TB/s r+w); merge of the page "
                     f"runs {t['merge_ms']:.2f} ms; best launch shape {t.get('best_config')}; host per launch "
                     f"{t.get('launch_host_ms', float('nan')):.3f} ms (cached plan; after 3 ms idle "
                     f"{t.get('launch_after_idle_host_ms', float('nan')):.3f}; new runs "
                     f"{t.get('launch_cold_host_ms', float('nan')):.3f} ms); scattered copy per call "
                     f"{t.get('scattered_call_ms', float('nan')):.3f} ms")
        for impl in ("index", "triton"):
            v = t.get(impl, {})
            if "gather_ms" in v:
                lines.append(f"  {impl}: gather {v['gather_vs_copy']:.3f} scatter {v['scatter_vs_copy']:.3f} of copy "
                             f"(per call {v['gather_call_vs_copy']:.3f} / {v['scatter_call_vs_copy']:.3f})")
            elif v:
                lines.append(f"  {impl}: {v}")
        for key, v in t.get("sweep", {}).items():
            lines.append(f"  sweep {key}: {v if isinstance(v, str) else ', '.join(f'{x} {y:.3f}' for x, y in v.items())}")
    k = res.get("kernels", {})
    if k:
        if "ipc_kernel_ms" in k:
            lines.append(f"  ipc kernel {k['ipc_kernel_ms']:.3f} ms = {k['ipc_kernel_gbps']:.0f} GB/s; "
                         f"sweep {k.get('ipc_sweep_gbps', {})}")
        if "split_gbps" in k:
            lines.append(f"  split across streams (GB/s, GPU time): {k['split_gbps']}")
        if "ipc_kernel_error" in k:
            lines.append(f"  ipc kernel error: {k['ipc_kernel_error']}")
        if "ipc_ce_ms" in k:
            lines.append(f"  ipc copy engine {k['ipc_ce_ms']:.3f} ms = {k['ipc_ce_gbps']:.0f} GB/s "
                         f"(per call {k['ipc_ce_call_ms']:.3f} ms)")
        elif "ipc_ce_error" in k:
            lines.append(f"  ipc copy engine error: {k['ipc_ce_error']}")
        if "peer_copy" in k:
            pc = k["peer_copy"]
            lines.append(f"  peer copy bound: torch {pc['torch_copy_ms']:.3f} ms = {pc['torch_copy_gbps']:.0f} GB/s;"
                         f" triton contiguous {pc['triton_contiguous_gbps']:.0f} GB/s")
            sh = res.get("shapes", {}).get(str(max(int(b) for b in res["shapes"])), {})
            if sh:
                auto = sh["paths"].get("auto", {}).get("median_ms", float("nan"))
                lines.append(f"GOALS ({sh['blocks']} blocks): gate {sh['gate_path']} {auto:.3f} ms = "
                             f"{auto / sh['best_ms']:.3f}x of best {sh['best_path']} {sh['best_ms']:.3f} ms "
                             f"(goal <= 1.05); best = {sh['best_ms'] / pc['torch_copy_ms']:.3f}x of the NVLink "
                             f"bound {pc['torch_copy_ms']:.3f} ms (goal <= 1.1)")
                if "rcv_best_ms" in sh:
                    ra = sh["paths"].get("auto", {}).get("rcv_median_ms", float("nan"))
                    lines.append(f"GOALS, end at the receiver's completion (no ack pipe): gate {ra:.3f} ms = "
                                 f"{ra / sh['rcv_best_ms']:.3f}x of best {sh['rcv_best_path']} "
                                 f"{sh['rcv_best_ms']:.3f} ms; best = {sh['rcv_best_ms'] / pc['torch_copy_ms']:.3f}x"
                                 f" of the bound")
    if "plan_stats" in res:
        lines.append(f"copy plans: {res['plan_stats']}")
    return "\n".join(lines)
