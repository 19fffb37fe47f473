"""Transport paths beyond bounce/direct, on CPU: chunk plans, the run-copy planner and kernel (Triton's
interpreter), the benches' per-link path chooser, chunk/IPC notifications, the pipelined receiver, and a pipelined bounce
between two real NIXL agents. Timings are never asserted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from vllm_dsa_dev.harness.paths.links import LINKS, LinkSettings, PathChooser, link_between

from vllm_dsa_connector.core.plan.runs import Runs, plan_chunks, runs_from_blocks
from vllm_dsa_connector.core.transfer.copy.kernels import plan_pieces
from vllm_dsa_connector.core.transfer.copy.local_copy import copy_runs
from vllm_dsa_connector.core.transfer.gate import BounceGate
from vllm_dsa_connector.core.transfer.gate_options import BounceSettings
from vllm_dsa_connector.core.transfer.ipc import IpcDesc
from vllm_dsa_connector.core.transfer.notices import (
    decode_chunk_notif,
    decode_event_notif,
    decode_notif,
    encode_chunk_notif,
    encode_event_notif,
    encode_notif,
)
from vllm_dsa_connector.core.transfer.staging import StagingArena
from vllm_dsa_connector.options import OptionError

GLM_BLOCK = 78 * 41984 + 21 * 8448  # bytes of one GLM-5.2-shaped block (BLHNC)


def _bytes(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if lengths.size == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(o, o + n) for o, n in zip(offsets, lengths, strict=True)])


def _random_runs(rng: np.random.Generator, n: int, unit: int, off: int = 0) -> Runs:
    lens = rng.integers(1, 40, n) * unit
    gaps = rng.integers(1, 9, n) * unit
    src = np.r_[0, np.cumsum((lens + gaps)[:-1])] + off
    order = rng.permutation(n)
    dst = np.empty(n, np.int64)
    dst[order] = np.r_[0, np.cumsum((lens[order] + gaps[order])[:-1])] + off
    return Runs(src, dst, lens)


# -- plans ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16, 1000])
def test_plan_chunks_covers_every_byte_once_in_order(count: int) -> None:
    runs = _random_runs(np.random.default_rng(count), 100, 256)
    chunks = plan_chunks(runs, count, align=4096)
    assert 1 <= len(chunks) <= count
    pos = 0
    for i, ch in enumerate(chunks):
        assert ch.index == i and ch.start == pos and ch.runs.total_bytes == ch.nbytes > 0
        assert ch.start % 4096 == 0
        pos += ch.nbytes
    assert pos == runs.total_bytes
    src = np.concatenate([_bytes(c.runs.src_offsets, c.runs.lengths) for c in chunks])
    dst = np.concatenate([_bytes(c.runs.dst_offsets, c.runs.lengths) for c in chunks])
    assert np.array_equal(src, _bytes(runs.src_offsets, runs.lengths))
    assert np.array_equal(dst, _bytes(runs.dst_offsets, runs.lengths))
    assert plan_chunks(Runs.empty(), 4) == []
    with pytest.raises(ValueError):
        plan_chunks(runs, 0)


def test_plan_pieces_splits_runs_keeping_alignment() -> None:
    t = plan_pieces(np.array([0, 10_000]), np.array([5_000, 0]), np.array([1000, 0]), 300)
    assert t.tolist() == [[0, 300, 600, 900], [5000, 5300, 5600, 5900], [300, 300, 300, 100]]
    assert plan_pieces(np.zeros(0), np.zeros(0), np.zeros(0), 8).shape == (3, 0)


def test_runs_table_splits_only_skewed_runs() -> None:
    from vllm_dsa_connector.core.transfer.copy.kernels import _runs_table

    lens = np.full(10, 1 << 20, np.int64)
    table, per_run = _runs_table(np.arange(10) << 20, np.arange(10) << 20, lens, 1 << 16)
    assert table.shape == (3, 10) and per_run == 16  # uniform: one entry per run
    lens[3] = 1 << 30  # one run 1024x the others: split so the grid stays small
    table, per_run = _runs_table(np.arange(10) << 31, np.arange(10) << 31, lens, 1 << 16)
    assert table.shape[1] > 10 and table[2].sum() == lens.sum() and per_run * table.shape[1] < 4 * (
        lens.sum() >> 16
    )


# -- copy ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unit,off", [(1, 3), (8, 0), (16, 0), (576, 0)])
def test_copy_runs_scattered_to_scattered_exact(unit: int, off: int) -> None:
    runs = _random_runs(np.random.default_rng(unit), 200, unit, off)
    size = max(runs.src_extent(), runs.dst_extent()) + 64
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    assert copy_runs(src, dst, runs) == "index"  # CPU
    ref = np.zeros(size, np.uint8)
    ref[_bytes(runs.dst_offsets, runs.lengths)] = src.numpy()[_bytes(runs.src_offsets, runs.lengths)]
    assert np.array_equal(dst.numpy(), ref)
    with pytest.raises(ValueError):
        copy_runs(src, dst[:10], runs)
    with pytest.raises(ValueError):
        copy_runs(src, dst, runs, impl="triton")  # needs CUDA tensors


_INTERPRET = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
from vllm_dsa_connector.core.transfer.copy import local_copy as C
from vllm_dsa_connector.core.transfer.copy import kernels as K
from vllm_dsa_connector.core.transfer.copy import launches as LA
from vllm_dsa_connector.core.plan.runs import Runs
assert C.triton_available(), K._KERNEL_ERROR
rng = np.random.default_rng(0)
for unit, off, skew in ((1, 3, False), (8, 0, False), (16, 0, True), (256, 0, False)):
    n = 40
    lens = rng.integers(1, 40, n) * unit
    if skew:
        lens[5] = lens.sum() * 5 // unit * unit
    gaps = rng.integers(1, 9, n) * unit
    src = np.r_[0, np.cumsum((lens + gaps)[:-1])] + off
    order = rng.permutation(n)
    dst = np.empty(n, np.int64)
    dst[order] = np.r_[0, np.cumsum((lens[order] + gaps[order])[:-1])] + off
    runs = Runs(src, dst, lens)
    size = int(max(runs.src_extent(), runs.dst_extent())) + 16
    s = torch.randint(0, 256, (size,), dtype=torch.uint8)
    d = torch.zeros(size, dtype=torch.uint8)
    cfg = C.CopyConfig(piece_bytes=1024, block_bytes=64, num_warps=1)
    K.launch_triton(s, d, runs.src_offsets, runs.dst_offsets, runs.lengths, cfg)
    ref = torch.zeros(size, dtype=torch.uint8)
    C._copy_index(s, ref, runs.src_offsets, runs.dst_offsets, runs.lengths)
    assert torch.equal(d, ref), (unit, off, skew)
print("ok")
"""


