"""A small P/D proxy for OpenAI-compatible vLLM servers (what ``vllm-dsa demo`` runs).

Each ``/v1/chat/completions`` or ``/v1/completions`` request goes (1) to the prefill server (P) as a
one-token, non-streaming request with ``kv_transfer_params={"do_remote_decode": true,
"do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
"remote_port": null}``, then (2) to the decode server (D) with exactly the ``kv_transfer_params`` P
returned, or none; D's answer is returned (or streamed) with headers ``x-prefill-ms`` and
``x-kv-transfer`` (``1`` when D got P's params).

It behaves as vllm-router (``--vllm-pd-disaggregation``, the production router the README recommends)
where the engines can tell: the prefill leg's six ``kv_transfer_params`` keys above, and one fresh
``X-Request-Id`` per P/D pair, ``___prefill_addr_<P host:port>___decode_addr_<D host:port>_<hex>``, sent on
both legs (so P and D name the request alike, as vLLM's NixlPushConnector needs); a client's
``X-Request-Id`` is echoed in the response only, as vllm-router does. The client's ``Authorization`` header
reaches both legs (vllm-router sends its own ``OPENAI_API_KEY`` instead).

Fields. Only the proxy sets ``kv_transfer_params``: a client's own is dropped on both legs, and so is
``vllm_xargs["kv_transfer_params"]`` (vLLM hands ``kv_transfer_params`` to the engine in ``extra_args``).
The prefill leg gets ``max_tokens=1`` (``max_completion_tokens=1`` when sent), ``n=1``, ``stream=false``
and loses what would make P generate more than one token or compute what nobody reads: ``best_of``,
``use_beam_search``, ``min_tokens``/``min_completion_tokens`` (vLLM rejects ``min_tokens > max_tokens``),
``stream_options``, ``logprobs``, ``top_logprobs``, ``logprob_token_ids``, ``prompt_logprobs``, ``echo``.
What shapes the prompt (messages, templates, ``cache_salt``, ...) reaches both legs unchanged; D gets the
client's sampling fields as sent. Prompt logprobs (``prompt_logprobs``, or ``echo`` with logprobs) need
the prompt's logits where the answer is made and vLLM ignores external KV for them
(``skip_reading_prefix_cache``): such requests go to D alone rather than make P prefill for nothing. Here
the proxy differs from vllm-router on purpose: vllm-router sends both legs and, non-streaming, merges P's
reply into D's (P's ``prompt_logprobs``, and for completions the prompt part of P's ``logprobs`` arrays in
front of D's). D computes those logprobs itself either way, so the proxy's answer is one engine's without
P's prefill, and without the merge's second copy of the prompt in an echoed completion's ``logprobs``
(measured in ``tests/test_router.py``; ``docs/deployment.md``, "A router in front").

One P request feeds one D request. vLLM answers a ``/v1/completions`` request with a list of prompts with
the ``kv_transfer_params`` of the first prompt only, so the proxy splits such a list into one P/D pair per
prompt (run concurrently, each pair with its own fresh ``X-Request-Id``) and merges D's answers into one
response: choice ``j`` of prompt ``i`` gets index ``i * n + j`` (vLLM's order), ``usage`` is the sum, the rest is the first answer's; ``x-prefill-ms`` is the slowest
prefill leg, ``x-kv-transfer`` is ``1`` when every D leg got P's params. A streamed prompt list is refused
with a 400 naming ``prompt`` (send one request per prompt). ``n > 1`` stays one D request: vLLM forks it
into ``n`` children sharing P's params; D's connector lets the first take P's KV and the others compute
the prompt themselves.

Errors are JSON ``{"error": {"message", "type", "code", "side", "upstream_status", "param"}}`` (``code``:
the HTTP status answered, as in vLLM's own error bodies), ``side`` being
``prefill``, ``decode`` or ``proxy``: a malformed client body is a 400; an upstream 4xx keeps its status and
message (vLLM's 400 for a bad request stays a 400); an upstream 5xx, unreachable upstream or bad upstream
body is a 502; an upstream timeout is a 504. Timeouts are per read (``--read-timeout``: the longest wait
for the next bytes, so a long stream that keeps sending is never cut) and per connect
(``--connect-timeout``), never a total. A decode stream failing mid-way is logged and ends with an SSE
``data: {"error": ...}`` event, no ``[DONE]``. One ``aiohttp.ClientSession`` serves the app's lifetime.

Early registration (``--early-registration``, off by default): once the proxy has seen an answer of P (its
``kv_transfer_params`` name P's engine id and side channel), it sends each request to D at the same time as
to P, both legs carrying one fresh random ``transfer_id``: D allocates its blocks and registers them with P
while P prefills, and P writes them as soon as its prefill is done (or layer by layer with P's
``layer_push``). P's answer only refreshes what the proxy knows of P (a restarted P is re-learnt from it);
``x-prefill-ms`` is then P's leg as measured alongside D's, ``x-kv-transfer`` is ``early``. A failed P leg
is logged; D's load then fails on its own (P tells D when it can: an aborted prefill sends D a failure
notice; a dead P costs D its ``transfer_timeout_s``), and vLLM's ``kv_load_failure_policy`` applies. The
first request to each P, and requests P's answers never described, go the sequential way. Early
registration needs exactly one P behind ``--prefill``: D registers with the P whose answer the proxy saw
last, and a load balancer in front of several P engines would hand the request to another one (D's
registration then waits at the wrong P until its deadline). ``--prefill-pool`` says the prefill URL is such
a pool; the proxy then refuses ``--early-registration`` at start-up (run one proxy per P instead).

The bodies and the merge are pure functions in :mod:`vllm_dsa_connector.proxy.bodies` (re-exported here);
this module is the app: the legs' HTTP, timeouts, errors and early registration.

Alone: ``python -m vllm_dsa_connector.proxy.app --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.logger import init_logger

from vllm_dsa_connector.core.handoff.params import EarlyParams
from vllm_dsa_connector.proxy.bodies import (
    decode_body,
    merge_completions,
    needs_local_prefill,
    pair_request_id,
    prefill_body,
    prompt_list,
)

__all__ = ["make_app", "main"]

logger = init_logger("vllm." + __name__)

DEFAULT_READ_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
def _json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` parsed, when it is a JSON object."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class ProxyError(Exception):
    """An error answered to the client as JSON, naming the side that failed."""

    def __init__(self, status: int, side: str, etype: str, message: str,
                 upstream_status: int | None = None, param: Any = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.payload = {"error": {"message": message, "type": etype, "code": status, "side": side,
                                  "upstream_status": upstream_status, "param": param}}


def _upstream_status_error(side: str, status: int, data: bytes) -> ProxyError:
    """A non-200 answer: a 4xx keeps its status, anything else becomes a 502; upstream message kept."""
    err = obj = _json_object(data) or {}
    if isinstance(obj.get("error"), dict):  # vLLM: {"error": {"message", "type", "param", "code"}}
        err = obj["error"]
    message = str(err.get("message") or data.decode("utf-8", "replace")[:2000] or f"HTTP {status}")
    logger.warning("P/D proxy: %s server answered HTTP %d: %s", side, status, message[:200])
    return ProxyError(status if 400 <= status < 500 else 502, side,
                      str(err.get("type") or "upstream_error"), message, status, err.get("param"))


def _transport_error(side: str, url: str, exc: BaseException, mid_stream: bool = False) -> ProxyError:
    """A timeout (504) or a connection failure (502) talking to ``url``, logged."""
    what = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if isinstance(exc, TimeoutError):
        err = ProxyError(504, side, "upstream_timeout", f"{side} server {url} timed out ({what})")
    else:
        err = ProxyError(502, side, "upstream_unreachable", f"{side} server {url} failed ({what})")
    logger.log(logging.ERROR if mid_stream else logging.WARNING, "P/D proxy: %s%s", err.message,
               " (mid-stream: the client's stream ends here)" if mid_stream else "")
    return err


async def _post_json(session: aiohttp.ClientSession, side: str, url: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> tuple[bytes, dict[str, Any]]:
    """POST ``body`` and return the raw and parsed JSON object of a 200 answer, or raise ProxyError."""
    try:
        async with session.post(url, json=body, headers=headers) as r:
            status, data = r.status, await r.read()
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _transport_error(side, url, e) from e
    if status != 200:
        raise _upstream_status_error(side, status, data)
    if (obj := _json_object(data)) is None:
        raise ProxyError(502, side, "bad_upstream_response", f"{side} server {url} answered a body "
                         f"that is not a JSON object: {data[:200]!r}", status)
    return data, obj


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  headers: dict[str, str], upstream_headers: dict[str, str] | None = None) -> Response:
    """Stream D's answer; a failure mid-way is logged and ends the stream with an error event."""
    try:
        resp = await session.post(url, json=body, headers=upstream_headers)
        if resp.status != 200:
            async with resp:
                data = await resp.read()
    except (TimeoutError, aiohttp.ClientError) as e:
        raise _transport_error("decode", url, e) from e
    if resp.status != 200:
        raise _upstream_status_error("decode", resp.status, data)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            err = _transport_error("decode", url, e, mid_stream=True)
            yield b"\n\ndata: " + json.dumps(err.payload).encode() + b"\n\n"
        finally:
            resp.close()

    return StreamingResponse(chunks(), headers=headers, media_type="text/event-stream")


