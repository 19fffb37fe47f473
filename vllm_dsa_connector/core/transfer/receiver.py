"""The receiver: ONE implementation of the target side of every transport path.

A request is armed with :meth:`Receiver.arm` (its key and, per writer, a :class:`WriterSpec`: the NIXL agent
its notifications must come from and, for a bounced writer, its staging slot, destination tensor and runs).
Notifications (:mod:`.notices`) then move each writer through :class:`WriterState`:

    EXPECTED --direct / ipc "done" / bounce (slot scattered) / last pipelined chunk--> LANDED
    EXPECTED --first pipelined chunk, or an ipc copy launched (its event not fired yet)--> PARTIAL --> LANDED
    any non-final --the writer reported a failure, or its bytes could not be placed--> FAILED
    LANDED --the caller's check of the landed bytes failed (e.g. checksums)--> CORRUPT

and :meth:`Receiver.collect` settles a request (:class:`RecvState`) once every writer is final (DONE, or FAILED /
CORRUPT when one is) or its deadline passed (TIMED_OUT); :meth:`Receiver.cancel` ends it (CANCELLED).
``_mark`` and ``_settle`` are the only places where these states change.

Notifications before :meth:`~Receiver.arm` are kept (expired after ``early_ttl_s``), those of a settled
request dropped. Early ones are bounded three ways: ``early_cap`` keys, ``early_per_key`` per key (a flood
for one request is dropped with a warning, and that request FAILS when armed: never a load that waits on
notifications thrown away) and ``early_per_peer`` per sending agent (beyond it that agent's early ones are
dropped, warned once; their requests time out). A tag is opaque here: ``hooks.split`` maps it to the request key and a payload (the
connector's Notice), ``hooks.admit`` accepts, ignores or fails a writer's notification on its payload,
``hooks.landed`` checks the landed bytes. :class:`PlainTags` (the default) keys requests by the tag itself.
A hook that raises never escapes :meth:`Receiver.handle` (an engine step): ``split`` raising makes the
notification malformed (ignored), ``admit`` raising fails the writer, ``landed`` raising marks it CORRUPT.

This module is the state machine; its plain data (the specs, states, results and hooks it names, importable
from here too) is in :mod:`.receiver_data`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_dsa_connector.core.plan.runs import Chunk, Runs, plan_chunks
from vllm_dsa_connector.core.transfer.copy.local_copy import scatter
from vllm_dsa_connector.core.transfer.early import EarlyNotices
from vllm_dsa_connector.core.transfer.ipc import PeerEvents
from vllm_dsa_connector.core.transfer.nixl.data import Region
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import Notif, parse_notif
from vllm_dsa_connector.core.transfer.paths import PathName
from vllm_dsa_connector.core.transfer.receiver_data import (
    COMPLETES,
    PlainTags,
    ReceiveHooks,
    RecvResult,
    RecvState,
    Verdict,
    WriterSpec,
    WriterState,
)
from vllm_dsa_connector.core.transfer.slots import Reservation
from vllm_dsa_connector.core.transfer.staging import StagingArena

logger = logging.getLogger(__name__)

__all__ = ["Receiver"]


#: A writer in one of these is done (its later notifications are duplicates); a request settles once all are.
_FINAL = frozenset({WriterState.LANDED, WriterState.FAILED, WriterState.CORRUPT})


@dataclass(eq=False)
class _Armed:
    key: bytes
    writers: dict[int, WriterSpec]
    started: float
    deadline: float | None
    res: Reservation | None
    context: Any
    states: dict[int, WriterState] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    payloads: dict[int, Any] = field(default_factory=dict)
    chunks: dict[int, tuple[list[Chunk], set[int]]] = field(default_factory=dict)  # pipelined
    events: dict[int, Any] = field(default_factory=dict)  # ipc: writer -> the sender's opened event


class Receiver:
    """The target side of the transport (bounce, pipelined, ipc and direct writers alike)."""

    def __init__(self, engine: NixlEngine, arena: StagingArena | None = None, *,
                 hooks: ReceiveHooks | None = None, clock: Callable[[], float] = time.monotonic,
                 early_ttl_s: float = 600.0, early_cap: int = 65536, early_per_key: int = 4096,
                 early_per_peer: int = 65536) -> None:
        self.engine = engine
        self.hooks: ReceiveHooks = hooks if hooks is not None else PlainTags()
        self.clock = clock
        self.early = EarlyNotices(clock, ttl_s=early_ttl_s, cap=early_cap, per_key=early_per_key,
                                  per_peer=early_per_peer)
        self.arena: StagingArena | None = None
        self.region: Region | None = None
        self._expected: dict[bytes, _Armed] = {}
        self.events = PeerEvents()  # the senders' interprocess CUDA events of event-signalled ipc writers
        self._closed: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # recent keys
        self.other: list[tuple[str, bytes]] = []  # notifications that are not the transport's
        if arena is not None:
            self.attach(arena)

    def attach(self, arena: StagingArena) -> Region:
        """Register ``arena`` (once) as the staging buffer bounced writers write into."""
        if self.region is not None:
            raise ValueError("Receiver.attach: a staging arena is already attached")
        self.arena = arena
        self.region = self.engine.register(arena.buffer)
        return self.region

    # -- arming --------------------------------------------------------------------------------------

    def arm(self, key: bytes, writers: Mapping[int, WriterSpec], *, timeout_s: float | None = None,
            reservation: Reservation | None = None, context: Any = None) -> None:
        """Expect ``writers`` for ``key``; notifications that came early are applied now.

        ``reservation``: the arena range the writers' slots lie in (released when the request settles,
        quarantined when it failed: a late write may still land there). ``timeout_s``: settle as
        TIMED_OUT after it (``None``: never; :meth:`wait` has its own timeout).
        """
        if key in self._expected:
            raise ValueError(f"Receiver.arm: {key!r} is already armed")
        now = self.clock()
        exp = _Armed(key, dict(writers), now, None if timeout_s is None else now + timeout_s, reservation,
                     context, states={w: WriterState.EXPECTED for w in writers})
        self._expected[key] = exp
        self._closed.pop(key, None)
        over, kept = self.early.take(key)
        if over is not None:  # its early notifications were dropped: it can never complete
            for w in exp.writers:
                self._mark(exp, w, WriterState.FAILED, over)
        for _, peer, n, payload in kept:
            self._arrive(exp, peer, n, payload)

    def writer_states(self, key: bytes) -> dict[int, WriterState]:
        """The writers' states of an armed request (empty when not armed)."""
        exp = self._expected.get(key)
        return dict(exp.states) if exp is not None else {}

    @property
    def pending(self) -> frozenset[bytes]:
        """Keys armed but not settled."""
        return frozenset(self._expected)

    @property
    def busy(self) -> bool:
        """Whether any request is armed (cheap, safe to read from another thread)."""
        return bool(self._expected)

    # -- notifications -------------------------------------------------------------------------------

    def handle(self, peer: str | None, msg: bytes) -> bool:
        """Feed one notification from agent ``peer``; ``True`` when it was a transport notification."""
        n = parse_notif(msg)
        if n is None:
            if peer is not None:
                self.other.append((peer, msg))
            return False
        try:
            got = self.hooks.split(n.tag)
        except Exception as e:  # noqa: BLE001 - an unreadable tag is a malformed notification
            logger.warning("receiver: reading a notification's tag raised %r", e)
            got = None
        if got is None:
            logger.warning("receiver: malformed notification from %r ignored", peer)
            return True
        key, payload = got
        exp = self._expected.get(key)
        if exp is not None:
            self._arrive(exp, peer, n, payload)
        elif key in self._closed:  # a late writer of a settled or cancelled request
            if n.path == PathName.IPC:  # the sender's "copy done" after we completed on its event
                logger.debug("receiver: ipc notification for finished %r dropped", key)
            else:
                logger.warning("receiver: late notification for finished/cancelled %r dropped", key)
        else:
            self.early.offer(key, peer, n, payload)
        return True

    def pump(self) -> None:
        """Handle the engine's new notifications (scatters bounced bytes); settles nothing."""
        for peer, msg in self.engine.poll_notifications():
            self.handle(peer, msg)

    def _arrive(self, exp: _Armed, peer: str | None, n: Notif, payload: Any) -> None:
        w = n.writer
        spec = exp.writers.get(w)
        if spec is None:
            logger.warning("receiver: %r has no writer %d; ignored", exp.key, w)
            return
        if spec.peer is not None and peer is not None and peer != spec.peer:
            logger.warning("receiver: notification for %r claims writer %d but comes from agent %r "
                           "(expected %r); ignored", exp.key, w, peer, spec.peer)
            return
        state = exp.states[w]
        if state in _FINAL:
            if n.path != PathName.IPC:  # ipc: the other half of the event signal, nothing to do
                logger.warning("receiver: duplicate notification from writer %d of %r", w, exp.key)
            return
        try:
            verdict, why = self.hooks.admit(exp.context, w, payload)
        except Exception as e:  # noqa: BLE001 - a notification the caller cannot judge fails its writer
            verdict, why = Verdict.FAIL, f"writer {w}'s notification could not be checked: {e!r}"
        if verdict is Verdict.IGNORE:
            logger.warning("receiver: notification from writer %d of %r ignored: %s", w, exp.key, why)
            return
        exp.payloads[w] = payload
        if verdict is Verdict.FAIL:
            self._mark(exp, w, WriterState.FAILED, why)
        elif spec.path is not None and n.path not in COMPLETES.get(spec.path, ()):
            self._mark(exp, w, WriterState.FAILED, f"writer {w} sent a {n.path} notification; its route is {spec.path}")
        elif n.path == "pipelined":
            self._chunk(exp, w, spec, n)
        elif n.path == PathName.IPC and n.handle:  # launched: landed once the sender's event fired
            if state is WriterState.PARTIAL:
                logger.warning("receiver: duplicate launch notification from writer %d of %r", w, exp.key)
                return
            ev = self.events.open(n.handle, spec.dst.device if spec.dst is not None else None)
            if ev is not None:  # else the sender's notification after the copy will come
                exp.events[w] = ev
                self._mark(exp, w, WriterState.PARTIAL)
        elif n.path != PathName.BOUNCE or self._scatter_all(exp, w, spec):
            exp.events.pop(w, None)
            self._landed(exp, w)

    def _scatter(self, exp: _Armed, w: int, spec: WriterSpec, start: int, nbytes: int,
                 runs: Runs | None) -> bool:
        """Scatter ``nbytes`` at ``start`` of writer ``w``'s slot; a failure fails the writer."""
        try:
            if spec.error:
                raise RuntimeError(spec.error)
            if spec.slot is None or self.arena is None or spec.dst is None or runs is None:
                raise RuntimeError(f"writer {w} of {exp.key!r} bounced without a staging slot")
            base = spec.slot[0] + start
            scatter(self.arena.buffer[base : base + nbytes], spec.dst, runs)
        except Exception as e:  # noqa: BLE001 - a bad bounce is a failed writer, never a crash
            self._mark(exp, w, WriterState.FAILED, f"scatter of writer {w}'s bounced write failed: {e}")
            return False
        return True

    def _scatter_all(self, exp: _Armed, w: int, spec: WriterSpec) -> bool:
        """Scatter a bounced writer's whole slot: its one part, or each of its ``parts`` from its offset."""
        if not spec.parts:
            return self._scatter(exp, w, spec, 0, spec.slot[1] if spec.slot else 0, spec.runs)
        for dst, runs, offset in spec.parts:
            if not self._scatter(exp, w, replace(spec, dst=dst), offset, runs.total_bytes, runs):
                return False
        return True

    def _chunk(self, exp: _Armed, w: int, spec: WriterSpec, n: Notif) -> None:
        """Chunk ``n.index`` of a pipelined writer landed: scatter it now (asynchronously on CUDA)."""
        if spec.runs is None:
            self._mark(exp, w, WriterState.FAILED, f"writer {w} of {exp.key!r} pipelined without a slot")
            return
        plan, seen = exp.chunks.setdefault(w, (plan_chunks(spec.runs, n.count), set()))
        if n.index >= len(plan) or n.index in seen:
            logger.warning("receiver: chunk %d/%d of writer %d of %r invalid or repeated", n.index, n.count,
                           w, exp.key)
            return
        ch = plan[n.index]
        if not self._scatter(exp, w, spec, ch.start, ch.nbytes, ch.runs):
            return
        seen.add(n.index)
        if len(seen) == len(plan):
            self._landed(exp, w)
        else:
            self._mark(exp, w, WriterState.PARTIAL)

    def _landed(self, exp: _Armed, w: int) -> None:
        self._mark(exp, w, WriterState.LANDED)
        try:
            good = self.hooks.landed(exp.context, w, exp.payloads.get(w))
        except Exception as e:  # noqa: BLE001 - a check that cannot run proves nothing: corrupt, not a crash
            logger.warning("receiver: checking writer %d of %r raised %r", w, exp.key, e)
            good = False
        if not good:
            self._mark(exp, w, WriterState.CORRUPT, f"writer {w}'s bytes failed the check")

    def _mark(self, exp: _Armed, w: int, state: WriterState, reason: str = "") -> None:
        """The one place a writer's state changes."""
        exp.states[w] = state
        if reason:
            exp.reasons[w] = reason

    def _fire_events(self, exp: _Armed) -> None:
        """PARTIAL ipc writers whose event fired landed (an unqueryable event: wait for the notification)."""
        for w, ev in list(exp.events.items()):
            try:
                fired = bool(ev.query())
            except Exception as e:
                logger.warning("ipc: querying writer %d's CUDA event failed (%s); waiting for its "
                               "notification", w, e)
                del exp.events[w]
                self._mark(exp, w, WriterState.EXPECTED)
                continue
            if fired:
                del exp.events[w]
                self._landed(exp, w)

    # -- settling ------------------------------------------------------------------------------------

    def collect(self) -> list[RecvResult]:
        """Settle the requests that are over (every writer final, or past the deadline)."""
        now = self.clock()
        self.early.expire(now)
        out = []
        for exp in list(self._expected.values()):
            self._fire_events(exp)
            states = set(exp.states.values())
            if states <= _FINAL:
                state = (RecvState.FAILED if WriterState.FAILED in states else
                         RecvState.CORRUPT if WriterState.CORRUPT in states else RecvState.DONE)
            elif exp.deadline is not None and now >= exp.deadline:
                state = RecvState.TIMED_OUT
            else:
                continue
            out.append(self._settle(exp, state, now))
        return out

    def _settle(self, exp: _Armed, state: RecvState, now: float) -> RecvResult:
        """The one place a request ends: forget it, free (or quarantine) its staging range."""
        del self._expected[exp.key]
        self._remember(exp.key)
        landed = state is RecvState.DONE or state is RecvState.CORRUPT
        if landed:
            devices = {s.dst.device for s in exp.writers.values() if s.dst is not None and s.dst.is_cuda}
            for dev in devices:
                torch.cuda.current_stream(dev).synchronize()
        if exp.res is not None and self.arena is not None:
            if landed:
                self.arena.release(exp.res)
            else:  # a late writer may still write into it
                self.arena.quarantine(exp.res)
        if state is RecvState.DONE:
            return RecvResult(exp.key, state, "", now - exp.started, (), exp.context)
        missing = tuple(sorted(w for w, s in exp.states.items() if s not in _FINAL))
        bad = next((exp.reasons[w] for w, s in sorted(exp.states.items())
                    if s in (WriterState.FAILED, WriterState.CORRUPT) and w in exp.reasons), "")
        reason = {RecvState.TIMED_OUT: f"writers {list(missing)} did not arrive",
                  RecvState.CANCELLED: "cancelled"}.get(state, bad)
        return RecvResult(exp.key, state, reason, now - exp.started, missing, exp.context)

    def completed(self) -> list[bytes]:
        """:meth:`collect`, keys only."""
        return [r.key for r in self.collect()]

    def poll(self) -> list[bytes]:
        """Process new notifications; returns the keys now settled (all writers in, scatters done)."""
        self.pump()
        return self.completed()

    def wait(self, key: bytes, timeout_s: float = 10.0) -> RecvResult | None:
        """Poll until ``key`` settles (``None`` when it is not armed, e.g. settled already);
        ``TimeoutError`` naming the missing writers, ``RuntimeError`` when it settled other than DONE."""
        started = time.perf_counter()
        deadline = started + timeout_s
        while key in self._expected:
            self.pump()
            for r in self.collect():
                if r.key != key:
                    continue
                if r.state is not RecvState.DONE:
                    raise RuntimeError(f"receive {key!r} ended {r.state.value}: {r.reason}")
                return r
            if time.perf_counter() > deadline:
                exp = self._expected[key]
                missing = sorted(w for w, s in exp.states.items() if s not in _FINAL)
                raise TimeoutError(f"receive {key!r}: writers {missing} did not arrive in {timeout_s}s")
            time.sleep(0 if time.perf_counter() - started < 0.02 else 5e-5)  # spin briefly, then 50 us naps
        return None

    def give_up(self, key: bytes, fence_timeout_s: float) -> RecvResult | None:
        """Abandon ``key`` once no byte of its writers can land any more: at once (CANCELLED, as
        :meth:`cancel`) when every writer is final or ``key`` is not armed; otherwise it stays armed (the
        caller keeps its blocks) until each writer not final yet sent its notice, which its sender sends only
        after fencing the connection (:mod:`.fence`: NIXL flushes the connection before a fence's
        notification), and :meth:`collect` settles it then, or TIMED_OUT after ``fence_timeout_s``. ``None``
        while it waits (or when not armed)."""
        exp = self._expected.get(key)
        if exp is None or set(exp.states.values()) <= _FINAL:
            return self.cancel(key)
        exp.deadline = self.clock() + fence_timeout_s
        return None

    def cancel(self, key: bytes) -> RecvResult | None:
        """Abandon ``key``; its staging range is quarantined (a late writer may still write into it)."""
        self.early.forget(key)
        exp = self._expected.get(key)
        if exp is None:
            self._remember(key)
            return None
        return self._settle(exp, RecvState.CANCELLED, self.clock())

    def _remember(self, key: bytes) -> None:
        self._closed[key] = None
        self._closed.move_to_end(key)
        while len(self._closed) > 4096:
            self._closed.popitem(last=False)
