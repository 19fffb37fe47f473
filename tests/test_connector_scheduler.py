"""Scheduler side of DSAConnector with a real VllmConfig, real vLLM Requests and KVCacheBlocks, and real side
channels between a P and a D scheduler in this process. Time is an injected clock (no sleeps decide a
deadline): leases, heartbeats of queued requests, the D-side give-up rule (blocks handed back only when no
WRITE can land), cancels that do not queue behind a dead peer's handshake."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from conftest import fake_page_table

from vllm_dsa_connector.core.handoff.leases import LeaseState
from vllm_dsa_connector.core.handoff.messages import ReqRef

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.t = time.monotonic()

    def __call__(self) -> float:
        return self.t


def _config(model: Path, role: str, extra: dict):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), enforce_eager=True, dtype="float32", max_model_len=2048,
                      kv_transfer_config=KVTransferConfig(kv_connector="DSAConnector", kv_role=role,
                                                          kv_connector_extra_config=extra)).create_engine_config()


def _payload(engine: str, agent: str = "", num_blocks: int = 512) -> bytes:
    from vllm_dsa_connector.core.handoff.wire import RankPayload, encode

    return encode(RankPayload(engine, 0, 0, 0, agent or f"agent-{engine}", b"", fake_page_table(num_blocks), [],
                              {"model_dtype": "f32"}))


class _Plan:
    src_block_size = BLOCK  # P's tokens per block (a real PeerPlan reads it from P's page tables)

    def senders_for(self, rank: int) -> tuple[int, ...]:
        return (0,)


@pytest.fixture(scope="module")
def pd(tiny_mla_dir: Path):
    """A P and a D scheduler (real side channels) sharing one injected clock."""
    import vllm.plugins

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    vllm.plugins.load_general_plugins()
    clock = Clock()
    extra = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "handshake_timeout_s": 2.0,
             "heartbeat_interval_s": 1.0, "bounce_mode": "never"}
    p = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_producer", extra), "P", ConnectorOptions.from_config(extra),
                              clock)
    d = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_consumer", extra), "D", ConnectorOptions.from_config(extra),
                              clock)
    p.set_local_payloads([_payload("P")])
    d.set_local_payloads([_payload("D")])
    # the page tables are fakes: skip the layout check, keep the real handshake round trip
    d.consumer.producers.check_peer = lambda src, dst: _Plan()
    # the clock estimate pairs the injected clock with real round trips: start it now, not before the
    # (seconds-long, on a cold host) config set-up, or the first registration is past its post deadline
    clock.t = time.monotonic()
    yield p, d, clock
    p.shutdown()
    d.shutdown()


def _request(req_id: str, n: int, params: dict, status: str = "WAITING"):
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    r = Request(req_id, list(range(100, 100 + n)), sp, None)
    r.status = getattr(RequestStatus, status)
    return r


def _prefill(p, req_id: str, n: int, blocks: list[int]) -> dict:
    r = _request(req_id, n, {"do_remote_decode": True}, "FINISHED_LENGTH_CAPPED")
    r.num_computed_tokens = n
    delay, params = p.request_finished(r, (blocks,))
    assert delay and params["remote_num_tokens"] == n and params["remote_token"]
    return params


def _blocks(hit: int, new: list[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from vllm_dsa_connector.compat import dataclass_has_field

    # A prefix-cache hit is a hashed block: the field is ``_block_hash`` (read through a property)
    # in vLLM 0.32/0.33, ``block_hash`` in 0.34.
    field = "block_hash" if dataclass_has_field(KVCacheBlock, "block_hash") else "_block_hash"
    cached = [KVCacheBlock(block_id=200 + i) for i in range(hit)]
    for b in cached:
        setattr(b, field, b"h" * 8)
    return KVCacheBlocks(blocks=(cached + [KVCacheBlock(block_id=b) for b in new],))


def _load(d, clock, req_id: str, params: dict, n: int, hit_blocks: int, new: list[int]):
    req = _request(req_id, n, dict(params))
    deadline = time.monotonic() + 10
    while (res := d.get_num_new_matched_tokens(req, hit_blocks * BLOCK))[0] is None:
        assert time.monotonic() < deadline, "handshake did not finish"
        time.sleep(0.02)
    assert res == (n - hit_blocks * BLOCK, True)
    d.update_state_after_alloc(req, _blocks(hit_blocks, new), res[0])
    return req


def _wait(fut) -> None:
    deadline = time.monotonic() + 10
    while not fut.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_d_prefix_hits_take_p_blocks_of_the_same_positions(pd) -> None:
    p, d, clock = pd
    params = _prefill(p, "p-pos", 5 * BLOCK + 3, [11, 12, 13, 14, 15, 16])
    _load(d, clock, "d-pos", params, 5 * BLOCK + 3, hit_blocks=2, new=[40, 41, 42, 43, 44])
    meta = d.build_connector_meta(None)
    (job,) = meta.recv
    assert job.src_blocks == [13, 14, 15, 16] and job.blocks == [40, 41, 42, 43]
    _wait(d.consumer.loads["d-pos"].reg)
    d.build_connector_meta(None)
    push = p.build_connector_meta(None).push
    assert [(j.src_blocks, j.dst_blocks) for j in push] == [([13, 14, 15, 16], [40, 41, 42, 43])]
    p.update_connector_output(_output(sending={"p-pos"}))
    d.update_connector_output(_output(recving={"d-pos"}))
    assert "d-pos" not in d.consumer.loads


def test_token_count_mismatch_is_a_load_failure(pd) -> None:
    p, d, clock = pd
    params = _prefill(p, "p-short", 3 * BLOCK, [1, 2, 3])
    req = _request("d-long", 3 * BLOCK + 5, dict(params))  # not the prompt P computed
    while d.get_num_new_matched_tokens(req, 0)[0] is None:
        time.sleep(0.02)
    d.update_state_after_alloc(req, _blocks(0, [5, 6, 7, 8]), 3 * BLOCK + 5)
    meta = d.build_connector_meta(None)
    assert not meta.recv and "not the same prompt" in meta.fail_recv["d-long"]


def _output(sending=(), recving=(), failed=()):
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_sending=set(sending), finished_recving=set(recving),
                             failed_recving=set(failed))


def _registered(p, d, clock, name: str, src: list[int], dst: list[int]):
    """P prefilled ``p-<name>``; D allocated ``d-<name>`` and P accepted its registration."""
    params = _prefill(p, f"p-{name}", 2 * BLOCK, src)
    req = _load(d, clock, f"d-{name}", params, 2 * BLOCK, 0, dst)
    d.build_connector_meta(None)
    _wait(d.consumer.loads[f"d-{name}"].reg)
    d.build_connector_meta(None)
    return req


def test_give_up_before_dispatch_releases_at_once_and_p_never_writes(pd) -> None:
    p, d, clock = pd
    _registered(p, d, clock, "stall", [21, 22], [50, 51])
    assert p.producer.lease("p-stall").state is LeaseState.REGISTERED  # P's engine has not stepped yet
    clock.t += 5.1  # D's transfer timeout passes
    meta = d.build_connector_meta(None)
    assert "d-stall" not in meta.fail_recv  # the cancel is on its way: not before P's answer
    _wait(d.consumer.loads["d-stall"].cancel)
    meta = d.build_connector_meta(None)
    assert "P confirmed nothing was written" in meta.fail_recv["d-stall"]
    assert "d-stall" in meta.fail_unposted  # nothing in flight: D's workers need no fence from P
    p_meta = p.build_connector_meta(None)  # P's engine resumes: the registration is dropped
    assert not p_meta.push and "p-stall" in p_meta.release
    p.update_connector_output(_output(sending={"p-stall"}))
    d.update_connector_output(_output(recving={"d-stall"}, failed={"d-stall"}))


def test_give_up_after_dispatch_holds_blocks_until_the_write_bound(pd) -> None:
    from vllm_dsa_connector.core.handoff.loads import SAFETY_MARGIN_S

    p, d, clock = pd
    _registered(p, d, clock, "slow", [23, 24], [52, 53])
    (job,) = p.build_connector_meta(None).push  # handed to P's workers: a WRITE may be in flight
    assert job.post_deadline <= d.consumer.loads["d-slow"].give_up_at + (job.post_deadline - clock.t)
    clock.t += 5.1
    d.build_connector_meta(None)
    _wait(d.consumer.loads["d-slow"].cancel)
    assert d.consumer.loads["d-slow"].cancel.result()[0].states == {"p-slow": "posted"}
    clock.t += 4.0
    assert "d-slow" not in d.build_connector_meta(None).fail_recv  # still inside give-up + write timeout
    assert d.has_pending_push_work()
    clock.t += 1.0 + SAFETY_MARGIN_S
    meta = d.build_connector_meta(None)
    assert "write bound passed" in meta.fail_recv["d-slow"]
    assert "d-slow" not in meta.fail_unposted  # a WRITE may be in flight: the workers wait for P's fence
    p.update_connector_output(_output(sending={"p-slow"}))
    d.update_connector_output(_output(recving={"d-slow"}, failed={"d-slow"}))


def test_p_tells_d_its_staging_arena_is_full_and_d_routes_direct(pd) -> None:
    """P's workers report their staging arenas in their stats (``staging:<held|full>:<rank>``); P's scheduler
    reads them from the connector output and says so in its answer to the next registration; D then plans
    that P's next requests without bounce (``RoutePlanner.plan(bounce=False)``), and again with it once P's
    arena has room."""
    from vllm_dsa_connector.connector.stats import DSAKVConnectorStats

    p, d, clock = pd
    planned: list[bool] = []
    real_plan = d.routes.plan

    def spy(*args, **kwargs):
        planned.append(kwargs.get("bounce", True))
        return real_plan(*args, **kwargs)

    d.routes.plan = spy
    try:
        for name, full in (("full", True), ("after-full", False), ("room", False)):
            stats = DSAKVConnectorStats()
            stats.staging(0, 7 << 20 if full else 0, full)
            out = _output()
            out.kv_connector_stats = stats
            if name != "after-full":  # no new sample: the last one holds
                p.update_connector_output(out)
            _registered(p, d, clock, f"arena-{name}", [28, 29], [56, 57])
            assert d.consumer.peers.get("P").staging_full is (name != "room"), name
            p.build_connector_meta(None)
            p.update_connector_output(_output(sending={f"p-arena-{name}"}))
            d.update_connector_output(_output(recving={f"d-arena-{name}"}))
    finally:
        d.routes.plan = real_plan
    # each registration is planned with P's previous answer: before the first none, then full, full
    assert planned == [True, False, False], planned


def test_a_fresh_p_s_first_loads_get_the_set_up_budget_on_top_of_the_transfer_s(pd) -> None:
    """Issue 44: P's one-time set-up of a fresh D (its NIXL remote agents, the first connection) is not spent
    from the transfer's budget: until a load from P's start landed, a registration waits transfer_timeout_s +
    peer_setup_timeout_s (and P's post deadline is that much later); after one landed, transfer_timeout_s."""
    import dataclasses

    p, d, clock = pd
    d.consumer.settings = dataclasses.replace(d.consumer.settings, peer_setup_s=3.0)
    d.consumer._proven.clear()  # the module's pair delivered loads in earlier tests
    _registered(p, d, clock, "fresh", [27, 28], [56, 57])
    load = d.consumer.loads["d-fresh"]
    assert load.give_up_at - clock.t == pytest.approx(5.0 + 3.0, abs=0.5)
    (job,) = p.build_connector_meta(None).push
    clock.t += 5.1  # past transfer_timeout_s: the set-up budget keeps it
    assert "d-fresh" not in d.build_connector_meta(None).fail_recv and load.state.name == "REGISTERED"
    p.update_connector_output(_output(sending={"p-fresh"}))
    d.update_connector_output(_output(recving={"d-fresh"}))  # it landed: P has set this D up
    _registered(p, d, clock, "warm", [29, 30], [58, 59])
    assert d.consumer.loads["d-warm"].give_up_at - clock.t == pytest.approx(5.0, abs=0.5)
    p.build_connector_meta(None)
    p.update_connector_output(_output(sending={"p-warm"}))
    d.update_connector_output(_output(recving={"d-warm"}))


def test_abort_while_loading_keeps_blocks_until_safe(pd) -> None:
    p, d, clock = pd
    req = _registered(p, d, clock, "abort", [25, 26], [54, 55])
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(req, ([54, 55],)) == (True, None)  # vLLM must not free the blocks yet
    _wait(d.consumer.loads["d-abort"].cancel)
    assert "d-abort" in d.build_connector_meta(None).fail_recv  # P never posted: released now
    assert "p-abort" in p.build_connector_meta(None).release
    p.update_connector_output(_output(sending={"p-abort"}))
    d.update_connector_output(_output(recving={"d-abort"}, failed={"d-abort"}))


def test_queued_requests_are_heartbeated(pd) -> None:
    p, d, clock = pd
    params = _prefill(p, "p-queue", BLOCK, [27])
    req = _request("d-queue", BLOCK, dict(params))
    while d.get_num_new_matched_tokens(req, 0)[0] is None:  # D has no blocks yet: stays queued
        time.sleep(0.02)
    lease = p.producer.lease("p-queue")
    for _ in range(4):  # 4 x 6 s > the 10 s lease: heartbeats keep it
        clock.t += 6
        d.build_connector_meta(None)
        deadline = time.monotonic() + 5
        while lease.deadline < clock.t + 9 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not p.build_connector_meta(None).release
    assert lease.state is LeaseState.HELD
    d.consumer.forget_queued("d-queue")
    clock.t += 11  # no more heartbeats: expires
    assert "p-queue" in p.build_connector_meta(None).release
    p.update_connector_output(_output(sending={"p-queue"}))


def _know_p(p, d, clock) -> None:
    """D has done its handshake with P (one whole load from P, finished on both sides), whatever ran
    before: the module's schedulers are shared, and a test run alone starts with D knowing no P."""
    if "P" in d.consumer.peers and d.consumer.peers["P"].control is not None:
        return
    params = _prefill(p, "p-know", BLOCK, [9])
    _load(d, clock, "d-know", params, BLOCK, hit_blocks=0, new=[90])
    d.build_connector_meta(None)
    _wait(d.consumer.loads["d-know"].reg)
    d.build_connector_meta(None)
    p.build_connector_meta(None)
    p.update_connector_output(_output(sending={"p-know"}))
    d.update_connector_output(_output(recving={"d-know"}))
    assert "P" in d.consumer.peers and "d-know" not in d.consumer.loads


def test_dead_producer_is_a_load_failure_and_cancels_do_not_queue_behind_it(pd) -> None:
    p, d, clock = pd
    _know_p(p, d, clock)  # the cancel below goes to a P that D knows
    dead = {"do_remote_prefill": True, "remote_engine_id": "P-dead", "remote_request_id": "x",
            "remote_host": "127.0.0.1", "remote_port": 24971, "remote_block_ids": [1, 2, 3],
            "remote_num_tokens": 40, "remote_token": "t", "transfer_mode": "dsa-push"}
    req = _request("d-dead", 40, dead)
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)  # handshake in flight: ask later
    t0 = time.monotonic()
    fut = d.consumer.cancel("P", [ReqRef("unrelated", "t")])  # P's control thread is not blocked
    _wait(fut)
    assert fut.result()[0].ok and time.monotonic() - t0 < 1.5
    deadline = time.monotonic() + 10
    while not d.consumer.peers["P-dead"].error:  # the first attempt goes unanswered (2 s)
        assert d.get_num_new_matched_tokens(req, 0) == (None, False)  # inside its budget: still waiting
        assert time.monotonic() < deadline
        time.sleep(0.1)
    clock.t += 1.0  # past the retry pause: a second attempt
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)
    assert d.consumer.peers["P-dead"].attempt == 2
    clock.t += 5.0  # the request's transfer budget (5 s) is spent while the second attempt runs
    deadline = time.monotonic() + 10
    while (res := d.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert res == (40, True)  # policy fail (the default): claimed, then failed at allocation
    assert "did not answer" in d.consumer.peers["P-dead"].error and d.consumer.peers["P-dead"].attempt == 2
    d.update_state_after_alloc(req, _blocks(0, [60, 61, 62]), 40)
    assert "did not answer" in d.build_connector_meta(None).fail_recv["d-dead"]


def test_unanswered_handshake_is_retried_inside_the_transfer_budget(pd, tiny_mla_dir: Path) -> None:
    """P's side channel silent for one handshake timeout (closed, then bound again on its port: what a
    starved or restarting P looks like from D): the waiting request is not failed; the next attempt
    succeeds, and the load registers and is pushed as usual."""
    from vllm_dsa_connector.core.handoff.side_channel import SideChannelServer

    _, d, clock = pd
    p2 = _second_p(tiny_mla_dir, "P-late", clock)
    try:
        params = _prefill(p2, "p-late", 2 * BLOCK, [21, 22])
        host, port = p2.server.host, p2.server.port
        p2.server.close()
        req = _request("d-late", 2 * BLOCK, dict(params))
        deadline = time.monotonic() + 10
        while not (d.consumer.peers.get("P-late") and d.consumer.peers["P-late"].error):
            assert d.get_num_new_matched_tokens(req, 0) == (None, False)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "did not answer" in d.consumer.peers["P-late"].error
        assert d.get_num_new_matched_tokens(req, 0) == (None, False)  # failed, but inside its 5 s budget
        p2.server = SideChannelServer(host, port, p2._handle, p2.auth, clock, origin=p2.server.origin)
        clock.t += 1.0
        deadline = time.monotonic() + 10
        while (res := d.get_num_new_matched_tokens(req, 0))[0] is None:
            assert time.monotonic() < deadline, "second handshake did not finish"
            time.sleep(0.05)
        peer = d.consumer.peers["P-late"]
        assert res == (2 * BLOCK, True) and peer.error is None and peer.attempt == 2
        d.update_state_after_alloc(req, _blocks(0, [70, 71]), 2 * BLOCK)
        meta = d.build_connector_meta(None)
        assert [j.blocks for j in meta.recv] == [[70, 71]] and not meta.fail_recv
        _wait(d.consumer.loads["d-late"].reg)
        d.build_connector_meta(None)
        push = p2.build_connector_meta(None).push
        assert [(j.src_blocks, j.dst_blocks) for j in push] == [([21, 22], [70, 71])]
        p2.update_connector_output(_output(sending={"p-late"}))
        d.update_connector_output(_output(recving={"d-late"}))
        assert "d-late" not in d.consumer.loads
    finally:
        p2.shutdown()


def test_malformed_kv_transfer_params_are_a_load_failure(pd) -> None:
    _, d, _ = pd
    bad = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "x",
           "remote_host": "127.0.0.1", "remote_port": "not a port", "remote_block_ids": [1],
           "remote_num_tokens": 16, "remote_token": "t"}
    req = _request("d-bad", 16, bad)
    assert d.get_num_new_matched_tokens(req, 0) == (16, True)  # claimed: failed at allocation
    d.update_state_after_alloc(req, _blocks(0, [95]), 16)
    reason = d.build_connector_meta(None).fail_recv["d-bad"]
    assert "(malformed)" in reason and "remote_port" in reason


