"""Which vLLM tokenizer mode ``--tokenizer-mode dsa-prefix-cache`` wraps, and the renderer it serves with.

vLLM picks a tokenizer mode per model: ``auto`` becomes e.g. ``deepseek_v32`` for ``DeepseekV32ForCausalLM``
(``ModelConfig``), and ``hf`` or ``mistral`` otherwise (``resolve_tokenizer_args``). A mode names both the
tokenizer class (``TokenizerRegistry``) and the renderer (``RENDERER_REGISTRY``), and the two together make the
prompt: DeepSeek-V3.2's mode encodes chats with DeepSeek's own Python encoding, not a Jinja template. The prefix
cache must therefore keep the *base mode* whole and change only its text -> ids step:

- the base mode is ``VLLM_DSA_TOKCACHE_BASE_MODE`` when set, else what vLLM's own ``ModelConfig`` resolves
  ``auto`` to for the model (built for the tokenizer's directory; ``auto`` left by it goes through vLLM's
  ``resolve_tokenizer_args`` like every stock load);
- the tokenizer is the one vLLM's ``get_tokenizer`` loads for the base mode, wrapped by
  :func:`~vllm_dsa_connector.tokenizer.wrapper.wrap_tokenizer` (a subclass: its chat encoding, special tokens
  and every other method stay the base mode's; single-text encodes go through the cache);
- the renderer is the base mode's, from ``RENDERER_REGISTRY`` (:func:`prefix_cache_renderer`).

Refused at start-up with a :class:`ModeError` naming the mode (never served without the cache or with another
mode's encoding): the modes in :data:`REFUSED`, unregistered modes, a base tokenizer that is not a transformers
fast tokenizer, one whose single-text encode path is overridden outside transformers (it would change ids in
Python, where the cache runs the Rust backend only), one whose Rust backend disagrees with its Python path on
probe texts, and a renderer whose model architecture is not the one ``auto`` was resolved for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from vllm_dsa_connector.options import option, resolve_options

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

MODE = "dsa-prefix-cache"
BASE_MODE_ENV = "VLLM_DSA_TOKCACHE_BASE_MODE"

REFUSED: dict[str, str] = {
    "mistral": "its tokenizer is mistral_common's, not a transformers fast tokenizer",
    "kimi_audio": "its tokenizer is a tiktoken-based class, not a transformers fast tokenizer",
    "terratorch": "it serves no text tokenizer",
    MODE: "it is this mode itself",
}

# transformers' single-text encode path: a class outside transformers overriding one of these changes ids in
# Python, which the cache (Rust backend only) would not reproduce.
ENCODE_PATH = ("__call__", "_call_one", "encode", "encode_plus", "_encode_plus", "prepare_for_tokenization")


class ModeError(ValueError):
    """The base mode cannot be wrapped (raised at start-up; the message names the mode and the reason)."""


@dataclass(frozen=True)
class BaseMode:
    """The vLLM mode a ``dsa-prefix-cache`` tokenizer wraps."""

    mode: str  # registered in TokenizerRegistry and RENDERER_REGISTRY; never "auto"
    requested: str  # "auto" or the value of VLLM_DSA_TOKCACHE_BASE_MODE
    architecture: str | None = None  # the architecture "auto" was resolved for (None when named)

    def describe(self) -> str:
        if self.requested == "auto":
            return f"{self.mode!r} (auto for {self.architecture or 'the model'})"
        return f"{self.mode!r} ({BASE_MODE_ENV})"


def _registered() -> tuple[dict[str, Any], dict[str, Any]]:
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    return TokenizerRegistry.tokenizers, RENDERER_REGISTRY.renderers


def check_mode(mode: str) -> None:
    """ModeError unless ``mode`` is a registered mode this wrapper may wrap."""
    if mode in REFUSED:
        hint = "" if mode == MODE else f"; serve it with --tokenizer-mode {mode} (no prefix cache)"
        raise ModeError(f"--tokenizer-mode {MODE} cannot wrap tokenizer mode {mode!r}: {REFUSED[mode]}{hint}")
    tokenizers, renderers = _registered()
    if mode not in tokenizers or mode not in renderers:
        known = sorted((set(tokenizers) & set(renderers)) - set(REFUSED))
        raise ModeError(
            f"--tokenizer-mode {MODE}: base mode {mode!r} is not a registered vLLM tokenizer mode with a "
            f"renderer (wrappable: {', '.join(known)})"
        )


def _parse_mode(key: str, value: Any) -> str:
    return str(value).strip().lower() or "auto"


@dataclass(frozen=True)
class BaseModeSettings:
    """The requested base mode (environment only); a mode this wrapper may not wrap is refused when resolved."""

    requested: str = option(
        "tokcache_base_mode", _parse_mode, "auto", env=BASE_MODE_ENV, env_only=True,
        doc=f"the vLLM tokenizer mode `--tokenizer-mode {MODE}` wraps (lower-cased); `auto`: what vLLM "
            "resolves `auto` to for the model",
    )

    def validate_options(self) -> None:
        """ModeError naming the variable and the value unless the mode is ``auto`` or one that may be wrapped."""
        if self.requested != "auto":
            try:
                check_mode(self.requested)
            except ModeError as e:
                raise ModeError(f"{BASE_MODE_ENV}={self.requested!r}: {e}") from None


def requested_base_mode(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DSA_TOKCACHE_BASE_MODE`` (lower-cased, like vLLM's ``--tokenizer-mode``), default ``auto``."""
    return resolve_options(BaseModeSettings, None, environ, where=f"--tokenizer-mode {MODE}").requested


