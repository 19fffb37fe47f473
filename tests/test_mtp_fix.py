"""Issue 6: the MTP draft loop's stale token->request map (runtime fix and upstream patch).

Every check drives vLLM's real ``CommonAttentionMetadata`` through the same metadata
rewrites as vLLM 0.32's (and 0.33's, unchanged) V1 draft loop (``v1/spec_decode/llm_base_proposer.py``, propose():
target forward, draft step 0 on the target layout, then the rewrite to one token per
request and ``num_speculative_tokens - 1`` steps that advance ``seq_lens``), optionally
through ``dataclasses.replace()`` as ``AttentionGroup._with_kernel_block_table`` does.

One substitution, because the fault cannot be avoided otherwise: vLLM's Triton kernel
``compute_token_to_req_indices`` cannot run here (Triton has no CPU backend), so on the
stock and patched-vLLM paths the kernel is replaced by the torch function with the same
contract (``vllm_dsa_connector.fixes.token_to_req_indices``). The caching logic under test is
vLLM's own (stock or patched) or the runtime fix's.

This file is also a script: ``python tests/test_mtp_fix.py --json ...`` runs the checks in
a fresh process (env var / register() / patched-vLLM-copy cases) and prints the result.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.compat  # runs against every supported vLLM release (ci/compat.sh)

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 2, 3, 5, 8)
DRAFT_LENS = (2, 3, 5)
MODES = ("in-place", "replace", "copy")


def _metadata_cls() -> type:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata


def substitute_cpu_kernel() -> None:
    """Replace vLLM's Triton map kernel (no CPU backend) by the same-contract torch one."""
    import vllm.v1.attention.ops.metadata as ops

    from vllm_dsa_connector.fixes.token_to_req_indices import compute_token_to_req_indices

    ops.compute_token_to_req_indices = compute_token_to_req_indices


def _expected_map(query_lens: list[int]) -> list[int]:
    return np.repeat(np.arange(len(query_lens)), query_lens).tolist()


def draft_loop(
    cls: type, batch: int, draft_len: int, mode: str, seed: int, ragged: bool = False
) -> dict[str, object]:
    """Run one spec-decode step's metadata life cycle on ``cls`` (a CommonAttentionMetadata
    class); return what the builders saw."""
    gen = torch.Generator().manual_seed(seed)
    if ragged:  # mixed prefill chunks / decodes, one zero-length (padding-like) row
        query_lens = torch.randint(1, draft_len + 6, (batch,), generator=gen)
        if batch > 2:
            query_lens[batch // 2] = 0
    else:  # pure decode: 1 verified + draft_len proposed tokens per request
        query_lens = torch.full((batch,), draft_len + 1)
    qlens = query_lens.tolist()
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens, 0)
    num_tokens = int(qsl[-1])
    seq_lens = (query_lens + torch.randint(4, 60, (batch,), generator=gen)).to(torch.int32)
    cm = cls(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=batch,
        num_actual_tokens=num_tokens,
        max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.arange(batch * 4, dtype=torch.int32).view(batch, 4),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
    )
    target_buf = torch.full((num_tokens + 16,), -1, dtype=torch.int32)
    draft_buf = torch.full((num_tokens + 16,), -1, dtype=torch.int32)
    out: dict[str, object] = {"expected_target": _expected_map(qlens)}

    # Target forward: builders of several layers/groups ask for the map.
    out["target"] = cm.token_to_req_indices(target_buf).tolist()
    saved = target_buf[0].item()
    target_buf[0] = 77  # poke the cached map: a reuse returns 77, a rebuild does not
    out["target_reused"] = cm.token_to_req_indices(target_buf)[0].item() == 77
    target_buf[0] = saved
    out["target_nc"] = cm.compute_num_computed_tokens().tolist()
    out["expected_target_nc"] = (seq_lens - query_lens.to(torch.int32)).tolist()

    # Draft step 0 (default EAGLE path keeps the target layout and object).
    out["draft0"] = cm.token_to_req_indices(draft_buf).tolist()

    # Rewrite as llm_base_proposer.propose() does before the loop.
    arange = torch.arange(max(batch + 1, num_tokens), dtype=torch.int32)  # self.arange
    token_arange_np = np.arange(max(batch + 1, num_tokens), dtype=np.int32)
    cm.num_actual_tokens = batch
    cm.max_query_len = 1
    cm.query_start_loc = arange[: batch + 1]
    cm.query_start_loc_cpu = torch.from_numpy(token_arange_np[: batch + 1]).clone()
    rejected = torch.randint(0, draft_len + 1, (batch,), generator=gen, dtype=torch.int32)
    rejected = torch.minimum(rejected, cm.seq_lens - 1)
    cm.seq_lens -= rejected
    steps = []
    for _ in range(draft_len - 1):
        # eagle_step_update_slot_mapping_and_metadata: a Triton kernel advances seq_lens
        # in place; .data mimics a raw-pointer write (no version-counter bump).
        cm.seq_lens.data.add_(1)
        if mode == "replace":
            view = dataclasses.replace(cm, block_table_tensor=cm.block_table_tensor + 0)
        elif mode == "copy":
            view = copy.copy(cm)
        else:
            view = cm
        steps.append(
            {
                "map": view.token_to_req_indices(draft_buf).tolist(),
                "nc": view.compute_num_computed_tokens().tolist(),
                "expected_nc": (cm.seq_lens - 1).tolist(),
            }
        )
    out["steps"] = steps
    out["expected_draft"] = list(range(batch))
    return out


