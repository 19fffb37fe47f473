"""The engine never waits on a peer (issue 44 items 1 and 2), in one process: real P and D
:class:`~vllm_dsa_connector.connector.worker.DSAConnectorWorker` over vLLM-allocated KV caches, two real NIXL
agents on UCX.

- Learning a destination loads its NIXL remote agent on the worker's set-up thread: ``start_load_kv`` returns
  at once and the worker lock stays free while NIXL's ``add_remote_agent`` is slow (made slow by wrapping
  P's own NIXL agent: a slow set-up, e.g. a loaded host, cannot be caused on demand otherwise); the push waits
  (counted) and lands once the set-up is over, driven by nothing but the workers' own threads.
- A held push still waiting at its post deadline is failed as late, while the set-up still runs.
- A reconnect (the connection to a known destination was lost: NIXL dropped its remote agent, or it was closed)
  runs on the same set-up thread: ``start_load_kv`` returns at once and the worker lock stays free while the
  reconnect's ``add_remote_agent`` is slow; the push waits and lands on the new connection (counted once).
- ``start_load_kv`` never polls a WRITE it posted (the 50 ms spin is gone): P's progress thread completes it
  and the request is reported ``finished_sending``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.test_connector_notices import DST_BLOCKS, SRC_BLOCKS, _arm, _worker


@pytest.fixture
def pd():
    p, _ = _worker("P-setup", "kv_producer")
    d, _ = _worker("D-setup", "kv_consumer")
    yield p, d
    p.shutdown()
    d.shutdown()


def _slow_add(p: Any, monkeypatch: Any, seconds: float) -> threading.Event:
    """P's NIXL ``add_remote_agent`` takes ``seconds`` (the fault); the event is set once it started."""
    agent = p.nixl._agent
    real = agent.add_remote_agent
    started = threading.Event()

    def slow(meta: bytes) -> Any:
        started.set()
        time.sleep(seconds)
        return real(meta)

    monkeypatch.setattr(agent, "add_remote_agent", slow)
    return started


def _received(d: Any, req_id: str, timeout_s: float) -> tuple[set[str], set[str]]:
    """D's own steps only (P is driven by its threads): (finished_recving, failed_recving) once ``req_id`` is."""
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    failed: set[str] = set()
    while req_id not in done:
        _, r, f = d.get_transfer_results()
        done, failed = done | r, failed | f
        assert time.monotonic() < deadline, f"{req_id} never reached D"
        time.sleep(0.005)
    return done, failed


def _sent(p: Any, req_id: str, timeout_s: float) -> float:
    """Call P's get_transfer_results until ``req_id`` is finished_sending; when (monotonic) it was."""
    deadline = time.monotonic() + timeout_s
    while req_id not in p.get_transfer_results()[0]:
        assert time.monotonic() < deadline, f"{req_id} was never reported finished_sending"
        time.sleep(0.005)
    return time.monotonic()


def test_a_slow_peer_set_up_never_blocks_the_step_and_its_push_lands_after(pd, monkeypatch) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    started = _slow_add(p, monkeypatch, 2.0)
    _arm(p, d, "d-slow")
    push = PushJob("p-slow", d.engine_id, "d-slow", SRC_BLOCKS, DST_BLOCKS, verify=True)
    t0 = time.perf_counter()
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])], push=[push]))
    took = time.perf_counter() - t0
    assert took < 0.5, f"start_load_kv waited {took:.2f} s on the peer's set-up"
    assert started.wait(5), "the set-up never started"
    # the set-up runs now: the worker lock (which the steps and D's receiver thread take) is free
    t0 = time.perf_counter()
    assert p._lock.acquire(timeout=1.0), "the worker lock is held during the peer's set-up"
    p._lock.release()
    p.get_transfer_results()  # a step meanwhile: nothing to report, no wait
    assert time.perf_counter() - t0 < 0.5
    assert p.stats.data["setup_waits"] == 1 and p.stats.data["send_bytes"] == 0
    assert not p.remotes[d.engine_id].ready
    _, failed = _received(d, "d-slow", 20.0)
    assert not failed and not d.get_block_ids_with_load_errors() and d.stats.data["checksummed_runs"] > 0
    _sent(p, "p-slow", 10.0)
    assert p.stats.data["send_ok"] == 1 and p.stats.data["send_failed"] == 0


@pytest.mark.parametrize("lost", ["dropped by NIXL", "closed"])
def test_a_slow_reconnect_never_blocks_the_step_and_its_push_lands_after(pd, monkeypatch, lost) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    _arm(p, d, "d-first")
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])],
                                         push=[PushJob("p-first", d.engine_id, "d-first", SRC_BLOCKS, DST_BLOCKS,
                                                               verify=True)]))
    assert not _received(d, "d-first", 20.0)[1]
    _sent(p, "p-first", 10.0)
    agent = p.remotes[d.engine_id].agents[0]
    with p._lock:  # the connection is lost (the fault): NIXL dropped the remote agent, or a fence closed it
        if lost == "closed":
            p.nixl.close_connection(agent, "fence not confirmed (test)")
        else:
            p.nixl._agent.remove_remote_agent(agent)  # what NIXL does itself after a remote disconnect
    started = _slow_add(p, monkeypatch, 2.0)
    _arm(p, d, "d-re")
    t0 = time.perf_counter()
    p.start_load_kv(DSAConnectorMetadata(push=[PushJob("p-re", d.engine_id, "d-re", SRC_BLOCKS, DST_BLOCKS,
                                                       verify=True)]))
    took = time.perf_counter() - t0
    assert took < 0.5, f"start_load_kv waited {took:.2f} s on the peer's reconnect"
    assert started.wait(5), "the reconnect never started"
    t0 = time.perf_counter()
    assert p._lock.acquire(timeout=1.0), "the worker lock is held during the peer's reconnect"
    p._lock.release()
    p.get_transfer_results()  # a step meanwhile: no wait
    assert time.perf_counter() - t0 < 0.5
    assert p.stats.data["setup_waits"] >= 1 and p.stats.data.get("peer_reconnects", 0) == 0
    _, failed = _received(d, "d-re", 20.0)
    assert not failed and not d.get_block_ids_with_load_errors() and d.stats.data["checksummed_runs"] > 0
    _sent(p, "p-re", 10.0)
    assert p.stats.data["peer_reconnects"] == 1 and p.nixl.reconnects == 1 and not p.nixl.disconnected(agent)
    assert p.stats.data["send_ok"] == 2 and p.stats.data["send_failed"] == 0


