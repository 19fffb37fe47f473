"""Side-channel messages: typed msgspec structs and an authenticated envelope.

The peer clock estimate (:class:`ClockEstimate`, :mod:`.clock`) and the request identifiers P, D and the
proxy share (:func:`check_transfer_id`, :func:`prompt_digest`, :mod:`.ids`) live in their own modules;
:func:`transfer_ref` stays, as it makes a :class:`ReqRef`.

Every message between two engines' schedulers is one :class:`Envelope` (msgpack) around one tagged
request struct (:data:`Request`); every reply is an envelope around a :class:`Reply`. Peers are
untrusted input: bytes are decoded straight into these types (a wrong type, a missing field or an
unknown kind is a :class:`MessageError`, answered with an error reply), then range-checked by
:func:`check_request` before anything is stored.

Every struct bounds its lists, dicts, strings and bytes (``msgspec.Meta``): an oversize message is
refused while it is decoded, at the first field over its bound, before it costs memory or time (a raw
size cap, :data:`MAX_MESSAGE_BYTES`, comes first).

Every envelope names its sender (:class:`Origin`: the engine id and the *epoch*, a random 63-bit id drawn once
per engine start, :func:`new_epoch`), so a peer learns when the engine behind an id restarted: a producer
replaces its record of a consumer whose registration comes from a new epoch (:mod:`.producer`), a consumer
redoes the handshake with a producer whose epoch changed (:mod:`.peers`).

Authentication (optional, ``auth_secret``): the envelope carries an HMAC-SHA256 over fixed-size and
length-prefixed fields (direction, protocol version, wall-clock timestamp, a random nonce, the nonce of
the request a reply answers, the sender's engine id and epoch, the body), so no two envelopes share a MAC
input. The secret is shared by every engine: it proves the sender is one of them, not which one; the
sender's name is what it signed, and P holds it to that name (a registration names only its sender's
engine). A receiver with a secret
refuses a message without a MAC or with a wrong one, one whose timestamp is more than
:data:`REPLAY_WINDOW_S` away from its own clock (either way), and a nonce it has already seen; it keeps
each nonce until the message's own expiry (its timestamp + the window, on the receiver's clock), so a
sender whose clock runs ahead cannot be replayed either. Every reply names the nonce of the request it
answers (``reply_to``, inside the MAC): a reply taken from another exchange is refused by the client. A
server signs only replies to messages it authenticated; a message it could not open gets an unsigned
refusal (``Reply.unread``), which a client treats as "not answered" (transient), never as the peer's
word. Per request, P also issues a random ``token`` in the ``kv_transfer_params`` it hands to the proxy:
registrations, heartbeats and cancels must present it, so only the D that was handed the request can
write into or release its KV.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Annotated

import msgspec

from vllm_dsa_connector.core.handoff.ids import (
    DIGEST_CHARS,
    TRANSFER_REF_PREFIX,
)
from vllm_dsa_connector.core.handoff.ids import prompt_digest as prompt_digest
from vllm_dsa_connector.core.handoff.wire import (
    MAX_ERROR_CHARS,
    MAX_ID_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_WORKERS,
    PROTOCOL_VERSION,
    Epoch,
    Id,
    Routes,
)
from vllm_dsa_connector.core.transfer.paths import PathName

#: Timestamps further than this from the receiver's wall clock (either way) are refused (with a secret).
REPLAY_WINDOW_S = 60.0
MAX_REQS_PER_MESSAGE = 4096
#: Most D blocks one registration may name (1 Mi tokens in 4-token blocks)
MAX_BLOCKS_PER_REG = 1 << 18
#: Largest token position a registration may name (far beyond any context length)
MAX_TOKENS = 1 << 40
NONCE_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256
#: Most nonces a receiver remembers (authentic messages inside two windows); beyond it the oldest expiry goes
MAX_SEEN_NONCES = 1 << 20

Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
def transfer_ref(transfer_id: str) -> ReqRef:
    """How D names an early registration's P request in registrations, heartbeats and cancels: the transfer id
    stands for P's request id (with :data:`TRANSFER_REF_PREFIX`) and for its token."""
    return ReqRef(TRANSFER_REF_PREFIX + transfer_id, transfer_id)


class MessageError(ValueError):
    """A peer's message that is malformed, out of range or not authentic; the text says which."""


