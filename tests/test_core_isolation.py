"""The transfer core imports nothing from vLLM: layout's model, the planner, the transport and the handoff
(producer/consumer roles, side channel, wire structs) load in a fresh interpreter where ``import vllm``
is refused, and leave no ``vllm`` module behind. This is what lets another serving engine's adapter (an
SGLang one) reuse the core, and what the two-process check (``tests/test_core_two_process.py``) runs on
a GPU host without vLLM."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: The core is one package, walked module by module (every submodule, so a new module is covered without listing
#: it). ``connector.page_tables`` reads vLLM's specs: it is the adapter's, not the core's.
CORE_PACKAGES = ("vllm_dsa_connector.core",)
CORE_MODULES: tuple[str, ...] = ()

_PROBE = textwrap.dedent("""
    import importlib, importlib.abc, pkgutil, sys

    class RefuseVllm(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError(f"the transfer core imported {name!r}")
            return None

    sys.meta_path.insert(0, RefuseVllm())
    packages, modules = ([n for n in arg.split(",") if n] for arg in sys.argv[1:3])
    loaded = []
    for pkg in packages:
        mod = importlib.import_module(pkg)
        loaded.append(pkg)
        for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
            importlib.import_module(info.name)
            loaded.append(info.name)
    for name in modules:
        importlib.import_module(name)
        loaded.append(name)
    leaked = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    assert not leaked, f"vllm modules loaded by the core: {leaked}"
    print("\\n".join(loaded))
""")


def _probe(packages: tuple[str, ...], modules: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _PROBE, ",".join(packages), ",".join(modules)],
                          capture_output=True, text=True, timeout=300)


def test_core_imports_nothing_from_vllm() -> None:
    r = _probe(CORE_PACKAGES, CORE_MODULES)
    assert r.returncode == 0, r.stderr[-4000:]
    loaded = set(r.stdout.split())
    for name in ("vllm_dsa_connector.core.handoff.producer", "vllm_dsa_connector.core.handoff.consumer",
                 "vllm_dsa_connector.core.handoff.side_channel", "vllm_dsa_connector.core.transfer.nixl.engine",
                 *CORE_MODULES):
        assert name in loaded, f"{name} was not imported by the probe"


def test_the_probe_catches_a_vllm_import() -> None:
    """The finder really refuses: the adapter (``connector``) imports vLLM and must fail in the probe."""
    r = _probe((), ("vllm_dsa_connector.connector.metadata",))
    assert r.returncode != 0 and "the transfer core imported 'vllm" in r.stderr


def test_core_log_lines_reach_vllms_log_output() -> None:
    """Under vLLM, the adapter hands vLLM's handlers and level to the package logger: a core INFO line is
    printed where vLLM prints its own (vLLM's ``vllm`` logger does not propagate)."""
    code = textwrap.dedent("""
        import logging
        from vllm.logger import init_logger
        from vllm_dsa_connector.connector.connector import share_vllm_log_output
        try:  # vLLM >= 0.33 configures its logging when an entry point starts; older ones on import
            from vllm.config.logging import LoggingConfig
            from vllm.logger import configure_logging
            configure_logging(LoggingConfig())
        except ImportError:
            pass
        init_logger("vllm.probe").info("vllm line")
        share_vllm_log_output()
        share_vllm_log_output()  # once: no duplicate handlers
        logging.getLogger("vllm_dsa_connector.core.handoff.producer").info("core line")
    """)
    env = {**__import__("os").environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout + r.stderr
    assert "vllm line" in out and out.count("core line") == 1, out[-4000:]
    line = next(x for x in out.splitlines() if "core line" in x)
    assert "INFO" in line  # in vLLM's format
