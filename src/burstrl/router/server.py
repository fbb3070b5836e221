"""The router's HTTP API: the replicas' OpenAI surface, a replica registry, and placement.

Why a proxy and not a redirect: OpenAI clients follow neither redirects on POST nor custom
headers, so the router forwards each call (streams chunk by chunk) to the replica the registry
picks. Every upstream call has a timeout; a replica that refuses connections is dropped and the
call retried once on the session's new home, so a dying replica costs a cache miss, not a rollout,
and a caller gets either an answer or a clear JSON error, never a hang.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from burstrl.config import RouteConfig
from burstrl.inference.openai_api import SESSION_HEADERS, BodyTooLarge, error_body, models_list, read_body
from burstrl.router.registry import LATEST, Registry, RouteError, validate_url

log = logging.getLogger(__name__)

# A replica that is gone: refused or reset connections. A read timeout is not one (a long
# generation may be slow), it becomes a 504 for that call only.
VERSION_HEADER = "X-Burstrl-Version"  # the version a call ran on (`latest` resolved)

DEAD = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def cluster_token(cfg: RouteConfig) -> str:
    """Configured token, else $BURSTRL_CLUSTER_TOKEN, else a fresh one printed to stderr."""
    token = cfg.cluster_token or os.environ.get("BURSTRL_CLUSTER_TOKEN", "")
    if not token:
        token = secrets.token_urlsafe(24)
        print(f"cluster token: {token}", file=sys.stderr, flush=True)
    return token


def session_id_of(body: dict[str, Any], headers: Any) -> str | None:
    """The session of a call: `session_id` in the body, else the first session header set."""
    sid = body.get("session_id")
    if isinstance(sid, str) and sid:
        return sid
    for name in SESSION_HEADERS:
        if headers.get(name):
            return headers[name]
    return None


def first_call_tokens(body: dict[str, Any]) -> int:
    """A lower bound on the session's size from the call itself: token-in prompt plus max_tokens.

    Why: at placement the size model only knows the task kind; a token-in call already says how
    large the session is, so headroom need not guess for the part it can see. Text prompts give 0.
    """
    ids = body.get("input_ids")
    max_tokens = body.get("max_tokens")
    n = len(ids) if isinstance(ids, list) else 0
    return n + (max_tokens if isinstance(max_tokens, int) and max_tokens > 0 and n else 0)


class Router:
    """State shared by the handlers: config, registry, token, HTTP client and the scrape task."""

    def __init__(self, cfg: RouteConfig, token: str, registry: Registry | None = None) -> None:
        self.cfg = cfg
        self.token = token
        self.registry = registry or Registry(cfg.policy, cfg.k, cfg.health_failures,
                                             version_pools=tuple(cfg.version_pools))
        self.client: httpx.AsyncClient | None = None
        self.lock = asyncio.Lock()  # serialises placement against scrapes; held briefly, never across I/O

    def http(self) -> httpx.AsyncClient:
        assert self.client is not None, "router client used outside the app lifespan"
        return self.client

    async def scrape(self, url: str) -> bool:
        """One scrape of `/v1/loads` and `/v1/models`; a failure counts toward dropping the replica."""
        timeout = min(self.cfg.request_timeout_s, max(2.0, 2 * self.cfg.scrape_s))
        try:
            loads, models = await asyncio.gather(self.http().get(url + "/v1/loads", timeout=timeout),
                                                 self.http().get(url + "/v1/models", timeout=timeout))
            loads.raise_for_status()
            models.raise_for_status()
            loads_body, models_body = loads.json(), models.json()
        except (httpx.HTTPError, ValueError) as exc:
            async with self.lock:
                if self.registry.scrape_failed(url):
                    log.warning("replica %s dropped after failed scrapes (%s)", url, exc)
            return False
        async with self.lock:
            self.registry.apply_scrape(url, loads_body, models_body)
        return True

    async def scrape_loop(self) -> None:
        """Refresh every replica's view each `scrape_s` until cancelled by the lifespan."""
        while True:
            urls = list(self.registry.replicas)
            if urls:
                await asyncio.gather(*(self.scrape(u) for u in urls))
            await asyncio.sleep(self.cfg.scrape_s)

    def require_token(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.token.encode()):
            raise RouteError(401, "missing or wrong cluster bearer token", "authentication_error")