def new_epoch() -> int:
    """A fresh instance id for one engine start (random, never 0: 0 means "not known")."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True)
class Origin:
    """Who sent an envelope: the engine id and the epoch of its current start (``""``/0: anonymous)."""

    engine_id: str = ""
    epoch: int = 0

    def __str__(self) -> str:
        return f"{self.engine_id!r} (epoch {self.epoch:016x})"


ANONYMOUS = Origin()


class ReqRef(msgspec.Struct, frozen=True, array_like=True):
    """One P request and the token P issued for it."""

    p_req: Id
    token: Id


class MetaReq(msgspec.Struct, frozen=True, tag="meta"):
    """D -> P: the engine's worker payloads (the handshake)."""


class RegReq(msgspec.Struct, frozen=True, tag="reg"):
    """D -> P: write tokens ``[first_token, first_token + num_tokens)`` of ``p_req`` into ``d_blocks``.

    ``d_blocks[j]`` holds D's tokens ``[(first_token // Bd + j) * Bd, +Bd)``; P takes its own blocks of
    that span by its own block size (the two may differ).

    ``post_deadline`` is in P's monotonic clock (D maps its give-up time through its clock estimate):
    P never posts a WRITE for this registration after it.
    """

    p_req: Id
    token: Id
    d_engine: Id
    d_req: Id
    first_token: int
    num_tokens: int
    d_blocks: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_REG)]
    post_deadline: float
    verify: bool = False
    routes: Routes = {}  # D's choice of path per (D rank, P rank) pair (absent: direct)
    d_payloads: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]],
                          msgspec.Meta(max_length=MAX_WORKERS)] | None = None
    prompt_tokens: int = 0  # D's prompt length (0: not stated); P refuses a registration of another length
    prompt_digest: Annotated[str, msgspec.Meta(max_length=DIGEST_CHARS)] = ""  # :func:`prompt_digest` of D's prompt


class HeartbeatReq(msgspec.Struct, frozen=True, tag="hb"):
    """D -> P: keep these leases alive (requests queued or loading on D)."""

    reqs: Annotated[list[ReqRef], msgspec.Meta(max_length=MAX_REQS_PER_MESSAGE)]


class CancelReq(msgspec.Struct, frozen=True, tag="cancel"):
    """D -> P: D gave up on these requests; P answers per request whether a WRITE may still come."""

    reqs: Annotated[list[ReqRef], msgspec.Meta(max_length=MAX_REQS_PER_MESSAGE)]


Request = MetaReq | RegReq | HeartbeatReq | CancelReq


class CancelState:
    """What P says about a cancelled request (``Reply.states``)."""

    NOT_POSTED = "not_posted"  # no WRITE was or will ever be posted: D may reuse the blocks now
    POSTED = "posted"  # a WRITE was handed to P's workers: it may land until the post deadline + write timeout


#: A producer's refusal of a handshake before its workers registered their KV caches (it is starting up).
NOT_READY = "workers have not registered their KV caches yet"


class Reply(msgspec.Struct, frozen=True):
    """Every answer. ``clock`` is P's monotonic clock when it answered (for :class:`ClockEstimate`).

    ``unread``: the server could not decode or authenticate the request, so its handler never saw it; such a
    refusal is never signed and says nothing about the request's fate.
    """

    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""
    clock: float = 0.0
    engine_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    payloads: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_PAYLOAD_BYTES)]],
                        msgspec.Meta(max_length=MAX_WORKERS)] = []
    need_payloads: bool = False
    write_timeout_s: float = 0.0
    states: Annotated[dict[Id, Annotated[str, msgspec.Meta(max_length=16)]],
                      msgspec.Meta(max_length=MAX_REQS_PER_MESSAGE)] = {}
    unread: bool = False
    staging_full: bool = False  # P's staging arena is (nearly) full: route its next requests direct


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """What travels: protocol version, wall-clock time, nonce, the nonce of the request a reply answers
    (empty in a request), the sender's engine id and epoch (:class:`Origin`), MAC (empty without a secret,
    and in a refusal of a message that was not read), body."""

    version: int
    ts: float
    nonce: Nonce
    reply_to: Annotated[bytes, msgspec.Meta(max_length=NONCE_BYTES)]
    sender: Id
    epoch: Epoch
    mac: Annotated[bytes, msgspec.Meta(max_length=MAC_BYTES)]
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_MESSAGE_BYTES)]

    @property
    def origin(self) -> Origin:
        """The sender this envelope names."""
        return Origin(self.sender, self.epoch)


class _Version(msgspec.Struct, frozen=True, array_like=True):
    """The first field of any protocol's envelope (read first, so an older peer is named as such)."""

    version: int


_enc = msgspec.msgpack.Encoder()
_dec_version = msgspec.msgpack.Decoder(_Version)
_dec_env = msgspec.msgpack.Decoder(Envelope)
_dec_req = msgspec.msgpack.Decoder(Request)
_dec_reply = msgspec.msgpack.Decoder(Reply)

