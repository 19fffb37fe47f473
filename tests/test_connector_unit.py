"""Fast DSAConnector tests: registration by name, options, stats, wire formats, side channel timeouts."""

from __future__ import annotations

import time

import pytest
from conftest import fake_page_table


def test_factory_resolves_dsaconnector_by_name() -> None:
    import vllm.plugins
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

    vllm.plugins.load_general_plugins()
    cfg = KVTransferConfig(kv_connector="DSAConnector", kv_role="kv_both")  # no kv_connector_module_path
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls.__name__ == "DSAConnector" and cls.__module__.startswith("vllm_dsa_connector.connector")
    assert issubclass(cls, KVConnectorBase_V1) and supports_hma(cls)
    stats = cls.build_kv_connector_stats({"send_bytes": 10, "transfer_s": [0.5]})
    assert stats.reduce()["send_bytes"] == 10


def test_options_validated_at_startup() -> None:
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.options import OptionError

    opts = ConnectorOptions.from_config({"verify_transfers": "true", "kv_lease_duration": 12,
                                         "bounce_min_runs": 4}, environ={})
    assert opts.verify_transfers is True and opts.kv_lease_duration == 12.0
    assert abs(opts.heartbeat_s - 2.0) < 1e-9
    with pytest.raises(OptionError, match="verify_transfer"):
        ConnectorOptions.from_config({"verify_transfer": True}, environ={})  # typo: refused, named
    with pytest.raises(OptionError, match="transfer_timeout_s"):
        ConnectorOptions.from_config({"transfer_timeout_s": -1}, environ={})
    with pytest.raises(OptionError, match="bounce_min_runs"):
        ConnectorOptions.from_config({"bounce_min_runs": 0}, environ={})  # the gate's keys are checked too
    env = ConnectorOptions.from_config({}, environ={"VLLM_DSA_VERIFY_TRANSFERS": "1"})
    assert env.verify_transfers is True
    assert ConnectorOptions.from_config({"verify_transfers": False},
                                        environ={"VLLM_DSA_VERIFY_TRANSFERS": "1"}).verify_transfers is False


def test_admission_keys_accepted() -> None:
    from vllm_dsa_connector.connector.options import known_keys

    try:
        from vllm_dsa_connector.admission import ADMISSION_OPTION_KEYS
    except ImportError:
        pytest.skip("admission module absent")
    assert set(ADMISSION_OPTION_KEYS) <= known_keys()


def test_stats_aggregate_across_workers() -> None:
    from vllm_dsa_connector.connector.stats import DSAKVConnectorStats

    a, b = DSAKVConnectorStats(), DSAKVConnectorStats()
    assert a.is_empty()
    a.add("send_bytes", 100)
    a.add("bounce_bytes", 25)
    a.observe("transfer_s", 0.002)
    b.add("send_bytes", 300)
    b.observe("transfer_s", 0.004)
    b.add("checksum_mismatches")
    out = a.aggregate(b).reduce()
    assert out["send_bytes"] == 400 and out["num_transfers"] == 2 and out["checksum_mismatches"] == 1
    assert out["avg_transfer_ms"] == 3.0 and out["bounce_share"] == round(25 / 400, 3)
    snap = a.clone_and_reset()
    assert a.is_empty() and not snap.is_empty()


def test_unusable_params_are_exported_by_reason() -> None:
    """``vllm:dsa_kv_unusable_params_total{reason}``: the scheduler's counts (aggregated with the workers'
    by vLLM) reach Prometheus under a fixed set of reasons; an unknown reason is a bug, never a new label."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    from prometheus_client import CollectorRegistry

    from vllm_dsa_connector.connector.stats import DSAKVConnectorStats, DSAPromMetrics, unusable_key

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                                                            prometheus_client.Histogram)}
    prom = DSAPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    scheduler, worker = DSAKVConnectorStats(), DSAKVConnectorStats()
    scheduler.add(unusable_key("malformed"), 2)
    scheduler.add(unusable_key("other_connector"))
    worker.add("recv_failed", 3)
    data = worker.aggregate(scheduler).data
    assert DSAKVConnectorStats(data=dict(data)).reduce()["unusable_malformed"] == 2
    prom.observe(data, 0)
    for reason, count in (("malformed", 2), ("other_connector", 1)):
        labels = {"engine": "0", "reason": reason}
        assert registry.get_sample_value("vllm:dsa_kv_unusable_params_total", labels) == count
    assert registry.get_sample_value("vllm:dsa_kv_requests_total",
                                     {"engine": "0", "side": "recv", "outcome": "failed"}) == 3
    with pytest.raises(ValueError, match="expected one of"):
        unusable_key("nulls")


def test_peer_reconnects_are_counted_and_exported() -> None:
    """``peer_reconnects`` (a worker's NIXL engine re-added a remote agent after a lost connection) sums over
    workers, shows in the log summary and reaches ``vllm:dsa_kv_peer_reconnects_total``."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    from prometheus_client import CollectorRegistry

    from vllm_dsa_connector.connector.stats import DSAKVConnectorStats, DSAPromMetrics

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                                                            prometheus_client.Histogram)}
    prom = DSAPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    a, b = DSAKVConnectorStats(), DSAKVConnectorStats()
    a.add("peer_reconnects")
    assert not a.is_empty()
    b.add("peer_reconnects", 2)
    data = a.aggregate(b).data
    assert DSAKVConnectorStats(data=dict(data)).reduce()["peer_reconnects"] == 3
    prom.observe(data, 0)
    assert registry.get_sample_value("vllm:dsa_kv_peer_reconnects_total", {"engine": "0"}) == 3


