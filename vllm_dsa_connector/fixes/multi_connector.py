"""Guard ``multi-connector-composition``: vLLM's MultiConnector checks a composition with DSAConnector.

MultiConnector resolves its children in the classmethod ``_get_connector_classes_and_configs`` (engine
start-up on the scheduler and on every worker, Prometheus set-up, KV layout checks): the only place where
the whole ``connectors`` list and the top-level config are both visible. This guard wraps it: after
vLLM's own resolution, :func:`vllm_dsa_connector.connector.compose.check_composition` refuses a
composition with DSAConnector that cannot work (order, a second P/D connector, a child's
``kv_load_failure_policy`` or ``kv_role`` that vLLM would not apply, a per-layer-hook store on a DSA
model) with one error naming the fix. Compositions without DSAConnector are not touched. Installed by
:func:`vllm_dsa_connector.fixes.apply_runtime_fixes`, logged once, off with
``VLLM_DSA_DISABLE_RUNTIME_FIXES=1`` (DSAConnector then still refuses to run without its own handshake
metadata, but the order of cache children is not checked).
"""

from __future__ import annotations

from typing import Any

GUARD_NAME = "multi-connector-composition"
_ATTR = "_get_connector_classes_and_configs"
_MARK = "__vllm_dsa_guard__"


def multi_connector_class() -> type | None:
    """vLLM's MultiConnector class (None if this vLLM has none)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    except ImportError:
        return None
    return MultiConnector


def supported(cls: type) -> bool:
    """Whether ``cls`` resolves its children where the guard expects (a classmethod of that name)."""
    return isinstance(vars(cls).get(_ATTR), classmethod)


def is_installed(cls: type) -> bool:
    raw = vars(cls).get(_ATTR)
    return isinstance(raw, classmethod) and getattr(raw.__func__, _MARK, None) is not None


def install(cls: type) -> bool:
    """Wrap ``cls._get_connector_classes_and_configs``; False if already wrapped or not supported."""
    if not supported(cls) or is_installed(cls):
        return False
    original = vars(cls)[_ATTR].__func__

    def _get_connector_classes_and_configs(klass: type, vllm_config: Any) -> Any:
        resolved = original(klass, vllm_config)
        check(vllm_config, [c for c, _ in resolved])
        return resolved

    _get_connector_classes_and_configs.__doc__ = original.__doc__
    setattr(_get_connector_classes_and_configs, _MARK, original)
    setattr(cls, _ATTR, classmethod(_get_connector_classes_and_configs))
    return True


def uninstall(cls: type) -> bool:
    """Restore vLLM's method (for tests); True if something changed."""
    if not is_installed(cls):
        return False
    setattr(cls, _ATTR, classmethod(getattr(vars(cls)[_ATTR].__func__, _MARK)))
    return True


def check(vllm_config: Any, classes: list[type]) -> None:
    """Run the composition check on a resolved ``connectors`` list."""
    from vllm_dsa_connector.connector.compose import (
        Child,
        check_composition,
        children_configs,
        is_dsa_model,
    )

    top = vllm_config.kv_transfer_config
    configs = children_configs(top)
    if len(configs) != len(classes):  # not the layout this guard knows: leave it to vLLM
        return
    children = [
        Child(i, cfg, cls) for i, (cfg, cls) in enumerate(zip(configs, classes, strict=True))
    ]
    check_composition(top, children, is_dsa_model(vllm_config))
