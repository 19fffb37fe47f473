"""The routed transport (``core.transfer.routed``): a writer follows the path the receiver chose, never another.

Two real NIXL agents in this process, each with two registered pools (a GPU engine's layout: the MLA latent
and the indexer K cache in separate pools), and the one :class:`Receiver`:

- a bounce route carries both parts of a writer in one slot (packed at ``packed_parts``' offsets, the layout
  ``WriterSpec.for_bounce`` scatters from), one WRITE, and the receiver scatters each part where it belongs;
- a direct route writes each part;
- a notification of another kind than the writer's route fails that writer (``COMPLETES``);
- a route the writer cannot follow (no local arena, a slot smaller than the parts, an ipc route without a
  mapping of the receiver's pools) fails the post with the reason, nothing posted and nothing notified;
- an ipc post's notice on a cold connection (no completed message on it yet) keeps the post in flight for
  the flush window (NIXL does not track the notice: it leaves only while P progresses).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_dsa_connector.core.plan.runs import Runs, packed_offsets, packed_parts, runs_from_blocks
from vllm_dsa_connector.core.transfer.nixl.agent import NOTIFY_FLUSH_S
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_notif
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec
from vllm_dsa_connector.core.transfer.routed import RoutedTransport
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import PostState

POOL = 1 << 20


def _drive(transport: RoutedTransport, post, rcv: Receiver, timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    done: list = []
    over = False
    while not (done and over):
        over = transport.progress(post)
        rcv.pump()
        done = done or rcv.collect()
        assert time.monotonic() < deadline, "the post did not complete"
    return done


def test_routes_are_followed_and_a_route_that_cannot_be_is_a_failed_post() -> None:
    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"routed-s-{stamp}"), NixlEngine(f"routed-r-{stamp}")
    try:
        gen = torch.Generator().manual_seed(9)
        srcs = [torch.randint(0, 256, (POOL,), dtype=torch.uint8, generator=gen) for _ in range(2)]
        dsts = [torch.zeros(POOL, dtype=torch.uint8) for _ in range(2)]
        rs = [a.register(t) for t in srcs]
        rd = [b.register(t) for t in dsts]
        arena = StagingArena(4 << 20)
        rcv = Receiver(b, arena)
        assert rcv.region is not None
        transport = RoutedTransport(a, 20.0, arena=StagingArena(4 << 20))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        rng = np.random.default_rng(3)
        # two parts of different page sizes (1000 and 4096 B: the second part's packed start is 512-aligned)
        runs = [runs_from_blocks(rng.choice(900, 30, replace=False), rng.choice(900, 30, replace=False), 1000),
                runs_from_blocks(rng.choice(200, 12, replace=False), rng.choice(200, 12, replace=False), 4096)]
        parts = [(rs[i], rd[i].desc(), runs[i]) for i in range(2)]
        merged, offsets, total = packed_parts(runs)
        assert [r.num_runs for r in merged] == [r.merged().num_runs for r in runs]
        assert offsets[1] % 512 == 0 and total > sum(r.total_bytes for r in merged)

        def expect_pages() -> None:
            for i in range(2):
                r = merged[i]
                for s, d, n in zip(r.src_offsets, r.dst_offsets, r.lengths, strict=True):
                    assert torch.equal(dsts[i][d:d + n], srcs[i][s:s + n]), f"pool {i} run at {d}"

        # bounce: one slot for both parts
        res = arena.reserve(total)
        assert res is not None
        spec = WriterSpec.for_bounce(a.name, (res.offset, total), [(dsts[i], runs[i]) for i in range(2)])
        assert not spec.error and [off for _, _, off in spec.parts] == offsets and spec.path == "bounce"
        short = WriterSpec.for_bounce(a.name, (res.offset, total - 1), [(dsts[i], runs[i]) for i in range(2)])
        assert short.error == f"its parts need {total} B, the slot holds {total - 1} B" and not short.parts
        rcv.arm(b"bounce", {3: spec}, reservation=res)
        post = transport.post(peer, parts, writer=3, tag=b"bounce", path="bounce",
                              slot=StagingSlot(rcv.region.desc(), res.offset, total))
        assert not post.error and post.path == "bounce"
        assert [r.state for r in _drive(transport, post, rcv)] == [RecvState.DONE]
        assert post.state is PostState.DONE and len(post.stats) == 1  # one WRITE for both parts
        expect_pages()
        assert transport.arena is not None and transport.arena.free_bytes == transport.arena.size

        # direct: one WRITE per part, the notification after both
        for t in dsts:
            t.zero_()
        rcv.arm(b"direct", {3: WriterSpec(peer=a.name, path="direct")})
        post = transport.post(peer, parts, writer=3, tag=b"direct")
        assert [r.state for r in _drive(transport, post, rcv)] == [RecvState.DONE] and len(post.stats) == 2
        expect_pages()

        # a notification of another kind than the route: the writer fails, naming both
        rcv.arm(b"wrong", {3: WriterSpec(peer=a.name, path="ipc")})
        post = transport.post(peer, parts, writer=3, tag=b"wrong")
        (result,) = _drive(transport, post, rcv)
        assert result.state is RecvState.FAILED and "direct notification; its route is ipc" in result.reason

        # routes the writer cannot follow: failed at once, with the reason; nothing in flight
        bare = RoutedTransport(a, 20.0)
        small = StagingSlot(rcv.region.desc(), 0, total - 1)
        for t, path, slot, why in ((bare, "bounce", small, "no staging arena"),
                                   (transport, "bounce", small, f"the parts need {total} B"),
                                   (transport, "bounce", None, "without a staging slot"),
                                   (transport, "ipc", None, "not mapped here"),
                                   (transport, "carrier-pigeon", None, "unknown path")):
            post = t.post(peer, parts, writer=3, tag=b"no", path=path, slot=slot, pools=[0, 1])
            assert post.state is PostState.FAILED and why in post.error, (path, post.error)
            assert f"cannot follow the receiver's {path} route" in post.error and not post._inflight
            assert t.progress(post)
        assert transport.arena.free_bytes == transport.arena.size
        empty = Runs.empty()
        assert packed_offsets([empty.total_bytes]) == ([0], 0)
    finally:
        a.close()
        b.close()


def test_an_ipc_notice_on_a_cold_connection_is_progressed_for_the_flush_window() -> None:
    """No WRITE crosses an ipc post's connection and NIXL does not track its notification: on a connection
    that has not carried a completed message, the post stays in flight (each progress progressing P's agent)
    until ``NOTIFY_FLUSH_S`` passed, then it is DONE and the connection warm (the next post DONE at once); a
    completed WRITE warms a connection too; a reconnect makes it cold again. The failure notice
    (``notify``) progresses for the window itself."""
    stamp = time.monotonic_ns()
    now = [100.0]
    a, b = NixlEngine(f"cold-s-{stamp}", clock=lambda: now[0]), NixlEngine(f"cold-r-{stamp}")
    try:
        src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        dst = torch.zeros_like(src)
        rs, rd = a.register(src), b.register(dst)
        transport = RoutedTransport(a, 20.0, clock=lambda: now[0])
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        transport._maps[peer] = [dst]  # D's pool "mapped" here (a CPU tensor: the copies accept it)
        parts = [(rs, rd.desc(), Runs(np.array([0]), np.array([0]), np.array([src.numel()])))]

        def ipc(tag: bytes):
            return transport.post(peer, parts, writer=1, tag=tag, path="ipc", pools=[0])

        post = ipc(b"first")
        for _ in range(3):  # sent, but kept in flight: P keeps progressing its agent
            assert not transport.progress(post) and post.state is PostState.IN_FLIGHT
        assert len(post.stats) == 1 and a.notification_pending(peer) and torch.equal(dst, src)
        now[0] += NOTIFY_FLUSH_S - 0.01
        assert not transport.progress(post)
        later = ipc(b"later")  # sent within the window: it queues behind the first and does not extend it
        assert not transport.progress(later)
        now[0] += 0.01
        assert transport.progress(post) and post.state is PostState.DONE and not post.error
        assert transport.progress(later) and later.state is PostState.DONE
        assert len(post.stats) == 1  # one notification, not sent again
        post = ipc(b"second")  # warm now: DONE at once
        assert transport.progress(post) and post.state is PostState.DONE

        a.reconnect(peer, "test")  # a new connection: cold again
        post = ipc(b"third")
        assert not transport.progress(post)
        now[0] += NOTIFY_FLUSH_S
        assert transport.progress(post) and post.state is PostState.DONE

        a.reconnect(peer, "test")  # a completed WRITE warms the new connection
        direct = transport.post(peer, parts, writer=1, tag=b"direct")
        deadline = time.monotonic() + 20
        while not transport.progress(direct):
            b.progress()  # D's engine loop (the new connection's wire-up needs both sides)
            assert time.monotonic() < deadline, "the direct post did not complete"
        assert direct.state is PostState.DONE and not a.notification_pending(peer)
        post = ipc(b"fourth")
        assert transport.progress(post) and post.state is PostState.DONE

        got: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(got) < 6:  # every notice arrived, each once
            got += [m for _, m in b.poll_notifications()]
            assert time.monotonic() < deadline, got
        assert sorted(got) == sorted(encode_notif(p, 1, t) for p, t in (
            ("ipc", b"first"), ("ipc", b"later"), ("ipc", b"second"), ("ipc", b"third"), ("direct", b"direct"), ("ipc", b"fourth")))

        a.reconnect(peer, "test")  # a failure notice on a cold connection: progressed for the window in notify
        a.clock = time.perf_counter
        t0 = time.perf_counter()
        transport.notify(peer, 1, b"failed")
        assert time.perf_counter() - t0 >= NOTIFY_FLUSH_S and not a.notification_pending(peer)
    finally:
        a.close()
        b.close()