def test_fences_and_staging_arena_are_exported() -> None:
    """Fences (P: confirmed, reset; D: loads handed back after P's fence or its timeout) reach
    ``vllm:dsa_kv_fenced_connections_total{outcome}``; the staging samples of P's workers (the latest per rank,
    over intervals and workers) set ``vllm:dsa_kv_staging_held_bytes``, and say whether an arena is full."""
    from functools import partial
    from types import SimpleNamespace

    import prometheus_client
    from prometheus_client import CollectorRegistry

    from vllm_dsa_connector.connector.stats import DSAKVConnectorStats, DSAPromMetrics
    from vllm_dsa_connector.core.worker.counters import staging_full

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                                                            prometheus_client.Histogram)}
    prom = DSAPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    a, b = DSAKVConnectorStats(), DSAKVConnectorStats()
    a.add("fenced_connections", 2)
    a.add("connection_resets")
    b.add("fenced_loads")
    b.add("fence_timeouts")
    a.staging(0, 4096, False)
    a.staging(0, 1 << 20, True)  # the latest sample of rank 0
    assert not DSAKVConnectorStats(data={"staging:held:1": [5.0]}).is_empty()
    b.staging(1, 512, False)
    data = a.aggregate(b).data
    assert staging_full(data) is True and staging_full({}) is None
    prom.observe(data, 0)
    for outcome, n in (("fenced", 2), ("reset", 1), ("load_fenced", 1), ("load_timeout", 1)):
        assert registry.get_sample_value("vllm:dsa_kv_fenced_connections_total",
                                         {"engine": "0", "outcome": outcome}) == n
    assert registry.get_sample_value("vllm:dsa_kv_staging_held_bytes", {"engine": "0"}) == (1 << 20) + 512
    later = DSAKVConnectorStats()
    later.staging(0, 0, False)  # rank 0's arena emptied; rank 1 sent nothing new: its last value holds
    prom.observe(later.data, 0)
    assert registry.get_sample_value("vllm:dsa_kv_staging_held_bytes", {"engine": "0"}) == 512
    assert staging_full(later.data) is False


def test_notice_and_payload_round_trip() -> None:
    from vllm_dsa_connector.core.handoff.wire import (
        PROTOCOL_VERSION,
        Notice,
        RankPayload,
        decode_notice,
        decode_payload,
        encode,
        encode_notice,
    )

    n = Notice("req-1", 3, True, 1024, 2, checks=[(0, 64, 512, 123), (0, 4096, 512, 456)])
    assert decode_notice(encode_notice(n)) == n
    assert decode_notice(b"HB:other connector") is None
    p = RankPayload("e", 0, 0, 0, "agent", b"\x00meta", fake_page_table(), [], {"model_dtype": "bf16"})
    assert decode_payload(encode(p)) == p
    old = RankPayload("e", 0, 0, 0, "agent", b"", {}, [], {}, protocol=PROTOCOL_VERSION + 1)
    with pytest.raises(ValueError, match="protocol mismatch"):
        decode_payload(encode(old))


