"""DSAConnector as a child of vLLM's ``MultiConnector``: which compositions can work, and why.

vLLM's MultiConnector (``{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors":
[...]}}``) builds each child from a shallow copy of the engine's config whose ``kv_transfer_config`` is
``KVTransferConfig(**child, engine_id=...)``: a child never sees the top level. What that means here:

- Order. MultiConnector loads a request's KV from the FIRST child that reports matched tokens. A cache
  child (offload, shared storage) ahead of DSAConnector would win on D whenever it has the prompt, and
  DSAConnector would get no external tokens: P's transfer is cancelled and P's KV wasted. Only the first
  child's handshake metadata is collected, too, and DSAConnector cannot run without its own. So
  DSAConnector must be ``connectors[0]``, and there is one of it.
- No second P/D connector: both would hand out ``kv_transfer_params`` (MultiConnector raises on the key
  clash) and both would need their own handshake metadata.
- ``kv_load_failure_policy``: vLLM's scheduler reads the TOP-LEVEL field; a child's copy is seen only
  by that child. DSAConnector therefore never decides it: a load it cannot do (peer refused or
  unreachable, timeout, bad pairing) is always reported as a failed load and vLLM applies the top-level
  policy. A child that sets a different value is refused, naming where it must go.
- ``kv_role``: vLLM asks the top-level config whether the engine is a producer/consumer (a consumer defers
  block frees under async scheduling), so that answer must allow what DSAConnector's role does. vLLM 0.32
  and 0.33 answer from the top-level ``kv_role``, which then must allow it; vLLM 0.34 answers from the
  children's roles (MultiConnector does not pass its own), so any top-level role works there. The rule
  asks vLLM's own ``is_kv_consumer``/``is_kv_producer`` of the top-level config, so it follows the release.
- DSA models: the indexer K caches are written by the indexer op, which has no connector hook; a child
  that stores KV from ``save_kv_layer`` never sees them and would store MLA pages without their indexer
  pages (a later hit would attend with stale or missing top-k keys). Such a child is refused for models
  whose config has ``index_topk``. Children that store whole blocks of the registered caches after the
  forward (``wait_for_save``: vLLM's offloading connectors, LMCache's non-layerwise and MP connectors)
  cover the indexer layers too and are accepted (by their source; they need a GPU, so not run here).

:func:`check_composition` is run by the guarded wrapper of ``MultiConnector._get_connector_classes_and_
configs`` (:mod:`vllm_dsa_connector.fixes.multi_connector`), i.e. wherever vLLM resolves the children:
engine start-up (scheduler and workers), Prometheus set-up, layout checks. It does nothing for
compositions without DSAConnector. No vLLM import here.
"""

from __future__ import annotations

import dis
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dsa_connector.core.handoff.params import DSA_CONNECTOR

__all__ = [
    "MULTI_CONNECTOR",
    "OTHER_PD_CONNECTORS",
    "CompositionError",
    "Child",
    "check_composition",
    "children_configs",
    "is_dsa_connector",
    "is_dsa_model",
    "layer_hook_store",
]

MULTI_CONNECTOR = "MultiConnector"

#: vLLM's P/D connectors (besides those found by their own handshake metadata): a second P/D connector
#: next to DSAConnector cannot work (kv_transfer_params clash, one handshake collected).
OTHER_PD_CONNECTORS: frozenset[str] = frozenset({
    "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector", "MoRIIOConnector",
    "P2pNcclConnector", "DecodeBenchConnector",
})

_CONSUMES = ("kv_consumer", "kv_both")
_PRODUCES = ("kv_producer", "kv_both")
_TRUE = {"1", "true", "yes", "on"}


class CompositionError(ValueError):
    """A MultiConnector configuration with DSAConnector that cannot work; the message says why and how."""


@dataclass(frozen=True)
class Child:
    """One entry of ``connectors``: its raw dict (what the user wrote) and its resolved class."""

    index: int
    config: Mapping[str, Any]
    cls: type

    @property
    def name(self) -> str:
        return str(self.config.get("kv_connector") or self.cls.__name__)

    @property
    def extra(self) -> Mapping[str, Any]:
        return self.config.get("kv_connector_extra_config") or {}


def is_dsa_connector(cls: type) -> bool:
    """Whether ``cls`` is DSAConnector or a subclass (by the MRO: no import of the connector needed)."""
    return any(c.__name__ == DSA_CONNECTOR and c.__module__.startswith("vllm_dsa_connector.connector")
               for c in getattr(cls, "__mro__", ()))


def _class_names(cls: type) -> set[str]:
    return {c.__name__ for c in getattr(cls, "__mro__", ())}


