"""The ZMQ side channel and the handshake checks.

Each engine's scheduler-side connector serves one ROUTER socket (like vLLM's NixlConnector). Messages
are the typed structs of :mod:`.messages` in an (optionally HMAC-authenticated) envelope; every reply is
a :class:`~.messages.Reply`. Every envelope names its sender (:class:`~.messages.Origin`: engine id and
epoch); the handler gets the sender of each request, a client the sender of each reply (:func:`exchange`):

- ``meta``: the engine's worker payloads (:class:`~.wire.RankPayload`, one per (pp, tp) worker).
- ``reg`` (D -> P): "write request ``p_req`` into my blocks"; P replies at once whether it still holds
  the request's KV (a lease), so D fails fast instead of waiting for a timeout.
- ``hb`` (D -> P): lease renewal for the listed P requests.
- ``cancel`` (D -> P): D gave up on these P requests; P answers per request whether a WRITE may come.

A message that does not decode, is out of range, is too large (``MAX_MESSAGE_BYTES``: ZMQ drops it; a
field over its bound is refused while decoding) or fails authentication gets an error reply and one log
line; it never reaches the handler's state. Every reply names the nonce of the request it answers; the
server signs only replies to messages it authenticated (an unread one gets an unsigned ``Reply.unread``
refusal), and the client accepts only a reply bound to its own request and, with a secret, signed: anything
else is a transient :class:`HandshakeError` (as if unanswered), never the peer's word. A clock skew over
the replay window is such a refusal too: D retries it inside the transfer budget and logs the skew.

Clients use a fresh REQ socket with send/receive timeouts and ``linger=0``: a dead peer costs one timeout
on a background thread, never a hung engine.

:func:`validate_peer` is the compatibility check run on the handshake result: it refuses any mismatch
that would corrupt KV (model, dtype, KV cache dtype, attention backend, block size, indexer
mask/pattern, head size), naming what differs, and builds the transfer plan, which handles PP and TP
reshards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from vllm_dsa_connector.core.handoff.clock import ClockEstimate
from vllm_dsa_connector.core.handoff.messages import (
    ANONYMOUS,
    NOT_READY,
    Authenticator,
    MessageError,
    MetaReq,
    Origin,
    Reply,
    Request,
    UnboundReply,
    check_request,
    decode_envelope,
    decode_request,
)
from vllm_dsa_connector.core.handoff.wire import (
    MAX_ERROR_CHARS,
    MAX_MESSAGE_BYTES,
    RankPayload,
    decode_payload,
)

if TYPE_CHECKING:
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan

logger = logging.getLogger(__name__)

__all__ = ["HandshakeError", "PeerMeta", "SideChannelServer", "UnauthenticatedSideChannel", "exchange",
           "fetch_payloads", "is_loopback", "request", "validate_peer"]


class HandshakeError(RuntimeError):
    """The peer cannot be used: unreachable, or its KV layout would corrupt ours. The message says why.

    ``transient``: a later attempt may succeed (no answer: timeout or socket error; or the peer's workers
    are not up yet); otherwise the peer refused, or its answer was unusable, and asking again changes nothing.
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


#: ``handler(request, sender) -> Reply``: ``sender`` is the origin the request's envelope names (signed with a
#: secret; whoever holds the secret may name any engine, the handler holds it to that name)
Handler = Callable[[Request, Origin], Reply]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a side channel's bind address) is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


class UnauthenticatedSideChannel(ValueError):
    """A side channel on a non-loopback address without a secret, and nobody said that is wanted."""


