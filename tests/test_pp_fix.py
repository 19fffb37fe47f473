"""Issue 21 item 2: pipeline parallelism on vLLM CPU (runtime fix ``cpu-pp-intermediate-tensors``
and ``patches/0002-*.patch``).

Fast checks (``compat``: ``ci/compat.sh`` also runs them against vLLM 0.33's sources) drive
vLLM's real ``CPUModelRunner.sync_and_gather_intermediate_tensors`` on a runner left as the CPU
worker leaves it after a skipped warm-up (no receive buffer): stock vLLM asserts, the runtime fix
and the patched copy of vLLM's file do not.

The ``slow`` checks start real engines (one model load per layout, each in its own process,
float32, ``enforce_eager``, a few greedy tokens): ``pipeline_parallel_size=2`` gives the same
tokens as ``pipeline_parallel_size=1`` on the tiny MLA model and the tiny masked-indexer DSA
model, and fails with vLLM's original ``AssertionError`` when ``VLLM_DSA_DISABLE_RUNTIME_FIXES=1``.
Run them under the engine lock: ``flock /tmp/vllm-dsa-engine.lock pytest -m slow tests/test_pp_fix.py``.

This file is also the engine script: ``python tests/test_pp_fix.py MODEL PP`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load_module_from_file

ROOT = Path(__file__).resolve().parents[1]
PATCH = next((ROOT / "patches").glob("0002-*.patch"))
RUNNER_FILE = "vllm/v1/worker/cpu_model_runner.py"
MAX_TOKENS = 6
# Prompt token ids (no tokenizer is loaded). 40 tokens: longer than the DSA model's
# index_topk=16, so its indexer selects a strict subset of the context.
PROMPTS = (list(range(1000, 1040)), list(range(5000, 5040, 2)) + list(range(7000, 7020)))
ENGINE_TIMEOUT_S = 900
ORIGINAL_ERROR = "assert self.intermediate_tensors is not None"


def _runner_cls() -> type:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


@pytest.fixture
def stock_runner(monkeypatch: pytest.MonkeyPatch):
    """vLLM's CPUModelRunner without the fix; the process-wide fix state is restored afterwards."""
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    if not fix.runner_module_exists():  # vLLM 0.34: retired, see the test below
        pytest.skip(f"{fix.NO_V1_RUNNER}: fix and patch retired on this release")
    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    cls = _runner_cls()
    was_installed = fix.uninstall(cls)
    yield cls
    fix.uninstall(cls)
    if was_installed:
        fix.install(cls)


def _stage_runner(cls: type) -> Any:
    """A runner of stage 1 whose warm-up was skipped: vLLM's class, no receive buffer yet."""
    from vllm.sequence import IntermediateTensors

    class StageModel:
        def make_empty_intermediate_tensors(self, batch_size, dtype, device):
            return IntermediateTensors(
                {
                    k: torch.zeros(batch_size, 6, dtype=dtype, device=device)
                    for k in ("hidden_states", "residual")
                }
            )

    runner = object.__new__(cls)
    runner.intermediate_tensors = None
    runner.model = StageModel()
    runner.max_num_tokens = 16
    runner.model_config = types.SimpleNamespace(dtype=torch.float32)
    runner.device = torch.device("cpu")
    return runner


def _receive(runner: Any, rows: int) -> tuple[Any, Any]:
    from vllm.sequence import IntermediateTensors

    sent = IntermediateTensors({k: torch.randn(rows, 6) for k in ("hidden_states", "residual")})
    return sent, runner.sync_and_gather_intermediate_tensors(rows, sent, True)


@pytest.mark.compat  # also against other vLLM releases (ci/compat.sh)
def test_stock_runner_asserts_and_fix_allocates_once(stock_runner: type) -> None:
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    with pytest.raises(AssertionError):
        _receive(_stage_runner(stock_runner), 5)
    assert fix.probe(stock_runner).buggy

    report = fix.apply("test")
    assert report.status == "applied", report
    assert fix.is_installed(stock_runner) and not fix.probe(stock_runner).buggy
    assert fix.apply("test").status == "already-applied"

    runner = _stage_runner(stock_runner)
    for rows in (5, 16, 2):  # later steps reuse the buffer allocated by the first
        sent, got = _receive(runner, rows)
        for key in ("hidden_states", "residual"):
            torch.testing.assert_close(got[key], sent[key])
    buffer = runner.intermediate_tensors["hidden_states"]
    assert buffer.shape == (16, 6)
    _receive(runner, 3)
    assert runner.intermediate_tensors["hidden_states"] is buffer

    assert fix.uninstall(stock_runner) and fix.probe(stock_runner).buggy  # vLLM's method again


