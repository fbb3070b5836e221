"""The router's HTTP API: the replicas' OpenAI surface, a replica registry, and placement.

Why a proxy and not a redirect: OpenAI clients follow neither redirects on POST nor custom
headers, so the router forwards each call (streams event by event) to the replica the registry
picks. Every upstream call has an overall deadline (`burstrl.deadline`: a replica dripping its answer a
byte at a time cannot hold a call, a scrape or a stream past it); a replica that refuses connections is dropped and the
call retried once on the session's new home, so a dying replica costs a cache miss, not a rollout,
and a caller gets either an answer or a clear JSON error, never a hang. A call the replica may
already have run (the connection broke after it was sent) is never retried, since it would run
twice: the replica is dropped and the caller gets a 503 (mid-stream: a final SSE error event and
no `[DONE]`) that is safe to retry, because the session's next call goes to another replica.
What a replica answers is relayed with caps (`relay.py`); replicas are scraped by `scrape.Scraper`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException

from burstrl.config import RouteConfig
from burstrl.deadline import CallFailed
from burstrl.protocol.blocks import BLOCK_TOKENS, cache_scope, prefix_block_hashes
from burstrl.protocol.http import (
    SESSION_ID,
    BodyTooLarge,
    bearer_matches,
    error_body,
    models_list,
    read_body,
    session_id_from,
)
from burstrl.protocol.process import bind_socket, print_ready, socket_url
from burstrl.router.fleet_routes import add_fleet_routes
from burstrl.router.metrics import prometheus_text
from burstrl.router.registry import LATEST, Registry, RouteError, validate_url
from burstrl.router.relay import drop, forward
from burstrl.router.scrape import Scraper
from burstrl.router.shares import Shares
from burstrl.router.tenancy import FLEET, RouteCaller, check_served, generating, reading, resolve
from burstrl.router.text_keys import CHUNK_TOKENS, text_prefix_keys
from burstrl.router.traces import forward_trace
from burstrl.router.visibility import Viewer, replicas_answer, stats_answer, viewer

log = logging.getLogger(__name__)

VERSION_HEADER = "X-Burstrl-Version"  # the version a call ran on (`latest` resolved)
KIND_HEADER = "x-task-kind"  # the task kind that sizes a new session (also the body's `task_kind`)
MAX_KIND_CHARS = 128
MAX_TOKENS_HINT = 1 << 40  # expected_tokens above this is not a size, it is an overflow

SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escaped or raw UTF-16 surrogate


def cluster_token(cfg: RouteConfig) -> str:
    """Configured token, else $BURSTRL_CLUSTER_TOKEN, else a fresh one printed to stderr."""
    token = cfg.cluster_token or os.environ.get("BURSTRL_CLUSTER_TOKEN", "")
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"cluster token: {token}", file=sys.stderr, flush=True)
    return token


def session_id_of(body: dict[str, Any], headers: Any) -> str | None:
    """The session of a call: `session_id` in the body, else the first session header set.

    An id the replicas would refuse is refused here, before it takes a place in the router's maps.
    """
    sid = session_id_from(body.get("session_id"), headers)
    if sid is not None and not SESSION_ID.fullmatch(sid):
        raise RouteError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
    return sid


def task_kind_of(body: dict[str, Any], headers: Any) -> str:
    """The task kind of a call: `task_kind` in the body, else the `X-Task-Kind` header, else `default`."""
    kind = body.get("task_kind", headers.get(KIND_HEADER) or "default")
    if not isinstance(kind, str) or not kind or len(kind) > MAX_KIND_CHARS:
        raise RouteError(400, f"task_kind must be a non-empty string of at most {MAX_KIND_CHARS} characters")
    return kind


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 that says why.

    Why more than `json.loads`: a body nested deeper than the interpreter's stack raises
    RecursionError, and a lone UTF-16 surrogate (`"\\ud800"`) parses but cannot be encoded back,
    so it would fail later, in an error message or a forwarded body, as a 500.
    """
    try:
        body = json.loads(raw)
        if SURROGATE_HINT.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except (json.JSONDecodeError, UnicodeError) as exc:
        raise RouteError(400, f"malformed JSON body: {type(exc).__name__}: {exc}"[:300]) from None
    except RecursionError:
        raise RouteError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise RouteError(400, "request body must be a JSON object")
    return body