def test_triton_copy_kernel_exact_under_interpreter() -> None:
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRET], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


_PLANS = r"""
import gc, os
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
from vllm_dsa_connector.core.transfer.copy import local_copy as C
from vllm_dsa_connector.core.transfer.copy import kernels as K
from vllm_dsa_connector.core.transfer.copy import launches as LA
from vllm_dsa_connector.core.plan.runs import Runs
assert C.triton_available(), K._KERNEL_ERROR
rng = np.random.default_rng(1)
n = 30
lens = rng.integers(1, 40, n) * 16
gaps = rng.integers(1, 9, n) * 16
src = np.r_[0, np.cumsum((lens + gaps)[:-1])]
order = rng.permutation(n)
dst = np.empty(n, np.int64)
dst[order] = np.r_[0, np.cumsum((lens[order] + gaps[order])[:-1])]
runs = Runs(src, dst, lens)
size = int(max(runs.src_extent(), runs.dst_extent())) + 16
s = torch.randint(0, 256, (size,), dtype=torch.uint8)
d1, d2 = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
ref = torch.zeros(size, dtype=torch.uint8)
C._copy_index(s, ref, runs.src_offsets, runs.dst_offsets, runs.lengths)
cfg = C.CopyConfig(piece_bytes=1024, block_bytes=64, num_warps=1)
LA.copy_planned(runs, s, d1, cfg)
assert torch.equal(d1, ref)
d1.zero_()
LA.copy_planned(runs, s, d1, cfg)  # the cached plan: same bytes
assert torch.equal(d1, ref)
st = LA.plan_stats()
assert st["plans"] == 1 and st["plan_hits"] == 1, st
LA.copy_planned(runs, s, d2, cfg)  # another destination: its own plan
assert LA.plan_stats()["plans"] == 2 and torch.equal(d2, ref)
try:
    LA.copy_planned(Runs(src, dst, lens), s, d1[:10], cfg)  # bounds checked when a plan is built
    raise SystemExit("no bounds check")
except ValueError:
    pass
assert len(LA._PLANS) == 1
del runs
gc.collect()
assert len(LA._PLANS) == 0  # plans go with their runs
print("ok")
"""


def test_copy_plans_cached_per_runs_under_interpreter() -> None:
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _PLANS], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_copy_graphs_switch() -> None:
    from vllm_dsa_connector.core.transfer.copy.launches import graphs_enabled, plan_stats

    assert graphs_enabled({}) and graphs_enabled({"VLLM_DSA_COPY_GRAPH": "1"})
    assert not graphs_enabled({"VLLM_DSA_COPY_GRAPH": "0"})
    assert not graphs_enabled({"VLLM_DSA_COPY_GRAPH": "off"})
    assert set(plan_stats()) == {"plans", "plan_hits", "graphs", "graph_replays", "graph_failures"}


