"""Runtime fix: vLLM's DeepGEMM MQA-logits wrappers over a DeepGEMM with the newer kernel API.

The DSA indexer scores every query token against the cached indexer keys with DeepGEMM's
``fp8_fp4_mqa_logits`` (prefill, keys gathered per chunk) and ``fp8_fp4_paged_mqa_logits`` (decode,
keys read from the paged cache). vLLM's wrappers in ``vllm.utils.deep_gemm`` pass the kernel arguments
through, so a vLLM and a DeepGEMM that disagree on the kernel API kill the engine on its first prefill.
Two APIs exist:

* older (what vLLM 0.32's wrappers call): ``fp8_fp4_mqa_logits(q, kv, weights, ks, ke,
  clean_logits=)`` returns ``[M, N]`` logits, column ``j`` = key ``j``, valid on ``[ks[i], ke[i])``;
  the paged kernel takes ``clean_logits=`` too;
* newer (DeepGEMM as shipped with vLLM 0.33, the only build whose binary loads on torch's stable ABI
  without vLLM's own torch): ``fp8_fp4_mqa_logits(q, kv, weights, ks, ke, max_seqlen_k,
  schedule_meta=None)`` returns COMPRESSED logits ``[M, max_seqlen_k]`` where row ``i`` starts at key
  ``ks[i]`` in column 0 (tail not cleaned); the paged kernel has no ``clean_logits`` (columns past each
  row's context length are not cleaned).

The fix (applied when vLLM's wrapper takes ``clean_logits`` and the DeepGEMM it resolves takes
``max_seqlen_k``, decided from the two signatures, never from version numbers) wraps vLLM's
``_lazy_init`` (where the wrappers resolve the kernels): after vLLM resolved them, the two kernel
handles are replaced by adapters that speak the older API over the newer kernels:

* prefill: ``max_seqlen_k`` is the number of keys ``N`` (an upper bound on ``ke - ks`` known from the
  shape, so no host sync and nothing that breaks CUDA graph capture), and the compressed rows are put
  back at their key columns by :func:`expand_compressed_logits` (one ``gather`` and one ``masked_fill``;
  columns outside ``[ks, ke)`` are ``-inf``, which is what ``clean_logits=True`` asks for and what the
  top-k kernel never reads otherwise). It costs an int64 ``[M, N]`` index beside the logits: an
  interoperability path for this combination of builds, not a production one (a matching vLLM +
  DeepGEMM pair needs no fix and gets none).
* decode: ``clean_logits`` is dropped (and applied by masking columns ``>= context_len`` when asked).

vLLM without DeepGEMM (the CPU build) never calls the kernels; the wrapper is still installed there
(nothing is imported or resolved until vLLM itself calls ``_lazy_init``), so the report is the same
everywhere. ``dev/bench/gpu_pd.py`` checks the adapted prefill logits against a torch reference on the GPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

FIX_NAME = "deep-gemm-mqa-logits-api"
MODULE = "vllm.utils.deep_gemm"
_MARK = "__vllm_dsa_fix__"
_PREFILL_IMPL = "_fp8_fp4_mqa_logits_impl"
_PAGED_IMPL = "_fp8_fp4_paged_mqa_logits_impl"

__all__ = [
    "FIX_NAME",
    "adapt_paged_kernel",
    "adapt_prefill_kernel",
    "caller_takes_clean_logits",
    "expand_compressed_logits",
    "install",
    "is_installed",
    "kernel_takes_max_seqlen_k",
    "uninstall",
]


def _params(fn: Callable[..., Any]) -> set[str] | None:
    """Parameter names of ``fn``, or None when Python cannot tell (a C function without a signature)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def caller_takes_clean_logits(module: Any) -> bool:
    """Whether vLLM's wrapper ``module.fp8_fp4_mqa_logits`` speaks the older API (``clean_logits=``)."""
    names = _params(getattr(module, "fp8_fp4_mqa_logits", None) or (lambda: None))
    return bool(names and "clean_logits" in names)


