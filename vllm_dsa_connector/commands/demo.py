"""``vllm-dsa demo``: a prefill and a decode vLLM server with DSAConnector, a proxy, a multi-turn chat.

Starts (on 127.0.0.1) a prefill server (``kv_producer``), a decode server (``kv_consumer``), both
``python -m vllm.entrypoints.openai.api_server`` with ``--kv-transfer-config`` naming DSAConnector (by name:
the general plugin registers it) and ``"verify_transfers": true``, then :mod:`vllm_dsa_connector.pd_proxy`,
and runs a greedy multi-turn chat through the proxy. Per request it prints TTFT (streamed, at the
client), the KV bytes D received and the WRITE time P measured (both from the servers' Prometheus
``/metrics``: ``vllm:dsa_kv_bytes_total``, ``vllm:dsa_kv_transfer_seconds``).

``--check`` also starts ONE server without a connector (alongside the pair), replays the same conversation
(same message history per turn) and exits non-zero unless every decode output is identical, every turn
really moved KV bytes (no silent local recompute: D's ``vllm:dsa_kv_requests_total{outcome="ok"}`` and
received bytes grow per turn), and no checksum mismatch or failed transfer was counted.

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
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

USER_TURNS = (
    "Hello! Please tell me a short story about a dragon who learned to paint.",
    "Nice. Now explain, step by step, how the dragon mixed its first colours.",
    "What would the dragon say to a young knight who wants to learn painting too?",
    "Summarise our whole conversation in three sentences.",
    "Finally, write a two-line poem about the dragon's best painting.",
    "Thank you. Any last advice for beginners?",
)


# ---------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A started process (own session) and its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Cluster:
    """Every process this command starts; ``close`` kills them all (process groups)."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.workdir / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 - owned by the child
        popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, grace_s: float = 10.0) -> None:
        if proc.alive():
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.popen.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.popen.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the group may hold children (engine core, workers) even after the leader exited
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        for proc in list(reversed(self.procs)):
            self.stop(proc)


@contextmanager
def cluster(workdir: Path) -> Iterator[Cluster]:
    """A :class:`Cluster` that is cleaned up on exit, exception, Ctrl-C and SIGTERM."""
    c = Cluster(workdir)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield c
    finally:
        c.close()
        signal.signal(signal.SIGTERM, old)


def engine_env(bind: str) -> dict[str, str]:
    """Environment of a CPU engine bound to the given cores."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    # check_backend reads vLLM's INFO line naming the attention backend: never quieter than INFO
    if env.get("VLLM_LOGGING_LEVEL", "INFO").upper() != "DEBUG":
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    return env


def resolve_model(model: str | None, kind: str) -> Path:
    """``model`` if given, else the tiny model of ``kind`` (``mla``: DeepSeek-V2 MLA; ``dsa``: GLM-MoE-DSA with
    ``index_topk_freq=2``, ``index_topk=16``), made if absent."""
    if model:
        return Path(model)
    if kind == "dsa":
        from vllm_dsa_connector.cpu_dsa.tiny_model import make_tiny_glm_dsa

        return make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    from vllm_dsa_connector.tiny_models import make_tiny_mla

    return make_tiny_mla()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (vLLM CPU then picks AMX_MLA for MLA models unless told otherwise)."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def is_dsa_model_dir(model: Path) -> bool:
    """Whether ``model``'s config.json describes a DSA (sparse indexer) model."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("index_topk") is not None


@dataclass(frozen=True)
class BackendChoice:
    """The attention backend an engine is asked for (``--attention-backend``, None = vLLM's choice) and the
    one it must end up with (read back from its log), with the reason."""

    requested: str | None
    expected: str
    reason: str


def choose_backend(model: Path, dtype: str, requested: str = "auto") -> BackendChoice:
    """Which attention backend a CPU engine of ``model`` runs, and why.

    - DSA models run on the plugin's ``CPU_DSA_SPARSE_MLA`` (vLLM has no CPU sparse backend).
    - MLA models: vLLM picks AMX_MLA whenever the CPU has AMX tiles, but AMX_MLA takes bf16/fp16/int8
      weights only and a block size that is a multiple of 32; a float32 run (the deterministic demo)
      therefore asks for CPU_MLA explicitly, which vLLM honours on every CPU. ``requested`` overrides.
    """
    if is_dsa_model_dir(model):
        return BackendChoice(None, "CPU_DSA_SPARSE_MLA", "DSA model: the plugin's CPU sparse MLA backend")
    if requested != "auto":
        return BackendChoice(requested, requested, "requested")
    if dtype == "float32":
        return BackendChoice("CPU_MLA", "CPU_MLA", "float32 needs CPU_MLA (AMX_MLA takes bf16/fp16/int8 only)")
    if cpu_has_amx():
        return BackendChoice(None, "AMX_MLA", "vLLM's choice on a CPU with AMX tiles")
    return BackendChoice(None, "CPU_MLA", "vLLM's choice on a CPU without AMX tiles")


_BACKEND_LINE = re.compile(r"Using (\w+) backend\.")


def backends_in_log(text: str) -> set[str]:
    """Attention backends an engine reported choosing (vLLM's and the plugin's "Using X backend." lines)."""
    return set(_BACKEND_LINE.findall(text))


