"""Nothing grows without bound (issue 29, item 8), with the real classes: a P and a D
``DSAConnectorScheduler`` over real side channels (ZMQ on localhost, real page tables, the real handshake
check), D's real ``StagingSlots``, a real ``Receiver`` on a real NIXL agent. Time is an injected clock.

- a peer no request used for ``peer_idle_s`` is forgotten on both sides (D's control thread stops, the
  workers are told to drop it) and the next request handshakes again (P re-learns D's payloads);
- a failed load's staging slot comes back once no WRITE can land in it, and not a step before;
- early notices are capped per request key and per sending agent: a flood fails its load, nothing grows.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tests.test_connector_scheduler import BLOCK, Clock, _config, _load, _output, _prefill, _wait
from vllm_dsa_connector.core.handoff.messages import ReqRef

IDLE_S = 60.0


def _control_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("dsa-control") and t.is_alive())


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _payload(engine: str, table, arena: int) -> bytes:
    from vllm_dsa_connector.core.handoff.wire import RankPayload, encode
    from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc

    staging = RegionDesc(f"agent-{engine}", 0, arena, "DRAM") if arena else None
    return encode(RankPayload(engine, table.rank, table.pp_rank, table.tp_rank, f"agent-{engine}", b"",
                              table, [], {"model_dtype": "f32"}, staging=staging))


@pytest.fixture(scope="module")
def pd(tiny_mla_dir: Path):
    """A P and a D scheduler (real side channels, real page tables of one layout) on one injected clock; D
    bounces every transfer into its staging slots."""
    import vllm.plugins
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import build_offline
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler

    vllm.plugins.load_general_plugins()
    clock = Clock()
    base = {"kv_lease_duration": 10.0, "transfer_timeout_s": 5.0, "peer_setup_timeout_s": 0.0, "handshake_timeout_s": 2.0,
            "heartbeat_interval_s": 1.0, "peer_idle_s": IDLE_S}
    p_extra, d_extra = {**base, "bounce_mode": "never"}, {**base, "bounce_mode": "always"}
    p = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_producer", p_extra), "P-gc",
                              ConnectorOptions.from_config(p_extra), clock)
    d = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_consumer", d_extra), "D-gc",
                              ConnectorOptions.from_config(d_extra), clock)
    (table,) = build_offline(glm_dsa_config(6), num_blocks=64, block_size=BLOCK)
    p.set_local_payloads([_payload("P-gc", table, 0)])
    d.set_local_payloads([_payload("D-gc", table, 8 * table.bytes_per_block)])
    clock.t = time.monotonic()
    yield p, d, clock
    p.shutdown()
    d.shutdown()


def _register(p, d, clock, name: str, src: list[int], dst: list[int]):
    params = _prefill(p, f"p-{name}", 2 * BLOCK, src)
    _load(d, clock, f"d-{name}", params, 2 * BLOCK, 0, dst)
    meta = d.build_connector_meta(None)
    _wait(d.consumer.loads[f"d-{name}"].reg)
    d.build_connector_meta(None)
    return meta


def test_an_idle_peer_is_forgotten_on_both_sides_and_handshakes_again(pd) -> None:
    from vllm_dsa_connector.core.handoff.loads import LoadState
    from vllm_dsa_connector.core.handoff.params import RemoteParams

    p, d, clock = pd
    before = _control_threads()
    meta = _register(p, d, clock, "gc1", [1, 2], [10, 11])
    assert [(i.engine_id, i.as_source) for i in meta.peers] == [("P-gc", True)]
    pm = p.build_connector_meta(None)
    assert [i.engine_id for i in pm.peers] == ["D-gc"] and [j.req_id for j in pm.push] == ["p-gc1"]
    _wait(d.consumer.cancel("P-gc", [ReqRef("unrelated", "t")]))  # the peer's control thread runs
    assert _control_threads() == before + 1
    p.update_connector_output(_output(sending={"p-gc1"}))
    d.update_connector_output(_output(recving={"d-gc1"}))

    # a request still queued on D keeps its peer, however long it waits; P's D record has no lease naming it
    params = _prefill(p, "p-gcq", BLOCK, [3])
    d.consumer.queue("d-gcq", RemoteParams.from_dict(params))  # waiting for blocks
    assert d.consumer.loads["d-gcq"].state is LoadState.QUEUED
    clock.t += IDLE_S - 1
    assert not d.build_connector_meta(None).forget_sources and not p.build_connector_meta(None).forget
    clock.t += 2
    assert d.build_connector_meta(None).forget_sources == [] and "P-gc" in d.consumer.peers  # the queued load
    assert p.build_connector_meta(None).forget == ["D-gc"] and "D-gc" not in p.producer._peers
    d.consumer.forget_queued("d-gcq")
    _wait_for(lambda: all(f.done() for _, _, f in d.consumer._heartbeats), "heartbeats unanswered")
    d.build_connector_meta(None)  # collects them
    clock.t += IDLE_S + 1
    assert d.build_connector_meta(None).forget_sources == ["P-gc"]  # the workers drop P's plan
    assert "P-gc" not in d.consumer.peers
    _wait_for(lambda: _control_threads() == before, "the idle peer's control thread did not stop")

    # the next request handshakes again; P answers need_payloads and learns D again
    meta = _register(p, d, clock, "gc2", [4, 5], [12, 13])
    assert [(i.engine_id, i.as_source) for i in meta.peers] == [("P-gc", True)]
    assert d.consumer.peers["P-gc"].attempt == 1 and "D-gc" in p.producer._peers
    pm = p.build_connector_meta(None)
    assert [i.engine_id for i in pm.peers] == ["D-gc"] and [j.req_id for j in pm.push] == ["p-gc2"]
    p.update_connector_output(_output(sending={"p-gc2"}))
    d.update_connector_output(_output(recving={"d-gc2"}))


def test_a_failed_loads_slot_returns_after_the_write_bound_and_not_before(pd) -> None:
    p, d, clock = pd
    meta = _register(p, d, clock, "sl1", [6, 7], [14, 15])
    (job,) = meta.recv
    assert job.routes, "D planned no staging slot"
    (arena,) = d.routes._arenas.values()
    assert arena.free_bytes < arena.size
    (push,) = p.build_connector_meta(None).push  # dispatched: a WRITE may be in flight
    assert push.routes == job.routes
    release_at = d.consumer.loads["d-sl1"].release_at
    # the workers report the load failed before the scheduler gave up (e.g. a writer's failure notice)
    d.update_connector_output(_output(recving={"d-sl1"}, failed={"d-sl1"}))
    assert arena.quarantined_bytes > 0
    clock.t = release_at - 0.01
    d.build_connector_meta(None)
    assert arena.quarantined_bytes > 0 and arena.free_bytes < arena.size  # a WRITE may still land
    clock.t = release_at
    d.build_connector_meta(None)
    assert arena.quarantined_bytes == 0 and arena.free_bytes == arena.size
    p.update_connector_output(_output(sending={"p-sl1"}))

    # P confirms nothing was posted: the slot comes back at once, long before the write bound
    _register(p, d, clock, "sl2", [8, 9], [16, 17])
    assert arena.free_bytes < arena.size
    clock.t += 5.1  # D's transfer timeout: it gives up and cancels before P's engine stepped
    d.build_connector_meta(None)
    _wait(d.consumer.loads["d-sl2"].cancel)
    assert "P confirmed nothing was written" in d.build_connector_meta(None).fail_recv["d-sl2"]
    d.update_connector_output(_output(recving={"d-sl2"}, failed={"d-sl2"}))
    d.build_connector_meta(None)
    assert arena.quarantined_bytes == 0 and arena.free_bytes == arena.size
    assert "p-sl2" in p.build_connector_meta(None).release
    p.update_connector_output(_output(sending={"p-sl2"}))


def test_early_notices_are_capped_per_key_and_per_agent(caplog) -> None:
    from vllm_dsa_connector.core.transfer.nixl.engine import NixlEngine
    from vllm_dsa_connector.core.transfer.notices import encode_notif
    from vllm_dsa_connector.core.transfer.receiver import Receiver
    from vllm_dsa_connector.core.transfer.receiver_data import RecvState, WriterSpec

    eng = NixlEngine(f"unit-early-{time.monotonic_ns()}")
    try:
        rcv = Receiver(eng, early_per_key=4, early_per_peer=6)
        for _ in range(4):
            rcv.handle("p0", encode_notif("direct", 0, b"flood"))
        assert len(rcv.early.kept[b"flood"]) == 4
        with caplog.at_level(logging.WARNING, logger="vllm_dsa_connector.core.transfer.receiver"):
            for _ in range(1000):  # one request's flood: dropped whole, warned once, nothing kept
                rcv.handle("p0", encode_notif("direct", 0, b"flood"))
        assert b"flood" not in rcv.early.kept and not rcv.early.by_peer
        assert sum("early_per_key" in r.getMessage() for r in caplog.records) == 1
        rcv.handle("p0", encode_notif("direct", 0, b"fine"))
        rcv.arm(b"flood", {0: WriterSpec(peer="p0")})
        rcv.arm(b"fine", {0: WriterSpec(peer="p0")})
        got = {r.key: r for r in rcv.collect()}
        assert got[b"flood"].state is RecvState.FAILED and "early_per_key" in got[b"flood"].reason
        assert got[b"fine"].state is RecvState.DONE

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm_dsa_connector.core.transfer.receiver"):
            for i in range(50):  # one agent, many keys: 6 kept in all, the cap warned once
                rcv.handle("p1", encode_notif("direct", 0, f"k{i}".encode()))
        assert sum(len(v) for v in rcv.early.kept.values()) == 6 and rcv.early.by_peer["p1"][0] == 6
        assert sum("early_per_peer" in r.getMessage() for r in caplog.records) == 1
        rcv.handle("p2", encode_notif("direct", 0, b"other"))  # another agent is not held back
        assert b"other" in rcv.early.kept
        rcv.arm(b"k0", {0: WriterSpec(peer="p1")})  # armed: its notice leaves the early ones
        assert rcv.early.by_peer["p1"][0] == 5 and [r.state for r in rcv.collect()] == [RecvState.DONE]
    finally:
        eng.close()