def test_copy_config_from_env() -> None:
    from vllm_dsa_connector.core.transfer.copy.kernels import DEFAULT_CONFIG, default_config
    from vllm_dsa_connector.core.transfer.copy.local_copy import default_impl

    assert default_config({}) is DEFAULT_CONFIG
    cfg = default_config({"VLLM_DSA_COPY_CONFIG": "65536,16384,8"})
    assert (cfg.piece_bytes, cfg.block_bytes, cfg.num_warps) == (65536, 16384, 8)
    with pytest.raises(ValueError):
        default_config({"VLLM_DSA_COPY_CONFIG": "big"})
    assert default_impl({}) == "auto" and default_impl({"VLLM_DSA_COPY_IMPL": "ce"}) == "ce"
    with pytest.raises(ValueError):
        default_impl({"VLLM_DSA_COPY_IMPL": "dma"})


# -- gate ----------------------------------------------------------------------------------------------


def _glm(blocks: int) -> Runs:
    return runs_from_blocks(np.arange(blocks) * 2, np.arange(blocks) * 2 + 1, GLM_BLOCK)


ALL = ("direct", "bounce", "pipelined", "ipc")


def _profile_arithmetic(link: str, runs: Runs) -> dict[str, float]:
    """The link profile's formulas written out (us), for the paths one GPU / two GPUs compare."""
    lp, n, b = LINKS[link], runs.num_runs, runs.total_bytes
    assert not lp.async_post and lp.ipc_gbps is not None
    return {
        "direct": lp.post_us + n * lp.desc_us + b / (lp.wire_gbps * 1e3),
        "bounce": lp.post_us + lp.bounce_us + lp.desc_us + b / (lp.wire_gbps * 1e3) + 2 * b / (lp.copy_gbps * 1e3),
        "ipc": lp.ipc_us + b / (lp.ipc_gbps * 1e3),
    }


@pytest.mark.parametrize(
    "link,blocks,expected",
    [
        # The profile's choice; the H200 runs measured the same path fastest (docs/benchmarks.md, "The bounce
        # gate": same GPU, h200_transfer_paths_rerun: ipc 1.571 / 0.569 / 0.451 ms vs direct 6.689 / 1.129 / 0.564).
        ("same_gpu", 594, "ipc"),
        ("same_gpu", 64, "ipc"),
        ("same_gpu", 8, "ipc"),
        ("nvlink", 594, "ipc"),
        ("nvlink", 64, "ipc"),
        ("nvlink", 8, "ipc"),
    ],
)
def test_gate_choose_per_link_follows_profile_arithmetic(link: str, blocks: int, expected: str) -> None:
    runs = _glm(blocks).merged()
    d = PathChooser(BounceGate(device="cuda:0", environ={}), link=link).choose(runs, merged=True, paths=ALL)
    assert d.path == expected and d.link == link and f"link {link}" in d.reason
    est = dict(d.estimates)
    want = _profile_arithmetic(link, runs)
    for path, us in want.items():
        assert est[path] == pytest.approx(us)
    # every other candidate (pipelined:K) costs more than the cheapest of the three
    assert min(want, key=want.__getitem__) == expected
    assert all(u >= want[expected] for p, u in est.items() if p.startswith("pipelined"))


