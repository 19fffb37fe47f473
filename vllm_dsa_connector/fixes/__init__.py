"""Runtime fixes of vLLM bugs that affect DSA models, applied by the plugin's ``register()``.

Each fix is applied only when the installed vLLM is a known-affected release AND a
behaviour probe shows the bug; it is logged once per process, and
``VLLM_DSA_DISABLE_RUNTIME_FIXES=1`` turns all of them off. ``patches/`` holds the same
fixes as upstream diffs.

Fixes:

* ``mtp-draft-token-map`` (:mod:`.mtp_token_map`): the MTP/EAGLE draft loop reuses the
  target forward's token->request map (and num_computed_tokens) after rewriting the batch
  to one token per request.
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["FixReport", "apply_runtime_fixes", "revert_runtime_fixes"]

_LOCK = threading.Lock()
_LOGGER_NAME = "vllm.plugins." + __name__
_LOGGED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class FixReport:
    """Outcome of :func:`apply_runtime_fixes` for one fix.

    ``status`` is one of ``"applied"``, ``"already-applied"``, ``"disabled"``,
    ``"not-needed"`` (probe shows no bug), ``"unlisted-version"`` (probe shows the bug on a
    release we have not checked; left alone).
    """

    name: str
    status: str
    vllm_version: str
    detail: str


def _log_once(key: str, level: str, msg: str, *args: object) -> None:
    from vllm.logger import init_logger

    if key in _LOGGED:
        return
    _LOGGED.add(key)
    # Under the "vllm." hierarchy so the record goes through vLLM's configured handler
    # (VLLM_LOGGING_LEVEL, VLLM_LOGGING_STREAM); a bare package name has no handler and
    # Python drops INFO records.
    getattr(init_logger(_LOGGER_NAME), level)(msg, *args)


def apply_runtime_fixes() -> tuple[FixReport, ...]:
    """Detect and fix known vLLM bugs in this process. Idempotent and thread-safe."""
    import vllm
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import mtp_token_map as fix
    from vllm_dsa_connector.plugin import runtime_fixes_disabled

    version = getattr(vllm, "__version__", "unknown")
    with _LOCK:
        if runtime_fixes_disabled():
            _log_once(
                "disabled",
                "info",
                "vllm-dsa-connector: runtime fixes disabled by VLLM_DSA_DISABLE_RUNTIME_FIXES",
            )
            return (FixReport(fix.FIX_NAME, "disabled", version, "env"),)
        if fix.is_installed(CommonAttentionMetadata):
            return (FixReport(fix.FIX_NAME, "already-applied", version, ""),)
        result = fix.probe(CommonAttentionMetadata)
        if not result.buggy:
            _log_once(
                fix.FIX_NAME,
                "debug",
                "vllm-dsa-connector: vLLM %s does not need fix %s (%s)",
                version,
                fix.FIX_NAME,
                result.detail,
            )
            return (FixReport(fix.FIX_NAME, "not-needed", version, result.detail),)
        if not fix.version_affected(version):
            _log_once(
                fix.FIX_NAME,
                "warning",
                "vllm-dsa-connector: vLLM %s shows the stale MTP draft-loop token map (%s) "
                "but is not a release this fix was checked against; not patching. Apply "
                "patches/0001-*.patch or use vLLM 0.32.",
                version,
                result.detail,
            )
            return (FixReport(fix.FIX_NAME, "unlisted-version", version, result.detail),)
        fix.install(CommonAttentionMetadata)
        _log_once(
            fix.FIX_NAME,
            "info",
            "vllm-dsa-connector: applied runtime fix %s to vLLM %s: "
            "CommonAttentionMetadata.token_to_req_indices/compute_num_computed_tokens now "
            "follow the draft loop's batch layout (probe: %s). "
            "VLLM_DSA_DISABLE_RUNTIME_FIXES=1 turns this off.",
            fix.FIX_NAME,
            version,
            result.detail,
        )
        return (FixReport(fix.FIX_NAME, "applied", version, result.detail),)


def revert_runtime_fixes() -> bool:
    """Undo :func:`apply_runtime_fixes` in this process (for tests). True if anything changed."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_dsa_connector.fixes import mtp_token_map as fix

    with _LOCK:
        return fix.uninstall(CommonAttentionMetadata)
