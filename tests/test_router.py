"""Production routing (issue 31 item 1): DSAConnector P/D behind vllm-router, and llm-d's sidecar conventions.

Real parts: vllm-router 0.1.17 (the PyPI wheel's Rust binary, ``--vllm-pd-disaggregation --kv-connector
nixl``), real vLLM engines on the tiny GLM-MoE-DSA model (CPU DSA backend, block 64, prefix caching on),
and one plain engine without a connector as the reference. The engine tests share ONE module-scoped pair
and reference (engine starts dominate the time): a multi-turn chat whose prompts span several blocks (D's
prefix cache serves the conversation's first blocks from turn 2), streaming and not, chat and completions,
every answer equal to the plain engine's, and D's counters say each request loaded its KV from P once
(``vllm:dsa_kv_requests_total{side="recv",outcome="ok"}``) with no unusable params
(``vllm:dsa_kv_unusable_params_total``).

llm-d's routing sidecar (nixlv2) runs on the decode pod and sends the prefill leg to P itself, then the
decode leg to its local D: :class:`LlmdSidecar` sends exactly what it sends (headers included), straight to
the engines.

The fast tests put the router and our proxy in front of two small recording HTTP servers standing in for
the engines, and compare what each sends (``pd_proxy`` behaves as vllm-router where the engines can tell).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, processes_on_ports
from vllm_dsa_dev.harness.client import metric, scrape
from vllm_dsa_dev.harness.engines import (
    PairUrls,
    RouterMissing,
    choose_backend,
    connector_config,
    engine_env,
    require_vllm_router,
    router_cmd,
    start_engine,
    start_pair,
)
from vllm_dsa_dev.harness.procs import cluster, wait_healthy

BASE = 22800  # P, D, router; side channels +3, +4; reference +5; router metrics +6
DTYPE = "float32"  # deterministic across P/D and one engine (greedy)
ROUTER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
# Long turns: the first prompt spans several 64-token blocks, and each turn's prompt extends the last one.
TURNS = (
    "You are a careful assistant. " + " ".join(f"Fact {i}: the dragon's colour number {i} is {i * 7 % 13}."
                                               for i in range(24)),
    "Using the facts above, list the colour numbers of facts 3, 5 and 8, then explain what the dragon painted.",
    "Now write a short paragraph that mentions every fact number between 10 and 20 in order.",
)
MAX_TOKENS = 24


def _router() -> str:
    try:
        return require_vllm_router()
    except RouterMissing as e:
        pytest.skip(str(e))


# ------------------------------------------------------------------ clients


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
          timeout_s: float = 600.0) -> tuple[dict[str, Any] | list[dict[str, Any]], dict[str, str]]:
    """POST ``body``; the JSON answer (a list of SSE chunks when ``body["stream"]``) and the headers."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        got = dict(r.headers.items())
        if not body.get("stream"):
            return json.loads(r.read()), got
        chunks = []
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
        return chunks, got


