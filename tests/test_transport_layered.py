"""Layer-by-layer push (``core.transfer.layered`` through ``RoutedTransport.open/add/close``), on CPU.

Two real NIXL agents in this process (as ``tests/test_transport_routed.py``) and the real :class:`Receiver`.
P and D each have two pools (an MLA-like pool holding every layer, an indexer-like pool holding the owning
layers only), in a layer-outermost layout (``[layer][block][page]``: a GPU engine's) and a block-outermost
one (``[block][layer][page]``: one merged run spans every layer of a block); blocks are shuffled on both
sides. For the direct, bounce and ipc routes (ipc through a mapping of D's CPU pools, which the copies
accept): open, add every layer (in order, and in a shuffled order), close, drive ``progress`` and the
receiver until it completes; then every byte of D's pools is P's where the runs say and untouched
elsewhere, exactly one completion notice arrived, and D's pools equal those of a one-shot ``post`` of the
whole parts. The bounce route writes each layer as it is gathered with layer-outermost pools (several
WRITEs) and once, at the last layer, with block-outermost pools. Failures: a deadline passed before a
later layer, runs outside the open's parts, bytes added twice, an add after close, a close before every
byte was added: the post fails (or the call raises) and no completion notice arrives. An ipc notice on a
cold connection keeps the post in flight for the flush window (NIXL does not track it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from vllm_dsa_connector.core.plan.runs import Runs, packed_offsets
from vllm_dsa_connector.core.transfer.nixl.agent import NOTIFY_FLUSH_S
from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
from vllm_dsa_connector.core.transfer.notices import encode_notif, parse_notif
from vllm_dsa_connector.core.transfer.receiver import Receiver
from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec
from vllm_dsa_connector.core.transfer.routed import RoutedTransport
from vllm_dsa_connector.core.transfer.staging import StagingArena, StagingSlot
from vllm_dsa_connector.core.transfer.transports import PostState

LAYERS = 4
OWNING = (1, 3)  # the indexer pool's layers (the last layer owns one, so a block-outermost bounce is one WRITE)
PAGES = (320, 132)  # bytes per page of each pool
NUM_BLOCKS = 24
WRITER = 2


@dataclass
class Rig:
    a: NixlEngine
    b: NixlEngine
    peer: str
    transport: RoutedTransport
    rcv: Receiver
    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    src_regions: list
    dst_regions: list
    layout: str


def pool_layers(pool: int) -> tuple[int, ...]:
    return tuple(range(LAYERS)) if pool == 0 else OWNING


def page_offsets(layout: str, pool: int, layer: int, blocks: np.ndarray) -> np.ndarray:
    """Byte offset of ``layer``'s page of each block in a pool of the given layout."""
    ls = pool_layers(pool)
    li, page = ls.index(layer), PAGES[pool]
    if layout == "layer_outer":
        return (li * NUM_BLOCKS + blocks) * page
    return (blocks * len(ls) + li) * page


def layer_runs(layout: str, layer: int, sb: np.ndarray, db: np.ndarray) -> list[tuple[int, Runs]]:
    """``(part index, Runs)`` of one layer: its page of every block pair, in each pool holding it."""
    out = []
    for pool in (0, 1):
        if layer in pool_layers(pool):
            n = np.full(sb.size, PAGES[pool], np.int64)
            out.append((pool, Runs(page_offsets(layout, pool, layer, sb), page_offsets(layout, pool, layer, db), n)))
    return out


def whole_runs(layout: str, sb: np.ndarray, db: np.ndarray) -> list[Runs]:
    per = [layer_runs(layout, la, sb, db) for la in range(LAYERS)]
    out = []
    for pool in (0, 1):
        rs = [r for lp in per for i, r in lp if i == pool]
        out.append(Runs(np.concatenate([r.src_offsets for r in rs]), np.concatenate([r.dst_offsets for r in rs]),
                        np.concatenate([r.lengths for r in rs])).merged())
    return out


@contextmanager
def rig(layout: str, device: str = "cpu") -> Iterator[Rig]:
    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"layered-s-{stamp}"), NixlEngine(f"layered-r-{stamp}")
    try:
        gen = torch.Generator().manual_seed(5)
        sizes = [NUM_BLOCKS * len(pool_layers(p)) * PAGES[p] for p in (0, 1)]
        srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device) for n in sizes]
        dsts = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
        rs, rd = [a.register(t) for t in srcs], [b.register(t) for t in dsts]
        transport = RoutedTransport(a, 20.0, arena=StagingArena(1 << 20, device=device))
        rcv = Receiver(b, StagingArena(1 << 20, device=device))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        transport._maps[peer] = dsts  # ipc: D's pools "mapped" here (CPU tensors; the copies accept them)
        yield Rig(a, b, peer, transport, rcv, srcs, dsts, rs, rd, layout)
    finally:
        a.close()
        b.close()


