"""Register the ``dsa-prefix-cache`` tokenizer mode with vLLM (called by the general plugin in every process).

The tokenizer entry loads the base mode's tokenizer and wraps it; the renderer entry returns the base mode's
renderer (see :mod:`.modes`).
"""

from __future__ import annotations

from vllm_dsa_connector.tokenizer.wrapper import MODE

TOKENIZER_ENTRY = ("vllm_dsa_connector.tokenizer.wrapper", "DSAPrefixCacheTokenizer")
RENDERER_ENTRY = ("vllm_dsa_connector.tokenizer.modes", "prefix_cache_renderer")


def register_tokenizer_mode() -> None:
    """Add the mode to vLLM's TokenizerRegistry and RENDERER_REGISTRY; a second call changes nothing."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if TokenizerRegistry.tokenizers.get(MODE) != TOKENIZER_ENTRY:
        TokenizerRegistry.register(MODE, *TOKENIZER_ENTRY)
    if RENDERER_REGISTRY.renderers.get(MODE) != RENDERER_ENTRY:
        RENDERER_REGISTRY.register(MODE, *RENDERER_ENTRY)
