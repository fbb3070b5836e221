"""What the router's open read routes (`GET /v1/replicas`, `/v1/stats`, `/metrics`) show to whom.

Why filtered, not closed: these routes need no token (a run's launcher samples `/v1/stats` every
second, `burstrl fleet status` lists the replicas, Prometheus scrapes `/metrics`), and what they
mostly say is the fleet's (URLs, pools, health, loads, counts). With tenants (`router.tenant_key`)
they would also list every tenant's versions as stored (`run-a~policy-v3`): a tenant's names to
anyone. So each answer names only the versions the caller may see, the same rule as a replica's
`/v1/models`: the router's cluster token (and everyone on a router without tenants) sees every name
as stored; a tenant token sees `base` and its own versions, shown as it knows them (`policy-v3`);
any other caller sees only names of no tenant's (`owner` None). Counts (sessions per replica, the
admission figures) name nobody and stay. Nothing is refused here: a bad token is just anonymous.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from burstrl.protocol.http import bearer_matches
from burstrl.protocol.tenants import owner, tenant_of
from burstrl.router.policies import newest_routable_version
from burstrl.router.registry import Registry
from burstrl.router.tenancy import FLEET, RouteCaller


@dataclass(frozen=True)
class Viewer:
    """A reader of the open routes: a `RouteCaller` (the fleet or a tenant), or None for anyone else."""

    caller: RouteCaller | None

    @property
    def everything(self) -> bool:
        """Whether every name is shown as stored (no tenants, or the cluster token)."""
        return self.caller is not None and self.caller.tenant is None

    def sees(self, name: str) -> bool:
        return owner(name) is None if self.caller is None else self.caller.sees(name)

    def show(self, name: str) -> str:
        """A stored name as this viewer knows it (a tenant's own without its prefix)."""
        return name if self.caller is None else self.caller.shown(name)

    def names(self, names: Iterable[str]) -> list[str]:
        """The stored `names` this viewer may see, as it knows them, sorted."""
        return sorted(self.show(n) for n in names if self.sees(n))


def viewer(tenant_key: str, cluster_token: str, headers: Mapping[str, str]) -> Viewer:
    """Who reads: everything without tenancy or with the cluster token; a tenant its own; else anonymous."""
    if not tenant_key or bearer_matches(headers, cluster_token):
        return Viewer(FLEET)
    tenant = tenant_of(headers, tenant_key)
    return Viewer(None if tenant is None else RouteCaller(tenant, headers["authorization"]))


def replicas_answer(reg: Registry, who: Viewer) -> dict[str, Any]:
    """`GET /v1/replicas`: every replica, its versions as `who` may see them."""
    return {"replicas": [{"url": v.id, "pool": v.pool, "weight": v.weight, "healthy": v.healthy,
                          "draining": v.draining, "bad_reason": v.bad_reason,
                          "capacity_tokens": v.capacity_tokens, "versions": who.names(v.versions)}
                         for v in reg.replicas.values()]}


def stats_answer(reg: Registry, who: Viewer) -> dict[str, Any]:
    """`Registry.stats()` (the body of `/v1/stats`, and `/metrics`) with only the versions `who` may see.

    Per replica its served versions; per version its live sessions; `in_use` counts the versions
    shown; `latest` is the newest routable version among them (a tenant's is its own `latest`).
    """
    stats = reg.stats()
    if who.everything:
        return stats
    for replica in stats["replicas"]:
        replica["versions"] = who.names(replica["versions"])
    spread = stats["versions"]["live_sessions"]
    local = dict(sorted((who.show(name), count) for name, count in spread.items() if who.sees(name)))
    latest = newest_routable_version(list(reg.replicas.values()), reg.version_pools, who.sees)
    stats["versions"] = {"live_sessions": local, "in_use": len(local),
                         "latest": None if latest is None else who.show(latest)}
    return stats
