"""Early registration on the real :class:`~vllm_dsa_connector.core.handoff.producer.Producer`: D registers by the
proxy's transfer id while P prefills (or before P has seen the request).

- a registration that arrives first is held and attached when P's lease opens; nothing is dispatched while
  the prefill runs, the layer-by-layer dispatch or the finished prefill hands the workers the blocks of the
  asked positions;
- a prompt of another length or digest is refused, at once or (held) as a failure job that writes nothing;
- an aborted prefill fails a registered load (failure job) or refuses the later registration;
- a lease whose prefill runs is never released by the clock or a cancel before vLLM finished the request;
- held registrations are bounded, expire at their post deadline, can be cancelled, and one transfer feeds
  one D request;
- D giving up: in every order of P opening the lease, D's registration and cancel reaching P and P's prefill
  finishing, P writes only what it dispatched before the cancel and otherwise releases the lease in the step
  after its prefill is done; a retried registration or cancel changes nothing; a lease D never named is kept
  ``lease_s`` after the prefill.
"""

from __future__ import annotations

import itertools

import pytest
from conftest import fake_page_table

from vllm_dsa_connector.core.handoff import leases as leases_mod
from vllm_dsa_connector.core.handoff.ids import check_transfer_id, prompt_digest
from vllm_dsa_connector.core.handoff.leases import LeaseState
from vllm_dsa_connector.core.handoff.messages import CancelReq, CancelState, RegReq, transfer_ref
from vllm_dsa_connector.core.handoff.params import RemoteParams
from vllm_dsa_connector.core.handoff.producer import Producer
from vllm_dsa_connector.core.handoff.settings import HandoffSettings
from vllm_dsa_connector.core.handoff.wire import RankPayload, encode

BLOCK = 16
TID = "0123456789abcdef0123456789abcdef"
PROMPT = list(range(1000, 1100))  # 100 tokens: 7 blocks of 16
DIGEST = prompt_digest(PROMPT)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _payloads() -> list[bytes]:
    return [encode(RankPayload("D", 0, 0, 0, "agent-d", b"", fake_page_table(100), [], {}))]


