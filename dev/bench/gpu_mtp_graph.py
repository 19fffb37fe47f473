"""GPU check for issue 6: the fixed token->request map inside CUDA graphs.

Needs torch with CUDA only (no vLLM). It exercises exactly what the runtime fix installs:

1. ``compute_token_to_req_indices`` (vllm_dsa_connector/fixes/token_to_req_indices.py) captured in a
   CUDA graph per (batch size, padded token count), replayed after ``query_start_loc`` is
   rewritten in place with target layouts (draft_len + 1 tokens per request), draft layouts
   (one token per request, padded tail) and ragged layouts with zero-length rows; every
   replay is compared with ``repeat_interleave`` on the host.
2. The same with a fixed ``num_mapped_tokens`` (the runtime fix's call, graph keyed on the
   CPU total), replayed with new per-request boundaries.
3. The installed method itself (``mtp_stale_caches._fixed_token_to_req_indices``) on a minimal
   stand-in with the fields it reads, through the draft-loop rewrite, under
   ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises.
4. Where vLLM is installed: vLLM's own ``compute_token_to_req_indices`` (its Triton kernel, imported
   at run time from ``vllm.v1.attention.ops.metadata``) gives the same maps; skipped without vLLM
   (the project holds no copy of vLLM's code).

Replay timings are printed for information only. Writes ``$OUT/gpu_mtp_graph.json`` when
``OUT`` is set; exits 1 on any mismatch.

    python dev/bench/gpu_mtp_graph.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

from vllm_dsa_connector.fixes import mtp_stale_caches  # noqa: E402
from vllm_dsa_connector.fixes.token_to_req_indices import compute_token_to_req_indices  # noqa: E402


def _reference(query_lens: list[int], num_tokens: int) -> list[int]:
    ref = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    ref = ref.tolist()[:num_tokens]
    return ref + [0] * (num_tokens - len(ref))


def _layouts(batch: int, draft_len: int, max_tokens: int, gen: torch.Generator) -> list:
    """Query-length vectors that fit in ``max_tokens``: target, draft, ragged, zero rows."""
    out = [[draft_len + 1] * batch, [1] * batch]
    for _ in range(6):
        lens = torch.randint(0, draft_len + 3, (batch,), generator=gen)
        while int(lens.sum()) > max_tokens:
            lens = torch.div(lens, 2, rounding_mode="floor")
        out.append(lens.tolist())
    return out


def _qsl(query_lens: list[int], device: str) -> torch.Tensor:
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return qsl.to(device)


def graph_checks(device: str) -> dict:
    gen = torch.Generator().manual_seed(6)
    results = {"graphs": 0, "replays": 0, "mismatches": 0, "examples": [], "replay_us": {}}
    for batch in (1, 3, 16, 64, 256, 1024):
        for draft_len in (1, 3, 7):
            max_tokens = batch * (draft_len + 1)
            for mapped_mode in ("device", "fixed"):
                qsl_static = torch.zeros(batch + 1, dtype=torch.int32, device=device)
                out_static = torch.full((max_tokens + 64,), -1, dtype=torch.int32, device=device)
                qsl_static.copy_(_qsl([draft_len + 1] * batch, device))
                fixed_total = max_tokens if mapped_mode == "fixed" else None

                def step(
                    fixed_total=fixed_total, qsl_static=qsl_static, out=out_static, n=max_tokens
                ) -> None:
                    compute_token_to_req_indices(qsl_static, out, fixed_total, n)

                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                results["graphs"] += 1
                layouts = _layouts(batch, draft_len, max_tokens, gen)
                if mapped_mode == "fixed":  # same total, new boundaries
                    layouts = [lens for lens in layouts if sum(lens) == max_tokens]
                    perm = torch.randperm(batch, generator=gen).tolist()
                    moved = [draft_len + 1] * batch
                    if batch > 1:
                        moved[perm[0]] += moved[perm[1]]
                        moved[perm[1]] = 0
                    layouts.append(moved)
                for lens in layouts:
                    qsl_static.copy_(_qsl(lens, device))  # in place, like the runner's buffer
                    graph.replay()
                    torch.cuda.synchronize()
                    got = out_static[:max_tokens].tolist()
                    want = _reference(lens, max_tokens)
                    results["replays"] += 1
                    tail_ok = out_static[max_tokens:].eq(-1).all().item()
                    if got != want or not tail_ok:
                        results["mismatches"] += 1
                        if len(results["examples"]) < 5:
                            results["examples"].append(
                                {
                                    "batch": batch,
                                    "lens": lens[:16],
                                    "got": got[:16],
                                    "want": want[:16],
                                }
                            )
                if mapped_mode == "device" and draft_len == 3:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(200):
                        graph.replay()
                    torch.cuda.synchronize()
                    results["replay_us"][str(batch)] = round(
                        (time.perf_counter() - t0) / 200 * 1e6, 2
                    )
    return results


def _meta(qsl: torch.Tensor, qsl_cpu: torch.Tensor, num_tokens: int) -> SimpleNamespace:
    """The fields of CommonAttentionMetadata the fixed method reads and writes (mutable,
    like the real one, which the drafter rewrites in place)."""
    return SimpleNamespace(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        num_actual_tokens=num_tokens,
        _token_to_req_indices_cache=None,
    )


def method_checks(device: str) -> dict:
    """The installed method through target -> draft rewrite, with host syncs made errors."""
    results = {"cases": 0, "mismatches": 0, "sync_errors": 0, "target_reused": 0}
    for batch, draft_len in ((2, 1), (3, 2), (8, 3), (128, 4)):
        lens = [draft_len + 1] * batch
        qsl_cpu = _qsl(lens, "cpu")
        meta = _meta(qsl_cpu.to(device), qsl_cpu.clone(), int(qsl_cpu[-1]))
        target_buf = torch.zeros(batch * (draft_len + 1) + 8, dtype=torch.int32, device=device)
        draft_buf = torch.zeros_like(target_buf)
        arange = torch.arange(batch + 1, dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            target = mtp_stale_caches._fixed_token_to_req_indices(meta, target_buf)
            again = mtp_stale_caches._fixed_token_to_req_indices(meta, target_buf)
            meta.num_actual_tokens = batch  # llm_base_proposer.propose() rewrite
            meta.query_start_loc = arange[: batch + 1]
            meta.query_start_loc_cpu = torch.arange(batch + 1, dtype=torch.int32)
            draft = [mtp_stale_caches._fixed_token_to_req_indices(meta, draft_buf) for _ in range(2)]
        except RuntimeError as exc:
            results["sync_errors"] += 1
            results["sync_error"] = str(exc)[:300]
            continue
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        results["cases"] += 1
        results["target_reused"] += int(again.data_ptr() == target.data_ptr())
        ok = target.tolist() == _reference(lens, len(lens) * (draft_len + 1))
        ok = ok and all(d.tolist() == list(range(batch)) for d in draft)
        results["mismatches"] += int(not ok)
    return results


def vllm_kernel_checks(device: str) -> dict:
    """vLLM's own token->request map (its Triton kernel) vs ours, where vLLM is installed."""
    try:
        from vllm.v1.attention.ops.metadata import compute_token_to_req_indices as vllm_map
    except ImportError as exc:  # the H200 host has no vLLM: nothing to compare with
        return {"skipped": f"vLLM's kernel not importable: {exc}"}

    gen = torch.Generator().manual_seed(7)
    results = {"cases": 0, "mismatches": 0}
    for _ in range(200):
        batch = int(torch.randint(1, 300, (1,), generator=gen))
        lens = torch.randint(0, 9, (batch,), generator=gen).tolist()
        qsl = _qsl(lens, device)
        mapped = sum(lens)
        num_tokens = mapped + int(torch.randint(0, 40, (1,), generator=gen))
        a = torch.full((num_tokens + 8,), -1, dtype=torch.int32, device=device)
        b = torch.full_like(a, -1)
        vllm_map(qsl, a, mapped, num_tokens)
        compute_token_to_req_indices(qsl, b, mapped, num_tokens)
        results["cases"] += 1
        results["mismatches"] += int(not torch.equal(a, b))
    return results


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    device = "cuda"
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "graph": graph_checks(device),
        "method": method_checks(device),
        "vllm_kernel": vllm_kernel_checks(device),
    }
    failed = (
        report["graph"]["mismatches"]
        or report["method"]["mismatches"]
        or report["method"]["sync_errors"]
        or report["vllm_kernel"].get("mismatches", 0)
    )
    report["ok"] = not failed
    text = json.dumps(report, indent=1)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "gpu_mtp_graph.json").write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