def test_a_push_still_waiting_for_set_up_at_its_post_deadline_fails_as_late(pd, monkeypatch) -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    _slow_add(p, monkeypatch, 4.0)
    deadline = time.monotonic() + 0.5
    push = PushJob("p-late", d.engine_id, "d-late", SRC_BLOCKS, DST_BLOCKS, post_deadline=deadline)
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])], push=[push]))
    when = _sent(p, "p-late", 10.0)
    assert when - deadline < 1.5, f"reported {when - deadline:.2f} s after its deadline (the set-up blocked it)"
    assert p.stats.data["send_late"] == 1 and p.stats.data["send_bytes"] == 0  # never written
    assert p.setup.pending == 1  # the set-up was still running
    assert p.setup.wait_idle(10) and p.remotes[d.engine_id].ready


def test_start_load_kv_never_polls_the_write_it_posted(pd, monkeypatch) -> None:
    """Before: ``start_load_kv`` polled a just-posted WRITE for up to 50 ms before the forward. Now P's progress
    thread completes it: this thread (the engine's step) polls nothing, D gets the request, P reports it."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode
    from vllm_dsa_connector.core.worker.sending import SendSide

    p, d = pd
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])]))
    assert p.setup.wait_idle(10)
    step = threading.current_thread()
    polls: list[bool] = []
    real_poll = SendSide.poll
    monkeypatch.setattr(SendSide, "poll", lambda self: (polls.append(threading.current_thread() is step),
                                                        real_poll(self))[1])
    _arm(p, d, "d-nospin")
    p.start_load_kv(DSAConnectorMetadata(push=[PushJob("p-nospin", d.engine_id, "d-nospin", SRC_BLOCKS,
                                                       DST_BLOCKS, verify=True)]))
    assert not any(polls), f"start_load_kv polled the WRITE it posted {sum(polls)} times before the forward"
    _, failed = _received(d, "d-nospin", 20.0)  # only D's steps and P's own threads run meanwhile
    assert not failed and not d.get_block_ids_with_load_errors()
    assert any(not on_step for on_step in polls), "nothing but the step polled the WRITE"
    _sent(p, "p-nospin", 10.0)


def test_ucx_fail_fast_knobs_are_set_unless_the_environment_sets_them(pd) -> None:
    """A dead peer fails fast: the agent set UCX's TCP connect and keepalive knobs before UCX read its
    configuration (the workers above made real agents), and a value the environment gives wins."""
    import os

    from vllm_dsa_connector.core.transfer.nixl.agent import UCX_FAIL_FAST, ucx_fail_fast_defaults

    assert all(os.environ.get(k) for k in UCX_FAIL_FAST)  # set in this process by the agents made above
    env = {"UCX_TCP_SYN_CNT": "6"}
    added = ucx_fail_fast_defaults(env)
    assert env["UCX_TCP_SYN_CNT"] == "6" and "UCX_TCP_SYN_CNT" not in added
    assert env["UCX_TCP_KEEPIDLE"] == UCX_FAIL_FAST["UCX_TCP_KEEPIDLE"] and set(added) == set(UCX_FAIL_FAST) - {
        "UCX_TCP_SYN_CNT"}


def test_a_failure_notice_met_by_a_reconnect_is_sent_after_it(pd, monkeypatch) -> None:
    """A failure notice (e.g. of a WRITE that failed because its connection was lost) that finds the
    connection being made again is kept and sent once the set-up thread reconnected: D keeps a given-up load's
    blocks until every writer's notice, so a dropped notice would cost D those blocks until its fence timeout."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PeerInfo, PushJob, encode

    p, d = pd
    _arm(p, d, "d-first")
    p.start_load_kv(DSAConnectorMetadata(local=PeerInfo(p.engine_id, [encode(p.payload)]),
                                         peers=[PeerInfo(d.engine_id, [encode(d.payload)])],
                                         push=[PushJob("p-first", d.engine_id, "d-first", SRC_BLOCKS, DST_BLOCKS,
                                                               verify=True)]))
    assert not _received(d, "d-first", 20.0)[1]
    _sent(p, "p-first", 10.0)
    agent = p.remotes[d.engine_id].agents[0]
    started = _slow_add(p, monkeypatch, 1.0)
    _arm(p, d, "d-err")
    with p._lock:  # the connection is lost as the failure notice goes out (the fault)
        p.nixl.close_connection(agent, "lost (test)")
        p.send._notify_failure(agent, "d-err", "the WRITE failed (test)")
    assert started.wait(5), "the reconnect never started"
    _, failed = _received(d, "d-err", 20.0)
    assert failed == {"d-err"}
    assert p.stats.data["peer_reconnects"] == 1 and not p.nixl.disconnected(agent)