def test_gate_choose_paths_thresholds_and_modes() -> None:
    gate = PathChooser(BounceGate(device="cuda:0", environ={}), link="nvlink")
    big = _glm(594)
    assert gate.choose(big, paths=("direct", "bounce", "pipelined")).path == "direct"
    # Without the direct path's descriptors being cheap, pipelining beats one bounce across GPUs.
    slow = PathChooser(BounceGate(BounceSettings(desc_cost_us=50.0), device="cuda:0", environ={}), link="nvlink")
    d = slow.choose(big, paths=("direct", "bounce", "pipelined"))
    assert d.path == "pipelined" and d.chunks >= 2
    one_gpu = PathChooser(BounceGate(BounceSettings(desc_cost_us=50.0), device="cuda:0", environ={}), link="same_gpu")
    assert one_gpu.choose(big, paths=("direct", "bounce", "pipelined")).path == "bounce"  # no overlap
    never = PathChooser(BounceGate(BounceSettings(mode="never"), device="cuda:0", environ={}), link="nvlink")
    assert never.choose(big, paths=("direct", "bounce", "pipelined")).path == "direct"
    always = PathChooser(BounceGate(BounceSettings(mode="always"), device="cuda:0", environ={}), link="same_gpu")
    assert always.choose(big, paths=ALL).path in ("bounce", "pipelined")
    few = gate.choose(_glm(4), paths=("bounce", "pipelined"))
    assert few.path == "direct" and "bounce_min_runs" in few.reason
    assert gate.choose(Runs.empty(), paths=ALL).path == "direct"
    capped = PathChooser(BounceGate(BounceSettings(desc_cost_us=50.0), device="cuda:0", environ={}),
                         LinkSettings(max_chunks=1), link="nvlink")
    assert capped.choose(big, paths=("pipelined",)).path == "direct"  # no chunk count allowed
    with pytest.raises(ValueError):
        gate.choose(big, paths=("teleport",))
    assert gate.for_link("same_gpu").choose(big, paths=ALL).path == "ipc"
    assert gate.choose(big, paths=ALL, link="same_gpu").link == "same_gpu"
    # one decision per (link, shape, paths), remembered: the same shape again is a lookup
    assert gate.choose(big, paths=ALL) is gate.choose(big.merged(), merged=True, paths=ALL)
    assert gate.choose(big, paths=ALL).link == "nvlink" and gate.for_link("same_gpu").link == "same_gpu"
    assert gate.choose(big, paths=ALL) is not gate.choose(big, paths=("direct", "bounce"))


