"""``kv_transfer_params``, typed once: the three bodies the key names carry between the proxy, P and D.

vLLM carries ``kv_transfer_params`` as a JSON object (a dict on the request), so the types here meet vLLM
and the router only at the boundary: a struct is built where the params are made and turned into a dict
(``to_dict``) just before vLLM or the HTTP body takes them, and read back (``from_dict``) where they are
read. Three messages share the key names:

- :class:`PrefillParams`: the proxy's prefill leg to P (vllm-router's six keys, P fills in the
  ``remote_*``), with the pair's ``transfer_id`` under early registration;
- :class:`RemoteParams`: what P hands out after its prefill and D reads (through the proxy: untrusted);
- :class:`EarlyParams`: what the proxy sends D together with P's leg under early registration (P's side
  channel as learnt from an earlier answer, the pair's ``transfer_id``); D reads it as a
  :class:`RemoteParams` naming P's request by the transfer id.

Params D cannot use are told apart and logged here too: :func:`other_connector` (another connector's params,
e.g. NixlConnector's), :func:`params_summary` and :func:`peer_key` (what the log line shows: bounded work and
output, short reprs, a secret shown by its type and length only, so a hostile or broken proxy cannot make a
log line long or slow, and a lease token never appears in a log).

Invariant: every string and list the params hold is bounded (like the side channel's wire structs), and D
never takes params it cannot check: :meth:`RemoteParams.from_dict` raises ``ValueError`` naming the missing
or bad key. Engine-free (no vLLM); the proxy, P's scheduler and D's scheduler share it.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any

import msgspec

from vllm_dsa_connector.core.handoff.ids import TRANSFER_REF_PREFIX, check_transfer_id
from vllm_dsa_connector.core.handoff.messages import MAX_BLOCKS_PER_REG, ReqRef
from vllm_dsa_connector.core.handoff.wire import LEGACY_TRANSFER_MODE, MAX_ID_CHARS, TRANSFER_MODE

__all__ = [
    "DSA_CONNECTOR",
    "EarlyParams",
    "PrefillParams",
    "RemoteParams",
    "is_early_prefill",
    "other_connector",
    "params_summary",
    "peer_key",
]

#: The ``kv_connector`` DSAConnector's P names in the params it hands out (its class name in vLLM).
DSA_CONNECTOR = "DSAConnector"

_Name = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]  # ids, hosts, modes
_Blocks = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_REG)]


class PrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    """The proxy's ``kv_transfer_params`` for P's leg: decode remotely; the ``remote_*`` placeholders are
    vllm-router's (``null``, P fills them in its answer); ``transfer_id`` (early registration) names the
    pair so D may register before P finished."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None
    transfer_id: _Name = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object P's leg carries (``transfer_id`` only when set)."""
        out = msgspec.structs.asdict(self)
        if not self.transfer_id:
            del out["transfer_id"]
        return out


def is_early_prefill(params: dict[str, Any] | None) -> bool:
    """Whether ``params`` (on P: the request's dict, as vLLM holds it) are those of an early registration's
    prefill leg (:class:`PrefillParams` with a ``transfer_id``)."""
    return bool(
        params
        and params.get("do_remote_decode")
        and not params.get("do_remote_prefill")
        and "transfer_id" in params
    )


