"""vllm-dsa-connector: disaggregated prefill/decode for DeepSeek-Sparse-Attention models on vLLM.

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in every process.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]


def register() -> None:
    """vLLM general-plugin entry point (idempotent, never raises on a repeat call)."""
    from vllm_dsa_connector.plugin import register as _register

    _register()
