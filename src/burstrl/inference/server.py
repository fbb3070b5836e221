"""The replica's HTTP API: OpenAI-compatible generation, capture, adapters, load and metrics.

Every error from outside is a 4xx JSON body in OpenAI's shape (`{"error": {"message", ...}}`),
unknown routes and malformed parameters included, never a traceback, and one bad request never
disturbs the others: a request that fails inside the engine gets a 500 naming the cause and the
engine serves on. A replica whose engine is dead says so on `/health`, `/v1/loads` and
`/v1/models` (503), so the router drops it. A client that disconnects mid-request has its
request aborted at the next token boundary, freeing its batch slot.

No request's size holds the others: a generation body is checked against the limits
(`inference.limits`: JSON values, characters, token ids, messages, nesting) before it is parsed,
rendered or tokenized, and all of that runs on the replica's request workers
(`inference.workers`), so the event loop only moves bytes and answers `/health` and `/v1/loads` on time.

Traces hold prompts and completions: reading them, and the per-session part of `/v1/loads`,
needs the admin token or the cluster token (the router's scrapes).

With `server.tenant_key` set the replica is shared by tenants: each route first asks
`inference.tenancy` who is calling, and every name in the request goes through that caller into
its tenant's namespace (sessions, versions, `cache_salt`, traces), so tenants never reach each other.

The routes are FastAPI `APIRouter`s (generation, traces and loads here, adapters in `admin_routes`)
that find the replica on `request.app.state.replica`; `build_app` puts it there and adds the error
handlers, and `run_replica` runs the whole process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from burstrl.config import ServeConfig
from burstrl.inference import admin_routes, tenancy
from burstrl.inference import generate_api as gen
from burstrl.inference import openai_api as api
from burstrl.inference.api_common import (
    ApiError,
    decode_request,
    first_error,
    is_reader,
    parse,
    read_limited,
    replica_of,
    require_engine,
)
from burstrl.inference.chat import ChatError, normalize_messages
from burstrl.inference.engine import Request as EngineRequest
from burstrl.inference.limits import check_chat, check_completion
from burstrl.inference.metrics import prometheus_text
from burstrl.inference.replica import InferenceReplica, build_replica
from burstrl.inference.sessions import SessionError
from burstrl.inference.streaming import stream_response
from burstrl.inference.tools import ToolError, ToolSpec, tool_spec
from burstrl.protocol.http import error_body, models_list, session_id_from
from burstrl.protocol.process import bind_socket, print_ready, socket_url
from burstrl.protocol.tenants import local

log = logging.getLogger(__name__)

router = APIRouter()


def build_app(rep: InferenceReplica, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The replica's app: its routes, OpenAI-shaped errors, and `rep` on `app.state.replica`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="burstrl replica", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.replica = rep

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        if exc.status < 500:
            rep.counters.bad_requests += 1
        return JSONResponse(error_body(exc.status, exc.message, exc.kind), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:  # unknown route, bad method
        rep.counters.bad_requests += 1
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(exc.status_code, str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        rep.counters.bad_requests += 1
        return JSONResponse(error_body(400, first_error(exc.errors())), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    app.include_router(router)
    app.include_router(admin_routes.router)
    return app


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    require_engine(replica_of(request))
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    require_engine(rep)
    caller = tenancy.viewing(rep, request)
    names = [rep.cfg.served_model_name, *caller.visible(rep.registry.names())]
    roots = {caller.shown(n): path for n, path in rep.registry.paths().items() if caller.sees(n)}
    body = models_list(names, rep.cfg.model.path, rep.cfg.served_model_name, roots, rep.max_model_len)
    body["engine_path"] = rep.engine.path  # "fast", "generic" (own engine) or "vllm"
    return body


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    rep = replica_of(request)
    caller = tenancy.generating(rep, request)
    if rep.chat is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    raw = await read_limited(request, rep.cfg.server.max_body_bytes)
    body, messages, tools = await rep.workers.run(_prepare_chat, rep, raw)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await _generate(rep, request, caller, body, "chat", messages=messages, tools=tools, top_logprobs=top,
                           max_tokens=max_tokens, want_logprobs=bool(body.logprobs))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    rep = replica_of(request)
    caller = tenancy.generating(rep, request)
    raw = await read_limited(request, rep.cfg.server.max_body_bytes)
    body, prompt = await rep.workers.run(_prepare_completion, rep, raw)
    top = body.logprobs or 0
    max_tokens = body.max_tokens if body.max_tokens is not None else api.COMPLETIONS_DEFAULT_MAX_TOKENS
    return await _generate(rep, request, caller, body, "text", prompt_ids=prompt, top_logprobs=top,
                           max_tokens=max_tokens, want_logprobs=body.logprobs is not None)


@router.post(gen.PATH)
async def generate(request: Request) -> Response:
    """vLLM's token-in endpoint (verifiers' train client): a completions call run by `_generate` (`generate_api`)."""
    rep = replica_of(request)
    caller = tenancy.generating(rep, request)
    raw = await read_limited(request, rep.cfg.server.max_body_bytes)
    body, prompt = await rep.workers.run(_prepare_generate, rep, raw)
    top = body.logprobs or 0
    return await _generate(rep, request, caller, body, "generate", prompt_ids=prompt, top_logprobs=top,
                           max_tokens=body.max_tokens, want_logprobs=body.logprobs is not None)


@router.get("/v1/traces/{session_id:path}")
async def get_trace(session_id: str, request: Request, full: bool = False) -> dict[str, Any]:
    """The session's records: deltas (`inference.capture`), or with `?full=true` whole prompts."""
    rep = replica_of(request)
    caller = tenancy.reading_traces(rep, request)
    session = rep.sessions.get(caller.name(session_id))
    if session is None:
        raise ApiError(404, f"unknown session {session_id!r}", "not_found_error")
    calls = await rep.workers.run(session.capture.calls_json, full)
    for call in calls:  # a tenant's trace names its versions as it does (`policy-v3`, not `run-a~policy-v3`)
        call["version"] = caller.shown(call["version"])
    return {"session_id": session_id, "version": caller.shown(session.version), "busy": session.busy,
            "calls": calls, **session.capture.summary()}


