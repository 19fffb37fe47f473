"""D's checks of the completion notices a P worker sends (issue 29 item 4), in one process: a real P and a
real D :class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker` over vLLM-allocated KV caches
(``connector.page_tables.allocate_offline``, a GLM-MoE-DSA config), two real NIXL agents, the worker's real Receiver.

A real push with ``verify_transfers`` lands and is checksummed; then notices a real sender never writes
are fed to D's receiver as its own progress thread does (the fault cannot be caused on a real wire: the
notice is fabricated, it comes from P's agent, everything after it is the worker's real receive path). Each
must fail that load, named, and never raise out of the receiver."""

from __future__ import annotations

import time
from typing import Any

import pytest

BLOCK_SIZE = 64
NUM_BLOCKS = 16
SRC_BLOCKS = [3, 4, 5]
DST_BLOCKS = [7, 2, 9]
CFG = {"num_layers": 4, "index_topk_pattern": "FSFS"}


def _worker(engine: str, role: str) -> tuple[Any, dict[str, Any]]:
    import torch
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import allocate_offline
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    kv_caches, _, table = allocate_offline(glm_dsa_config(**CFG), pp_rank=0, pp_size=1, tp_rank=0, tp_size=1,
                                           block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    opts = ConnectorOptions.from_config({"transfer_timeout_s": 30, "prefault_kv_cache": False}, environ={})
    worker = DSAConnectorWorker(engine, opts, {"model_dtype": "bf16"}, role=role)
    worker.register(kv_caches, table)
    g = torch.Generator().manual_seed(5)
    for t in kv_caches.values():
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, tuple(b.shape), generator=g, dtype=torch.uint8))
    return worker, kv_caches


@pytest.fixture(scope="module")
def pd():
    p, _ = _worker("P-notice", "kv_producer")
    d, _ = _worker("D-notice", "kv_consumer")
    yield p, d
    p.shutdown()
    d.shutdown()


def _results(worker: Any, want: str, timeout_s: float = 20.0) -> tuple[set[str], set[str], set[int]]:
    """``get_transfer_results`` until ``want`` is reported: (finished_recving, failed_recving, error blocks)."""
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    failed: set[str] = set()
    errors: set[int] = set()
    while want not in done:
        _, r, f = worker.get_transfer_results()
        done |= r
        failed |= f
        errors |= worker.get_block_ids_with_load_errors()
        assert time.monotonic() < deadline, f"{want} was never reported"
        time.sleep(0.002)
    return done, failed, errors


def _arm(p: Any, d: Any, req: str) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, RecvJob, encode

    peers = [] if p.engine_id in d.sources else [PeerInfo(p.engine_id, [encode(p.payload)], as_source=True)]
    d.start_load_kv(DSAConnectorMetadata(peers=peers, recv=[RecvJob(req, p.engine_id, DST_BLOCKS, {0: [0]}, 30.0,
                                                                     verify=True, src_blocks=SRC_BLOCKS)]))


def _feed(p: Any, d: Any, notice: Any) -> None:
    from vllm_dsa_connector.core.handoff.wire import encode
    from vllm_dsa_connector.core.transfer.notices import encode_notif

    with d._lock:  # as the worker's own progress thread does
        d.receiver.handle(p.nixl.name, encode_notif("direct", 0, encode(notice)))


def _good_checks(p: Any, d: Any) -> list[tuple[int, int, int, int]]:
    """What a real sender puts in its notice for this request (D's plan of P rank 0 -> D rank 0)."""
    from vllm_dsa_connector.core.worker.pool_bytes import crc_runs

    plan = d.sources[p.engine_id].plan
    out = []
    for sp, dp, runs in plan.runs(0, 0, SRC_BLOCKS, DST_BLOCKS):
        crcs = crc_runs(p.regions[sp].tensor, runs.src_offsets, runs.lengths)
        out.extend((dp, int(o), int(n), crc)
                   for o, n, crc in zip(runs.dst_offsets, runs.lengths, crcs, strict=True))
    return out



def _until_received(p, d, req_id: str, what: str) -> set[str]:
    """Progress both sides (a WRITE completes only while P polls it too) until D reports ``req_id``; D's
    failed loads meanwhile. ``what`` is the assertion message when 20 s pass first."""
    deadline = time.monotonic() + 20
    done: set[str] = set()
    failed: set[str] = set()
    while req_id not in done:
        p.get_transfer_results()
        _, r, f = d.get_transfer_results()
        done, failed = done | r, failed | f
        assert time.monotonic() < deadline, what
        time.sleep(0.002)
    return failed


