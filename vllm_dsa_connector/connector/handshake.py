"""The ZMQ side channel and the handshake checks.

Each engine's scheduler-side connector serves one ROUTER socket (like vLLM's NixlConnector). Requests are
msgpack ``[kind, body]``; every reply is msgpack ``{"ok": bool, ...}``:

- ``meta``: the engine's worker payloads (:class:`~.metadata.RankPayload`, one per (pp, tp) worker).
- ``reg`` (D -> P): "write request ``p_req`` into my blocks"; P replies at once whether it still holds
  the request's KV (a lease), so D fails fast instead of waiting for a timeout.
- ``hb`` (D -> P): lease renewal for the listed P requests.
- ``cancel`` (D -> P): D gave up on these P requests (timeout, abort): free them unless already written.

Clients use a fresh REQ socket with send/receive timeouts and ``linger=0``: a dead peer costs one timeout
on a background thread, never a hung engine.

:func:`validate_peer` is the compatibility check run on the handshake result: it refuses any mismatch
that would corrupt KV (model, dtype, KV cache dtype, indexer mask/pattern, head size, block-split indexer
with different block sizes), naming what differs, and builds the transfer plan, which handles PP and TP
reshards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
from vllm.logger import init_logger

from vllm_dsa_connector.connector.metadata import RankPayload, decode_payload

logger = init_logger("vllm." + __name__)  # under "vllm." so vLLM's handler prints it

__all__ = ["HandshakeError", "SideChannelServer", "fetch_payloads", "request", "validate_peer"]


class HandshakeError(RuntimeError):
    """The peer cannot be used: unreachable, or its KV layout would corrupt ours. The message says why."""


Handler = Callable[[str, Any], dict[str, Any]]


class SideChannelServer:
    """A ROUTER socket on a daemon thread; ``handler(kind, body) -> reply dict`` runs on that thread."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        self._handler = handler
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsa-side-channel", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, _, raw = self._sock.recv_multipart()
            except (zmq.ZMQError, ValueError):
                continue
            try:
                kind, body = msgspec.msgpack.decode(raw)
                reply = self._handler(str(kind), body)
            except Exception as e:  # a bad request must not kill the channel
                logger.warning("DSAConnector side channel: bad request: %s", e)
                reply = {"ok": False, "error": f"bad request: {e}"}
            try:
                self._sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])
            except zmq.ZMQError as e:
                logger.warning("DSAConnector side channel: reply failed: %s", e)
        self._sock.close()

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.term()


def request(host: str, port: int, kind: str, body: Any, timeout_s: float) -> dict[str, Any]:
    """One request/reply on a peer's side channel; :class:`HandshakeError` on timeout or refusal."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    ms = max(int(timeout_s * 1000), 1)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode([kind, body]))
        reply = msgspec.msgpack.decode(sock.recv())
    except zmq.Again:
        raise HandshakeError(
            f"DSAConnector peer {host}:{port} did not answer {kind!r} within {timeout_s:.1f} s"
        ) from None
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        raise HandshakeError(f"DSAConnector peer {host}:{port} {kind!r} failed: {e}") from None
    finally:
        sock.close()
    if not isinstance(reply, dict):
        raise HandshakeError(f"DSAConnector peer {host}:{port}: malformed reply to {kind!r}")
    return reply


def fetch_payloads(host: str, port: int, timeout_s: float) -> list[RankPayload]:
    """The peer's worker payloads (the handshake)."""
    reply = request(host, port, "meta", None, timeout_s)
    if not reply.get("ok"):
        raise HandshakeError(f"DSAConnector peer {host}:{port} refused the handshake: {reply.get('error')}")
    try:
        return [decode_payload(p) for p in reply["payloads"]]
    except (KeyError, ValueError) as e:
        raise HandshakeError(f"DSAConnector peer {host}:{port}: {e}") from None


def validate_peer(src: Sequence[RankPayload], dst: Sequence[RankPayload]) -> Any:
    """Refuse corrupting mismatches (naming them) and return the transfer plan ``src -> dst``.

    ``src`` are the producer's (P) payloads, ``dst`` the consumer's (D). PP and TP reshards are planned,
    not refused.
    """
    from vllm_dsa_connector.layout import PageTable
    from vllm_dsa_connector.matching import PlanError, plan_transfer

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
        src_tables = [PageTable.from_dict(p.page_table) for p in src]
        dst_tables = [PageTable.from_dict(p.page_table) for p in dst]
    except ValueError as e:
        raise HandshakeError(f"DSAConnector handshake: {e}") from None
    try:
        return plan_transfer(src_tables, dst_tables)
    except PlanError as e:
        raise HandshakeError(
            f"DSAConnector refuses peer {a.engine_id} -> {b.engine_id}: {e}"
        ) from None
