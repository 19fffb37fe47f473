"""Runtime fix: pipeline parallelism on vLLM CPU (no receive buffer on stages after the first).

vLLM 0.32's ``GPUModelRunner`` allocates ``intermediate_tensors`` (the buffer into which a
pipeline stage other than the first copies the previous stage's hidden states and residual)
only inside ``_dummy_run``, i.e. during the warm-up/profile run. On GPU that run always
happens. The CPU worker skips it: ``CPUModelRunner.warming_up_model`` returns at once for
``CompilationMode.NONE`` (``enforce_eager=True``) and ``CPUWorker._should_warm_up_model`` is
false with ``VLLM_CPU_CI_ENV`` or with eager mode plus an explicit KV cache size. The first
``execute_model`` of stage 1 then calls ``sync_and_gather_intermediate_tensors``, which
asserts ``self.intermediate_tensors is not None``: ``pipeline_parallel_size>=2`` fails on CPU
for every model.

``patches/0002-*.patch`` is the upstream fix (``CPUModelRunner`` allocates the buffer on first
use); this module installs the equivalent at run time, on ``CPUModelRunner`` only (the GPU
runner is untouched): ``sync_and_gather_intermediate_tensors`` allocates the buffer with the
model's own ``make_empty_intermediate_tensors`` (``max_num_tokens`` rows, the model dtype,
the runner's device; the sizes ``_dummy_run`` uses) when it is still ``None``, then runs
vLLM's method. A runner whose buffer exists (a warm-up ran) is not changed.

The probe drives vLLM's own ``sync_and_gather_intermediate_tensors`` on a ``CPUModelRunner``
instance made without ``__init__`` (no config, no model load; a 4-wide stand-in model) with
the buffer unset, as after a skipped warm-up: vLLM with the bug raises ``AssertionError``; a
fixed vLLM returns the copied tensors.

Only the processes that run the model import vLLM's CPU runner module (about 3 s), so :func:`apply`
does not import it: when ``vllm.v1.worker.cpu_model_runner`` is not imported yet it returns status
``"deferred"`` and leaves a one-shot import hook (:class:`_AfterImport`) that probes and installs the fix
right after vLLM imports the module (in the workers); the API server and engine-core processes never pay
for it. Where the module is already imported the fix is applied at once, as before.

Per release: vLLM 0.32 and 0.33 have the bug (the fix applies). vLLM 0.34 deleted the V1 runner
(``vllm.v1.worker.cpu_model_runner`` no longer exists): its CPU runners (``vllm.v1.worker.cpu``, V2-based,
and the standalone one) allocate the receive buffer in ``load_model`` on every stage after the first, so
:func:`apply` reports ``"not-needed"`` where the module cannot be found (never ``"deferred"`` for a module
that will not come); ``tests/test_pp_fix.py::test_retired_where_the_v1_cpu_runner_is_gone`` proves it on
0.34's sources.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

FIX_NAME = "cpu-pp-intermediate-tensors"
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
METHOD = "sync_and_gather_intermediate_tensors"
# What the fixed method reads on the runner besides vLLM's own method.
REQUIRED_ATTRS: tuple[str, ...] = ("model", "max_num_tokens", "model_config", "device")
_MARK_ATTR = "_vllm_dsa_fix"
_PROBE_WIDTH = 4
_PROBE_ROWS = 8

NO_V1_RUNNER = (
    f"vLLM has no V1 CPU runner ({RUNNER_MODULE}); its CPU runners allocate the pipeline "
    "receive buffer in load_model"
)

__all__ = [
    "FIX_NAME",
    "NO_V1_RUNNER",
    "RUNNER_MODULE",
    "apply",
    "deferred",
    "METHOD",
    "ProbeResult",
    "install",
    "is_installed",
    "probe",
    "runner_class",
    "runner_module_exists",
    "supported",
    "uninstall",
]


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the behaviour probe saw on the installed ``CPUModelRunner``."""

    buggy: bool
    detail: str