def is_dsa_model(vllm_config: Any) -> bool:
    """Whether the engine's model is a DSA model (its HF config has ``index_topk``)."""
    mc = getattr(vllm_config, "model_config", None)
    for attr in ("hf_config", "hf_text_config"):
        cfg = getattr(mc, attr, None)
        if cfg is not None and getattr(cfg, "index_topk", None) is not None:
            return True
    return False


def children_configs(kv_transfer_config: Any) -> list[Mapping[str, Any]]:
    """The ``connectors`` list of a MultiConnector config (empty for any other connector)."""
    if kv_transfer_config is None or getattr(kv_transfer_config, "kv_connector", None) != MULTI_CONNECTOR:
        return []
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return [c for c in extra.get("connectors") or [] if isinstance(c, Mapping)]


def _is_noop(fn: Callable[..., Any]) -> bool:
    """Whether a function's body does nothing (``pass``, a docstring, ``return``/``return None``)."""
    try:
        ops = [i for i in dis.get_instructions(fn) if i.opname not in ("RESUME", "NOP", "CACHE")]
    except TypeError:
        return False
    if len(ops) == 1:
        return ops[0].opname == "RETURN_CONST" and ops[0].argval is None
    return (len(ops) == 2 and ops[0].opname == "LOAD_CONST" and ops[0].argval is None
            and ops[1].opname == "RETURN_VALUE")


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in _TRUE)