@pytest.mark.parametrize("seed", range(3))
def test_chooser_agrees_with_the_gate_on_cpu_links(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for profile in ("cma", "tcp"):
        gate = BounceGate(BounceSettings(profile=profile), environ={})
        chooser = PathChooser(gate)
        assert chooser.link == profile and LINKS[profile].ipc_gbps is None
        for _ in range(30):
            n = int(rng.integers(1, 5000))
            block = int(rng.choice([576, 4096, 16384, 65536, 1 << 20]))
            runs = runs_from_blocks(np.arange(n), np.arange(n) * 2, block)
            assert chooser.choose(runs, paths=("direct", "bounce")).path == gate.decide(runs)


def test_chooser_link_settings() -> None:
    g = PathChooser(BounceGate(device="cuda:0", environ={}), LinkSettings(link="nvlink", ipc_gbps=100))
    assert g.link == "nvlink" and g.link_profile.ipc_gbps == 100.0
    assert PathChooser(BounceGate(device="cuda:0", environ={})).link == "same_gpu"
    assert PathChooser(BounceGate.from_config({}, environ={"UCX_TLS": "tcp"})).link == "tcp"
    cpu_rdma = PathChooser(BounceGate(environ={}), LinkSettings(link="rdma")).link_profile
    assert cpu_rdma.copy_gbps == 4.0 and not cpu_rdma.overlap  # host memory: CPU copies
    for bad in ({"link": "pcie"}, {"max_chunks": 0}, {"wire_gbps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LinkSettings(**bad)
    with pytest.raises(ValueError):
        PathChooser(BounceGate(environ={}), link="pcie")
    # the link keys are the benches' now: the connector's options refuse them (a typo never passes)
    for gone in ("bounce_link", "bounce_max_chunks", "bounce_wire_gbps", "bounce_ipc_gbps"):
        with pytest.raises(OptionError, match=gone):
            BounceGate.from_config({gone: 1}, environ={})


def test_link_between_cpu_and_unknown_peer() -> None:
    assert link_between("cpu") == "cma" and link_between("cpu", cpu_link="tcp") == "tcp"
    if torch.cuda.is_available():  # pragma: no cover - GPU hosts only
        assert link_between("cuda:0", None) == "rdma"


# -- notifications, IPC descriptors ---------------------------------------------------------------------


def test_chunk_and_ipc_notifications() -> None:
    msg = encode_chunk_notif(2, 3, 8, b"req:1")
    assert decode_chunk_notif(msg) == (2, 3, 8, b"req:1") and decode_notif(msg) is None
    assert decode_chunk_notif(encode_chunk_notif(0, 8, 8, b"x")) is None  # index out of range
    assert decode_chunk_notif(b"dsa1:c1.2:x") is None and decode_chunk_notif(b"other") is None
    assert decode_notif(encode_notif("ipc", 5, b"t")) == ("ipc", 5, b"t")
    assert decode_chunk_notif(encode_notif("bounce", 0, b"t")) is None
    handle = bytes(range(64))
    msg = encode_event_notif(3, handle, b"req:7")
    assert decode_event_notif(msg) == (3, handle, b"req:7")
    assert decode_notif(msg) is None and decode_chunk_notif(msg) is None
    assert decode_event_notif(encode_notif("ipc", 3, b"t")) is None
    for bad in (b"dsa1:e3:t", b"dsa1:e.ab:t", b"dsa1:e3.abc:t", b"dsa1:e3.zz:t", b"dsa1:e3.ab"):
        assert decode_event_notif(bad) is None, bad


class _FakeEvent:
    """Stands in for a sender's interprocess CUDA event on a CPU host."""

    def __init__(self) -> None:
        self.fired = False
        self.broken = False

    def query(self) -> bool:
        if self.broken:
            raise RuntimeError("event gone")
        return self.fired


def test_receiver_completes_ipc_writers_on_their_events(caplog: pytest.LogCaptureFixture) -> None:
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    eng = NixlEngine(f"unit-ipcev-{time.monotonic_ns()}")
    try:
        rcv = BounceReceiver(eng, StagingArena(1 << 16, align=4096))
        events: dict[bytes, _FakeEvent] = {b"\x01" * 64: _FakeEvent(), b"\x02" * 64: _FakeEvent()}
        opened: list[bytes] = []

        def open_event(handle: bytes, device: torch.device | None = None) -> _FakeEvent | None:
            opened.append(handle)
            return events.get(handle)

        rcv.events.open = open_event  # type: ignore[method-assign]
        dst = torch.zeros(1 << 16, dtype=torch.uint8)
        a, b = runs_from_blocks([0], [0], 4096), runs_from_blocks([1], [1], 4096)
        rcv.expect(b"r", dst, [a, b], bounce=False)
        h1, h2 = b"\x01" * 64, b"\x02" * 64
        assert rcv.handle("p", encode_event_notif(0, h1, b"r"))  # launched, not done
        assert rcv.handle("p", encode_event_notif(1, h2, b"r"))
        assert rcv.completed() == []
        events[h1].fired = True
        assert rcv.completed() == []  # writer 1's copy still running
        events[h2].fired = True
        with caplog.at_level("WARNING"):
            assert rcv.completed() == [b"r"]
            # The senders' "copy done" notifications come after: dropped without a warning.
            rcv.handle("p", encode_notif("ipc", 0, b"r"))
            rcv.handle("p", encode_notif("ipc", 1, b"r"))
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        # An event that cannot be opened: the writer completes on the notification after the copy.
        rcv.expect(b"s", dst, [a], bounce=False)
        rcv.handle("p", encode_event_notif(0, b"\x03" * 64, b"s"))
        assert rcv.completed() == []
        rcv.handle("p", encode_notif("ipc", 0, b"s"))
        assert rcv.completed() == [b"s"]
        # An event that fails when queried: the same fallback.
        events[h1].fired, events[h1].broken = False, True
        rcv.expect(b"t", dst, [a], bounce=False)
        rcv.handle("p", encode_event_notif(0, h1, b"t"))
        assert rcv.completed() == [] and rcv.completed() == []
        rcv.handle("p", encode_notif("ipc", 0, b"t"))
        assert rcv.completed() == [b"t"]
        # "Copy done" before the event notification, and both before expect(): complete, no wait.
        events[h2].fired = False
        rcv.handle("p", encode_notif("ipc", 0, b"u"))
        rcv.handle("p", encode_event_notif(0, h2, b"u"))
        rcv.expect(b"u", dst, [a], bounce=False)
        assert rcv.completed() == [b"u"]
        # Event notification early, "copy done" later: the event no longer matters once it came.
        rcv.handle("p", encode_event_notif(0, h2, b"v"))
        rcv.expect(b"v", dst, [a], bounce=False)
        assert rcv.completed() == []
        rcv.handle("p", encode_notif("ipc", 0, b"v"))
        assert rcv.completed() == [b"v"]
    finally:
        eng.close()


def test_ipc_send_on_cpu_copies_then_notifies() -> None:
    """The ipc path with a CPU "mapping" (the receiver's tensor): copy, then the notification after it."""
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver
    from vllm_dsa_dev.harness.paths.sender import BounceSender

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"ipc-s-{stamp}"), NixlEngine(f"ipc-r-{stamp}")
    try:
        src = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        dst = torch.zeros(1 << 18, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst)
        snd = BounceSender(a, StagingArena(1 << 16), BounceGate(environ={}))
        with pytest.raises(ValueError):
            BounceSender(a, StagingArena(1 << 12), BounceGate(environ={}), ipc_signal="pigeon")
        both = BounceSender(a, StagingArena(1 << 12), BounceGate(environ={}), ipc_signal="event+notify")
        assert both.ipc_signal == "event+notify"
        rcv = BounceReceiver(b, StagingArena(1 << 16))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        runs = runs_from_blocks([3, 0, 9], [1, 7, 2], 4096, merge=False)
        for i in range(2):  # the second send reuses the merged runs (cached on ``runs``)
            dst.zero_()
            tag = f"ipc{i}".encode()
            rcv.expect(tag, dst, [runs], bounce=False)
            s = snd.send(peer, rs, rd.desc(), runs, tag, slot=None, path="ipc", ipc=dst)
            assert s.path == "ipc" and s.signal == "notify" and s.launch_s >= 0
            st = snd.wait(s)
            assert st.num_runs == 3 and st.total_bytes == 3 * 4096
            deadline = time.monotonic() + 20
            while tag not in rcv.poll():
                a.poll_notifications()  # one process: the sender's agent progresses too
                assert time.monotonic() < deadline, "ipc send did not complete"
            for x, y in ((3, 1), (0, 7), (9, 2)):
                assert torch.equal(dst[y * 4096 : (y + 1) * 4096], src[x * 4096 : (x + 1) * 4096])
    finally:
        a.close()
        b.close()


def test_ipc_desc_roundtrip_and_refusals() -> None:
    from vllm_dsa_connector.core.transfer.ipc import (
        IpcUnavailable,
        export_region,
        host_id,
        open_region,
    )

    d = IpcDesc(host_id(), "GPU-x", 100, 8, b"\x01\x02".hex(), 4096, 0, b"ref".hex(), 3, "", False)
    assert IpcDesc.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError):
        IpcDesc.from_dict({"host": "h"})
    with pytest.raises(IpcUnavailable):
        export_region(torch.zeros(4))  # CPU memory cannot be shared this way
    other = IpcDesc("elsewhere/0", "GPU-x", 100, 8, b"\x01".hex(), 4096, 0, "", 0, "", False)
    with pytest.raises(IpcUnavailable, match="host"):
        open_region(other.to_dict())


# -- pipelined receive and send ---------------------------------------------------------------------------


def test_receiver_scatters_each_chunk_and_completes_after_the_last() -> None:
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    eng = NixlEngine(f"unit-pipe-{time.monotonic_ns()}")
    try:
        arena = StagingArena(1 << 20, align=4096)
        rcv = BounceReceiver(eng, arena)
        dst = torch.zeros(1 << 19, dtype=torch.uint8)
        runs = runs_from_blocks([0, 1, 2, 3], [7, 2, 5, 0], 16384)
        (slot,) = rcv.expect(b"p", dst, [runs])
        packed = torch.randint(0, 256, (runs.total_bytes,), dtype=torch.uint8)
        arena.buffer[slot.offset : slot.offset + runs.total_bytes] = packed
        chunks = plan_chunks(runs.merged(), 3)
        assert rcv.handle("w", encode_chunk_notif(0, 2, len(chunks), b"p"))  # out of order is fine
        assert rcv.completed() == []
        rcv.handle("w", encode_chunk_notif(0, 0, len(chunks), b"p"))
        rcv.handle("w", encode_chunk_notif(0, 0, len(chunks), b"p"))  # repeated: ignored
        assert rcv.completed() == []
        rcv.handle("w", encode_chunk_notif(0, 1, len(chunks), b"p"))
        assert rcv.completed() == [b"p"] and arena.free_bytes == arena.size
        m = runs.merged()
        for so, do, n in zip(m.staging_offsets(), m.dst_offsets, m.lengths, strict=True):
            assert torch.equal(dst[do : do + n], packed[so : so + n])
        # Chunk notifications that arrive before expect() wait for it.
        rcv.handle("w", encode_chunk_notif(0, 0, 1, b"q"))
        rcv.expect(b"q", dst, [runs])
        assert rcv.completed() == [b"q"]
    finally:
        eng.close()


def test_pipelined_and_gated_sends_between_two_agents_exact() -> None:
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver
    from vllm_dsa_dev.harness.paths.sender import BounceSender

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"pipe-s-{stamp}"), NixlEngine(f"pipe-r-{stamp}")
    try:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst)
        snd = BounceSender(a, StagingArena(1 << 20), BounceGate(BounceSettings(min_runs=1), environ={}))
        rcv = BounceReceiver(b, StagingArena(1 << 20))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        rng = np.random.default_rng(0)
        sb, db = rng.choice(256, 100, replace=False), rng.choice(256, 100, replace=False)
        runs = runs_from_blocks(sb, db, 4096, merge=False)
        cases = [("pipelined", 5, None), ("pipelined", 1, None), ("bounce", None, None),
                 (None, None, ("direct", "bounce", "pipelined"))]

        def complete(s, tag: bytes) -> None:
            deadline = time.monotonic() + 20
            while tag not in rcv.poll():
                snd.progress(s)
                for x in s._posted or [s.transfer]:
                    if x._xfer is not None:
                        a.state(x)  # the sender's agent progresses too (one process here)
                assert time.monotonic() < deadline, f"{s.path} did not complete"

        for i, (path, k, paths) in enumerate(cases):
            dst.zero_()
            tag = f"t{i}".encode()
            (slot,) = rcv.expect(tag, dst, [runs])
            s = snd.send(peer, rs, rd.desc(), runs, tag, slot=slot, path=path, chunks=k, paths=paths)
            complete(s, tag)
            st = snd.wait(s)
            if path == "pipelined":
                assert s.chunks == st.num_runs == k
            for x, y in zip(sb, db, strict=True):
                assert torch.equal(dst[y * 4096 : (y + 1) * 4096], src[x * 4096 : (x + 1) * 4096])
        assert snd.arena.free_bytes == snd.arena.size and rcv.arena.free_bytes == rcv.arena.size
        # No IPC mapping: a forced ipc path falls back to a direct WRITE.
        (slot,) = rcv.expect(b"z", dst, [runs], bounce=False)
        s = snd.send(peer, rs, rd.desc(), runs, b"z", slot=None, path="ipc")
        assert s.path == "direct"
        complete(s, b"z")
        snd.wait(s)
    finally:
        a.close()
        b.close()


