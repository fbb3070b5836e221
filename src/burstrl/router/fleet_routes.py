"""The route a run on a shared fleet asks for the replicas its trainer pushes versions to.

Why a route of its own: a run on a fleet it does not own (`burstrl run --fleet.url`) still pushes
each version to every replica itself, shard by shard, with its tenant token; only the fleet knows
which replicas are up. `GET /v1/fleet/replicas` answers a tenant token (or the cluster token, or
anyone on a router without tenants) with the URLs of the healthy replicas that take new sessions,
which the run's launcher writes to the replicas file its trainer re-reads before each push (as the
launcher of a run with its own fleet does). Nothing in the answer names any tenant's versions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

if TYPE_CHECKING:
    from burstrl.router.server import Router


def add_fleet_routes(app: FastAPI, router: Router) -> None:
    @app.get("/v1/fleet/replicas")
    async def fleet_replicas(request: Request) -> dict[str, Any]:
        router.reading(request)  # a tenant, the cluster token, or anyone without tenancy; 401 else
        views = router.registry.replicas.values()
        return {"replicas": sorted(v.id for v in views if v.healthy and not v.draining)}
