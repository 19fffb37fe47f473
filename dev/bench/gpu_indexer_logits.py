"""GPU check of the runtime fix ``deep-gemm-mqa-logits-api``: vLLM's MQA-logits wrapper over the installed DeepGEMM.

Needs vLLM's GPU build and a DeepGEMM on an SM90+ GPU. The plugin's runtime fixes are applied, then vLLM's own
``vllm.utils.deep_gemm.fp8_fp4_mqa_logits`` (prefill: keys per query row in ``[ks, ke)``) is called with fp8
queries and keys as the DSA indexer passes them and compared with a torch reference of the same math
(sum over heads of relu(q . k) * weight, times the key's dequant scale) on the same fp8 values. Writes
``$OUT/gpu_indexer_logits.json`` when ``OUT`` is set; exits 1 on a mismatch.

    python dev/bench/gpu_indexer_logits.py
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> int:
    """Run the check for a few shapes; print one JSON line."""
    from vllm_dsa_connector.fixes import apply_runtime_fixes, report_for

    report = report_for(apply_runtime_fixes(), "deep-gemm-mqa-logits-api")
    import vllm.utils.deep_gemm as dg

    results = []
    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, heads in ((7, 300, 32), (64, 1000, 64), (130, 4096, 32)):
        dim = 128
        q = (torch.randn(m, heads, dim, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
        k = (torch.randn(n, dim, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda", generator=g) + 0.5
        w = torch.randn(m, heads, device="cuda", generator=g)
        ks = torch.randint(0, n // 2, (m,), device="cuda", dtype=torch.int32, generator=g)
        ke = torch.minimum(ks + torch.randint(1, n, (m,), device="cuda", dtype=torch.int32, generator=g),
                           torch.tensor(n, device="cuda", dtype=torch.int32))
        out = dg.fp8_fp4_mqa_logits((q, None), (k, scale), w, ks, ke, clean_logits=False)
        ref = (torch.einsum("mhd,nd->mhn", q.float(), k.float()).relu() * w.unsqueeze(-1)).sum(1) * scale
        cols = torch.arange(n, device="cuda").view(1, -1)
        valid = (cols >= ks.view(-1, 1)) & (cols < ke.view(-1, 1))
        err = ((out - ref).abs() / (ref.abs() + 1.0))[valid].max().item()
        good = out.shape == (m, n) and err < 1e-2
        ok = ok and good
        results.append({"m": m, "n": n, "heads": heads, "max_rel_err": err, "ok": good})
    res = {"fix": report.status, "fix_detail": report.detail, "deep_gemm_kernel":
           getattr(getattr(dg, "_fp8_fp4_mqa_logits_impl", None), "__name__", None), "shapes": results, "ok": ok}
    print(json.dumps(res))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_indexer_logits.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