class RemoteParams(msgspec.Struct, frozen=True):
    """The ``kv_transfer_params`` P hands out for D after its prefill, and what D reads of them (through the
    proxy: untrusted, checked by :meth:`from_dict`). The trailing fields are P's word to the router and the
    proxy (``kv_connector`` tells them apart from another connector's); D reads only :data:`_D_READS`."""

    remote_engine_id: (
        str  # these three: 1..MAX_ID_CHARS, checked by from_dict (its error names the key)
    )
    remote_request_id: str
    remote_host: _Name
    remote_port: int
    remote_block_ids: _Blocks
    remote_num_tokens: int
    remote_token: str
    transfer_mode: _Name = TRANSFER_MODE
    remote_epoch: int = 0  # the P start holding the lease (0: not named)
    transfer_id: _Name = (
        ""  # early registration: the proxy's id of this P/D pair (P has not finished yet)
    )
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    tp_size: int = 1
    pp_size: int = 1
    kv_connector: _Name = DSA_CONNECTOR

    @property
    def ref(self) -> ReqRef:
        return ReqRef(self.remote_request_id, self.remote_token)

    @property
    def early(self) -> bool:
        """Sent to D together with P's leg (early registration): P's blocks and token count are not known
        yet, P takes its own blocks of the span when they exist."""
        return bool(self.transfer_id)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object P hands out (vLLM returns it to the proxy in the answer); ``transfer_id`` only when
        set (D's view of early params: P's answer never carries one)."""
        out = msgspec.structs.asdict(self)
        if not self.transfer_id:
            del out["transfer_id"]
        return out

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemoteParams:
        """Typed params D loads by; ``ValueError`` naming the problem. Params with a ``transfer_id`` and no
        ``remote_request_id`` are an early registration's (:class:`EarlyParams`): P's request is then named
        by the transfer id (:func:`~.messages.transfer_ref`), its blocks are P's to find."""
        if "transfer_id" in params and "remote_request_id" not in params:
            early = EarlyParams.from_dict(params)
            params = {
                **{k: params[k] for k in EarlyParams.__struct_fields__ if k in params},
                "remote_request_id": TRANSFER_REF_PREFIX + early.transfer_id,
                "remote_token": early.transfer_id,
                "remote_block_ids": [],
                "remote_num_tokens": 0,
            }
        fields = {k: params[k] for k in _D_READS if k in params}
        try:
            rp = msgspec.convert(fields, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"malformed kv_transfer_params: {e}") from None
        if not 0 < rp.remote_port < 65536:
            raise ValueError(f"remote_port {rp.remote_port} out of range")
        if not 0 <= rp.remote_epoch < 1 << 63:
            raise ValueError(f"remote_epoch {rp.remote_epoch} out of range (0..2**63-1)")
        if rp.remote_num_tokens < 0 or any(b < 0 for b in rp.remote_block_ids):
            raise ValueError("negative remote_num_tokens or block id")
        for name in ("remote_engine_id", "remote_request_id", "remote_token"):
            # P refuses a whole heartbeat or cancel naming one id it cannot take: never let one through
            if not 0 < len(getattr(rp, name)) <= MAX_ID_CHARS:
                raise ValueError(
                    f"{name} must be 1..{MAX_ID_CHARS} characters, got {len(getattr(rp, name))}"
                )
        return rp


#: The keys of :class:`RemoteParams` D reads (the others are P's word to the router: never a reason to fail)
_D_READS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_token",
    "transfer_mode",
    "remote_epoch",
    "transfer_id",
)


class EarlyParams(msgspec.Struct, frozen=True, kw_only=True):
    """The ``kv_transfer_params`` of an early registration: the proxy sends them to D together with P's leg
    (P's side channel as learnt from an earlier answer of P, and the pair's ``transfer_id``)."""

    remote_engine_id: _Name
    remote_host: _Name
    remote_port: int
    transfer_id: _Name
    transfer_mode: _Name = TRANSFER_MODE
    remote_epoch: int = 0
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    kv_connector: _Name = DSA_CONNECTOR

    def to_dict(self) -> dict[str, Any]:
        """The JSON object D's leg carries (``remote_epoch`` only when named)."""
        out = msgspec.structs.asdict(self)
        if not self.remote_epoch:
            del out["remote_epoch"]
        return out

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> EarlyParams:
        """Typed early params (D side); ``ValueError`` naming the problem (the transfer id checked)."""
        fields = {
            k: params[k]
            for k in (
                "remote_engine_id",
                "remote_host",
                "remote_port",
                "transfer_id",
                "transfer_mode",
                "remote_epoch",
            )
            if k in params
        }
        try:
            early = msgspec.convert(fields, cls)
            check_transfer_id(early.transfer_id)
        except (msgspec.ValidationError, ValueError) as e:
            raise ValueError(f"malformed kv_transfer_params: {e}") from None
        return early

    @classmethod
    def from_answer(cls, answer: dict[str, Any], transfer_id: str) -> EarlyParams | None:
        """D's params of an early registration from an earlier answer of P (``answer``: the
        ``kv_transfer_params`` P handed out, P's engine and side channel) and the pair's ``transfer_id``;
        ``None`` when the answer does not describe a DSAConnector P."""
        keys = ("remote_engine_id", "remote_host", "remote_port")
        if answer.get("kv_connector") != DSA_CONNECTOR or any(not answer.get(k) for k in keys):
            return None
        return cls(
            remote_engine_id=answer["remote_engine_id"],
            remote_host=answer["remote_host"],
            remote_port=answer["remote_port"],
            transfer_id=transfer_id,
            transfer_mode=answer.get("transfer_mode", TRANSFER_MODE),
        )


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