def _text(answer: dict[str, Any] | list[dict[str, Any]], chat: bool) -> str:
    """The first choice's text of an answer (streamed: its chunks joined)."""
    if isinstance(answer, dict):
        choice = answer["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    parts = []
    for chunk in answer:
        for choice in chunk.get("choices") or []:
            parts.append(((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or "")
    return "".join(parts)


def _body(chat: bool, model: str, prompt: list[dict[str, str]] | str, stream: bool) -> dict[str, Any]:
    key = "messages" if chat else "prompt"
    body: dict[str, Any] = {"model": model, key: prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class LlmdSidecar:
    """What llm-d's routing sidecar (``--connector nixlv2``) sends, from the decode pod.

    Prefill leg, straight to P: the client's body with ``kv_transfer_params`` set to the six keys
    (``do_remote_decode: true``, ``do_remote_prefill: false``, ``remote_*: null``), ``stream: false``,
    ``stream_options`` removed, ``max_tokens`` and ``max_completion_tokens`` 1, header ``x-request-id`` a
    fresh uuid. Decode leg, to its local D: the client's body as sent with P's returned
    ``kv_transfer_params``, the same ``x-request-id``. The client's other headers (``Authorization``) on
    both legs.
    """

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.sent: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # (url, body, headers) per leg

    def request(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                ) -> dict[str, Any] | list[dict[str, Any]]:
        """One client request through the sidecar: D's answer."""
        ids = {**(headers or {}), "x-request-id": str(uuid.uuid4())}
        pre = {k: v for k, v in body.items() if k != "stream_options"}
        pre.update(kv_transfer_params=dict(ROUTER_PARAMS), stream=False, max_tokens=1, max_completion_tokens=1)
        self.sent.append((self.prefill_url + path, pre, ids))
        answer, _ = _post(self.prefill_url + path, pre, ids)
        assert isinstance(answer, dict)
        dec = {**body, "kv_transfer_params": answer.get("kv_transfer_params")}
        self.sent.append((self.decode_url + path, dec, ids))
        out, _ = _post(self.decode_url + path, dec, ids)
        return out


# ------------------------------------------------------------------ the engines (one pair for the module)


class Served:
    """The module's pair behind vllm-router, the plain reference engine, and D's counters."""

    def __init__(self, urls: PairUrls, reference: str, model: Path) -> None:
        self.urls, self.reference, self.model = urls, reference, str(model)

    def loads(self) -> tuple[float, float, float, float]:
        """D's (ok loads, other load outcomes, received bytes, unusable params) so far."""
        m = scrape(self.urls.decode)
        ok = metric(m, "vllm:dsa_kv_requests_total", side="recv", outcome="ok")
        other = metric(m, "vllm:dsa_kv_requests_total", side="recv") - ok
        return ok, other, metric(m, "vllm:dsa_kv_bytes_total", side="recv"), metric(
            m, "vllm:dsa_kv_unusable_params_total")

    def wait_ok(self, before: tuple[float, float, float, float], n: int) -> tuple[float, float, float, float]:
        """D's counters once ``n`` more ok loads are counted (stats reach /metrics with a later step), or after
        10 s; the differences from ``before``."""
        deadline = time.monotonic() + 10
        while True:
            now = self.loads()
            if now[0] - before[0] >= n or time.monotonic() > deadline:
                return tuple(a - b for a, b in zip(now, before, strict=True))  # type: ignore[return-value]
            time.sleep(0.2)

    def prefix_hits(self) -> float:
        """D's prefix-cache hits in tokens so far."""
        return metric(scrape(self.urls.decode), "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    _router()
    from vllm_dsa_dev.cpu_dsa.tiny_model import make_tiny_glm_dsa

    model = make_tiny_glm_dsa(index_topk_freq=2, index_topk=16)
    workdir = tmp_path_factory.mktemp("router")
    p_cfg = connector_config("kv_producer", True, {}, BASE + 3)
    d_cfg = connector_config("kv_consumer", True, {}, BASE + 4)
    with cluster(workdir) as c:
        ref = start_engine(c, "reference", model, BASE + 5, DTYPE, None, choose_backend(model, DTYPE),
                           engine_env("0"))
        urls = start_pair(c, model, p_cfg, d_cfg, base_port=BASE, dtype=DTYPE, startup_timeout=900,
                          label="router", router="vllm-router")
        ref.ready(900)
        yield Served(urls, ref.url, model)
    assert not processes_on_ports(BASE, 7), "engines or router left behind"


def _conversation(served: Served, send: Any, chat: bool, stream: bool) -> None:
    """Three turns (each prompt extends the last) through ``send(path, body)``: every answer equals the plain
    engine's, D loads each request's KV from P once, nothing unusable; D's prefix cache hits from turn 2."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    messages: list[dict[str, str]] = []
    text = ""
    hits0 = served.prefix_hits()
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        text += f"\n\nUser: {turn}\nAssistant:"
        prompt: Any = list(messages) if chat else text
        before = served.loads()
        got = _text(send(path, _body(chat, served.model, prompt, stream)), chat)
        ok, other, received, unusable = served.wait_ok(before, 1)
        want = _text(_post(served.reference + path, _body(chat, served.model, prompt, False))[0], chat)
        assert got == want, f"turn {i + 1}: P/D {got!r} != one engine {want!r}"
        assert (ok, other, unusable) == (1, 0, 0) and received > 0, (i + 1, ok, other, received, unusable)
        messages.append({"role": "assistant", "content": got})
        text += got
    assert served.prefix_hits() > hits0, "D's prefix cache never served a block of the conversation"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_vllm_router_multi_turn_dsa_chat(served: Served, stream: bool) -> None:
    def send(path: str, body: dict[str, Any]) -> Any:
        return _post(served.urls.proxy + path, body)[0]

    _conversation(served, send, chat=True, stream=stream)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_vllm_router_multi_turn_dsa_completions(served: Served, stream: bool) -> None:
    def send(path: str, body: dict[str, Any]) -> Any:
        return _post(served.urls.proxy + path, body)[0]

    _conversation(served, send, chat=False, stream=stream)


@pytest.mark.slow
def test_llm_d_sidecar_conventions(served: Served) -> None:
    """Chat streamed and completions not, each over three turns, sent as llm-d's sidecar sends them: P's
    params are taken by D, answers equal the plain engine's (the sidecar sends P's params to D as they are)."""
    sidecar = LlmdSidecar(served.urls.prefill, served.urls.decode)
    _conversation(served, sidecar.request, chat=True, stream=True)
    _conversation(served, sidecar.request, chat=False, stream=False)
    for (_, pre, p_ids), (_, dec, d_ids) in zip(sidecar.sent[::2], sidecar.sent[1::2], strict=True):
        assert p_ids == d_ids and uuid.UUID(p_ids["x-request-id"])
        assert pre["kv_transfer_params"] == ROUTER_PARAMS and pre["max_tokens"] == 1
        assert dec["kv_transfer_params"]["transfer_mode"] == "dsa-push"
        assert dec["kv_transfer_params"]["kv_connector"] == "DSAConnector"


# ------------------------------------------------------------------ fast: what the router sends


class Recorder:
    """A small HTTP server standing in for an engine: records every request; answers completions with fixed
    ``kv_transfer_params`` (as a DSAConnector P does), /metrics, /health and the router's other probes."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.seen: list[tuple[str, dict[str, str], dict[str, Any] | None]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True, name="router-stub")
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            body = json.loads(raw) if raw else None
            self.seen.append((request.path, dict(request.headers), body))
            if request.path == "/metrics":
                return web.Response(text="")
            if request.path.endswith("/completions"):
                return web.json_response({"id": "x", "object": "text_completion", "model": "m",
                                          "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                          "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
                                          "kv_transfer_params": self.params})
            if request.path == "/v1/models":
                return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
            return web.json_response({}, status=200 if request.path == "/health" else 404)

        async def start() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            started.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def completions(self) -> list[tuple[dict[str, str], dict[str, Any]]]:
        """(headers, body) of each completion request received."""
        return [(h, b) for path, h, b in self.seen if path in ("/v1/completions", "/v1/chat/completions")
                and b is not None]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


P_RETURNS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P", "remote_epoch": 1,
             "remote_request_id": "r", "remote_token": "t", "remote_host": "127.0.0.1", "remote_port": 5999,
             "remote_block_ids": [1], "remote_num_tokens": 3, "tp_size": 1, "pp_size": 1,
             "transfer_mode": "dsa-push", "kv_connector": "DSAConnector"}


def _legs(router_url: str, p: Recorder, d: Recorder, headers: dict[str, str]) -> tuple[Any, ...]:
    """One chat request through the router at ``router_url``: (P's leg, D's leg, the response headers)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "min_tokens": 3,
            "stream": False, "stream_options": {"include_usage": True}}
    _, got = _post(router_url + "/v1/chat/completions", body, headers, timeout_s=30)
    ((p_h, p_b),), ((d_h, d_b),) = p.completions(), d.completions()
    return p_h, p_b, d_h, d_b, got


@pytest.mark.parametrize("router", ["vllm-router", "pd-proxy"])
def test_what_the_router_sends(tmp_path: Path, router: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-router's P/D exchange, read off the wire, and our proxy's the same where the engines can tell:
    prefill leg with max_tokens 1, no stream, no stream_options, the six kv_transfer_params keys; the same
    ``___prefill_addr_<P>___decode_addr_<D>_<hex>`` X-Request-Id on both legs (the client's echoed in the
    response only); decode leg with P's params as P returned them (``transfer_mode`` ``"dsa-push"``: a
    returned ``"push"`` sends vllm-router down its own push path)."""
    binary = _router() if router == "vllm-router" else None
    p, d = Recorder(P_RETURNS), Recorder(P_RETURNS)
    port = free_port()
    if binary is not None:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-router-test")
        cmd = router_cmd(p.url, d.url, port, prometheus_port=free_port(), binary=binary)
        headers = {"X-Request-Id": "client-1"}
    else:
        import sys

        cmd = [sys.executable, "-m", "vllm_dsa_connector.proxy.app", "--prefill", p.url, "--decode", d.url,
               "--port", str(port)]
        headers = {"X-Request-Id": "client-1", "Authorization": "Bearer sk-router-test"}
    try:
        with cluster(tmp_path) as c:
            x = c.start(router, cmd)
            wait_healthy(f"http://127.0.0.1:{port}", [x], 60)
            p_h, p_b, d_h, d_b, got = _legs(f"http://127.0.0.1:{port}", p, d, headers)
    finally:
        p.close()
        d.close()
    addr = re.escape(p.url.removeprefix("http://")), re.escape(d.url.removeprefix("http://"))
    ids = {k.lower(): v for k, v in p_h.items()}["x-request-id"], {k.lower(): v for k, v in d_h.items()}["x-request-id"]
    assert ids[0] == ids[1] and re.fullmatch(rf"___prefill_addr_{addr[0]}___decode_addr_{addr[1]}_[0-9a-f]{{32}}",
                                             ids[0]), ids
    assert {k.lower(): v for k, v in got.items()}.get("x-request-id") == "client-1"
    assert p_b["kv_transfer_params"] == ROUTER_PARAMS
    assert p_b["max_tokens"] == 1 and p_b["stream"] is False and "stream_options" not in p_b
    assert p_b.get("min_tokens", 0) <= 1
    assert d_b["kv_transfer_params"] == P_RETURNS and d_b["max_tokens"] == 5 and d_b["min_tokens"] == 3
    for h in (p_h, d_h):
        assert {k.lower(): v for k, v in h.items()}.get("authorization") == "Bearer sk-router-test"



# ------------------------------------------------------------------ logprobs: our proxy and vllm-router


def _differ(a: Any, b: Any, tol: float, path: str = "") -> str:
    """Where JSON values ``a`` and ``b`` first differ (floats within ``tol`` are equal: logprobs of one
    prompt from two engines), ``""`` when they do not."""
    if isinstance(a, float) and isinstance(b, float):
        return "" if a == b or abs(a - b) <= tol else f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        return next((d for k in a if (d := _differ(a[k], b[k], tol, f"{path}.{k}"))), "")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} entries"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := _differ(x, y, tol, f"{path}[{i}]"))),
                    "")
    return "" if a == b else f"{path}: {a!r} != {b!r}"


def _answer(reply: dict[str, Any]) -> dict[str, Any]:
    """What a client reads of an answer: the choices (index, text or message, logprobs, prompt_logprobs,
    finish_reason), the top-level prompt_logprobs and the usage; not ids or timestamps."""
    keys = ("index", "text", "message", "logprobs", "prompt_logprobs", "finish_reason")
    return {"choices": [{k: c.get(k) for k in keys} for c in reply["choices"]],
            "prompt_logprobs": reply.get("prompt_logprobs"), "usage": reply.get("usage")}


@pytest.mark.slow
def test_logprobs_through_our_proxy_equal_one_engine_and_what_vllm_router_returns(served: Served,
                                                                                 tmp_path: Path) -> None:
    """Logprob requests on the module's pair, through pd_proxy and through vllm-router 0.1.17, against one
    engine. Our proxy: every answer equals the plain engine's; prompt logprobs (``prompt_logprobs``, or
    ``echo`` with ``logprobs``) go to D alone (vLLM computes a prompt's logprobs only where the prompt is
    prefilled: D reads no external KV for them), other logprob requests move P's KV as usual.

    vllm-router sends both legs with the client's logprob fields and, non-streaming, merges P's reply into
    D's (``prompt_logprobs``; for completions the prompt part of P's ``logprobs`` arrays in front of D's). D
    still loads nothing for prompt logprobs and computes them itself, so: chat and completions
    ``prompt_logprobs`` come out as P computed them (equal to one engine's, to float rounding), but an echoed
    completion's ``logprobs`` hold the prompt twice (P's prompt part, then D's echoed prompt and the output),
    longer than its ``text``. Pinned here for the version the ``[router]`` extra pins."""
    from vllm_dsa_dev.harness.engines import proxy_cmd

    port = free_port()
    chat_msgs = [{"role": "user", "content": TURNS[0]}]
    cases = {
        "echo": ("/v1/completions", {"prompt": TURNS[0], "echo": True, "logprobs": 2}, False),
        "completion prompt_logprobs": ("/v1/completions", {"prompt": TURNS[0], "prompt_logprobs": 2}, False),
        "chat prompt_logprobs": ("/v1/chat/completions", {"messages": chat_msgs, "logprobs": True,
                                                          "top_logprobs": 2, "prompt_logprobs": 2}, False),
        "completion logprobs": ("/v1/completions", {"prompt": TURNS[0], "logprobs": 2}, True),
        "chat logprobs": ("/v1/chat/completions", {"messages": chat_msgs, "logprobs": True, "top_logprobs": 2},
                          True),
    }
    got: dict[str, dict[str, Any]] = {}
    with cluster(tmp_path) as c:
        x = c.start("pd-proxy", proxy_cmd(served.urls.prefill, served.urls.decode, port))
        wait_healthy(f"http://127.0.0.1:{port}", [x], 120)
        for name, (path, extra, moves_kv) in cases.items():
            body = {"model": served.model, "max_tokens": 4, "temperature": 0.0, **extra}
            ref = _answer(_post(served.reference + path, body)[0])
            row: dict[str, Any] = {"ref": ref}
            for via, url in (("proxy", f"http://127.0.0.1:{port}"), ("router", served.urls.proxy)):
                before = served.loads()
                reply, headers = _post(url + path, body)
                ok, other, _, unusable = served.wait_ok(before, 1) if moves_kv else served.wait_ok(before, 99)
                assert (ok, other, unusable) == ((1, 0, 0) if moves_kv else (0, 0, 0)), (name, via, ok, other)
                row[via] = _answer(reply)  # type: ignore[arg-type]
                if via == "proxy":
                    assert headers.get("x-kv-transfer") == ("1" if moves_kv else "0"), (name, headers)
            got[name] = row
    for name, row in got.items():
        # D alone computes a prompt's logprobs as one engine does; decoding on P's KV rounds differently
        tol = 1e-3 if cases[name][2] else 1e-5
        assert not (d := _differ(row["proxy"], row["ref"], tol)), f"{name}: pd_proxy differs from one engine: {d}"
    for name in ("completion prompt_logprobs", "chat prompt_logprobs", "completion logprobs", "chat logprobs"):
        assert not (d := _differ(got[name]["router"], got[name]["ref"], 1e-3)), f"{name}: vllm-router differs: {d}"
    echo = got["echo"]
    ref_lp, router_lp = echo["ref"]["choices"][0]["logprobs"], echo["router"]["choices"][0]["logprobs"]
    prompt = echo["ref"]["usage"]["prompt_tokens"]
    assert echo["router"]["choices"][0]["text"] == echo["ref"]["choices"][0]["text"]
    assert len(router_lp["tokens"]) == prompt + len(ref_lp["tokens"]), "vllm-router's echo merge changed"
    assert router_lp["tokens"][prompt:] == ref_lp["tokens"] and router_lp["tokens"][:prompt] == ref_lp["tokens"][:prompt]
    print(f"echo + logprobs: one engine {len(ref_lp['tokens'])} logprob entries, pd_proxy the same, "
          f"vllm-router {len(router_lp['tokens'])} (the {prompt} prompt tokens twice)")