def runner_class() -> type | None:
    """vLLM's ``CPUModelRunner`` when this process runs on vLLM's CPU platform, else None.

    On other platforms the class is not imported (the GPU runner always runs the warm-up
    that allocates the buffer).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return None
    return CPUModelRunner


def runner_module_exists() -> bool:
    """Whether this vLLM has the V1 CPU runner module the bug lives in (found, not imported)."""
    try:
        return importlib.util.find_spec(RUNNER_MODULE) is not None
    except ImportError:  # a parent package is missing
        return False


def supported(cls: type) -> bool:
    """Whether ``cls`` has the method this fix wraps."""
    return callable(getattr(cls, METHOD, None))


def is_installed(cls: type) -> bool:
    """Whether this fix is installed on ``cls`` (directly, not inherited)."""
    return getattr(cls.__dict__.get(METHOD), _MARK_ATTR, None) == FIX_NAME


class _ProbeModel:
    """Stand-in for a PP model: the two-tensor stage interface of vLLM's decoder models."""

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> Any:
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors(
            {
                name: torch.zeros((batch_size, _PROBE_WIDTH), dtype=dtype, device=device)
                for name in ("hidden_states", "residual")
            }
        )


def _probe_runner(cls: type) -> Any:
    """A ``cls`` instance without ``__init__``: a stage-1 runner whose warm-up was skipped."""
    runner: Any = object.__new__(cls)
    runner.intermediate_tensors = None
    runner.model = _ProbeModel()
    runner.max_num_tokens = _PROBE_ROWS
    runner.model_config = types.SimpleNamespace(dtype=torch.float32)
    runner.device = torch.device("cpu")
    return runner


def probe(cls: type) -> ProbeResult:
    """Receive 3 rows of a previous stage on a runner that skipped the warm-up."""
    from vllm.sequence import IntermediateTensors

    received = IntermediateTensors(
        {
            "hidden_states": torch.arange(12, dtype=torch.float32).reshape(3, _PROBE_WIDTH),
            "residual": -torch.arange(12, dtype=torch.float32).reshape(3, _PROBE_WIDTH),
        }
    )
    runner = _probe_runner(cls)
    try:
        out = getattr(runner, METHOD)(3, received, True)
    except AssertionError:
        return ProbeResult(
            True,
            f"{cls.__name__}.{METHOD} raised AssertionError with no receive buffer "
            "(the buffer is allocated only by the warm-up dummy run)",
        )
    ok = all(torch.equal(out[name], received[name]) for name in ("hidden_states", "residual"))
    if not ok:
        return ProbeResult(True, f"{cls.__name__}.{METHOD} returned other values than received")
    return ProbeResult(False, f"{cls.__name__}.{METHOD} works without a warm-up run")


_ORIGINAL: dict[type, tuple[bool, Any]] = {}


def install(cls: type) -> bool:
    """Install the fix on ``cls``. False if it was already installed."""
    if is_installed(cls):
        return False
    had_own = METHOD in cls.__dict__
    original = getattr(cls, METHOD)

    def sync_and_gather_intermediate_tensors(
        self: Any, num_tokens: int, intermediate_tensors: Any, sync_self: bool
    ) -> Any:
        """vLLM's method, after allocating the receive buffer if no warm-up did."""
        if getattr(self, "intermediate_tensors", None) is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )
        return original(self, num_tokens, intermediate_tensors, sync_self)

    setattr(sync_and_gather_intermediate_tensors, _MARK_ATTR, FIX_NAME)
    _ORIGINAL[cls] = (had_own, cls.__dict__.get(METHOD))
    setattr(cls, METHOD, sync_and_gather_intermediate_tensors)
    return True


def uninstall(cls: type) -> bool:
    """Remove the fix from ``cls`` (for tests). False if it was not installed."""
    if not is_installed(cls):
        return False
    had_own, own = _ORIGINAL.pop(cls, (False, None))
    if had_own:
        setattr(cls, METHOD, own)
    else:
        delattr(cls, METHOD)
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: applies the fix right after ``RUNNER_MODULE`` is executed."""

    def __init__(self, version: str) -> None:
        self.version = version

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The module's own spec, its loader's ``exec_module`` followed by :func:`_apply_now`."""
        if fullname != RUNNER_MODULE:
            return None
        remove_deferred()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module
        version = self.version

        def exec_module(module: types.ModuleType) -> None:
            execute(module)
            _apply_now(version)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