def test_one_p_request_feeds_one_d_request(pd, tiny_mla_dir: Path) -> None:
    """Issue 29 item 3. vLLM forks ``n > 1`` into children sharing the parent's kv_transfer_params (and a
    prompt list sent as one request hands the first prompt's params to every prompt): on one D, the first
    child takes P's KV and the others compute the prompt locally. A second D engine handed the same params
    is refused by P, and its load fails naming the D request that has the lease."""
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    p, d, clock = pd
    params = _prefill(p, "p-fork", 2 * BLOCK, [33, 34])
    _load(d, clock, "0_fork", params, 2 * BLOCK, 0, [90, 91])
    sibling = _request("1_fork", 2 * BLOCK, dict(params))
    assert d.get_num_new_matched_tokens(sibling, 0) == (0, False)  # computed locally, not a second load
    assert not sibling.kv_transfer_params["do_remote_prefill"] and "1_fork" not in d.consumer.loads
    d.build_connector_meta(None)
    _wait(d.consumer.loads["0_fork"].reg)
    assert not d.build_connector_meta(None).fail_recv
    extra = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "bounce_mode": "never"}
    d2 = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_consumer", extra), "D2", ConnectorOptions.from_config(extra),
                               clock)
    try:
        d2.set_local_payloads([_payload("D2")])
        d2.consumer.producers.check_peer = lambda src, dst: _Plan()
        _load(d2, clock, "d2-fork", params, 2 * BLOCK, 0, [92, 93])
        d2.build_connector_meta(None)
        _wait(d2.consumer.loads["d2-fork"].reg)
        failed: dict[str, str] = {}
        # a registration left unanswered on a loaded host is retried: the refusal may come a step later
        _wait_for(lambda: failed.update(d2.build_connector_meta(None).fail_recv) or "d2-fork" in failed,
                  "D2's refused load failed")
        reason = failed["d2-fork"]
        assert "P refused the registration" in reason and "already registered by D request '0_fork'" in reason
        assert "refusing D request 'd2-fork' of engine 'D2'" in reason
        (job,) = p.build_connector_meta(None).push  # P writes for the first D request only
        assert (job.dst_engine, job.dst_req_id, job.dst_blocks) == ("D", "0_fork", [90, 91])
        p.update_connector_output(_output(sending={"p-fork"}))
        d.update_connector_output(_output(recving={"0_fork"}))
        d2.update_connector_output(_output(recving={"d2-fork"}, failed={"d2-fork"}))
    finally:
        d2.shutdown()


