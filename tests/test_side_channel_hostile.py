"""Side-channel peers that sit on the path, flood or drift: replies bound to their request, bounded decoding,
replay and clock skew. Real ZMQ side channels, real :class:`Producer` and :class:`Consumer`; the only fakes are
a relay that plays the attacker on the path (real sockets, real P replies), a transfer plan (the page tables are
fakes) and, where a clock is the fault, an injected clock (said so at the test)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from conftest import fake_page_table

from vllm_dsa_connector.core.handoff.consumer import Consumer
from vllm_dsa_connector.core.handoff.leases import LeaseState
from vllm_dsa_connector.core.handoff.loads import LoadState
from vllm_dsa_connector.core.handoff.messages import (
    MAX_REQS_PER_MESSAGE,
    REPLAY_WINDOW_S,
    Authenticator,
    HeartbeatReq,
    MessageError,
    MetaReq,
    Origin,
    RegReq,
    Reply,
    ReqRef,
    decode_envelope,
    decode_reply,
    decode_request,
)
from vllm_dsa_connector.core.handoff.params import RemoteParams
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import (
    HandshakeError,
    SideChannelServer,
    fetch_payloads,
    request,
)
from vllm_dsa_connector.core.handoff.wire import MAX_WORKERS, RankPayload, encode

SECRET = "hostile-peers-secret-0123"
BLOCK = 16
P_EPOCH = 0x5EED


class Clock:
    """A settable clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Plan:
    """The page tables below are fakes: the transfer plan is one sender per rank."""

    def senders_for(self, rank: int) -> tuple[int, ...]:
        return (0,)


def _payload(engine: str) -> RankPayload:
    return RankPayload(engine, 0, 0, 0, f"agent-{engine}", b"", fake_page_table(512, block_size=BLOCK), [],
                       {"model_dtype": "f32"})


def _producer(auth: Authenticator) -> tuple[Producer, SideChannelServer]:
    prod = Producer("P", HandoffSettings(lease_s=30.0, transfer_timeout_s=10.0), block_size=BLOCK)
    payloads = [encode(_payload("P"))]
    return prod, SideChannelServer("127.0.0.1", 0, lambda req, sender: prod.handle(req, payloads, sender), auth,
                                   origin=Origin("P", P_EPOCH))


def _consumer(clock: Clock | None = None) -> Consumer:
    d = _payload("D")
    settings = HandoffSettings(transfer_timeout_s=10.0, handshake_timeout_s=2.0)
    return Consumer("D", settings, Authenticator(SECRET), lambda: [d], lambda: [encode(d)],
                    clock or time.monotonic, check_peer=lambda src, dst: _Plan())