def check_backend(proc: Proc, choice: BackendChoice) -> None:
    """RuntimeError unless the engine's log shows exactly the expected attention backend: a future vLLM
    that picks another one must not silently change what runs (and what the tests test)."""
    found = backends_in_log(proc.log.read_text(errors="replace"))
    if found != {choice.expected}:
        raise RuntimeError(
            f"{proc.name}: expected attention backend {choice.expected} ({choice.reason}), the engine "
            f"reported {sorted(found) or 'none'}; log {proc.log}"
        )


def engine_cmd(model: Path, port: int, dtype: str, kv_config: dict[str, Any] | None,
               max_model_len: int = 2048, backend: BackendChoice | None = None,
               extra: list[str] | None = None) -> list[str]:
    """``api_server`` command line of one engine (``backend``: see :func:`choose_backend`)."""
    backend = backend or choose_backend(model, dtype)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
           "--max-model-len", str(max_model_len), "--seed", "0"]
    if backend.requested:
        cmd += ["--attention-backend", backend.requested]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd + list(extra or [])


def wait_healthy(url: str, procs: list[Proc], timeout_s: float) -> None:
    """Poll ``url``/health until 200; RuntimeError with the log tail if a process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with code {p.popen.returncode}; log tail:\n{p.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s; logs in {procs[0].log.parent}")


# ---------------------------------------------------------------------------------------- HTTP


def scrape(url: str) -> dict[str, float]:
    """Prometheus text of ``url``/metrics as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                continue
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, val in m.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(re.search(rf'\b{k}="{re.escape(v)}"', rest) for k, v in labels.items()):
            total += val
    return total


@dataclass
class Reply:
    """One chat completion."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> Reply:
    """A streamed greedy chat completion (TTFT measured at the first content chunk)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    prompt_tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
            for ch in chunk.get("choices", []):
                content = (ch.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(content)
    total = time.perf_counter() - t0
    return Reply("".join(parts), ttft if ttft is not None else total, total, prompt_tokens)


# ---------------------------------------------------------------------------------------- the demo


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
    parser.add_argument("--compose", action="store_true",
                        help="run DSAConnector as the first child of vLLM's MultiConnector, vLLM's "
                             "ExampleConnector (shared-storage KV cache, on a directory under the workdir) "
                             "second; --check then also requires the stored prompts")


def connector_config(role: str, verify: bool, extra: dict[str, Any], side_port: int) -> dict[str, Any]:
    """``--kv-transfer-config`` of a DSAConnector engine (side channel on ``side_port``)."""
    return {"kv_connector": "DSAConnector", "kv_role": role,
            "kv_connector_extra_config": {"verify_transfers": verify, "side_channel_port": side_port, **extra}}


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


def start_pair(c: Cluster, model: Path, args: argparse.Namespace, p_cfg: dict[str, Any], d_cfg: dict[str, Any],
               extra_env: dict[str, dict[str, str]] | None = None) -> tuple[str, str, str]:
    """Start P, D and the proxy; return their URLs once healthy."""
    base = args.base_port
    p_url, d_url, x_url = (f"http://127.0.0.1:{base + i}" for i in range(3))
    ncpu = os.cpu_count() or 1
    extra_env = extra_env or {}
    backend = choose_backend(model, args.dtype, getattr(args, "attention_backend", "auto"))
    p = c.start("prefill", engine_cmd(model, base, args.dtype, p_cfg, backend=backend),
                {**engine_env("0"), **extra_env.get("prefill", {})})
    d = c.start("decode", engine_cmd(model, base + 1, args.dtype, d_cfg, backend=backend),
                {**engine_env(str(min(1, ncpu - 1))), **extra_env.get("decode", {})})
    x = c.start("proxy", [sys.executable, "-m", "vllm_dsa_connector.pd_proxy", "--prefill", p_url,
                          "--decode", d_url, "--port", str(base + 2)], dict(os.environ))
    wait_healthy(p_url, [p, d, x], args.startup_timeout)
    wait_healthy(d_url, [p, d, x], args.startup_timeout)
    wait_healthy(x_url, [x], 60)
    for proc in (p, d):
        check_backend(proc, backend)
    print(f"[demo] attention backend {backend.expected} on P and D ({backend.reason})", flush=True)
    return p_url, d_url, x_url


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
            ref = ref_url = None
            if args.check:  # start the reference engine now: its start-up overlaps the pair's
                ref_url = f"http://127.0.0.1:{args.base_port + 5}"
                ref = c.start("reference", engine_cmd(
                    model, args.base_port + 5, args.dtype, None,
                    backend=choose_backend(model, args.dtype, args.attention_backend)), engine_env("0"))
            p_url, d_url, x_url = start_pair(c, model, args, p_cfg, d_cfg)
            print(f"[demo] prefill {p_url}, decode {d_url}, proxy {x_url} up in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            results = run_turns(x_url, p_url, d_url, model, args.turns, args.max_tokens)
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
                if proc is not ref:
                    c.stop(proc)
            assert ref is not None and ref_url is not None
            wait_healthy(ref_url, [ref], args.startup_timeout)
            check_backend(ref, choose_backend(model, args.dtype, args.attention_backend))
            problems = []
            for i, r in enumerate(results):
                want = chat(ref_url, str(model), r.messages, args.max_tokens)
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
                  f"{f', MultiConnector with {COMPOSE_CHILD}' if getattr(args, 'compose', False) else ''})",
                  flush=True)
            return 0
        except RuntimeError as e:
            print(f"[demo] FAILED: {e}", file=sys.stderr, flush=True)
            return 1