def _wait_for(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_heartbeats_of_many_queued_requests_stay_under_p_s_cap(pd) -> None:
    """Issue 29 item 5: more queued loads than P takes in one message (4,096) are heartbeated in chunks
    under the cap; one heartbeat of them all was refused whole and every lease expired."""
    from vllm_dsa_connector.core.handoff.messages import MAX_REQS_PER_MESSAGE
    from vllm_dsa_connector.core.handoff.params import RemoteParams

    p, d, clock = pd
    template = _prefill(p, "p-many-0", BLOCK, [30])
    n = MAX_REQS_PER_MESSAGE + 5
    ids = [f"p-many-{i}" for i in range(1, n)]
    for i, p_req in enumerate(ids, 1):
        token = p.producer.add_lease(p_req, [30 + i % 100])
        d.consumer.queue(f"d-many-{i}", RemoteParams.from_dict({**template, "remote_request_id": p_req,
                                                             "remote_token": token}))
    ids.append("p-many-0")
    d.consumer.queue("d-many-0", RemoteParams.from_dict(template))
    try:
        leases = [p.producer.lease(i) for i in ids]
        start = clock.t
        clock.t += 6  # a heartbeat is due; the 10 s leases end at start + 10
        d.build_connector_meta(None)
        _wait_for(lambda: all(lease.deadline >= clock.t + 9 for lease in leases), "leases not extended")
        clock.t = start + 12
        assert not set(p.build_connector_meta(None).release) & set(ids)
        assert all(lease.state is LeaseState.HELD for lease in leases)
        d.build_connector_meta(None)
        assert d.consumer.heartbeats_refused == 0
    finally:
        for i in range(n):
            d.consumer.forget_queued(f"d-many-{i}")
        p.update_connector_output(_output(sending=set(ids)))


def test_a_refused_heartbeat_is_an_error_and_fails_its_queued_loads(pd) -> None:
    """Issue 29 item 5: P refusing a heartbeat (here P's real check refusing a request id over 512 characters
    in it, the D load queued directly: kv_transfer_params with such an id now fail their load) is logged,
    counted, and the loads it covered fail by name at allocation instead of waiting for expired leases."""
    import msgspec

    from vllm_dsa_connector.core.handoff.params import RemoteParams

    p, d, clock = pd
    params = _prefill(p, "p-victim", BLOCK, [40])
    req = _request("d-victim", BLOCK, dict(params))
    assert d.get_num_new_matched_tokens(req, 0) == (BLOCK, True)  # handshake done; no blocks yet: queued
    long_id = {**params, "remote_request_id": "x" * 600}
    long_req = _request("d-long", BLOCK, long_id)
    assert d.get_num_new_matched_tokens(long_req, 0) == (BLOCK, True)  # refused by name: its load fails
    d.consumer.queue("d-poison", msgspec.structs.replace(RemoteParams.from_dict(params), remote_request_id="x" * 600))
    before = d.consumer.heartbeats_refused
    try:
        clock.t += 2
        d.build_connector_meta(None)  # the heartbeat goes out
        _wait_for(lambda: all(f.done() for _, _, f in d.consumer._heartbeats), "heartbeat unanswered")
        d.build_connector_meta(None)  # its refusal is collected
        assert d.consumer.heartbeats_refused == before + 1
        assert "refused the heartbeat" in d.consumer.loads["d-victim"].error
        assert "length <= 512" in d.consumer.loads["d-victim"].error  # refused while decoding (bounded wire type)
        assert d.get_num_new_matched_tokens(req, 0) == (BLOCK, True)
        d.update_state_after_alloc(req, _blocks(0, [80]), BLOCK)
        assert "refused the heartbeat" in d.build_connector_meta(None).fail_recv["d-victim"]
        d.update_state_after_alloc(long_req, _blocks(0, [81]), BLOCK)
        assert "remote_request_id must be 1..512 characters" in d.build_connector_meta(None).fail_recv["d-long"]
    finally:
        d.consumer.forget_queued("d-poison")
        d.consumer.forget_queued("d-victim")
        p.update_connector_output(_output(sending={"p-victim"}))


def test_idle_steps_pause_and_a_registration_wakes_p(pd) -> None:
    """P only holding a lease pauses its idle steps longer and longer (up to 20 ms); D's registration reaching
    P's side channel ends the pause; with the WRITE handed to the workers P pauses 2 ms at most, and D, its
    load registered, too (both need steps to learn the outcome)."""
    from types import SimpleNamespace

    p, d, clock = pd
    # earlier tests' requests are done: their workers report them (P frees its leases, D forgets its loads)
    p.update_connector_output(_output(sending=set(p.producer._leases)))
    d.update_connector_output(_output(recving=set(d.consumer.loads)))
    assert not p.producer.pending() and not d.consumer.loads
    idle = SimpleNamespace(total_num_scheduled_tokens=0)
    waits: dict[str, list[tuple[float, bool]]] = {"P": [], "D": []}
    for name, sched in (("P", p), ("D", d)):
        sched.pacer.wait = lambda ev, t, name=name: waits[name].append((t, ev.is_set())) or ev.is_set()
        sched.pacer.busy()
        sched.pacer._event.clear()  # earlier tests' side-channel messages woke it
    try:
        params = _prefill(p, "p-idle", 2 * BLOCK, [25, 26])
        expected = pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02])
        for _ in range(3):  # a loaded host may deliver an earlier test's late side-channel message meanwhile
            waits["P"].clear()
            p.pacer.busy()
            p.pacer._event.clear()
            for _ in range(7):
                assert p.build_connector_meta(idle).is_empty()
            if [t for t, _ in waits["P"]] == expected and not any(woken for _, woken in waits["P"]):
                break
        assert [t for t, _ in waits["P"]] == expected
        assert not any(woken for _, woken in waits["P"])
        _load(d, clock, "d-idle", params, 2 * BLOCK, 0, [54, 55])
        d.build_connector_meta(None)
        _wait(d.consumer.loads["d-idle"].reg)  # P's side channel answered: P's pause ends at once
        assert not d.consumer.in_flight()  # D has not taken the reply yet: still only waiting on P
        assert p.pacer._event.is_set()
        (job,) = p.build_connector_meta(idle).push  # the registration is dispatched on this step
        assert p.pacer.idle_steps == 0
        for _ in range(4):
            p.build_connector_meta(idle)  # a WRITE in flight: short pauses
        assert max(t for t, _ in waits["P"][-4:]) == pytest.approx(0.002)
        d.build_connector_meta(idle)  # D takes the reply: its load is registered
        assert d.consumer.in_flight() and not d.consumer.giving_up() and p.producer.in_flight()
        for _ in range(4):
            d.build_connector_meta(idle)
        assert max(t for t, _ in waits["D"][-4:]) == pytest.approx(0.002)
        p.update_connector_output(_output(sending={"p-idle"}))
        d.update_connector_output(_output(recving={"d-idle"}))
        assert not p.producer.pending() and "d-idle" not in d.consumer.loads
    finally:
        for sched in (p, d):
            sched.pacer.wait = type(sched.pacer).wait