def make_app(prefill_url: str, decode_url: str, timeout_s: float = DEFAULT_READ_TIMEOUT_S, *,
             connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, early_registration: bool = False,
             prefill_pool: bool = False) -> FastAPI:
    """The proxy as a FastAPI app.

    ``timeout_s`` is the read timeout: the longest wait for the next bytes of an upstream answer (not
    a total). ``connect_timeout_s`` bounds each connect. Both must be > 0. ``early_registration``: send
    D its leg together with P's (see the module docstring). ``prefill_pool``: ``prefill_url`` is a load
    balancer or pool of several P engines, which early registration cannot serve (``ValueError``).
    """
    if early_registration and prefill_pool:
        raise ValueError(
            f"early registration needs exactly one prefill engine behind {prefill_url}, which is a pool "
            "(--prefill-pool): D would register its blocks with the P that answered last, not the one the pool "
            "gives the request to. Drop --early-registration, or run one proxy per prefill engine")
    for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                    sock_connect=connect_timeout_s, sock_read=timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # limit=0: no pool cap, so long streams never make other requests wait for a connection
        app.state.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        try:
            yield
        finally:
            await app.state.session.close()

    app = FastAPI(title="vllm-dsa P/D proxy", lifespan=lifespan)
    known_p: dict[str, Any] = {}  # P's last kv_transfer_params (its engine id and side channel)
    background: set[asyncio.Task[Any]] = set()  # early P legs still running after D answered

    async def prefill(session: aiohttp.ClientSession, path: str, body: dict[str, Any], ids: dict[str, str],
                      pbody: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, float]:
        """The prefill leg (``pbody``: its body when already made, else :func:`prefill_body` of ``body``): P's
        ``kv_transfer_params`` (``None`` when it returned none) and its time in ms."""
        t0 = time.perf_counter()
        _, pre = await _post_json(session, "prefill", prefill_url + path, pbody or prefill_body(body), ids)
        prefill_ms = (time.perf_counter() - t0) * 1000
        params = pre.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise ProxyError(502, "prefill", "bad_upstream_response",
                             f"kv_transfer_params is not an object: {params!r}", 200)
        if not params:
            logger.warning_once("P/D proxy: the prefill server returned no kv_transfer_params "
                                "(no KV connector on P?): D computes the prompt itself")
        elif early_registration:
            known_p.clear()
            known_p.update(params)
        return params or None, prefill_ms

    def early_leg(session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                  ids: dict[str, str]) -> tuple[dict[str, Any], asyncio.Task[tuple[dict[str, Any] | None, float]]] | None:
        """Early registration: start P's leg with a fresh transfer id now and return D's params for the same
        id with P's running leg; ``None`` when the proxy knows no DSAConnector P yet (sequential then)."""
        if not early_registration or not known_p:
            return None
        tid = secrets.token_hex(16)
        early = EarlyParams.from_answer(known_p, tid)
        if early is None:
            return None
        dparams, pbody = early.to_dict(), prefill_body(body, tid)

        async def leg() -> tuple[dict[str, Any] | None, float]:
            try:
                return await prefill(session, path, body, ids, pbody)
            except ProxyError as e:
                logger.warning("P/D proxy: early prefill leg failed (%s); D's load fails and vLLM's "
                               "kv_load_failure_policy applies", e.message)
                return None, 0.0

        task = asyncio.ensure_future(leg())
        background.add(task)
        task.add_done_callback(background.discard)
        return dparams, task

    async def split(session: aiohttp.ClientSession, path: str, body: dict[str, Any], prompts: list[Any],
                    auth: dict[str, str], echo: dict[str, str]) -> Response:
        """One P/D pair per prompt (concurrently, each with its own request id), D's answers merged into one
        completion."""

        async def pair(i: int, prompt: Any) -> tuple[dict[str, Any], bool, float]:
            one = {**body, "prompt": prompt}
            ids = {**auth, "X-Request-Id": pair_request_id(prefill_url, decode_url)}
            if (early := early_leg(session, path, one, ids)) is not None:
                _, answer = await _post_json(session, "decode", decode_url + path, decode_body(one, early[0]), ids)
                return answer, True, (await early[1])[1]
            params, prefill_ms = await prefill(session, path, one, ids)
            _, answer = await _post_json(session, "decode", decode_url + path, decode_body(one, params), ids)
            return answer, params is not None, prefill_ms

        done = []
        for r in await asyncio.gather(*(pair(i, p) for i, p in enumerate(prompts)), return_exceptions=True):
            if isinstance(r, BaseException):  # every pair has ended: the first failure answers the client
                raise r
            done.append(r)
        n = body.get("n")
        merged = merge_completions([answer for answer, _, _ in done], n if isinstance(n, int) and n > 0 else 1)
        headers = {"x-prefill-ms": f"{max(ms for _, _, ms in done):.3f}",
                   "x-kv-transfer": "1" if all(got for _, got, _ in done) else "0", **echo}
        return JSONResponse(merged, headers=headers)

    async def forward(path: str, request: Request) -> Response:
        session: aiohttp.ClientSession = request.app.state.session
        echo = {"x-request-id": c} if (c := request.headers.get("x-request-id")) else {}
        try:
            if (body := _json_object(await request.body())) is None:
                raise ProxyError(400, "proxy", "invalid_request_error",
                                 "the request body must be a JSON object (malformed JSON?)")
            params, prefill_ms = None, 0.0
            # One fresh request id per P/D pair on both legs, as vllm-router makes them (vLLM's
            # NixlPushConnector matches D's registration to P's finished request by it); the client's own
            # is echoed in the response only. The client's credentials reach both engines.
            auth = {"Authorization": a} if (a := request.headers.get("authorization")) else {}
            ids = {**auth, "X-Request-Id": pair_request_id(prefill_url, decode_url)}
            if not needs_local_prefill(body, chat=path == "/v1/chat/completions"):
                prompts = prompt_list(body) if path == "/v1/completions" else None
                if prompts is not None:
                    if body.get("stream"):
                        raise ProxyError(400, "proxy", "invalid_request_error",
                                         f"the P/D proxy does not stream a list of {len(prompts)} prompts (P "
                                         "hands KV to D per prompt): send one request per prompt, or "
                                         "stream=false", param="prompt")
                    return await split(session, path, body, prompts, auth, echo)
                if (early := early_leg(session, path, body, ids)) is not None:
                    return await early_forward(session, path, body, ids, early, echo)
                params, prefill_ms = await prefill(session, path, body, ids)
            headers = {"x-prefill-ms": f"{prefill_ms:.3f}", "x-kv-transfer": "1" if params else "0", **echo}
            dbody = decode_body(body, params)
            if body.get("stream"):
                return await _stream(session, decode_url + path, dbody, headers, ids)
            data, _ = await _post_json(session, "decode", decode_url + path, dbody, ids)
            return Response(data, headers=headers, media_type="application/json")
        except ProxyError as e:
            return JSONResponse(e.payload, status_code=e.status, headers=echo)

    async def early_forward(session: aiohttp.ClientSession, path: str, body: dict[str, Any], ids: dict[str, str],
                            early: tuple[dict[str, Any], asyncio.Task[tuple[dict[str, Any] | None, float]]],
                            echo: dict[str, str]) -> Response:
        """D's leg of an early registration, sent while P's leg runs."""
        dparams, task = early
        dbody = decode_body(body, dparams)
        if body.get("stream"):
            return await _stream(session, decode_url + path, dbody, {"x-kv-transfer": "early", **echo}, ids)
        data, _ = await _post_json(session, "decode", decode_url + path, dbody, ids)
        _, prefill_ms = await task
        return Response(data, headers={"x-prefill-ms": f"{prefill_ms:.3f}", "x-kv-transfer": "early", **echo},
                        media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"ok": True})

    return app


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--prefill URL --decode URL [--host H] [--port N] [--read-timeout S] [--connect-timeout S]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", required=True, help="prefill server base URL")
    p.add_argument("--decode", required=True, help="decode server base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--read-timeout", type=_seconds, default=DEFAULT_READ_TIMEOUT_S,
                   help="longest wait in seconds for the next bytes of an upstream answer, between "
                        "stream chunks included; not a total (default: %(default)s)")
    p.add_argument("--connect-timeout", type=_seconds, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="longest wait in seconds to connect to an upstream (default: %(default)s)")
    p.add_argument("--early-registration", action="store_true",
                   help="send each request to D together with P (one transfer id on both legs), so D registers "
                        "its blocks while P prefills; needs DSAConnector on both and one P behind --prefill "
                        "(default: off)")
    p.add_argument("--prefill-pool", action="store_true",
                   help="--prefill is a load balancer or pool of several prefill engines (refuses "
                        "--early-registration, which needs the one P that prefills each request)")
    a = p.parse_args(argv)
    import uvicorn

    try:
        app = make_app(a.prefill, a.decode, a.read_timeout, connect_timeout_s=a.connect_timeout,
                       early_registration=a.early_registration, prefill_pool=a.prefill_pool)
    except ValueError as e:
        p.error(str(e))
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