def _reg(deadline: float, *, tid: str = TID, d_req: str = "d1", digest: str = DIGEST, tokens: int = 100,
         first: int = 0, num: int = 100, payloads: bool = True) -> RegReq:
    ref = transfer_ref(tid)
    blocks = list(range(40, 40 + -(-(first + num) // BLOCK) - first // BLOCK))
    return RegReq(ref.p_req, ref.token, "D", d_req, first, num, blocks, deadline, prompt_tokens=tokens,
                  prompt_digest=digest, d_payloads=_payloads() if payloads else None)


@pytest.fixture
def prod() -> tuple[Producer, Clock]:
    clock = Clock()
    return Producer("P", HandoffSettings(lease_s=10.0, transfer_timeout_s=5.0), clock, block_size=BLOCK), clock


def test_early_params_parse_and_transfer_ids_are_checked() -> None:
    rp = RemoteParams.from_dict({"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
                              "remote_port": 5600, "transfer_id": TID})
    assert rp.early and rp.ref == transfer_ref(TID) and rp.remote_block_ids == []
    for bad in ("short", "x" * 200, "has space in it 0123", 17):
        with pytest.raises(ValueError, match="transfer_id"):
            check_transfer_id(bad)
    with pytest.raises(ValueError, match="malformed kv_transfer_params: transfer_id"):
        RemoteParams.from_dict({"remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "transfer_id": "no"})
    assert prompt_digest(PROMPT) != prompt_digest(PROMPT[:-1] + [7]) and prompt_digest([]) == ""


def test_registration_before_the_request_is_held_then_dispatched_layer_by_layer(prod) -> None:
    p, clock = prod
    assert p.handle_reg(_reg(clock.t + 30)).ok  # P has not seen the request: held
    assert not p.pending()
    p.add_early("p1", TID, [5, 6], prompt_tokens=100, digest=DIGEST)  # first chunk's blocks
    lease = p.lease("p1")
    assert lease.state is LeaseState.REGISTERED and not lease.final
    clock.t += 12  # past lease_s: a running prefill's lease is not released by the clock
    assert not p.step().push and not p.step().release
    assert not p.dispatch_layered("p1", [5, 6]).push  # the blocks do not cover the span yet
    d = p.dispatch_layered("p1", [5, 6, 7, 8, 9, 10, 11])
    (job,) = d.push
    assert job.layered and not job.error and job.src_blocks == [5, 6, 7, 8, 9, 10, 11]
    assert [peer.engine_id for peer in d.peers] == ["D"]
    assert p.finish_early("p1", [5, 6, 7, 8, 9, 10, 11], ok=True)  # keep the blocks for the workers
    assert not p.step().push  # dispatched once
    p.finished_sending({"p1"})
    assert not p.pending()
    assert "ended" in p.handle_reg(_reg(clock.t + 30)).error


def test_registration_during_the_prefill_is_dispatched_once_it_finished(prod) -> None:
    p, clock = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    assert p.handle_reg(_reg(clock.t + 30, first=32, num=68)).ok
    assert not p.step().push
    p.update_blocks("p1", [5, 6, 7, 8, 9, 10, 11])
    assert p.finish_early("p1", [5, 6, 7, 8, 9, 10, 11], ok=True)
    (job,) = p.step().push
    assert not job.layered and job.src_blocks == [7, 8, 9, 10, 11] and job.first_token == 32


def test_another_prompt_is_refused_at_once_or_fails_the_held_registration(prod) -> None:
    p, clock = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    with pytest.raises(Exception, match="not the same prompt"):
        p.handle_reg(_reg(clock.t + 30, tokens=99, num=99))
    with pytest.raises(Exception, match="is not P's request p1"):
        p.handle_reg(_reg(clock.t + 30, digest=prompt_digest([1, 2, 3])))
    with pytest.raises(Exception, match="states no prompt length and digest"):
        p.handle_reg(_reg(clock.t + 30, digest=""))
    # held first, then P's request turns out to be another prompt: a failure job, nothing written
    tid2 = "f" * 32
    assert p.handle_reg(_reg(clock.t + 30, tid=tid2, d_req="d2", digest=prompt_digest([9] * 100))).ok
    p.add_early("p2", tid2, [20], prompt_tokens=100, digest=DIGEST)
    (job,) = p.step().push  # at once: D fails its load instead of waiting for its timeout
    assert job.error and "is not P's request p2" in job.error and job.src_blocks == []
    assert p.lease("p2").state is LeaseState.DISPATCHED
    assert p.finish_early("p2", [20], ok=True)  # the workers' finished_sending frees the blocks


def test_aborted_prefill_fails_a_registered_load_and_refuses_a_later_one(prod) -> None:
    p, clock = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    assert p.handle_reg(_reg(clock.t + 30)).ok
    assert p.finish_early("p1", [5, 6], ok=False, why="FINISHED_ABORTED")
    (job,) = p.step().push
    assert "ended without its prefill (FINISHED_ABORTED)" in job.error
    tid2 = "e" * 32
    p.add_early("p2", tid2, [9], prompt_tokens=100, digest=DIGEST)
    assert not p.finish_early("p2", [9], ok=False)  # nobody registered: the blocks go back now
    assert "ended" in p.handle_reg(_reg(clock.t + 30, tid=tid2, d_req="d2")).error


def test_cancel_of_a_running_prefill_waits_for_it_and_held_ones_are_bounded(prod, monkeypatch) -> None:
    p, clock = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    assert p.handle_reg(_reg(clock.t + 30)).ok
    ref = transfer_ref(TID)
    assert p.handle_cancel(CancelReq([ref])).states == {ref.p_req: CancelState.NOT_POSTED}
    assert not p.step().release  # vLLM still runs the prefill in these blocks
    assert p.finish_early("p1", [5, 6, 7, 8, 9, 10, 11], ok=True)
    assert p.step().release == ["p1"]
    # held: cancelled before P saw the request, never attached
    tid2 = "c" * 32
    assert p.handle_reg(_reg(clock.t + 30, tid=tid2, d_req="d2")).ok
    assert p.handle_cancel(CancelReq([transfer_ref(tid2)])).states[transfer_ref(tid2).p_req] == CancelState.NOT_POSTED
    p.add_early("p2", tid2, [30], prompt_tokens=100, digest=DIGEST)
    assert p.lease("p2").state is LeaseState.CANCELLED  # D gave up first: released once the prefill is done
    assert not p.step().release
    assert p.finish_early("p2", [30], ok=True) and p.step().release == ["p2"]
    # one transfer feeds one D request; a wrong token is refused; held ones expire and are bounded
    tid3 = "d" * 32
    assert p.handle_reg(_reg(clock.t + 2, tid=tid3, d_req="d3")).ok
    assert "already registered by D request 'd3'" in p.handle_reg(_reg(clock.t + 2, tid=tid3, d_req="d4")).error
    forged = RegReq(transfer_ref(tid3).p_req, "x" * 32, "D", "d3", 0, 100, [1] * 7, clock.t + 2,
                    prompt_tokens=100, prompt_digest=DIGEST)
    assert "token is not its transfer id" in p.handle_reg(forged).error
    clock.t += 3
    p.step()
    assert "ended" in p.handle_reg(_reg(clock.t + 30, tid=tid3, d_req="d3")).error
    monkeypatch.setattr(leases_mod, "EARLY_HELD", 1)
    assert p.handle_reg(_reg(clock.t + 30, tid="a" * 32, d_req="d5")).ok
    assert "early registrations" in p.handle_reg(_reg(clock.t + 30, tid="b" * 32, d_req="d6")).error


def test_a_held_registration_needs_payloads_from_an_unknown_d(prod) -> None:
    p, clock = prod
    reply = p.handle_reg(_reg(clock.t + 30, payloads=False))
    assert reply.need_payloads and not reply.ok
    assert p.handle_reg(_reg(clock.t + 30)).ok


# Every order of the four events of one early transfer D gives up on: P opens the lease ("A", add_early),
# D's registration reaches P ("R": held when it comes before A), D's cancel reaches P ("C": D aborted or timed
# out; its registration goes through D's registration threads, its cancel through the peer's control thread,
# so either may come first) and P's prefill finishes ("F"); P's prefill opens before it finishes.
_ORDERS = ["".join(o) for o in itertools.permutations("ARCF") if o.index("A") < o.index("F")]
_FULL = [5, 6, 7, 8, 9, 10, 11]  # the prompt's 7 blocks once the prefill is done


@pytest.mark.parametrize("layered", [False, True], ids=["step", "layer_push"])
@pytest.mark.parametrize("order", _ORDERS)
def test_every_order_of_open_register_cancel_finish_releases_once_the_prefill_is_done(order, layered) -> None:
    """P's engine steps after each event. P writes only a registration it dispatched before the cancel
    reached it (R and F before C: D had registered, the cancel answers ``posted`` and D keeps its blocks until
    the write bound); in every other order the cancel answers ``not_posted``, nothing is ever dispatched, and
    P releases the lease in the first step after both the cancel and the end of its prefill: never while vLLM
    still prefills into the blocks, never later (not after ``lease_s``)."""
    clock = Clock()
    p = Producer("P", HandoffSettings(lease_s=10.0, transfer_timeout_s=5.0), clock, block_size=BLOCK)
    ref = transfer_ref(TID)
    pushed: list[str] = []
    released_at: int | None = None
    answers: dict[str, CancelState] = {}
    seen = ""
    for ev in order:
        if ev == "A":
            p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
        elif ev == "R":
            p.handle_reg(_reg(clock.t + 30))  # accepted, held or refused: the order decides
        elif ev == "C":
            answers = p.handle_cancel(CancelReq([ref])).states
        else:
            if layered:  # the step that finishes the prefill carries a registered lease's job
                pushed += [j.dst_req_id for j in p.dispatch_layered("p1", _FULL).push]
            assert p.finish_early("p1", _FULL, ok=True)  # the lease keeps the blocks until the workers say
        seen += ev
        d = p.step()
        pushed += [j.dst_req_id for j in d.push]
        if d.release:
            assert d.release == ["p1"] and released_at is None
            released_at = len(seen)
        clock.t += 0.5
    if order.index("C") > max(order.index("R"), order.index("F")):
        assert pushed == ["d1"] and answers == {ref.p_req: CancelState.POSTED} and released_at is None
        assert p.lease("p1").state is LeaseState.DISPATCHED
    else:
        assert not pushed and answers == {ref.p_req: CancelState.NOT_POSTED}
        assert released_at == max(order.index("C"), order.index("F")) + 1, f"released after {seen[:released_at]}"
        assert p.lease("p1").state is LeaseState.RELEASED
    p.finished_sending({"p1"})
    assert not p.pending() and p.in_flight() is False
    assert "ended" in p.handle_reg(_reg(clock.t + 30)).error  # a registration arriving later is refused
    assert p.handle_cancel(CancelReq([ref])).states == answers  # a retried cancel gets the same answer


@pytest.mark.parametrize("order", ["R1 A C R2", "R1 C A R2", "A R1 C R2", "C R1 A R2"])
def test_a_registration_cancelled_between_its_two_attempts_is_refused(prod, order) -> None:
    """D's first registration to a P that does not know it yet is answered ``need_payloads`` (R1) and sent
    again with them (R2); a cancel between the two leaves nothing to write, whether P opened the lease first."""
    p, clock = prod
    replies = {}
    for ev in order.split():
        if ev == "A":
            p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
        elif ev == "C":
            p.handle_cancel(CancelReq([transfer_ref(TID)]))
        else:
            replies[ev] = p.handle_reg(_reg(clock.t + 30, payloads=ev == "R2"))
        assert not p.step().push
    assert not replies["R2"].ok  # R1: need_payloads, or refused at once when the cancel came first
    assert replies["R1"].need_payloads or "ended" in replies["R1"].error
    assert p.lease("p1").state is LeaseState.CANCELLED  # vLLM still prefills into its blocks
    assert p.finish_early("p1", _FULL, ok=True)
    d = p.step()
    assert d.release == ["p1"] and not d.push


def test_a_cancel_retried_after_the_lease_ended_gets_the_same_answer(prod) -> None:
    """D sends an unanswered cancel again: P's answer to the retry is the one it gave (or would have given)
    the first time, after the lease was released or its WRITE finished too."""
    p, clock = prod
    ref = transfer_ref(TID)
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    assert p.handle_cancel(CancelReq([ref])).states == {ref.p_req: CancelState.NOT_POSTED}
    assert p.handle_cancel(CancelReq([ref])).states == {ref.p_req: CancelState.NOT_POSTED}  # still prefilling
    assert p.finish_early("p1", _FULL, ok=True) and p.step().release == ["p1"]
    assert p.handle_cancel(CancelReq([ref])).states == {ref.p_req: CancelState.NOT_POSTED}  # released
    p.finished_sending({"p1"})
    assert p.handle_cancel(CancelReq([ref])).states == {ref.p_req: CancelState.NOT_POSTED}  # gone
    tid2, ref2 = "b" * 32, transfer_ref("b" * 32)
    p.add_early("p2", tid2, [5], prompt_tokens=100, digest=DIGEST)
    assert p.handle_reg(_reg(clock.t + 30, tid=tid2, d_req="d2")).ok
    assert p.finish_early("p2", _FULL, ok=True) and p.step().push
    assert p.handle_cancel(CancelReq([ref2])).states == {ref2.p_req: CancelState.POSTED}
    p.finished_sending({"p2"})
    assert p.handle_cancel(CancelReq([ref2])).states == {ref2.p_req: CancelState.POSTED}  # a WRITE was posted


def test_a_cancelled_lease_whose_prefill_is_aborted_is_released(prod) -> None:
    p, _ = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    p.handle_cancel(CancelReq([transfer_ref(TID)]))
    assert p.finish_early("p1", [5, 6], ok=False, why="FINISHED_ABORTED")  # released by the next step
    d = p.step()
    assert d.release == ["p1"] and not d.push


def test_a_lease_d_never_named_is_kept_lease_s_after_the_prefill(prod) -> None:
    """Neither D's registration nor its cancel reached P (D aborted before it said anything, and the cancel
    it sends then was lost): P cannot tell a D that gave up from one still coming, so it keeps the blocks for
    ``lease_s`` after its prefill, the documented bound of a lease nobody renews, then releases them."""
    p, clock = prod
    p.add_early("p1", TID, [5], prompt_tokens=100, digest=DIGEST)
    clock.t += 30  # a long prefill: the clock never releases a lease whose prefill runs
    assert not p.step().release
    assert p.finish_early("p1", _FULL, ok=True)
    clock.t += 9.9
    assert not p.step().release
    clock.t += 0.2
    assert p.step().release == ["p1"]
