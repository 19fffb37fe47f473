"""vLLM ``api_server`` engines on the CPU, for the demo, the benches and the tests.

The command line and environment of one engine (:func:`engine_cmd`, :func:`engine_env`), the attention
backend it must run (:func:`choose_backend`, checked from its log by :func:`check_backend`), the
DSAConnector ``--kv-transfer-config`` (:func:`connector_config`) and :func:`start_pair`: a prefill and a
decode engine plus a router in front of them, :mod:`vllm_dsa_connector.proxy.app` (the embedded default) or
vllm-router (:func:`router_cmd`, the ``[router]`` extra), all started in a :class:`~.procs.Cluster` (own
process groups, killed as groups).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from vllm_dsa_dev.harness.procs import Cluster, Proc, wait_healthy

API_SERVER = "vllm.entrypoints.openai.api_server"


#: ``VLLM_CPU_OMP_THREADS_BIND`` value that leaves placement to the kernel (:meth:`Layout.bind`).
NOBIND = "nobind"


def engine_env(bind: str) -> dict[str, str]:
    """Environment of a CPU engine bound to the given cores (``VLLM_CPU_OMP_THREADS_BIND``); with
    :data:`NOBIND`, one OpenMP thread per rank placed by the kernel. ``TORCH_COMPILE_DISABLE`` defaults to 1
    (eager engines, no C++ compile in a fresh engine's first step)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    # vLLM torch.compiles a few helpers even with --enforce-eager (the vocab-parallel embedding mask of a
    # TP>1 engine): on a machine with an empty inductor cache the first request of a fresh TP engine then
    # spends tens of seconds in the C++ compiler inside its first step (two loaded cores: 25-40 s and more).
    # The harness's engines are eager: run those helpers eagerly too (set it to 0 to keep compiling).
    env.setdefault("TORCH_COMPILE_DISABLE", "1")
    if bind == NOBIND:
        env["OMP_NUM_THREADS"] = "1"
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
        from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

        return make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    from vllm_dsa_dev.tiny_models import make_tiny_mla

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


def engine_cmd(model: Path, port: int, dtype: str | None, kv_config: dict[str, Any] | None,
               max_model_len: int = 2048, backend: BackendChoice | None = None,
               extra: list[str] | None = None, host: str = "127.0.0.1",
               prefix: Sequence[str] = ()) -> list[str]:
    """``api_server`` command line of one engine (``backend``: see :func:`choose_backend`; ``dtype``
    None leaves vLLM's default), serving HTTP on ``host``; ``prefix`` runs it under another command, e.g.
    :attr:`~.netns.Host.prefix` (``ip netns exec NAME``) to start it inside a network namespace."""
    backend = backend or choose_backend(model, dtype or "auto")
    cmd = [*prefix, sys.executable, "-m", API_SERVER, "--model", str(model), "--host", host,
           "--port", str(port), "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0"]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if backend.requested:
        cmd += ["--attention-backend", backend.requested]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd + list(extra or [])


@dataclass(frozen=True)
class Engine:
    """A started engine: its process, base URL and the attention backend it must report."""

    proc: Proc
    url: str
    backend: BackendChoice

    def ready(self, timeout_s: float, watch: Sequence[Proc] = (), poll_s: float = 1.0) -> None:
        """Wait until healthy (failing early if it or a ``watch`` process exits), then check the backend."""
        wait_healthy(self.url, [self.proc, *watch], timeout_s, poll_s=poll_s)
        check_backend(self.proc, self.backend)


def start_engine(c: Cluster, name: str, model: Path, port: int, dtype: str | None,
                 kv_config: dict[str, Any] | None, backend: BackendChoice, env: dict[str, str],
                 extra: list[str] | None = None, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> Engine:
    """Start one ``api_server`` on ``host``:``port`` in ``c`` (see :func:`engine_cmd`; ``prefix``: e.g. inside a
    network namespace); returns at once."""
    cmd = engine_cmd(model, port, dtype, kv_config, backend=backend, extra=extra, host=host, prefix=prefix)
    return Engine(c.start(name, cmd, env), f"http://{host}:{port}", backend)


def connector_config(role: str, verify: bool, extra: dict[str, Any], side_port: int,
                     side_host: str | None = None, auth_secret: str | None = None) -> dict[str, Any]:
    """``--kv-transfer-config`` of a DSAConnector engine (side channel on ``side_port``, bound to ``side_host``
    when given, e.g. a network namespace's wire address; signed with ``auth_secret`` when given)."""
    extra_cfg: dict[str, Any] = {"verify_transfers": verify, "side_channel_port": side_port}
    if side_host is not None:
        extra_cfg["side_channel_host"] = side_host
    if auth_secret is not None:
        extra_cfg["auth_secret"] = auth_secret
    return {"kv_connector": "DSAConnector", "kv_role": role, "kv_connector_extra_config": {**extra_cfg, **extra}}


def proxy_cmd(prefill_url: str, decode_url: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """Command line of :mod:`vllm_dsa_connector.proxy.app` in front of one prefill and one decode server
    (``extra``: more of its options, e.g. ``--early-registration``)."""
    return [sys.executable, "-m", "vllm_dsa_connector.proxy.app", "--prefill", prefill_url,
            "--decode", decode_url, "--port", str(port), *extra]


#: The routers :func:`start_pair` can put in front of a pair: our embedded proxy, or vllm-router.
ROUTERS = ("pd-proxy", "vllm-router")
#: The vllm-router release the ``[router]`` extra pins (tested in tests/test_router.py).
VLLM_ROUTER_VERSION = "0.1.17"


class RouterMissing(RuntimeError):
    """vllm-router is not installed (the ``[router]`` extra)."""


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable: the one next to this Python (its virtual environment's), else the
    one on ``PATH``; None when neither exists."""
    local = Path(sys.executable).parent / "vllm-router"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("vllm-router")


def require_vllm_router() -> str:
    """The ``vllm-router`` executable, or :class:`RouterMissing` saying how to install it."""
    found = vllm_router_binary()
    if found is None:
        raise RouterMissing(f"vllm-router is not installed (neither next to {sys.executable} nor on PATH): "
                            f"pip install 'vllm-dsa-connector[router]' (vllm-router=={VLLM_ROUTER_VERSION})")
    return found


def router_cmd(prefill_url: str, decode_url: str, port: int, *, prometheus_port: int,
               host: str = "127.0.0.1", binary: str | None = None) -> list[str]:
    """Command line of vllm-router in P/D mode in front of one prefill and one decode server.

    ``--kv-connector nixl`` is vllm-router's NIXL-style exchange (prefill with ``max_tokens=1`` and
    ``kv_transfer_params={"do_remote_decode": true, ...}``, decode with P's returned params), which
    DSAConnector follows. ``prometheus_port``: the router's own metrics exporter (it otherwise binds a
    fixed default port, which two routers on one host would share).
    """
    return [binary or require_vllm_router(), "--vllm-pd-disaggregation", "--prefill", prefill_url,
            "--decode", decode_url, "--kv-connector", "nixl", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port)]


class PairUrls(NamedTuple):
    """Base URLs of a started P/D pair and its proxy."""

    prefill: str
    decode: str
    proxy: str


def pp_layer_partition(model: Path, pp: int) -> str | None:
    """``VLLM_PP_LAYER_PARTITION`` for ``pp`` stages of ``model``, or None for vLLM's even split.

    A DSA model's IndexCache layers (``indexer_types[i] == "shared"``) reuse the top-k of the layer before
    them from a per-process buffer that is not sent between stages, so every stage must start with a layer
    that computes its own top-k (``"full"``): each cut is the ``"full"`` layer nearest the even split.
    Raises ValueError when the model has too few such layers for ``pp`` stages.
    """
    if pp <= 1:
        return None
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    kinds = cfg.get("indexer_types")
    if not kinds:
        return None
    n = len(kinds)
    cuts: list[int] = []
    for k in range(1, pp):
        free = [i for i in range(1, n) if kinds[i] == "full" and i > (cuts[-1] if cuts else 0)
                and n - i >= pp - k]
        if not free:
            raise ValueError(f"{model}: indexer_types {kinds} has too few 'full' layers to start {pp} "
                             "pipeline stages")
        cuts.append(min(free, key=lambda i: (abs(i * pp - k * n), -i)))
    bounds = [0, *cuts, n]
    return ",".join(str(b - a) for a, b in zip(bounds, bounds[1:], strict=False))


@dataclass(frozen=True)
class Layout:
    """Tensor- and pipeline-parallel sizes of one engine (one OpenMP thread per rank, see :meth:`bind`)."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"engine layout tp={self.tp} pp={self.pp}: both must be >= 1")

    @property
    def world(self) -> int:
        """Number of ranks (worker processes)."""
        return self.tp * self.pp

    @property
    def label(self) -> str:
        """``tp1``, ``tp2``, ``pp2``, ``tp2pp2``."""
        if self.pp == 1:
            return f"tp{self.tp}"
        return f"pp{self.pp}" if self.tp == 1 else f"tp{self.tp}pp{self.pp}"

    def args(self) -> list[str]:
        """``api_server`` arguments of this layout (none for one rank)."""
        if self.world == 1:
            return []
        return ["--tensor-parallel-size", str(self.tp), "--pipeline-parallel-size", str(self.pp),
                "--distributed-executor-backend", "mp"]

    def bind(self, first_core: int = 0, host_ranks: int = 0) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND``: rank i on core ``first_core + i``, or :data:`NOBIND` when the
        ranks of every engine on this host (``host_ranks``, default this engine's) outnumber its cores.

        Bound ranks sharing a core cannot move to an idle one: on two cores a tp1 P and a tp2 D put two
        workers on one core while the other has one, and the P engine's processes wait there for tens of
        seconds (its side channel unanswered, its WRITE timed out); placed by the kernel, the same pairs
        pass.
        """
        ncpu = os.cpu_count() or 1
        if max(host_ranks, self.world) > ncpu:
            return NOBIND
        return "|".join(str((first_core + i) % ncpu) for i in range(self.world))

    def env(self, model: Path, first_core: int = 0, host_ranks: int = 0) -> dict[str, str]:
        """:func:`engine_env` of this layout (see :meth:`bind`), with :func:`pp_layer_partition` for pipeline
        stages."""
        env = engine_env(self.bind(first_core, host_ranks))
        env.pop("VLLM_PP_LAYER_PARTITION", None)
        partition = pp_layer_partition(model, self.pp)
        if partition:
            env["VLLM_PP_LAYER_PARTITION"] = partition
        return env


def start_pair(c: Cluster, model: Path, p_cfg: dict[str, Any], d_cfg: dict[str, Any], *, base_port: int,
               dtype: str, startup_timeout: float, attention_backend: str = "auto",
               extra_env: dict[str, dict[str, str]] | None = None, label: str = "demo",
               p_layout: Layout | None = None, d_layout: Layout | None = None,
               router: str = "pd-proxy", router_metrics_port: int | None = None,
               proxy_args: Sequence[str] = (), p_args: Sequence[str] = ()) -> PairUrls:
    """Start P (port ``base_port``, from core 0), D (``base_port + 1``, from core 1) and the router
    (``base_port + 2``); return their URLs once all are healthy and both engines run the expected attention
    backend.

    ``extra_env`` adds variables per engine (keys ``prefill``, ``decode``); ``p_layout``/``d_layout`` give
    the engines' TP/PP sizes (default one rank each). ``router`` (:data:`ROUTERS`): ``pd-proxy`` (our
    proxy, started next to the engines) or ``vllm-router`` (started once both engines are healthy, as it
    probes them at start-up; its own metrics exporter on ``router_metrics_port``, default ``base_port + 6``
    as the demo's ports go; :class:`RouterMissing` when not installed). ``proxy_args``: more options of our
    proxy (:func:`proxy_cmd`'s ``extra``, e.g. ``--early-registration``; refused with vllm-router);
    ``p_args``: more ``api_server`` arguments of P only (e.g. ``--max-num-batched-tokens N``).
    """
    if router not in ROUTERS:
        raise ValueError(f"router {router!r}: one of {', '.join(ROUTERS)}")
    if proxy_args and router != "pd-proxy":
        raise ValueError(f"proxy_args {list(proxy_args)} are options of our proxy, not of {router}")
    binary = require_vllm_router() if router == "vllm-router" else None
    x_url = f"http://127.0.0.1:{base_port + 2}"
    ncpu = os.cpu_count() or 1
    extra_env = extra_env or {}
    backend = choose_backend(model, dtype, attention_backend)
    p_layout, d_layout = p_layout or Layout(), d_layout or Layout()
    ranks = p_layout.world + d_layout.world
    p = start_engine(c, "prefill", model, base_port, dtype, p_cfg, backend,
                     {**p_layout.env(model, 0, ranks), **extra_env.get("prefill", {})},
                     extra=[*p_layout.args(), *p_args])
    d = start_engine(c, "decode", model, base_port + 1, dtype, d_cfg, backend,
                     {**d_layout.env(model, min(1, ncpu - 1), ranks), **extra_env.get("decode", {})},
                     extra=d_layout.args())
    if binary is None:
        x = c.start("proxy", proxy_cmd(p.url, d.url, base_port + 2, extra=proxy_args))
        p.ready(startup_timeout, watch=[d.proc, x])
        d.ready(startup_timeout, watch=[p.proc, x])
    else:
        p.ready(startup_timeout, watch=[d.proc])
        d.ready(startup_timeout, watch=[p.proc])
        x = c.start("router", router_cmd(p.url, d.url, base_port + 2, prometheus_port=router_metrics_port or base_port + 6,
                                         binary=binary))
    wait_healthy(x_url, [x], 60)
    if binary is not None:
        print(f"[{label}] router: vllm-router ({binary}) on {x_url}", flush=True)
    print(f"[{label}] attention backend {backend.expected} on P and D ({backend.reason})", flush=True)
    if p_layout.world > 1 or d_layout.world > 1:
        print(f"[{label}] layouts: prefill {p_layout.label}, decode {d_layout.label}", flush=True)
    return PairUrls(p.url, d.url, x_url)
