"""Transport pieces in one process: runs merging, staging arena, gather/scatter, fan-in check, gate options."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from vllm_dsa_dev.harness.paths.fan_in import LayoutError, check_fan_in

from vllm_dsa_connector.core.plan.runs import Runs, merge_runs, runs_from_blocks
from vllm_dsa_connector.core.transfer.copy.local_copy import gather, scatter
from vllm_dsa_connector.core.transfer.gate import BounceGate
from vllm_dsa_connector.core.transfer.gate_options import BOUNCE_OPTION_KEYS, BounceSettings
from vllm_dsa_connector.core.transfer.notices import decode_notif, encode_notif
from vllm_dsa_connector.core.transfer.staging import StagingArena
from vllm_dsa_connector.options import OptionError


def _byte_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Reference: every byte position the runs cover, in run order (independent of gather's rows)."""
    if lengths.size == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(o, o + n) for o, n in zip(offsets, lengths, strict=True)])


def _merge_reference(src, dst, lens):
    out = []
    order = np.argsort(src, kind="stable")
    for s, d, n in zip(src[order], dst[order], lens[order], strict=True):
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return out


# -- runs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_merge_runs_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 500
    lens = rng.integers(0, 5, n) * 64
    # Many neighbours contiguous on one side only, some on both.
    src = np.cumsum(np.r_[0, lens[:-1]]) + rng.integers(0, 2, n) * 4096 * np.arange(n)
    dst = np.cumsum(np.r_[0, lens[:-1]]) * rng.integers(1, 3)
    got = merge_runs(src, dst, lens)
    want = _merge_reference(src, dst, lens)
    assert got.num_runs <= len(want)  # at least as good as sort-then-merge
    assert got.total_bytes == int(lens.sum())
    # Same byte mapping (src byte -> dst byte), whatever the grouping.
    pairs = sorted(zip(_byte_index(got.src_offsets, got.lengths), _byte_index(got.dst_offsets, got.lengths),
                       strict=True))
    ref = sorted(zip(_byte_index(src, lens), _byte_index(dst, lens), strict=True))
    assert pairs == ref
    # Nothing left to merge: no run continues the one before it on both sides.
    s, d, n = got.src_offsets, got.dst_offsets, got.lengths
    assert not np.any((s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1]))
    assert np.all(np.diff(s) >= 0)
    assert got.merged() is got.merged()  # cached


def test_merge_counts_runs_not_blocks() -> None:
    # 4096 adjacent blocks on both sides are one run; adjacent on one side only stay 4096.
    assert runs_from_blocks(np.arange(4096), np.arange(4096) + 7, 576).num_runs == 1
    assert runs_from_blocks(np.arange(4096), np.arange(4096) * 2, 576).num_runs == 4096
    assert Runs.empty().merged().num_runs == 0


