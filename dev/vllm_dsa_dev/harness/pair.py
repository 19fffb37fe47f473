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
roles, e.g. the transfer core's producer and consumer; ``DATA`` messages carry what such roles exchange. It,
:class:`Channel` and the message kinds live in :mod:`.channel`; this module holds
the two sides of the consumer service: their specs and resources, D's loop, P's view of D and :func:`run_pair`.

P runs the caller's ``driver(producer_side, args)`` (a module-level function: spawn pickles it by name);
``producer_side.consumer`` is D behind the protocol (:class:`RemoteConsumer`). The driver's return value
is :func:`run_pair`'s. P's pool holds seeded bytes (:func:`fill`); D regenerates them to verify, so P and
D must be on the same device type. No vLLM imports here (the H200 scripts run without vLLM).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_dsa_dev.harness.channel import Channel, Kind, ProtocolError, run_two

logger = logging.getLogger(__name__)

__all__ = [
    "ConsumerSide",
    "Driver",
    "PairSpec",
    "ProducerSide",
    "RemoteConsumer",
    "Side",
    "SideSpec",
    "fill",
    "run_pair",
    "serve_consumer",
    "sync",
]


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
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.staging import StagingArena

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

        from vllm_dsa_connector.core.plan.runs import Runs
        from vllm_dsa_connector.core.transfer.copy.local_copy import gather

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

    from vllm_dsa_connector.core.plan.runs import Runs
    from vllm_dsa_connector.core.transfer.ipc import export_region
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver

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