def test_a_real_verified_push_lands_and_is_checksummed(pd) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    _arm(p, d, "d-good")
    push = PushJob("p-good", d.engine_id, "d-good", SRC_BLOCKS, DST_BLOCKS, verify=True)
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])], push=[push]))
    failed = _until_received(p, d, "d-good", "the push never landed")
    assert not failed and not d.get_block_ids_with_load_errors()
    assert d.stats.data["checksummed_runs"] == len(_good_checks(p, d)) > 0
    assert d.stats.data["checksum_mismatches"] == 0


def _bad_notices(p: Any, d: Any) -> dict[str, tuple[Any, str]]:
    from vllm_dsa_connector.core.handoff.wire import Notice

    good = _good_checks(p, d)
    nbytes = sum(c[2] for c in good)
    pool, off, length, crc = good[0]
    size = d.regions[pool].size
    shifted = [(pool, off + BLOCK_SIZE, length, crc)] + good[1:]  # in range, but not a run D expects
    return {
        "neg-length": (Notice("neg-length", 0, True, nbytes, len(good), checks=[(pool, off, -5, crc)] + good[1:]),
                       "outside pool"),
        "past-pool": (Notice("past-pool", 0, True, nbytes, len(good), checks=[(pool, size - 8, 64, 0)] + good[1:]),
                      "outside pool"),
        "neg-offset": (Notice("neg-offset", 0, True, nbytes, len(good), checks=[(pool, -64, 64, 0)] + good[1:]),
                       "outside pool"),
        "bad-pool": (Notice("bad-pool", 0, True, nbytes, len(good), checks=[(99, off, length, crc)] + good[1:]),
                     "pool 99"),
        "bad-crc-range": (Notice("bad-crc-range", 0, True, nbytes, len(good),
                                 checks=[(pool, off, length, 1 << 40)] + good[1:]), "crc32"),
        "no-checks": (Notice("no-checks", 0, True, 0, 0), "checksum entries differ from the expected runs"),
        "few-checks": (Notice("few-checks", 0, True, nbytes - length, len(good) - 1, checks=good[1:]),
                       "checksum entries differ from the expected runs"),
        "shifted": (Notice("shifted", 0, True, nbytes, len(good), checks=shifted),
                    "checksum entries differ from the expected runs"),
        "neg-bytes": (Notice("neg-bytes", 0, True, -1, len(good), checks=good), "counts must be >= 0"),
        "runs-mismatch": (Notice("runs-mismatch", 0, True, nbytes, len(good) + 1, checks=good), "checksum entries for runs"),
        "bytes-mismatch": (Notice("bytes-mismatch", 0, True, nbytes + 1, len(good), checks=good), "cover"),
        "other-rank": (Notice("other-rank", 3, True, nbytes, len(good), checks=good), "src_rank 3"),
    }


def test_every_bad_notice_fails_its_load_and_never_raises(pd) -> None:
    from vllm_dsa_connector.core.transfer.receiver_data import RecvState

    p, d = pd
    if p.engine_id not in d.sources:
        _arm(p, d, "d-warm")  # D learns P's plan as the scheduler's first step would
        d.receiver.cancel(b"d-warm")
    for req, (notice, why) in _bad_notices(p, d).items():
        _arm(p, d, req)
        _feed(p, d, notice)  # before the fix, "neg-length" raised here (ctypes array of -5 bytes)
        with d._lock:
            (r,) = d.receiver.collect()  # settled at once: the writer failed, not left waiting
        assert (r.key, r.state) == (req.encode(), RecvState.FAILED), f"{req}: {r}"
        assert "bad notice from rank 0" in r.reason and why in r.reason, f"{req}: {r.reason}"
    # end to end: the worker reports such a load as failed (vLLM then applies kv_load_failure_policy)
    notice, _ = _bad_notices(p, d)["neg-length"]
    _arm(p, d, "neg-length")
    _feed(p, d, notice)
    done, failed, errors = _results(d, "neg-length")
    assert "neg-length" in failed and not errors


def test_a_checksum_mismatch_on_the_expected_runs_is_corrupt(pd) -> None:
    """The entries are exactly the expected runs, one CRC is wrong: the bytes landed but are not P's."""
    from vllm_dsa_connector.core.handoff.wire import Notice

    p, d = pd
    _arm(p, d, "d-crc")
    good = _good_checks(p, d)
    pool, off, length, crc = good[0]
    before = d.stats.data["checksum_mismatches"]
    _feed(p, d, Notice("d-crc", 0, True, sum(c[2] for c in good), len(good),
                       checks=[(pool, off, length, crc ^ 1)] + good[1:]))
    done, failed, errors = _results(d, "d-crc")
    assert "d-crc" not in failed and errors == set(DST_BLOCKS)  # vLLM's block-level path, policy decides
    assert d.stats.data["checksum_mismatches"] == before + 1


