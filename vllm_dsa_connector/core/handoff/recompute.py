"""Why a decode engine (D) did not load a request's KV from P: a bounded set of reasons and the fix of each.

Every request D does not load from P falls back to vLLM's ``kv_load_failure_policy`` (``recompute``: D
prefills it locally; ``fail``: the request fails), or, for one reason (``already_taken``), is prefilled
locally at once. D names the reason in its log line, in ``vllm:dsa_kv_load_failures_total{reason}`` and in
the request's record; ``vllm-dsa explain REASON`` prints the fix (:data:`FIXES`).

Invariant: a reason is always one of :data:`REASONS` (a fixed label set: never a value taken from the
untrusted ``kv_transfer_params`` or a peer's error text); what cannot be told apart is ``other``.
"""

from __future__ import annotations

import re

__all__ = ["FIXES", "REASONS", "classify", "missing_key", "params_reason"]

#: reason -> (what happened, how to fix it). The order is the order ``vllm-dsa explain`` lists them in.
FIXES: dict[str, tuple[str, str]] = {
    "params_missing_key": (
        "kv_transfer_params lack a key DSAConnector's P hands out (the log line names it, e.g. remote_num_tokens)",
        "the router/proxy must forward P's kv_transfer_params to D unchanged, every key (a router that copies "
        "only the keys NixlConnector needs drops remote_num_tokens and remote_token); use python -m "
        "vllm_dsa_connector.proxy.app or vllm-router 0.1.17 (--vllm-pd-disaggregation), or fix the router to copy "
        "the whole object",
    ),
    "params_malformed": (
        "kv_transfer_params have a key of the wrong type or value (the log line names it)",
        "the router/proxy rewrote a value (a number sent as a string, a truncated block list): forward P's "
        "kv_transfer_params verbatim",
    ),
    "params_other_connector": (
        "kv_transfer_params were handed out by another connector (e.g. NixlConnector's transfer_mode \"pull\")",
        "P and D must both run DSAConnector (the same kv_connector in --kv-transfer-config), and the router must "
        "send the prefill leg to a DSAConnector P",
    ),
    "already_taken": (
        "another D request already loads the same P request (n > 1, or a prompt list sent as one request)",
        "send one prompt per request with n=1 through the P/D router; D prefills such a request locally",
    ),
    "auth_failed": (
        "P's and D's auth_secret differ (bad HMAC), or one side has none",
        "set the same auth_secret (VLLM_DSA_AUTH_SECRET, at least 16 characters) on every P and D engine",
    ),
    "version_mismatch": (
        "P and D speak different side-channel protocol versions (different vllm-dsa-connector releases)",
        "run the same vllm-dsa-connector release on P and D (upgrade both; a rolling upgrade recomputes meanwhile)",
    ),
    "handshake_failed": (
        "D could not complete the handshake with P (P's side channel unreachable, refused, or too slow)",
        "check that D reaches remote_host:remote_port (P's side_channel_host/side_channel_port; firewalls, "
        "container networking), that P is up, and raise handshake_timeout_s on a slow network",
    ),
    "peer_restarted": (
        "P restarted after handing out the params: its blocks, and the lease, are gone",
        "nothing to fix for one-off restarts; if P restarts often, look at P's logs (OOM, crashes)",
    ),
    "p_refused": (
        "P refused D's registration (lease expired, unknown request, a prompt that differs from P's)",
        "D registered too late: raise kv_lease_duration on P or cut the router's delay between the legs; a "
        "prompt mismatch means the router changed the prompt (chat template, truncation) between the legs",
    ),
    "p_unreachable": (
        "D's registration went unanswered (P's side channel stopped answering)",
        "check P's health and the network between D and P's side channel; raise handshake_timeout_s",
    ),
    "block_pairing": (
        "D could not pair its blocks with P's (P's token count differs from D's prompt)",
        "the router must send D the same prompt (same tokens) as P; check tokenizer and chat template on both",
    ),
    "timeout": (
        "the KV did not arrive within transfer_timeout_s",
        "raise transfer_timeout_s (and peer_setup_timeout_s for a fresh P), check the network/NIXL transport "
        "(UCX_TLS, RDMA), and P's load: a P that steps slowly posts late",
    ),
    "p_failed": (
        "P's worker reported it could not write the KV (its failure notice names why)",
        "read P's log for the request id; common causes: a route P cannot follow (ipc_mode across hosts), "
        "its staging arena full, the destination's set-up failed",
    ),
    "checksum": (
        "verify_transfers found bytes that differ from P's",
        "a transport or memory problem: report it with both engines' logs; keep verify_transfers on meanwhile",
    ),
    "other": (
        "a reason this release does not tell apart (the log line has the text)",
        "read D's log line for the request id",
    ),
}
REASONS: tuple[str, ...] = tuple(FIXES)

_MISSING = re.compile(r"missing required field `(\w{1,64})`")
#: (pattern over the failure text D's own code writes, reason), first match wins
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"bad HMAC|not authenticated|auth_secret", "auth_failed"),
    (r"protocol mismatch|protocol version", "version_mismatch"),
    (r"restarted|being redone|P is now", "peer_restarted"),
    (r"P refused the registration|refused the heartbeat", "p_refused"),
    (r"registration unanswered", "p_unreachable"),
    (r"handshake", "handshake_failed"),
    (r"block pairing|cannot pair", "block_pairing"),
    (r"no KV after|timed out", "timeout"),
    (r"checksum", "checksum"),
))


def missing_key(problem: str) -> str:
    """The key a malformed-params ``problem`` says is missing (``""``: none named)."""
    m = _MISSING.search(problem)
    return m.group(1) if m else ""


def params_reason(unusable: str, problem: str) -> str:
    """The reason of ``kv_transfer_params`` D could not use: ``unusable`` is ``other_connector`` or
    ``malformed`` (the ``reason`` of ``vllm:dsa_kv_unusable_params_total``), ``problem`` the parser's text."""
    if unusable == "other_connector":
        return "params_other_connector"
    return "params_missing_key" if missing_key(problem) else "params_malformed"


def classify(why: str) -> str:
    """The reason of a load D failed, from the text D's own code wrote (``other`` when none matches)."""
    for pattern, reason in _RULES:
        if pattern.search(why):
            return reason
    return "other"