_REQUEST, _REPLY = b"Q", b"R"


def mac_input(direction: bytes, version: int, ts: float, nonce: bytes, reply_to: bytes, body: bytes,
              sender: str = "", epoch: int = 0) -> bytes:
    """What the MAC covers: fixed-size fields, then each variable one prefixed by its length (one byte
    string per envelope, and no two envelopes share one)."""
    head = struct.pack(">cIdQB", direction, version, ts, epoch, len(nonce)) + nonce
    name = sender.encode()
    return (head + struct.pack(">B", len(reply_to)) + reply_to + struct.pack(">H", len(name)) + name
            + struct.pack(">Q", len(body)) + body)


def _mac(secret: bytes, direction: bytes, env: Envelope) -> bytes:
    data = mac_input(direction, env.version, env.ts, env.nonce, env.reply_to, env.body, env.sender, env.epoch)
    return hmac.new(secret, data, hashlib.sha256).digest()


def decode_envelope(raw: bytes) -> Envelope:
    """An envelope of this protocol; :class:`MessageError` naming what is wrong (size, version, shape)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} B (at most {MAX_MESSAGE_BYTES} B)")
    try:
        version = _dec_version.decode(raw).version
    except msgspec.DecodeError as e:
        raise MessageError(f"not a DSAConnector envelope: {e}") from None
    if version != PROTOCOL_VERSION:
        raise MessageError(f"protocol mismatch: peer speaks {version}, this side {PROTOCOL_VERSION}")
    try:
        return _dec_env.decode(raw)
    except msgspec.DecodeError as e:
        raise MessageError(f"not a DSAConnector envelope: {e}") from None


class Authenticator:
    """Signs outgoing envelopes and checks incoming ones (a no-op without a secret, but the structure
    and protocol version are still checked). Thread-safe: a server thread and client threads share one."""

    def __init__(self, secret: str | None, clock=time.time) -> None:  # noqa: ANN001 - injected clock
        self.secret = secret.encode() if secret else None
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[bytes, float] = {}  # nonce -> the message's expiry (its timestamp + window)
        self._expiry: list[tuple[float, bytes]] = []  # heap of (expiry, nonce)

    def new_nonce(self) -> bytes:
        """A fresh random nonce."""
        return os.urandom(NONCE_BYTES)

    def seal(self, obj: msgspec.Struct, nonce: bytes | None = None, origin: Origin = ANONYMOUS) -> bytes:
        """Envelope bytes of request ``obj`` sent by ``origin`` (under ``nonce``, fresh if None)."""
        env = Envelope(PROTOCOL_VERSION, self._clock(), nonce or self.new_nonce(), b"", origin.engine_id,
                       origin.epoch, b"", _enc.encode(obj))
        if self.secret:
            env = msgspec.structs.replace(env, mac=_mac(self.secret, _REQUEST, env))
        return _enc.encode(env)

    def seal_reply(self, reply: Reply, reply_to: bytes, signed: bool = True, origin: Origin = ANONYMOUS) -> bytes:
        """Envelope bytes of ``reply`` (from ``origin``) to the request whose nonce is ``reply_to``;
        ``signed=False`` for a refusal of a message that was not authenticated (never sign an answer to an
        unknown sender)."""
        env = Envelope(PROTOCOL_VERSION, self._clock(), self.new_nonce(), reply_to, origin.engine_id, origin.epoch,
                       b"", _enc.encode(reply))
        if self.secret and signed:
            env = msgspec.structs.replace(env, mac=_mac(self.secret, _REPLY, env))
        return _enc.encode(env)

    def open(self, raw: bytes) -> Envelope:
        """A request's envelope, after the size, version, MAC, freshness and replay checks."""
        env = decode_envelope(raw)
        self.check(env)
        return env

    def check(self, env: Envelope) -> None:
        """Authenticate a request's envelope; :class:`MessageError` naming what is wrong."""
        if env.reply_to:
            raise MessageError("a reply where a request was expected")
        if self.secret is None:
            return
        if not env.mac:
            raise MessageError("message is not authenticated (this engine requires auth_secret)")
        if not hmac.compare_digest(env.mac, _mac(self.secret, _REQUEST, env)):
            raise MessageError("bad HMAC: the peer's auth_secret differs")
        now = self._clock()
        if not math.isfinite(env.ts) or abs(now - env.ts) > REPLAY_WINDOW_S:
            raise MessageError(f"stale message: the sender's clock is {env.ts - now:+.1f} s from this side's "
                               f"(timestamp {env.ts:.1f}, now {now:.1f}, window {REPLAY_WINDOW_S:.0f} s)")
        with self._lock:
            while self._expiry and (self._expiry[0][0] < now or len(self._expiry) > MAX_SEEN_NONCES):
                _, old = heapq.heappop(self._expiry)
                self._seen.pop(old, None)
            if env.nonce in self._seen:
                raise MessageError("replayed message (nonce seen before)")
            # fresh until its own timestamp + window (on this clock): remember the nonce as long
            expiry = env.ts + REPLAY_WINDOW_S
            self._seen[env.nonce] = expiry
            heapq.heappush(self._expiry, (expiry, env.nonce))

    def open_reply(self, raw: bytes, nonce: bytes) -> tuple[Envelope, Reply]:
        """The envelope and reply answering our request ``nonce``. :class:`UnboundReply` when it is not the
        peer's authentic answer to that request (with a secret: anything before the MAC checks out, which
        anyone on the path could have sent); :class:`MessageError` when an authentic reply is malformed."""
        try:
            env = decode_envelope(raw)
        except MessageError as e:
            if self.secret is None:
                raise
            raise UnboundReply(f"unreadable reply: {e}") from None
        if env.reply_to != nonce:
            raise UnboundReply(f"the reply answers another message (reply_to {env.reply_to.hex() or 'empty'}, "
                               f"our nonce {nonce.hex()})")
        if self.secret is not None and not env.mac:
            try:
                said = decode_reply(env.body).error or "no error given"
            except MessageError:
                said = "unreadable"
            raise UnboundReply(f"unsigned reply (the peer could not read or authenticate our message?): {said}",
                               env=env)
        if self.secret is not None and not hmac.compare_digest(env.mac, _mac(self.secret, _REPLY, env)):
            raise UnboundReply("bad HMAC on the reply: not signed with this side's auth_secret", env=env)
        return env, decode_reply(env.body)