def test_a_restarted_peer_s_nixl_agent_is_removed_and_the_new_one_added(pd) -> None:
    """Issue 29 item 2: D restarted with the same engine id (a new worker: a new NIXL agent, new pools). P's
    worker kept the old start's remote agent and wrote with it. Now the new start's PeerInfo (another epoch)
    replaces the record: the old NIXL remote agent is removed from P's real agent, the new one added, a push the
    new start registered lands in the new start's pools (checksummed), and a push the old start registered is
    failed without a WRITE."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode
    from vllm_dsa_connector.core.transfer.nixl.data import TransferError

    p, d = pd
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)], epoch=1)]))
    assert p.setup.wait_idle(10)  # the worker's set-up thread loads the remote agent, off the step
    old_agent = d.nixl.name
    assert p.remotes[d.engine_id].epoch == 1 and old_agent in p.nixl.peers
    d2, _ = _worker(d.engine_id, "kv_consumer")  # the restarted D: same engine id, new agent
    try:
        assert d2.nixl.name != old_agent
        _arm(p, d2, "d-restart")
        push = PushJob("p-restart", d.engine_id, "d-restart", SRC_BLOCKS, DST_BLOCKS, verify=True, dst_epoch=2)
        p.start_load_kv(DSAConnectorMetadata(peers=[PeerInfo(d.engine_id, [encode(d2.payload)], epoch=2)],
                                             push=[push]))
        assert p.setup.wait_idle(10)
        assert p.remotes[d.engine_id].epoch == 2 and p.remotes[d.engine_id].agents == {0: d2.nixl.name}
        deadline = time.monotonic() + 20
        while old_agent in p.nixl.peers:  # removed once no post uses it (none does)
            p.get_transfer_results()
            assert time.monotonic() < deadline, "the old agent was never removed"
        assert d2.nixl.name in p.nixl.peers
        with pytest.raises(TransferError, match=old_agent):  # NIXL's own refusal: its agent no longer knows it
            p.nixl.send_notification(old_agent, b"after the restart")
        failed = _until_received(p, d2, "d-restart", "the push never landed in the new start's pools")
        assert not failed and not d2.get_block_ids_with_load_errors() and d2.stats.data["checksummed_runs"] > 0
        before, sent = p.stats.data["send_failed"], p.stats.data["send_bytes"]
        p.start_load_kv(DSAConnectorMetadata(push=[PushJob("p-stale", d.engine_id, "d-stale", SRC_BLOCKS, DST_BLOCKS,
                                                           dst_epoch=1)]))
        deadline = time.monotonic() + 20
        sending: set[str] = set()
        while "p-stale" not in sending:
            sending |= p.get_transfer_results()[0]
            assert time.monotonic() < deadline, "the stale push was never reported"
        assert p.stats.data["send_failed"] == before + 1 and p.stats.data["send_bytes"] == sent  # no WRITE
    finally:
        d2.shutdown()


def test_a_forgotten_peer_s_remote_agents_go_and_come_back(pd) -> None:
    """Issue 29 item 8: the scheduler's ``forget`` of an idle peer drops the worker's plan and its real NIXL
    remote agents (P: D's agent; D: P's plan); a later handshake's PeerInfo brings them back and a verified
    push lands again."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])]))
    assert p.setup.wait_idle(10)
    assert d.engine_id in p.remotes and d.nixl.name in p.nixl.peers
    _arm(p, d, "d-warm2")  # D knows P's plan
    d.receiver.cancel(b"d-warm2")
    p.start_load_kv(DSAConnectorMetadata(forget=[d.engine_id]))
    d.start_load_kv(DSAConnectorMetadata(forget_sources=[p.engine_id]))
    assert d.engine_id not in p.remotes and d.nixl.name not in p.nixl.peers
    assert p.engine_id not in d.sources
    _arm(p, d, "d-again")  # D handshakes again: P's plan is back
    push = PushJob("p-again", d.engine_id, "d-again", SRC_BLOCKS, DST_BLOCKS, verify=True)
    p.start_load_kv(DSAConnectorMetadata(peers=[PeerInfo(d.engine_id, [encode(d.payload)])], push=[push]))
    assert p.setup.wait_idle(10)
    assert d.nixl.name in p.nixl.peers
    failed = _until_received(p, d, "d-again", "the push after the re-handshake never landed")
    assert not failed and not d.get_block_ids_with_load_errors()