def test_a_restarted_d_is_served_with_its_own_payloads(pd, tiny_mla_dir: Path) -> None:
    """Issue 29 item 2: D restarted with the same engine id (a new scheduler: new epoch, another agent, 1,024
    blocks instead of 512). P learnt D's payloads once and wrote the new start's blocks with the old agent and
    layout; now the new start's registration is asked for its payloads and served with them, P's workers get
    the new start's PeerInfo, the old start's registration P had not dispatched yet is dropped, never written,
    and the old start's next registration is checked against its own layout (512 blocks), not the new one's."""
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler
    from vllm_dsa_connector.core.handoff.loads import LoadState

    p, d, clock = pd
    _registered(p, d, clock, "before", [41, 42], [60, 61])
    (job,) = p.build_connector_meta(None).push
    assert job.dst_epoch == d.epoch and p.producer._peers.sent_epoch("D") == d.epoch
    _registered(p, d, clock, "old", [43, 44], [62, 63])  # registered by the old start, not dispatched yet
    extra = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "bounce_mode": "never"}
    d2 = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_consumer", extra), "D", ConnectorOptions.from_config(extra),
                               clock)
    try:
        d2.set_local_payloads([_payload("D", agent="agent-D-restarted", num_blocks=1024)])
        d2.consumer.producers.check_peer = lambda src, dst: _Plan()
        assert d2.epoch != d.epoch
        _registered(p, d2, clock, "new", [45, 46], [700, 701])  # blocks only the new start has
        assert d2.consumer.loads["d-new"].state is LoadState.REGISTERED
        meta = p.build_connector_meta(None)
        (info,) = meta.peers
        assert (info.engine_id, info.epoch, info.payloads) == ("D", d2.epoch, d2._local_payloads)
        assert [(j.req_id, j.dst_epoch, j.dst_blocks) for j in meta.push] == [("p-new", d2.epoch, [700, 701])]
        assert "p-old" in meta.release  # the old start's registration: released, never written
        # the old start again: its own layout decides (its pools end at 511), and P's record stays the new start's
        params = _prefill(p, "p-back", 2 * BLOCK, [47, 48])
        _load(d, clock, "d-back", params, 2 * BLOCK, 0, [600, 601])
        d.build_connector_meta(None)
        _wait(d.consumer.loads["d-back"].reg)
        reason = d.build_connector_meta(None).fail_recv["d-back"]
        assert "outside D's pools (0..511)" in reason
        assert p.producer._peers["D"].epoch == d2.epoch
        p.update_connector_output(_output(sending={"p-before", "p-old", "p-new", "p-back"}))
        d.update_connector_output(_output(recving={"d-before", "d-old", "d-back"}, failed={"d-old", "d-back"}))
        d2.update_connector_output(_output(recving={"d-new"}))
    finally:
        d2.shutdown()


