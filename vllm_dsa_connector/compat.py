"""Differences between the vLLM releases the plugin supports, in one place.

Supported: vLLM 0.32, 0.33 and 0.34 (``SUPPORTED_VLLM``). Each shim detects the API it needs (an
import, a parameter, a dataclass field) instead of comparing version strings, so a patch
release that backports a change keeps working.

============================  ================================  =================================
what                          vLLM 0.32                         vLLM 0.33
============================  ================================  =================================
KV cache planning             ``kv_cache_utils.                 ``kv_cache_planning.
                              get_kv_cache_configs(vc, specs,   get_kv_cache_configs(vc, specs,
                              memory)``                         memory, global_groups)``
MLA ``do_kv_cache_update``    6 arguments                       7: ``skip_scale`` (bool) added
``supports_sleep_mode()``     absent                            classmethod, default True
``MLAAttentionSpec``          no ``topk_buffer_width``          ``topk_buffer_width`` (sparse)
CPU block size                set in ``check_and_update_        reset later by ``update_block_
                              config``                          size_for_backend`` (128)
============================  ================================  =================================

vLLM 0.34 (as 0.33, plus; each detected where it is used):

* the V1 model runner and its proposers are gone (``cpu_model_runner``, ``llm_base_proposer``): the
  fixes ``mtp-draft-token-map`` and ``cpu-pp-intermediate-tensors`` find no such module and report
  ``not-needed`` (``fixes/``);
* ``ModelRunnerOutput`` has no ``req_id_to_index`` (the admission harness passes it only where the field
  exists, :func:`dataclass_has_field`); ``KVCacheBlock._block_hash`` is the field ``block_hash``;
* ``Request.prompt_token_ids`` is a ``TokenBuffer`` (an int32 ``array``): the prompt digest is the same;
* connector hooks ``kv_cache_access``, ``supports_lookahead_block_hashes``, ``may_load_async``
  (``connector/connector.py``); MultiConnector's producer/consumer come from the children's roles
  (``connector/compose.py`` asks vLLM's own ``is_kv_consumer``/``is_kv_producer``);
* on x86 CPUs ``CpuPlatform`` requires Triton; vLLM keeps an installed Triton with no active driver only
  when ``CUDA_VISIBLE_DEVICES`` is set empty (``ci/compat.sh``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "SUPPORTED_VLLM",
    "dataclass_has_field",
    "get_kv_cache_configs",
    "is_supported_vllm",
    "vllm_version",
    "warn_if_unsupported",
]

SUPPORTED_VLLM = ">=0.32,<0.35"
"""The vLLM releases this plugin supports (a PEP 440 specifier; the pins in pyproject agree)."""


def vllm_version() -> str:
    """The imported vLLM's ``__version__`` (``"unknown"`` if it has none)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported_vllm(version: str | None = None) -> bool:
    """Whether ``version`` (default: the imported vLLM) is in :data:`SUPPORTED_VLLM`.

    Local version labels (``0.32.0+cpu``) and pre-releases of a supported minor count.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version if version is not None else vllm_version())
    except InvalidVersion:
        return False
    release = Version(".".join(str(p) for p in parsed.release))
    return SpecifierSet(SUPPORTED_VLLM).contains(release, prereleases=True)


def warn_if_unsupported() -> bool:
    """Plugin step: log a warning (once per process) if the imported vLLM is not supported.

    Nothing is disabled: the runtime fixes probe behaviour and the shims detect APIs, so an
    untested release may work; the warning says it was not tested. Returns True if supported.
    """
    if is_supported_vllm():
        return True
    from vllm.logger import init_logger

    init_logger("vllm.plugins.vllm_dsa_connector").warning_once(
        "vllm-dsa-connector supports vLLM %s; this is vLLM %s (untested).",
        SUPPORTED_VLLM,
        vllm_version(),
    )
    return False


def dataclass_has_field(cls: type, name: str) -> bool:
    """Whether the dataclass ``cls`` declares the field ``name``."""
    return dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls))


def get_kv_cache_configs(
    vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
) -> list[Any]:
    """vLLM's per-worker ``KVCacheConfig`` planning, on either release.

    vLLM 0.33 moved ``get_kv_cache_configs`` to ``vllm.v1.core.kv_cache_planning`` and made the
    caller group the layers of all workers first (``get_global_kv_cache_groups``), as
    ``EngineCore`` does; vLLM 0.32 groups inside ``kv_cache_utils.get_kv_cache_configs``.
    """
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs as planned
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as grouped

        return list(grouped(vllm_config, kv_cache_specs, available_memory))
    groups = get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    return list(planned(vllm_config, kv_cache_specs, available_memory, groups))