def test_direct_and_bounce_transports_called_the_same_way_one_receiver() -> None:
    """Both transports through one call pattern (post / progress), into the one Receiver; the receiver's
    caller never looks at the path (two real NIXL agents in this process)."""
    from vllm_dsa_dev.harness.paths.sender import BounceSender, BounceTransport

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.receiver import Receiver
    from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec
    from vllm_dsa_connector.core.transfer.staging import StagingSlot
    from vllm_dsa_connector.core.transfer.transports import DirectTransport, PostState

    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"tp-s-{stamp}"), NixlEngine(f"tp-r-{stamp}")
    try:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst)
        arena = StagingArena(1 << 20)
        rcv = Receiver(b, arena)
        snd = BounceSender(a, StagingArena(1 << 20), BounceGate(BounceSettings(mode="always"), environ={}))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        rng = np.random.default_rng(1)
        sb, db = rng.choice(256, 64, replace=False), rng.choice(256, 64, replace=False)
        runs = runs_from_blocks(sb, db, 4096)
        transports = {"direct": DirectTransport(a, 20.0), "bounce": BounceTransport(snd, 20.0)}
        assert rcv.region is not None
        for i, (name, transport) in enumerate(transports.items()):
            dst.zero_()
            tag = f"r{i}".encode()
            res = arena.reserve(runs.total_bytes) if name == "bounce" else None
            slot = StagingSlot(rcv.region.desc(), res.offset, runs.total_bytes) if res else None
            spec = WriterSpec(peer=a.name, dst=dst, runs=runs, slot=(res.offset, runs.total_bytes) if res else None)
            rcv.arm(tag, {7: spec}, reservation=res)
            post = transport.post(peer, [(rs, rd.desc(), runs)], writer=7, tag=tag, slot=slot)
            assert post.path == name and not post.error
            deadline = time.monotonic() + 20
            done: list = []
            over = False
            while not (done and over):
                over = transport.progress(post)  # the direct transport notifies once its WRITEs are DONE
                rcv.pump()
                done = done or rcv.collect()
                assert time.monotonic() < deadline, f"{name} did not complete"
            assert post.state is PostState.DONE and [r.state for r in done] == [RecvState.DONE]
            for x, y in zip(sb, db, strict=True):
                assert torch.equal(dst[y * 4096 : (y + 1) * 4096], src[x * 4096 : (x + 1) * 4096])
        assert arena.free_bytes == arena.size and snd.arena.free_bytes == snd.arena.size
        # A part that cannot be posted fails the post (nothing raised, nothing in flight, nothing notified).
        bad = Runs(np.array([0]), np.array([2 << 20]), np.array([4096]))  # past the destination region
        post = transports["direct"].post(peer, [(rs, rd.desc(), bad)], writer=7, tag=b"x")
        assert transports["direct"].progress(post) and post.state is PostState.FAILED and "2101248" in post.error
    finally:
        a.close()
        b.close()