class SideChannelServer:
    """A ROUTER socket on a daemon thread; ``handler(request, sender) -> Reply`` runs on that thread; replies
    name ``origin`` (this engine and its epoch) as their sender."""

    def __init__(self, host: str, port: int, handler: Handler, auth: Authenticator | None = None,
                 clock: Callable[[], float] = time.monotonic, origin: Origin = ANONYMOUS, *,
                 allow_unauthenticated: bool = False) -> None:
        if (auth is None or auth.secret is None) and not is_loopback(host) and not allow_unauthenticated:
            raise UnauthenticatedSideChannel(
                f"DSAConnector side channel on {host}:{port} without auth_secret: anyone who reaches it could "
                "register writes into or cancel this engine's transfers; set auth_secret on both engines, or "
                "allow_unauthenticated_side_channel if no one else can reach this address")
        self._handler = handler
        self.origin = origin
        self._auth = auth or Authenticator(None)
        self._clock = clock
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise HandshakeError(f"DSAConnector side channel cannot bind {host}:{port}: {e}") from None
        self.host = host
        if self._auth.secret is None and not is_loopback(host):
            logger.warning(
                "DSAConnector side channel binds %s:%d without auth_secret (allow_unauthenticated_side_channel "
                "is set): anyone who reaches it can register writes into or cancel this engine's transfers",
                host, self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsa-side-channel", daemon=True)
        self._thread.start()

    def handle_raw(self, raw: bytes) -> Reply:
        """Decode, authenticate, check and handle one message; never raises."""
        return self.answer(raw)[0]

    def answer(self, raw: bytes) -> tuple[Reply, bytes, bool]:
        """``(reply, nonce of the request, signed)`` for one message: a message that does not open (size,
        version, shape, MAC, freshness, replay) gets an unsigned ``unread`` refusal; never raises."""
        nonce = b""
        try:
            env = decode_envelope(raw)
            nonce = env.nonce
            self._auth.check(env)
        except MessageError as e:
            logger.warning("DSAConnector side channel: refused a message it could not open: %s", e)
            return Reply(False, error=f"refused: {e}"[:MAX_ERROR_CHARS], clock=self._clock(), unread=True), nonce, False
        try:
            req = decode_request(env.body)
            check_request(req)
            return self._handler(req, env.origin), nonce, True
        except MessageError as e:
            logger.warning("DSAConnector side channel: refused a message: %s", e)
            return Reply(False, error=f"refused: {e}"[:MAX_ERROR_CHARS], clock=self._clock()), nonce, True
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the channel
            logger.warning("DSAConnector side channel: request failed: %r", e)
            return Reply(False, error=f"request failed: {e!r}"[:MAX_ERROR_CHARS], clock=self._clock()), nonce, True

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                continue
            if len(frames) != 3 or frames[1] != b"":
                logger.warning("DSAConnector side channel: dropped a message of %d frames", len(frames))
                continue
            ident, _, raw = frames
            reply, nonce, signed = self.answer(raw)
            try:
                self._sock.send_multipart([ident, b"", self._auth.seal_reply(reply, nonce, signed, self.origin)])
            except zmq.ZMQError as e:
                logger.warning("DSAConnector side channel: reply failed: %s", e)
        self._sock.close()

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.term()


def request(host: str, port: int, req: Request, timeout_s: float, auth: Authenticator | None = None,
            clock_estimate: ClockEstimate | None = None, origin: Origin = ANONYMOUS) -> Reply:
    """:func:`exchange` without the reply's sender."""
    return exchange(host, port, req, timeout_s, auth, clock_estimate, origin)[0]


def exchange(host: str, port: int, req: Request, timeout_s: float, auth: Authenticator | None = None,
             clock_estimate: ClockEstimate | None = None, origin: Origin = ANONYMOUS) -> tuple[Reply, Origin]:
    """One request (sent as ``origin``) and its reply on a peer's side channel: the reply and the sender it
    names (the peer's engine id and epoch); :class:`HandshakeError` on timeout or a bad reply.

    With ``clock_estimate`` the reply's clock refines the estimate of the peer's clock. A reply that is not
    bound to this request, or (with a secret) not signed, is a transient :class:`HandshakeError`: it may come
    from anyone on the path, so it says nothing about what the peer did with the request.
    """
    auth = auth or Authenticator(None)
    kind = type(req).__struct_config__.tag
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    ms = max(int(timeout_s * 1000), 1)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    nonce = auth.new_nonce()
    try:
        sock.connect(f"tcp://{host}:{port}")
        sent = time.monotonic()
        sock.send(auth.seal(req, nonce, origin))
        raw = sock.recv()
        received = time.monotonic()
    except zmq.Again:
        raise HandshakeError(
            f"DSAConnector peer {host}:{port} did not answer {kind!r} within {timeout_s:.1f} s", transient=True
        ) from None
    except zmq.ZMQError as e:
        raise HandshakeError(f"DSAConnector peer {host}:{port} {kind!r} failed: {e}", transient=True) from None
    finally:
        sock.close()
    try:
        env, reply = auth.open_reply(raw, nonce)
    except UnboundReply as e:
        gap = e.env.ts - time.time() if e.env is not None else 0.0  # unsigned: for the log line only
        skew = f"; the peer's wall clock is {gap:+.1f} s from this side's" if abs(gap) >= 1.0 else ""
        raise HandshakeError(f"DSAConnector peer {host}:{port}: no authentic answer to {kind!r} (treated as "
                             f"unanswered): {e}{skew}", transient=True) from None
    except MessageError as e:
        raise HandshakeError(f"DSAConnector peer {host}:{port}: bad reply to {kind!r}: {e}") from None
    if reply.unread:  # no secret on this side: an unread refusal is still not the peer's word on the request
        raise HandshakeError(f"DSAConnector peer {host}:{port} could not read {kind!r} (treated as unanswered): "
                             f"{reply.error}", transient=True)
    if clock_estimate is not None:
        clock_estimate.add_sample(sent, received, reply.clock)
    return reply, env.origin


@dataclass
class PeerMeta:
    """What the handshake learns about a peer engine; ``epoch``: the start of it that answered (its payloads,
    clock and leases belong to that start only)."""

    engine_id: str
    payloads: list[RankPayload]
    write_timeout_s: float
    clock: ClockEstimate
    epoch: int = 0


def fetch_payloads(host: str, port: int, timeout_s: float, auth: Authenticator | None = None,
                   origin: Origin = ANONYMOUS) -> PeerMeta:
    """The peer's worker payloads (the handshake), its epoch, its write timeout and a first clock estimate."""
    clock = ClockEstimate()
    reply, sender = exchange(host, port, MetaReq(), timeout_s, auth, clock, origin)
    if not reply.ok:
        raise HandshakeError(f"DSAConnector peer {host}:{port} refused the handshake: {reply.error}",
                             transient=reply.error == NOT_READY)
    try:
        payloads = [decode_payload(p) for p in reply.payloads]
    except ValueError as e:
        raise HandshakeError(f"DSAConnector peer {host}:{port}: {e}") from None
    if not payloads:
        raise HandshakeError(f"DSAConnector peer {host}:{port} published no worker payloads")
    if sender.engine_id != reply.engine_id:
        raise HandshakeError(f"DSAConnector peer {host}:{port}: the handshake reply names engine {reply.engine_id!r}, "
                             f"its envelope sender {sender}")
    return PeerMeta(reply.engine_id, payloads, reply.write_timeout_s, clock, sender.epoch)


def validate_peer(src: Sequence[RankPayload], dst: Sequence[RankPayload]) -> PeerPlan:
    """Refuse corrupting mismatches (naming them) and return the :class:`~vllm_dsa_connector.core.plan.peer_plan.PeerPlan`
    ``src -> dst`` (both sides' page tables, decoded once here, and the transfer plan).

    ``src`` are the producer's (P) payloads, ``dst`` the consumer's (D). PP and TP reshards are planned,
    not refused.
    """
    from vllm_dsa_connector.core.plan.peer_plan import PeerPlan
    from vllm_dsa_connector.core.plan.token_map import PlanError

    if not src or not dst:
        raise HandshakeError("DSAConnector handshake: a side published no worker payloads")
    a, b = src[0], dst[0]
    diffs = [f"{key} differs (producer {a.compat.get(key)!r}, consumer {b.compat.get(key)!r})"
             for key in sorted(set(a.compat) | set(b.compat)) if a.compat.get(key) != b.compat.get(key)]
    if diffs:
        raise HandshakeError(
            f"DSAConnector refuses peer {a.engine_id} -> {b.engine_id}: {'; '.join(diffs)}; "
            "transferring would corrupt KV (run both engines with the same attention backend, block size "
            "and dtypes)"
        )
    try:
        src_tables = [p.page_table for p in src]
        dst_tables = [p.page_table for p in dst]
    except ValueError as e:
        raise HandshakeError(f"DSAConnector handshake: {e}") from None
    try:
        return PeerPlan.build(src_tables, dst_tables)
    except PlanError as e:
        raise HandshakeError(
            f"DSAConnector refuses peer {a.engine_id} -> {b.engine_id}: {e}"
        ) from None
