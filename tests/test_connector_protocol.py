"""DSAConnector's protocol without engines: block pairing by position, P's lease state machine, D's give-up
rule, side-channel authentication and hostile messages. Real side channels (ZMQ) and msgspec types; time is
an injected clock, never a sleep, wherever a deadline is involved."""

from __future__ import annotations

import os
import random

import msgspec
import pytest
from conftest import fake_page_table

from vllm_dsa_connector.core.handoff.clock import ClockEstimate
from vllm_dsa_connector.core.handoff.leases import LeaseState
from vllm_dsa_connector.core.handoff.messages import (
    Authenticator,
    CancelReq,
    CancelState,
    HeartbeatReq,
    MessageError,
    MetaReq,
    Origin,
    RegReq,
    Reply,
    ReqRef,
)
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import HandshakeError, SideChannelServer, request
from vllm_dsa_connector.core.handoff.states import IllegalTransition
from vllm_dsa_connector.core.handoff.wire import (
    PROTOCOL_VERSION,
    RankPayload,
    Route,
    decode_payload,
    encode,
)
from vllm_dsa_connector.core.plan.pairing import PairingError, pair_blocks_by_position

SECRET = "s3cret-s3cret-s3cret"


class Clock:
    """A settable monotonic clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------------------------------ pairing


def test_pairing_skips_the_blocks_d_already_holds() -> None:
    p = pair_blocks_by_position(block_size=64, prompt_tokens=300, local_computed_tokens=128,
                                local_new_blocks=[90, 91, 92], remote_block_ids=[5, 6, 7, 8, 9],
                                remote_num_tokens=300)
    # tokens 128..299 live in P's blocks 2, 3, 4 (7, 8, 9), not in P's first three
    assert (p.first_block, p.src_blocks, p.dst_blocks) == (2, (7, 8, 9), (90, 91, 92))


def test_pairing_without_local_hits_and_with_a_partial_last_block() -> None:
    p = pair_blocks_by_position(block_size=16, prompt_tokens=33, local_computed_tokens=0,
                                local_new_blocks=[3, 2, 1, 0], remote_block_ids=[10, 11, 12],
                                remote_num_tokens=33)
    assert p.src_blocks == (10, 11, 12) and p.dst_blocks == (3, 2, 1)  # D's extra block is not paired


@pytest.mark.parametrize("kwargs, match", [
    (dict(remote_num_tokens=299), "not the same prompt"),
    (dict(remote_block_ids=[5, 6, 7, 8]), "needs 5"),
    (dict(local_computed_tokens=100), "not whole"),
    (dict(local_new_blocks=[90, 91]), "needs 3"),
    (dict(local_computed_tokens=320), "nothing to load"),
    (dict(remote_block_ids=[5, 6, -7, 8, 9]), "negative"),
])
def test_pairing_mismatch_is_an_error_never_a_guess(kwargs: dict, match: str) -> None:
    args = dict(block_size=64, prompt_tokens=300, local_computed_tokens=128, local_new_blocks=[90, 91, 92],
                remote_block_ids=[5, 6, 7, 8, 9], remote_num_tokens=300)
    with pytest.raises(PairingError, match=match):
        pair_blocks_by_position(**{**args, **kwargs})


def test_pairing_matches_positions_for_random_prefix_hits() -> None:
    rng = random.Random(3)
    for _ in range(300):
        b = rng.choice((16, 32, 64))
        n = rng.randint(2, 40 * b)
        blocks_p = rng.sample(range(10_000), -(-n // b))
        hit = rng.randint(0, (n - 1) // b) * b
        new = rng.sample(range(10_000, 20_000), -(-n // b) - hit // b + rng.randint(0, 2))
        pr = pair_blocks_by_position(block_size=b, prompt_tokens=n, local_computed_tokens=hit,
                                     local_new_blocks=new, remote_block_ids=blocks_p, remote_num_tokens=n)
        for i, (s, d) in enumerate(zip(pr.src_blocks, pr.dst_blocks, strict=True)):
            pos = hit + i * b  # the first token both blocks hold
            assert s == blocks_p[pos // b] and d == new[(pos - hit) // b]


@pytest.mark.parametrize("bp,bd", [(64, 16), (16, 64), (32, 48), (64, 64)])
def test_pairing_with_different_block_sizes_follows_the_runs_convention(bp: int, bd: int) -> None:
    """src_blocks[i] holds P's tokens [(first_token // Bp + i) * Bp, +Bp), dst_blocks[j] D's tokens
    [(first_token // Bd + j) * Bd, +Bd) (``PeerPlan.runs``' convention), for random prompts and D hits."""
    rng = random.Random(bp * 1000 + bd)
    for _ in range(200):
        n = rng.randint(2, 12 * max(bp, bd))
        blocks_p = rng.sample(range(10_000), -(-n // bp))
        hit = rng.randint(0, (n - 1) // bd) * bd
        new = rng.sample(range(10_000, 20_000), -(-n // bd) - hit // bd + rng.randint(0, 2))
        pr = pair_blocks_by_position(src_block_size=bp, dst_block_size=bd, prompt_tokens=n,
                                     local_computed_tokens=hit, local_new_blocks=new, remote_block_ids=blocks_p,
                                     remote_num_tokens=n)
        assert (pr.first_token, pr.num_tokens, pr.first_block) == (hit, n - hit, hit // bp)
        for t in range(hit, n):
            assert pr.src_blocks[t // bp - hit // bp] == blocks_p[t // bp]
            assert pr.dst_blocks[t // bd - hit // bd] == new[(t - hit) // bd]
        assert len(pr.dst_blocks) == -(-n // bd) - hit // bd
    if bp != bd:
        with pytest.raises(PairingError, match=f"not whole {bd}-token blocks"):
            pair_blocks_by_position(src_block_size=bp, dst_block_size=bd, prompt_tokens=500,
                                    local_computed_tokens=bd + 1, local_new_blocks=list(range(40)),
                                    remote_block_ids=list(range(40)), remote_num_tokens=500)


def test_older_protocol_peers_are_refused() -> None:
    """Protocol 8 peers fence a connection after an aborted WRITE and say when P's staging arena is full (7 did
    neither: its D hands blocks back without waiting for the fence), 7 registrations name a route per pair (6
    sent bare staging slots and let P's gate choose the path), 6 envelopes name their sender's engine id and
    epoch (5's had neither; 4's had no ``reply_to`` either): an older peer is refused, both its envelopes and its
    handshake payloads, naming both versions."""
    assert PROTOCOL_VERSION == 8
    for version, env in ((7, [7, 0.0, b"n" * 16, b"", b"", "D", 1, msgspec.msgpack.encode({"type": "meta"})]),
                         (6, [6, 0.0, b"n" * 16, b"", b"", "D", 1, msgspec.msgpack.encode({"type": "meta"})]),
                         (5, [5, 0.0, b"n" * 16, b"", b"", msgspec.msgpack.encode({"type": "meta"})]),
                         (4, [4, 0.0, b"n" * 16, b"", msgspec.msgpack.encode({"type": "meta"})])):
        with pytest.raises(MessageError, match=f"peer speaks {version}, this side 8"):
            Authenticator(None).open(msgspec.msgpack.encode(env))
        old = encode(RankPayload("D", 0, 0, 0, "agent-d", b"", {}, [], {}, protocol=version))
        with pytest.raises(ValueError, match=f"peer speaks {version}, this side 8"):
            decode_payload(old)


def test_payload_page_table_regions_and_staging_are_typed_and_bounded() -> None:
    """A payload's page table, regions and staging arena travel as typed structs whose bytes are those of the
    plain ``to_dict()`` forms (no protocol change) and give the same tables and regions back; a payload whose
    page table has another shape, or a list over its bound, is refused while it is decoded, naming the field."""
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.page_tables import build_offline
    from vllm_dsa_connector.core.handoff.wire import (
        MAX_ENTRIES,
    )
    from vllm_dsa_connector.core.plan.pages import PageTable
    from vllm_dsa_connector.core.transfer.ipc_desc import IpcDesc
    from vllm_dsa_connector.core.transfer.nixl.data import RegionDesc

    (table,) = build_offline(glm_dsa_config(6), num_blocks=8)
    wire = table
    assert encode(wire) == encode(table.to_dict()) and PageTable.from_dict(wire.to_dict()) == table
    region = RegionDesc("agent-d", 4096, 1 << 20, "DRAM", 0)
    assert RegionDesc.from_dict(region.to_dict()) == region
    export = IpcDesc("host/boot", "GPU-0", 1 << 20, 0, (b"\x01" * 64).hex(), 2 << 20, 0, b"/torch_1_2".hex(), 0,
                     (b"\x02" * 64).hex(), True)
    assert IpcDesc.from_dict(export.to_dict()) == export
    good = RankPayload("D", 0, 0, 0, "agent-d", b"", wire, [region], {}, staging=region)
    assert decode_payload(encode(good)) == good
    plain = dict(msgspec.structs.asdict(good), page_table=wire.to_dict())
    for bad, field in ((dict(plain, page_table={"pools": [{"num_blocks": 8}]}), "page_table"),
                       (dict(plain, page_table=dict(plain["page_table"], layers=list(range(MAX_ENTRIES + 1)))),
                        "page_table.layers"),
                       (dict(plain, staging={"size": 64}), "staging")):
        with pytest.raises(ValueError, match=rf"malformed DSAConnector handshake payload: .*{field}"):
            decode_payload(msgspec.msgpack.encode(bad))
    with pytest.raises(ValueError, match="region description .*agent"):
        RegionDesc.from_dict({"addr": 0, "size": 1, "mem": "DRAM"})


# ------------------------------------------------------------------------------------------ P side


def _d_payload(num_blocks: int = 100) -> bytes:
    return encode(RankPayload("D", 0, 0, 0, "agent-d", b"", fake_page_table(num_blocks), [], {}))


P_BLOCK = 16  # the producer fixture's block size


def _reg(token: str, deadline: float, blocks: list[int], first: int = 0, **kw) -> RegReq:
    """A registration of D's ``blocks`` for the tokens of P's blocks ``first..first + len(blocks) - 1``."""
    return RegReq("p1", token, "D", "d1", first * P_BLOCK, len(blocks) * P_BLOCK, blocks, deadline,
                  d_payloads=[_d_payload()], **kw)


@pytest.fixture
def producer() -> tuple[Producer, Clock]:
    clock = Clock()
    return Producer("P", HandoffSettings(lease_s=10.0, transfer_timeout_s=5.0), clock, block_size=P_BLOCK), clock


def test_registration_dispatches_the_blocks_of_the_asked_positions(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7, 8, 9, 10])
    assert prod.handle_reg(_reg(token, clock.t + 5, [40, 41], first=2)).ok
    meta = prod.step()
    (job,) = meta.push
    assert (job.src_blocks, job.dst_blocks, job.post_deadline) == ([9, 10], [40, 41], clock.t + 5)
    assert prod.lease("p1").state is LeaseState.DISPATCHED
    again = prod.step()
    assert not again.push  # once
    prod.finished_sending({"p1"})
    assert not prod.pending()


def test_registration_names_tokens_and_p_takes_its_own_blocks() -> None:
    """P (64-token blocks) serves D (16-token blocks): D registers tokens 32..299 (its hit was 2 blocks of
    16); P pushes its blocks 0..4 (tokens 0..319) with the span, and refuses a span its lease does not hold
    or too few D blocks for it (D's block size comes from D's page table)."""
    clock = Clock()
    prod = Producer("P", HandoffSettings(lease_s=10.0, transfer_timeout_s=5.0), clock, block_size=64)
    d_table = fake_page_table(100, block_size=16)
    d_pay = [encode(RankPayload("D", 0, 0, 0, "agent-d", b"", d_table, [], {}))]
    token = prod.add_lease("p1", [7, 8, 9, 10, 11])
    with pytest.raises(MessageError, match="need 17 of D's 16-token blocks"):
        prod.handle_reg(RegReq("p1", token, "D", "d1", 32, 268, list(range(16)), clock.t + 5, d_payloads=d_pay))
    # a refused registration teaches P nothing: the next one is asked for D's payloads again
    assert prod.handle_reg(RegReq("p1", token, "D", "d1", 32, 300, list(range(20)), clock.t + 5)).need_payloads
    with pytest.raises(MessageError, match="request p1 has 5"):
        prod.handle_reg(RegReq("p1", token, "D", "d1", 32, 300, list(range(20)), clock.t + 5, d_payloads=d_pay))
    assert prod.handle_reg(RegReq("p1", token, "D", "d1", 32, 268, list(range(17)), clock.t + 5, d_payloads=d_pay)).ok
    (job,) = prod.step().push
    assert (job.src_blocks, job.first_token, job.num_tokens) == ([7, 8, 9, 10, 11], 32, 268)
    assert job.dst_blocks == list(range(17))


def test_registration_checked_against_token_blocks_and_deadline(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7, 8])
    assert "token does not match" in prod.handle_reg(_reg("wrong", clock.t + 5, [1])).error
    with pytest.raises(MessageError, match="outside D's pools"):
        prod.handle_reg(_reg(token, clock.t + 5, [100]))  # D has blocks 0..99
    with pytest.raises(MessageError, match="request p1 has 2"):
        prod.handle_reg(_reg(token, clock.t + 5, [1, 2], first=1))
    with pytest.raises(MessageError, match="outside D rank 0's staging arena"):
        prod.handle_reg(_reg(token, clock.t + 5, [1], routes={0: {0: Route("bounce", 0, 4096)}}))  # D offers none
    with pytest.raises(MessageError, match="ipc route to D rank 0, which exported no pools"):
        prod.handle_reg(_reg(token, clock.t + 5, [1], routes={0: {0: Route("ipc")}}))
    assert "after its post deadline" in prod.handle_reg(_reg(token, clock.t - 0.1, [1])).error
    assert prod.lease("p1").state is LeaseState.HELD  # nothing above changed the lease


def test_registration_past_its_post_deadline_is_never_dispatched(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7])
    assert prod.handle_reg(_reg(token, clock.t + 2, [1])).ok
    clock.t += 3  # P's engine was stalled past the deadline D gave
    meta = prod.step()
    assert not meta.push and meta.release == ["p1"]


def test_cancel_before_dispatch_is_not_posted_and_a_late_registration_is_refused(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7])
    reply = prod.handle_cancel(CancelReq([ReqRef("p1", token)]))
    assert reply.states == {"p1": CancelState.NOT_POSTED}
    meta = prod.step()
    assert meta.release == ["p1"] and not meta.push
    prod.finished_sending({"p1"})
    late = prod.handle_reg(_reg(token, clock.t + 5, [1]))  # a registration overtaken by its cancel
    assert not late.ok and "ended" in late.error
    # a cancel for a request P never saw is remembered too
    assert prod.handle_cancel(CancelReq([ReqRef("zz", "t")])).states == {"zz": CancelState.NOT_POSTED}


def test_cancel_after_dispatch_says_posted(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7])
    prod.handle_reg(_reg(token, clock.t + 5, [1]))
    prod.step()
    assert prod.handle_cancel(CancelReq([ReqRef("p1", token)])).states == {"p1": CancelState.POSTED}
    prod.finished_sending({"p1"})
    assert prod.handle_cancel(CancelReq([ReqRef("p1", token)])).states == {"p1": CancelState.POSTED}


def test_lease_expires_without_heartbeats_and_lives_with_them(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7])
    for _ in range(5):  # heartbeats every 6 s keep a 10 s lease alive for 30 s
        clock.t += 6
        assert prod.handle_heartbeat(HeartbeatReq([ReqRef("p1", token), ReqRef("p1", "forged")])).ok
        meta = prod.step()
        assert not meta.release
    clock.t += 11
    meta = prod.step()
    assert meta.release == ["p1"]


# ------------------------------------------------------------------------------------------ clocks


def test_clock_estimate_maps_deadlines_conservatively() -> None:
    est = ClockEstimate()
    est.add_sample(sent=10.0, received=10.2, peer_clock=500.1)  # P's clock = D's + 490, +-0.1
    assert est.offset == pytest.approx(490.0) and est.uncertainty == pytest.approx(0.1)
    p_deadline = est.to_peer_before(20.0, now=10.2)
    for true_offset in (489.9, 490.0, 490.1):  # whatever the true offset, P's deadline is not after D's
        assert p_deadline - true_offset <= 20.0 + 1e-9
    est.add_sample(sent=11.0, received=11.5, peer_clock=501.2)  # a worse sample does not replace it
    assert est.uncertainty == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------ side channel


def _serve(secret: str | None) -> tuple[SideChannelServer, list]:
    seen: list = []

    def handler(req, sender):
        seen.append(req)
        return Reply(True, engine_id="E")

    return SideChannelServer("127.0.0.1", 0, handler, Authenticator(secret), origin=Origin("E", 1)), seen


def test_auth_refuses_missing_and_wrong_secrets_by_name() -> None:
    server, seen = _serve(SECRET)
    try:
        port = server.port
        assert request("127.0.0.1", port, MetaReq(), 2, Authenticator(SECRET)).ok
        with pytest.raises(HandshakeError, match="requires auth_secret") as e:
            request("127.0.0.1", port, MetaReq(), 2, Authenticator(None))
        assert e.value.transient  # the refusal is unsigned: never the peer's final word
        with pytest.raises(HandshakeError, match="bad HMAC") as e:  # P cannot read it, so it does not sign
            request("127.0.0.1", port, MetaReq(), 2, Authenticator("another-secret-of-16+"))
        assert e.value.transient and "unsigned reply" in str(e.value)
        assert len(seen) == 1  # only the authentic message reached the handler
    finally:
        server.close()


def test_auth_refuses_replays_and_stale_messages() -> None:
    clock = Clock(1_000_000.0)
    auth = Authenticator(SECRET, clock)
    raw = Authenticator(SECRET, clock).seal(MetaReq())
    assert auth.open(raw)
    with pytest.raises(MessageError, match="replayed"):
        auth.open(raw)
    old = Authenticator(SECRET, Clock(clock.t - 120)).seal(MetaReq())
    with pytest.raises(MessageError, match="stale"):
        auth.open(old)


def test_hostile_messages_get_error_replies_and_the_channel_keeps_serving() -> None:
    server, seen = _serve(None)
    rng = random.Random(11)
    bodies = [
        b"", b"\x00", os.urandom(64), msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"kind": "reg"}),
        Authenticator(None).seal(MetaReq())[:-3],  # truncated
    ]
    for _ in range(40):  # random msgpack values
        bodies.append(msgspec.msgpack.encode(rng.choice([
            rng.random(), rng.randint(-2**40, 2**40), "x" * rng.randint(0, 50), [None] * rng.randint(0, 5),
            {"type": "reg", "p_req": rng.randint(0, 9)}, {str(i): i for i in range(rng.randint(0, 5))}])))
    # well-formed envelopes around well-formed kinds with bad bodies
    span = {"first_token": 0, "num_tokens": 16}
    for bad in ({"type": "reg", "p_req": "", "token": "t", "d_engine": "D", "d_req": "d", **span,
                 "d_blocks": [1], "post_deadline": 1.0},
                {"type": "reg", "p_req": "p", "token": "t", "d_engine": "D", "d_req": "d", **span, "first_token": -1,
                 "d_blocks": [1], "post_deadline": 1.0},
                {"type": "reg", "p_req": "p", "token": "t", "d_engine": "D", "d_req": "d", **span, "num_tokens": 0,
                 "d_blocks": [1], "post_deadline": 1.0},
                {"type": "reg", "p_req": "p", "token": "t", "d_engine": "D", "d_req": "d", "first_block": 0,
                 "d_blocks": [1], "post_deadline": 1.0},  # protocol 3's field: not a registration any more
                {"type": "reg", "p_req": "p", "token": "t", "d_engine": "D", "d_req": "d", **span,
                 "d_blocks": [], "post_deadline": 1.0},
                {"type": "reg", "p_req": "p", "token": "t", "d_engine": "D", "d_req": "d", **span,
                 "d_blocks": [1], "post_deadline": float("nan")},
                {"type": "hb", "reqs": [["p"]]}, {"type": "cancel", "reqs": "p"}, {"type": "nope"}):
        body = msgspec.msgpack.encode(bad)
        bodies.append(msgspec.msgpack.encode([PROTOCOL_VERSION, 0.0, b"n" * 16, b"", "D", 1, b"", body]))
    try:
        for raw in bodies:
            reply = server.handle_raw(raw)
            assert not reply.ok and reply.error, raw
        assert not seen  # nothing malformed reached the handler
        first = request("127.0.0.1", server.port, MetaReq(), 2)
        again = request("127.0.0.1", server.port, MetaReq(), 2)
        assert first.ok and again.ok and first.engine_id == again.engine_id == "E"
    finally:
        server.close()


def test_a_retried_registration_gets_the_same_answer(producer) -> None:
    prod, clock = producer
    token = prod.add_lease("p1", [7, 8])
    reg = _reg(token, clock.t + 5, [1, 2])
    assert prod.handle_reg(reg).ok
    assert prod.handle_reg(reg).ok  # D missed the first reply and asked again
    other = _reg(token, clock.t + 5, [3, 4])
    assert "is registered" in prod.handle_reg(other).error  # a different registration is refused
    meta = prod.step()
    assert len(meta.push) == 1


def test_a_second_d_request_registering_a_lease_is_refused_naming_both(producer) -> None:
    """Issue 29 item 3: one P request feeds one D request. A second D request (same engine or another one)
    presenting the same kv_transfer_params is refused by name, before and after dispatch; the first D
    request's retry still gets its answer."""
    import msgspec

    prod, clock = producer
    token = prod.add_lease("p1", [7, 8])
    first = _reg(token, clock.t + 5, [1, 2])
    assert prod.handle_reg(first).ok
    for d_engine, d_req in (("D", "d2"), ("D-other", "d1")):
        second = msgspec.structs.replace(first, d_engine=d_engine, d_req=d_req)
        reply = prod.handle_reg(second)
        assert not reply.ok
        assert "already registered by D request 'd1' of engine 'D'" in reply.error
        assert f"refusing D request {d_req!r} of engine {d_engine!r}" in reply.error
    (job,) = prod.step().push
    assert job.dst_req_id == "d1"
    assert "already registered by D request 'd1'" in prod.handle_reg(
        msgspec.structs.replace(first, d_req="d3")).error  # dispatched: still refused by name
    assert prod.handle_reg(first).ok  # the first D request's retry


# ------------------------------------------------------------------------------------------ state machines


def test_lease_transitions_happen_in_one_place_and_illegal_ones_are_refused(producer) -> None:
    from vllm_dsa_connector.core.handoff.leases import TRANSITIONS

    prod, clock = producer
    token = prod.add_lease("p1", [7])
    assert prod.handle_reg(_reg(token, clock.t + 5, [1])).ok
    lease = prod.lease("p1")
    assert lease.state is LeaseState.REGISTERED
    # a cancel between registration and dispatch: nothing is posted, the next step releases
    assert prod.handle_cancel(CancelReq([ReqRef("p1", token)])).states == {"p1": CancelState.NOT_POSTED}
    assert lease.state is LeaseState.CANCELLED
    assert "is cancelled" in prod.handle_reg(_reg(token, clock.t + 5, [1])).error  # even the same one
    out = prod.step()
    assert out.release == ["p1"] and not out.push and lease.state is LeaseState.RELEASED
    # terminal states have no way out, and the error names the request and both states
    with pytest.raises(IllegalTransition, match=r"lease of p1: released -> dispatched .*none"):
        lease.to(LeaseState.DISPATCHED)
    assert not TRANSITIONS[LeaseState.DISPATCHED]  # a WRITE may be in flight: never cancelled or released
    prod.add_lease("p2", [8])
    with pytest.raises(IllegalTransition, match="held -> dispatched"):
        prod.lease("p2").to(LeaseState.DISPATCHED)  # a dispatch needs a registration first


def test_load_transitions_happen_in_one_place_and_illegal_ones_are_refused() -> None:
    from vllm_dsa_connector.core.handoff.loads import TRANSITIONS, Loading, LoadState

    load = Loading("P", ReqRef("p1", "t"), req_id="d1")
    for state in (LoadState.REGISTERING, LoadState.REGISTERED, LoadState.GIVING_UP, LoadState.FAILED):
        load.to(state)
    with pytest.raises(IllegalTransition, match=r"load of d1: failed -> registering .*none"):
        load.to(LoadState.REGISTERING)
    queued = Loading("P", ReqRef("p2", "t"), req_id="d2")
    with pytest.raises(IllegalTransition, match="queued -> registered"):
        queued.to(LoadState.REGISTERED)  # P cannot accept what was never sent
    assert TRANSITIONS[LoadState.REGISTERED] == frozenset({LoadState.GIVING_UP})  # never FAILED at once