def test_d_redoes_the_handshake_after_p_restarts_on_the_same_id_and_port(pd, tiny_mla_dir: Path) -> None:
    """Issue 29 item 2: P restarted with the same engine id and side-channel port. D kept the old start's
    payloads (agent, plan) forever and every load of the new start timed out (its notices came from an agent D
    did not expect). Now a request naming the new start makes D redo the handshake: D's workers get the new
    start's PeerInfo, the new load registers and is pushed; the load the old start had accepted fails (given
    up, its blocks kept until the write bound: the new start's "not posted" is not the old start's word)."""
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler
    from vllm_dsa_connector.core.handoff.loads import SAFETY_MARGIN_S, LoadState
    from vllm_dsa_connector.core.handoff.wire import decode_payload

    _, d, clock = pd
    extra = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "bounce_mode": "never"}
    p1 = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_producer", extra), "P-restart",
                               ConnectorOptions.from_config(extra), clock)
    p1.set_local_payloads([_payload("P-restart", agent="agent-P-first")])
    _registered(p1, d, clock, "r1", [21, 22], [80, 81])
    assert d.consumer.peers["P-restart"].meta.epoch == p1.epoch
    port = p1.server.port
    p1.shutdown()
    again = {**extra, "side_channel_port": port}
    p2 = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_producer", again), "P-restart",
                               ConnectorOptions.from_config(again), clock)
    try:
        p2.set_local_payloads([_payload("P-restart", agent="agent-P-second")])
        params = _prefill(p2, "p-r2", 2 * BLOCK, [31, 32])
        assert params["remote_port"] == port and params["remote_epoch"] == p2.epoch != p1.epoch
        _load(d, clock, "d-r2", params, 2 * BLOCK, 0, [82, 83])  # waits for the second handshake
        peer = d.consumer.peers["P-restart"]
        assert peer.meta.epoch == p2.epoch and peer.error is None
        old = d.consumer.loads["d-r1"]
        assert old.state is LoadState.GIVING_UP and "P-restart restarted" in old.reason
        meta = d.build_connector_meta(None)
        (info,) = [i for i in meta.peers if i.engine_id == "P-restart"]
        assert info.epoch == p2.epoch and info.as_source
        assert decode_payload(info.payloads[0]).agent_name == "agent-P-second"
        (job,) = meta.recv
        assert (job.req_id, job.src_epoch, job.blocks) == ("d-r2", p2.epoch, [82, 83])
        _wait(d.consumer.loads["d-r2"].reg)
        assert not d.build_connector_meta(None).fail_recv
        assert d.consumer.loads["d-r2"].state is LoadState.REGISTERED
        (push,) = p2.build_connector_meta(None).push
        assert (push.req_id, push.dst_engine, push.dst_epoch, push.dst_blocks) == ("p-r2", "D", d.epoch, [82, 83])
        _wait(old.cancel)
        assert old.cancel.result()[1].epoch == p2.epoch  # the new start answered: not the old one's word
        assert "d-r1" not in d.build_connector_meta(None).fail_recv
        clock.t = old.release_at + SAFETY_MARGIN_S
        assert "write bound passed" in d.build_connector_meta(None).fail_recv["d-r1"]
        p2.update_connector_output(_output(sending={"p-r2"}))
        d.update_connector_output(_output(recving={"d-r1", "d-r2"}, failed={"d-r1"}))
    finally:
        p2.shutdown()


