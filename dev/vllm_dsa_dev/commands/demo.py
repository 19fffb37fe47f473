"""``vllm-dsa demo``: a prefill and a decode vLLM server with DSAConnector, a proxy, a multi-turn chat.

Starts (on 127.0.0.1) a prefill server (``kv_producer``), a decode server (``kv_consumer``), both
``python -m vllm.entrypoints.openai.api_server`` with ``--kv-transfer-config`` naming DSAConnector (by name:
the general plugin registers it) and ``"verify_transfers": true``, then :mod:`vllm_dsa_connector.proxy.app`,
and runs a greedy multi-turn chat through the proxy. Per request it prints TTFT (streamed, at the
client), the KV bytes D received and the WRITE time P measured (both from the servers' Prometheus
``/metrics``: ``vllm:dsa_kv_bytes_total``, ``vllm:dsa_kv_transfer_seconds``).

``--check`` also starts ONE server without a connector (alongside the pair), replays the same conversation
(same message history per turn) and exits non-zero unless every decode output is identical, every turn
really moved KV bytes (no silent local recompute: D's ``vllm:dsa_kv_requests_total{outcome="ok"}`` and
received bytes grow per turn), and no checksum mismatch or failed transfer was counted.

``--prefill-tp/--prefill-pp/--decode-tp/--decode-pp`` give P and D their own tensor/pipeline-parallel
layouts (DSAConnector reshards the KV between them: replicated pages come from one elected P rank, each
pipeline stage sends its own layers); a pipeline-parallel DSA engine gets a ``VLLM_PP_LAYER_PARTITION``
whose stages each start with a layer that computes its own top-k
(:func:`~vllm_dsa_dev.harness.engines.pp_layer_partition`). ``--check``'s reference stays one rank.

``--router vllm-router`` puts vllm-router (``pip install 'vllm-dsa-connector[router]'``, the production
router the README recommends; ``--vllm-pd-disaggregation --kv-connector nixl``, its metrics exporter on
``--base-port`` + 6) in front of the pair instead of :mod:`vllm_dsa_connector.proxy.app`.

``--compose`` runs each side's DSAConnector as the first child of vLLM's ``MultiConnector`` with vLLM's
``ExampleConnector`` (shared-storage reference connector: KV of each new prompt saved per layer as
safetensors files, loaded on an exact prompt hit; it runs on the CPU platform) second, both engines on
one storage directory. P stores every prompt; D's copy then has a hit for every prompt it gets from P, and
DSAConnector, being first, still wins it: ``--check`` also requires the stored prompts. DSA models are
refused (the shared-storage connector stores KV from per-layer hooks, which never see the indexer K
caches; see :mod:`vllm_dsa_connector.connector.compose`).

Settings for determinism: float32 weights/activations (``--dtype float32``), greedy sampling
(temperature 0), ``--enforce-eager``, one request at a time. With bf16 the random tiny model's flat
logits let rounding differences between D's one-token step and a full prefill flip the argmax.
Every process started here runs in its own session and is killed on exit, Ctrl-C and failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dsa_dev.harness.client import Reply, chat, metric, scrape
from vllm_dsa_dev.harness.engines import (
    ROUTERS,
    Layout,
    RouterMissing,
    choose_backend,
    connector_config,
    engine_env,
    is_dsa_model_dir,
    require_vllm_router,
    resolve_model,
    start_engine,
    start_pair,
)
from vllm_dsa_dev.harness.procs import cluster

USER_TURNS = (
    "Hello! Please tell me a short story about a dragon who learned to paint.",
    "Nice. Now explain, step by step, how the dragon mixed its first colours.",
    "What would the dragon say to a young knight who wants to learn painting too?",
    "Summarise our whole conversation in three sentences.",
    "Finally, write a two-line poem about the dragon's best painting.",
    "Thank you. Any last advice for beginners?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``vllm-dsa demo``."""
    parser.add_argument("--turns", type=int, default=3, help="chat turns (default 3)")
    parser.add_argument("--check", action="store_true",
                        help="also run one engine without a connector; fail unless outputs match and KV moved")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (default 16)")
    parser.add_argument("--model", default=None,
                        help="model directory (default: the tiny model of --model-kind, made if absent)")
    parser.add_argument("--model-kind", default="mla", choices=("mla", "dsa"),
                        help="tiny model to make when --model is not given: mla (DeepSeek-V2) or dsa "
                             "(GLM-MoE-DSA, index_topk_freq 2, index_topk 16; runs on the plugin's CPU DSA "
                             "backend)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="model dtype (float32: deterministic across P/D and one engine)")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "CPU_MLA", "AMX_MLA"),
                        help="MLA models: auto = CPU_MLA for float32 (AMX_MLA takes bf16 only), vLLM's "
                             "choice for bf16 (AMX_MLA on CPUs with AMX tiles); the demo fails if the "
                             "engines report another backend")
    parser.add_argument("--base-port", type=int, default=24000,
                        help="P, D, proxy HTTP ports: base..base+2; side channels base+3, base+4; reference base+5")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for servers")
    parser.add_argument("--workdir", default=None, help="where logs go (default: a temporary directory)")
    parser.add_argument("--no-verify", action="store_true", help="turn verify_transfers off")
    parser.add_argument("--extra-config", default="{}",
                        help="JSON merged into kv_connector_extra_config of both engines")
    for side in ("prefill", "decode"):
        for dim, what in (("tp", "tensor"), ("pp", "pipeline")):
            parser.add_argument(f"--{side}-{dim}", type=int, default=1, metavar="N",
                                help=f"{what}-parallel size of the {side} engine (default 1; ranks are "
                                     "bound to cores round-robin)")
    parser.add_argument("--router", default="pd-proxy", choices=ROUTERS,
                        help="what routes between P and D: pd-proxy (the embedded python -m "
                             "vllm_dsa_connector.proxy.app, default) or vllm-router (the [router] extra; its "
                             "metrics exporter on base+6)")
    parser.add_argument("--compose", action="store_true",
                        help="run DSAConnector as the first child of vLLM's MultiConnector, vLLM's "
                             "ExampleConnector (shared-storage KV cache, on a directory under the workdir) "
                             "second; --check then also requires the stored prompts")


