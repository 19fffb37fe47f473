"""Exact prefix token cache for multi-turn prompts, and the ``dsa-prefix-cache`` vLLM tokenizer mode.

``PrefixTokenCache(tokenizer, **options).encode(text)`` equals
``tokenizer(text, add_special_tokens=False)["input_ids"]`` for every text, re-tokenizing only the tail after
the longest prefix shared with a cached text (restarting at a cut proved exact, see :mod:`.analysis`).
"""

from vllm_dsa_connector.tokenizer.cache import PrefixTokenCache
from vllm_dsa_connector.tokenizer.options import CacheOptions

__all__ = ["CacheOptions", "PrefixTokenCache", "wrap_tokenizer"]


def wrap_tokenizer(tokenizer, **options):  # noqa: ANN001, ANN201 - lazy re-export (imports vLLM's logger)
    """See :func:`vllm_dsa_connector.tokenizer.wrapper.wrap_tokenizer`."""
    from vllm_dsa_connector.tokenizer.wrapper import wrap_tokenizer as _wrap

    return _wrap(tokenizer, **options)
