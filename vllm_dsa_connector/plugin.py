"""What the general plugin registers in every vLLM process: one table of steps the plugin owns.

Each step is a plain function that imports its part (so a static import graph sees every dependency,
all pointing down from here) and calls its hook; a second call is a no-op. Registration failures are
logged, never raised: a plugin must not take a vLLM process down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "register",
]

_LOCK = threading.Lock()
_DONE: set[str] = set()

CONNECTOR_NAME = "DSAConnector"
CONNECTOR_MODULE = (
    "vllm_dsa_connector.connector"  # vLLM's factory imports it when a config names it
)
CONNECTOR_CLASS = "DSAConnector"


def _warn_vllm_version() -> None:
    from vllm_dsa_connector.compat import warn_if_unsupported

    warn_if_unsupported()


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # register_connector raises if the name exists: another plugin copy or an earlier call.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)


def _register_tokenizer() -> None:
    from vllm_dsa_connector.tokenizer.registration import register_tokenizer_mode

    register_tokenizer_mode()


def _apply_runtime_fixes() -> None:
    from vllm_dsa_connector.fixes import apply_runtime_fixes

    apply_runtime_fixes()


def _register_cpu_dsa() -> None:
    from vllm_dsa_connector.cpu_dsa.registration import register_cpu_dsa

    register_cpu_dsa()


#: The registration steps, in order: (name, step).
STEPS: tuple[tuple[str, Callable[[], None]], ...] = (
    ("vllm_version", _warn_vllm_version),
    ("connector", _register_connector),
    ("tokenizer", _register_tokenizer),
    ("runtime_fixes", _apply_runtime_fixes),
    ("cpu_dsa", _register_cpu_dsa),
)


def register() -> None:
    """Run every registration step once per process."""
    from vllm.logger import init_logger

    logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it
    with _LOCK:
        for name, step in STEPS:
            if name in _DONE:
                continue
            try:
                step()
            except Exception:  # a plugin must never take the vLLM process down
                logger.exception("vllm-dsa-connector: registering %s failed", name)
                continue
            _DONE.add(name)
