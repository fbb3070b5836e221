"""The route a run on a shared fleet asks for the replicas its trainer pushes versions to.

Why a route of its own: a run on a fleet it does not own (`burstrl run --fleet.url`) still pushes
each version to every replica itself, shard by shard, with its tenant token; only the fleet knows
which replicas are up. `GET /v1/fleet/replicas` answers a tenant token (or the cluster token, or
anyone on a router without tenants) with the URLs of the healthy replicas that take new sessions,
which the run's launcher writes to the replicas file its trainer re-reads before each push (as the
launcher of a run with its own fleet does). Nothing in the answer names any tenant's versions.

Why the router notes when each tenant last asked: a live run's launcher asks every few seconds, so
a tenant that stopped asking has lost its launcher (killed with -9: nothing of the run is left to
release its versions). `GET /v1/fleet/tenants` (the cluster token) tells the fleet's supervisor
how long ago each tenant asked, and the supervisor unloads the versions of one that has been quiet
for `fleet.tenant_idle_s` (`launcher/idle_tenants.py`).

`GET /v1/fleet/sandbox-nodes` (a tenant token) lists the fleet's sandbox node agents
(`fleet.sandbox_nodes`), where a tenant run's SWE env creates its sandboxes with its own token.
The list starts as the router's config says; `PUT /v1/fleet/sandbox-nodes` (the cluster token: the
fleet's supervisor) replaces it, because on Ray agents come and go with the nodes that carry
`sandbox_node`. Only names and URLs are kept: no node token ever reaches the router.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from fastapi import FastAPI, Request

from burstrl.router.registry import Registry, RouteError, validate_url
from burstrl.router.tenancy import RouteCaller


class RouterParts(Protocol):
    """What these routes use of `server.Router` (named here, not imported: server imports this module)."""

    registry: Registry
    cfg: Any  # RouteConfig: its `sandbox_nodes`

    def reading(self, request: Request) -> RouteCaller: ...

    def require_token(self, request: Request) -> None: ...


def node_rows(rows: Any) -> list[dict[str, str]]:
    """[{name, url}] from what the fleet sent (http(s) URLs only); RouteError(400) naming what is wrong."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RouteError(400, "expected {\"nodes\": [{\"name\": ..., \"url\": ...}, ...]}")
    return [{"name": str(r.get("name", ""))[:200], "url": validate_url(r.get("url", ""))} for r in rows]


def add_fleet_routes(app: FastAPI, router: RouterParts) -> None:
    asked: dict[str, float] = {}  # tenant -> when (monotonic) it last asked for the replicas
    nodes = [{"name": n.get("name", ""), "url": n["url"]} for n in router.cfg.sandbox_nodes]

    @app.get("/v1/fleet/replicas")
    async def fleet_replicas(request: Request) -> dict[str, Any]:
        caller = router.reading(request)  # a tenant, the cluster token, or anyone without tenancy; 401 else
        if caller.tenant is not None:
            asked[caller.tenant] = time.monotonic()
        views = router.registry.replicas.values()
        return {"replicas": sorted(v.id for v in views if v.healthy and not v.draining)}

    @app.get("/v1/fleet/sandbox-nodes")
    async def fleet_sandbox_nodes(request: Request) -> dict[str, Any]:
        """The fleet's sandbox node agents ({name, url}); a tenant's token acts there for it alone."""
        router.reading(request)
        return {"nodes": nodes}

    @app.put("/v1/fleet/sandbox-nodes")
    async def set_fleet_sandbox_nodes(request: Request) -> dict[str, Any]:
        """The fleet's supervisor says which agents are up now (Ray: nodes joined or left)."""
        router.require_token(request)  # before the body is read: a stranger learns nothing from a 400
        try:
            body = await request.json()
        except ValueError:
            raise RouteError(400, "the body is not JSON") from None
        nodes[:] = node_rows(body.get("nodes") if isinstance(body, dict) else None)
        return {"nodes": nodes}

    @app.get("/v1/fleet/tenants")
    async def fleet_tenants(request: Request) -> dict[str, Any]:
        router.require_token(request)
        now = time.monotonic()
        return {"tenants": {t: round(now - at, 3) for t, at in sorted(asked.items())}}
