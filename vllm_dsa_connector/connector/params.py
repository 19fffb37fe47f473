"""What the D side logs of ``kv_transfer_params`` it cannot use, and how it tells another connector's apart.

The params come through the router: untrusted. Everything here bounds its work and its output (short reprs,
a secret shown by its type and length only), so a hostile or broken proxy cannot make a log line long or
slow, and never makes a lease token appear in a log.
"""

from __future__ import annotations

import reprlib
from typing import Any

from vllm_dsa_connector.core.handoff.params import DSA_CONNECTOR
from vllm_dsa_connector.core.handoff.wire import LEGACY_TRANSFER_MODE, TRANSFER_MODE

__all__ = ["other_connector", "params_summary", "peer_key"]

#: kv_transfer_params keys whose value is never logged (a lease token lets its holder register for P's KV)
_SECRET_KEYS = frozenset({"remote_token"})
_SUMMARY_CHARS = 800  # the whole "received" part of the log line


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()  # bounded work and length whatever the (untrusted) values are
    r.maxstring, r.maxother, r.maxlong = 60, 60, 40
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 6
    r.maxlevel = 2
    return r


_REPR = _short_repr()


def params_summary(params: dict[str, Any]) -> str:
    """The keys of ``params`` with a short repr of each value (truncated; a secret shown by its type and
    length only), so the log line says what D received, whatever the params are."""
    parts = []
    for key in sorted(params, key=str)[:40]:
        value = params[key]
        shown = (f"<{type(value).__name__}, {len(value)} chars>" if key in _SECRET_KEYS and isinstance(value, str)
                 else _REPR.repr(value))
        parts.append(f"{_REPR.repr(key)}: {shown}")
    out = "{" + ", ".join(parts) + (", ..." if len(params) > 40 else "") + "}"
    return out if len(out) <= _SUMMARY_CHARS else out[:_SUMMARY_CHARS] + "...}"


def peer_key(params: dict[str, Any]) -> str:
    """Which peer handed out ``params`` (unusable ones are logged once per peer): its ``remote_engine_id``
    when present, else ``remote_host:remote_port``, else ``"unknown"`` (short reprs: the params are untrusted)."""
    engine = params.get("remote_engine_id")
    if engine not in (None, ""):
        return f"engine {_REPR.repr(engine)}"
    host, port = params.get("remote_host"), params.get("remote_port")
    if host not in (None, "") or port not in (None, ""):
        return ":".join(v[:80] if isinstance(v, str) else _REPR.repr(v) for v in (host, port))
    return "unknown"


def other_connector(params: dict[str, Any]) -> str:
    """Why ``params`` are another connector's (``""``: they may be DSAConnector's): a ``kv_connector`` naming
    another connector, or a ``transfer_mode`` that is not DSAConnector's (e.g. NixlConnector's ``"pull"``, or
    a bare ``"push"``: protocol 6's mode is taken only together with ``kv_connector`` ``"DSAConnector"``).
    A value that is not a string names nothing: such params are malformed, not another connector's."""
    name = params.get("kv_connector", DSA_CONNECTOR)
    if isinstance(name, str) and name != DSA_CONNECTOR:
        return f"kv_connector {_REPR.repr(name)} names another connector (DSAConnector's P hands out {DSA_CONNECTOR!r})"
    mode = params.get("transfer_mode", TRANSFER_MODE)
    if mode == LEGACY_TRANSFER_MODE and params.get("kv_connector") == DSA_CONNECTOR:
        return ""  # an older DSAConnector P (protocol 6)
    if isinstance(mode, str) and mode != TRANSFER_MODE:
        bare = (f" without kv_connector {DSA_CONNECTOR!r}" if mode == LEGACY_TRANSFER_MODE else "")
        return (f"transfer_mode {_REPR.repr(mode)}{bare} is another producer's (DSAConnector's P hands out "
                f"{TRANSFER_MODE!r})")
    return ""