def test_side_channel_dead_peer_times_out_fast() -> None:
    from vllm_dsa_connector.core.handoff.messages import HeartbeatReq, MetaReq, Reply, ReqRef
    from vllm_dsa_connector.core.handoff.side_channel import (
        HandshakeError,
        SideChannelServer,
        request,
    )

    seen = []
    server = SideChannelServer("127.0.0.1", 24990, lambda req, sender: (seen.append(req), Reply(True))[1])
    try:
        assert request("127.0.0.1", server.port, HeartbeatReq([ReqRef("r1", "t")]), 5.0).ok
        assert seen == [HeartbeatReq([ReqRef("r1", "t")])]
    finally:
        server.close()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="did not answer") as e:
        request("127.0.0.1", 24991, MetaReq(), 0.5)  # nobody listens: a timeout, never a hang
    assert time.monotonic() - t0 < 3
    assert e.value.transient  # D tries again while a waiting request's transfer budget lasts


def test_handshake_refusals_say_whether_asking_again_can_help() -> None:
    """A producer whose workers have not registered yet (starting up) refuses transiently; so does one that
    cannot authenticate D (a wrong secret): its refusal is unsigned, so it is never taken as P's final word
    (D retries inside the transfer budget). Real producers behind real side channels."""
    from vllm_dsa_connector.core.handoff.messages import Authenticator
    from vllm_dsa_connector.core.handoff.producer import Producer
    from vllm_dsa_connector.core.handoff.settings import HandoffSettings
    from vllm_dsa_connector.core.handoff.side_channel import (
        HandshakeError,
        SideChannelServer,
        fetch_payloads,
    )

    producer = Producer("P-start", HandoffSettings(), block_size=16)
    secret = Authenticator("s" * 32)
    starting = SideChannelServer("127.0.0.1", 0, lambda req, sender: producer.handle(req, [], sender))
    locked = SideChannelServer("127.0.0.1", 0, lambda req, sender: producer.handle(req, [b"x"], sender), secret)
    try:
        with pytest.raises(HandshakeError, match="not registered their KV caches") as e:
            fetch_payloads("127.0.0.1", starting.port, 5.0)
        assert e.value.transient
        with pytest.raises(HandshakeError, match="auth_secret differs") as e:
            fetch_payloads("127.0.0.1", locked.port, 5.0, Authenticator("t" * 32))
        assert e.value.transient and "unsigned reply" in str(e.value)
    finally:
        starting.close()
        locked.close()


def test_worker_drops_a_push_past_its_deadline_and_reports_it_once() -> None:
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker
    from vllm_dsa_connector.core.handoff.wire import PushJob

    worker = DSAConnectorWorker("P-unit", ConnectorOptions(), {}, role="kv_producer")  # a real NIXL agent
    try:
        late = PushJob("r1", "D", "d1", [1, 2], [3, 4], post_deadline=time.monotonic() - 0.1)
        worker.start_load_kv(DSAConnectorMetadata(push=[late]))
        sending, _, _ = worker.get_transfer_results()
        assert sending == {"r1"} and worker.stats.data["send_late"] == 1  # no WRITE was posted
        worker.start_load_kv(DSAConnectorMetadata(release=["r1"]))  # a release of the same request
        assert worker.get_transfer_results() == (set(), set(), set())  # never reported twice
        worker.start_load_kv(DSAConnectorMetadata(fail_recv={"d9": "gave up"}))
        assert worker.get_transfer_results() == (set(), {"d9"}, {"d9"})
        worker.start_load_kv(DSAConnectorMetadata(fail_recv={"d9": "gave up again"}))
        assert worker.get_transfer_results() == (set(), set(), set())
    finally:
        worker.shutdown()


