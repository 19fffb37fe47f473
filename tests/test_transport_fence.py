"""What P may still write after a give-up, with two real NIXL agents in this process over UCX TCP.

- The post deadline holds through a reconnect: the connection between the agents is aborted (``ss -K``),
  so the next post meets a dead connection and reconnects (remove + add the remote agent, post again). The
  reconnect is slowed past the deadline (``add_remote_agent`` wrapped to sleep: the one mock, a slow
  metadata load cannot be caused otherwise); the WRITE is refused, not posted after its deadline.
- Reconnects off the caller's thread (``reconnect_inline=False``, the connector's workers): a post to a peer
  whose connection is gone (NIXL dropped its remote agent) posts nothing and raises ``PeerReconnecting``; the
  reconnect is claimed once, its NIXL calls run with no lock (here: on another thread while this one posts
  to no one), a failed attempt backs off (posts then fail at once naming the next attempt, not waiting), and
  after a successful one the post lands on the new connection (counted once, ``on_reconnect`` called).
- No byte of a given-up WRITE lands in blocks D reused: D never progresses while P's WRITE is in flight (a
  stalled or partitioned D: UCX over TCP applies the bytes only when the target progresses), P aborts it at
  its write timeout and sends its failure notice, which goes as a fence (NIXL flushes the connection before a
  transfer's notification); D gives the load up (``Receiver.give_up``) and "reuses" the block (zeroes it) only
  once the receiver settles the load, then keeps progressing for other loads: the block stays zero. Without
  the fence D handed the block back at once and all 65,536 B of the aborted WRITE landed in it later.
- D's wait for P's fence ends early only when P's start is gone (``core.handoff.fence_waits``): its side channel
  refuses connections (a real listening socket closed), or P answers from another start; a P that still
  listens (stalled, or just slow) keeps it waiting.
- P's staging arena does not leak on failed bounces: bounced WRITEs to a receiver that never progresses
  (UCX TCP: the bytes wait for the target) time out, more of them than the arena holds; every one's space
  comes back once its connection is fenced, and the next bounce finds room. With the reconnect off the
  caller's thread (``reconnect_inline=False``) a fence that closes the connection keeps the space quarantined
  until the new connection is made, then fences the notice again on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from tests.test_transport_nixl import _kill_connections, _kill_unavailable
from vllm_dsa_connector.core.plan.runs import runs_from_blocks
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec
from vllm_dsa_connector.core.transfer.routed import RoutedTransport
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import PostState

PAGE = 4096


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents made inside use UCX over TCP only (as between hosts): a WRITE waits for the target to progress."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    yield


def _pair(tag: str) -> tuple[NixlEngine, NixlEngine]:
    stamp = time.monotonic_ns()
    return NixlEngine(f"{tag}-p-{stamp}"), NixlEngine(f"{tag}-d-{stamp}")


def _until_done(p: NixlEngine, d: NixlEngine, xfer, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while p.state(xfer) == "PROC":
        d.progress()
        assert time.monotonic() < end, "the WRITE did not complete"
    p.wait(xfer)


def test_post_deadline_is_checked_after_a_reconnect_right_before_the_post(tcp: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    why = _kill_unavailable()
    if why:
        pytest.skip(why)
    p, d = _pair("dl")
    try:
        src = torch.full((4 * PAGE,), 7, dtype=torch.uint8)
        dst = torch.zeros(4 * PAGE, dtype=torch.uint8)
        rs, rd = p.register(src), d.register(dst)
        peer = p.add_peer(d.metadata())
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [0], PAGE)))
        assert _kill_connections(os.getpid(), os.getpid()) > 0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # both agents see the reset
            p.progress()
            d.progress()
        slow = p._agent.add_remote_agent

        def slow_add(meta: bytes):  # a reconnect that takes 1.5 s (a slow metadata load)
            time.sleep(1.5)
            return slow(meta)

        monkeypatch.setattr(p._agent, "add_remote_agent", slow_add)
        transport = RoutedTransport(p, 5.0)
        started = time.monotonic()
        post = transport.post(peer, [(rs, rd.desc(), runs_from_blocks([0], [1], PAGE))], writer=0, tag=b"late",
                              deadline=started + 0.5)
        took = time.monotonic() - started
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # anything posted lands meanwhile
            transport.progress(post)
            d.progress()
        assert p.reconnects == 1 and took >= 1.5, (p.reconnects, took)  # the reconnect did run past the deadline
        assert post.state is PostState.FAILED and "post deadline passed" in post.error, post.error
        assert not bool(dst[PAGE:2 * PAGE].any()), "a WRITE was posted after its deadline (during a reconnect)"
        # a post before its deadline goes through on the reconnected connection
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [2], PAGE),
                                  deadline=time.monotonic() + 10))
        assert bool((dst[2 * PAGE:3 * PAGE] == 7).all())
    finally:
        p.close()
        d.close()


def test_reconnect_off_the_posting_thread_keeps_the_backoff(tcp: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from vllm_dsa_connector.core.transfer.nixl.agent import PeerReconnecting
    from vllm_dsa_connector.core.transfer.nixl.data import TransferError

    stamp = time.monotonic_ns()
    seen: list[tuple[str, str]] = []
    p = NixlEngine(f"off-p-{stamp}", reconnect_inline=False, reconnect_backoff_s=0.2, reconnect_backoff_max_s=0.4,
                   on_reconnect=lambda peer, why: seen.append((peer, why)))
    d = NixlEngine(f"off-d-{stamp}")
    try:
        src = torch.full((4 * PAGE,), 9, dtype=torch.uint8)
        dst = torch.zeros(4 * PAGE, dtype=torch.uint8)
        rs, rd = p.register(src), d.register(dst)
        peer = p.add_peer(d.metadata())
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [0], PAGE)))
        p._agent.remove_remote_agent(peer)  # what NIXL does itself after a remote disconnect
        with pytest.raises(PeerReconnecting):  # nothing posted, no reconnect on this thread
            p.write(peer, rs, rd.desc(), runs_from_blocks([0], [1], PAGE))
        assert p.reconnects == 0 and p.disconnected(peer) and p.reconnect_pending(peer)
        with pytest.raises(PeerReconnecting):  # marked: the next post does not even try
            p.write(peer, rs, rd.desc(), runs_from_blocks([0], [1], PAGE))
        meta = p.begin_reconnect(peer)
        assert meta is not None and p.begin_reconnect(peer) is None  # claimed once
        real = p._agent.add_remote_agent

        def refused(meta: bytes):  # the peer is still unreachable: the re-add fails (the fault)
            raise RuntimeError("connect refused (test)")

        monkeypatch.setattr(p._agent, "add_remote_agent", refused)
        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: _reload(p, peer, meta, errors))
        t.start()
        t.join(10)
        with pytest.raises(TransferError, match="next attempt in"):
            p.end_reconnect(peer, errors[0], "lost (test)")
        assert not p.reconnect_pending(peer)  # backing off: posts fail at once, they do not wait
        with pytest.raises(TransferError, match="next reconnect attempt in") as refusal:
            p.write(peer, rs, rd.desc(), runs_from_blocks([0], [1], PAGE))
        assert not isinstance(refusal.value, PeerReconnecting)
        assert p.begin_reconnect(peer) is None
        time.sleep(0.25)  # the backoff is over: the next attempt may be made
        assert p.reconnect_pending(peer)
        monkeypatch.setattr(p._agent, "add_remote_agent", real)
        meta = p.begin_reconnect(peer)
        assert meta is not None
        errors.clear()
        t = threading.Thread(target=lambda: _reload(p, peer, meta, errors))
        t.start()
        t.join(10)
        assert not errors
        p.end_reconnect(peer, None, "lost (test)")
        assert p.reconnects == 1 and len(seen) == 1 and not p.disconnected(peer) and not p.reconnect_pending(peer)
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [1], PAGE)))
        assert bool((dst[PAGE:2 * PAGE] == 9).all())
        assert p.backoff(peer) == (0, 0.0)  # a transfer completed on the new connection: the backoff is over
    finally:
        p.close()
        d.close()


def _reload(p: NixlEngine, peer: str, meta: bytes, errors: list[BaseException]) -> None:
    try:
        p.reload_peer(peer, meta)
    except Exception as e:  # noqa: BLE001 - handed to end_reconnect
        errors.append(e)


def _drive_until(cond, *engines: NixlEngine, timeout_s: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        for e in engines:
            e.progress()
        assert time.monotonic() < end, what


def test_a_given_up_write_never_lands_in_a_reused_block(tcp: None) -> None:
    p, d = _pair("fence")
    try:
        n = 1 << 16
        src = torch.full((2 * n,), 7, dtype=torch.uint8)
        dst = torch.zeros(2 * n, dtype=torch.uint8)
        rs, rd = p.register(src), d.register(dst)
        peer = p.add_peer(d.metadata())
        rcv = Receiver(d)
        _until_done(p, d, p.write(peer, rs, rd.desc(), runs_from_blocks([0], [0], 4096)))  # a warm connection
        rcv.pump()
        transport = RoutedTransport(p, 0.3)
        rcv.arm(b"req", {0: WriterSpec(peer=p.name, path="direct")})
        post = transport.post(peer, [(rs, rd.desc(), runs_from_blocks([0], [1], n))], writer=0, tag=b"req")
        _drive_until(lambda: transport.progress(post), p, what="the WRITE was never aborted")  # D stalls
        assert post.state is PostState.FAILED and "timed out" in post.error, post.error
        assert not bool(dst[n:].any())  # nothing landed yet: D did not progress
        transport.notify(peer, 0, b"req")  # P's failure notice (a fence after the aborted WRITE)
        assert rcv.give_up(b"req", fence_timeout_s=30.0) is None  # a WRITE may be in flight: not yet
        reused_at = None
        end = time.monotonic() + 5.0
        while time.monotonic() < end:  # D progresses for other loads; P confirms its fence
            rcv.pump()
            for r in rcv.collect():
                assert r.key == b"req" and r.state is not RecvState.TIMED_OUT
                dst[n:].zero_()  # D hands the block back; vLLM reuses it
                reused_at = time.monotonic()
            transport.poll_fences()
            if reused_at is not None and time.monotonic() - reused_at > 1.0:
                break
        assert reused_at is not None, "the given-up load never settled (P's fence did not arrive)"
        landed = int((dst[n:] == 7).sum())
        assert landed == 0, f"{landed} B of the given-up WRITE landed in the reused block"
        assert transport.fences.fenced == 1 and transport.fences.resets == 0
    finally:
        p.close()
        d.close()


def test_timed_out_bounces_do_not_exhaust_the_staging_arena(tcp: None) -> None:
    p, d = _pair("arena")
    try:
        n = 1 << 16
        src = torch.full((n,), 5, dtype=torch.uint8)
        rs = p.register(src)
        recv_arena = StagingArena(n)
        rslot = d.register(recv_arena.buffer)
        peer = p.add_peer(d.metadata())
        arena = StagingArena(4 * n)  # four bounces' worth
        transport = RoutedTransport(p, 0.2, arena=arena, reserve_timeout_s=0.0)
        slot = StagingSlot(rslot.desc(), 0, n)
        for i in range(8):  # twice what the arena holds; D progresses for every other one only
            stalled = i % 2 == 0
            post = transport.post(peer, [(rs, rslot.desc(), runs_from_blocks([0], [0], n))], writer=0,
                                  tag=f"b{i}".encode(), path="bounce", slot=slot)
            assert post.state is PostState.IN_FLIGHT, f"bounce {i}: {post.error}"
            _drive_until(lambda post=post: transport.progress(post), p, what=f"bounce {i} never ended")
            if post.state is PostState.DONE:  # D progressed before the timeout: nothing to fence
                continue
            # timed out (aborted), or failed by a connection a fence closed under it (a stalled D)
            assert "timed out" in post.error or "ERR" in post.error, post.error
            transport.notify(peer, 0, f"b{i}".encode())  # its failure notice: a fence
            engines = (p,) if stalled else (p, d)  # a stalled D: the fence is overdue, the connection closed
            _drive_until(lambda s=stalled: (transport.poll_fences(), arena.quarantined_bytes == 0
                                            and (s or transport.fences.pending == 0))[1], *engines,
                         what=f"bounce {i}'s staging was never given back")
        assert arena.free_bytes == arena.size and arena.quarantined_bytes == 0
        print(f"fences confirmed {transport.fences.fenced}, connections reset {transport.fences.resets}")
        assert transport.fences.resets >= 1  # a stalled D: the connection was closed instead
        assert transport.fences.fenced >= 1  # a D that progresses confirms the fences (re-posted ones too)
    finally:
        p.close()
        d.close()


def test_a_fence_closed_off_thread_keeps_the_staging_until_the_new_connection(tcp: None) -> None:
    stamp = time.monotonic_ns()
    p, d = NixlEngine(f"offf-p-{stamp}", reconnect_inline=False), NixlEngine(f"offf-d-{stamp}")
    try:
        n = 1 << 16
        rs = p.register(torch.full((n,), 5, dtype=torch.uint8))
        recv_arena = StagingArena(n)
        rslot = d.register(recv_arena.buffer)
        peer = p.add_peer(d.metadata())
        arena = StagingArena(2 * n)
        transport = RoutedTransport(p, 0.2, arena=arena, reserve_timeout_s=0.0)
        post = transport.post(peer, [(rs, rslot.desc(), runs_from_blocks([0], [0], n))], writer=0, tag=b"s",
                              path="bounce", slot=StagingSlot(rslot.desc(), 0, n))
        _drive_until(lambda: transport.progress(post), p, what="the stalled bounce never ended")  # D stalls
        assert post.state is PostState.FAILED and arena.quarantined_bytes == n, post.error
        transport.notify(peer, 0, b"s")  # its failure notice: a fence, overdue while D stalls
        _drive_until(lambda: (transport.poll_fences(), transport.fences.resets >= 1)[1], p,
                     what="the overdue fence never closed the connection")
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # nothing gives the space back before the connection is really closed
            transport.poll_fences()
        assert arena.quarantined_bytes == n and p.disconnected(peer) and transport.fences.unposted() == {peer}
        meta = p.begin_reconnect(peer)  # what the connector's set-up thread does
        assert meta is not None
        p.reload_peer(peer, meta)
        p.end_reconnect(peer, None)
        _drive_until(lambda: (transport.poll_fences(), arena.quarantined_bytes == 0
                              and transport.fences.pending == 0)[1], p, d,
                     what="the fence was never confirmed on the new connection")
        assert p.reconnects == 1 and transport.fences.fenced == 1 and arena.free_bytes == arena.size
    finally:
        p.close()
        d.close()


def test_fence_waits_end_only_when_p_is_gone() -> None:
    import socket

    from vllm_dsa_connector.core.handoff.fence_waits import FenceWaits

    alive = socket.create_server(("127.0.0.1", 0))  # a P that listens (its engine may be stalled)
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # a P whose process is gone: nothing listens on its port any more
    epochs = {"p-alive": 5, "p-dead": 7, "p-restarted": 9}
    waits = FenceWaits(probe_every_s=0.0)
    try:
        waits.add("r1", "p-alive", "127.0.0.1", alive.getsockname()[1], 5)
        waits.add("r2", "p-dead", "127.0.0.1", dead_port, 7)
        waits.add("r3", "p-restarted", "127.0.0.1", alive.getsockname()[1], 8)  # D now knows start 9
        void: set[str] = set()
        end = time.monotonic() + 10
        while "r2" not in void:
            void |= waits.step(epochs.get)
            assert time.monotonic() < end, void
            time.sleep(0.05)
        for _ in range(5):  # probed again and again: a P that listens is never given up on
            void |= waits.step(epochs.get)
            time.sleep(0.05)
        assert void == {"r2", "r3"} and len(waits) == 1
        waits.done("r1")
        assert len(waits) == 0
    finally:
        alive.close()
        waits.shutdown()