def test_a_flood_of_early_notices_for_one_load_fails_it(pd) -> None:
    """Issue 29 item 8: more early notices for one request than ``early_per_key`` (before its job is armed)
    are dropped, and the load fails when armed instead of memory growing."""
    from vllm_dsa_connector.core.handoff.wire import Notice

    p, d = pd
    good = _good_checks(p, d) if p.engine_id in d.sources else []
    cap, d.receiver.early.per_key = d.receiver.early.per_key, 3
    try:
        for _ in range(10):
            _feed(p, d, Notice("d-flood", 0, True, sum(c[2] for c in good), len(good), checks=good))
        assert b"d-flood" not in d.receiver.early.kept
        _arm(p, d, "d-flood")
        done, failed, errors = _results(d, "d-flood")
        assert "d-flood" in failed and not errors
    finally:
        d.receiver.early.per_key = cap


def test_kv_both_engines_swap_roles_and_each_direction_lands() -> None:
    """Two ``kv_both`` workers: A pushes to B, then B pushes to A, then A to B again (an engine of a kv_both
    pair is P of its peer for one request and its D for the next). Each role keeps its own record of the
    peer: with one record per engine, B's record of A as a source (a plan of A -> B, no NIXL agent) answered
    A's PeerInfo as a destination, so B's push posted nothing, was reported sent, and A waited until its
    load timed out."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    a, _ = _worker("A-both", "kv_both")
    b, _ = _worker("B-both", "kv_both")
    try:
        for src, dst, req in ((a, b, "ab"), (b, a, "ba"), (a, b, "ab2")):
            _arm(src, dst, f"d-{req}")
            src.start_load_kv(DSAConnectorMetadata(
                local=PeerInfo(src.engine_id, [encode(src.payload)]),
                peers=[PeerInfo(dst.engine_id, [encode(dst.payload)])],
                push=[PushJob(f"p-{req}", dst.engine_id, f"d-{req}", SRC_BLOCKS, DST_BLOCKS, verify=True)]))
            failed = _until_received(src, dst, f"d-{req}", f"{src.engine_id} -> {dst.engine_id} never landed")
            assert not failed and not dst.get_block_ids_with_load_errors(), req
            assert dst.stats.data["checksummed_runs"] > 0, req
        assert a.stats.data["send_failed"] == 0 and b.stats.data["send_failed"] == 0
        assert set(a.remotes) == set(a.sources) == {"B-both"} and set(b.remotes) == set(b.sources) == {"A-both"}
    finally:
        a.shutdown()
        b.shutdown()


def test_a_layered_push_is_not_waited_for_before_the_forward_and_lands_layer_by_layer(monkeypatch) -> None:
    """``layer_push``: the step that finishes P's prefill opens the post in ``start_load_kv`` (before the
    forward) and feeds it from ``save_kv_layer``. ``start_load_kv`` must not spin on that open post: it cannot
    finish before the layers are computed, and the spin (``_SPIN_S``) held every such step back by 50 ms
    (bench pd and the GPU pair showed it). Then each layer goes out as it is saved, ``wait_for_save`` closes the
    post, and D gets the request checksummed. ``SendSide.poll`` is wrapped only to count its calls. Its own
    pair of workers: the module's pair has seen restarts and forgets."""

    p, _ = _worker("P-layered", "kv_producer")
    d, _ = _worker("D-layered", "kv_consumer")
    try:
        _layered_push(p, d, monkeypatch)
    finally:
        p.shutdown()
        d.shutdown()


def _layered_push(p: Any, d: Any, monkeypatch: Any) -> None:
    import threading

    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode
    from vllm_dsa_connector.core.worker.sending import SendSide

    _arm(p, d, "d-layered")
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])]))
    assert p.setup.wait_idle(10)  # a known peer: the push opens its layer-by-layer post at once
    polls = []
    real_poll = SendSide.poll
    step = threading.current_thread()  # the engine's step; the side's progress thread may poll meanwhile
    monkeypatch.setattr(SendSide, "poll", lambda self: (polls.append(threading.current_thread() is step),
                                                        real_poll(self))[1])
    push = PushJob("p-layered", d.engine_id, "d-layered", SRC_BLOCKS, DST_BLOCKS, verify=True, layered=True)
    p.start_load_kv(DSAConnectorMetadata(push=[push]))
    assert not any(polls), f"start_load_kv polled an open layer-by-layer post {sum(polls)} times before the forward"
    layered = p.stats.data["layered_bytes"]
    assert layered > 0
    for name in sorted(p.layer_ids, key=p.layer_ids.get):  # the forward: each attention layer saved in order
        p.save_layer(name)
    p.wait_for_save()
    failed = _until_received(p, d, "d-layered", "the layered push never landed")
    assert not failed and not d.get_block_ids_with_load_errors()
    assert d.stats.data["checksum_mismatches"] == 0