def test_notice_must_come_from_the_agent_of_the_rank_it_names() -> None:
    """The worker's receive path is the transport's Receiver: fed real notifications (as NIXL hands them
    over: agent name + bytes), it applies a notice only from the agent of the source rank it names."""
    from types import SimpleNamespace

    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker, _RemoteEngine
    from vllm_dsa_connector.core.handoff.wire import Notice, RankPayload, RecvJob, encode
    from vllm_dsa_connector.core.transfer.notices import encode_notif
    from vllm_dsa_connector.core.transfer.receiver_data import WriterState

    def feed(agent: str, n: Notice) -> bool:
        with worker._lock:  # as the worker's own progress thread does
            return worker.receiver.handle(agent, encode_notif("direct", n.src_rank, encode(n)))

    worker = DSAConnectorWorker("D-unit", ConnectorOptions(), {}, role="kv_consumer")  # a real NIXL agent
    try:
        worker.table = SimpleNamespace(rank=0)  # no KV caches registered: only the rank is read
        worker.sources["P"] = _RemoteEngine([RankPayload("P", 0, 0, 0, "agent-p0", b"", fake_page_table(), [], {})], {})
        worker.start_load_kv(DSAConnectorMetadata(recv=[RecvJob("d1", "P", [3], {0: [0]}, 30.0)]))
        rcv = worker.receiver
        assert feed("agent-evil", Notice("d1", 0, True, 10, 1))  # a forged notice: ignored
        assert rcv.writer_states(b"d1") == {0: WriterState.EXPECTED}
        feed("agent-p0", Notice("d1", 1, True, 10, 1))  # names another rank: ignored
        assert rcv.writer_states(b"d1") == {0: WriterState.EXPECTED}
        feed("agent-p0", Notice("d1", 0, True, 10, 1))
        assert rcv.writer_states(b"d1") == {0: WriterState.LANDED}
        assert worker.get_transfer_results() == (set(), {"d1"}, set())  # loaded, not failed
        # A failure notice fails the load; an early notice waits for its RecvJob.
        feed("agent-p0", Notice("d2", 0, False, error="P lost its blocks"))
        worker.start_load_kv(DSAConnectorMetadata(recv=[RecvJob("d2", "P", [4], {0: [0]}, 30.0)]))
        assert worker.get_transfer_results() == (set(), {"d2"}, {"d2"})
        # A malformed notice from the right agent fails its load (issue 29 item 4), never raises.
        worker.start_load_kv(DSAConnectorMetadata(recv=[RecvJob("d3", "P", [5], {0: [0]}, 30.0)]))
        feed("agent-p0", Notice("d3", 0, True, -5, 1))
        assert rcv.writer_states(b"d3") == {0: WriterState.FAILED}
        assert worker.get_transfer_results() == (set(), {"d3"}, {"d3"})
    finally:
        worker.shutdown()


def test_receiver_progress_period_grows_with_the_wait() -> None:
    """Fast while a WRITE is likely landing, at most 2 ms after a long wait (a waiting D must not burn a core)."""
    from vllm_dsa_connector.core.worker.receiving import recv_poll_period

    assert recv_poll_period(0.0) == pytest.approx(0.0002)
    assert recv_poll_period(0.004) == pytest.approx(0.0002)
    assert recv_poll_period(0.02) == pytest.approx(0.001)
    assert recv_poll_period(0.04) == pytest.approx(0.002)
    assert recv_poll_period(120.0) == pytest.approx(0.002)
    periods = [recv_poll_period(t / 1000) for t in range(0, 100)]
    assert periods == sorted(periods)


def test_idle_pacer_grows_caps_by_kind_and_wakes() -> None:
    """An engine only waiting on its peer pauses 1, 2, 4 ... ms per idle step: up to 2 ms while the workers
    must report an outcome (urgent), up to 20 ms otherwise; a wake ends the pause and restarts at 1 ms."""
    import threading

    from vllm_dsa_connector.connector.pacing import IdlePacer

    waited: list[float] = []
    woken = [False]

    def fake_wait(event: threading.Event, timeout: float) -> bool:  # records instead of sleeping
        waited.append(timeout)
        return woken[0] or event.is_set()

    p = IdlePacer(wait=fake_wait)
    for _ in range(8):
        p.pause(urgent=False)
    assert waited == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.02])
    assert p.period(urgent=True) == pytest.approx(0.002)
    p.busy()
    assert p.period(urgent=False) == pytest.approx(0.001)
    for _ in range(5):
        p.pause(urgent=True)
    assert waited[-5:] == pytest.approx([0.001, 0.002, 0.002, 0.002, 0.002])
    p.wake()  # e.g. D's registration reached P's side channel during the pause
    p.pause(urgent=False)
    assert p.idle_steps == 0 and p.period(urgent=False) == pytest.approx(0.001)
    p.pause(urgent=False)  # the wake was consumed: this pause runs its course
    assert p.idle_steps == 1
    with pytest.raises(ValueError, match="base_s <= urgent_cap_s <= cap_s"):
        IdlePacer(base_s=0.01, urgent_cap_s=0.002)


def test_idle_pacer_wake_ends_a_real_pause() -> None:
    import threading

    from vllm_dsa_connector.connector.pacing import IdlePacer

    p = IdlePacer(cap_s=5.0, urgent_cap_s=5.0, base_s=5.0)
    threading.Timer(0.05, p.wake).start()
    t0 = time.monotonic()
    p.pause(urgent=False)
    assert time.monotonic() - t0 < 2.0