def build_app(router: Router, on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan owns the HTTP client and the scrape task."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        timeout = httpx.Timeout(router.cfg.request_timeout_s, connect=5.0)
        router.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        for url in router.cfg.replicas:
            router.registry.add(url)
        await asyncio.gather(*(router.scrape(u) for u in list(router.registry.replicas)))
        task = asyncio.create_task(router.scrape_loop())
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
    async def _route_error(_: Request, exc: RouteError) -> JSONResponse:
        reg.counters.errors += 1
        return JSONResponse(error_body(exc.status, exc.message, exc.kind), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "replicas": len(reg.replicas)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_list(sorted(reg.models()), "burstrl-router")

    @app.post("/v1/replicas")
    async def register(request: Request) -> JSONResponse:
        router.require_token(request)
        body = await _read_json(request, router.cfg.max_body_bytes)
        try:
            pool, weight = str(body.get("pool", "reserved")), float(body.get("weight", 1.0))
            capacity = int(body.get("capacity_tokens", 0))
        except (TypeError, ValueError):
            raise RouteError(400, "weight must be a number and capacity_tokens an integer") from None
        async with router.lock:
            view = reg.add(body.get("url", ""), pool, weight, capacity)
        scraped = await router.scrape(view.id)  # routable at once, not after the next tick
        return JSONResponse({"url": view.id, "pool": view.pool, "weight": view.weight,
                             "scraped": scraped, "versions": sorted(view.versions)}, status_code=201)

    @app.post("/v1/replicas/drain")
    async def drain(request: Request) -> dict[str, Any]:
        """Stop sending new sessions to a replica that is about to be removed; its sessions finish there."""
        router.require_token(request)
        url = str((await _read_json(request, router.cfg.max_body_bytes)).get("url", "")).rstrip("/")
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
        if not removed:
            raise RouteError(404, f"replica {url!r} is not registered", "not_found_error")
        return {"url": url.rstrip("/"), "removed": True}

    @app.get("/v1/replicas")
    async def list_replicas() -> dict[str, Any]:
        return {"replicas": [{"url": v.id, "pool": v.pool, "weight": v.weight, "healthy": v.healthy,
                              "draining": v.draining,
                              "capacity_tokens": v.capacity_tokens, "versions": sorted(v.versions)}
                             for v in reg.replicas.values()]}

    @app.post("/v1/assign")
    async def assign(request: Request) -> dict[str, Any]:
        body = await _read_json(request, router.cfg.max_body_bytes)
        sid, version = body.get("session_id"), body.get("version", LATEST)
        if not isinstance(sid, str) or not sid or not isinstance(version, str) or not version:
            raise RouteError(400, "session_id (a non-empty string) is required; version, if given, "
                             "must be a non-empty string (default latest)")
        expected = body.get("expected_tokens", 0)
        if not isinstance(expected, int) or expected < 0:
            raise RouteError(400, "expected_tokens must be a non-negative integer")
        async with router.lock:
            resolved = reg.resolve(sid, version)
            view = reg.place(sid, resolved, expected)
        return {"url": view.id, "session_id": sid, "version": resolved}

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return reg.stats()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(reg.stats()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/traces/{session_id:path}")
    async def get_trace(session_id: str) -> Response:
        return await forward_trace(router, "GET", session_id, request_headers={})

    @app.delete("/v1/traces/{session_id:path}")
    async def delete_trace(session_id: str, request: Request) -> Response:
        auth = {"authorization": request.headers["authorization"]} if "authorization" in request.headers else {}
        return await forward_trace(router, "DELETE", session_id, request_headers=auth)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(router, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(router, request, "/v1/completions")

    return app


async def proxy(router: Router, request: Request, path: str) -> Response:
    """Forward one generation call to its session's replica; on a dead replica re-home and retry once."""
    reg = router.registry
    reg.counters.requests += 1
    raw = await _read_body(request, router.cfg.max_body_bytes)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RouteError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise RouteError(400, "request body must be a JSON object with a string `model`")
    sid = session_id_of(body, request.headers)
    headers = {"content-type": "application/json"}
    headers.update({name: request.headers[name] for name in SESSION_HEADERS if name in request.headers})
    for attempt in range(2):
        async with router.lock:
            version = reg.resolve(sid, body["model"])
            url = reg.place(sid, version, first_call_tokens(body)).id
        if version != body["model"]:  # `latest`: the replica must see the concrete version
            body["model"] = version
            raw = json.dumps(body).encode()
        try:
            response = await _forward(router, url + path, raw, headers, bool(body.get("stream")))
            response.headers[VERSION_HEADER] = version
            return response
        except DEAD as exc:
            log.warning("replica %s failed (%s); re-homing session %s", url, type(exc).__name__, sid)
            async with router.lock:
                reg.mark_dead(url)
        except httpx.TimeoutException:
            raise RouteError(504, f"replica {url} timed out", "server_error") from None
    raise RouteError(503, "replicas failed twice in a row; try again", "server_error")


async def forward_trace(router: Router, method: str, session_id: str, request_headers: dict[str, str]) -> Response:
    """A session's capture lives on its replica: forward GET/DELETE there (the replica checks the token).

    A trace answered by a replica carries `replica` (its URL), so the caller can tell which replica
    recorded the calls. A successful DELETE also drops the session from the router's maps.
    """
    async with router.lock:
        url = router.registry.home_of(session_id).id
    try:
        r = await router.http().request(method, f"{url}/v1/traces/{session_id}", headers=request_headers)
    except DEAD as exc:
        async with router.lock:
            router.registry.mark_dead(url)
        raise RouteError(503, f"session {session_id!r}: replica {url} failed ({type(exc).__name__})",
                         "server_error") from None
    except httpx.TimeoutException:
        raise RouteError(504, f"replica {url} timed out", "server_error") from None
    body = r.content
    if r.status_code == 200:
        data = r.json()
        data["replica"] = url
        body = json.dumps(data).encode()
        if method == "DELETE":
            async with router.lock:
                router.registry.forget(session_id)
    return Response(body, status_code=r.status_code, media_type="application/json")


async def _forward(router: Router, url: str, raw: bytes, headers: dict[str, str], stream: bool) -> Response:
    client = router.http()
    if not stream:
        r = await client.post(url, content=raw, headers=headers)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))
    upstream = await client.send(client.build_request("POST", url, content=raw, headers=headers), stream=True)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:  # the replica died mid-stream: end the stream, counted
            router.registry.counters.errors += 1
            log.warning("stream from %s broke: %s", url, exc)
        finally:
            await upstream.aclose()

    return StreamingResponse(chunks(), status_code=upstream.status_code,
                             media_type=upstream.headers.get("content-type", "text/event-stream"))


async def _read_body(request: Request, limit: int) -> bytes:
    try:
        return await read_body(request, limit)
    except BodyTooLarge as exc:
        raise RouteError(413, str(exc)) from None


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    raw = await _read_body(request, limit)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RouteError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RouteError(400, "request body must be a JSON object")
    return body


def prometheus_text(stats: dict[str, Any]) -> str:
    """`/v1/stats` as Prometheus text: totals as counters/gauges, per-replica gauges by label."""
    totals = stats["totals"]
    lines = []
    for name, kind in (("requests", "counter"), ("errors", "counter"), ("rehomes", "counter"),
                       ("replicas_dropped", "counter"), ("sessions", "gauge"), ("replicas", "gauge")):
        metric = f"burstrl_router_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {totals[name]}"]
    for name in ("thrash", "evictions", "cache_hit_rate"):  # summed over the replicas' own counters
        metric = f"burstrl_router_fleet_{name}"
        lines += [f"# TYPE {metric} gauge", f"{metric} {float(totals[name])}"]
    lines.append("# TYPE burstrl_router_versions_in_use gauge")
    lines.append(f"burstrl_router_versions_in_use {stats['versions']['in_use']}")
    lines.append("# TYPE burstrl_router_version_live_sessions gauge")
    for version, count in stats["versions"]["live_sessions"].items():
        lines.append(f'burstrl_router_version_live_sessions{{version="{version}"}} {count}')
    for field in ("sessions", "live_sessions", "used_tokens", "capacity_tokens", "projected_headroom",
                  "cache_hit_rate", "thrash", "evictions"):
        metric = f"burstrl_router_replica_{field}"
        lines.append(f"# TYPE {metric} gauge")
        for r in stats["replicas"]:
            lines.append(f'{metric}{{replica="{r["url"]}",pool="{r["pool"]}"}} {float(r[field])}')
    return "\n".join(lines) + "\n"


def serve(cfg: RouteConfig) -> None:
    """Run the router until SIGINT/SIGTERM; prints a ready line with the URL once listening."""
    import uvicorn

    from burstrl.inference.replica import bind_socket

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown the log
    for url in cfg.replicas:
        validate_url(url)  # a bad static URL fails the start (RouteError), not the first scrape
    router = Router(cfg, cluster_token(cfg))
    sock = bind_socket(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def ready() -> None:
        print(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}), flush=True)

    config = uvicorn.Config(build_app(router, on_ready=ready), log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