COMPOSE_CHILD = "ExampleConnector"


def compose_config(dsa_config: dict[str, Any], storage: Path) -> dict[str, Any]:
    """``--kv-transfer-config`` of a MultiConnector engine: DSAConnector first (P/D connectors must be: see
    :mod:`vllm_dsa_connector.connector.compose`), vLLM's shared-storage ExampleConnector second."""
    return {"kv_connector": "MultiConnector", "kv_role": dsa_config["kv_role"],
            "kv_connector_extra_config": {"connectors": [
                dsa_config,
                {"kv_connector": COMPOSE_CHILD, "kv_role": "kv_both",
                 "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
            ]}}


def check_compose(model: Path, kv_config: dict[str, Any]) -> None:
    """The composition check the engines run (the runtime guard), here before starting anything."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from vllm_dsa_connector.connector.compose import Child, check_composition, children_configs
    from vllm_dsa_connector.connector.connector import DSAConnector

    top = SimpleNamespace(**kv_config)
    classes = {"DSAConnector": DSAConnector, COMPOSE_CHILD: ExampleConnector}
    children = [Child(i, c, classes[c["kv_connector"]]) for i, c in enumerate(children_configs(top))]
    check_composition(top, children, is_dsa_model_dir(model))


def stored_prompts(storage: Path) -> tuple[int, int]:
    """(prompt folders, layer files) the shared-storage connector wrote."""
    folders = [d for d in storage.iterdir() if d.is_dir()] if storage.is_dir() else []
    return len(folders), sum(len(list(d.glob("*.safetensors"))) for d in folders)


@dataclass
class TurnResult:
    """One P/D turn."""

    messages: list[dict[str, str]]
    reply: Reply
    kv_bytes: float
    transfer_ms: float
    runs_checked: float
    ok_transfers: float


def run_turns(x_url: str, p_url: str, d_url: str, model: Path, turns: int, max_tokens: int,
              label: str = "P/D") -> list[TurnResult]:
    """The multi-turn chat through the proxy, with per-turn KV figures from both servers' metrics."""
    messages: list[dict[str, str]] = []
    results = []
    for i in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]})
        pm0, dm0 = scrape(p_url), scrape(d_url)
        reply = chat(x_url, str(model), list(messages), max_tokens)
        # Stats reach /metrics with the engine step that finished the transfer: allow a moment.
        deadline = time.monotonic() + 5
        while True:
            pm1, dm1 = scrape(p_url), scrape(d_url)
            ok = metric(dm1, "vllm:dsa_kv_requests_total", outcome="ok", side="recv") - metric(
                dm0, "vllm:dsa_kv_requests_total", outcome="ok", side="recv")
            if ok >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        kv_bytes = metric(dm1, "vllm:dsa_kv_bytes_total", side="recv") - metric(
            dm0, "vllm:dsa_kv_bytes_total", side="recv")
        xfer_ms = 1000 * (metric(pm1, "vllm:dsa_kv_transfer_seconds_sum") - metric(
            pm0, "vllm:dsa_kv_transfer_seconds_sum"))
        checked = metric(dm1, "vllm:dsa_kv_checksummed_runs_total") - metric(
            dm0, "vllm:dsa_kv_checksummed_runs_total")
        results.append(TurnResult(list(messages), reply, kv_bytes, xfer_ms, checked, ok))
        print(f"[demo] {label} turn {i + 1}/{turns}: prompt {reply.prompt_tokens} tok, "
              f"TTFT {reply.ttft_s * 1000:.1f} ms, KV {int(kv_bytes):,} B moved in {xfer_ms:.2f} ms "
              f"({int(checked)} runs checksummed), reply {reply.text[:60]!r}", flush=True)
        messages.append({"role": "assistant", "content": reply.text})
    return results


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vllm-dsa demo``."""
    if args.turns < 1:
        print("vllm-dsa demo: --turns must be >= 1", file=sys.stderr)
        return 2
    try:
        extra = json.loads(args.extra_config)
    except json.JSONDecodeError as e:
        print(f"vllm-dsa demo: --extra-config is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        p_layout = Layout(getattr(args, "prefill_tp", 1), getattr(args, "prefill_pp", 1))
        d_layout = Layout(getattr(args, "decode_tp", 1), getattr(args, "decode_pp", 1))
    except ValueError as e:
        print(f"vllm-dsa demo: {e}", file=sys.stderr)
        return 2
    router = getattr(args, "router", "pd-proxy")
    if router == "vllm-router":
        try:
            require_vllm_router()
        except RouterMissing as e:
            print(f"vllm-dsa demo --router vllm-router: {e}", file=sys.stderr)
            return 2
    model = resolve_model(args.model, args.model_kind)
    verify = not args.no_verify
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vllm-dsa-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model {model}, dtype {args.dtype}, logs in {workdir}", flush=True)
    p_cfg = connector_config("kv_producer", verify, extra, args.base_port + 3)
    d_cfg = connector_config("kv_consumer", verify, extra, args.base_port + 4)
    storage = workdir / "shared-storage"
    if getattr(args, "compose", False):
        from vllm_dsa_connector.connector.compose import CompositionError

        p_cfg, d_cfg = compose_config(p_cfg, storage), compose_config(d_cfg, storage)
        try:
            check_compose(model, p_cfg)
        except CompositionError as e:
            print(f"vllm-dsa demo --compose: {e}", file=sys.stderr)
            return 2
        print(f"[demo] compose: MultiConnector[DSAConnector, {COMPOSE_CHILD}] on P and D, shared storage "
              f"{storage}", flush=True)
    with cluster(workdir) as c:
        try:
            t0 = time.monotonic()
            ref = None
            if args.check:  # start the reference engine now: its start-up overlaps the pair's
                ref = start_engine(c, "reference", model, args.base_port + 5, args.dtype, None,
                                   choose_backend(model, args.dtype, args.attention_backend), engine_env("0"))
            p_url, d_url, x_url = start_pair(
                c, model, p_cfg, d_cfg, base_port=args.base_port, dtype=args.dtype,
                startup_timeout=args.startup_timeout, attention_backend=args.attention_backend,
                p_layout=p_layout, d_layout=d_layout, router=router)
            print(f"[demo] prefill {p_url}, decode {d_url}, {router} {x_url} up in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            label = "P/D" if p_layout == d_layout == Layout() else f"P/D {p_layout.label}->{d_layout.label}"
            label += " via vllm-router" if router == "vllm-router" else ""
            results = run_turns(x_url, p_url, d_url, model, args.turns, args.max_tokens, label)
            pm, dm = scrape(p_url), scrape(d_url)
            failures = {
                "checksum mismatches": metric(dm, "vllm:dsa_kv_checksum_mismatches_total"),
                "failed/timed-out loads": metric(dm, "vllm:dsa_kv_requests_total", side="recv", outcome="failed")
                + metric(dm, "vllm:dsa_kv_requests_total", side="recv", outcome="timeout"),
                "failed sends": metric(pm, "vllm:dsa_kv_requests_total", side="send", outcome="failed"),
            }
            compose_problems = []
            if getattr(args, "compose", False):
                folders, files = stored_prompts(storage)
                print(f"[demo] {COMPOSE_CHILD} stored {folders} prompts ({files} layer files) in {storage}",
                      flush=True)
                if folders < len(results) or files == 0:
                    compose_problems.append(f"{COMPOSE_CHILD} stored {folders} prompts ({files} files) for "
                                            f"{len(results)} turns")
            if not args.check:
                return 0
            for proc in list(c.procs):
                if ref is None or proc is not ref.proc:
                    c.stop(proc)
            assert ref is not None
            ref.ready(args.startup_timeout)
            problems = []
            for i, r in enumerate(results):
                want = chat(ref.url, str(model), r.messages, args.max_tokens)
                same = want.text == r.reply.text
                print(f"[demo] reference turn {i + 1}/{len(results)}: "
                      f"{'identical' if same else 'DIFFERENT'} ({want.text[:60]!r})", flush=True)
                if not same:
                    problems.append(f"turn {i + 1}: P/D {r.reply.text!r} != one engine {want.text!r}")
                if r.kv_bytes <= 0 or r.ok_transfers < 1:
                    problems.append(f"turn {i + 1}: no KV moved (bytes {r.kv_bytes}, ok transfers {r.ok_transfers})")
                if verify and r.runs_checked <= 0:
                    problems.append(f"turn {i + 1}: no run was checksummed")
            problems += [f"{k}: {int(v)}" for k, v in failures.items() if v] + compose_problems
            if problems:
                print("[demo] CHECK FAILED:\n  " + "\n  ".join(problems), flush=True)
                return 1
            total = sum(r.kv_bytes for r in results)
            print(f"[demo] CHECK OK: {len(results)} turns identical to one engine; {int(total):,} KV bytes moved "
                  f"and verified ({args.dtype}, greedy"
                  f"{f', MultiConnector with {COMPOSE_CHILD}' if getattr(args, 'compose', False) else ''}"
                  f"{', through vllm-router' if router == 'vllm-router' else ''})",
                  flush=True)
            return 0
        except RuntimeError as e:
            print(f"[demo] FAILED: {e}", file=sys.stderr, flush=True)
            return 1