def request(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(NUM_BLOCKS)[:9].astype(np.int64), rng.permutation(NUM_BLOCKS)[:9].astype(np.int64)


def expected(r: Rig, runs: list[Runs]) -> list[torch.Tensor]:
    out = []
    for pool, m in enumerate(runs):
        want = torch.zeros_like(r.dsts[pool])
        for s, d, n in zip(m.src_offsets.tolist(), m.dst_offsets.tolist(), m.lengths.tolist(), strict=True):
            want[d:d + n] = r.srcs[pool][s:s + n]
        out.append(want)
    return out


def arm(r: Rig, tag: bytes, path: str, runs: list[Runs]) -> StagingSlot | None:
    """Arm the receiver for one writer of ``path``; the writer's slot for a bounce."""
    if path != "bounce":
        r.rcv.arm(tag, {WRITER: WriterSpec(peer=r.a.name, path=path)})
        return None
    offsets, total = packed_offsets([m.total_bytes for m in runs])
    assert r.rcv.arena is not None and r.rcv.region is not None
    res = r.rcv.arena.reserve(total)
    assert res is not None
    spec = WriterSpec(peer=r.a.name, slot=(res.offset, total), path="bounce",
                      parts=tuple((r.dsts[i], runs[i], offsets[i]) for i in range(2)))
    r.rcv.arm(tag, {WRITER: spec}, reservation=res)
    return StagingSlot(r.rcv.region.desc(), res.offset, total)


def drive(r: Rig, post, timeout_s: float = 20.0, settle_s: float = 0.2) -> tuple[list, list[bytes]]:
    """Progress the post and pump the receiver until both are over (then a little longer, to catch a late
    notice); the receiver's results and every transport notice that arrived."""
    deadline = time.monotonic() + timeout_s
    results: list = []
    notices: list[bytes] = []
    over_at = None
    while over_at is None or time.monotonic() < over_at + settle_s:
        over = r.transport.progress(post)
        r.a.progress()  # the sender's engine loop: a first notice to a peer leaves only while it progresses
        for peer, msg in r.b.poll_notifications():
            if parse_notif(msg) is not None:
                notices.append(msg)
            r.rcv.handle(peer, msg)
        results += r.rcv.collect()
        if over_at is None and over and (results or post.state is PostState.FAILED):
            over_at = time.monotonic()
        assert time.monotonic() < deadline, "the post did not complete"
    return results, notices


def parts_of(r: Rig, runs: list[Runs]) -> list:
    return [(r.src_regions[i], r.dst_regions[i].desc(), runs[i]) for i in range(2)]


def push(r: Rig, tag: bytes, path: str, order: list[int], sb: np.ndarray, db: np.ndarray):
    runs = whole_runs(r.layout, sb, db)
    slot = arm(r, tag, path, runs)
    post = r.transport.open(r.peer, parts_of(r, runs), writer=WRITER, tag=tag, path=path, slot=slot, pools=[0, 1])
    assert not post.error, post.error
    for layer in order:
        r.transport.add(post, layer_runs(r.layout, layer, sb, db))
    r.transport.close(post)
    return post, runs, drive(r, post)


@pytest.mark.parametrize("layout", ["layer_outer", "block_outer"])
@pytest.mark.parametrize("path", ["direct", "bounce", "ipc"])
def test_layered_push_lands_the_whole_request_with_one_notice(layout: str, path: str) -> None:
    with rig(layout) as r:
        sb, db = request(7)
        shuffled = [2, 0, 3, 1]  # the indexer pool's last layer (3) is not the last one added
        for k, order in enumerate((list(range(LAYERS)), shuffled)):
            for t in r.dsts:
                t.zero_()
            tag = f"{path}-{k}".encode()
            post, runs, (results, notices) = push(r, tag, path, order, sb, db)
            assert post.state is PostState.DONE, post.error
            assert [x.state for x in results] == [RecvState.DONE], results
            assert notices == [encode_notif(path, WRITER, tag)]  # exactly one, the route's
            for got, want in zip(r.dsts, expected(r, runs), strict=True):
                assert torch.equal(got, want)  # P's bytes where the runs say, nothing else touched
            if path == "bounce":
                writes = len(post.stats)
                if layout == "layer_outer":
                    assert writes > 1, "each layer goes out as it is gathered"
                elif k == 0:
                    assert writes == 1, "one merged run spans every layer of a block: one WRITE, at the end"
                else:
                    assert writes <= 2
                assert r.transport.arena is not None and r.transport.arena.free_bytes == r.transport.arena.size
            elif path == "direct":
                assert len(post.stats) == sum(len(layer_runs(layout, la, sb, db)) for la in range(LAYERS))
            assert sum(s.total_bytes for s in post.stats) >= sum(m.total_bytes for m in runs)
        # the same bytes as a one-shot post of the whole parts
        layered_pools = [t.clone() for t in r.dsts]
        for t in r.dsts:
            t.zero_()
        slot = arm(r, b"oneshot", path, runs)
        if path == "ipc":  # the one-shot ipc post's notice; the receiver is armed for ipc
            one = r.transport.post(r.peer, parts_of(r, runs), writer=WRITER, tag=b"oneshot", path=path,
                                   pools=[0, 1])
        else:
            one = r.transport.post(r.peer, parts_of(r, runs), writer=WRITER, tag=b"oneshot", path=path, slot=slot)
        results, notices = drive(r, one)
        assert one.state is PostState.DONE and [x.state for x in results] == [RecvState.DONE]
        assert all(torch.equal(x, y) for x, y in zip(r.dsts, layered_pools, strict=True))


@pytest.mark.parametrize("path", ["direct", "bounce"])
def test_a_deadline_passed_before_a_later_layer_fails_the_post_without_a_notice(path: str) -> None:
    with rig("layer_outer") as r:
        sb, db = request(3)
        runs = whole_runs(r.layout, sb, db)
        slot = arm(r, b"late", path, runs)
        post = r.transport.open(r.peer, parts_of(r, runs), writer=WRITER, tag=b"late", path=path, slot=slot)
        r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        r.transport.add(post, layer_runs(r.layout, 1, sb, db), deadline=time.monotonic() - 0.01)
        assert "deadline passed" in post.error
        r.transport.add(post, layer_runs(r.layout, 2, sb, db))  # a failed post ignores further layers
        r.transport.close(post)
        results, notices = drive(r, post, settle_s=0.3)
        assert post.state is PostState.FAILED and "deadline passed" in post.error
        assert notices == [] and results == []
        assert r.transport.arena is not None and r.transport.arena.free_bytes == r.transport.arena.size

        # the open's deadline counts for every layer
        post = r.transport.open(r.peer, parts_of(r, runs), writer=WRITER, tag=b"late2", path=path, slot=slot,
                                deadline=time.monotonic() + 60)
        r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        post.deadline = time.monotonic() - 0.01
        r.transport.add(post, layer_runs(r.layout, 1, sb, db))
        r.transport.close(post)
        _, notices = drive(r, post, settle_s=0.3)
        assert post.state is PostState.FAILED and "deadline passed" in post.error and notices == []


def test_misuse_is_refused_with_clear_errors() -> None:
    with rig("block_outer") as r:
        sb, db = request(4)
        runs = whole_runs(r.layout, sb, db)
        parts = parts_of(r, runs)

        def opened(tag: bytes, path: str = "bounce"):
            slot = arm(r, tag, path, runs)
            return r.transport.open(r.peer, parts, writer=WRITER, tag=tag, path=path, slot=slot)

        # runs outside the open's parts: refused, and the post fails
        post = opened(b"outside")
        other = Runs(np.array([int(runs[0].src_offsets[0]) + 1]), np.array([int(runs[0].dst_offsets[0])]),
                     np.array([8]))
        with pytest.raises(ValueError, match="inside none of the part's runs"):
            r.transport.add(post, [(0, other)])
        with pytest.raises(ValueError, match="part 5 of a post opened with 2 parts"):
            r.transport.add(post, [(5, runs[0])])
        r.transport.close(post)
        _, notices = drive(r, post)
        assert post.state is PostState.FAILED and "inside none" in post.error and notices == []

        # bytes added twice
        post = opened(b"twice", "direct")
        r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        with pytest.raises(ValueError, match="bytes added twice"):
            r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        r.transport.close(post)
        _, notices = drive(r, post)
        assert post.state is PostState.FAILED and notices == []
        post = opened(b"twice-in-one", "direct")
        ((_, r0), *_) = layer_runs(r.layout, 0, sb, db)
        with pytest.raises(ValueError, match="bytes added twice"):
            r.transport.add(post, [(0, r0), (0, r0)])

        # one part's runs of a layer in two pieces of one add: fine
        post = opened(b"pieces", "bounce")
        for layer in range(LAYERS):
            (i, first), *rest = layer_runs(r.layout, layer, sb, db)
            h = first.num_runs // 2
            halves = [Runs(first.src_offsets[a:b], first.dst_offsets[a:b], first.lengths[a:b])
                      for a, b in ((0, h), (h, first.num_runs))]
            r.transport.add(post, [(i, halves[1]), *rest, (i, halves[0])])
        r.transport.close(post)
        results, notices = drive(r, post)
        assert post.state is PostState.DONE and len(notices) == 1 and results[0].state is RecvState.DONE

        # add after close
        post = opened(b"closed")
        for layer in range(LAYERS):
            r.transport.add(post, layer_runs(r.layout, layer, sb, db))
        r.transport.close(post)
        with pytest.raises(ValueError, match="is closed"):
            r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        results, notices = drive(r, post)
        assert post.state is PostState.DONE and len(notices) == 1 and results[0].state is RecvState.DONE

        # closed before every byte was added: failed, nothing notified
        post = opened(b"short")
        r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        r.transport.close(post)
        _, notices = drive(r, post)
        assert post.state is PostState.FAILED and "closed before every byte was added" in post.error
        assert notices == []
        assert r.transport.arena is not None and r.transport.arena.free_bytes == r.transport.arena.size

        # a route that cannot be followed: FAILED at open, as post() does
        bare = RoutedTransport(r.a, 20.0)
        post = bare.open(r.peer, parts, writer=WRITER, tag=b"no", path="bounce", slot=None)
        assert post.state is PostState.FAILED and "no staging arena" in post.error and bare.progress(post)
        post = r.transport.open(r.peer, parts, writer=WRITER, tag=b"no", path="bounce", slot=None)
        assert "without a staging slot" in post.error
        post = r.transport.open(r.peer, parts, writer=WRITER, tag=b"no", path="pigeon")
        assert "unknown path" in post.error
        with pytest.raises(TypeError, match="not a layered post"):
            r.transport.add(r.transport.post(r.peer, parts, writer=WRITER, tag=b"x"), [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["direct", "bounce", "ipc"])
def test_cuda_sources_are_posted_only_once_their_kernels_finished(path: str) -> None:
    with rig("layer_outer", "cuda") as r:
        sb, db = request(8)
        runs = whole_runs(r.layout, sb, db)
        slot = arm(r, b"cuda", path, runs)
        post = r.transport.open(r.peer, parts_of(r, runs), writer=WRITER, tag=b"cuda", path=path, slot=slot,
                                pools=[0, 1])
        assert not post.error, post.error
        torch.cuda._sleep(200_000_000)  # a long kernel on the current stream: the pages are not final yet
        r.transport.add(post, layer_runs(r.layout, 0, sb, db))
        if path != "ipc":
            assert not post._inflight and post._pending, "a WRITE was posted before the kernels finished"
        for layer in range(1, LAYERS):
            r.transport.add(post, layer_runs(r.layout, layer, sb, db))
        r.transport.close(post)
        results, notices = drive(r, post)
        assert post.state is PostState.DONE, post.error
        assert [x.state for x in results] == [RecvState.DONE] and notices == [encode_notif(path, WRITER, b"cuda")]
        torch.cuda.synchronize()
        for got, want in zip(r.dsts, expected(r, runs), strict=True):
            assert torch.equal(got, want)


def test_a_layered_ipc_notice_on_a_cold_connection_is_progressed_for_the_flush_window() -> None:
    """The layered ipc post's one notice crosses a connection no WRITE warmed: the post stays in flight until
    ``NOTIFY_FLUSH_S`` passed (P keeps progressing its agent), then it is DONE; the next one is DONE at once."""
    with rig("layer_outer") as r:
        now = [50.0]
        r.a.clock = lambda: now[0]
        sb, db = request(11)
        runs = whole_runs(r.layout, sb, db)
        for k in range(2):
            tag = f"cold-{k}".encode()
            arm(r, tag, "ipc", runs)
            post = r.transport.open(r.peer, parts_of(r, runs), writer=WRITER, tag=tag, path="ipc", pools=[0, 1])
            for layer in range(LAYERS):
                r.transport.add(post, layer_runs(r.layout, layer, sb, db))
            r.transport.close(post)
            if k == 0:  # cold: sent, kept in flight until the window passed
                assert not r.transport.progress(post) and not r.transport.progress(post)
                assert post.state is PostState.IN_FLIGHT and r.a.notification_pending(r.peer)
                now[0] += NOTIFY_FLUSH_S
            assert r.transport.progress(post) and post.state is PostState.DONE, post.error
            results, notices = drive(r, post)
            assert [x.state for x in results] == [RecvState.DONE] and notices == [encode_notif("ipc", WRITER, tag)]