def lmcache_settings(extra: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """LMCache's ``use_layerwise`` / ``enable_pd`` as LMCache resolves them for this child: the
    ``lmcache.*`` keys of its ``kv_connector_extra_config`` (and vLLM's bare ``use_layerwise``), the
    ``LMCACHE_*`` environment variables and the YAML file named by ``LMCACHE_CONFIG_FILE``."""
    environ = os.environ if environ is None else environ
    out = {"use_layerwise": False, "enable_pd": False}
    path = environ.get("LMCACHE_CONFIG_FILE")
    if path:
        try:
            import yaml

            with open(path) as fh:
                data = yaml.safe_load(fh) or {}
            for key in out:
                out[key] = out[key] or _truthy(data.get(key))
            out["enable_pd"] = out["enable_pd"] or _truthy(data.get("enable_xpyd"))
        except Exception:  # noqa: BLE001 - LMCache reports its own config errors
            pass
    for key in out:
        out[key] = (out[key] or _truthy(environ.get("LMCACHE_" + key.upper()))
                    or _truthy(extra.get("lmcache." + key)))
    out["use_layerwise"] = out["use_layerwise"] or _truthy(extra.get("use_layerwise"))
    return out


def layer_hook_store(cls: type, extra: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str | None:
    """Why this connector stores KV through the per-layer ``save_kv_layer`` hook (which never sees DSA
    indexer K caches), or None when it does not."""
    names = _class_names(cls)
    if "LMCacheConnectorV1" in names:
        if lmcache_settings(extra, environ)["use_layerwise"]:
            return "LMCache's layerwise mode (use_layerwise) stores one layer per save_kv_layer call"
        return None  # non-layerwise: stores every registered cache (indexer included) in wait_for_save
    if "LMCacheMPConnector" in names:
        return None  # stores whole blocks of every registered cache in wait_for_save
    if is_dsa_connector(cls):
        return None  # its layer push (layer_push) posts every role of a layer, the indexer K page included
    fn = getattr(cls, "save_kv_layer", None)
    if fn is None or _is_noop(fn):
        return None
    return f"{cls.__name__}.save_kv_layer stores KV layer by layer"


def _overrides_handshake(cls: type) -> bool:
    fn = getattr(cls, "get_handshake_metadata", None)
    owner = next((c for c in getattr(cls, "__mro__", ()) if "get_handshake_metadata" in vars(c)), None)
    return fn is not None and owner is not None and owner.__name__ != "KVConnectorBase_V1"


def _top_is(top: Any, kind: str, roles: tuple[str, ...]) -> bool:
    """Whether vLLM takes the engine for a ``kind`` (``consumer``/``producer``): its own
    ``is_kv_<kind>`` of the top-level config where it has one, else the top-level ``kv_role``."""
    answer = getattr(top, f"is_kv_{kind}", None)
    return answer if isinstance(answer, bool) else getattr(top, "kv_role", None) in roles


def check_composition(top: Any, children: Sequence[Child], dsa_model: bool,
                      environ: Mapping[str, str] | None = None) -> None:
    """Refuse a MultiConnector composition with DSAConnector that cannot work (see the module doc).

    ``top`` is the engine's (top-level) ``KVTransferConfig``. Compositions without DSAConnector pass
    untouched. Raises :class:`CompositionError` listing every problem with what to do.
    """
    dsa = [c for c in children if is_dsa_connector(c.cls)]
    if not dsa:
        return
    problems: list[str] = []
    first = dsa[0]
    if len(dsa) > 1:
        problems.append(f"DSAConnector appears {len(dsa)} times (entries {[c.index for c in dsa]}); "
                        "use one")
    if first.index != 0:
        problems.append(
            f"DSAConnector is entry {first.index}, after {children[0].name}: put it FIRST. MultiConnector "
            "loads from the first child that has the tokens, so a cache hit of an earlier child would "
            "cancel P's transfer, and only the first child's handshake metadata is collected")
    for child in children:
        if child in dsa:
            continue
        if _class_names(child.cls) & OTHER_PD_CONNECTORS or _overrides_handshake(child.cls):
            problems.append(
                f"{child.name} (entry {child.index}) is a P/D connector too or needs its own handshake "
                "metadata: one P/D connector per engine (both would hand out kv_transfer_params, and "
                "MultiConnector collects one child's handshake metadata)")
        elif {"LMCacheConnectorV1", "LMCacheMPConnector"} & _class_names(child.cls) and \
                lmcache_settings(child.extra, environ)["enable_pd"]:
            problems.append(f"{child.name} (entry {child.index}) has LMCache's P/D mode on (enable_pd): "
                            "DSAConnector does P/D; use LMCache for offload only")
        elif dsa_model and (why := layer_hook_store(child.cls, child.extra, environ)):
            problems.append(
                f"{child.name} (entry {child.index}) cannot store KV of a DSA model: {why}, and DSA "
                "indexer K caches have no per-layer hook, so it would store MLA pages without their "
                "indexer pages. Use a connector that stores whole blocks after the forward "
                "(OffloadingConnector, LMCacheConnectorV1 without use_layerwise, LMCacheMPConnector)")
    top_policy = getattr(top, "kv_load_failure_policy", "fail")
    for child in children:
        policy = child.config.get("kv_load_failure_policy")
        if policy is not None and policy != top_policy:
            problems.append(
                f"kv_load_failure_policy={policy!r} in {child.name} (entry {child.index}) differs from the "
                f"top level ({top_policy!r}): vLLM's scheduler applies the top-level value to every "
                "child's failed loads; set it at the top level of --kv-transfer-config")
    top_role = getattr(top, "kv_role", None)
    role = first.config.get("kv_role")
    needs = [kind for kind, roles in (("consumer", _CONSUMES), ("producer", _PRODUCES))
             if role in roles and not _top_is(top, kind, roles)]
    if needs:
        problems.append(
            f"DSAConnector's kv_role {role!r} needs a top-level kv_role that is a {' and '.join(needs)} "
            f"(this vLLM reads the top-level role), got {top_role!r}; use {role!r} or 'kv_both' there")
    if problems:
        raise CompositionError(
            "DSAConnector in MultiConnector: " + "; ".join(problems)
            + ". See docs/configuration.md, 'Composing with other connectors'.")


def resolve_children(top: Any, resolve: Callable[[Mapping[str, Any]], type]) -> list[Child]:
    """:class:`Child` entries of a MultiConnector config, classes resolved by ``resolve``."""
    return [Child(i, cfg, resolve(cfg)) for i, cfg in enumerate(children_configs(top))]


def admission_keys(kv_transfer_config: Any, prefix: str = "admission") -> dict[str, Any]:
    """The admission keys wherever the user put them: the top-level ``kv_connector_extra_config`` and,
    for MultiConnector, every child's. The same key with different values in two places is an error."""
    found: dict[str, tuple[str, Any]] = {}
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    places: list[tuple[str, Mapping[str, Any]]] = [("the top level", extra)]
    for i, child in enumerate(children_configs(kv_transfer_config)):
        places.append((f"connectors[{i}] ({child.get('kv_connector')})",
                       child.get("kv_connector_extra_config") or {}))
    for where, cfg in places:
        for key, value in cfg.items():
            if not key.startswith(prefix):
                continue
            if key in found and found[key][1] != value:
                raise CompositionError(f"{key} is set in {found[key][0]} ({found[key][1]!r}) and in {where} "
                                       f"({value!r}); set it once")
            found.setdefault(key, (where, value))
    return {k: v for k, (_, v) in found.items()}


def describe(children: Iterable[Child]) -> str:
    """``A, B`` for log lines."""
    return ", ".join(c.name for c in children)