@router.delete("/v1/traces/{session_id:path}")
async def delete_trace(session_id: str, request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    caller = tenancy.owning(rep, request)
    key = caller.name(session_id)
    try:
        session = rep.sessions.release(key)
    except SessionError as exc:
        raise ApiError(exc.status, caller.say(str(exc))) from None
    rep.engine.drop_session(key)
    rep.collect_retired()
    return {"session_id": session_id, "released": True, "calls": len(session.calls)}


@router.get("/v1/loads")
async def loads(request: Request) -> dict[str, Any]:
    rep = replica_of(request)
    require_engine(rep)
    out = rep.engine.loads()
    if not is_reader(rep, request):  # session ids and sizes are for the fleet, not for anyone
        out.pop("sessions")
    else:  # which prefixes are cached, for the router's index (keys only, no tokens)
        out["prefix_blocks"] = rep.engine.prefix_summary()
    caller = tenancy.viewing(rep, request)
    out["versions"] = [rep.cfg.served_model_name, *caller.visible(rep.registry.names())]
    out["retiring_versions"] = caller.visible(list(rep.registry.retiring))
    return out


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(prometheus_text(replica_of(request)), media_type="text/plain; version=0.0.4")


def _prepare_chat(rep: InferenceReplica, raw: bytes) -> tuple[api.ChatRequest, list[dict[str, Any]], ToolSpec | None]:
    """On a request worker: a chat body checked against the limits, validated, its messages
    normalized and its tools checked (`inference.tools`)."""
    body = parse(api.ChatRequest, decode_request(raw, rep.limits, check_chat))
    try:
        tools = tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls)
        return body, normalize_messages(body.messages), tools
    except (ChatError, ToolError) as exc:
        raise ApiError(400, str(exc)) from None


def _prepare_completion(rep: InferenceReplica, raw: bytes) -> tuple[api.CompletionRequest, list[int]]:
    """On a request worker: a completions body checked against the limits, validated, its prompt tokenized."""
    body = parse(api.CompletionRequest, decode_request(raw, rep.limits, check_completion))
    return body, _completion_prompt(rep, body)


def _prepare_generate(rep: InferenceReplica, raw: bytes) -> tuple[api.CompletionRequest, list[int]]:
    """On a request worker: a generate body checked against the limits, validated, as a completions request."""
    data = decode_request(raw, rep.limits, gen.check_generate)
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    body = gen.to_completion(gen.parse_generate(data))
    return body, _completion_prompt(rep, body)


def _completion_prompt(rep: InferenceReplica, body: Any) -> list[int]:
    """Token ids of a completions prompt: text, token ids, or a one-element batch of either."""
    ids = body.input_ids if body.input_ids is not None else body.prompt
    if isinstance(ids, list) and ids and isinstance(ids[0], (str, list)):
        if len(ids) != 1:
            raise ApiError(400, "batch prompts are not supported: send one request per prompt")
        ids = ids[0]
    if ids is None or len(ids) == 0:
        raise ApiError(400, "prompt (text or token ids) or input_ids is required")
    if isinstance(ids, str):
        return rep.tokenizer.encode(ids, add_special_tokens=body.add_special_tokens)
    if any(not 0 <= t < rep.engine.vocab_size for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {rep.engine.vocab_size})")
    return ids


