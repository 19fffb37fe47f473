"""The P/D proxy against small real HTTP stubs standing in for the prefill and decode servers.

Everything async (the two aiohttp stubs and the proxy under uvicorn) runs on one event loop in a
background thread; the tests talk to the proxy over HTTP with ``requests``, as a client would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import requests
import uvicorn
from aiohttp import web
from conftest import free_port

from vllm_dsa_connector.proxy import app as pd_proxy

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P-engine",
            "remote_request_id": "req-p", "remote_host": "10.0.0.1", "remote_port": 5600,
            "remote_block_ids": [1, 2, 3]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
EVIL = {"do_remote_prefill": True, "remote_engine_id": "someone-else", "remote_request_id": "victim"}

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class Stub:
    """An OpenAI-ish server that records what it receives; ``handler`` decides the answer."""

    def __init__(self, handler: Handler) -> None:
        self.default, self.url = handler, ""
        self.reset()

    def reset(self) -> None:
        """Back to the default handler, nothing recorded."""
        self.handler: Handler = self.default
        self.bodies: list[dict[str, Any]] = []
        self.peers: list[Any] = []
        self.ids: list[str | None] = []  # X-Request-Id of each request
        self.auth: list[str | None] = []  # Authorization of each request
        self.release = asyncio.Event()  # set at the end of a test: stalled handlers return

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.peers.append(request.transport.get_extra_info("peername"))
        self.ids.append(request.headers.get("X-Request-Id"))
        self.auth.append(request.headers.get("Authorization"))
        return await self.handler(request, self.bodies[-1])

    async def stall(self, seconds: float = 30.0) -> None:
        """Wait (until the test ends) without answering."""
        try:
            await asyncio.wait_for(self.release.wait(), seconds)
        except TimeoutError:
            pass

    async def start(self) -> None:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions"):
            app.router.add_post(path, self._handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"


async def prefill_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS})


async def decode_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response({"id": "d", "choices": [{"text": "hello"}]})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


class Harness:
    """An event loop thread with a prefill stub, a decode stub and proxies made on demand.

    One per module (starting and stopping servers is most of a test's time); ``reset`` and
    ``end_test`` run around each test.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pd-proxy-test", daemon=True)
        self.thread.start()
        self.prefill, self.decode = Stub(prefill_ok), Stub(decode_ok)
        self.servers: list[tuple[uvicorn.Server, asyncio.Future]] = []
        self.apps: list[Any] = []
        self.default_url = ""
        self._default: tuple[uvicorn.Server, asyncio.Future] | None = None
        self.call(self.prefill.start())
        self.call(self.decode.start())

    def call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def proxy(self, prefill: str | None = None, decode: str | None = None,
              read_timeout: float | None = None, fresh: bool = False) -> str:
        """A proxy's base URL: the shared one in front of the two stubs, or a new one (stopped at the
        end of the test) with other upstreams, read timeout or when ``fresh``."""
        if not (prefill or decode or read_timeout or fresh):
            if not self.default_url:
                self.default_url = self.proxy(fresh=True)
                self._default = self.servers.pop()  # kept for the module, not stopped by end_test
            return self.default_url
        app = pd_proxy.make_app(prefill or self.prefill.url, decode or self.decode.url,
                                read_timeout or 2.0, connect_timeout_s=2.0)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", timeout_graceful_shutdown=1))

        async def start() -> asyncio.Future:
            task = asyncio.ensure_future(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            return task

        self.servers.append((server, self.call(start())))
        self.apps.append(app)
        return f"http://127.0.0.1:{port}"

    def reset(self) -> None:
        self.prefill.reset()
        self.decode.reset()

    async def end_test(self) -> None:
        """Release stalled stub handlers, stop the proxies the test started."""
        for stub in (self.prefill, self.decode):
            stub.release.set()
        for server, _ in self.servers:
            server.should_exit = True
        for _, task in self.servers:
            await task
        self.servers.clear()

    def close(self) -> None:
        async def stop() -> None:
            await self.end_test()
            if self._default is not None:
                self.servers.append(self._default)
                await self.end_test()
            for stub in (self.prefill, self.decode):
                await stub.runner.cleanup()
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        try:
            self.call(stop(), timeout=15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


@pytest.fixture(scope="module")
def hub() -> Iterator[Harness]:
    before = set(threading.enumerate())
    harness = Harness()
    try:
        yield harness
    finally:
        harness.close()
    assert not harness.thread.is_alive()
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []


@pytest.fixture
def h(hub: Harness, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    for var in ("NO_PROXY", "no_proxy"):  # requests must reach 127.0.0.1 directly
        monkeypatch.setenv(var, "*")
    hub.reset()
    try:
        yield hub
    finally:
        hub.call(hub.end_test())


def sse_events(data: bytes) -> list[str]:
    return [line[len("data: "):] for line in data.decode().splitlines() if line.startswith("data: ")]


def error_of(r: requests.Response, status: int, side: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["side"] == side and err["message"] and err["code"] == status
    return err


def test_client_kv_transfer_params_never_forwarded(h: Harness) -> None:
    url = h.proxy()
    body = {**CHAT, "kv_transfer_params": EVIL, "vllm_xargs": {"kv_transfer_params": ["x"], "k": 1}}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.json()["id"] == "d"
    assert r.headers["x-kv-transfer"] == "1" and float(r.headers["x-prefill-ms"]) >= 0
    (pbody,), (dbody,) = h.prefill.bodies, h.decode.bodies
    assert pbody["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,  # vllm-router's
                                           "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                           "remote_port": None}
    assert dbody["kv_transfer_params"] == P_PARAMS
    assert pbody["vllm_xargs"] == dbody["vllm_xargs"] == {"k": 1}


def _pair_id(h: Harness) -> re.Pattern[str]:
    """vllm-router's request id for the stubs' P/D pair."""
    addr = [u.removeprefix("http://") for u in (h.prefill.url, h.decode.url)]
    return re.compile(rf"___prefill_addr_{re.escape(addr[0])}___decode_addr_{re.escape(addr[1])}_[0-9a-f]{{32}}")


@pytest.mark.parametrize("stream", [False, True])
def test_both_legs_carry_one_request_id(h: Harness, stream: bool) -> None:
    """As vllm-router: one fresh id per P/D pair on both legs (vLLM's NixlPushConnector matches D's
    registration to P's request by it), ``___prefill_addr_<P>___decode_addr_<D>_<hex>``; the client's
    X-Request-Id is echoed in the response only. The client's Authorization reaches both legs."""
    url = h.proxy()
    echoed = []
    for headers in ({}, {"Authorization": "Bearer k"}, {"X-Request-Id": "client-id-1"}):
        with requests.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers,
                           timeout=10) as r:
            assert r.status_code == 200
            echoed.append(r.headers.get("x-request-id"))
    assert h.prefill.ids == h.decode.ids and len(set(h.prefill.ids)) == 3
    assert all(_pair_id(h).fullmatch(i or "") for i in h.prefill.ids), h.prefill.ids
    assert echoed == [None, None, "client-id-1"]
    assert h.prefill.auth == h.decode.auth == [None, "Bearer k", None]


def test_no_params_from_prefill_means_none_on_decode(h: Harness) -> None:
    async def prefill_plain(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": None})

    h.prefill.handler = prefill_plain
    url = h.proxy()
    r = requests.post(url + "/v1/chat/completions", json={**CHAT, "kv_transfer_params": EVIL}, timeout=10)
    assert r.status_code == 200 and r.headers["x-kv-transfer"] == "0"
    assert "kv_transfer_params" not in h.decode.bodies[0]


def test_prefill_leg_body_and_decode_leg_body(h: Harness) -> None:
    url = h.proxy()
    body = {**CHAT, "n": 3, "best_of": 4, "min_tokens": 5, "max_tokens": 50, "max_completion_tokens": 50,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
            "top_logprobs": 2, "temperature": 0.7, "cache_salt": "salt"}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=10) as r:
        assert r.status_code == 200 and r.headers["x-kv-transfer"] == "1"
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.content)
    assert events == ['{"i": 0}', '{"i": 1}', '{"i": 2}', "[DONE]"]
    (pbody,), (dbody,) = h.prefill.bodies, h.decode.bodies
    assert pbody["n"] == 1 and pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1
    assert pbody["stream"] is False
    for key in ("best_of", "min_tokens", "stream_options", "logprobs", "top_logprobs"):
        assert key not in pbody, key
    assert pbody["messages"] == CHAT["messages"] and pbody["temperature"] == 0.7
    assert pbody["cache_salt"] == "salt"
    assert dbody == {**body, "kv_transfer_params": P_PARAMS}


def test_completions_non_stream(h: Harness) -> None:
    url = h.proxy()
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4},
                      timeout=10)
    assert r.status_code == 200 and r.json() == {"id": "d", "choices": [{"text": "hello"}]}
    (pbody,) = h.prefill.bodies
    assert pbody["max_tokens"] == 1 and "max_completion_tokens" not in pbody
    assert h.decode.bodies[0]["max_tokens"] == 4


async def prefill_per_prompt(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """P's params name the prompt they were computed for."""
    return web.json_response({"id": "p", "choices": [{"text": "x"}],
                              "kv_transfer_params": {**P_PARAMS, "remote_request_id": f"p-{body['prompt']}"}})


async def decode_echo_params(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """D's n choices say which P request's KV they decoded."""
    n = body.get("n", 1)
    name = body["kv_transfer_params"]["remote_request_id"]
    return web.json_response({
        "id": f"d-{name}", "object": "text_completion", "model": "m",
        "choices": [{"index": j, "text": f"{name}/{j}", "finish_reason": "length"} for j in range(n)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n,
                  "prompt_tokens_details": None}})


def test_prompt_list_is_split_into_one_p_d_pair_per_prompt(h: Harness) -> None:
    """Issue 29 item 3: vLLM returns kv_transfer_params for the first prompt of a list only; sent as one
    request, every prompt's D request would name that one P request. Split: one pair per prompt, each D leg
    with its own prompt's params; choices indexed i * n + j as vLLM does, usage summed."""
    h.prefill.handler, h.decode.handler = prefill_per_prompt, decode_echo_params
    url = h.proxy()
    body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 4, "n": 2}
    r = requests.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "cli"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-transfer"] == "1" and float(r.headers["x-prefill-ms"]) >= 0
    out = r.json()
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "p-a/0"), (1, "p-a/1"), (2, "p-b/0"), (3, "p-b/1"), (4, "p-c/0"), (5, "p-c/1")]
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                            "prompt_tokens_details": None}
    assert out["id"] == "d-p-a" and out["object"] == "text_completion"
    assert sorted(b["prompt"] for b in h.prefill.bodies) == ["a", "b", "c"]
    assert all(b["n"] == 1 and b["max_tokens"] == 1 for b in h.prefill.bodies)
    assert sorted((b["prompt"], b["kv_transfer_params"]["remote_request_id"], b["n"]) for b in h.decode.bodies) == [
        ("a", "p-a", 2), ("b", "p-b", 2), ("c", "p-c", 2)]
    assert sorted(h.prefill.ids) == sorted(h.decode.ids) and len(set(h.prefill.ids)) == 3  # fresh per pair
    assert all(_pair_id(h).fullmatch(i or "") for i in h.prefill.ids) and r.headers["x-request-id"] == "cli"
    pairs = {b["prompt"]: i for b, i in zip(h.prefill.bodies, h.prefill.ids, strict=True)}
    assert {b["prompt"]: i for b, i in zip(h.decode.bodies, h.decode.ids, strict=True)} == pairs  # one id per pair


