"""P's early state is bounded in time, memory and tombstones (issue 43, item 5), with the real :class:`Producer`
(its side-channel handler, called in process) and the real proxy app. Time is an injected clock.

- one D engine cannot hold P's whole early table (a quota by count and by bytes per D engine), nor keep a
  registration alive with a far post deadline (clamped to P's horizon: ``transfer_timeout_s`` + a margin);
- a held registration keeps its blocks compactly and no payloads (those are kept once per D engine);
- the tombstone of a transfer D cancelled before P saw it is not evicted by cancels of unknown ids, so a
  delayed registration P answered "not posted" for is never written; a full tombstone table refuses new holds;
- the proxy refuses early registration in front of a prefill pool.
"""

from __future__ import annotations

import msgspec
import pytest
from conftest import fake_page_table

from vllm_dsa_connector.core.handoff.ids import prompt_digest
from vllm_dsa_connector.core.handoff.leases import LeaseState
from vllm_dsa_connector.core.handoff.messages import (
    CancelReq,
    CancelState,
    Origin,
    RegReq,
    ReqRef,
    transfer_ref,
)
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.settings import POST_DEADLINE_MARGIN_S, HandoffSettings
from vllm_dsa_connector.core.handoff.wire import RankPayload, encode

BLOCK = 16
PROMPT = list(range(100))
DIGEST = prompt_digest(PROMPT)
TIMEOUT_S = 5.0