def test_post_deadline_is_checked_before_every_write_after_staging_waits() -> None:
    """Issue 29 item 10: a bounced post that waits for staging space (the sender's arena is held full) until
    past its deadline must not WRITE; the direct transport checks each part before posting it. Two real
    NIXL agents; the receiver sees no bytes and no notification."""
    from vllm_dsa_dev.harness.paths.sender import BounceSender, BounceTransport

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.staging import StagingSlot
    from vllm_dsa_connector.core.transfer.transports import DirectTransport, PostState

    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"dl-s-{stamp}"), NixlEngine(f"dl-r-{stamp}")
    try:
        src = torch.full((1 << 16,), 7, dtype=torch.uint8)
        dst = torch.zeros(1 << 16, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst)
        recv_arena = StagingArena(1 << 16)
        recv_region = b.register(recv_arena.buffer)
        local = StagingArena(1 << 16)
        held = local.reserve(local.size)  # every byte of the sender's arena taken: the bounce waits
        assert held is not None
        snd = BounceSender(a, local, BounceGate(BounceSettings(mode="always"), environ={}), reserve_timeout_s=1.0)
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        runs = runs_from_blocks([0, 1], [2, 3], 4096)
        slot = StagingSlot(recv_region.desc(), 0, runs.total_bytes)
        bounce = BounceTransport(snd, 20.0)
        started = time.monotonic()
        post = bounce.post(peer, [(rs, rd.desc(), runs)], writer=0, tag=b"late", slot=slot,
                           deadline=started + 0.3)
        assert time.monotonic() - started >= 0.3  # it did wait for staging past the deadline ...
        assert bounce.progress(post) and post.state is PostState.FAILED  # ... and then posted nothing
        assert "post deadline passed" in post.error and not post._inflight
        direct = DirectTransport(a, 20.0)
        post = direct.post(peer, [(rs, rd.desc(), runs)], writer=0, tag=b"late2", deadline=time.monotonic())
        assert direct.progress(post) and post.state is PostState.FAILED and "post deadline passed" in post.error
        # before the deadline the same post goes through
        post = direct.post(peer, [(rs, rd.desc(), runs)], writer=0, tag=b"ok", deadline=time.monotonic() + 20)
        wait_until = time.monotonic() + 20
        while not direct.progress(post):
            b.progress()
            assert time.monotonic() < wait_until, "direct post did not complete"
        assert post.state is PostState.DONE and bool((dst[2 * 4096 : 4 * 4096] == 7).all())
        notes = []
        wait_until = time.monotonic() + 5
        while not notes and time.monotonic() < wait_until:
            notes = [m for _, m in b.poll_notifications()]
        assert notes == [encode_notif("direct", 0, b"ok")]  # nothing from the refused posts
        local.release(held)
        assert local.free_bytes == local.size  # the refused bounce gave its (never taken) space back
    finally:
        a.close()
        b.close()