def test_token_prompts_split_and_one_token_list_does_not(h: Harness) -> None:
    h.prefill.handler, h.decode.handler = prefill_per_prompt, decode_echo_params
    url = h.proxy()
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": [[1, 2], [3, 4]]}, timeout=10)
    assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == ["p-[1, 2]/0", "p-[3, 4]/0"]
    h.reset()
    h.prefill.handler, h.decode.handler = prefill_per_prompt, decode_echo_params
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": [5, 6, 7]}, timeout=10)
    assert r.status_code == 200 and len(h.prefill.bodies) == len(h.decode.bodies) == 1
    assert h.decode.bodies[0]["prompt"] == [5, 6, 7]


def test_streamed_prompt_list_is_refused_by_name(h: Harness) -> None:
    url = h.proxy()
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": ["a", "b"], "stream": True}, timeout=10)
    err = error_of(r, 400, "proxy")
    assert err["param"] == "prompt" and "list of 2 prompts" in err["message"]
    assert not h.prefill.bodies and not h.decode.bodies


def test_split_prompt_failing_on_one_side_is_that_side_s_error(h: Harness) -> None:
    async def decode_fails_b(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body["prompt"] == "b":
            return web.json_response({"error": {"message": "no KV", "type": "x"}}, status=500)
        return await decode_echo_params(request, body)

    h.prefill.handler, h.decode.handler = prefill_per_prompt, decode_fails_b
    r = requests.post(h.proxy() + "/v1/completions", json={"model": "m", "prompt": ["a", "b"]}, timeout=10)
    err = error_of(r, 502, "decode")
    assert err["message"] == "no KV" and len(h.decode.bodies) == 2


@pytest.mark.parametrize("path,extra,local", [
    ("/v1/completions", {"prompt_logprobs": 1}, True),
    ("/v1/completions", {"echo": True, "logprobs": 2}, True),
    ("/v1/completions", {"echo": True}, False),
    ("/v1/chat/completions", {"echo": True}, True),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, False),
])
def test_prompt_logprobs_go_to_decode_alone(h: Harness, path: str, extra: dict[str, Any],
                                            local: bool) -> None:
    url = h.proxy()
    base = CHAT if "chat" in path else {"model": "m", "prompt": "hi", "max_tokens": 4}
    r = requests.post(url + path, json={**base, **extra}, timeout=10)
    assert r.status_code == 200
    assert r.headers["x-kv-transfer"] == ("0" if local else "1")
    assert len(h.prefill.bodies) == (0 if local else 1)
    assert ("kv_transfer_params" in h.decode.bodies[0]) is not local


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_down_is_502_naming_prefill(h: Harness, stream: bool) -> None:
    url = h.proxy(prefill=f"http://127.0.0.1:{free_port()}")
    r = requests.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    err = error_of(r, 502, "prefill")
    assert err["type"] == "upstream_unreachable" and not h.decode.bodies