async def _generate(rep: InferenceReplica, request: Request, caller: tenancy.Caller, body: Any, kind: str, *,
                    top_logprobs: int, max_tokens: int | None, want_logprobs: bool, messages: list | None = None,
                    tools: ToolSpec | None = None, prompt_ids: list[int] | None = None) -> Response:
    n = _samples(body)
    client_sid = session_id_from(body.session_id, request.headers)
    sid = caller.session(client_sid)  # the session's key: in the caller's namespace
    rid = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
    if n == 1:
        req, events = await _start(rep, caller, body, sid, rid, None, messages, tools, prompt_ids, max_tokens, top_logprobs)
        if body.stream:
            return StreamingResponse(stream_response(rep, req, events, body, kind, want_logprobs),
                                     media_type="text/event-stream")
        return JSONResponse(await _answer(rep, request, body, kind, req, events, want_logprobs))
    # a group in one request (GRPO): sample i is its own session `<sid>/i`, seeded `seed + i`
    started = []
    try:
        for i in range(n):
            started.append(await _start(rep, caller, body, sid and f"{sid}/{i}", f"{rid}-{i}", i, messages, tools,
                                        prompt_ids, max_tokens, top_logprobs))
        answers = [await _answer(rep, request, body, kind, req, events, want_logprobs) for req, events in started]
    except BaseException:
        for req, _ in started:
            rep.engine.abort(req.id)
        raise
    return JSONResponse(_merge(answers, rid, client_sid))


MAX_SAMPLES = 64  # `n` per request


def _samples(body: Any) -> int:
    n = 1 if body.n is None else body.n
    if type(n) is not int or not 1 <= n <= MAX_SAMPLES:
        raise ApiError(400, f"n must be an integer from 1 to {MAX_SAMPLES}")
    if n > 1 and body.stream:
        raise ApiError(400, "n > 1 is answered whole, not streamed: send stream=false, or one request per sample")
    return n


async def _start(rep: InferenceReplica, caller: tenancy.Caller, body: Any, sid: str | None, rid: str, sample: int | None,
                 messages: list | None, tools: ToolSpec | None, prompt_ids: list[int] | None,
                 max_tokens: int | None, top_logprobs: int) -> tuple[EngineRequest, asyncio.Queue[str]]:
    """Begin one call's session and hand the call to the engine; its events queue says when it is done."""
    existing = rep.sessions.get(sid) if sid else None
    version = caller.version(body.model, rep.cfg.served_model_name)
    adapter = _resolve_adapter(rep, caller, body.model, version, existing is not None)
    try:
        session = rep.sessions.begin(sid, version, rid)
    except SessionError as exc:
        raise ApiError(exc.status, caller.say(str(exc))) from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[str] = asyncio.Queue()
    try:  # until the engine owns the request, every way out must free the session
        if messages is not None:  # rendered and tokenized off the loop; the session stays busy meanwhile
            prompt_ids = await rep.workers.run(_chat_prompt, rep, messages, tools, session)
        _check_extends(rep, session, prompt_ids)
        params = _params(rep, body, prompt_ids, max_tokens, top_logprobs)
        if sample is not None and params.seed is not None:
            params.seed += sample
        req = EngineRequest(
            id=rid, session=session, prompt_ids=prompt_ids, params=params, version=version,
            adapter=adapter, messages=messages, tools=tools, cache_salt=caller.salt(body.cache_salt),
            on_done=lambda _: _notify(loop, events, "done"),
            on_token=(lambda _: _notify(loop, events, "token")) if body.stream else None,
        )
        rep.engine.submit(req)
    except RuntimeError as exc:
        rep.sessions.end(session)
        raise ApiError(503, str(exc), "server_error") from None
    except BaseException:
        rep.sessions.end(session)
        raise
    return req, events


async def _answer(rep: InferenceReplica, request: Request, body: Any, kind: str, req: EngineRequest,
                  events: asyncio.Queue[str], want_logprobs: bool) -> dict[str, Any]:
    await _wait_done(rep, request, req, events)
    if req.error is not None:
        raise ApiError(500, f"engine error: {req.error}", "server_error")
    build = {"chat": api.chat_response, "text": api.completion_response, "generate": gen.generate_response}[kind]
    return build(req, body.model, body.return_token_ids, want_logprobs, rep.text)