class _Lines(logging.Handler):
    """The records of one logger (vLLM's loggers do not propagate to the root, so caplog alone sees nothing)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Lines:
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


_NIXL_PULL = {  # what vLLM's NixlConnector (pull) P hands out
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2], "remote_engine_id": "nixl-P",
    "remote_request_id": "cmpl-1", "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1,
    "remote_num_tokens": 2 * BLOCK, "transfer_mode": "pull"}
_NO_BLOCKS = {  # DSAConnector's keys (an older P's legacy "push"), remote_block_ids missing
    "do_remote_prefill": True, "remote_engine_id": "P-noblocks", "remote_request_id": "x", "remote_host": "127.0.0.1",
    "remote_port": 24999, "remote_num_tokens": 2 * BLOCK, "remote_token": "secret-lease-token",
    "transfer_mode": "push", "kv_connector": "DSAConnector"}
_ROUTER_NULLS = {  # a router's placeholders, sent to D as they are
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None}


@pytest.mark.parametrize(("params", "reason", "peer", "problem"), [
    (_NIXL_PULL, "other_connector", "engine 'nixl-P'", "transfer_mode 'pull' is another producer's"),
    ({**_NIXL_PULL, "remote_engine_id": "lm-P", "transfer_mode": "push", "kv_connector": "LMCacheConnector"},
     "other_connector", "engine 'lm-P'", "kv_connector 'LMCacheConnector' names another connector"),
    ({**_NIXL_PULL, "remote_engine_id": "push-P", "transfer_mode": "push"}, "other_connector", "engine 'push-P'",
     "transfer_mode 'push' without kv_connector 'DSAConnector' is another producer's"),
    (_NO_BLOCKS, "malformed", "engine 'P-noblocks'", "Object missing required field `remote_block_ids`"),
    (_ROUTER_NULLS, "malformed", "unknown", "got `null`"),
    ({**_ROUTER_NULLS, "remote_host": "10.0.0.9", "remote_port": 7000}, "malformed", "10.0.0.9:7000",
     "got `null`"),
    ({**_ROUTER_NULLS, "remote_engine_id": "P-nullmode", "transfer_mode": None}, "malformed", "engine 'P-nullmode'",
     "got `null`"),
], ids=["nixl-pull", "other-kv_connector", "bare-push", "no-remote_block_ids", "router-nulls", "nulls-host-port", "null-mode"])
def test_unusable_params_fail_the_load_counted_and_logged_once_per_peer(pd, request, params: dict, reason: str,
                                                                        peer: str, problem: str) -> None:
    """Issue 31 item 0: kv_transfer_params D cannot use (another connector's, missing keys, the nulls of a
    router) are a load failure: claimed, failed at allocation with a reason naming what was wrong (vLLM's
    kv_load_failure_policy then decides), counted by reason, and logged once per peer with what was received
    (the lease token's value never). Asking again for a request not yet allocated counts it once."""
    from vllm_dsa_connector.connector.stats import unusable_key

    _, d, _ = pd
    d.get_stats()  # what earlier tests counted
    ids = [f"d-unusable-{request.node.callspec.id}-{i}" for i in range(3)]
    reqs = [_request(i, 2 * BLOCK + 3, dict(params)) for i in ids]
    with _Lines("vllm.vllm_dsa_connector.connector.scheduler") as lines:
        for req in reqs:
            assert d.get_num_new_matched_tokens(req, BLOCK) == (BLOCK + 3, True)
        assert d.get_num_new_matched_tokens(reqs[0], BLOCK) == (BLOCK + 3, True)  # not allocated last step
        for req in reqs:
            d.update_state_after_alloc(req, _blocks(1, [96, 97]), BLOCK + 3)
        meta = d.build_connector_meta(None)
    assert d.get_stats().data[unusable_key(reason)] == 3
    (line,) = [m for m in lines.at(logging.ERROR) if "cannot use" in m]
    assert ids[0] in line and peer in line and f"({reason})" in line and problem in line
    assert "kv_load_failure_policy" in line and f"vllm:dsa_kv_unusable_params_total{{reason={reason!r}}}" in line
    for key, value in params.items():  # what was received: every key, a short repr of its value
        assert repr(key) in line and (key == "remote_token" or repr(value)[:20] in line)
    assert "secret-lease-token" not in line and not lines.at(logging.WARNING)
    for req in reqs:
        assert meta.fail_recv[req.request_id].startswith(f"kv_transfer_params D cannot use ({reason}): ")
        assert problem in meta.fail_recv[req.request_id]
        assert not req.kv_transfer_params["do_remote_prefill"] and req.request_id not in d.consumer.loads
    assert meta.fail_quiet == set(ids) and not meta.recv  # the workers do not log each one again
    d.update_connector_output(_output(recving=ids, failed=ids))
    with _Lines("vllm.vllm_dsa_connector.connector.scheduler") as lines:
        later = _request(f"{ids[0]}-later", 2 * BLOCK, dict(params))
        assert d.get_num_new_matched_tokens(later, 0) == (2 * BLOCK, True)
        d.update_state_after_alloc(later, _blocks(0, [98, 99]), 2 * BLOCK)
        assert reason in d.build_connector_meta(None).fail_recv[later.request_id]
    assert not lines.at(logging.ERROR) and any(problem in m for m in lines.at(logging.DEBUG))  # once per peer
    assert d.get_stats().data[unusable_key(reason)] == 1


def test_unusable_params_fail_on_the_workers_without_any_expectation(pd) -> None:
    """The failed load reaches vLLM as one: a real D worker handed the step's metadata reports the request
    finished and failed (vLLM's kv_load_failure_policy applies to failed_recving), though nothing was ever
    armed for it, and counts the failure without logging it per request."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    _, d, _ = pd
    req = _request("d-unusable-worker", BLOCK, dict(_NIXL_PULL, remote_engine_id="nixl-P-worker"))
    assert d.get_num_new_matched_tokens(req, 0) == (BLOCK, True)
    d.update_state_after_alloc(req, _blocks(0, [94]), BLOCK)
    meta = d.build_connector_meta(None)
    worker = DSAConnectorWorker("D-unusable", ConnectorOptions(), {}, role="kv_consumer")  # a real NIXL agent
    try:
        with _Lines("vllm.vllm_dsa_connector.connector.worker") as lines:
            worker.start_load_kv(DSAConnectorMetadata(fail_recv=meta.fail_recv, fail_quiet=meta.fail_quiet))
        assert worker.get_transfer_results() == (set(), {"d-unusable-worker"}, {"d-unusable-worker"})
        assert worker.stats.data["recv_failed"] == 1 and not lines.at(logging.ERROR)
    finally:
        worker.shutdown()
    d.update_connector_output(_output(recving={"d-unusable-worker"}, failed={"d-unusable-worker"}))


def test_params_without_remote_prefill_are_left_alone(pd) -> None:
    """No do_remote_prefill (or false): not a load, nothing counted or changed, whatever else the params hold."""
    _, d, _ = pd
    d.get_stats()
    for params in ({}, {"do_remote_prefill": False, **{k: v for k, v in _NIXL_PULL.items() if k != "do_remote_prefill"}},
                   {"do_remote_decode": True}, {"remote_block_ids": None}):
        req = _request("d-local", BLOCK, dict(params))
        assert d.get_num_new_matched_tokens(req, 0) == (0, False)
        d.update_state_after_alloc(req, _blocks(0, []), 0)
        assert req.kv_transfer_params == params
    assert d.get_stats() is None and "d-local" not in d.build_connector_meta(None).fail_recv


def test_unusable_params_with_every_token_computed_claim_nothing(pd) -> None:
    """Nothing left to load (D computed the whole prompt): nothing to claim or fail; still counted."""
    from vllm_dsa_connector.connector.stats import unusable_key

    _, d, _ = pd
    d.get_stats()
    req = _request("d-unusable-all", BLOCK, dict(_ROUTER_NULLS, remote_engine_id="P-allcomputed"))
    assert d.get_num_new_matched_tokens(req, BLOCK) == (0, False)
    assert not req.kv_transfer_params["do_remote_prefill"] and "d-unusable-all" not in d._unusable
    assert d.get_stats().data[unusable_key("malformed")] == 1


def test_unusable_params_log_memory_is_bounded(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers whose unusable params were logged are remembered up to a cap (least recently seen forgotten
    first): made-up engine ids cannot grow it, and a forgotten peer is logged again when it comes back."""
    from vllm_dsa_connector.connector import scheduler

    _, d, _ = pd
    monkeypatch.setattr(scheduler, "_UNUSABLE_LOGGED", 4)
    with _Lines("vllm.vllm_dsa_connector.connector.scheduler") as lines:
        for i in [0, 1, 2, 3, 4, 5, 5, 0]:
            req = _request(f"d-cap-{i}-{len(lines.records)}", BLOCK, dict(_NIXL_PULL, remote_engine_id=f"P-cap-{i}"))
            assert d.get_num_new_matched_tokens(req, 0) == (BLOCK, True)
            d.request_finished(req, ([],))  # aborted before allocation: nothing left behind
    logged = [m for m in lines.at(logging.ERROR) if "cannot use" in m]
    assert [next(f"P-cap-{i}" for i in range(6) if f"'P-cap-{i}'" in m) for m in logged] == [
        "P-cap-0", "P-cap-1", "P-cap-2", "P-cap-3", "P-cap-4", "P-cap-5", "P-cap-0"]
    assert len(d._unusable_logged) == 4 and not any(r.startswith("d-cap-") for r in d._unusable)
    d.get_stats()


def test_an_unanswered_cancel_is_sent_again_until_p_answers(pd, tiny_mla_dir: Path) -> None:
    """D aborts a registered load while P's side channel is silent (closed, then bound again on its port: a
    starved P): the cancel goes unanswered, D sends it again on a later step, P releases the lease without a
    WRITE, and D hands its blocks back on P's answer instead of keeping them until the write bound."""
    from vllm.v1.request import RequestStatus

    from vllm_dsa_connector.core.handoff.side_channel import HandshakeError, SideChannelServer

    _, d, clock = pd
    p2 = _second_p(tiny_mla_dir, "P-deaf", clock)
    try:
        req = _registered(p2, d, clock, "deaf", [31, 32], [80, 81])
        host, port = p2.server.host, p2.server.port
        p2.server.close()
        req.status = RequestStatus.FINISHED_ABORTED
        assert d.request_finished(req, ([80, 81],)) == (True, None)
        first = d.consumer.loads["d-deaf"].cancel
        _wait(first)  # unanswered within D's handshake timeout (2 s)
        assert isinstance(first.exception(), HandshakeError) and d.consumer.cancelling()
        assert "d-deaf" not in d.build_connector_meta(None).fail_recv  # no word of P: the blocks stay
        assert d.consumer.loads["d-deaf"].cancel is first  # not sent again sooner than the retry pause
        p2.server = SideChannelServer(host, port, p2._handle, p2.auth, clock, origin=p2.server.origin)
        clock.t += 1.0
        assert "d-deaf" not in d.build_connector_meta(None).fail_recv
        retry = d.consumer.loads["d-deaf"].cancel
        assert retry is not first
        _wait(retry)
        assert "P confirmed nothing was written" in d.build_connector_meta(None).fail_recv["d-deaf"]
        p_meta = p2.build_connector_meta(None)
        assert "p-deaf" in p_meta.release and not p_meta.push
        p2.update_connector_output(_output(sending={"p-deaf"}))
        d.update_connector_output(_output(recving={"d-deaf"}, failed={"d-deaf"}))
    finally:
        p2.shutdown()


def _second_p(model_dir: Path, engine_id: str, clock):
    """Another producer scheduler beside the fixture's pair (its own side channel), payloads set."""
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    extra = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "bounce_mode": "never"}
    p2 = DSAConnectorScheduler(_config(model_dir, "kv_producer", extra), engine_id,
                               ConnectorOptions.from_config(extra), clock)
    p2.set_local_payloads([_payload(engine_id)])
    return p2