@pytest.mark.compat  # also against other vLLM releases (ci/compat.sh)
def test_env_disables_the_fix(stock_runner: type, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_dsa_connector import fixes
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    monkeypatch.setenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", "1")
    reports = fixes.apply_runtime_fixes()
    assert [(r.name, r.status) for r in reports] == [(n, "disabled") for n in fixes.FIX_NAMES]
    assert not fix.is_installed(stock_runner)


@pytest.mark.compat  # also against other vLLM releases (ci/compat.sh)
def test_register_applies_the_fix(stock_runner: type) -> None:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector import fixes
    from vllm_dsa_connector.fixes import mtp_stale_caches
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    others_were_installed = mtp_stale_caches.is_installed(CommonAttentionMetadata)
    try:
        reports = fixes.apply_runtime_fixes()
        assert [r.name for r in reports] == list(fixes.FIX_NAMES)
        assert fixes.report_for(reports, fix.FIX_NAME).status == "applied"
        assert fix.is_installed(stock_runner)
        again = fixes.apply_runtime_fixes()
        assert fixes.report_for(again, fix.FIX_NAME).status == "already-applied"
        assert fixes.revert_runtime_fixes() and not fix.is_installed(stock_runner)  # with the rest
        assert not fixes.revert_runtime_fixes()
    finally:
        if others_were_installed:
            fixes.apply_runtime_fixes()  # the PP fix's own state is restored by stock_runner


def allocates_at_load(cls: type) -> bool:
    """Whether ``cls.load_model`` (as resolved on ``cls``) allocates the receive buffer.

    Looks in vLLM's own source of the method for ``self.intermediate_tensors =
    self.model.make_empty_intermediate_tensors(...)``: allocated when the model loads, a stage
    needs no warm-up run to receive.
    """
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.load_model)))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        targets = [t for t in node.targets if isinstance(t, ast.Attribute)]
        if (
            any(t.attr == "intermediate_tensors" for t in targets)
            and isinstance(func, ast.Attribute)
            and func.attr == "make_empty_intermediate_tensors"
        ):
            return True
    return False