def first_call_tokens(body: dict[str, Any]) -> int:
    """A lower bound on the session's size from the call itself: token-in prompt plus max_tokens.

    Why: at placement the size model only knows the task kind; a token-in call already says how
    large the session is, so headroom need not guess for the part it can see. Text prompts give 0.
    `max_tokens` is top-level (OpenAI) or in `sampling_params` (vLLM's /inference/v1/generate).
    """
    ids = prompt_ids(body)
    sampling = body.get("sampling_params")
    max_tokens = body.get("max_tokens", sampling.get("max_tokens") if isinstance(sampling, dict) else None)
    n = len(ids)
    return min(MAX_TOKENS_HINT, n + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 and n else 0))


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The token ids of a token-in call (`input_ids`, `prompt` as ids or a one-element batch, or
    /inference/v1/generate's `token_ids`); else []."""
    ids = body.get("input_ids")
    if ids is None:
        ids = body.get("prompt")
    if ids is None:
        ids = body.get("token_ids")
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 1 << 31 for t in ids):
        return []
    return ids


def prompt_blocks(body: dict[str, Any], version: str, caller: RouteCaller = FLEET) -> tuple[int, ...]:
    """Prefix block keys of a token-in prompt, as the replicas summarise their caches (protocol.blocks).

    Text and chat prompts give none: the router holds no tokenizer (`prompt_keys` gives them text keys).
    """
    return tuple(prefix_block_hashes(prompt_ids(body), prompt_scope(body, version, caller)))


def prompt_scope(body: dict[str, Any], version: str, caller: RouteCaller = FLEET) -> str:
    """The seed of a prompt's keys: `version` as stored and the salt as the engine sees it (a tenant's is scoped)."""
    salt = body.get("cache_salt")
    return cache_scope(version, caller.salt(salt if isinstance(salt, str) else None))


def prompt_keys(body: dict[str, Any], version: str, caller: RouteCaller = FLEET,
                text: bool = True) -> tuple[tuple[int, ...], int]:
    """The prefix keys a new session is placed by, and tokens per key: token blocks, else (with `text`,
    `router.text_prefix_keys`) the chat or text prompt's chunk keys (`text_keys`), so a GRPO group's
    siblings follow the first to its replica."""
    blocks = prompt_blocks(body, version, caller)
    if blocks or not text:
        return blocks, BLOCK_TOKENS
    return text_prefix_keys(body, prompt_scope(body, version, caller)), CHUNK_TOKENS


class Router:
    """State shared by the handlers: config, registry, token, HTTP client and the scrapes (`scrape.Scraper`)."""

    def __init__(self, cfg: RouteConfig, token: str, registry: Registry | None = None) -> None:
        self.cfg = cfg
        self.token = token
        self.registry = registry or Registry(cfg.policy, cfg.k, cfg.health_failures,
                                             version_pools=tuple(cfg.version_pools), max_sessions=cfg.max_sessions)
        self.client: httpx.AsyncClient | None = None
        self.lock = asyncio.Lock()  # serialises placement against scrapes; held briefly, never across I/O
        self.scraper = Scraper(cfg, self.registry, self.lock, self.http, token, static=cfg.replicas)
        self.shares = Shares(cfg, self.registry)  # admission of new sessions: fair shares, quotas (off by default)

    def http(self) -> httpx.AsyncClient:
        assert self.client is not None, "router client used outside the app lifespan"
        return self.client

    def require_token(self, request: Request) -> None:
        if not bearer_matches(request.headers, self.token):
            raise RouteError(401, "missing or wrong cluster bearer token", "authentication_error")

    def generating(self, request: Request) -> RouteCaller:
        """The caller of a generation route or `/v1/assign` (`tenancy.generating`), kept for its errors."""
        request.state.caller = generating(self.cfg.tenant_key, request.headers)
        return request.state.caller

    def viewer(self, request: Request) -> Viewer:
        """The reader of `/v1/replicas`, `/v1/stats` or `/metrics`: which versions it is shown (`visibility`)."""
        return viewer(self.cfg.tenant_key, self.token, request.headers)

    def reading(self, request: Request) -> RouteCaller:
        """The caller of a trace route or `/v1/models` (`tenancy.reading`), kept for its errors."""
        request.state.caller = reading(self.cfg.tenant_key, self.token, request.headers)
        return request.state.caller


