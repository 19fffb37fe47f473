"""Issue 34: early registration and layer-by-layer push on real vLLM CPU engines (slow).

One module-scoped set of engines on the tiny GLM-MoE-DSA model (``index_topk_freq=2``: MLA latent and the
indexer K pages of the owning layers travel), all DSAConnector ``kv_both``, ``verify_transfers`` on:

- P: ``layer_push`` on, ``--max-num-batched-tokens 64``: where vLLM chunks the prefill (GPU, AMX CPUs) every
  prompt here prefills over several steps; on a CPU without AMX vLLM turns chunked prefill off for MLA models
  and prefills each prompt in one step. Either way a registration P holds when the step that finishes the
  prefill is scheduled is posted layer by layer from ``save_kv_layer`` in that step;
- P2: the same with ``--max-num-batched-tokens 16``, killed in the middle of a long prefill;
- D: ``transfer_timeout_s`` 6, ``kv_load_failure_policy`` recompute (a load that fails is computed on D) and
  ``bounce_mode=always``: a sequential load bounces, an early one goes direct (D scatters a bounce by P's
  block ids, which it does not know before P finished);
- our proxy with ``--early-registration`` in front of P and D: once it has seen one answer of P it sends D
  its leg together with P's, one fresh ``transfer_id`` on both.

Checked: a multi-turn conversation of token ids through the early proxy (turn k+1 = turn k + D's reply + new
tokens, so D serves the first blocks from its own prefix cache) decodes exactly P's own plain replies, the
answers say ``x-kv-transfer: early``, D loads only what it lacks and P posted bytes layer by layer;
concurrent early requests each get their own prompt's KV; the sequential way still works on the same
engines; D giving up (its client gone) before P prefills leaves P releasing the lease without a WRITE;
P killed in the middle of a prefill D registered for costs D its timeout, then D computes the prompt itself
(the answer still right). No checksum mismatch anywhere.
Run under the engine lock: ``flock /tmp/vllm-dsa-engine.lock pytest -m slow tests/test_early_pd.py``.
"""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import free_port
from vllm_dsa_dev.harness.client import complete, metric, scrape
from vllm_dsa_dev.harness.engines import (
    Engine,
    choose_backend,
    connector_config,
    engine_env,
    proxy_cmd,
    start_engine,
)
from vllm_dsa_dev.harness.procs import Cluster, Proc, cluster, kill_group, wait_healthy

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LEAN = {"prefault_kv_cache": False, "bounce_arena_bytes": 32 << 20}


@dataclass
class Engines:
    """The started engines and the early proxy."""

    model: str
    p: Engine
    p2: Engine
    d: Engine
    proxy: str
    proxy_proc: Proc
    c: Cluster
    p_side: int
    p2_side: int


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

    model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    backend = choose_backend(model, "float32", "auto")
    with cluster(tmp_path_factory.mktemp("early-pd")) as c:
        t0 = time.monotonic()
        sides = {name: free_port() for name in ("p", "p2", "d")}
        cfgs: dict[str, dict[str, Any]] = {}
        for name, extra in (("p", {"layer_push": True}), ("p2", {"layer_push": True, "transfer_timeout_s": 3}),
                            ("d", {"transfer_timeout_s": 6, "peer_setup_timeout_s": 0, "bounce_mode": "always"})):
            cfgs[name] = connector_config("kv_both", True, {**LEAN, **extra}, sides[name])
            cfgs[name]["engine_id"] = f"early-{name}"
        cfgs["d"]["kv_load_failure_policy"] = "recompute"
        started = {
            "p": start_engine(c, "p", model, free_port(), "float32", cfgs["p"], backend, engine_env("0"),
                              extra=["--max-num-batched-tokens", "64"]),
            "p2": start_engine(c, "p2", model, free_port(), "float32", cfgs["p2"], backend, engine_env("0"),
                               extra=["--max-num-batched-tokens", "16"]),
            "d": start_engine(c, "d", model, free_port(), "float32", cfgs["d"], backend, engine_env("1")),
        }
        for e in started.values():
            e.ready(900, watch=[x.proc for x in started.values()])
        port = free_port()
        x = c.start("proxy", proxy_cmd(started["p"].url, started["d"].url, port, ["--early-registration"]))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [x], 60)
        print(f"[early] engines and proxy up in {time.monotonic() - t0:.0f} s")
        yield Engines(str(model), started["p"], started["p2"], started["d"], url, x, c, sides["p"], sides["p2"])


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}


def _body(model: str, ids: list[int], max_tokens: int = MAX_TOKENS, params: dict[str, Any] | None = None) -> dict:
    body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _counters(url: str) -> dict[str, float]:
    m = scrape(url)
    return {"recv_bytes": metric(m, "vllm:dsa_kv_bytes_total", side="recv"),
            "send_bytes": metric(m, "vllm:dsa_kv_bytes_total", side="send"),
            "layered": metric(m, "vllm:dsa_kv_layered_bytes_total"),
            "bounce": metric(m, "vllm:dsa_kv_bounce_bytes_total"),
            "recv_ok": metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="ok"),
            "recv_bad": metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="failed")
            + metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="timeout"),
            "send_ok": metric(m, "vllm:dsa_kv_requests_total", side="send", outcome="ok"),
            "send_expired": metric(m, "vllm:dsa_kv_requests_total", side="send", outcome="expired"),
            "mismatch": metric(m, "vllm:dsa_kv_checksum_mismatches_total")}


