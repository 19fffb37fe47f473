"""GPU P/D page check: DSAConnector pairs on one GPU, every layer's KV pages compared block by block on P and D.

Runs on a host with vLLM's GPU build (see shared/gpu/README.md for the H200 payload). Per mode (``eager``:
``--enforce-eager``; ``graphs``: vLLM's default torch.compile + CUDA graphs), a prefill and a decode engine
with DSAConnector (``verify_transfers`` on, so every run is CRC-checked on the GPU pools) and the KV probe
worker extension start at once (``--kv-cache-memory-bytes``, so concurrent starts on one GPU do not disturb
each other's memory profile). Then three turns as multi-turn traffic has them: a prompt of 3 blocks + 1
token, one that keeps its first 3 blocks (D serves them from its own prefix cache) and one that keeps 2.
Each turn: P prefills (``do_remote_decode``), D decodes with P's ``kv_transfer_params`` and, while it runs,
the probe returns D's block list and a CRC32 per layer and block; the same prompt on P alone gives P's.
Every full block must be equal on every layer; bytes received per turn come from D's counters.

    python bench/gpu_pd.py --model /tmp/models/tiny-glm-dsa-h32-k128 [--modes eager,graphs]

Prints a JSON line and writes ``$OUT/gpu_pd.json`` when ``OUT`` is set; exit 1 when a page differs or a
turn fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dsa_connector.harness.client import metric, post_json, probe_running, scrape
from vllm_dsa_connector.harness.procs import Cluster, cluster, wait_healthy

BLOCK = 64
PROBE = ["--worker-extension-cls", "vllm_dsa_connector.kv_probe.KVProbe"]


def _engine(c: Cluster, name: str, model: str, port: int, side: int, role: str, eager: bool,
            kv_bytes: int) -> tuple[Any, str]:
    cfg = {"kv_connector": "DSAConnector", "kv_role": role, "kv_load_failure_policy": "fail",
           "kv_connector_extra_config": {"verify_transfers": True, "side_channel_port": side}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
           "--seed", "0", "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", str(kv_bytes),
           "--kv-transfer-config", json.dumps(cfg), *PROBE]
    if eager:
        cmd.append("--enforce-eager")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return c.start(name, cmd, env), f"http://127.0.0.1:{port}"


def _by_layer(entry: dict[str, Any]) -> dict[str, list[int]]:
    return entry["layer_digests"]


def _turns() -> list[list[int]]:
    rng = random.Random(7)
    new = lambda n: [rng.randrange(100, 20000) for _ in range(n)]  # noqa: E731
    x = new(3 * BLOCK + 1)
    y = x[: 3 * BLOCK] + new(2 * BLOCK + 1)
    z = y[: 2 * BLOCK] + new(3 * BLOCK + 1)
    return [x, y, z]


def _run_mode(p_url: str, d_url: str) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    ok = True
    for turn, ids in enumerate(_turns(), 1):
        row: dict[str, Any] = {"turn": turn, "prompt_tokens": len(ids)}
        try:
            recv0 = metric(scrape(d_url), "vllm:dsa_kv_bytes_total", side="recv")
            t0 = time.perf_counter()
            res = post_json(p_url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
            row["p_prefill_s"] = round(time.perf_counter() - t0, 4)
            params = res["kv_transfer_params"]
            (d,) = probe_running(d_url, "tiny", ids, params)
            (p,) = probe_running(p_url, "tiny", ids, None)
            time.sleep(0.5)
            row["recv_bytes"] = metric(scrape(d_url), "vllm:dsa_kv_bytes_total", side="recv") - recv0
            full = (len(ids) - 1) // BLOCK
            lp, ld = _by_layer(p), _by_layer(d)
            bad = {name: [j for j in range(full) if lp[name][j] != ld.get(name, [None] * full)[j]]
                   for name in lp}
            bad = {k: v for k, v in bad.items() if v}
            row.update(full_blocks=full, layers=len(lp), p_blocks=p["block_ids"], d_blocks=d["block_ids"],
                       pages_equal=not bad and len(p["digests"]) == len(d["digests"]) == full,
                       differing=bad)
        except Exception as e:  # noqa: BLE001 - a failed turn is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        ok = ok and bool(row.get("pages_equal"))
        out.append(row)
        print(f"[gpu_pd] turn {turn}: {row}", flush=True)
    return {"turns": out, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="eager,graphs")
    ap.add_argument("--base-port", type=int, default=9100)
    ap.add_argument("--kv-cache-bytes", type=int, default=4 << 30)
    ap.add_argument("--startup-timeout", type=float, default=480.0)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    result: dict[str, Any] = {"model": args.model, "block_size": BLOCK}
    work = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-pd-"))
    with cluster(work / "engines") as c:
        pairs = {}
        for k, mode in enumerate(modes):
            base = args.base_port + 10 * k
            p = _engine(c, f"{mode}-P", args.model, base, base + 3, "kv_producer", mode == "eager", args.kv_cache_bytes)
            d = _engine(c, f"{mode}-D", args.model, base + 1, base + 4, "kv_consumer", mode == "eager",
                        args.kv_cache_bytes)
            pairs[mode] = (p, d)
        t0 = time.time()
        for mode, ((pp, pu), (dp, du)) in pairs.items():
            try:
                for url in (pu, du):
                    wait_healthy(url, [pp, dp], args.startup_timeout)
                result[f"{mode}_up_s"] = round(time.time() - t0, 1)
                log = pp.log.read_text(errors="replace") + dp.log.read_text(errors="replace")
                result[f"{mode}_backends"] = sorted({ln.split("Using ")[1].split(" ")[0] for ln in log.splitlines()
                                                     if "attention backend out of" in ln})
                result[f"{mode}_registered"] = sorted({ln.split("registered ")[1] for ln in log.splitlines()
                                                       if "registered" in ln and "pool(s)" in ln})
                result[mode] = _run_mode(pu, du)
            except Exception as e:  # noqa: BLE001
                result[mode] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800]}
            for proc in (pp, dp):
                tail = [ln for ln in proc.log.read_text(errors="replace").splitlines()
                        if "Error" in ln or "Traceback" in ln][:5]
                if tail:
                    result.setdefault("engine_errors", {})[proc.name] = tail
    result["ok"] = all(result.get(m, {}).get("ok") for m in modes)
    print(json.dumps(result))
    (work / "gpu_pd.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
