"""A small P/D proxy for OpenAI-compatible vLLM servers (what ``vllm-dsa demo`` runs).

For every ``/v1/chat/completions`` or ``/v1/completions`` request:

1. send it to the prefill server with ``max_tokens=1`` (streaming off) and
   ``kv_transfer_params={"do_remote_decode": true}``;
2. send the original request to the decode server with the ``kv_transfer_params`` P returned (P's engine
   id, request id and side channel: the connector on D takes it from there);
3. return (or stream) D's answer. The response headers carry ``x-prefill-ms``.

Run it alone::

    python -m vllm_dsa_connector.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["make_app", "main"]


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    """The proxy as a FastAPI app."""
    app = FastAPI(title="vllm-dsa P/D proxy")
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(prefill_url + path, json=_prefill_body(body)) as r:
                if r.status != 200:
                    return Response(await r.read(), status_code=r.status, media_type="application/json")
                pre = await r.json()
        prefill_ms = (time.perf_counter() - t0) * 1000
        params = pre.get("kv_transfer_params")
        dbody = dict(body)
        if params:
            dbody["kv_transfer_params"] = params
        headers = {"x-prefill-ms": f"{prefill_ms:.3f}", "x-kv-transfer": "1" if params else "0"}
        if body.get("stream"):
            session = aiohttp.ClientSession(timeout=timeout)
            resp = await session.post(decode_url + path, json=dbody)

            async def gen():  # noqa: ANN202
                try:
                    async for chunk in resp.content.iter_any():
                        yield chunk
                finally:
                    resp.release()
                    await session.close()

            return StreamingResponse(gen(), status_code=resp.status, headers=headers,
                                     media_type="text/event-stream")
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(decode_url + path, json=dbody) as r:
                data = await r.read()
                return Response(data, status_code=r.status, headers=headers, media_type="application/json")

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


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--prefill URL --decode URL --port N``."""
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    uvicorn.run(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host, port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