def build_app(router: Router, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan owns the HTTP client and the scrape task."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Idle connections expire before uvicorn's 5 s keep-alive does, so a call is never sent on
        # a connection the replica is closing (that would look like a replica dying mid-call).
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)
        timeout = httpx.Timeout(router.cfg.request_timeout_s, connect=5.0)
        router.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        for url in router.cfg.replicas:
            router.registry.add(url)
        await asyncio.gather(*(router.scraper.scrape_guarded(u) for u in list(router.registry.replicas)))
        task = asyncio.create_task(router.scraper.run())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await router.client.aclose()

    app = FastAPI(title="burstrl router", lifespan=lifespan, docs_url=None, redoc_url=None)
    reg = router.registry

    @app.exception_handler(RouteError)
    async def _route_error(request: Request, exc: RouteError) -> JSONResponse:
        caller: RouteCaller = getattr(request.state, "caller", FLEET)  # a tenant's errors say its own names
        return error_response(router, exc.status, caller.say(exc.message), exc.kind)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(router, exc.status_code, str(exc.detail), kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors())
        return error_response(router, 400, f"invalid request: {where}"[:500])

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the router")
        return error_response(router, 500, f"internal router error: {type(exc).__name__}", "server_error")

    add_fleet_routes(app, router)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "replicas": len(reg.replicas)}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return models_list(router.reading(request).visible(reg.models()), "burstrl-router")

    @app.post("/v1/replicas")
    async def register(request: Request) -> JSONResponse:
        router.require_token(request)
        body = await _read_json(request, router.cfg.max_body_bytes)
        pool, weight, capacity = body.get("pool", "reserved"), body.get("weight", 1.0), body.get("capacity_tokens", 0)
        if not isinstance(pool, str):
            raise RouteError(400, "pool must be a string")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < 1e300:
            raise RouteError(400, "weight must be a number in (0, 1e300)")
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise RouteError(400, "capacity_tokens must be an integer")
        async with router.lock:
            view = reg.add(body.get("url", ""), pool, float(weight), capacity)
        scraped = await router.scraper.scrape_guarded(view.id)  # routable at once, not after the next tick
        return JSONResponse({"url": view.id, "pool": view.pool, "weight": view.weight,
                             "scraped": scraped, "versions": sorted(view.versions)}, status_code=201)

    @app.post("/v1/replicas/drain")
    async def drain(request: Request) -> dict[str, Any]:
        """Stop sending new sessions to a replica that is about to be removed; its sessions finish there."""
        router.require_token(request)
        url = (await _read_json(request, router.cfg.max_body_bytes)).get("url", "")
        if not isinstance(url, str):
            raise RouteError(400, "url must be a string")
        url = url.rstrip("/")
        async with router.lock:
            view = reg.replicas.get(url)
            if view is None:
                raise RouteError(404, f"replica {url!r} is not registered", "not_found_error")
            view.draining = True
        return {"url": url, "draining": True}

    @app.delete("/v1/replicas")
    async def deregister(request: Request, url: str = "") -> dict[str, Any]:
        router.require_token(request)
        async with router.lock:
            removed = reg.remove(url)
            router.scraper.forget(url)
        if not removed:
            raise RouteError(404, f"replica {url!r} is not registered", "not_found_error")
        return {"url": url.rstrip("/"), "removed": True}

    @app.get("/v1/replicas")
    async def list_replicas(request: Request) -> dict[str, Any]:
        return replicas_answer(reg, router.viewer(request))  # versions: only the caller's (visibility.py)

    @app.post("/v1/assign")
    async def assign(request: Request) -> dict[str, Any]:
        caller = router.generating(request)
        body = await _read_json(request, router.cfg.max_body_bytes)
        sid, version = body.get("session_id"), body.get("version", LATEST)
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid) or not isinstance(version, str) or not version:
            raise RouteError(400, "session_id (1-128 characters of [A-Za-z0-9._:@/-]) is required; version, "
                             "if given, must be a non-empty string (default latest)")
        expected = body.get("expected_tokens", 0)
        if not isinstance(expected, int) or not 0 <= expected <= MAX_TOKENS_HINT:
            raise RouteError(400, f"expected_tokens must be an integer in [0, {MAX_TOKENS_HINT}]")
        kind = task_kind_of(body, request.headers)
        key = caller.session(sid)
        async with router.shares.admission(caller.tenant, key, request.is_disconnected, kind, expected), router.lock:
            resolved = resolve(reg, caller, key, version)
            check_served(reg, caller, key, resolved, version)
            view = reg.place(key, resolved, expected, kind)
        return {"url": view.id, "session_id": sid, "version": caller.shown(resolved)}

    @app.get("/v1/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return {**stats_answer(reg, router.viewer(request)), "admission": router.shares.stats()}

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        text = prometheus_text(stats_answer(reg, router.viewer(request)))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/traces/{session_id:path}")
    async def get_trace(session_id: str, request: Request, full: bool = False) -> Response:
        key = router.reading(request).session(session_id)
        return await forward_trace(router.registry, router.lock, router.http(), "GET", session_id,
                                   _auth_of(request), router.cfg.request_timeout_s, full, key=key)

    @app.delete("/v1/traces/{session_id:path}")
    async def delete_trace(session_id: str, request: Request) -> Response:
        key = router.reading(request).session(session_id)
        return await forward_trace(router.registry, router.lock, router.http(), "DELETE", session_id,
                                   _auth_of(request), router.cfg.request_timeout_s, key=key)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(router, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(router, request, "/v1/completions")

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        """vLLM's token-in endpoint (verifiers' train client); the session comes from its X-Session-ID header."""
        return await proxy(router, request, "/inference/v1/generate")

    return app


async def proxy(router: Router, request: Request, path: str) -> Response:
    """Forward one generation call to its session's replica; retried once only if it never got there.

    With tenants the session and version are the caller's (`tenancy`), and the call goes upstream with
    the caller's own bearer and names, so the replica maps them into the same namespace.
    """
    reg = router.registry
    reg.counters.requests += 1
    caller = router.generating(request)
    raw = await _read_body(request, router.cfg.max_body_bytes)
    body = parse_json(raw)
    if not isinstance(body.get("model"), str):
        raise RouteError(400, "request body must be a JSON object with a string `model`")
    sid, kind = session_id_of(body, request.headers), task_kind_of(body, request.headers)
    key, headers = caller.session(sid), caller.upstream(request.headers)
    hint = first_call_tokens(body)
    async with router.shares.admission(caller.tenant, key, request.is_disconnected, kind, hint):  # new sessions only
        for _ in range(2):
            async with router.lock:
                version = resolve(reg, caller, key, body["model"])
                check_served(reg, caller, key, version, body["model"])
                placing = key is None or key not in reg.homes or reg.may_move(key)  # its prompt's cached blocks count
                blocks, per = prompt_keys(body, version, caller, router.cfg.text_prefix_keys) if placing else ((), 0)
                url = reg.place(key, version, hint, kind, blocks, per).id
                reg.call_started(url)
            if caller.shown(version) != body["model"]:  # `latest`: the replica must see the concrete version
                body["model"] = caller.shown(version)
                raw = json.dumps(body).encode()
            try:
                response = await _counted_forward(router, url, path, raw, headers, bool(body.get("stream")))
            except CallFailed as exc:
                if exc.never_sent:
                    log.warning("replica %s refused a call (%s); re-homing session %s", url, exc.reason, sid)
                    await drop(router, url)
                    continue
                raise await _call_failed(router, url, exc) from None
            response.headers[VERSION_HEADER] = caller.shown(version)
            return response
    raise RouteError(503, "replicas refused the connection twice in a row; try again", "server_error")


async def _call_failed(router: Router, url: str, exc: CallFailed) -> RouteError:
    """The caller's error for a call that reached `url` and got no usable answer (`CallFailed`).

    A deadline passed is a 504 for this call only (a long generation may be slow); a connection that
    broke after the call was sent drops the replica and is never retried (it may have run there); a
    call this side could not make or read is a 502.
    """
    if exc.timed_out:
        return RouteError(504, f"replica {url} timed out: {exc.reason}", "server_error")
    if exc.kind != "broken":  # `invalid` (this side's), or `too_large` (raised as a RouteError before here)
        return RouteError(502, f"replica {url}: {exc.reason}", "server_error")
    await drop(router, url)
    return RouteError(503, f"replica {url} failed after it accepted the call ({exc.reason}); not retried, since "
                      "it may have run there. Retrying is safe: the replica is dropped and the session's next "
                      "call goes to another replica", "server_error")


async def _counted_forward(router: Router, replica: str, path: str, raw: bytes, headers: dict[str, str],
                           stream: bool) -> Response:
    """`_forward`, ending the call's in-flight count (started at placement) when it is answered.

    A stream's count ends when its `RelayResponse` ends (however it ends), not when its headers arrive.
    """
    try:
        response = await forward(router, replica, path, raw, headers, stream)
    except BaseException:
        router.registry.call_ended(replica)
        raise
    if not isinstance(response, StreamingResponse):
        router.registry.call_ended(replica)
    return response


def _auth_of(request: Request) -> dict[str, str]:
    """The caller's Authorization header, for a replica to check (the router holds no replica's admin token)."""
    return {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}


def error_response(router: Router, status: int, message: str, kind: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """Every error the router answers, OpenAI-shaped (`{"error": {...}}`), counted."""
    router.registry.counters.errors += 1
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    try:
        return await read_body(request, limit)
    except BodyTooLarge as exc:
        raise RouteError(413, str(exc)) from None


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    return parse_json(await _read_body(request, limit))


def run_router(cfg: RouteConfig) -> None:
    """Run the router until SIGINT/SIGTERM; prints a ready line with the URL once listening."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown the log
    for url in cfg.replicas:
        validate_url(url)  # a bad static URL fails the start (RouteError), not the first scrape
    router = Router(cfg, cluster_token(cfg))
    sock = bind_socket(cfg.host, cfg.port)
    url = socket_url(sock)
    config = uvicorn.Config(build_app(router, on_ready=lambda: print_ready(url)), log_level="warning",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
