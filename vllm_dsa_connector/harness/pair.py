"""Two-process transfer runs: a producer (P) and a consumer (D) process with real NIXL agents.

:func:`run_pair` spawns both (``multiprocessing`` spawn), each with a NIXL engine, a registered pool on
its device and a staging arena; D answers on a control channel (a pipe between P and D, nothing relayed
through the parent) with ONE message protocol, :class:`Kind`::

    D -> P  HELLO(meta, region, ipc)        D's agent metadata, pool descriptor, CUDA IPC export or None
    P -> D  HELLO(meta)                     P's agent metadata (both sides then know each other)
    P -> D  RUNS(key, src, dst, len)        a request layout, named; D answers OK
    P -> D  EXPECT(tag, key, bounce)        D zeroes its pool, arms its BounceReceiver, answers
            READY(slot), waits for the data, answers DONE(t: D's time.perf_counter() at completion),
            then compares the landed bytes with P's and answers VERIFIED(ok)
    P -> D  CALL(fn, kwargs)                D runs ``fn(consumer_side, **kwargs)``, answers RESULT(value)
    P -> D  STOP                            D closes its engine and exits
    either  ERROR(text)                     instead of any answer: the sender failed (RemoteError here)

:func:`run_two` is the process part alone (spawn, channel, values, failures, timeout, clean-up) for other
roles, e.g. the transfer core's producer and consumer; ``DATA`` messages carry what such roles exchange.

P runs the caller's ``driver(producer_side, args)`` (a module-level function: spawn pickles it by name);
``producer_side.consumer`` is D behind the protocol (:class:`RemoteConsumer`). The driver's return value
is :func:`run_pair`'s. P's pool holds seeded bytes (:func:`fill`); D regenerates them to verify, so P and
D must be on the same device type. No vLLM imports here (the H200 scripts run without vLLM).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)


class Kind(Enum):
    """Message kinds of the control channel (see the module docstring)."""

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


@dataclass(frozen=True)
class SideSpec:
    """One process's resources: device, pool and arena sizes in bytes, engine options.

    ``threads``: torch intra-op threads (1 on small CPU hosts: a second thread waits behind the peer's
    polling one; None leaves torch's default). ``ipc``: D exports its pool for CUDA IPC (CUDA only).
    """

    device: str = "cpu"
    pool_bytes: int = 1 << 20
    arena_bytes: int = 1 << 20
    threads: int | None = 1
    telemetry: bool = False
    ipc: bool = False
    reserve_timeout_s: float = 0.2


@dataclass(frozen=True)
class PairSpec:
    """A two-process run: both sides, P's data seed, D's wait per transfer, the children's extra
    environment (e.g. ``UCX_TLS``; applied before NIXL starts) and whether both spin on the channel."""

    producer: SideSpec
    consumer: SideSpec
    seed: int = 0
    transfer_timeout_s: float = 120.0
    env: Mapping[str, str] = field(default_factory=dict)
    hot: bool = False


def fill(nbytes: int, device: str, seed: int) -> Any:
    """``nbytes`` seeded random bytes on ``device`` (uint8; the same on every device of one type)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(-(-nbytes // 8), dtype=torch.int64, device=device)
    out.random_(generator=g)
    return out.view(torch.uint8)[:nbytes]


def sync(device: str) -> None:
    """Wait for ``device``'s queued work (no-op on the CPU)."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Side:
    """What one process holds: its spec, engine, registered pool and staging arena."""

    spec: SideSpec
    engine: Any
    pool: Any
    region: Any
    arena: Any


def _open(name: str, spec: SideSpec, pool: Any) -> tuple[Any, Any, Any]:
    """(engine, registered ``pool``'s region, arena) of one process."""
    from vllm_dsa_connector.transport import NixlEngine, StagingArena

    engine = NixlEngine(f"{name}-{os.getpid()}", telemetry=spec.telemetry)
    return engine, engine.register(pool), StagingArena(spec.arena_bytes, device=spec.device)


def _prepare(spec: SideSpec) -> None:
    import torch

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(spec.device)


# -- consumer (D) ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumerSide(Side):
    """D's process: :class:`Side` plus its receiver, P's bytes regenerated from the seed (``expected``) and
    the layouts P registered (``runs[key]``)."""

    receiver: Any = None
    expected: Any = None
    runs: dict[str, Any] = field(default_factory=dict)
    _want: dict[str, Any] = field(default_factory=dict)  # P's bytes of the last verified layout

    def verify(self, key: str) -> bool:
        """Whether the bytes at ``runs[key]``'s destinations equal P's bytes at its sources."""
        import torch

        from vllm_dsa_connector.transport import Runs, gather

        runs = self.runs[key].merged()
        if key not in self._want:
            self._want.clear()  # free the previous layout's copy first
            want = torch.empty(runs.total_bytes, dtype=torch.uint8, device=self.spec.device)
            gather(self.expected, runs, want)
            self._want[key] = want
        got = torch.empty(runs.total_bytes, dtype=torch.uint8, device=self.spec.device)
        gather(self.pool, Runs(runs.dst_offsets, runs.dst_offsets, runs.lengths), got)
        return bool(torch.equal(got, self._want[key]))


def serve_consumer(ch: Channel, spec: PairSpec) -> None:
    """D's role: open its side, shake hands, answer P's messages until STOP (or P goes away)."""
    _prepare(spec.consumer)
    import torch

    from vllm_dsa_connector.harness.paths.fan_in import BounceReceiver
    from vllm_dsa_connector.transport import Runs, export_region

    c = spec.consumer
    pool = torch.zeros(c.pool_bytes, dtype=torch.uint8, device=c.device)
    engine, region, arena = _open("consumer", c, pool)
    ch.idle = engine.progress
    try:
        side = ConsumerSide(c, engine, pool, region, arena,
                            receiver=BounceReceiver(engine, arena, reserve_timeout_s=c.reserve_timeout_s),
                            expected=fill(spec.producer.pool_bytes, c.device, spec.seed))
        ipc = export_region(pool).to_dict() if c.ipc and c.device.startswith("cuda") else None
        ch.send(Kind.HELLO, meta=engine.metadata(), region=region.desc().to_dict(), ipc=ipc)
        engine.add_peer(ch.recv(Kind.HELLO).body["meta"])
        while True:
            try:
                msg = ch.recv()
            except ProtocolError:  # P went away: nothing left to serve
                break
            b = msg.body
            if msg.kind is Kind.STOP:
                break
            if msg.kind is Kind.RUNS:
                side.runs[b["key"]] = Runs(b["src"], b["dst"], b["len"])
                ch.send(Kind.OK)
            elif msg.kind is Kind.EXPECT:
                pool.zero_()
                sync(c.device)
                (slot,) = side.receiver.expect(b["tag"], pool, [side.runs[b["key"]]], bounce=b["bounce"])
                ch.send(Kind.READY, slot=slot.to_dict() if slot is not None else None)
                side.receiver.wait(b["tag"], spec.transfer_timeout_s)
                ch.send(Kind.DONE, t=time.perf_counter())  # CLOCK_MONOTONIC: comparable across processes
                ch.send(Kind.VERIFIED, ok=side.verify(b["key"]))
            elif msg.kind is Kind.CALL:
                ch.send(Kind.RESULT, value=b["fn"](side, **b["kwargs"]))
            else:
                raise ProtocolError(f"consumer: unexpected {msg.kind.value} from the producer")
    finally:
        engine.close()


# -- producer (P) ---------------------------------------------------------------------------------------


class RemoteConsumer:
    """D as P's driver sees it: one method per request of the protocol."""

    def __init__(self, ch: Channel) -> None:
        self.ch = ch

    def runs(self, key: str, runs: Any) -> None:
        """Register a layout on D under ``key`` (its destinations, for EXPECT and verification)."""
        self.ch.send(Kind.RUNS, key=key, src=runs.src_offsets, dst=runs.dst_offsets, len=runs.lengths)
        self.ch.recv(Kind.OK)

    def expect(self, tag: bytes, key: str, bounce: bool) -> dict[str, Any] | None:
        """Arm D for ``tag`` with layout ``key``; returns D's staging slot (None: write directly)."""
        self.ch.send(Kind.EXPECT, tag=tag, key=key, bounce=bounce)
        slot: dict[str, Any] | None = self.ch.recv(Kind.READY).body["slot"]
        return slot

    def done(self) -> float:
        """Wait until D saw the transfer complete; D's ``time.perf_counter()`` at that moment."""
        t: float = self.ch.recv(Kind.DONE).body["t"]
        return t

    def verified(self) -> bool:
        """D's byte-for-byte verdict on the last transfer."""
        ok: bool = self.ch.recv(Kind.VERIFIED).body["ok"]
        return ok

    def submit(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        """Run module-level ``fn(consumer_side, **kwargs)`` on D; collect with :meth:`result`."""
        self.ch.send(Kind.CALL, fn=fn, kwargs=kwargs)

    def result(self, timeout_s: float | None = None) -> Any:
        """The value of the last :meth:`submit`."""
        return self.ch.recv(Kind.RESULT, timeout_s=timeout_s).body["value"]

    def call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """:meth:`submit` and :meth:`result`."""
        self.submit(fn, **kwargs)
        return self.result()

    def stop(self) -> None:
        """Tell D to close and exit."""
        self.ch.send(Kind.STOP)


@dataclass(frozen=True)
class ProducerSide(Side):
    """P's process: :class:`Side` plus D's agent name, pool descriptor, IPC export and D itself."""

    peer: str = ""
    remote_region: dict[str, Any] = field(default_factory=dict)
    remote_ipc: dict[str, Any] | None = None
    consumer: RemoteConsumer | None = None
    pair: PairSpec | None = None


Driver = Callable[[ProducerSide, Any], Any]


def _produce(ch: Channel, job: tuple[PairSpec, Driver, Any]) -> Any:
    """P's role: open its side, shake hands, run the driver, stop D; the driver's value."""
    spec, driver, args = job
    p = spec.producer
    _prepare(p)
    pool = fill(p.pool_bytes, p.device, spec.seed)
    engine, region, arena = _open("producer", p, pool)
    ch.idle = engine.progress  # P waiting on D keeps its agent progressing (see Channel)
    try:
        hello = ch.recv(Kind.HELLO).body
        peer = engine.add_peer(hello["meta"])
        ch.send(Kind.HELLO, meta=engine.metadata())
        consumer = RemoteConsumer(ch)
        out = driver(ProducerSide(p, engine, pool, region, arena, peer=peer, remote_region=hello["region"],
                                  remote_ipc=hello["ipc"], consumer=consumer, pair=spec), args)
        consumer.stop()
        return out
    finally:
        engine.close()


def run_pair(spec: PairSpec, driver: Driver, args: Any = None, timeout_s: float = 600.0) -> Any:
    """Run ``driver(producer_side, args)`` in P against D's :func:`serve_consumer` (both fresh spawned
    processes, :func:`run_two`); the driver's value."""
    value, _ = run_two(_produce, serve_consumer, (spec, driver, args), spec, env=spec.env, hot=spec.hot,
                       timeout_s=timeout_s)
    return value


# -- the two processes ----------------------------------------------------------------------------------

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