def kernel_takes_max_seqlen_k(kernel: Callable[..., Any] | None) -> bool:
    """Whether a resolved DeepGEMM prefill kernel speaks the newer API (``max_seqlen_k``, compressed rows)."""
    if kernel is None:
        return False
    names = _params(kernel)
    return bool(names and "max_seqlen_k" in names and "clean_logits" not in names)


def expand_compressed_logits(
    compressed: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, num_keys: int
) -> torch.Tensor:
    """``[M, W]`` rows whose column 0 is key ``ks[i]`` -> ``[M, num_keys]`` with key ``j`` in column ``j``.

    Columns outside ``[ks[i], min(ke[i], ks[i] + W))`` are ``-inf``. Pure index ops on the tensors'
    device (int64 indices), no host sync.
    """
    m, width = compressed.shape
    if m == 0 or num_keys == 0 or width == 0:
        return torch.full(
            (m, num_keys), float("-inf"), dtype=compressed.dtype, device=compressed.device
        )
    cols = torch.arange(num_keys, device=compressed.device, dtype=torch.int64)
    start = ks.to(torch.int64).view(-1, 1)
    rel = cols.view(1, -1) - start
    valid = (rel >= 0) & (rel < width) & (cols.view(1, -1) < ke.to(torch.int64).view(-1, 1))
    out = torch.gather(compressed, 1, rel.clamp_(0, width - 1))
    return out.masked_fill_(~valid, float("-inf"))


