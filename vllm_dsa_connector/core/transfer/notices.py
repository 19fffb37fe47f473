"""Transport notifications: ``dsa1:`` messages that tell a receiver what a writer did.

- ``dsa1:<b|d|i><writer>:<tag>`` (:func:`encode_notif`): the writer's bytes landed by that path (bounce:
  scatter the staging slot; direct / ipc: nothing to do);
- ``dsa1:c<writer>.<i>.<K>:<tag>`` (:func:`encode_chunk_notif`): chunk ``i`` of ``K`` of a pipelined bounce;
- ``dsa1:e<writer>.<hex handle>:<tag>`` (:func:`encode_event_notif`): an ipc copy was launched; its bytes
  are there once the sender's interprocess CUDA event fired.

:func:`parse_notif` reads any of them into one :class:`Notif` record. The tag is opaque bytes (it may
contain ``:``); the receiver maps it to its key (see :class:`~.receiver.Receiver`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsa_connector.core.transfer.paths import PathName

__all__ = [
    "Notif",
    "decode_chunk_notif",
    "decode_event_notif",
    "decode_notif",
    "encode_chunk_notif",
    "encode_event_notif",
    "encode_notif",
    "parse_notif",
]

_NOTIF_PREFIX = b"dsa1:"

_PATH_CODE: dict[str, bytes] = {PathName.BOUNCE: b"b", PathName.DIRECT: b"d", PathName.IPC: b"i"}
_CODE_PATH = {v: k for k, v in _PATH_CODE.items()}


def encode_notif(path: str, writer: int, tag: bytes) -> bytes:
    """``dsa1:<b|d|i><writer>:<tag>``: which path a writer took, so the target knows whether to scatter.

    ``i`` (the IPC single copy) needs no scatter, like ``d``; any other path is encoded as ``d``.
    """
    return _NOTIF_PREFIX + _PATH_CODE.get(path, b"d") + str(int(writer)).encode() + b":" + tag


def decode_notif(msg: bytes) -> tuple[str, int, bytes] | None:
    """Inverse of :func:`encode_notif`; ``None`` for other messages (chunk notifications included)."""
    if not msg.startswith(_NOTIF_PREFIX):
        return None
    body = msg[len(_NOTIF_PREFIX) :]
    head, sep, tag = body.partition(b":")
    if not sep or len(head) < 2 or head[:1] not in _CODE_PATH or not head[1:].isdigit():
        return None
    return _CODE_PATH[head[:1]], int(head[1:]), tag


def encode_event_notif(writer: int, handle: bytes, tag: bytes) -> bytes:
    """``dsa1:e<writer>.<hex handle>:<tag>``: the ``ipc`` copy was launched; done when the event fires."""
    return _NOTIF_PREFIX + f"e{int(writer)}.".encode() + bytes(handle).hex().encode() + b":" + tag


def decode_event_notif(msg: bytes) -> tuple[int, bytes, bytes] | None:
    """Inverse of :func:`encode_event_notif`: ``(writer, handle, tag)``; ``None`` for other messages."""
    if not msg.startswith(_NOTIF_PREFIX + b"e"):
        return None
    head, sep, tag = msg[len(_NOTIF_PREFIX) + 1 :].partition(b":")
    w, dot, hexed = head.partition(b".")
    if not sep or not dot or not w.isdigit() or not hexed or len(hexed) % 2:
        return None
    try:
        handle = bytes.fromhex(hexed.decode())
    except ValueError:
        return None
    return int(w), handle, tag


def encode_chunk_notif(writer: int, index: int, count: int, tag: bytes) -> bytes:
    """``dsa1:c<writer>.<index>.<count>:<tag>``: chunk ``index`` of ``count`` of a pipelined bounce."""
    return _NOTIF_PREFIX + f"c{int(writer)}.{int(index)}.{int(count)}:".encode() + tag


def decode_chunk_notif(msg: bytes) -> tuple[int, int, int, bytes] | None:
    """Inverse of :func:`encode_chunk_notif`: ``(writer, index, count, tag)``; ``None`` otherwise."""
    if not msg.startswith(_NOTIF_PREFIX + b"c"):
        return None
    head, sep, tag = msg[len(_NOTIF_PREFIX) + 1 :].partition(b":")
    parts = head.split(b".")
    if not sep or len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    writer, index, count = (int(p) for p in parts)
    if count < 1 or index >= count:
        return None
    return writer, index, count, tag


@dataclass(frozen=True)
class Notif:
    """One parsed transport notification.

    ``path`` is ``"bounce"``, ``"direct"``, ``"ipc"`` or ``"pipelined"``; ``index``/``count`` the chunk of a
    pipelined writer; ``handle`` the interprocess event of a launched ipc copy (``b""`` otherwise).
    """

    path: str
    writer: int
    tag: bytes
    index: int = 0
    count: int = 0
    handle: bytes = b""


def parse_notif(msg: bytes) -> Notif | None:
    """Any ``dsa1:`` notification as a :class:`Notif`; ``None`` for other messages."""
    chunk = decode_chunk_notif(msg)
    if chunk is not None:
        writer, index, count, tag = chunk
        return Notif("pipelined", writer, tag, index, count)
    launched = decode_event_notif(msg)
    if launched is not None:
        writer, handle, tag = launched
        return Notif(PathName.IPC, writer, tag, handle=handle)
    parsed = decode_notif(msg)
    if parsed is None:
        return None
    path, writer, tag = parsed
    return Notif(path, writer, tag)