class UnboundReply(MessageError):
    """A reply that is not the peer's signed answer to our request (taken from another exchange, unsigned or
    forged): says nothing about the request's fate. ``env``: its envelope, when it decoded (for its clock)."""

    def __init__(self, message: str, env: Envelope | None = None) -> None:
        super().__init__(message)
        self.env = env


def decode_request(body: bytes) -> Request:
    """A typed request; :class:`MessageError` naming what is wrong."""
    try:
        return _dec_req.decode(body)
    except msgspec.DecodeError as e:
        raise MessageError(f"malformed request: {e}") from None


def decode_reply(body: bytes) -> Reply:
    """A typed reply; :class:`MessageError` naming what is wrong."""
    try:
        return _dec_reply.decode(body)
    except msgspec.DecodeError as e:
        raise MessageError(f"malformed reply: {e}") from None


def _check_id(name: str, value: str) -> None:
    if not value or len(value) > MAX_ID_CHARS:  # the length is bounded while decoding too
        raise MessageError(f"{name} must be 1..{MAX_ID_CHARS} characters, got {len(value)}")


def check_request(req: Request) -> None:
    """Range checks that need no state (ids, counts, finite numbers); the owner checks the rest."""
    if isinstance(req, HeartbeatReq | CancelReq):
        if len(req.reqs) > MAX_REQS_PER_MESSAGE:
            raise MessageError(f"{len(req.reqs)} requests in one message (at most {MAX_REQS_PER_MESSAGE})")
        for r in req.reqs:
            _check_id("p_req", r.p_req)
    elif isinstance(req, RegReq):
        for name in ("p_req", "token", "d_engine", "d_req"):
            _check_id(name, getattr(req, name))
        if not req.d_blocks or len(req.d_blocks) > MAX_BLOCKS_PER_REG:
            raise MessageError(f"d_blocks must hold 1..{MAX_BLOCKS_PER_REG} block ids, got {len(req.d_blocks)}")
        if not 0 <= req.first_token <= MAX_TOKENS:
            raise MessageError(f"first_token must be 0..{MAX_TOKENS}, got {req.first_token}")
        if not 1 <= req.num_tokens <= MAX_TOKENS:
            raise MessageError(f"num_tokens must be 1..{MAX_TOKENS}, got {req.num_tokens}")
        if not math.isfinite(req.post_deadline):
            raise MessageError("post_deadline is not a finite number")
        for per in req.routes.values():
            for route in per.values():
                if route.path == PathName.BOUNCE and (route.offset < 0 or route.size <= 0):
                    raise MessageError(f"bounce route [{route.offset}, +{route.size}) is not [offset >= 0, size > 0]")
