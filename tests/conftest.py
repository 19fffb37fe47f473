"""Shared fixtures and helpers: tiny models made locally (cached across runs), free ports, processes left on ports."""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_mla_dir() -> Path:
    """The tiny random DeepSeek-V2 MLA model (made once, cached under VLLM_DSA_MODEL_DIR or ~/.cache)."""
    from vllm_dsa_dev.tiny_models import make_tiny_mla

    return make_tiny_mla()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their source port there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, picked below the ephemeral range and above the fixed bases
    tests use (22300-25500): an engine binds it seconds later, and a port from the ephemeral range could be
    taken meanwhile as the source port of any outgoing connection on the host (CI saw an engine's side
    channel fail with "Address already in use")."""
    top = min(32700, _ephemeral_low())
    for _ in range(500):
        candidate = random.randrange(26000, top) if top > 26000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("free_port: no free port found")


@pytest.fixture
def port() -> int:
    return free_port()


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def processes_on_ports(base: int, span: int) -> list[str]:
    """Live processes whose command line names a port in ``base .. base + span - 1`` (engines, proxies)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(f"--port {base + i}" in cmd for i in range(span)) or f":{base}" in cmd:
            out.append(f"{pid}: {cmd[:120]}")
    return out


def fake_page_table(num_blocks: int = 512, *, block_size: int = 0):
    """A handshake payload's page table (``core.plan.PageTable``) with one pool of ``num_blocks`` blocks and
    nothing else, for tests whose transfer plan is faked (``block_size`` 0: not published)."""
    from vllm_dsa_connector.core.plan.pages import ModelId, PageTable, Pool

    model = ModelId("fake", 1, 0, 0, 0, 0, 0, 0, None, ())
    return PageTable(0, 0, 1, 0, 1, block_size, "auto", model, (), (Pool(0, 0, 0, num_blocks),))


def load_module_from_file(path: Path, name: str) -> types.ModuleType:
    """Execute the Python file ``path`` as a module named ``name`` (e.g. a patched copy of a vLLM file).

    The module is in ``sys.modules`` while it executes (dataclasses resolve annotations through
    it) and removed afterwards, so the temporary name never shadows anything (``inspect.getfile``
    of its classes then fails: a caller that needs it keeps its own ``sys.modules`` entry).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path} as module {name!r}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def check_conversation_exact(tok: Any, kind: str, options: dict[str, Any], seed: int,
                             check: Callable[[Any], None]) -> None:
    """A ``kind`` conversation of ``vllm_dsa_dev.tokenizer.workloads.requests`` (12k-character turns, 6 of them) through one
    ``PrefixTokenCache(tok, **options)``: every text it encodes (the workload's counts and each prompt) equals a
    full encode, nearly all are hits, none a mismatch, and what is re-tokenized stays a small tail (from the
    last anchor, not the start). ``check(req)``: the workload's own checks of each request."""
    from vllm_dsa_dev.tokenizer.workloads import requests

    from vllm_dsa_connector.tokenizer import PrefixTokenCache

    cache = PrefixTokenCache(tok, **options)
    checked = 0

    def count(text: str) -> int:
        nonlocal checked
        got = cache.encode(text)
        assert got == tok(text, add_special_tokens=False)["input_ids"]
        checked += 1
        return len(got)

    for req in requests(kind, 12_000, 6, count, seed=seed):
        assert count(req.text) > 0
        check(req)
    s = cache.stats()
    assert checked > 10 and s["hits"] >= checked - 3 and s["mismatches"] == 0
    assert s["tail_tokens"] < s["reused_tokens"] / 4  # re-tokenized from the last anchor, not the start


_MODULE_SECONDS: dict[str, float] = {}


_NOISE = ("failed to automatically increase", "Unknown vLLM environment variable", "is not found in LD_PRELOAD",
          "Triton is not installed", "Model Runner V2 requires Triton", "Enforce eager set",
          "Initializing KVConnectorBase_V1", "SECURITY WARNING", "No DeepseekV2MoE layer",
          "has no dense-MHA prefill path", "Reset SSM cache type")


def key_log_lines(text: str, keep: int) -> list[str]:
    """At most ``keep`` lines of an engine log that say what went wrong: errors, tracebacks, the connector's
    warnings (start-up noise left out), each cut to 300 characters: the first ones of the engine's own
    processes (the root cause), then the last ones."""
    hits = [x for x in text.splitlines()
            if ("ERROR" in x or "Traceback" in x or "Error:" in x or ("WARNING" in x and "DSAConnector" in x))
            and not any(n in x for n in _NOISE)]
    # the first hits of an engine process (EngineCore, a worker) are the root cause; the API server's
    # traceback of the dead engine comes last and would push them out
    first = [x for x in hits if "APIServer" not in x][: keep // 2]
    rest = keep - len(first)
    last = [x for x in hits if x not in first][-rest:] if rest > 0 else []
    return [x[:300] for x in first + last]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration (setup, call, teardown) to its module's total; with ``VLLM_DSA_TEST_DIAG``
    set (``ci/test.sh`` sets it), append a failed test's exception line, the last lines it printed and the
    key lines of every running engine's log to that file, which CI prints last, where a truncated CI log
    still shows it."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    diag = os.environ.get("VLLM_DSA_TEST_DIAG")
    if diag and report.failed:
        from vllm_dsa_dev.harness.procs import running_procs

        crash = getattr(report.longrepr, "reprcrash", None)
        lines = [f"=== {report.nodeid} ({report.when}): {crash.message if crash else ''}"[:1000]]
        for proc in running_procs():
            try:
                text = proc.log.read_text(errors="replace")
            except OSError:
                continue
            hits = key_log_lines(text, 12)
            if hits:
                lines.append(f"--- {proc.name} ({proc.log.name}), key lines:")
                lines.extend("  " + x for x in hits)
        for name, text in report.sections:
            if "stdout" in name or "stderr" in name:
                lines.append(f"--- {name}, last lines")
                lines.extend(x[:300] for x in text.splitlines()[-25:])
        with open(diag, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per test module, slowest first (module-scoped engines count where they start), when more
    than one module ran: where CI time goes (``ci/test.sh`` prints this for each shard)."""
    if len(_MODULE_SECONDS) < 2:
        return
    terminalreporter.write_sep("=", "seconds per test module")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