def deferred() -> bool:
    """Whether the import hook waits for ``RUNNER_MODULE`` in this process."""
    return any(isinstance(f, _AfterImport) for f in sys.meta_path)


def remove_deferred() -> bool:
    """Remove a waiting import hook (False if there was none)."""
    hooks = [f for f in sys.meta_path if isinstance(f, _AfterImport)]
    for f in hooks:
        sys.meta_path.remove(f)
    return bool(hooks)


def apply(version: str) -> Any:
    """Probe, install and re-probe on this process's ``CPUModelRunner``; log the outcome once.

    Called by :func:`vllm_dsa_connector.fixes.apply_runtime_fixes` (which holds its lock and has
    already checked ``VLLM_DSA_DISABLE_RUNTIME_FIXES``), which returns this
    :class:`~vllm_dsa_connector.fixes.FixReport` among its reports; ``"not-needed"`` off vLLM's
    CPU platform or where vLLM has no V1 CPU runner (0.34); ``"deferred"`` when vLLM has not
    imported its CPU runner yet (the fix is then applied by an import hook when it does, see the
    module docstring).
    :func:`~vllm_dsa_connector.fixes.revert_runtime_fixes` undoes it.
    """
    from vllm_dsa_connector.fixes import FixReport, not_needed

    if RUNNER_MODULE not in sys.modules:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return FixReport(FIX_NAME, "not-needed", version, "not vLLM's CPU platform")
        if not runner_module_exists():
            return not_needed(FIX_NAME, version, NO_V1_RUNNER)
        if not deferred():
            sys.meta_path.insert(0, _AfterImport(version))
        return FixReport(
            FIX_NAME, "deferred", version, f"applied when vLLM imports {RUNNER_MODULE}"
        )
    return _apply_now(version)


def _apply_now(version: str) -> Any:
    """:func:`apply` on the imported ``CPUModelRunner``."""
    from vllm_dsa_connector.fixes import FixReport, log_once, not_needed

    cls = runner_class()
    if cls is None:
        return FixReport(FIX_NAME, "not-needed", version, "not vLLM's CPU platform")
    if is_installed(cls):
        return FixReport(FIX_NAME, "already-applied", version, "")
    if not supported(cls):
        log_once(
            FIX_NAME,
            "warning",
            "vllm-dsa-connector: vLLM %s's %s has no %s; fix %s not applied",
            version,
            cls.__name__,
            METHOD,
            FIX_NAME,
        )
        return FixReport(FIX_NAME, "unsupported", version, f"no {METHOD}")
    before = probe(cls)
    if not before.buggy:
        return not_needed(FIX_NAME, version, before.detail)
    install(cls)
    after = probe(cls)
    if after.buggy:
        uninstall(cls)
        log_once(
            FIX_NAME,
            "warning",
            "vllm-dsa-connector: fix %s did not give vLLM %s's CPU "
            "runner a pipeline receive buffer (before: %s; after: %s); removed it again. "
            "pipeline_parallel_size>1 fails on CPU: apply patches/0002-*.patch.",
            FIX_NAME,
            version,
            before.detail,
            after.detail,
        )
        return FixReport(FIX_NAME, "failed", version, after.detail)
    log_once(
        FIX_NAME,
        "info",
        "vllm-dsa-connector: applied runtime fix %s to vLLM %s: "
        "CPUModelRunner allocates the pipeline-stage receive buffer on first use, so "
        "pipeline_parallel_size>1 runs without a warm-up (probe: %s; after the fix: %s). "
        "VLLM_DSA_DISABLE_RUNTIME_FIXES=1 turns this off.",
        FIX_NAME,
        version,
        before.detail,
        after.detail,
    )
    return FixReport(FIX_NAME, "applied", version, before.detail)