class Clock:
    """A settable monotonic clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _payloads(engine: str) -> list[bytes]:
    return [encode(RankPayload(engine, 0, 0, 0, f"agent-{engine}", b"", fake_page_table(1 << 19), [], {}))]


def _reg(tid: str, deadline: float, *, d_engine: str = "D", blocks: int = 7, payloads: bool = False) -> RegReq:
    ref = transfer_ref(tid)
    return RegReq(ref.p_req, ref.token, d_engine, f"d-{tid}", 0, 100, list(range(40, 40 + blocks)), deadline,
                  prompt_tokens=100, prompt_digest=DIGEST, d_payloads=_payloads(d_engine) if payloads else None)


def _tid(i: int) -> str:
    return f"{i:032x}"


def _producer(**kw) -> tuple[Producer, Clock]:
    clock = Clock()
    return Producer("P", HandoffSettings(lease_s=10.0, transfer_timeout_s=TIMEOUT_S, **kw), clock,
                    block_size=BLOCK), clock


def _hold(p: Producer, clock: Clock, tid: str, d_engine: str = "D", **kw):
    first = d_engine not in p._peers
    return p.handle_reg(_reg(tid, clock.t + TIMEOUT_S, d_engine=d_engine, payloads=first, **kw),
                        Origin(d_engine, 7))


def test_one_d_cannot_hold_the_whole_early_table() -> None:
    """With the default settings one D engine holds at most 1024 early registrations; another D still gets its
    own held. (Before: one D could take all 4096 and every other D's early registration was refused.)"""
    p, clock = _producer()
    for i in range(1024):
        assert _hold(p, clock, _tid(i)).ok
    refused = _hold(p, clock, _tid(5000))
    assert not refused.ok and "early_held_per_peer 1024" in refused.error, refused
    assert _hold(p, clock, _tid(6000), d_engine="D2").ok
    assert p.held() == 1025


def test_the_byte_quota_refuses_a_d_whose_held_blocks_pass_it() -> None:
    """Each held registration counts its blocks (4 B each, compactly stored) against its engine's byte quota."""
    p, clock = _producer(early_held_bytes_per_peer=1 << 20)
    n = 0
    while (reply := _hold(p, clock, _tid(n), blocks=50_000)).ok:
        n += 1
    assert n == 5 and "early_held_bytes_per_peer 1048576" in reply.error, (n, reply)
    held = p._held._held[_tid(0)]
    assert held.blocks.itemsize == 4 and len(held.blocks) == 50_000 and held.reg.d_payloads is None
    assert _hold(p, clock, _tid(99), d_engine="D2", blocks=50_000).ok  # another D is not held to D's bytes


def test_a_far_post_deadline_is_clamped_to_ps_horizon() -> None:
    """A registration stating a post deadline 10^9 s away is held only until P's horizon (transfer_timeout_s +
    the margin) and never written after it: a request P sees later is not served by it."""
    p, clock = _producer()
    start = clock.t
    assert p.handle_reg(_reg(_tid(1), start + 1e9, payloads=True), Origin("D", 7)).ok
    clock.t = start + TIMEOUT_S + POST_DEADLINE_MARGIN_S + 0.001
    p.step()
    p.add_early("p1", _tid(1), [5, 6, 7, 8, 9, 10, 11], prompt_tokens=100, digest=DIGEST)
    assert p.lease("p1").state is LeaseState.CANCELLED  # the expired registration was not attached
    p.finish_early("p1", [5, 6, 7, 8, 9, 10, 11], ok=True)
    d = p.step()
    assert not d.push and d.release == ["p1"] and p.held() == 0
    # a registered lease's deadline is clamped the same way
    token = p.add_lease("p2", [1, 2, 3, 4, 5, 6, 7], prompt_tokens=100)
    assert p.handle_reg(RegReq("p2", token, "D", "d2", 0, 100, list(range(7)), clock.t + 1e9), Origin("D", 7)).ok
    assert p.lease("p2").reg.post_deadline == pytest.approx(clock.t + TIMEOUT_S + POST_DEADLINE_MARGIN_S)


def test_cancels_of_unknown_ids_do_not_evict_a_tombstone_and_the_delayed_registration_is_never_written() -> None:
    """D registers transfer T (the message is delayed), gives up, cancels T: P has not seen T and answers
    "not posted", so D frees its blocks. Then D (or anyone) cancels 65,537 unknown ids, more than P's old shared
    tombstone FIFO held. The delayed registration of T arrives: it is refused, and the prefill P runs for T
    later writes nothing. Once T's tombstone has aged out, the same registration is past its own deadline."""
    p, clock = _producer()
    sent_at = clock.t
    delayed = _reg(_tid(1), sent_at + TIMEOUT_S, payloads=True)
    reply = p.handle_cancel(CancelReq([transfer_ref(_tid(1))]))
    assert reply.states[transfer_ref(_tid(1)).p_req] == CancelState.NOT_POSTED
    unknown = list(range(2, 2 + 65_537))
    for i in range(0, len(unknown), 4096):
        p.handle_cancel(CancelReq([transfer_ref(_tid(j)) for j in unknown[i:i + 4096]][:4096]))
    for i in range(0, 20_000, 4096):  # and unknown P request ids
        p.handle_cancel(CancelReq([ReqRef(f"p-{j}", "t") for j in range(i, i + 4096)]))
    clock.t += 1.0
    refused = p.handle_reg(delayed, Origin("D", 7))
    assert not refused.ok and "ended" in refused.error, refused
    p.add_early("p1", _tid(1), [5, 6, 7, 8, 9, 10, 11], prompt_tokens=100, digest=DIGEST)
    p.finish_early("p1", [5, 6, 7, 8, 9, 10, 11], ok=True)
    d = p.step()
    assert not d.push and d.release == ["p1"]  # cancelled before P saw it: released, never written
    # after the tombstone's time the delayed registration is past its own deadline
    clock.t = sent_at + TIMEOUT_S + POST_DEADLINE_MARGIN_S + 1
    p.step()
    late = p.handle_reg(delayed, Origin("D", 7))
    assert not late.ok, late


def test_a_full_tombstone_table_refuses_new_holds_and_promises_nothing() -> None:
    """When P cannot remember another cancelled transfer it evicts nothing: a new early registration is refused
    and a cancel of an unknown transfer is answered "posted" (D keeps its blocks until its write bound)."""
    p, clock = _producer()
    p._unseen.limit = 3
    p.handle_cancel(CancelReq([transfer_ref(_tid(i)) for i in range(3)]))
    answer = p.handle_cancel(CancelReq([transfer_ref(_tid(9))])).states[transfer_ref(_tid(9)).p_req]
    assert answer == CancelState.POSTED
    refused = _hold(p, clock, _tid(10))
    assert not refused.ok and "refusing early registrations" in refused.error
    assert not p.handle_reg(_reg(_tid(0), clock.t + TIMEOUT_S), Origin("D", 7)).ok  # still tombstoned
    clock.t += TIMEOUT_S + POST_DEADLINE_MARGIN_S + 0.1  # they age out: holds are accepted again
    assert _hold(p, clock, _tid(10)).ok


def test_the_proxy_refuses_early_registration_in_front_of_a_prefill_pool(capsys) -> None:
    from vllm_dsa_connector.proxy import app as pd_proxy

    with pytest.raises(ValueError, match="exactly one prefill engine behind http://lb:8100.*--prefill-pool"):
        pd_proxy.make_app("http://lb:8100", "http://d:8200", early_registration=True, prefill_pool=True)
    pd_proxy.make_app("http://lb:8100", "http://d:8200", prefill_pool=True)  # sequential mode serves a pool
    with pytest.raises(SystemExit) as e:
        pd_proxy.main(["--prefill", "http://lb:8100", "--decode", "http://d:8200", "--prefill-pool",
                       "--early-registration"])
    assert e.value.code == 2 and "one proxy per prefill engine" in capsys.readouterr().err


def test_d_states_no_post_deadline_past_ps_horizon() -> None:
    """A D whose own transfer_timeout_s is far longer than P's (100 s against 5 s) states a post deadline inside
    P's horizon (P's write timeout + the margin), so the tombstone P keeps for a cancel outlives every copy of
    its registration; D itself still waits its own budget. Real Consumer and Producer over a real side channel."""
    import time

    from vllm_dsa_connector.core.handoff.consumer import Consumer
    from vllm_dsa_connector.core.handoff.messages import Authenticator
    from vllm_dsa_connector.core.handoff.params import RemoteParams
    from vllm_dsa_connector.core.handoff.side_channel import SideChannelServer

    class _Plan:
        def senders_for(self, rank: int) -> tuple[int, ...]:
            return (0,)

    prod = Producer("P", HandoffSettings(lease_s=30.0, transfer_timeout_s=TIMEOUT_S), block_size=BLOCK)
    server = SideChannelServer("127.0.0.1", 0, lambda req, sender: prod.handle(req, _payloads("P"), sender),
                               origin=Origin("P", 5))
    d_payload = RankPayload("D", 0, 0, 0, "agent-D", b"", fake_page_table(512, block_size=BLOCK), [], {})
    d = Consumer("D", HandoffSettings(transfer_timeout_s=100.0, handshake_timeout_s=2.0), Authenticator(None),
                 lambda: [d_payload], lambda: [encode(d_payload)], check_peer=lambda src, dst: _Plan())
    try:
        peer = d.peer("P", "127.0.0.1", server.port)
        deadline = time.monotonic() + 10
        while not (peer.future is None or peer.future.done()):
            assert time.monotonic() < deadline, "handshake did not finish"
            time.sleep(0.01)
        peer = d.peer("P", "127.0.0.1", server.port)
        token = prod.add_lease("p-1", [1, 2], prompt_tokens=2 * BLOCK)
        rp = RemoteParams("P", "p-1", "127.0.0.1", server.port, [1, 2], 2 * BLOCK, token)
        d.queue("d-1", rp)
        before = time.monotonic()
        d.register("d-1", rp, peer, 0, 2 * BLOCK, [1, 2], [40, 41], {}, [])
        load = d.loads["d-1"]
        assert load.reg_body.post_deadline <= before + TIMEOUT_S + POST_DEADLINE_MARGIN_S + 1.0  # P's clock
        assert load.give_up_at >= before + 100.0  # D's own budget is unchanged
    finally:
        d.shutdown()
        server.close()


def test_held_registrations_and_refused_identities_reach_prometheus(tiny_mla_dir) -> None:
    """P's scheduler reports the held early registrations as a gauge (a sample when it changed) and the refused
    identities as a counter; vLLM's Prometheus hook exports them as ``vllm:dsa_kv_early_held`` and
    ``vllm:dsa_kv_refused_identities_total``. A real P scheduler (its real side channel) on a tiny model."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    import vllm.plugins
    from prometheus_client import CollectorRegistry

    from tests.test_connector_scheduler import _config
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.scheduler import DSAConnectorScheduler
    from vllm_dsa_connector.connector.stats import DSAPromMetrics
    from vllm_dsa_connector.core.handoff.messages import MessageError

    vllm.plugins.load_general_plugins()
    extra = {"transfer_timeout_s": TIMEOUT_S, "bounce_mode": "never"}
    sched = DSAConnectorScheduler(_config(tiny_mla_dir, "kv_producer", extra), "P-metrics",
                                  ConnectorOptions.from_config(extra, environ={}))
    try:
        p, now = sched.producer, sched.producer.clock()
        assert sched.get_stats() is None  # nothing held, nothing refused: no sample
        for i in range(3):
            assert p.handle_reg(_reg(_tid(i), now + TIMEOUT_S, payloads=i == 0), Origin("D", 7)).ok
        other = [encode(RankPayload("D2", 0, 0, 0, "agent-D", b"", fake_page_table(1 << 19), [], {}))]
        with pytest.raises(MessageError, match="bound to D engine 'D'"):
            p.handle_reg(msgspec.structs.replace(_reg(_tid(9), now + TIMEOUT_S, d_engine="D2"), d_payloads=other),
                         Origin("D2", 8))
        stats = sched.get_stats()
        assert stats is not None and stats.data["early_held"] == [3] and stats.data["refused_identities"] == 1
        registry = CollectorRegistry()
        types = {cls: partial(cls, registry=registry) for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                                                                prometheus_client.Histogram)}
        prom = DSAPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
        prom.observe(stats.data, 0)
        assert registry.get_sample_value("vllm:dsa_kv_early_held", {"engine": "0"}) == 3
        assert registry.get_sample_value("vllm:dsa_kv_refused_identities_total", {"engine": "0"}) == 1
        assert sched.get_stats() is None  # unchanged: no new sample
    finally:
        sched.shutdown()