@pytest.mark.compat  # the proof that retires fix and patch on vLLM 0.34 (ci/compat.sh)
def test_retired_where_the_v1_cpu_runner_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.34 deleted ``cpu_model_runner.py``; its CPU runners allocate the buffer at load.

    On 0.32/0.33 the V1 runner is there and does not (the bug the fix and patch 0002 remove);
    on 0.34 the fix reports ``not-needed`` instead of waiting for a module that never comes.
    """
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    monkeypatch.delenv("VLLM_DSA_DISABLE_RUNTIME_FIXES", raising=False)
    if fix.runner_module_exists():
        assert not allocates_at_load(_runner_cls())  # V1: only _dummy_run allocates it
        return
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    for cls in (CPUModelRunner, StandaloneCPUModelRunner):  # what CPUWorker builds
        assert allocates_at_load(cls), cls
    fix.remove_deferred()
    report = fix.apply("test")
    assert (report.status, report.detail) == ("not-needed", fix.NO_V1_RUNNER), report
    assert not fix.deferred()


def test_fix_names_and_report_lookup() -> None:
    from vllm_dsa_connector import fixes
    from vllm_dsa_connector.fixes import deep_gemm_api, mtp_stale_caches, pp_intermediate

    assert fixes.FIX_NAMES == (mtp_stale_caches.FIX_NAME, pp_intermediate.FIX_NAME, deep_gemm_api.FIX_NAME)
    reports = (fixes.FixReport("a", "applied", "0", ""), fixes.FixReport("b", "failed", "0", ""))
    assert fixes.report_for(reports, "b") is reports[1]
    with pytest.raises(KeyError, match="'c'.*\\['a', 'b'\\]"):
        fixes.report_for(reports, "c")


def _patched_runner_cls(dest: Path) -> type:
    """Apply the patch to a copy of the installed vLLM's file; load the patched CPUModelRunner."""
    import vllm

    src = Path(vllm.__file__).resolve().parents[1] / RUNNER_FILE
    (dest / RUNNER_FILE).parent.mkdir(parents=True)
    shutil.copy2(src, dest / RUNNER_FILE)
    check = subprocess.run(
        ["git", "apply", "--check", "-v", str(PATCH)], cwd=dest, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    subprocess.run(["git", "apply", str(PATCH)], cwd=dest, check=True, capture_output=True)
    return load_module_from_file(dest / RUNNER_FILE, "vllm_dsa_patched_cpu_runner").CPUModelRunner


@pytest.mark.compat
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_patch_applies_and_fixes_a_copy_of_vllm(stock_runner: type, tmp_path: Path) -> None:
    from vllm_dsa_connector.fixes import pp_intermediate as fix

    patched = _patched_runner_cls(tmp_path)
    result = fix.probe(patched)
    assert not result.buggy, result.detail  # a patched vLLM is left alone by apply()
    sent, got = _receive(_stage_runner(patched), 4)
    torch.testing.assert_close(got["residual"], sent["residual"])


_DEFER_SCRIPT = """
import json, sys
from vllm_dsa_connector import fixes
from vllm_dsa_connector.fixes import pp_intermediate as fix
first = fixes.report_for(fixes.apply_runtime_fixes(), fix.FIX_NAME).status
out = {"first": first, "imported": fix.RUNNER_MODULE in sys.modules, "hook": fix.deferred(),
       "again": fixes.report_for(fixes.apply_runtime_fixes(), fix.FIX_NAME).status}
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
out.update(installed=fix.is_installed(CPUModelRunner), hook_after=fix.deferred(),
           buggy=fix.probe(CPUModelRunner).buggy,
           third=fixes.report_for(fixes.apply_runtime_fixes(), fix.FIX_NAME).status)
print("DEFER " + json.dumps(out))
"""


def test_fix_waits_for_the_runner_import() -> None:
    """A process that never imports vLLM's CPU runner (API server, engine core) does not pay for it: the
    fix is ``deferred`` to an import hook, which installs it when a worker imports the runner."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DSA_DISABLE_RUNTIME_FIXES"}
    proc = subprocess.run([sys.executable, "-c", _DEFER_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600, cwd=str(ROOT))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("DEFER ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("DEFER "):])
    assert got == {"first": "deferred", "imported": False, "hook": True, "again": "deferred",
                   "installed": True, "hook_after": False, "buggy": False, "third": "already-applied"}, got


# --------------------------------------------------------------------------- real engines


def _engine_run(
    model: Path, pp: int, *, fixes_off: bool = False, partition: str | None = None
) -> dict[str, Any]:
    """Start one engine in a fresh process; its JSON result (tokens, start time) or its failure."""
    env = dict(os.environ)
    env.pop("VLLM_DSA_DISABLE_RUNTIME_FIXES", None)
    if fixes_off:
        env["VLLM_DSA_DISABLE_RUNTIME_FIXES"] = "1"
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    if partition:
        env["VLLM_PP_LAYER_PARTITION"] = partition
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # One OpenMP thread per stage on its own core; pp=1 uses one thread too (same numerics).
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(pp))
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(model), str(pp)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
        start_new_session=True,  # its own process group: workers are killed with it
    )
    try:
        out, _ = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, 9)  # EngineCore / worker children that outlived the script
        except ProcessLookupError:
            pass
    lines = [x for x in out.splitlines() if x.startswith("PPFIX ")]
    result = json.loads(lines[-1][len("PPFIX ") :]) if lines else {}
    result.update(rc=proc.returncode, wall_s=round(time.monotonic() - start, 1), log=out)
    return result


_RUNS: dict[tuple[str, int, bool, str | None], dict[str, Any]] = {}


@pytest.fixture(scope="module")
def engine_run():
    """Runs each (model, pp, fixes_off, partition) layout once for the whole module."""

    def run(
        model: Path, pp: int, fixes_off: bool = False, partition: str | None = None
    ) -> dict[str, Any]:
        key = (str(model), pp, fixes_off, partition)
        if key not in _RUNS:
            _RUNS[key] = _engine_run(model, pp, fixes_off=fixes_off, partition=partition)
            r = _RUNS[key]
            print(
                f"[pp-fix] {Path(model).name} pp={pp} fixes_off={fixes_off} partition={partition}: "
                f"rc={r['rc']} "
                f"wall {r['wall_s']} s, engine start {r.get('start_s')} s, tokens {r.get('tokens')}"
            )
        return _RUNS[key]

    return run


@pytest.fixture(scope="module")
def tiny_dsa_dir() -> Path:
    from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

    return make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)


def _failure(run: dict[str, Any]) -> str:
    """The first worker/engine traceback of a failed run (the log's tail is only the shutdown)."""
    lines = run["log"].splitlines()
    first = next((i for i, x in enumerate(lines) if "Traceback" in x), max(0, len(lines) - 40))
    return "\n".join(lines[first : first + 60])


def _assert_same_tokens(pp1: dict[str, Any], pp2: dict[str, Any]) -> None:
    assert pp1["rc"] == 0, _failure(pp1)
    assert pp2["rc"] == 0, _failure(pp2)
    assert ORIGINAL_ERROR not in pp2["log"]
    # the fix's log line (every process logs it once, the stage-1 worker too)
    assert "cpu-pp-intermediate-tensors" in pp2["log"]
    assert len(pp1["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in pp1["tokens"])
    assert pp2["tokens"] == pp1["tokens"]


@pytest.mark.slow
def test_mla_pp2_equals_pp1(engine_run, tiny_mla_dir: Path) -> None:
    _assert_same_tokens(engine_run(tiny_mla_dir, 1), engine_run(tiny_mla_dir, 2))


@pytest.mark.slow
def test_mla_pp2_without_fix_fails_with_the_original_assertion(
    engine_run, tiny_mla_dir: Path
) -> None:
    off = engine_run(tiny_mla_dir, 2, fixes_off=True)
    assert off["rc"] != 0 and "tokens" not in off, off["log"][-3000:]
    assert ORIGINAL_ERROR in off["log"], off["log"][-4000:]
    assert "sync_and_gather_intermediate_tensors" in off["log"]


def owning_first_partition(model_dir: Path) -> str:
    """A 2-stage ``VLLM_PP_LAYER_PARTITION`` whose stage 1 starts with a layer that computes its own
    top-k (``indexer_types[i] == "full"``), as near the middle as possible.

    vLLM 0.32's IndexCache layers (``"shared"``) reuse the top-k of the layer before them from a
    per-process buffer (``topk_indices_buffer``) that is not among the tensors sent between
    stages: a stage that starts with a shared layer reads a buffer no layer of its own filled.
    vLLM's even split of the tiny DSA model (full, full, shared, full) is such a split.
    """
    config = json.loads((model_dir / "config.json").read_text())
    types_ = config["indexer_types"]
    n = len(types_)
    cuts = [k for k in range(1, n) if types_[k] == "full"]
    cut = min(cuts, key=lambda k: (abs(2 * k - n), -k))
    return f"{cut},{n - cut}"


@pytest.mark.slow
def test_dsa_pp2_equals_pp1(engine_run, tiny_dsa_dir: Path) -> None:
    partition = owning_first_partition(tiny_dsa_dir)
    assert partition == "3,1"  # full, full, shared | full
    _assert_same_tokens(
        engine_run(tiny_dsa_dir, 1), engine_run(tiny_dsa_dir, 2, partition=partition)
    )


# --------------------------------------------------------------------------- engine script


def main() -> None:
    """``MODEL PP``: one engine, greedy tokens of :data:`PROMPTS`, one ``PPFIX {json}`` line."""
    model, pp = sys.argv[1], int(sys.argv[2])
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        enforce_eager=True,
        skip_tokenizer_init=True,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp" if pp > 1 else None,
    )
    start_s = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(
        "PPFIX " + json.dumps({"pp": pp, "start_s": round(start_s, 1), "tokens": tokens}),
        flush=True,
    )


if __name__ == "__main__":
    main()
