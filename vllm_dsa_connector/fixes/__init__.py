"""Runtime fixes of vLLM bugs that affect DSA models, applied by the plugin's ``register()``.

Each fix decides by behaviour, never by a list of releases: a probe drives vLLM's own class
on tiny CPU tensors; a vLLM that does not show the bug (a fixed release, or one carrying the
upstream patch) is left alone; one that shows it, whatever its version, is fixed, the fix is
probed again (and removed if the bug is still there), and the outcome is logged once per
process with the vLLM version and what the probe saw. A class whose fields the fix does not
know is left alone with a warning. ``VLLM_DSA_DISABLE_RUNTIME_FIXES=1`` turns all of them off.
``patches/`` holds the same fixes as upstream diffs.

Fixes:

* ``mtp-draft-token-map`` (:mod:`.mtp_stale_caches`): the MTP/EAGLE draft loop reuses the
  target forward's token->request map (and num_computed_tokens) after rewriting the batch
  to one token per request. vLLM 0.32, 0.33: applies; 0.34: not needed (no V1 draft loop).
* ``cpu-pp-intermediate-tensors`` (:mod:`.pp_intermediate`): vLLM's CPU runner has no pipeline
  receive buffer on stages after the first when the warm-up run is skipped. vLLM 0.32, 0.33:
  applies (CPU platform); 0.34: not needed (no V1 CPU runner).
* ``deep-gemm-mqa-logits-api`` (:mod:`.deep_gemm_api`): vLLM's DeepGEMM MQA-logits wrappers call
  ``clean_logits=`` kernels while the DeepGEMM they resolve takes ``max_seqlen_k`` and returns
  compressed rows (the DSA indexer then dies on the first prefill). Decided by its probe on
  each release (GPU hosts with DeepGEMM only).

:func:`apply_runtime_fixes` returns one :class:`FixReport` per fix (:func:`report_for` picks
one by name); :func:`revert_runtime_fixes` undoes all of them and the guards.

Guards (not bug fixes: no probe; installed with the fixes, off with the same variable, not in
the returned reports):

* ``multi-connector-composition`` (:mod:`.multi_connector`): vLLM's MultiConnector refuses a
  composition with DSAConnector that cannot work (see :mod:`vllm_dsa_connector.connector.compose`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

from vllm_dsa_connector.options import runtime_fixes_disabled

__all__ = ["FIX_NAMES", "FixReport", "apply_runtime_fixes", "report_for", "revert_runtime_fixes"]

# The fixes, in the order of apply_runtime_fixes()'s reports (each module's FIX_NAME).
FIX_NAMES: tuple[str, ...] = (
    "mtp-draft-token-map",
    "cpu-pp-intermediate-tensors",
    "deep-gemm-mqa-logits-api",
)

_LOCK = threading.Lock()
_LOGGER_NAME = "vllm.plugins." + __name__
_LOGGED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class FixReport:
    """Outcome of :func:`apply_runtime_fixes` for one fix.

    ``status`` is one of ``"applied"`` (probe showed the bug; the fix is installed and a second
    probe shows it gone), ``"already-applied"``, ``"disabled"``, ``"not-needed"`` (probe shows
    no bug), ``"unsupported"`` (probe shows the bug but the class lacks fields the fix uses;
    left alone) or ``"failed"`` (the fix did not remove the bug; removed again).
    """

    name: str
    status: str
    vllm_version: str
    detail: str


def log_once(key: str, level: str, msg: str, *args: object) -> None:
    from vllm.logger import init_logger

    if key in _LOGGED:
        return
    _LOGGED.add(key)
    # Under the "vllm." hierarchy so the record goes through vLLM's configured handler
    # (VLLM_LOGGING_LEVEL, VLLM_LOGGING_STREAM); a bare package name has no handler and
    # Python drops INFO records.
    getattr(init_logger(_LOGGER_NAME), level)(msg, *args)


def not_needed(name: str, version: str, detail: str) -> FixReport:
    """Fix ``name`` is not needed on vLLM ``version`` because of ``detail``: logged once (debug), reported."""
    log_once(
        name,
        "debug",
        "vllm-dsa-connector: vLLM %s does not need fix %s (%s)",
        version,
        name,
        detail,
    )
    return FixReport(name, "not-needed", version, detail)


def apply_runtime_fixes() -> tuple[FixReport, ...]:
    """Detect and fix known vLLM bugs in this process. Idempotent and thread-safe.

    Returns one :class:`FixReport` per fix, in the order of :data:`FIX_NAMES`; pick one with
    :func:`report_for` rather than by position.
    """
    import vllm

    from vllm_dsa_connector.fixes import deep_gemm_api, pp_intermediate

    version = getattr(vllm, "__version__", "unknown")
    with _LOCK:
        if runtime_fixes_disabled():
            log_once(
                "disabled",
                "info",
                "vllm-dsa-connector: runtime fixes disabled by VLLM_DSA_DISABLE_RUNTIME_FIXES",
            )
            return tuple(FixReport(name, "disabled", version, "env") for name in FIX_NAMES)
        _install_guards(version)
        return (
            _apply_mtp_stale_caches(version),
            pp_intermediate.apply(version),
            deep_gemm_api.apply(version),
        )


def report_for(reports: Iterable[FixReport], name: str) -> FixReport:
    """The report of fix ``name`` among ``reports`` (as returned by :func:`apply_runtime_fixes`).

    Raises ``KeyError`` naming the fix asked for and the fixes reported when none matches.
    """
    reports = tuple(reports)
    for report in reports:
        if report.name == name:
            return report
    raise KeyError(
        f"no report for fix {name!r}; the reports are for {[r.name for r in reports]} "
        f"(known fixes: {list(FIX_NAMES)})"
    )


def _apply_mtp_stale_caches(version: str) -> FixReport:
    """Probe, install and re-probe fix ``mtp-draft-token-map`` (caller holds the lock)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import mtp_stale_caches as fix

    if fix.is_installed(CommonAttentionMetadata):
        return FixReport(fix.FIX_NAME, "already-applied", version, "")
    if not fix.draft_loop_modules():  # vLLM 0.34: nothing rewrites the metadata in place
        return not_needed(fix.FIX_NAME, version, fix.NO_DRAFT_LOOP)
    result = fix.probe(CommonAttentionMetadata)
    if not result.buggy:
        return not_needed(fix.FIX_NAME, version, result.detail)
    missing = fix.missing_fields(CommonAttentionMetadata)
    if missing:
        log_once(
            fix.FIX_NAME,
            "warning",
            "vllm-dsa-connector: vLLM %s shows the stale MTP draft-loop token map (%s) "
            "but its CommonAttentionMetadata lacks %s, which fix %s uses; not patching. "
            "MTP draft steps of DSA models may read another request's KV: apply "
            "patches/0001-*.patch.",
            version,
            result.detail,
            ", ".join(missing),
            fix.FIX_NAME,
        )
        return FixReport(fix.FIX_NAME, "unsupported", version, result.detail)
    fix.install(CommonAttentionMetadata)
    after = fix.probe(CommonAttentionMetadata)
    if after.buggy:
        fix.uninstall(CommonAttentionMetadata)
        log_once(
            fix.FIX_NAME,
            "warning",
            "vllm-dsa-connector: fix %s did not remove the stale MTP draft-loop token map "
            "on vLLM %s (before: %s; after: %s); removed it again. Apply "
            "patches/0001-*.patch.",
            fix.FIX_NAME,
            version,
            result.detail,
            after.detail,
        )
        return FixReport(fix.FIX_NAME, "failed", version, after.detail)
    log_once(
        fix.FIX_NAME,
        "info",
        "vllm-dsa-connector: applied runtime fix %s to vLLM %s: "
        "CommonAttentionMetadata.token_to_req_indices/compute_num_computed_tokens now "
        "follow the draft loop's batch layout (probe: %s; after the fix: %s). "
        "VLLM_DSA_DISABLE_RUNTIME_FIXES=1 turns this off.",
        fix.FIX_NAME,
        version,
        result.detail,
        after.detail,
    )
    return FixReport(fix.FIX_NAME, "applied", version, result.detail)