def test_runs_validation() -> None:
    with pytest.raises(ValueError, match="differ"):
        Runs([0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        Runs([-1], [0], [1])
    r = Runs([0, 100], [10, 0], [50, 20])
    with pytest.raises(ValueError, match="source"):
        r.check_bounds(100, 100)
    assert r.src_offsets.flags.writeable is False
    mine = np.arange(3, dtype=np.int64)
    Runs(mine, mine, mine)
    assert mine.flags.writeable  # the caller's array is not frozen


# -- arena --------------------------------------------------------------------------------------------


def test_arena_first_fit_reuses_holes_and_coalesces() -> None:
    arena = StagingArena(8192, align=512)
    a = arena.reserve(1)
    b = arena.reserve(1000)
    c = arena.reserve(512)
    assert (a.offset, b.offset, c.offset) == (0, 512, 1536)
    assert a.size == 512 and b.size == 1024
    arena.release(b)
    d = arena.reserve(600)  # first fit: the freed hole at 512
    assert d.offset == 512
    arena.release(a)
    arena.release(d)
    e = arena.reserve(1536)  # a's and d's holes coalesced
    assert e.offset == 0
    with pytest.raises(ValueError, match="not live"):
        arena.release(a)
    arena.release(e)
    arena.release(c)
    assert arena.free_bytes == 8192
    assert arena.reserve(8192).offset == 0
    assert arena.reserve(9000) is None


def test_arena_bounded_wait() -> None:
    arena = StagingArena(4096)
    full = arena.reserve(4096)
    t0 = time.perf_counter()
    assert arena.reserve(512, timeout_s=0.1) is None
    assert 0.09 <= time.perf_counter() - t0 < 1.0
    threading.Timer(0.05, arena.release, args=(full,)).start()
    got = arena.reserve(512, timeout_s=2.0)  # woken by the release
    assert got is not None and got.offset == 0
    arena.quarantine(got)
    assert arena.quarantined_bytes == 512 and arena.free_bytes == 4096 - 512


# -- gather / scatter ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block,stride,odd_offset",
    [(576, 576, 0), (4096, 8192, 0), (577, 577, 0), (64, 64, 3), (12, 20, 2), (1, 3, 1)],
)
def test_gather_scatter_exact(block: int, stride: int, odd_offset: int) -> None:
    rng = np.random.default_rng(block)
    nblocks = 300
    size = odd_offset + stride * 2 * nblocks
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    s = rng.choice(2 * nblocks, nblocks, replace=False) * stride + odd_offset
    d = rng.choice(2 * nblocks, nblocks, replace=False) * stride
    runs = Runs(s, d, np.full(nblocks, block))
    out = torch.empty(runs.total_bytes + 5, dtype=torch.uint8)
    gather(src, runs, out)
    want = src.numpy()[_byte_index(runs.src_offsets, runs.lengths)]
    assert np.array_equal(out[: runs.total_bytes].numpy(), want)
    dst = torch.zeros(size, dtype=torch.uint8)
    scatter(out, dst, runs)
    ref = np.zeros(size, np.uint8)
    ref[_byte_index(runs.dst_offsets, runs.lengths)] = want
    assert np.array_equal(dst.numpy(), ref)


def test_gather_mixed_lengths_and_typed_tensors() -> None:
    rng = np.random.default_rng(1)
    src = torch.randn(10_000, dtype=torch.float32)  # 40,000 bytes, viewed as bytes
    lens = rng.integers(1, 200, 50)
    offs = np.sort(rng.choice(39_000 // 200, 50, replace=False)) * 200 + 1
    runs = Runs(offs, np.cumsum(np.r_[0, lens[:-1]]), lens)
    out = torch.empty(runs.total_bytes, dtype=torch.uint8)
    gather(src, runs, out)
    want = src.view(torch.uint8).numpy()[_byte_index(runs.src_offsets, runs.lengths)]
    assert np.array_equal(out.numpy(), want)
    with pytest.raises(ValueError, match="contiguous"):
        gather(src.view(100, 100).t(), runs, out)


def test_gather_empty_is_noop() -> None:
    out = torch.zeros(4, dtype=torch.uint8)
    gather(torch.ones(8, dtype=torch.uint8), Runs.empty(), out)
    scatter(out, torch.ones(8, dtype=torch.uint8), Runs.empty())
    assert out.sum() == 0


# -- fan-in check ---------------------------------------------------------------------------------------


def test_fan_in_checks_every_writer() -> None:
    w0 = runs_from_blocks([0, 1], [0, 2], 100)
    w1 = runs_from_blocks([0, 1], [1, 3], 100)
    check_fan_in([w0, w1], 400)
    # Writer 0's layout is fine alone; the overlap is only visible when writer 1 is checked too.
    w1_bad = runs_from_blocks([0, 1], [1, 2], 100)
    with pytest.raises(LayoutError, match="writers 0 and 1"):
        check_fan_in([w0, w1_bad], 400)
    with pytest.raises(LayoutError, match="writer 1"):
        check_fan_in([w0, runs_from_blocks([0], [4], 100)], 400)
    # Overlap hidden behind a long earlier run (not adjacent after sorting by start).
    long0 = Runs([0], [0], [1000])
    with pytest.raises(LayoutError):
        check_fan_in([long0, Runs([0, 0], [100, 500], [10, 10])], 2000)


def test_notif_roundtrip() -> None:
    msg = encode_notif("bounce", 3, b"req:1:x")
    assert decode_notif(msg) == ("bounce", 3, b"req:1:x")
    assert decode_notif(encode_notif("direct", 0, b"")) == ("direct", 0, b"")
    assert decode_notif(b"other") is None and decode_notif(b"dsa1:zz:") is None


# -- gate ----------------------------------------------------------------------------------------------


def test_gate_decides_from_merged_runs() -> None:
    gate = BounceGate(BounceSettings(profile="tcp"))
    scattered = runs_from_blocks(np.arange(4096), np.arange(4096) * 2, 576, merge=False)
    adjacent = runs_from_blocks(np.arange(4096), np.arange(4096), 576, merge=False)
    assert gate.decide(scattered) == "bounce"
    assert gate.decide(adjacent) == "direct"  # 4096 blocks, but one run after merging
    big = runs_from_blocks(np.arange(1024), np.arange(1024) * 2, 64 << 10)
    assert BounceGate(BounceSettings(profile="cma")).decide(big) == "direct"  # copy costs more there
    huge = runs_from_blocks(np.arange(64), np.arange(64) * 2, 4 << 20)
    assert gate.decide(huge) == "direct"  # 4 MiB runs: descriptors are cheap next to the copy
    assert gate.decide(Runs.empty()) == "direct"
    d = gate.decision(runs_from_blocks(np.arange(4), np.arange(4) * 2, 576))
    assert d.path == "direct" and "bounce_min_runs" in d.reason


def test_gate_options_precedence() -> None:
    env = {"VLLM_DSA_BOUNCE_MIN_RUNS": "64", "VLLM_DSA_BOUNCE_MIN_BYTES": "1m", "UCX_TLS": "tcp"}
    s = BounceSettings.from_config({"bounce_min_runs": 3}, environ=env)
    assert s.min_runs == 3  # explicit > env
    assert s.min_bytes == 1 << 20  # env > default
    assert s.max_avg_run_bytes == BounceSettings().max_avg_run_bytes  # default
    gate = BounceGate.from_config({"other_key": 1}, environ=env)  # non-bounce keys are not ours
    assert gate.profile == "tcp" and gate.settings.min_runs == 64
    assert BounceGate.from_config({}, environ={}).profile == "cma"
    assert BounceGate.from_config({}, device="cuda:0", environ={}).profile == "cuda"
    g = BounceGate.from_config({"bounce_desc_cost_us": "0", "bounce_profile": "tcp"}, environ={})
    assert g.decide(runs_from_blocks(np.arange(4096), np.arange(4096) * 2, 576)) == "direct"
    assert "bounce_min_runs" in BOUNCE_OPTION_KEYS


@pytest.mark.parametrize(
    "config,env,key",
    [
        ({"bounce_min_runs": "many"}, {}, "bounce_min_runs"),
        ({"bounce_min_runs": 0}, {}, "bounce_min_runs"),
        ({}, {"VLLM_DSA_BOUNCE_MIN_BYTES": "-5"}, "VLLM_DSA_BOUNCE_MIN_BYTES"),
        ({"bounce_max_avg_run_bytes": 1.5}, {}, "bounce_max_avg_run_bytes"),
        ({"bounce_copy_gbps": 0}, {}, "bounce_copy_gbps"),
        ({"bounce_desc_cost_us": "nan"}, {}, "bounce_desc_cost_us"),
        ({"bounce_profile": "infiniband"}, {}, "bounce_profile"),
        ({"bounce_mode": True}, {}, "bounce_mode"),
        ({"bounce_min_run": 4}, {}, "bounce_min_run"),  # typo: refused, not ignored
    ],
)
def test_gate_invalid_settings_name_the_key(config, env, key) -> None:
    with pytest.raises(OptionError, match=key):
        BounceGate.from_config(config, environ=env)


# -- receiver state machine (one real NIXL agent; notifications fed by hand, the two-process tests
#    in test_transport_nixl.py cover the same path with real writes) ---------------------------------


def test_receiver_completes_only_after_every_writer_and_scatter() -> None:
    from vllm_dsa_dev.harness.paths.fan_in import BounceReceiver

    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    eng = NixlEngine(f"unit-rcv-{time.monotonic_ns()}")
    try:
        arena = StagingArena(1 << 16)
        rcv = BounceReceiver(eng, arena)
        dst = torch.zeros(8192, dtype=torch.uint8)
        w0 = runs_from_blocks([0, 1], [3, 0], 512)
        w1 = runs_from_blocks([0], [5], 512)
        slots = rcv.expect(b"t", dst, [w0, w1])
        assert [s.size for s in slots] == [1024, 512] and slots[1].offset == slots[0].offset + 1024
        payload = torch.arange(1024, dtype=torch.int32).view(torch.uint8)[:1024].clone()
        arena.buffer[slots[0].offset: slots[0].offset + 1024] = payload  # "writer 0's data landed"
        assert rcv.handle("w0", encode_notif("bounce", 0, b"t"))
        assert rcv.completed() == [] and b"t" in rcv.pending  # writer 1 still missing
        assert torch.equal(dst[3 * 512: 4 * 512], payload[:512])  # scattered on arrival
        assert torch.equal(dst[0:512], payload[512:])
        rcv.handle("w1", encode_notif("direct", 1, b"t"))
        assert rcv.completed() == [b"t"] and arena.free_bytes == arena.size
        # A late duplicate is dropped, an early notification waits for its expect().
        rcv.handle("w1", encode_notif("direct", 1, b"t"))
        assert not rcv.early.kept
        rcv.handle("w0", encode_notif("direct", 0, b"u"))
        rcv.expect(b"u", dst, [w1], bounce=False)
        assert rcv.completed() == [b"u"]
        assert not rcv.handle("x", b"foreign") and rcv.other == [("x", b"foreign")]
        # Cancel quarantines the staging region: a late writer cannot corrupt a later request.
        rcv.expect(b"v", dst, [w0])
        rcv.cancel(b"v")
        assert arena.quarantined_bytes == 1024
    finally:
        eng.close()


# -- slot allocator (torch-free) and the receiver's states ----------------------------------------------


def test_slot_allocator_imports_no_torch_and_waits_on_its_clock() -> None:
    import subprocess
    import sys

    from vllm_dsa_connector.core.transfer.slots import SlotAllocator

    code = ("import sys; import vllm_dsa_connector.core.transfer.slots as s; "
            "assert 'torch' not in sys.modules, 'slots imported torch'; print(s.SlotAllocator(4096).size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "4096", out.stderr[-2000:]
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0  # every look at the clock is a second later: the bounded wait ends without sleeping
        return t[0]

    slots = SlotAllocator(1000, align=512, clock=clock)
    assert slots.size == 512 and slots.reserve(600) is None  # larger than the arena: go direct
    a = slots.reserve(100)
    assert a is not None and a.size == 512 and slots.free_bytes == 0
    started = time.monotonic()
    assert slots.reserve(1, timeout_s=5.0) is None and time.monotonic() - started < 1.0
    slots.quarantine(a)
    assert slots.quarantined_bytes == 512 and slots.free_bytes == 0
    with pytest.raises(ValueError, match="not live"):
        slots.release(a)


def test_receiver_states_failed_corrupt_timed_out_cancelled() -> None:
    """One Receiver, caller hooks deciding on payloads, an injected clock for the deadline (no sleeps)."""
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.receiver import Receiver
    from vllm_dsa_connector.core.transfer.receiver_data import (
        RecvState,
        Verdict,
        WriterSpec,
        WriterState,
    )

    class Hooks:
        def split(self, tag: bytes):
            key, _, payload = tag.partition(b"/")
            return (key, payload) if payload else None

        def admit(self, context, writer: int, payload: bytes):
            if payload == b"bad":
                return Verdict.IGNORE, "malformed"
            return (Verdict.FAIL, "sender failed") if payload == b"fail" else (Verdict.ACCEPT, "")

        def landed(self, context, writer: int, payload: bytes) -> bool:
            return payload != b"crc"

    now = [100.0]
    eng = NixlEngine(f"unit-states-{time.monotonic_ns()}")
    try:
        arena = StagingArena(1 << 14)
        rcv = Receiver(eng, arena, hooks=Hooks(), clock=lambda: now[0])
        dst = torch.zeros(4096, dtype=torch.uint8)
        w = runs_from_blocks([0], [2], 512)
        rcv.arm(b"a", {3: WriterSpec(peer="p3"), 5: WriterSpec(peer="p5")}, context="ctx-a")
        rcv.handle("p5", encode_notif("direct", 3, b"a/ok"))  # writer 3's notice from writer 5's agent
        rcv.handle("p3", encode_notif("direct", 3, b"a/bad"))  # ignored by the hook
        rcv.handle("p3", b"dsa1:d3:a")  # no payload: split refuses it
        assert rcv.writer_states(b"a") == {3: WriterState.EXPECTED, 5: WriterState.EXPECTED}
        rcv.handle("p3", encode_notif("direct", 3, b"a/fail"))
        rcv.handle("p5", encode_notif("direct", 5, b"a/ok"))
        (r,) = rcv.collect()
        assert (r.key, r.state, r.reason, r.context) == (b"a", RecvState.FAILED, "sender failed", "ctx-a")
        # A bounced writer whose check fails: CORRUPT (the bytes were scattered).
        res = arena.reserve(512)
        arena.buffer[res.offset : res.offset + 512] = 7
        rcv.arm(b"b", {0: WriterSpec(dst=dst, runs=w, slot=(res.offset, 512))}, reservation=res)
        rcv.handle("p", encode_notif("bounce", 0, b"b/crc"))
        (r,) = rcv.collect()
        assert r.state is RecvState.CORRUPT and bool((dst[1024:1536] == 7).all())
        assert arena.free_bytes == arena.size  # released: the bytes did land
        # A bounce without a slot fails its writer instead of raising.
        rcv.arm(b"c", {0: WriterSpec()})
        rcv.handle("p", encode_notif("bounce", 0, b"c/ok"))
        (r,) = rcv.collect()
        assert r.state is RecvState.FAILED and "without a staging slot" in r.reason
        # The deadline, on the injected clock.
        rcv.arm(b"d", {0: WriterSpec(), 1: WriterSpec()}, timeout_s=30.0)
        rcv.handle("p", encode_notif("direct", 1, b"d/ok"))
        now[0] += 29.0
        assert rcv.collect() == []
        now[0] += 2.0
        (r,) = rcv.collect()
        assert r.state is RecvState.TIMED_OUT and r.missing == (0,) and r.waited_s == 31.0
        # Cancel: the staging range is quarantined; a late notification is dropped.
        res = arena.reserve(512)
        rcv.arm(b"e", {0: WriterSpec(dst=dst, runs=w, slot=(res.offset, 512))}, reservation=res)
        r = rcv.cancel(b"e")
        assert r is not None and r.state is RecvState.CANCELLED and arena.quarantined_bytes == 512
        rcv.handle("p", encode_notif("bounce", 0, b"e/ok"))
        assert rcv.collect() == [] and not rcv.pending
    finally:
        eng.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"reconnect_backoff_s": 0}, "reconnect_backoff_s must be a finite number of seconds > 0"),
    ({"reconnect_backoff_s": float("nan")}, "reconnect_backoff_s must be"),
    ({"reconnect_backoff_max_s": float("inf")}, "reconnect_backoff_max_s must be"),
    ({"reconnect_backoff_s": True}, "reconnect_backoff_s must be"),
    ({"reconnect_backoff_s": 2.0, "reconnect_backoff_max_s": 1.0}, r"reconnect_backoff_max_s \(1.0\) must be >="),
])
def test_reconnect_backoff_bounds_are_validated(kwargs: dict, match: str) -> None:
    """The backoff must start above 0 (a gone peer then costs little per post) and end at a finite wait (a
    peer that comes back is tried again in bounded time): anything else is refused before NIXL starts."""
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine

    with pytest.raises(ValueError, match=match):
        NixlEngine(f"unit-backoff-{time.monotonic_ns()}", **kwargs)