def _merge(answers: list[dict[str, Any]], rid: str, sid: str | None) -> dict[str, Any]:
    """One answer with a choice per sample (index i); usage counts the prompt once, as OpenAI does."""
    body = dict(answers[0])
    body["id" if "id" in body else "request_id"] = rid
    body["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    done = sum(a["usage"]["completion_tokens"] for a in answers)
    body["usage"] = {**body["usage"], "completion_tokens": done, "total_tokens": body["usage"]["prompt_tokens"] + done}
    body["meta_info"] = {**body["meta_info"], "session_id": sid,
                         "session_ids": [a["meta_info"]["session_id"] for a in answers],
                         "cached_tokens": [a["meta_info"]["cached_tokens"] for a in answers]}
    return body


def _chat_prompt(rep: InferenceReplica, messages: list[dict[str, Any]], tools: ToolSpec | None,
                 session: Any) -> list[int]:
    """On a request worker: the chat prompt's ids (`chat.ChatTokenizer`), its refusals as 400s."""
    try:
        return rep.chat.prompt_ids(messages, session, tools)
    except ChatError as exc:
        raise ApiError(400, str(exc)) from None


def _check_extends(rep: InferenceReplica, session: Any, prompt_ids: list[int]) -> None:
    """With `engine.diverged_calls = "refuse"`, a call must extend its session's previous call: the
    session belongs to the history of its first caller, not to whoever knows its id."""
    if rep.cfg.engine.diverged_calls != "refuse" or session.ephemeral or not session.completion_ids:
        return
    head = session.history()
    if prompt_ids[:len(head)] != head:
        raise ApiError(409, f"session {local(session.id)!r}: this prompt does not extend the session's previous "
                            "call (edited history or another client); start a new session")


def _notify(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[str], event: str) -> None:
    """Called from the engine thread; the loop is gone only when the server is shutting down."""
    if not loop.is_closed():
        loop.call_soon_threadsafe(events.put_nowait, event)


def _resolve_adapter(rep: InferenceReplica, caller: tenancy.Caller, model: str, version: str,
                     existing_session: bool) -> Any:
    """The adapter of registry name `version` (the request's `model` in the caller's namespace)."""
    if version == rep.cfg.served_model_name:
        return None
    try:
        if existing_session:
            return rep.registry.for_session(version)
        return rep.registry.for_new_session(version)
    except KeyError:
        served = [rep.cfg.served_model_name, *caller.visible(rep.registry.names())]
        raise ApiError(404, f"model {model!r} not found; served: {served}", "not_found_error") from None


def _params(rep: InferenceReplica, body: Any, prompt_ids: list[int], max_tokens: int | None, top_logprobs: int) -> Any:
    limit = rep.max_model_len
    if len(prompt_ids) >= limit:
        raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; this model's maximum context "
                            f"length is {limit} tokens")
    if max_tokens is None:  # chat without a limit: the rest of the context, as vLLM does
        max_tokens = limit - len(prompt_ids)
    if max_tokens < 1:
        raise ApiError(400, "max_tokens (or max_completion_tokens) must be at least 1")
    if len(prompt_ids) + max_tokens > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; you requested "
                            f"{len(prompt_ids)} prompt + {max_tokens} completion tokens")
    try:
        return api.sampling_params(body, max_tokens, top_logprobs, rep.engine.vocab_size)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


async def _wait_done(rep: InferenceReplica, request: Request, req: EngineRequest, events: asyncio.Queue[str]) -> None:
    """Wait for the engine; abort the request if the client goes away meanwhile."""
    while True:
        try:
            await asyncio.wait_for(events.get(), timeout=0.5)
            return
        except TimeoutError:
            if await request.is_disconnected():
                rep.counters.client_disconnects += 1
                rep.engine.abort(req.id)
                await events.get()
                return


def _exit_after_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_replica(cfg: ServeConfig) -> None:
    """Run a replica until SIGINT/SIGTERM; prints a ready line with the URL once listening."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replica = build_replica(cfg)
    sock = bind_socket(cfg.server.host, cfg.server.port)
    url = socket_url(sock, tls=bool(cfg.server.ssl_certfile))
    app = build_app(replica, on_ready=lambda: print_ready(url))
    config = uvicorn.Config(app, log_level="warning", ssl_certfile=cfg.server.ssl_certfile or None,
                            ssl_keyfile=cfg.server.ssl_keyfile or None, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def engine_died(error: str) -> None:  # 503 for a while, then exit so the fleet replaces us
        log.error("engine died (%s): answering 503, exiting in %.1f s", error, cfg.server.dead_engine_exit_s)
        timer = threading.Timer(cfg.server.dead_engine_exit_s, lambda: setattr(server, "should_exit", True))
        timer.daemon = True  # owned by the process, which ends when it fires
        timer.start()

    replica.engine.on_fatal = engine_died
    # uvicorn re-raises a SIGTERM it caught once it has stopped serving; with the default handler that
    # would end the process before `close` (a vLLM engine's children would outlive the replica)
    signal.signal(signal.SIGTERM, _exit_after_sigterm)
    try:
        server.run(sockets=[sock])
    finally:
        replica.close()
    if replica.engine.error is not None:
        raise SystemExit(f"replica stopped: engine died: {replica.engine.error}")
