"""A D registers only with its own payloads (issue 43, item 1): P binds the NIXL agents a D engine's payloads
name to that engine, and refuses payloads naming an agent bound to another engine, payloads whose agent
metadata is another agent's, and other payloads of an engine start it knows; a non-loopback side channel
without a secret does not start unless the operator says so.

Real parts in one process: three connector workers (:class:`DSAConnectorWorker`, KV caches allocated by vLLM's
own code for a tiny DSA model, real NIXL agents on UCX), P's real :class:`Producer` behind a real ZMQ side
channel, registrations sent with the real client. The victim's pools start filled with 0xAB; the test reads
them back after P's worker ran the step the producer handed it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from vllm_dsa_connector.core.handoff.messages import (
    Authenticator,
    MessageError,
    MetaReq,
    Origin,
    RegReq,
)
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.side_channel import (
    SideChannelServer,
    UnauthenticatedSideChannel,
    request,
)
from vllm_dsa_connector.core.handoff.wire import PeerInfo, decode_payload, encode

BLOCK = 16
NUM_BLOCKS = 16
SECRET = "peer-identity-secret-0123"
FILL = 0xAB


def _worker(engine: str, role: str) -> tuple[Any, dict[str, Any], bytes]:
    """One rank of ``engine``: vLLM-allocated KV caches wrapped by the connector worker (P's filled with a
    pattern, D's with 0xAB); its encoded payload."""
    import torch
    from vllm_dsa_dev.tiny_models import glm_dsa_config

    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.connector.page_tables import allocate_offline
    from vllm_dsa_connector.connector.worker import DSAConnectorWorker

    kv_caches, _, table = allocate_offline(glm_dsa_config(num_layers=2), block_size=BLOCK, num_blocks=NUM_BLOCKS)
    opts = ConnectorOptions.from_config({"transfer_timeout_s": 10, "bounce_mode": "never"}, environ={})
    worker = DSAConnectorWorker(engine, opts, {"model_dtype": "bf16"}, role=role)
    payload = worker.register(kv_caches, table)
    for t in kv_caches.values():
        b = t.view(torch.uint8)
        if role == "kv_producer":
            b.copy_(torch.arange(b.numel(), dtype=torch.int64).remainder(251).to(torch.uint8).view(b.shape))
        else:
            b.fill_(FILL)
    return worker, kv_caches, encode(payload)


def _touched(kv_caches: dict[str, Any], blocks: list[int]) -> int:
    """Bytes of ``blocks`` (every pool) that are no longer 0xAB."""
    import torch

    return sum(int((t.view(torch.uint8)[torch.tensor(blocks)] != FILL).sum()) for t in kv_caches.values())


def _run_step(engines: dict[str, Any], producer: Producer, req_ids: set[str], timeout_s: float = 5.0) -> set:
    """Hand P's worker what the producer dispatches now, and drive every worker (the D ones progress their
    agents, as a running D does) until P's reports ``req_ids`` (or the timeout: a refused registration is never
    dispatched)."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata

    p_worker, _, p_payload = engines["P"]
    d = producer.step()
    p_worker.start_load_kv(DSAConnectorMetadata(local=PeerInfo("P", [p_payload]), peers=d.peers, push=d.push))
    sent: set[str] = set()
    deadline = time.monotonic() + (timeout_s if d.push else 0.2)
    while time.monotonic() < deadline and not req_ids <= sent:
        sent |= p_worker.get_transfer_results()[0]
        for name in ("D-victim", "D-evil"):
            engines[name][0].get_transfer_results()
        time.sleep(0.005)
    return sent


@pytest.fixture(scope="module")
def engines():
    """P, the victim D and the D that hands P the victim's payloads, each a real worker with its pools."""
    made = {name: _worker(name, role) for name, role in (("P", "kv_producer"), ("D-victim", "kv_consumer"),
                                                           ("D-evil", "kv_consumer"))}
    yield made
    for worker, _, _ in made.values():
        worker.shutdown()


def test_a_d_registering_with_another_engines_payloads_is_refused_and_writes_nothing(engines) -> None:
    """The victim registers first (P writes its KV, its agent is bound to it); then another D registers with the
    victim's payloads under its own engine id (re-encoded with its id, as the issue's repro did). P refuses
    it, naming the engine the agent is bound to, counts it, and not one byte lands in the victim's pools."""
    _, _, p_payload = engines["P"]
    _, victim_kv, victim_payload = engines["D-victim"]
    auth = Authenticator(SECRET)
    producer = Producer("P", HandoffSettings(lease_s=30.0, transfer_timeout_s=10.0), block_size=BLOCK, epoch=1)
    server = SideChannelServer("127.0.0.1", 0, lambda req, sender: producer.handle(req, [p_payload], sender), auth,
                               origin=Origin("P", 1))
    try:
        deadline = producer.clock() + 8.0
        token = producer.add_lease("p-victim", [1, 2], prompt_tokens=2 * BLOCK)
        ok = request("127.0.0.1", server.port, RegReq("p-victim", token, "D-victim", "v1", 0, 2 * BLOCK, [3, 4],
                                                      deadline, d_payloads=[victim_payload]),
                     5.0, auth, origin=Origin("D-victim", 0x11))
        assert ok.ok, ok.error
        assert _run_step(engines, producer, {"p-victim"}) >= {"p-victim"}
        assert _touched(victim_kv, [3, 4]) > 0  # the victim's own load landed

        forged = [encode(msgspec.structs.replace(decode_payload(victim_payload), engine_id="D-evil"))]
        token = producer.add_lease("p-evil", [5, 6], prompt_tokens=2 * BLOCK)
        reply = request("127.0.0.1", server.port, RegReq("p-evil", token, "D-evil", "e1", 0, 2 * BLOCK, [7, 8],
                                                         deadline, d_payloads=forged),
                        5.0, auth, origin=Origin("D-evil", 0x22))
        _run_step(engines, producer, {"p-evil"})
        assert _touched(victim_kv, [7, 8]) == 0, "P wrote another D's request into the victim's pools"
        assert not reply.ok and "bound to D engine 'D-victim'" in reply.error, reply
        assert producer.refused_identities == 1
        assert "D-evil" not in producer._peers
    finally:
        server.close()


def test_a_p_worker_refuses_payloads_naming_another_destinations_agent(engines) -> None:
    """The worker's own check (behind the producer's): a PeerInfo whose payloads name an agent another
    destination engine holds, or whose agent metadata is another agent's, is refused and counted; nothing is
    written through it."""
    from vllm_dsa_connector.connector.metadata import DSAConnectorMetadata
    from vllm_dsa_connector.core.handoff.wire import PushJob

    p_worker, _, p_payload = engines["P"]
    _, victim_kv, victim_payload = engines["D-victim"]
    _, _, evil_payload = engines["D-evil"]
    learn = DSAConnectorMetadata(local=PeerInfo("P", [p_payload]), peers=[PeerInfo("D-victim", [victim_payload],
                                                                                   epoch=0x11)])
    p_worker.start_load_kv(learn)  # known from the test above, or learnt now
    before = p_worker.stats.data.get("refused_identities", 0)
    victim, evil = decode_payload(victim_payload), decode_payload(evil_payload)
    cases = {
        "D-copy": msgspec.structs.replace(victim, engine_id="D-copy"),  # the victim's agent, another engine
        "D-mixed": msgspec.structs.replace(evil, engine_id="D-mixed", agent_metadata=victim.agent_metadata),
    }
    for name, payload in cases.items():
        job = PushJob(f"p-{name}", name, "x", [1, 2], [9, 10], post_deadline=time.monotonic() + 5.0, dst_epoch=3)
        p_worker.start_load_kv(DSAConnectorMetadata(peers=[PeerInfo(name, [encode(payload)], epoch=3)], push=[job]))
        assert "are not its own" in p_worker.remotes[name].error, p_worker.remotes[name]
    time.sleep(0.2)
    p_worker.get_transfer_results()
    assert _touched(victim_kv, [9, 10]) == 0
    assert p_worker.stats.data.get("refused_identities", 0) - before == 2


def test_a_non_loopback_side_channel_without_a_secret_refuses_to_start() -> None:
    """The secure mode is the default: no secret on a non-loopback address is an error naming the keys, the
    host and the fix, at option validation and in the side channel itself; the explicit option allows it."""
    from vllm_dsa_connector.connector.options import ConnectorOptions
    from vllm_dsa_connector.options import OptionError

    with pytest.raises(OptionError, match=r"side_channel_host: '0\.0\.0\.0'.*auth_secret.*"
                                          r"allow_unauthenticated_side_channel"):
        ConnectorOptions.from_config({"side_channel_host": "0.0.0.0"}, environ={})
    assert ConnectorOptions.from_config({"side_channel_host": "0.0.0.0", "auth_secret": SECRET}, environ={})
    opts = ConnectorOptions.from_config({"side_channel_host": "0.0.0.0"},
                                        environ={"VLLM_DSA_ALLOW_UNAUTHENTICATED_SIDE_CHANNEL": "1"})
    assert opts.allow_unauthenticated_side_channel
    assert ConnectorOptions.from_config({}, environ={}).side_channel_host == "127.0.0.1"  # loopback: no secret
    with pytest.raises(UnauthenticatedSideChannel, match="0.0.0.0.*auth_secret"):
        SideChannelServer("0.0.0.0", 0, lambda req, sender: None)  # type: ignore[arg-type,return-value]
    SideChannelServer("0.0.0.0", 0, lambda req, sender: None, allow_unauthenticated=True).close()  # type: ignore


def test_p_refuses_other_agents_metadata_its_own_agents_and_changed_payloads(engines) -> None:
    """The producer's other identity checks, on the real payloads: agent metadata that is another agent's than
    the payload says, P's own agent, and other payloads from an engine start P already knows; each is refused
    and counted, and the first payloads stay that start's record."""
    _, _, p_payload = engines["P"]
    _, _, victim_payload = engines["D-victim"]
    _, _, evil_payload = engines["D-evil"]
    victim, evil = decode_payload(victim_payload), decode_payload(evil_payload)
    producer = Producer("P", HandoffSettings(lease_s=30.0, transfer_timeout_s=10.0), block_size=BLOCK, epoch=1)
    producer.handle(MetaReq(), [p_payload], Origin("D-evil", 0x22))  # P serves its own payloads: reserved

    def register(name: str, payloads: list[bytes], epoch: int = 0x22) -> Any:
        token = producer.add_lease(f"p-{name}-{len(producer._leases)}", [1, 2], prompt_tokens=2 * BLOCK)
        reg = RegReq(f"p-{name}-{len(producer._leases) - 1}", token, name, "x", 0, 2 * BLOCK, [3, 4],
                     producer.clock() + 5.0, d_payloads=payloads)
        return producer.handle(reg, [p_payload], Origin(name, epoch))

    mixed = msgspec.structs.replace(evil, agent_metadata=victim.agent_metadata)
    with pytest.raises(MessageError, match="agent metadata is agent 'dsa-D-victim-"):
        register("D-evil", [encode(mixed)])
    own = msgspec.structs.replace(decode_payload(p_payload), engine_id="D-evil")
    with pytest.raises(MessageError, match="bound to D engine 'P'"):
        register("D-evil", [encode(own)])
    assert register("D-evil", [evil_payload]).ok  # its own payloads
    other = msgspec.structs.replace(evil, compat={"model_dtype": "f32"})
    with pytest.raises(MessageError, match="differ from those this engine start registered with first"):
        register("D-evil", [encode(other)])
    assert register("D-evil", [evil_payload]).ok  # the same payloads again are fine
    assert producer.refused_identities == 3
    assert producer._peers.get("D-evil").payloads == [evil_payload]