def adapt_prefill_kernel(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The older prefill API (``clean_logits=``, ``[M, N]`` logits) over a newer-API ``kernel``."""

    def fp8_fp4_mqa_logits(
        q: Any,
        kv: Any,
        weights: torch.Tensor,
        cu_seqlen_ks: torch.Tensor,
        cu_seqlen_ke: torch.Tensor,
        clean_logits: bool = False,
    ) -> torch.Tensor:
        num_keys = int(kv[0].shape[0])
        compressed = kernel(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, num_keys)
        return expand_compressed_logits(compressed.float(), cu_seqlen_ks, cu_seqlen_ke, num_keys)

    setattr(fp8_fp4_mqa_logits, _MARK, kernel)
    return fp8_fp4_mqa_logits


def adapt_paged_kernel(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The older paged API (``clean_logits=``) over a newer-API paged ``kernel`` (same output layout)."""

    def fp8_fp4_paged_mqa_logits(
        q: Any,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        schedule_metadata: torch.Tensor,
        max_model_len: int,
        clean_logits: bool = False,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = {} if indices is None else {"indices": indices}
        logits = kernel(
            q,
            kv_cache,
            weights,
            context_lens,
            block_tables,
            schedule_metadata,
            max_model_len,
            **kwargs,
        )
        if clean_logits:
            lens = context_lens.reshape(-1).to(torch.int64)
            if lens.numel() != logits.shape[0]:  # one length per request, next_n rows each
                lens = lens.repeat_interleave(logits.shape[0] // max(lens.numel(), 1))
            cols = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
            logits = logits.masked_fill(cols.view(1, -1) >= lens.view(-1, 1), float("-inf"))
        return logits

    setattr(fp8_fp4_paged_mqa_logits, _MARK, kernel)
    return fp8_fp4_paged_mqa_logits


def _adapt_resolved(module: Any) -> None:
    """Replace the kernels vLLM resolved in ``module`` by adapters, once, when they speak the newer API."""
    prefill = getattr(module, _PREFILL_IMPL, None)
    if (
        prefill is None
        or getattr(prefill, _MARK, None) is not None
        or not kernel_takes_max_seqlen_k(prefill)
    ):
        return
    setattr(module, _PREFILL_IMPL, adapt_prefill_kernel(prefill))
    paged = getattr(module, _PAGED_IMPL, None)
    if paged is not None and "clean_logits" not in (_params(paged) or {"clean_logits"}):
        setattr(module, _PAGED_IMPL, adapt_paged_kernel(paged))
    from vllm.logger import init_logger

    init_logger("vllm.plugins." + __name__).info(
        "vllm-dsa-connector: fix %s: DeepGEMM %s takes max_seqlen_k (compressed logits); vLLM's MQA-logits "
        "wrappers now call it through adapters",
        FIX_NAME,
        getattr(prefill, "__module__", "?"),
    )


def is_installed(module: Any) -> bool:
    """Whether ``module._lazy_init`` is this fix's wrapper."""
    return getattr(getattr(module, "_lazy_init", None), _MARK, None) is not None


def supported(module: Any) -> bool:
    """Whether ``module`` resolves its kernels where the fix expects (``_lazy_init`` and the impl handles)."""
    return callable(getattr(module, "_lazy_init", None)) and hasattr(module, _PREFILL_IMPL)


def install(module: Any) -> bool:
    """Wrap ``module._lazy_init`` (False if already wrapped or unsupported)."""
    if is_installed(module) or not supported(module):
        return False
    original = module._lazy_init

    def _lazy_init() -> None:
        original()
        _adapt_resolved(module)

    _lazy_init.__doc__ = original.__doc__
    setattr(_lazy_init, _MARK, original)
    module._lazy_init = _lazy_init
    _adapt_resolved(module)  # kernels vLLM already resolved in this process
    return True


def uninstall(module: Any) -> bool:
    """Restore vLLM's ``_lazy_init`` and the kernels it resolved (False if nothing was installed)."""
    changed = False
    for name in (_PREFILL_IMPL, _PAGED_IMPL):
        original = getattr(getattr(module, name, None), _MARK, None)
        if original is not None:
            setattr(module, name, original)
            changed = True
    wrapped = getattr(getattr(module, "_lazy_init", None), _MARK, None)
    if wrapped is not None:
        module._lazy_init = wrapped
        changed = True
    return changed


def apply(version: str) -> Any:
    """Install the fix on this process's ``vllm.utils.deep_gemm`` when vLLM's wrappers speak the older API;
    one :class:`~vllm_dsa_connector.fixes.FixReport` (called by ``apply_runtime_fixes`` under its lock)."""
    import importlib

    from vllm_dsa_connector.fixes import FixReport, log_once, not_needed

    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        return FixReport(FIX_NAME, "not-needed", version, f"no {MODULE}: {e}")
    if is_installed(module):
        return FixReport(FIX_NAME, "already-applied", version, "")
    if not caller_takes_clean_logits(module):
        detail = "vLLM's fp8_fp4_mqa_logits wrapper takes no clean_logits (it speaks DeepGEMM's newer API)"
        return not_needed(FIX_NAME, version, detail)
    if not supported(module):
        log_once(
            FIX_NAME,
            "warning",
            "vllm-dsa-connector: vLLM %s's %s has no _lazy_init/%s; fix %s not "
            "applied (a DeepGEMM with the newer MQA-logits API fails on the first DSA prefill)",
            version,
            MODULE,
            _PREFILL_IMPL,
            FIX_NAME,
        )
        return FixReport(FIX_NAME, "unsupported", version, "no _lazy_init")
    install(module)
    detail = (
        "vLLM's wrappers take clean_logits; a DeepGEMM that takes max_seqlen_k (compressed logits) is "
        "adapted when vLLM resolves it"
    )
    log_once(
        FIX_NAME,
        "info",
        "vllm-dsa-connector: applied runtime fix %s to vLLM %s: %s. "
        "VLLM_DSA_DISABLE_RUNTIME_FIXES=1 turns this off.",
        FIX_NAME,
        version,
        detail,
    )
    return FixReport(FIX_NAME, "applied", version, detail)


def revert() -> bool:
    """Undo :func:`apply` in this process (for tests)."""
    import importlib

    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return False
    return uninstall(module)