@pytest.mark.parametrize("stream", [False, True])
def test_decode_down_is_502_naming_decode(h: Harness, stream: bool) -> None:
    url = h.proxy(decode=f"http://127.0.0.1:{free_port()}")
    r = requests.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert error_of(r, 502, "decode")["type"] == "upstream_unreachable"
    assert len(h.prefill.bodies) == 1


def test_prefill_slower_than_read_timeout_is_504_naming_prefill(h: Harness) -> None:
    async def slow(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await h.prefill.stall()
        return web.json_response({})

    h.prefill.handler = slow
    url = h.proxy(read_timeout=0.4)
    t0 = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert time.monotonic() - t0 < 3
    assert error_of(r, 504, "prefill")["type"] == "upstream_timeout" and not h.decode.bodies


def test_decode_slower_than_read_timeout_is_504_naming_decode(h: Harness) -> None:
    async def slow(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await h.decode.stall()
        return web.json_response({})

    h.decode.handler = slow
    url = h.proxy(read_timeout=0.4)
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
    assert error_of(r, 504, "decode")["type"] == "upstream_timeout"


def test_decode_stream_stalling_mid_way_ends_the_client_stream(h: Harness) -> None:
    async def stalls(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        await h.decode.stall()
        return resp

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    pd_proxy.logger.addHandler(handler)
    try:
        h.decode.handler = stalls
        url = h.proxy(read_timeout=0.4)
        t0 = time.monotonic()
        with requests.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}, stream=True,
                           timeout=10) as r:
            assert r.status_code == 200
            events = sse_events(r.content)
        assert time.monotonic() - t0 < 3
    finally:
        pd_proxy.logger.removeHandler(handler)
    assert events[0] == '{"i": 0}' and "[DONE]" not in events
    err = json.loads(events[-1])["error"]
    assert err["side"] == "decode" and err["type"] == "upstream_timeout"
    assert any(rec.levelno == logging.ERROR and "mid-stream" in rec.getMessage() for rec in records)


def test_slow_stream_that_keeps_sending_is_not_cut(h: Harness) -> None:
    async def trickle(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(6):
            await asyncio.sleep(0.25)
            await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    h.decode.handler = trickle
    url = h.proxy(read_timeout=0.6)  # the whole stream takes 1.5 s: longer than the read timeout
    t0 = time.monotonic()
    with requests.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}, stream=True,
                       timeout=10) as r:
        events = sse_events(r.content)
    assert time.monotonic() - t0 > 1.2
    assert events == [f'{{"i": {i}}}' for i in range(6)] + ["[DONE]"]