def test_engine_progress_keeps_notifications_for_poll() -> None:
    """``progress()`` moves UCX along without losing what arrived: poll_notifications returns it later."""
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    stamp = time.monotonic_ns()
    a, b = NixlEngine(f"prog-s-{stamp}"), NixlEngine(f"prog-r-{stamp}")
    try:
        a.register(torch.zeros(4096, dtype=torch.uint8))
        b.register(torch.zeros(4096, dtype=torch.uint8))
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        a.send_notification(peer, b"n1")
        a.send_notification(peer, b"n2")
        deadline = time.monotonic() + 20
        while len(b._backlog) < 2:
            a.progress()
            b.progress()
            assert time.monotonic() < deadline, "notifications never arrived"
        assert b.poll_notifications() == [(a.name, b"n1"), (a.name, b"n2")]
        assert b.poll_notifications() == []
    finally:
        a.close()
        b.close()


def _drain_notifications(side: Any, timeout_s: float) -> list[tuple[str, bytes]]:
    deadline = time.monotonic() + timeout_s
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < deadline:
        got = side.engine.poll_notifications()
        time.sleep(1e-4)
    return got


def _notify_first(side: Any, timeout_s: float) -> Any:
    # The first message to D is an untracked notification (like the ipc path's launch notice); P then
    # only waits on the control channel. NIXL sends it once P's UCX worker progresses (wire-up).
    side.engine.send_notification(side.peer, b"first-message")
    return side.consumer.call(_drain_notifications, timeout_s=timeout_s)


@pytest.mark.slow
@pytest.mark.parametrize("hot", [False, True])
def test_pair_first_message_a_notification_arrives(hot: bool) -> None:
    """Regression (dev/bench/gpu_transfer.py --hot, ipc first: ``writers [0] did not arrive in 120.0s``): the
    harness's waiting producer keeps its agent progressing, so the notification leaves (two processes)."""
    from vllm_dsa_dev.harness.pair import PairSpec, SideSpec, run_pair

    spec = PairSpec(SideSpec("cpu"), SideSpec("cpu"), hot=hot)
    got = run_pair(spec, _notify_first, 30.0, timeout_s=240)
    assert [m for _, m in got] == [b"first-message"]