def _until_state(p, req_id: str, state: LeaseState) -> None:
    deadline = time.monotonic() + 10
    while p.producer.lease(req_id).state is not state:
        assert time.monotonic() < deadline, f"{req_id} stayed {p.producer.lease(req_id).state}"
        time.sleep(0.01)


def test_a_request_d_never_scheduled_cancels_p_s_lease(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM finished a D request before it ever asked the connector for it (aborted while it waited), so no
    load was queued: D still cancels P's lease, which P releases at its next step (an early one once its
    prefill is done) instead of keeping it for kv_lease_duration; never a lease another D request takes."""
    from vllm.v1.request import RequestStatus

    p, d, clock = pd
    _know_p(p, d, clock)
    # early registration: P's prefill runs when D's request is aborted
    tid = "abortedbeforeschedule0123456789ab"
    prefill = _request("p-early-gone", 3 * BLOCK, {"do_remote_decode": True, "transfer_id": tid})
    p.update_state_after_alloc(prefill, _blocks(0, [36]), 0)
    early = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": p.server.host,
             "remote_port": p.server.port, "transfer_id": tid, "transfer_mode": "dsa-push"}
    gone = _request("d-early-gone", 3 * BLOCK, dict(early), "FINISHED_ABORTED")
    assert d.request_finished(gone, ([],)) == (False, None)
    _until_state(p, "p-early-gone", LeaseState.CANCELLED)
    assert not p.build_connector_meta(None).release  # vLLM still prefills into the blocks
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    prefill.num_computed_tokens = 3 * BLOCK
    assert p.request_finished(prefill, ([36, 37, 38],))[0]
    meta = p.build_connector_meta(None)
    assert "p-early-gone" in meta.release and not meta.push
    p.update_connector_output(_output(sending={"p-early-gone"}))
    # sequential: P's finished prefill
    params = _prefill(p, "p-gone", BLOCK, [33])
    assert d.request_finished(_request("d-gone", BLOCK, dict(params), "FINISHED_ABORTED"), ([],)) == (False, None)
    _until_state(p, "p-gone", LeaseState.CANCELLED)
    assert "p-gone" in p.build_connector_meta(None).release
    p.update_connector_output(_output(sending={"p-gone"}))
    # another D request takes the lease (n > 1 siblings share the params): its sibling cancels nothing
    params = _prefill(p, "p-kept", BLOCK, [34])
    taker = _request("d-kept", BLOCK, dict(params))
    while d.get_num_new_matched_tokens(taker, 0)[0] is None:
        time.sleep(0.02)
    sent: list = []
    with monkeypatch.context() as m:
        m.setattr(d.consumer, "cancel", lambda *a, **k: sent.append(a))
        sibling = _request("d-kept-sibling", BLOCK, dict(params), "FINISHED_ABORTED")
        assert d.request_finished(sibling, ([],)) == (False, None)
    assert not sent and p.producer.lease("p-kept").state is LeaseState.HELD
    taker.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(taker, ([],)) == (False, None)  # queued: its give-up cancels
    _until_state(p, "p-kept", LeaseState.CANCELLED)
    assert "p-kept" in p.build_connector_meta(None).release
    p.update_connector_output(_output(sending={"p-kept"}))


def test_a_finished_load_sends_p_no_cancel(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A D request whose load ran (and finished) ends without a cancel to P: its lease ended with the WRITE, so
    a cancel would only cost P a side-channel round trip per request."""
    from vllm.v1.request import RequestStatus

    p, d, clock = pd
    _know_p(p, d, clock)
    params = _prefill(p, "p-done", BLOCK, [35])
    req = _request("d-done", BLOCK, dict(params))
    while d.get_num_new_matched_tokens(req, 0)[0] is None:
        time.sleep(0.02)
    assert d.consumer.finished("d-done") is not None  # the workers reported the load
    sent: list = []
    with monkeypatch.context() as m:
        m.setattr(d.consumer, "cancel", lambda *a, **k: sent.append(a))
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert d.request_finished(req, ([],)) == (False, None)
    assert not sent
    p.producer.finished_sending({"p-done"})