def auto_mode(model: str | Path, *, trust_remote_code: bool = False, revision: str | None = None,
              hf_overrides: Any = None) -> tuple[str, str]:
    """What vLLM's ``ModelConfig`` resolves ``tokenizer_mode="auto"`` to for ``model``, and its architecture.

    The result may still be ``auto`` (vLLM's tokenizer loader then picks ``mistral`` or ``hf``).
    """
    from vllm.config import ModelConfig

    kw: dict[str, Any] = {"hf_overrides": hf_overrides} if hf_overrides else {}
    try:
        config = ModelConfig(model=str(model), tokenizer_mode="auto", trust_remote_code=trust_remote_code,
                             revision=revision, **kw)
    except Exception as e:  # noqa: BLE001 - any failure means the mode cannot be told: refuse, naming it
        raise ModeError(
            f"--tokenizer-mode {MODE}: cannot tell which tokenizer mode 'auto' is for {model} "
            f"({type(e).__name__}: {e}); name it with {BASE_MODE_ENV}=<mode>"
        ) from e
    return str(config.tokenizer_mode), str(config.architecture)


def resolve_base_mode(model: str | Path, *, environ: Mapping[str, str] | None = None,
                      trust_remote_code: bool = False, revision: str | None = None,
                      hf_overrides: Any = None) -> BaseMode:
    """The base mode for ``model`` (ModeError when it is not one this wrapper may wrap)."""
    requested = requested_base_mode(environ)
    mode, arch = requested, None
    if requested == "auto":
        mode, arch = auto_mode(model, trust_remote_code=trust_remote_code, revision=revision,
                               hf_overrides=hf_overrides)
    if mode == "auto":
        from vllm.tokenizers.registry import resolve_tokenizer_args

        mode = resolve_tokenizer_args(str(model), tokenizer_mode="auto", revision=revision,
                                      trust_remote_code=trust_remote_code)[0]
    check_mode(mode)
    return BaseMode(mode, requested, arch)


def check_tokenizer(tokenizer: Any, base: BaseMode) -> None:
    """ModeError unless the base mode's tokenizer is a transformers fast tokenizer whose single-text encode
    path is transformers' own (vLLM's mode classes only add chat encoding and cached properties)."""
    name = type(tokenizer).__name__
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise ModeError(
            f"--tokenizer-mode {MODE} cannot wrap tokenizer mode {base.mode!r}: it loaded {name}, not a "
            f"transformers fast tokenizer; serve it with --tokenizer-mode {base.mode} (no prefix cache)"
        )
    for cls in type(tokenizer).__mro__:
        module = cls.__module__
        if cls is object or module == "transformers" or module.startswith("transformers."):
            continue
        overridden = [m for m in ENCODE_PATH if m in cls.__dict__]
        if overridden:
            raise ModeError(
                f"--tokenizer-mode {MODE} cannot wrap tokenizer mode {base.mode!r}: {module}.{cls.__qualname__} "
                f"overrides {', '.join(overridden)} (text -> ids in Python, which the cache would bypass); "
                f"serve it with --tokenizer-mode {base.mode} (no prefix cache)"
            )


def prefix_cache_renderer(config: Any, tokenizer: Any) -> Any:
    """``RENDERER_REGISTRY`` entry of ``dsa-prefix-cache``: the base mode's own renderer over the wrapped tokenizer.

    ``RendererRegistry.load_renderer`` calls its entry with ``(config, tokenizer)``; this returns the renderer
    of the mode the tokenizer wraps, so chat rendering is that mode's and only text -> ids is cached.
    """
    from vllm.renderers.registry import RENDERER_REGISTRY

    mc = config.model_config
    arch = str(getattr(mc, "architecture", None) or "")
    base: Any
    if tokenizer is None:  # skip_tokenizer_init: nothing to cache, but keep the model's renderer
        base = resolve_base_mode(mc.model, trust_remote_code=mc.trust_remote_code, revision=mc.revision,
                                 hf_overrides=getattr(mc, "hf_overrides", None))
    else:
        base = getattr(tokenizer, "_dsa_base", None)
        if not isinstance(base, BaseMode):
            raise ModeError(f"--tokenizer-mode {MODE}: the renderer got a {type(tokenizer).__name__} that this "
                            "mode did not load")
    if base.architecture is not None and arch and base.architecture != arch:
        raise ModeError(
            f"--tokenizer-mode {MODE}: 'auto' was resolved to {base.mode!r} for {base.architecture} (the "
            f"tokenizer's directory) but the model is {arch}; name the base mode with {BASE_MODE_ENV}=<mode>"
        )
    check_mode(base.mode)
    renderer = RENDERER_REGISTRY.load_renderer(base.mode, config, tokenizer)
    logger.info("DSA prefix token cache: renderer %s of tokenizer mode %s", type(renderer).__name__,
                base.describe())
    return renderer
