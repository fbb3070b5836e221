"""A capture proxy: the baseline for in-replica capture (`benchmarks/capture.py`).

Why it exists: systems whose inference servers do not record what they sampled (a stock vLLM or
SGLang behind an agent harness) capture trajectories with a proxy in the OpenAI path. The proxy
rewrites every chat request to ask for `return_token_ids` and `logprobs`, forwards it, records the
prompt ids, completion ids and logprobs of the answer under the call's session id, strips the
fields the client did not ask for (so the client sees a normal response), and serves the
session's record at the end. This is that proxy, kept small, so the benchmark can measure what
its extra hop, its JSON re-encoding and its larger upstream answers cost against a replica that
captures by itself.

Endpoints (the same shapes as a burstrl replica's, so the benchmark reads both alike):
`POST /v1/chat/completions` (non-streaming), `GET /v1/traces/{session_id}` ->
`{"session_id", "calls": [{"prompt_ids", "completion_ids", "logprobs", "finish_reason"}]}`,
`DELETE /v1/traces/{session_id}` (forgets the record; the replica-side session is the caller's
to release). Session id: body `session_id` or header `X-Session-ID` / `X-SMG-Routing-Key` /
`X-Dynamo-Session-ID`; it is forwarded so the replica keeps the session's KV cache.

    .venv/bin/python benchmarks/capture_proxy.py --upstream http://127.0.0.1:8000 --port 0
    # prints {"event": "ready", "url": ...} once listening
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from burstrl.protocol.http import SESSION_HEADERS
from burstrl.protocol.process import bind_socket, print_ready, socket_url

FORWARD_HEADERS = (*SESSION_HEADERS, "authorization")


def session_id(body: dict[str, Any], request: Request) -> str | None:
    if body.get("session_id"):
        return str(body["session_id"])
    for name in SESSION_HEADERS:
        if request.headers.get(name):
            return request.headers[name]
    return None


def record_of(data: dict[str, Any]) -> dict[str, Any]:
    """What the trainer needs from one answer that was asked for ids and logprobs."""
    choice = data["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    return {"prompt_ids": data.get("prompt_token_ids") or choice.get("prompt_token_ids") or [],
            "completion_ids": choice.get("token_ids") or [],
            "logprobs": [item["logprob"] for item in content],
            "finish_reason": choice.get("finish_reason")}


def strip(data: dict[str, Any], want_ids: bool, want_logprobs: bool) -> dict[str, Any]:
    """Remove what the proxy added, so the client gets the answer it asked for."""
    if not want_ids:
        data.pop("prompt_token_ids", None)
    for choice in data.get("choices", []):
        if not want_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not want_logprobs:
            choice["logprobs"] = None
    return data


def build_app(upstream: str, on_ready: Any = None) -> FastAPI:
    records: dict[str, list[dict[str, Any]]] = {}
    client = httpx.AsyncClient(base_url=upstream, timeout=300)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield
        await client.aclose()

    app = FastAPI(title="capture proxy", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        if body.get("stream"):
            return JSONResponse({"error": {"message": "streaming is not supported by this proxy"}}, 400)
        sid = session_id(body, request)
        want_ids, want_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        forwarded = dict(body, return_token_ids=True, logprobs=True)
        headers = {k: request.headers[k] for k in FORWARD_HEADERS if k in request.headers}
        r = await client.post("/v1/chat/completions", json=forwarded, headers=headers)
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        data = r.json()
        if sid is not None:
            records.setdefault(sid, []).append(record_of(data))
        return JSONResponse(strip(data, want_ids, want_logprobs))

    @app.get("/v1/traces/{sid:path}")
    async def get_trace(sid: str) -> Response:
        if sid not in records:
            return JSONResponse({"error": {"message": f"unknown session {sid!r}"}}, 404)
        return JSONResponse({"session_id": sid, "calls": records[sid]})

    @app.delete("/v1/traces/{sid:path}")
    async def delete_trace(sid: str) -> Response:
        calls = records.pop(sid, None)
        if calls is None:
            return JSONResponse({"error": {"message": f"unknown session {sid!r}"}}, 404)
        return JSONResponse({"session_id": sid, "released": True, "calls": len(calls)})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the replica's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    sock = bind_socket(args.host, args.port)
    url = socket_url(sock)
    config = uvicorn.Config(build_app(args.upstream.rstrip("/"), lambda: print_ready(url)), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