def run_checks(cls: type | None = None) -> dict[str, object]:
    """All batch sizes x draft lengths x modes; counts of correct / stale results."""
    cls = cls or _metadata_cls()
    summary: dict[str, object] = {
        "cases": 0,
        "draft_map_wrong": 0,
        "draft_nc_wrong": 0,
        "target_wrong": 0,
        "target_not_reused": 0,
        "draft0_wrong": 0,
        "stale_example": None,
    }
    seed = 0
    for batch in BATCH_SIZES:
        for draft_len in DRAFT_LENS:
            for mode in MODES:
                for ragged in (False, True):
                    seed += 1
                    r = draft_loop(cls, batch, draft_len, mode, seed, ragged)
                    summary["cases"] += 1
                    summary["target_wrong"] += (r["target"] != r["expected_target"]) or (
                        r["target_nc"] != r["expected_target_nc"]
                    )
                    summary["target_not_reused"] += not r["target_reused"]
                    summary["draft0_wrong"] += r["draft0"] != r["expected_target"]
                    for step in r["steps"]:
                        if step["map"] != r["expected_draft"]:
                            summary["draft_map_wrong"] += 1
                            if summary["stale_example"] is None:
                                summary["stale_example"] = [batch, draft_len, mode, step["map"]]
                        summary["draft_nc_wrong"] += step["nc"] != step["expected_nc"]
    return summary


# --------------------------------------------------------------------------- pytest