@pytest.mark.parametrize(("params", "loads_async"), [
    ({}, False),
    ({"do_remote_decode": True}, False),
    ({**_NIXL_PULL, "remote_engine_id": "nixl-P-async"}, True),
    ({**_ROUTER_NULLS, "remote_engine_id": "P-async-nulls"}, True),
], ids=["none", "prefill-leg", "other-connector", "router-nulls"])
def test_may_load_async_names_the_requests_claimed_async(pd, request, params: dict, loads_async: bool) -> None:
    """vLLM 0.34 asks ``may_load_async`` when a request enters the waiting queues (with
    ``--max-num-inflight-kv-loads`` such requests may start loading while the running batch is full): the
    facade says yes for exactly the requests D's scheduler then claims with ``load_kv_async=True``."""
    from vllm_dsa_connector.connector import DSAConnector

    _, d, _ = pd
    facade = object.__new__(DSAConnector)  # the facade's scheduler half is the D above
    facade._scheduler = d
    req = _request(f"d-may-async-{request.node.callspec.id}", 2 * BLOCK + 3, dict(params))
    assert facade.may_load_async(req) is loads_async
    count, is_async = d.get_num_new_matched_tokens(req, BLOCK)
    assert is_async is loads_async
    if is_async:  # claimed: failed at allocation (unusable params), as the test above
        d.update_state_after_alloc(req, _blocks(1, [90, 91]), count)
        d.build_connector_meta(None)
        d.get_stats()