def test_prefill_400_passes_through_as_json_naming_prefill(h: Harness) -> None:
    async def bad_request(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"error": {"message": "temperature must be >= 0", "type": "BadRequestError",
                                            "param": "temperature", "code": 400}}, status=400)

    h.prefill.handler = bad_request
    url = h.proxy()
    r = requests.post(url + "/v1/chat/completions", json={**CHAT, "temperature": -1}, timeout=10)
    err = error_of(r, 400, "prefill")
    assert err["message"] == "temperature must be >= 0" and err["type"] == "BadRequestError"
    assert err["upstream_status"] == 400 and err["param"] == "temperature"
    assert not h.decode.bodies


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("status,body,expect", [
    (500, b'{"error": {"message": "boom", "type": "InternalServerError"}}', 502),
    (503, b"Service Unavailable", 502),
    (429, b'{"message": "slow down", "type": "RateLimit"}', 429),
    (200, b"not json", 502),
])
def test_upstream_errors(h: Harness, side: str, status: int, body: bytes, expect: int) -> None:
    async def answer(request: web.Request, _: dict[str, Any]) -> web.StreamResponse:
        return web.Response(body=body, status=status, content_type="application/json")

    getattr(h, side).handler = answer
    url = h.proxy()
    r = requests.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
    err = error_of(r, expect, side)
    assert err["upstream_status"] == status
    assert err["type"] == ("bad_upstream_response" if status == 200 else "upstream_error" if
                           status == 503 else json.loads(body).get("error", json.loads(body))["type"])


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_client_body_is_400(h: Harness, data: bytes) -> None:
    url = h.proxy()
    r = requests.post(url + "/v1/chat/completions", data=data,
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert error_of(r, 400, "proxy")["type"] == "invalid_request_error"
    assert not h.prefill.bodies and not h.decode.bodies


def test_one_session_for_the_app_lifetime(h: Harness) -> None:
    url = h.proxy(fresh=True)
    app = h.apps[-1]
    session = app.state.session
    for _ in range(3):
        assert requests.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                             timeout=10).status_code == 200
        assert app.state.session is session
    # one kept-alive connection per upstream, reused: a session per request would open three
    assert len(set(h.prefill.peers)) == 1 and len(set(h.decode.peers)) == 1
    assert requests.get(url + "/health", timeout=10).json() == {"ok": True}
    server, task = h.servers[-1]

    async def shutdown() -> None:
        server.should_exit = True
        await task

    h.call(shutdown())
    assert session.closed


@pytest.mark.parametrize("args,message", [
    (["--read-timeout", "0"], "--read-timeout"),
    (["--read-timeout", "abc"], "--read-timeout"),
    (["--connect-timeout", "-1"], "--connect-timeout"),
    (["--connect-timeout", "inf"], "--connect-timeout"),
])
def test_cli_rejects_bad_timeouts(capsys: pytest.CaptureFixture[str], args: list[str],
                                  message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        pd_proxy.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "seconds" in err


def test_make_app_rejects_bad_timeouts() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        pd_proxy.make_app("http://a", "http://b", 0)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        pd_proxy.make_app("http://a", "http://b", connect_timeout_s=-1.0)