def _until(cond, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _handshake(d: Consumer, host: str, port: int, since: float | None = None):
    peer = d.peer("P", host, port, waiting_since=since)
    _until(lambda: peer.future is None or peer.future.done(), "handshake did not finish")
    return d.peer("P", host, port, waiting_since=since)


class Relay:
    """Someone on the path between D and P (real sockets): forwards every message to P; in ``mode`` "junk"
    D's registrations get the reply P gave to junk bytes, in "swap" the reply P gave to the first registration
    it saw in that mode (a signed refusal of another D's request); in "garbage" every answer is junk bytes."""

    def __init__(self, p_port: int) -> None:
        self.p_port, self.mode, self.stolen = p_port, "honest", None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _to_p(self, raw: bytes) -> bytes:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{self.p_port}")
        try:
            sock.send(raw)
            return sock.recv()
        finally:
            sock.close()

    def _loop(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, raw = self.sock.recv_multipart()
            answer = self._to_p(raw)  # P handles D's message whatever D is told
            kind = msgspec.msgpack.decode(decode_envelope(raw).body).get("type")
            if self.mode == "garbage":
                answer = b"garbage"
            elif kind == "reg" and self.mode == "junk":
                answer = self._to_p(b"junk")
            elif kind == "reg" and self.mode == "swap":
                self.stolen = self.stolen or answer
                answer = self.stolen
            self.sock.send_multipart([ident, b"", answer])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close()
        self.ctx.term()


def _register(d: Consumer, peer, name: str, token: str):
    rp = RemoteParams("P", f"p-{name}", "127.0.0.1", 1, [7, 8], 2 * BLOCK, token)
    d.queue(f"d-{name}", rp)
    d.register(f"d-{name}", rp, peer, 0, 2 * BLOCK, [7, 8], [40, 41], {}, [])
    load = d.loads[f"d-{name}"]
    _until(lambda: load.reg.done(), "registration unanswered")
    fail: dict[str, str] = {}
    d.step(fail)
    return load, fail


# ------------------------------------------------------------------------------------------ item 1: binding


@pytest.mark.parametrize("mode", ["junk", "swap"])
def test_a_refusal_from_another_exchange_never_makes_d_give_back_blocks_p_writes(mode: str) -> None:
    """The relay forwards D's registration to P (P accepts: it will write) and hands D a refusal P signed for
    something else: junk bytes (protocol 4 signed even that) or another registration (4 bound a reply to
    nothing, and D had never seen that reply). D must not take it as P's word: the load stays registering (retried), nothing is failed."""
    prod, server = _producer(Authenticator(SECRET))
    relay = Relay(server.port)
    d = _consumer()
    try:
        peer = _handshake(d, "127.0.0.1", relay.port)
        assert peer.meta is not None and peer.error is None, peer.error
        load, fail = _register(d, peer, "warm", prod.add_lease("p-warm", [1, 2]))  # P learns D's payloads
        assert load.state is LoadState.REGISTERED and not fail
        if mode == "swap":  # another D's registration P refuses (wrong token): its signed refusal gets stolen
            relay.mode = "swap"
            prod.add_lease("p-other", [3, 4])
            other = RegReq("p-other", "not-the-token", "D2", "d-other", 0, 2 * BLOCK, [1, 2], time.monotonic() + 5)
            refused = request("127.0.0.1", relay.port, other, 5.0, Authenticator(SECRET),
                                  origin=Origin("D2", 9))
            assert "P holds no KV for request p-other" in refused.error  # genuinely refused, and signed
        relay.mode = mode
        load, fail = _register(d, peer, "ok", prod.add_lease("p-ok", [7, 8]))
        assert prod.lease("p-ok").state is LeaseState.REGISTERED  # P got it and will write into 40, 41
        assert "d-ok" not in fail, fail  # ... so D keeps those blocks
        assert load.state is LoadState.REGISTERING  # the answer did not count: retried like an unanswered one
    finally:
        d.shutdown()
        relay.close()
        server.close()


def test_junk_on_the_path_is_no_answer_not_a_final_refusal() -> None:
    """With a secret, a reply that does not decode could come from anyone on the path: the handshake failure
    is transient (retried inside the transfer budget), not final."""
    prod, server = _producer(Authenticator(SECRET))
    relay = Relay(server.port)
    relay.mode = "garbage"
    try:
        with pytest.raises(HandshakeError, match="no authentic answer to 'meta'.*unreadable reply") as e:
            fetch_payloads("127.0.0.1", relay.port, 5.0, Authenticator(SECRET))
        assert e.value.transient
    finally:
        relay.close()
        server.close()


def test_p_never_signs_a_reply_to_a_message_it_could_not_authenticate() -> None:
    server = SideChannelServer("127.0.0.1", 0, lambda req, sender: Reply(True), Authenticator(SECRET))
    try:
        forged = Authenticator("another-secret-0123456").seal(MetaReq())
        for raw in (b"junk", forged, Authenticator(None).seal(MetaReq())):
            reply, nonce, signed = server.answer(raw)
            assert not reply.ok and reply.unread and not signed, raw
        good = Authenticator(SECRET).seal(MetaReq())
        reply, nonce, signed = server.answer(good)
        assert reply.ok and signed and nonce == decode_envelope(good).nonce
        assert server.answer(good)[0].unread  # a replay is not read either
    finally:
        server.close()


def test_mac_input_is_unambiguous_and_binds_the_reply_to_its_request() -> None:
    """Protocol 4's MAC input was ``version|ts|`` + nonce + ``|`` + body: moving bytes between nonce and body
    kept the MAC (a new nonce for an old message). Now every field is fixed-size or length-prefixed."""
    auth = Authenticator(SECRET)
    raw = auth.seal(RegReq("p|q", "t", "D", "d", 0, 16, [1], 5.0))
    env = decode_envelope(raw)
    cut = env.body.index(b"|")
    for nonce, body in ((env.nonce[:15], env.nonce[15:] + env.body),  # a byte moved from nonce to body
                        (env.nonce[1:] + env.body[:1], env.body[1:]),
                        (env.nonce + b"|" + env.body[:cut], env.body[cut + 1:])):
        moved = msgspec.msgpack.encode([env.version, env.ts, nonce, b"", env.mac, body])
        with pytest.raises(MessageError):
            Authenticator(SECRET).open(moved)
    server_auth = Authenticator(SECRET)
    nonce = server_auth.open(raw).nonce
    reply = server_auth.seal_reply(Reply(False, error="no"), nonce)
    assert auth.open_reply(reply, nonce)[1].error == "no"
    with pytest.raises(MessageError, match="answers another message"):
        auth.open_reply(reply, b"x" * 16)
    rebound = msgspec.structs.replace(decode_envelope(reply), reply_to=b"x" * 16)
    with pytest.raises(MessageError, match="bad HMAC on the reply"):  # reply_to is inside the MAC
        auth.open_reply(msgspec.msgpack.encode(rebound), b"x" * 16)


# ------------------------------------------------------------------------------------------ item 6: decoding


def test_oversize_fields_are_refused_while_decoding() -> None:
    """Every list, dict and string is bounded in the type: the decoder refuses at the field (named in the
    error), before it builds the objects; protocol 4 decoded everything, and refused later (or never)."""
    refs = [ReqRef("p", "t")] * (MAX_REQS_PER_MESSAGE + 1)
    cases = {
        "$.reqs": encode(HeartbeatReq(refs)),
        "$.p_req": encode(RegReq("x" * 10_000, "t", "D", "d", 0, 16, [1], 5.0)),
        "$.d_blocks": encode(RegReq("p", "t", "D", "d", 0, 16, [0] * (1 << 19), 5.0)),
        "$.d_payloads": encode(RegReq("p", "t", "D", "d", 0, 16, [1], 5.0, d_payloads=[b""] * 5000)),
        "$.routes": encode(RegReq("p", "t", "D", "d", 0, 16, [1], 5.0,
                                  routes={0: {r: ["bounce", 0, 1] for r in range(MAX_WORKERS + 1)}})),
    }
    for path, body in cases.items():
        with pytest.raises(MessageError, match=f"at `{path.replace('$', '[$]')}"):
            decode_request(body)
    with pytest.raises(MessageError, match="states"):
        decode_reply(encode(Reply(True, states={str(i): "posted" for i in range(MAX_REQS_PER_MESSAGE + 1)})))
    with pytest.raises(MessageError, match="message of"):
        decode_envelope(b"\x00" * ((16 << 20) + 1))  # the raw cap comes before any decoding


def test_handshake_is_answered_within_1s_under_a_flood_of_oversize_messages() -> None:
    """One peer (holding the secret: an insider, or a buggy D) floods P's real side channel with ~15 MiB
    heartbeats of 5 M request refs while another D handshakes in a loop. Protocol 4 built every ref before
    refusing the message (seconds and ~20x the size each); now each is refused at the list's header."""
    prod, server = _producer(Authenticator(SECRET))
    flooder = Authenticator(SECRET)
    body = HeartbeatReq([ReqRef("", "")] * 5_000_000)
    flood = [flooder.seal(body) for _ in range(6)]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    latencies: list[float] = []
    try:
        assert fetch_payloads("127.0.0.1", server.port, 5.0, Authenticator(SECRET)).engine_id == "P"
        t0 = time.monotonic()
        for raw in flood:
            sock.send_multipart([b"", raw])
        answered = 0
        while answered < len(flood) and time.monotonic() - t0 < 60:
            start = time.monotonic()
            meta = fetch_payloads("127.0.0.1", server.port, 10.0, Authenticator(SECRET))
            latencies.append(time.monotonic() - start)
            assert meta.engine_id == "P"
            while sock.poll(0):
                sock.recv_multipart()
                answered += 1
        flood_s = time.monotonic() - t0
        print(f"flood of {len(flood)} x {len(flood[0]) / 2**20:.1f} MiB: answered in {flood_s:.2f} s; "
              f"{len(latencies)} handshakes meanwhile, max {max(latencies):.3f} s, "
              f"median {sorted(latencies)[len(latencies) // 2]:.3f} s")
        assert answered == len(flood)
        assert max(latencies) < 1.0, latencies
    finally:
        sock.close()
        server.close()


# ------------------------------------------------------------------------------------------ item 7: replay, clocks


def test_a_sender_whose_clock_runs_ahead_cannot_be_replayed() -> None:
    """Injected wall clocks (the fault is a clock): the sender runs 50 s ahead. Its message stays fresh until
    its own timestamp + 60 s (on this clock); protocol 4 forgot the nonce 60 s after arrival, so a replay
    70 s later was accepted."""
    now = Clock(1_000_000.0)
    receiver = Authenticator(SECRET, now)
    raw = Authenticator(SECRET, Clock(now.t + 50)).seal(MetaReq())
    assert receiver.open(raw)
    now.t += 70  # the message is 20 s old by its own clock: still fresh
    with pytest.raises(MessageError, match="replayed"):
        receiver.open(raw)
    now.t += 50  # past its timestamp + window: stale (its nonce may be forgotten)
    with pytest.raises(MessageError, match="stale"):
        receiver.open(raw)
    ahead = Authenticator(SECRET, Clock(now.t + REPLAY_WINDOW_S + 1)).seal(MetaReq())
    with pytest.raises(MessageError, match=r"stale message: the sender's clock is \+61.0 s"):
        receiver.open(ahead)  # too far in the future


def test_nonce_cache_is_safe_across_threads() -> None:
    """The server thread and client threads share one Authenticator: each message is accepted exactly once."""
    import sys

    receiver = Authenticator(SECRET)
    raws = [Authenticator(SECRET).seal(MetaReq()) for _ in range(300)]
    accepted: list[bytes] = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def run() -> None:
        for raw in raws:
            try:
                receiver.open(raw)
                accepted.append(raw)
            except MessageError:
                pass

    try:
        threads = [threading.Thread(target=run) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert sorted(accepted) == sorted(raws)


def test_clock_skew_over_the_window_is_a_transient_handshake_failure() -> None:
    """P's wall clock (injected: the fault is a clock) runs 120 s ahead of D's: P refuses D's handshake as
    stale. Protocol 4 signed that refusal and D took it as final (the peer was never retried, even after the
    clocks agreed); now it is unsigned, D logs the measured skew and retries inside the transfer budget."""
    skew = [120.0]
    prod, server = _producer(Authenticator(SECRET, lambda: time.time() + skew[0]))
    clock = Clock(time.monotonic())
    d = _consumer(clock)
    try:
        since = d.queue("d-1", RemoteParams("P", "p-1", "127.0.0.1", server.port, [1], BLOCK, "t"))
        peer = _handshake(d, "127.0.0.1", server.port, since)
        assert peer.meta is None and peer.retryable, peer.error
        assert "stale message" in peer.error and "the peer's wall clock is +120" in peer.error
        assert d.waits_for(peer, since)  # the request keeps waiting
        skew[0] = 0.0  # the clocks agree again
        clock.t += 1.0
        peer = _handshake(d, "127.0.0.1", server.port, since)
        assert peer.meta is not None and peer.error is None and peer.attempt == 2
    finally:
        d.shutdown()
        server.close()


# ------------------------------------------------------------------------------------------ issue 29 item 2


def test_a_registration_names_only_its_sender_s_engine() -> None:
    """Issue 29 item 2: a D holding one valid token (of its own request) named another D's engine id in its
    registration, and P wrote that KV with the other D's agent into the other D's blocks. The registration's
    ``d_engine`` must now be the engine its signed envelope names: refused, naming both, with or without payloads,
    and nothing is dispatched; the real D's own registration is served as before."""
    prod, server = _producer(Authenticator(SECRET))
    victim = _consumer()
    try:
        peer = _handshake(victim, "127.0.0.1", server.port)
        assert peer.meta is not None and peer.meta.epoch == P_EPOCH, peer.error
        load, fail = _register(victim, peer, "victim", prod.add_lease("p-victim", [1, 2]))  # P learns D
        assert load.state is LoadState.REGISTERED and not fail
        token = prod.add_lease("p-evil", [3, 4])  # the attacker's own request: its token is valid
        evil = Origin("D-evil", 77)
        for payloads in (None, [encode(_payload("D"))]):
            forged = RegReq("p-evil", token, "D", "d-evil", 0, 2 * BLOCK, [40, 41], time.monotonic() + 5,
                            d_payloads=payloads)
            reply = request("127.0.0.1", server.port, forged, 5.0, Authenticator(SECRET), origin=evil)
            assert not reply.ok and not reply.need_payloads
            assert "names D engine 'D' but was sent by engine 'D-evil' (epoch 000000000000004d)" in reply.error
        assert prod.lease("p-evil").state is LeaseState.HELD
        assert [j.req_id for j in prod.step().push] == ["p-victim"]  # only the victim's own registration
    finally:
        server.close()
        victim.shutdown()


def test_a_reply_from_a_new_start_of_p_makes_d_redo_the_handshake() -> None:
    """Issue 29 item 2: P restarted on the same engine id and port, and D's queued request names no epoch
    (kv_transfer_params without ``remote_epoch``): D kept the old start's handshake forever. Now the first reply
    of the new start (here a heartbeat's) names another epoch, D's next look at the peer redoes the handshake,
    and the queued load whose lease the old start held fails, by name. The clock is injected (heartbeat due)."""
    prod, server = _producer(Authenticator(SECRET))
    port = server.port
    clock = Clock(time.monotonic())
    d = _consumer(clock)
    try:
        peer = _handshake(d, "127.0.0.1", port)
        assert peer.meta is not None and peer.meta.epoch == P_EPOCH, peer.error
        d.queue("d-q", RemoteParams("P", "p-q", "127.0.0.1", port, [7], BLOCK, prod.add_lease("p-q", [7])))
        assert d.loads["d-q"].epoch == P_EPOCH  # no epoch in the params: the start the handshake knows
        server.close()
        restarted = Producer("P", HandoffSettings(lease_s=30.0, transfer_timeout_s=10.0), block_size=BLOCK)
        payloads = [encode(_payload("P"))]
        server = SideChannelServer("127.0.0.1", port, lambda req, sender: restarted.handle(req, payloads, sender),
                                   Authenticator(SECRET), origin=Origin("P", P_EPOCH + 1))
        clock.t += 10  # a heartbeat is due
        d.step({})
        _until(lambda: all(f.done() for _, _, f in d._heartbeats), "heartbeat unanswered")
        d.step({})
        assert "a reply came from its epoch" in d.peers["P"].stale
        again = _handshake(d, "127.0.0.1", port)
        assert again is not peer and again.meta is not None and again.meta.epoch == P_EPOCH + 1, again.error
        assert not again.stale and "P P restarted" in d.loads["d-q"].error
    finally:
        server.close()
        d.shutdown()