def _start_script(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("VLLM_DSA_DISABLE_RUNTIME_FIXES", None)
    env.update(env_extra or {})
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def _result(proc: subprocess.Popen) -> dict[str, object]:
    try:
        # generous: a fresh process imports vLLM (0.33: from sources); CI runs other jobs beside it
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    line = [x for x in stdout.splitlines() if x.startswith("{")][-1]
    result = json.loads(line)
    result["stderr"] = stderr
    return result


def _patch_copy(dest: Path) -> tuple[Path, list[str]]:
    """Copy the files the patch touches from the installed vLLM into ``dest``; apply it."""
    import vllm

    patches = sorted((ROOT / "patches").glob("0001-*.patch"))
    assert len(patches) == 1, patches
    text = patches[0].read_text()
    assert text.startswith("From ") and "Subject: [PATCH]" in text
    lines = text.splitlines()
    files = [line[len("+++ b/") :] for line in lines if line.startswith("+++ b/")]
    created = {
        line[len("+++ b/") :]
        for prev, line in zip(lines, lines[1:], strict=False)
        if line.startswith("+++ b/") and prev == "--- /dev/null"
    }
    assert files, "patch touches no file"
    site = Path(vllm.__file__).resolve().parents[1]
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel not in created:  # only the installed files the patch modifies
            shutil.copy2(site / rel, dest / rel)
    tool = shutil.which("patch")
    cmd = [tool, "-p1", "-i", str(patches[0])] if tool else ["git", "apply", str(patches[0])]
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rel in files:  # every patched file still compiles
        compile((dest / rel).read_text(), str(dest / rel), "exec")
    return dest, files


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The fresh-process cases, started together (each one pays vLLM's import time)."""
    dest, files = _patch_copy(tmp_path_factory.mktemp("vllm_patched"))
    procs = {
        # Stock vLLM with the env var set, and the patched copy loaded beside it.
        "off": _start_script(
            "--register",
            "--substitute-kernel",
            "--patched-backend",
            str(dest / "vllm/v1/attention/backend.py"),
            env_extra={"VLLM_DSA_DISABLE_RUNTIME_FIXES": "1"},
        ),
        "on": _start_script("--register"),
    }
    runs: dict[str, object] = {"patched_files": files}
    for name, proc in procs.items():
        runs[name] = proc  # collected lazily so one failure does not hide the others
    return runs


def _assert_fixed(summary: dict[str, object]) -> None:
    assert summary["cases"] == len(BATCH_SIZES) * len(DRAFT_LENS) * len(MODES) * 2
    assert summary["draft_map_wrong"] == 0, summary["stale_example"]
    assert summary["draft_nc_wrong"] == 0
    assert summary["target_wrong"] == 0
    assert summary["draft0_wrong"] == 0


def _assert_stale(summary: dict[str, object]) -> None:
    assert summary["target_wrong"] == 0 and summary["draft0_wrong"] == 0
    # Every draft step with >= 2 requests: pure decode batches give j // (K + 1).
    assert summary["draft_map_wrong"] > 0
    assert summary["draft_nc_wrong"] > 0
    _b, k, _mode, got = summary["stale_example"]
    assert got == [j // (k + 1) for j in range(len(got))]


def test_token_map_matches_repeat_interleave() -> None:
    from vllm_dsa_connector.fixes.token_to_req_indices import (
        compute_token_to_req_indices,
        token_to_req_indices_from_lens,
    )

    gen = torch.Generator().manual_seed(6)
    for _ in range(50):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        lens = torch.randint(0, 5, (n,), generator=gen)
        want = torch.repeat_interleave(torch.arange(n), lens).to(torch.int32)
        assert torch.equal(token_to_req_indices_from_lens(lens), want)
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(lens, 0)
        total = int(qsl[-1])
        buf = torch.full((total + 7,), -5, dtype=torch.int32)
        got = compute_token_to_req_indices(qsl, buf, None, total + 3)  # padded tail -> 0
        assert got.tolist() == want.tolist() + [0, 0, 0]
        assert buf[total + 3 :].tolist() == [-5] * 4  # nothing written past num_tokens
        assert got.data_ptr() == buf.data_ptr()
        assert compute_token_to_req_indices(qsl, buf, total, total + 3).tolist() == got.tolist()


def _skip_without_v1_draft_loop() -> None:
    """vLLM 0.34: fix and patch 0001 retired (test_retired_where_no_draft_loop_rewrites_metadata)."""
    from vllm_dsa_connector.fixes.mtp_stale_caches import NO_DRAFT_LOOP, draft_loop_modules

    if not draft_loop_modules():
        pytest.skip(f"{NO_DRAFT_LOOP}: fix and patch 0001 retired on this release")


@pytest.fixture
def stock_state(monkeypatch: pytest.MonkeyPatch):
    """The stock class (fix reverted) with the CPU kernel; the fix state is restored after."""
    import vllm.v1.attention.ops.metadata as ops

    from vllm_dsa_connector.fixes import apply_runtime_fixes, revert_runtime_fixes
    from vllm_dsa_connector.fixes.mtp_stale_caches import is_installed

    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    was_installed = is_installed(_metadata_cls())
    kernel = ops.compute_token_to_req_indices
    revert_runtime_fixes()
    substitute_cpu_kernel()
    yield
    ops.compute_token_to_req_indices = kernel
    revert_runtime_fixes()
    if was_installed:
        apply_runtime_fixes()


def layout_rewrite_modules(root: Path) -> set[str]:
    """Modules under vLLM's package ``root`` that rewrite a built batch's query layout in place.

    A function that assigns both ``num_actual_tokens`` and ``query_start_loc`` of one object other
    than ``self`` (the V1 draft loop's rewrite of the target forward's ``CommonAttentionMetadata``
    for draft steps >= 1): the only path on which the stale caches are read.
    """
    import ast
    import re

    fields = {"num_actual_tokens", "query_start_loc"}
    quick = re.compile(r"\.query_start_loc\s*=[^=]")
    found = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if not quick.search(text):
            continue
        for func in ast.walk(ast.parse(text)):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assigned: dict[str, set[str]] = {}
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr in fields
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    ):
                        assigned.setdefault(ast.unparse(t.value), set()).add(t.attr)
            if any(attrs == fields for attrs in assigned.values()):
                rel = path.relative_to(root.parent).with_suffix("")
                found.add(".".join(rel.parts))
    return found


def test_layout_rewrite_scan_sees_the_v1_loop(tmp_path: Path) -> None:
    """The scan finds the rewrite as the V1 proposer writes it, and not a builder's own fields."""
    pkg = tmp_path / "vllm" / "v1"
    pkg.mkdir(parents=True)
    (pkg / "loop.py").write_text(
        "def propose(self, common_attn_metadata, batch_size):\n"
        "    common_attn_metadata.num_actual_tokens = batch_size\n"
        "    common_attn_metadata.query_start_loc = self.arange[: batch_size + 1]\n"
    )
    (pkg / "builder.py").write_text(
        "def build(self, md, cm):\n"
        "    self.query_start_loc = cm.query_start_loc\n"
        "    md.query_start_loc = cm.query_start_loc\n"
    )
    assert layout_rewrite_modules(tmp_path / "vllm") == {"vllm.v1.loop"}


def test_retired_where_no_draft_loop_rewrites_metadata(stock_state: None) -> None:
    """Which releases need the fix: exactly those with a V1 draft loop (0.32, 0.33; not 0.34).

    The scan of the running vLLM's sources must find the in-place rewrite in the modules the fix
    names and nowhere else; where it finds none (0.34), the fix reports ``not-needed``.
    """
    import vllm

    from vllm_dsa_connector.fixes import apply_runtime_fixes, report_for
    from vllm_dsa_connector.fixes.mtp_stale_caches import (
        FIX_NAME,
        NO_DRAFT_LOOP,
        draft_loop_modules,
        is_installed,
    )

    present = draft_loop_modules()
    assert layout_rewrite_modules(Path(vllm.__file__).resolve().parent) == set(present)
    report = report_for(apply_runtime_fixes(), FIX_NAME)
    if present:  # 0.32, 0.33
        assert report.status == "applied", report
        return
    assert (report.status, report.detail) == ("not-needed", NO_DRAFT_LOOP), report
    assert not is_installed(_metadata_cls())


def test_v2_draft_steps_build_fresh_metadata(stock_state: None) -> None:
    """vLLM's V2 ``build_attn_metadata`` (called once per draft step by its speculators) makes a
    new ``CommonAttentionMetadata`` each call, so the stock class's map follows each step's layout
    even when the step rewrites the same ``query_start_loc`` buffer in place, as the speculators do.
    Its second KV cache group reuses the first group's map of the same call."""
    import types

    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    buffer = torch.zeros(32, dtype=torch.int32)
    seen: list[tuple[int, list[int]]] = []

    class Builder:
        supports_update_block_table = False

    class Group:
        """One attention group: hands vLLM's metadata to the map, as the DSA builders do."""

        def __init__(self, name: str) -> None:
            self.layer_names = [name]
            self.kv_cache_spec = None

        def get_metadata_builder(self, ubatch_idx: int = 0) -> Builder:
            return Builder()

        def build_metadata(self, cm: Any, ubatch_idx: int = 0, **kwargs: Any) -> Any:
            seen.append((id(cm), cm.token_to_req_indices(buffer).tolist()))
            return cm

    groups = [[Group("a")], [Group("b")]]
    config = types.SimpleNamespace(kv_cache_groups=[object(), object()])
    qsl = torch.zeros(4, dtype=torch.int32)  # the speculator's persistent input buffer
    seq_lens = torch.full((3,), 20, dtype=torch.int32)
    block_table = torch.zeros((3, 2), dtype=torch.int32)
    kept = []
    for per_req in (3, 1, 1):  # target forward (3 tokens a request), then two draft steps
        qsl.copy_(torch.arange(4, dtype=torch.int32) * per_req)
        kept.append(
            build_attn_metadata(
                groups,
                3,
                3 * per_req,
                qsl,
                qsl.clone(),
                per_req,
                seq_lens,
                20,
                [block_table, block_table],
                torch.zeros((2, 3 * per_req), dtype=torch.int64),
                config,
            )
        )
        seq_lens += 1
    maps = [m for _, m in seen]
    assert maps == [[0, 0, 0, 1, 1, 1, 2, 2, 2]] * 2 + [[0, 1, 2]] * 4, maps
    assert len({i for i, _ in seen}) == 6  # a new object per group and step


@pytest.fixture
def fix_state(monkeypatch: pytest.MonkeyPatch):
    """Run with the env var unset; restore the process-wide fix state afterwards."""
    import vllm.v1.attention.ops.metadata as ops

    _skip_without_v1_draft_loop()

    from vllm_dsa_connector.fixes import apply_runtime_fixes, revert_runtime_fixes
    from vllm_dsa_connector.fixes.mtp_stale_caches import is_installed

    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    was_installed = is_installed(_metadata_cls())
    kernel = ops.compute_token_to_req_indices
    yield
    ops.compute_token_to_req_indices = kernel
    revert_runtime_fixes()
    if was_installed:
        apply_runtime_fixes()


def test_stale_without_fix_and_correct_with_fix(fix_state: None) -> None:
    """In-process: revert -> vLLM's stock methods show the bug; apply -> correct."""
    import vllm.v1.attention.ops.metadata as ops

    from vllm_dsa_connector.fixes import apply_runtime_fixes, report_for, revert_runtime_fixes
    from vllm_dsa_connector.fixes.mtp_stale_caches import FIX_NAME, is_installed

    cls = _metadata_cls()
    kernel = ops.compute_token_to_req_indices
    revert_runtime_fixes()
    assert not is_installed(cls)
    substitute_cpu_kernel()
    _assert_stale(run_checks())
    report = report_for(apply_runtime_fixes(), FIX_NAME)
    assert report.status == "applied", report
    assert "[0, 0, 0]" in report.detail  # the behaviour probe saw the bug
    ops.compute_token_to_req_indices = kernel  # the fix must not need vLLM's kernel
    _assert_fixed(run_checks())
    assert report_for(apply_runtime_fixes(), FIX_NAME).status == "already-applied"
    assert revert_runtime_fixes() and not is_installed(cls)  # the test-only revert works
    assert not revert_runtime_fixes()


def test_v2_runner_style_seeded_cache(fix_state: None) -> None:
    """The V2 runner passes the map via the constructor; a stale one must be rebuilt."""
    from vllm_dsa_connector.fixes import apply_runtime_fixes
    from vllm_dsa_connector.fixes.mtp_stale_caches import is_installed

    cls = _metadata_cls()
    apply_runtime_fixes()
    assert is_installed(cls)
    stale = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)  # target map, 4 tok/req
    qsl = torch.arange(3, dtype=torch.int32)  # draft layout: one token per request

    def group(cache: torch.Tensor | None) -> object:
        return cls(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor([9, 9], dtype=torch.int32),
            num_reqs=2,
            num_actual_tokens=2,
            max_query_len=1,
            max_seq_len=9,
            block_table_tensor=torch.zeros((2, 1), dtype=torch.int32),
            slot_mapping=torch.zeros(2, dtype=torch.int64),
            _token_to_req_indices_cache=cache,
        )

    first = group(stale)
    got = first.token_to_req_indices(torch.zeros(8, dtype=torch.int32))
    assert got.tolist() == [0, 1]
    # The next KV-cache group gets the rebuilt map (same layout): shared, not rebuilt.
    second = group(first._token_to_req_indices_cache)
    assert second.token_to_req_indices(torch.zeros(8, dtype=torch.int32)).data_ptr() == (
        got.data_ptr()
    )


def _report(result: dict[str, Any], name: str) -> dict[str, Any]:
    """The report of fix ``name`` in a script result (``apply_runtime_fixes()`` as dicts)."""
    found = [r for r in result["reports"] if r["name"] == name]
    assert len(found) == 1, f"expected one report for {name!r}, got {result['reports']}"
    return found[0]


def test_env_disables_runtime_fix(script_runs: dict[str, object]) -> None:
    off = _result(script_runs["off"])
    for name in ("mtp-draft-token-map", "cpu-pp-intermediate-tensors"):
        assert _report(off, name)["status"] == "disabled"
    _assert_stale(off["summary"])


def test_register_applies_once(script_runs: dict[str, object]) -> None:
    _skip_without_v1_draft_loop()
    on = _result(script_runs["on"])
    # register() applied it first
    assert _report(on, "mtp-draft-token-map")["status"] == "already-applied"
    assert on["log_lines"] == 1, on["stderr"][-2000:]
    _assert_fixed(on["summary"])


def test_patch_applies_and_fixes_a_copy_of_vllm(script_runs: dict[str, object]) -> None:
    _skip_without_v1_draft_loop()
    result = _result(script_runs["off"])
    assert "vllm/v1/attention/backend.py" in script_runs["patched_files"]
    assert result["patched_file"].endswith("vllm/v1/attention/backend.py")
    assert result["patched_file"] != result["stock_file"]
    probe = result["patched_probe"]  # the runtime fix's behaviour probe: nothing to fix
    assert not probe["token_map_stale"] and not probe["num_computed_stale"], probe
    _assert_fixed(result["patched_summary"])


# --------------------------------------------------------------------------- script


def _load_patched_backend(path: Path) -> type:
    """Load a patched copy of vllm/v1/attention/backend.py beside the installed one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_patched_attention_backend", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module.CommonAttentionMetadata


def main() -> None:
    import logging

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--register", action="store_true", help="call plugin.register() twice")
    parser.add_argument("--patched-backend", help="patched copy of vllm/v1/attention/backend.py")
    parser.add_argument("--substitute-kernel", action="store_true")
    args = parser.parse_args()
    out: dict[str, object] = {}
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("vllm").addHandler(_Collect(level=logging.DEBUG))
    logging.getLogger("vllm.plugins").setLevel(logging.DEBUG)
    if args.substitute_kernel:
        substitute_cpu_kernel()
    from vllm_dsa_connector import fixes

    reports = []
    if args.register:
        from vllm_dsa_connector import register

        register()
        register()
    if args.register:
        reports = [dataclasses.asdict(r) for r in fixes.apply_runtime_fixes()]
    out["reports"] = reports
    # This fix's own "applied" lines (the other fixes log theirs too).
    out["log_lines"] = sum("applied runtime fix mtp-draft-token-map " in m for m in records)
    out["summary"] = run_checks()
    if args.patched_backend:
        import inspect

        from vllm_dsa_connector.fixes.mtp_stale_caches import probe

        patched = _load_patched_backend(Path(args.patched_backend))
        out["stock_file"] = inspect.getfile(_metadata_cls())
        out["patched_file"] = inspect.getfile(patched)
        out["patched_probe"] = dataclasses.asdict(probe(patched))
        out["patched_summary"] = run_checks(patched)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
