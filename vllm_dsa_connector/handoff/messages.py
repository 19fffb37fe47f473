"""Side-channel messages: typed msgspec structs, an authenticated envelope, and peer clock estimates.

Every message between two engines' schedulers is one :class:`Envelope` (msgpack) around one tagged
request struct (:data:`Request`); every reply is an envelope around a :class:`Reply`. Peers are
untrusted input: bytes are decoded straight into these types (a wrong type, a missing field or an
unknown kind is a :class:`MessageError`, answered with an error reply), then range-checked by
:func:`check_request` before anything is stored.

Authentication (optional, ``auth_secret``): the envelope carries an HMAC-SHA256 over protocol
version, wall-clock timestamp, a random nonce and the body. A receiver with a secret refuses a message
without a MAC or with a wrong one, one whose timestamp is more than :data:`REPLAY_WINDOW_S` away from
its own clock, and a nonce it has already seen within that window (replay). Replies are signed the
same way and checked by the client. Per request, P also issues a random ``token`` in the
``kv_transfer_params`` it hands to the proxy: registrations, heartbeats and cancels must present it,
so only the D that was handed the request can write into or release its KV.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from vllm_dsa_connector.handoff.wire import PROTOCOL_VERSION, Slots

#: Largest side-channel message accepted (the ZMQ socket drops bigger ones before they are read).
MAX_MESSAGE_BYTES = 16 << 20
#: Timestamps further than this from the receiver's wall clock are refused (with a secret).
REPLAY_WINDOW_S = 60.0
MAX_ID_CHARS = 512
MAX_REQS_PER_MESSAGE = 4096
#: Largest token position a registration may name (far beyond any context length)
MAX_TOKENS = 1 << 40


class MessageError(ValueError):
    """A peer's message that is malformed, out of range or not authentic; the text says which."""


class ReqRef(msgspec.Struct, frozen=True, array_like=True):
    """One P request and the token P issued for it."""

    p_req: str
    token: str


class MetaReq(msgspec.Struct, frozen=True, tag="meta"):
    """D -> P: the engine's worker payloads (the handshake)."""


class RegReq(msgspec.Struct, frozen=True, tag="reg"):
    """D -> P: write tokens ``[first_token, first_token + num_tokens)`` of ``p_req`` into ``d_blocks``.

    ``d_blocks[j]`` holds D's tokens ``[(first_token // Bd + j) * Bd, +Bd)``; P takes its own blocks of
    that span by its own block size (the two may differ).

    ``post_deadline`` is in P's monotonic clock (D maps its give-up time through its clock estimate):
    P never posts a WRITE for this registration after it.
    """

    p_req: str
    token: str
    d_engine: str
    d_req: str
    first_token: int
    num_tokens: int
    d_blocks: list[int]
    post_deadline: float
    verify: bool = False
    slots: Slots = {}
    d_payloads: list[bytes] | None = None


class HeartbeatReq(msgspec.Struct, frozen=True, tag="hb"):
    """D -> P: keep these leases alive (requests queued or loading on D)."""

    reqs: list[ReqRef]


class CancelReq(msgspec.Struct, frozen=True, tag="cancel"):
    """D -> P: D gave up on these requests; P answers per request whether a WRITE may still come."""

    reqs: list[ReqRef]


Request = MetaReq | RegReq | HeartbeatReq | CancelReq


class CancelState:
    """What P says about a cancelled request (``Reply.states``)."""

    NOT_POSTED = "not_posted"  # no WRITE was or will ever be posted: D may reuse the blocks now
    POSTED = "posted"  # a WRITE was handed to P's workers: it may land until the post deadline + write timeout


#: A producer's refusal of a handshake before its workers registered their KV caches (it is starting up).
NOT_READY = "workers have not registered their KV caches yet"


class Reply(msgspec.Struct, frozen=True):
    """Every answer. ``clock`` is P's monotonic clock when it answered (for :class:`ClockEstimate`)."""

    ok: bool
    error: str = ""
    clock: float = 0.0
    engine_id: str = ""
    payloads: list[bytes] = []
    need_payloads: bool = False
    write_timeout_s: float = 0.0
    states: dict[str, str] = {}


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """What travels: protocol version, wall-clock time, nonce, MAC (empty without a secret), body."""

    version: int
    ts: float
    nonce: bytes
    mac: bytes
    body: bytes


_enc = msgspec.msgpack.Encoder()
_dec_env = msgspec.msgpack.Decoder(Envelope)
_dec_req = msgspec.msgpack.Decoder(Request)
_dec_reply = msgspec.msgpack.Decoder(Reply)


