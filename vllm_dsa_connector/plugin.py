"""What the general plugin registers in every vLLM process.

Each part registers only if its module exists and vLLM offers the hook; a second call is a no-op.
Registration failures are logged, never raised: a plugin must not take a vLLM process down.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading

_LOCK = threading.Lock()
_DONE: set[str] = set()

CONNECTOR_NAME = "DSAConnector"
CONNECTOR_MODULE = "vllm_dsa_connector.connector"
CONNECTOR_CLASS = "DSAConnector"

# Each registration step: (name, module, function). Steps whose module is absent are skipped.
_STEPS: tuple[tuple[str, str, str], ...] = (
    ("vllm_version", "vllm_dsa_connector.compat", "warn_if_unsupported"),
    ("connector", "vllm_dsa_connector.plugin", "_register_connector"),
    ("tokenizer", "vllm_dsa_connector.tokenizer.registration", "register_tokenizer_mode"),
    ("runtime_fixes", "vllm_dsa_connector.fixes", "apply_runtime_fixes"),
    ("cpu_dsa", "vllm_dsa_connector.cpu_dsa.registration", "register_cpu_dsa"),
)


def runtime_fixes_disabled() -> bool:
    """``VLLM_DSA_DISABLE_RUNTIME_FIXES=1`` turns off every runtime patch of vLLM."""
    return os.environ.get("VLLM_DSA_DISABLE_RUNTIME_FIXES", "0").strip().lower() in {
        "1",
        "true",
        "yes",
    }


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if importlib.util.find_spec(CONNECTOR_MODULE) is None:
        return
    # register_connector raises if the name exists: another plugin copy or an earlier call.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)


def register() -> None:
    """Run every registration step once per process."""
    from vllm.logger import init_logger

    logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it
    with _LOCK:
        for name, module, func in _STEPS:
            if name in _DONE:
                continue
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:
                spec = None
            if spec is None:
                continue
            try:
                getattr(importlib.import_module(module), func)()
            except Exception:  # a plugin must never take the vLLM process down
                logger.exception("vllm-dsa-connector: registering %s failed", name)
                continue
            _DONE.add(name)