def _wait(url: str, key: str, at_least: float, what: str, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s  # stats reach /metrics with the engine's next step
    while (now := _counters(url))[key] < at_least:
        assert time.monotonic() < deadline, f"{what}: {key} stayed {now[key]} (< {at_least})"
        time.sleep(0.2)
    return now


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(n)]


def _early_params(eng: Engines, side_port: int, engine_id: str, tid: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": "127.0.0.1", "remote_port": side_port, "transfer_id": tid,
            "transfer_mode": "dsa-push", "kv_connector": "DSAConnector"}


def test_multi_turn_through_the_early_proxy_decodes_ps_replies(eng: Engines) -> None:
    rng = random.Random(34)
    _post(eng.proxy, _body(eng.model, _ids(rng, 70)))  # the proxy learns P's side channel from this answer
    ids = _ids(rng, 6 * 64 + 20)  # 7 chunks of 64 on P: D registers before the final one
    lines, hits = [], 0
    for turn in range(1, 4):
        want = complete(eng.p.url, eng.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
        p0, d0 = _counters(eng.p.url), _counters(eng.d.url)
        answer, headers = _post(eng.proxy, _body(eng.model, ids))
        got = answer["choices"][0]["token_ids"]
        assert headers.get("x-kv-transfer") == "early", headers
        d1 = _wait(eng.d.url, "recv_ok", d0["recv_ok"] + 1, f"turn {turn}: D counted no load")
        p1 = _wait(eng.p.url, "send_ok", p0["send_ok"] + 1, f"turn {turn}: P counted no send")
        assert got == want, f"turn {turn}: D decoded {got}, P alone {want}"
        moved = int(d1["recv_bytes"] - d0["recv_bytes"])
        assert moved == int(p1["send_bytes"] - p0["send_bytes"]) > 0
        assert p1["bounce"] == p0["bounce"], f"turn {turn}: an early registration bounced"
        full = -(-len(ids) // 64)
        per_block = 4 * 64 * 576 * 4 + 3 * 64 * (128 + 4)
        hits += moved < full * per_block
        lines.append(f"turn {turn}: prompt {len(ids)} tok, moved {moved:,} B, layered "
                     f"{int(p1['layered'] - p0['layered']):,} B")
        ids = ids + got + _ids(rng, 70)
    print("[early] " + "; ".join(lines))  # layered or not: whether D registered before P's final chunk
    assert hits >= 2, lines  # turns 2-3: D's own prefix cache served the first blocks


def test_a_registration_before_p_saw_the_request_is_held_then_pushed_layer_by_layer(eng: Engines) -> None:
    rng = random.Random(39)
    ids = _ids(rng, 5 * 64 + 9)
    want = complete(eng.p.url, eng.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
    tid = f"held{rng.getrandbits(96):024x}"
    p0, d0 = _counters(eng.p.url), _counters(eng.d.url)
    with ThreadPoolExecutor(1) as pool:
        d_leg = pool.submit(_post, eng.d.url, _body(eng.model, ids, params=_early_params(eng, eng.p_side, "early-p",
                                                                                           tid)))
        time.sleep(1.5)  # D registered; P has not seen the request: it holds the registration
        assert not d_leg.done()
        complete(eng.p.url, eng.model, ids, 1, {"do_remote_decode": True, "transfer_id": tid})
        answer, _ = d_leg.result(60)
    assert answer["choices"][0]["token_ids"] == want
    p1 = _wait(eng.p.url, "send_ok", p0["send_ok"] + 1, "P counted no send")
    d1 = _wait(eng.d.url, "recv_ok", d0["recv_ok"] + 1, "D counted no load")
    moved = p1["send_bytes"] - p0["send_bytes"]
    assert p1["layered"] - p0["layered"] == moved == d1["recv_bytes"] - d0["recv_bytes"] > 0


def test_concurrent_early_requests_each_get_their_own_kv(eng: Engines) -> None:
    rng = random.Random(35)
    prompts = [_ids(rng, 150 + 37 * i) for i in range(4)]
    want = [complete(eng.p.url, eng.model, ids, MAX_TOKENS)["choices"][0]["token_ids"] for ids in prompts]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ids: _post(eng.proxy, _body(eng.model, ids)), prompts))
    for i, (answer, headers) in enumerate(answers):
        assert headers.get("x-kv-transfer") == "early", headers
        assert answer["choices"][0]["token_ids"] == want[i], f"prompt {i}"


def test_the_sequential_way_still_works_on_the_same_engines(eng: Engines) -> None:
    rng = random.Random(36)
    ids = _ids(rng, 140)
    want = complete(eng.p.url, eng.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
    p0 = _counters(eng.p.url)
    first = complete(eng.p.url, eng.model, ids, 1, {"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert "transfer_id" not in params and params["remote_block_ids"]
    assert complete(eng.d.url, eng.model, ids, MAX_TOKENS, params)["choices"][0]["token_ids"] == want
    p1 = _wait(eng.p.url, "send_ok", p0["send_ok"] + 1, "P counted no send")
    assert p1["bounce"] - p0["bounce"] == p1["send_bytes"] - p0["send_bytes"] > 0  # D's route: bounce, whole


def test_d_giving_up_before_p_prefills_leaves_p_releasing_without_a_write(eng: Engines) -> None:
    """D registers by the transfer id before P has seen the request (P holds the registration), then its
    client goes away: D aborts the request and cancels, P drops the held registration and answers
    ``not_posted`` (D fails the load at once). P's leg then opens its lease cancelled and releases it once the
    prefill is done, writing nothing.

    The order is forced: a registration P dispatched before D's cancel reached it is written, legitimately
    (D keeps its blocks until the write bound). On a CPU without AMX P prefills the whole prompt in one step
    and dispatches a registration it holds layer by layer at the start of that step, so a cancel sent "while
    P prefills" raced that dispatch and P sometimes wrote. Every order of P opening the lease, D's
    registration and cancel reaching P and P's prefill finishing is checked in tests/test_handoff_early.py."""
    rng = random.Random(37)
    _post(eng.proxy, _body(eng.model, _ids(rng, 70)))  # D knows P: its registration below goes out at once
    ids = _ids(rng, 1500)
    tid = f"giveup{rng.getrandbits(96):024x}"
    p0, d0 = _counters(eng.p.url), _counters(eng.d.url)
    with pytest.raises((TimeoutError, urllib.error.URLError)):  # D's client goes away: D aborts the request
        _post(eng.d.url, _body(eng.model, ids, params=_early_params(eng, eng.p_side, "early-p", tid)),
              timeout_s=3.0)
    d1 = _wait(eng.d.url, "recv_bad", d0["recv_bad"] + 1, "D counted no failed load: P did not confirm the cancel")
    assert d1["recv_ok"] == d0["recv_ok"]
    complete(eng.p.url, eng.model, ids, 1, {"do_remote_decode": True, "transfer_id": tid})
    p1 = _wait(eng.p.url, "send_expired", p0["send_expired"] + 1, "P did not release the cancelled lease")
    assert p1["send_ok"] == p0["send_ok"], "P wrote for a D request that gave up"
    # D's blocks went back to its pool: the next requests are right
    ids2 = _ids(rng, 200)
    want = complete(eng.p.url, eng.model, ids2, MAX_TOKENS)["choices"][0]["token_ids"]
    assert _post(eng.proxy, _body(eng.model, ids2))[0]["choices"][0]["token_ids"] == want


def test_p_killed_mid_prefill_costs_d_its_timeout_then_d_computes(eng: Engines) -> None:
    rng = random.Random(38)
    ids = _ids(rng, 1900)  # ~119 chunks of 16 on P2
    want = complete(eng.p.url, eng.model, ids, MAX_TOKENS)["choices"][0]["token_ids"]
    warm = _ids(rng, 40)  # D's handshake with P2 first (its first contact then costs nothing below)
    tid0 = f"warm{rng.getrandbits(96):024x}"
    with ThreadPoolExecutor(2) as pool:
        pool.submit(complete, eng.p2.url, eng.model, warm, 1, {"do_remote_decode": True, "transfer_id": tid0})
        pool.submit(_post, eng.d.url, _body(eng.model, warm, params=_early_params(eng, eng.p2_side, "early-p2",
                                                                                     tid0)))
    d0 = _counters(eng.d.url)
    tid = f"kill{rng.getrandbits(96):024x}"
    pool = ThreadPoolExecutor(2)
    p_leg = pool.submit(complete, eng.p2.url, eng.model, ids, 1, {"do_remote_decode": True, "transfer_id": tid})
    t0 = time.monotonic()
    d_leg = pool.submit(_post, eng.d.url, _body(eng.model, ids, params=_early_params(eng, eng.p2_side, "early-p2",
                                                                                       tid)))
    time.sleep(1.0)  # D registered (its handshake with P2 is done), P2 is a few chunks into the prompt
    assert not p_leg.done(), "P2 finished the prefill before it could be killed: make the prompt longer"
    kill_group(eng.p2.proc.pid, signal.SIGKILL)
    answer, _ = d_leg.result(120)
    took = time.monotonic() - t0
    pool.shutdown(wait=False)
    assert answer["choices"][0]["token_ids"] == want
    d1 = _wait(eng.d.url, "recv_bad", d0["recv_bad"] + 1, "D counted no failed load")
    assert d1["recv_ok"] == d0["recv_ok"]
    print(f"[early] P2 killed mid-prefill: D answered after {took:.1f} s (its timeout 6 s + P's write bound), "
          "computing the prompt itself")


def test_no_checksum_mismatch(eng: Engines) -> None:
    for e in (eng.p, eng.d):
        assert _counters(e.url)["mismatch"] == 0
