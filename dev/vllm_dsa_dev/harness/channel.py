"""The control channel between two spawned processes, and the spawning: :class:`Channel`, :func:`run_two`.

:func:`run_two` spawns a producer (P) and a consumer (D) process (``multiprocessing`` spawn), joined by one
:class:`Channel` (a pipe between them, nothing relayed through the parent); each runs its role
``fn(channel, args)``, and the two values (or the first failure, with its traceback) come back to the
parent. Messages are :class:`Msg` of a :class:`Kind`: the kinds of the consumer service of :mod:`.pair`
(its protocol is stated there) and ``DATA`` for other roles, e.g. the transfer core's producer and consumer
(``dev/bench/core_pd.py``); ``ERROR`` is the failure of the other side (:class:`RemoteError` here). Kept apart
from :mod:`.pair` (what the two processes hold and do) because other roles use only this; every name here is
importable from :mod:`.pair` too. Stdlib only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Channel", "Kind", "Msg", "ProtocolError", "RemoteError", "Role", "run_two"]


class Kind(Enum):
    """Message kinds of the control channel (the consumer service's protocol: :mod:`.pair`'s docstring)."""

    HELLO = "hello"
    RUNS = "runs"
    OK = "ok"
    EXPECT = "expect"
    READY = "ready"
    DONE = "done"
    VERIFIED = "verified"
    CALL = "call"
    RESULT = "result"
    STOP = "stop"
    ERROR = "error"
    DATA = "data"  # free-form, for roles of run_two other than the consumer service


@dataclass(frozen=True)
class Msg:
    """One message: its kind and named fields."""

    kind: Kind
    body: dict[str, Any] = field(default_factory=dict)


_IDLE_S = 1e-3  # a waiting recv runs Channel.idle this often (not hot)


class RemoteError(RuntimeError):
    """The other process reported a failure (the text carries its traceback)."""


class ProtocolError(RuntimeError):
    """A message of another kind than expected arrived, or the channel closed."""


class Channel:
    """One end of the control channel; ``hot`` spins on ``poll`` instead of sleeping in ``recv``.

    ``idle`` (the roles set ``engine.progress``) runs while ``recv`` waits, every ``_IDLE_S`` (each spin
    when ``hot``): a waiting side keeps its agent progressing, so an untracked notification it sent
    (the ipc launch notice as the first message to the peer) still leaves.
    """

    def __init__(self, conn: Any, side: str, hot: bool = False,
                 idle: Callable[[], None] | None = None) -> None:
        self.conn = conn
        self.side = side
        self.hot = hot
        self.idle = idle

    def send(self, kind: Kind, **body: Any) -> None:
        """Send one message."""
        self.conn.send(Msg(kind, body))

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether a message is waiting (within ``timeout_s``); True also once the other side closed."""
        try:
            return bool(self.conn.poll(timeout_s))
        except (EOFError, OSError):
            return True

    def recv(self, *expect: Kind, timeout_s: float | None = None) -> Msg:
        """The next message; :class:`RemoteError` for ERROR, :class:`ProtocolError` for a kind not in
        ``expect`` (any kind when empty), a closed channel or ``timeout_s`` without a message."""
        try:
            if self.hot or self.idle is not None:
                deadline = None if timeout_s is None else time.perf_counter() + timeout_s
                while not self.conn.poll(0 if self.hot else _IDLE_S):  # wakes at once on a message
                    if self.idle is not None:
                        self.idle()
                    if deadline is not None and time.perf_counter() > deadline:
                        raise ProtocolError(f"{self.side}: no message in {timeout_s} s")
            elif timeout_s is not None and not self.conn.poll(timeout_s):
                raise ProtocolError(f"{self.side}: no message in {timeout_s} s")
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            raise ProtocolError(f"{self.side}: the other process closed the channel ({e!r})") from e
        if msg.kind is Kind.ERROR:
            raise RemoteError(msg.body["text"])
        if expect and msg.kind not in expect:
            raise ProtocolError(f"{self.side}: expected {[k.value for k in expect]}, got {msg.kind.value} "
                                f"{ {k: v for k, v in msg.body.items() if k in ('key', 'tag')} }")
        return msg


Role = Callable[[Channel, Any], Any]


def _role_main(name: str, fn: Role, conn: Any, result: Any, args: Any, env: Mapping[str, str], hot: bool) -> None:
    """A child: run ``fn(channel, args)``; its value (or its failure) goes to the parent on ``result``, a
    failure also to the other process as ERROR (so it stops waiting)."""
    os.environ.update(env)  # before NIXL / UCX start
    ch = Channel(conn, name, hot)
    try:
        value = fn(ch, args)
    except BaseException as e:
        text = f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        # first: the root cause reaches the parent before the other side's echo of it
        result.send(("echo" if isinstance(e, RemoteError) else "err", text))
        try:
            ch.send(Kind.ERROR, text=text)
        except (OSError, ValueError):
            pass
        raise
    result.send(("ok", value))


def run_two(producer: Role, consumer: Role, p_args: Any = None, d_args: Any = None, *,
            env: Mapping[str, str] | None = None, hot: bool = False, timeout_s: float = 600.0) -> tuple[Any, Any]:
    """Spawn P running ``producer(channel, p_args)`` and D running ``consumer(channel, d_args)``, joined by
    one :class:`Channel` (module-level functions: spawn pickles them by name); both values.

    ``env`` is set in both before they start anything. Raises ``RuntimeError`` with the failing side's
    traceback (the first failure first) when either failed or exited without a value, or after
    ``timeout_s``; both processes are gone when this returns or raises.
    """
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    p_end, d_end = ctx.Pipe()
    names = ("producer", "consumer")
    results, procs = [], []
    for name, fn, conn, args in ((names[0], producer, p_end, p_args), (names[1], consumer, d_end, d_args)):
        mine, theirs = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_role_main, args=(name, fn, conn, theirs, args, dict(env or {}), hot),
                                 daemon=True, name=f"pair-{name}"))
        procs[-1].start()
        theirs.close()
        results.append(mine)
    for end in (p_end, d_end):  # the children hold them now: EOF reaches the other side
        end.close()
    values: dict[int, Any] = {}
    errors: list[str] = []
    echoes: list[str] = []  # a side that failed because the other one did (listed after the cause)
    pending: dict[Any, int] = {r: i for i, r in enumerate(results)}
    try:
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                alive = [n for n, pr in zip(names, procs, strict=True) if pr.is_alive()]
                errors.append(f"pair: no result after {timeout_s:.0f} s (still running: {alive})")
                break
            ready: list[Any] = wait(list(pending), min(left, 1.0))
            for r in ready:
                i = pending.pop(r)
                try:
                    status, value = r.recv()
                except EOFError:
                    status, value = "err", f"pair: the {names[i]} exited with code {procs[i].exitcode} without a result"
                if status == "ok":
                    values[i] = value
                else:
                    (echoes if status == "echo" else errors).append(str(value))
            if (errors or echoes) and pending:  # give the other side a moment to report its end
                deadline = min(deadline, time.monotonic() + 5.0)
        if errors or echoes:
            raise RuntimeError("pair run failed: " + "\n".join(errors + echoes))
        return values[0], values[1]
    finally:
        for pr in procs:
            pr.join(10)
            if pr.is_alive():
                pr.kill()
                pr.join(5)
        for r in results:
            r.close()