def _install_guards(version: str) -> None:
    """Install the guards (caller holds the lock); each is logged once."""
    from vllm_dsa_connector.fixes import multi_connector as guard

    cls = guard.multi_connector_class()
    if cls is None:
        return
    if not guard.supported(cls):
        log_once(
            guard.GUARD_NAME,
            "warning",
            "vllm-dsa-connector: vLLM %s's MultiConnector has no %s classmethod; DSAConnector "
            "compositions are not checked (put DSAConnector first; see docs/configuration.md)",
            version,
            "_get_connector_classes_and_configs",
        )
        return
    if guard.install(cls):
        log_once(
            guard.GUARD_NAME,
            "info",
            "vllm-dsa-connector: guard %s installed on vLLM %s: MultiConnector refuses "
            "compositions with DSAConnector that cannot work. "
            "VLLM_DSA_DISABLE_RUNTIME_FIXES=1 turns this off.",
            guard.GUARD_NAME,
            version,
        )


def revert_runtime_fixes() -> bool:
    """Undo :func:`apply_runtime_fixes` in this process (for tests): every fix and guard.

    True if anything changed.
    """
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import deep_gemm_api, mtp_stale_caches, pp_intermediate
    from vllm_dsa_connector.fixes import multi_connector as guard

    with _LOCK:
        changed = deep_gemm_api.revert()
        changed = mtp_stale_caches.uninstall(CommonAttentionMetadata) or changed
        runner = pp_intermediate.runner_class()
        if runner is not None:
            changed = pp_intermediate.uninstall(runner) or changed
        multi = guard.multi_connector_class()
        if multi is not None:
            changed = guard.uninstall(multi) or changed
        return changed