def test_crc_runs_in_place_and_gathered_agree_with_zlib() -> None:
    """Checksums of byte runs read in place (host pools) and gathered in batches (the device-pool path, run
    here on a host tensor) equal zlib's over the same bytes, across batch boundaries."""
    import zlib

    import torch

    from vllm_dsa_connector.core.worker import pool_bytes

    pool = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    offsets, lengths = [0, 17, 40_000, 65_000, 3, 9_000], [17, 1_000, 5_000, 536, 0, 30_000]
    want = [zlib.crc32(pool[o:o + n].numpy().tobytes()) for o, n in zip(offsets, lengths, strict=True)]
    assert pool_bytes.crc_runs(pool, offsets, lengths) == want
    assert pool_bytes.crc_runs(pool, offsets, lengths, gather=True) == want
    old = pool_bytes.CRC_BATCH_BYTES
    pool_bytes.CRC_BATCH_BYTES = 4_096  # several batches, one run longer than a batch
    try:
        assert pool_bytes.crc_runs(pool, offsets, lengths, gather=True) == want
    finally:
        pool_bytes.CRC_BATCH_BYTES = old
    with pytest.raises(ValueError, match="2 offsets but 1 lengths"):
        pool_bytes.crc_runs(pool, [0, 1], [1])


def test_stats_taken_while_a_progress_thread_records_lose_nothing() -> None:
    """vLLM takes a worker's stats on the step thread while the send/receive progress threads record into the same
    counters under the worker lock (new keys each step: pair bytes, staging, failures): taking them must neither
    break (``dictionary changed size during iteration`` in the copy) nor lose what was recorded meanwhile."""
    import sys
    import threading

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker
    from vllm_dsa_connector.core.worker.counters import pair_bytes

    worker = DSAConnectorWorker("P-stats", ConnectorOptions(), {}, role="kv_producer")  # a real NIXL agent
    stop = threading.Event()
    recorded = [0]

    def progress() -> None:  # as the progress threads do: one round at a time under the worker lock
        while not stop.is_set():
            with worker._lock:
                for dst in range(64):
                    worker.stats.counters.add_pair_bytes("send", 0, dst, 1)
                worker.stats.counters.add("send_bytes", 64)
                recorded[0] += 64

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=progress, daemon=True)
    taken = 0
    try:
        thread.start()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            stats = worker.get_stats()
            if stats is not None:
                assert sum(pair_bytes(stats.data).values()) == stats.data["send_bytes"]  # one round's keys, whole
                taken += stats.data["send_bytes"]
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join(5)
        last = worker.get_stats()
        taken += 0 if last is None else last.data["send_bytes"]
        worker.shutdown()
    assert recorded[0] > 0 and taken == recorded[0], f"recorded {recorded[0]}, taken {taken}"


def test_cpu_worker_warns_when_vllm_binds_every_engine_to_the_same_cores(caplog, monkeypatch) -> None:
    """vLLM CPU's default binding (``VLLM_CPU_OMP_THREADS_BIND`` unset: ``auto``) puts every engine of a host on the
    same cores, where a P and a D starve each other (measured on 2 cores: every first request failed); a CPU
    worker says so when it registers its pools, naming its cores and the fix, and stays quiet with an explicit
    binding."""
    import logging

    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import allocate_offline
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    kv_caches, _, table = allocate_offline(glm_dsa_config(num_layers=2), pp_rank=0, pp_size=1, tp_rank=0,
                                           tp_size=1, block_size=64, num_blocks=8)
    opts = ConnectorOptions.from_config({"prefault_kv_cache": False}, environ={})
    for bind, warned in ((None, True), ("auto", True), ("nobind", False), ("0", False)):
        if bind is None:
            monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
        caplog.clear()
        worker = DSAConnectorWorker(f"cpu-bind-{bind}", opts, {"model_dtype": "bf16"}, role="kv_producer")
        try:
            with caplog.at_level(logging.WARNING, logger="vllm_dsa_connector.connector.worker"):
                worker.register(kv_caches, table)
        finally:
            worker.shutdown()
        hits = [r.getMessage() for r in caplog.records if "VLLM_CPU_OMP_THREADS_BIND" in r.getMessage()]
        assert len(hits) == int(warned), (bind, hits)
        if warned:
            assert "core(s)" in hits[0] and "nobind" in hits[0] and f"cpu-bind-{bind}" in hits[0]