def _mac(secret: bytes, version: int, ts: float, nonce: bytes, body: bytes) -> bytes:
    head = f"{version}|{ts!r}|".encode() + nonce + b"|"
    return hmac.new(secret, head + body, hashlib.sha256).digest()


class Authenticator:
    """Signs outgoing envelopes and checks incoming ones (a no-op without a secret, but the structure
    and protocol version are still checked)."""

    def __init__(self, secret: str | None, clock=time.time) -> None:  # noqa: ANN001 - injected clock
        self.secret = secret.encode() if secret else None
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def seal(self, obj: msgspec.Struct) -> bytes:
        """Envelope bytes for ``obj``."""
        body = _enc.encode(obj)
        ts, nonce = self._clock(), os.urandom(16)
        mac = _mac(self.secret, PROTOCOL_VERSION, ts, nonce, body) if self.secret else b""
        return _enc.encode(Envelope(PROTOCOL_VERSION, ts, nonce, mac, body))

    def open(self, raw: bytes) -> bytes:
        """The body of an envelope, after the version, MAC, freshness and replay checks."""
        try:
            env = _dec_env.decode(raw)
        except msgspec.DecodeError as e:
            raise MessageError(f"not a DSAConnector envelope: {e}") from None
        if env.version != PROTOCOL_VERSION:
            raise MessageError(f"protocol mismatch: peer speaks {env.version}, this side {PROTOCOL_VERSION}")
        if self.secret is None:
            return env.body
        if not env.mac:
            raise MessageError("message is not authenticated (this engine requires auth_secret)")
        if not hmac.compare_digest(env.mac, _mac(self.secret, env.version, env.ts, env.nonce, env.body)):
            raise MessageError("bad HMAC: the peer's auth_secret differs")
        now = self._clock()
        if not math.isfinite(env.ts) or abs(now - env.ts) > REPLAY_WINDOW_S:
            raise MessageError(f"stale message (timestamp {env.ts:.1f}, now {now:.1f}, window "
                               f"{REPLAY_WINDOW_S:.0f} s)")
        while self._seen and next(iter(self._seen.values())) < now - REPLAY_WINDOW_S:
            self._seen.popitem(last=False)
        if env.nonce in self._seen:
            raise MessageError("replayed message (nonce seen before)")
        self._seen[env.nonce] = now
        return env.body


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
    if not value or len(value) > MAX_ID_CHARS:
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
        if not req.d_blocks or len(req.d_blocks) > 1 << 20:
            raise MessageError(f"d_blocks must hold 1..{1 << 20} block ids, got {len(req.d_blocks)}")
        if not 0 <= req.first_token <= MAX_TOKENS:
            raise MessageError(f"first_token must be 0..{MAX_TOKENS}, got {req.first_token}")
        if not 1 <= req.num_tokens <= MAX_TOKENS:
            raise MessageError(f"num_tokens must be 1..{MAX_TOKENS}, got {req.num_tokens}")
        if not math.isfinite(req.post_deadline):
            raise MessageError("post_deadline is not a finite number")
        for per in req.slots.values():
            for off_size in per.values():
                if len(off_size) != 2 or off_size[0] < 0 or off_size[1] <= 0:
                    raise MessageError(f"staging slot {off_size} is not [offset >= 0, size > 0]")


@dataclass
class ClockEstimate:
    """P's monotonic clock as seen from D: ``p_time ~= d_time + offset``, within ``uncertainty`` (half the
    round trip of the best sample) plus a drift allowance that grows with the sample's age."""

    offset: float = 0.0
    uncertainty: float = math.inf
    taken_at: float = 0.0

    DRIFT = 1e-4  # 100 ppm between two hosts' monotonic clocks, generously

    def bound(self, now: float) -> float:
        """Current uncertainty of the offset (s)."""
        return self.uncertainty + self.DRIFT * max(now - self.taken_at, 0.0)

    def add_sample(self, sent: float, received: float, peer_clock: float) -> None:
        """One request/reply: D sent at ``sent``, got P's clock ``peer_clock`` back at ``received``."""
        if peer_clock <= 0 or received < sent:
            return
        u = (received - sent) / 2
        if u < self.bound(received):
            self.offset, self.uncertainty, self.taken_at = peer_clock - (sent + received) / 2, u, received

    def to_peer_before(self, d_time: float, now: float) -> float:
        """A time in P's clock that is surely not later than ``d_time`` on D's clock."""
        return d_time + self.offset - self.bound(now)
