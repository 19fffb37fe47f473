"""The ``dsa-prefix-cache`` tokenizer mode: a vLLM mode's tokenizer with prompt encoding through a PrefixTokenCache.

:func:`wrap_tokenizer` returns a copy of a transformers fast tokenizer whose class is a subclass of the original
one (so every ``isinstance`` check, chat template and vLLM's thread pool keep working) with ``__call__`` and
``encode`` routed through the cache when the call is a plain single-text encode. ``add_special_tokens`` is
handled by adding the fixed prefix/suffix ids that the tokenizer's post-processor adds (derived once, only for
post-processors that add constant tokens); truncation that would cut, pairs, batches, offsets, tensors and
padding go to the original implementation. Copies of the tokenizer (vLLM deep-copies it per worker thread)
share one cache. Stats are logged every ``log_interval_s`` seconds.

:class:`DSAPrefixCacheTokenizer` (the vLLM TokenizerRegistry entry) wraps the tokenizer of the *base mode*
(the mode vLLM would use for the model, or ``VLLM_DSA_TOKCACHE_BASE_MODE``; see :mod:`.modes`), so the base
mode's chat encoding and renderer stay in charge and only text -> ids goes through the cache.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from vllm_dsa_connector.tokenizer.cache import PrefixTokenCache
from vllm_dsa_connector.tokenizer.modes import (
    MODE,
    BaseMode,
    ModeError,
    check_tokenizer,
    resolve_base_mode,
)

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

_CONSTANT_POSTPROCESSORS = {"ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"}
_PROBES = ("a", "Hello world", "x\n\ny  z", "é1")
# kwargs of __call__ that keep the cached path when they have these (default) values
_BENIGN: dict[str, tuple[Any, ...]] = {
    "return_tensors": (None,),
    "padding": (False, None, "do_not_pad"),
    "return_offsets_mapping": (False, None),
    "return_attention_mask": (None, True),
    "return_token_type_ids": (None,),
    "return_overflowing_tokens": (False,),
    "return_special_tokens_mask": (False,),
    "return_length": (False,),
    "is_split_into_words": (False,),
    "stride": (0,),
    "pad_to_multiple_of": (None,),
    "padding_side": (None,),
    "split_special_tokens": (None,),
    "verbose": (True, False),
    "text_target": (None,),
    "text_pair_target": (None,),
    "tokenizer_kwargs": (None,),
}
_KNOWN = {"add_special_tokens", "truncation", "max_length"}  # handled by the cached path


def _postprocessor_is_constant(desc: Any) -> bool:
    if desc is None:
        return True
    if desc.get("type") == "Sequence":
        return all(_postprocessor_is_constant(d) for d in desc.get("processors", []))
    return desc.get("type") in _CONSTANT_POSTPROCESSORS


def _special_affixes(base_cls: type, tok: Any) -> tuple[list[int], list[int]] | None:
    """The ids ``add_special_tokens=True`` puts before/after a single text, when they are constant."""
    pp = tok.backend_tokenizer.post_processor
    try:
        desc = json.loads(pp.__getstate__()) if pp is not None else None
    except (TypeError, ValueError):
        return None
    if not _postprocessor_is_constant(desc):
        return None
    found: tuple[list[int], list[int]] | None = None
    for probe in _PROBES:
        with_sp = base_cls.__call__(tok, probe, add_special_tokens=True)["input_ids"]
        plain = base_cls.__call__(tok, probe, add_special_tokens=False)["input_ids"]
        extra = len(with_sp) - len(plain)
        if extra < 0:
            return None
        splits = [(with_sp[:i], with_sp[i + len(plain):]) for i in range(extra + 1)
                  if with_sp[i:i + len(plain)] == plain]
        if found is None:
            if len(splits) != 1:
                return None
            found = splits[0]
        elif found not in splits:
            return None
    return found


def _backend_path_agrees(base_cls: type, tok: Any) -> bool:
    """Whether the Rust backend alone (what the cache runs) gives transformers' ids for some probes.

    A tokenizer class that pre-processes text in Python would differ: then the wrapper never uses the cache.
    """
    backend = tok.backend_tokenizer
    probes = (*_PROBES, "  two  spaces\n\tand tabs", "CAPS & ünïcödé 中文 123,456",
              *(f"{t}x{t}" for t in list(getattr(tok, "all_special_tokens", []))[:4]))
    for probe in probes:
        expected = base_cls.__call__(tok, probe, add_special_tokens=False)["input_ids"]
        if backend.encode(probe, add_special_tokens=False).ids != expected:
            logger.warning("%s: %s pre-processes text outside its Rust backend; prefix cache not used",
                           MODE, base_cls.__name__)
            return False
    return True


def _truncation_limit(tok: Any, truncation: Any, max_length: int | None) -> int | None:
    """The length above which transformers would truncate (None: it never does)."""
    if truncation in (False, "do_not_truncate"):
        return None
    if truncation is None:
        return max_length
    if max_length is not None:
        return max_length
    limit = getattr(tok, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 1 << 40 else None


def _make_class(base_cls: type) -> type:
    class DSAPrefixCacheTokenizer(base_cls):  # type: ignore[misc, valid-type]
        def _dsa_ids(self, text: str, kwargs: dict[str, Any]) -> list[int] | None:
            """The ids of the cached path, or None when the original implementation must run."""
            add_special_tokens = kwargs.get("add_special_tokens", True)
            if add_special_tokens and self._dsa_affixes is None:
                return None
            ids = self._dsa_cache.encode(text)
            if add_special_tokens and (self._dsa_affixes[0] or self._dsa_affixes[1]):
                ids = self._dsa_affixes[0] + ids + self._dsa_affixes[1]
            limit = _truncation_limit(self, kwargs.get("truncation"), kwargs.get("max_length"))
            if limit is not None and len(ids) > limit:
                return None
            self._dsa_cache.log_if_due()
            return ids

        def __call__(self, text: Any = None, text_pair: Any = None, *args: Any, **kwargs: Any) -> Any:
            # Same positional order as transformers (text, text_pair, text_target, ...): any further
            # positional argument goes to the original implementation untouched.
            if (self._dsa_agrees and not args and isinstance(text, str) and text_pair is None
                    and all(k in _KNOWN or (k in _BENIGN and v in _BENIGN[k]) for k, v in kwargs.items())):
                ids = self._dsa_ids(text, kwargs)
                if ids is not None:
                    from transformers import BatchEncoding

                    data: dict[str, list[int]] = {"input_ids": ids}
                    names = self.model_input_names
                    if "token_type_ids" in names:
                        data["token_type_ids"] = [0] * len(ids)
                    if "attention_mask" in names:
                        data["attention_mask"] = [1] * len(ids)
                    return BatchEncoding(data)
            return super().__call__(text, text_pair, *args, **kwargs)

        def encode(self, text: Any, text_pair: Any = None, *args: Any, **kwargs: Any) -> Any:
            # The path of vLLM's chat encodings (DeepSeek V3.2/V4 modes: encode(prompt, add_special_tokens=False)):
            # ids straight from the cache, no BatchEncoding.
            if (self._dsa_agrees and not args and isinstance(text, str) and text_pair is None
                    and set(kwargs) <= {"add_special_tokens", "truncation", "max_length", "padding"}
                    and kwargs.get("padding", False) in (False, None)):
                ids = self._dsa_ids(text, kwargs)
                if ids is not None:
                    return ids
            return super().encode(text, text_pair, *args, **kwargs)

        @property
        def prefix_cache(self) -> PrefixTokenCache:
            """The shared :class:`PrefixTokenCache`."""
            return self._dsa_cache

        def __copy__(self) -> Any:  # plain attribute copy; the cache object is shared
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__)
            return new

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:  # PrefixTokenCache.__deepcopy__ shares it
            new = object.__new__(type(self))
            memo[id(self)] = new
            for key, value in self.__dict__.items():
                new.__dict__[key] = copy.deepcopy(value, memo)
            return new

        def __reduce__(self) -> Any:  # pickling: the plain tokenizer plus the options, re-wrapped on load
            base: Any = object.__new__(base_cls)
            base.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_dsa_")})
            return _rewrap, (base, self._dsa_cache.options, self._dsa_base)

    DSAPrefixCacheTokenizer.__name__ = f"DSAPrefixCache{base_cls.__name__}"
    DSAPrefixCacheTokenizer.__qualname__ = DSAPrefixCacheTokenizer.__name__
    return DSAPrefixCacheTokenizer


def _rewrap(base: Any, options: Any, base_mode: BaseMode | None = None) -> Any:
    from dataclasses import asdict

    return wrap_tokenizer(base, base_mode=base_mode, **asdict(options))


def wrap_tokenizer(tokenizer: Any, *, environ: Any = None, base_mode: BaseMode | None = None,
                   **options: Any) -> Any:
    """A copy of ``tokenizer`` whose single-text encodes go through a new :class:`PrefixTokenCache`.

    ``base_mode``: the vLLM tokenizer mode ``tokenizer`` was loaded with (kept on the copy for the renderer).
    """
    base_cls = type(tokenizer)
    cache = PrefixTokenCache(tokenizer, environ=environ, **options)
    wrapped = copy.copy(tokenizer)
    wrapped.__class__ = _make_class(base_cls)
    wrapped._dsa_cache = cache
    wrapped._dsa_affixes = _special_affixes(base_cls, tokenizer)
    wrapped._dsa_agrees = _backend_path_agrees(base_cls, tokenizer)
    wrapped._dsa_base = base_mode
    cache.tokenizer = wrapped  # fingerprint the tokenizer that is served (shares the backend)
    s = cache.stats()
    logger.info(
        "DSA prefix token cache on %s: enabled=%s anchors=%d line_cuts=%s specials=%s options=%s",
        base_cls.__name__, s["enabled"] and wrapped._dsa_agrees, s["anchors"], s["line_cuts"],
        "constant" if wrapped._dsa_affixes is not None else "fallback", cache.options,
    )
    return wrapped


class DSAPrefixCacheTokenizer:
    """vLLM TokenizerRegistry entry for ``--tokenizer-mode dsa-prefix-cache``.

    Loads the tokenizer exactly like the base mode (vLLM's ``get_tokenizer`` with that mode, see
    :func:`~vllm_dsa_connector.tokenizer.modes.resolve_base_mode`) and wraps it; a base mode or tokenizer that
    cannot be wrapped raises :class:`~vllm_dsa_connector.tokenizer.modes.ModeError` naming it. Cache options
    come from the environment (``VLLM_DSA_TOKCACHE_*``, see :class:`~vllm_dsa_connector.tokenizer.CacheOptions`).
    """

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | Path, *args: Any, **kwargs: Any) -> Any:
        from vllm.tokenizers.registry import get_tokenizer

        base_mode = resolve_base_mode(
            path_or_repo_id, environ=os.environ, trust_remote_code=bool(kwargs.get("trust_remote_code")),
            revision=kwargs.get("revision"),
        )
        base = get_tokenizer(path_or_repo_id, *args, tokenizer_mode=base_mode.mode, **kwargs)
        check_tokenizer(base, base_mode)
        wrapped = wrap_tokenizer(base, environ=os.environ, base_mode=base_mode)
        if not wrapped._dsa_agrees:
            raise ModeError(
                f"--tokenizer-mode {MODE} cannot wrap tokenizer mode {base_mode.mode!r}: "
                f"{type(base).__name__} gives other ids than its Rust backend on probe texts; serve it with "
                f"--tokenizer-mode {base_mode.mode} (no prefix cache)"
            )
        logger.info("DSA prefix token cache: --tokenizer-mode %s wraps tokenizer mode %s: %s", MODE,
                    base_mode.describe(), type(base).__name__)
        return wrapped
