"""The tenant layer of the router: who is calling a route, and which sessions and versions it reaches.

Why at the entry of each route, as on a replica (`inference/tenancy.py`): with `router.tenant_key`
set, several runs (tenants) share the router and its replicas. Every generation route, `/v1/assign`,
the trace routes and `/v1/models` first turn the request's bearer token into a `RouteCaller`; every name
the router keeps or looks up goes through it into the tenant's namespace (`protocol.tenants`), so
the registry (`registry.py`, which knows nothing of tenants) holds sessions as `<tenant>~<sid>`:
tenant B reusing tenant A's session id is a new session of B's, never A's home or pin.

Why the caller's own token goes upstream: the replicas share the tenant key and do the same mapping
for themselves, so the router forwards a tenant's call with the tenant's `Authorization` and the
tenant's own names (`shown`); it never sends its own tokens with a tenant's call. The router learns
versions from its scrapes (cluster token), that is as stored (`a~policy-v3`); a tenant's `latest`
is the newest version every pool serves among its own and `base` (`versions`).

Who is who, with tenancy on: a tenant token acts in its namespace; the router's cluster token (its
admin) keeps its replica routes and reads traces and `/v1/models` by the stored names; anyone
else gets a 401. The open reads (`/v1/replicas`, `/v1/stats`, `/metrics`) refuse nobody but name
only the versions the caller may see (`visibility.py`). With `tenant_key` empty every function
here answers exactly as the router did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from burstrl.protocol.http import SESSION_HEADERS, bearer_matches
from burstrl.protocol.tenants import local, owner, scoped, scoped_salt, tenant_of
from burstrl.protocol.versions import BASE
from burstrl.router.registry import LATEST, Registry, RouteError

REFUSED = "this router is shared by tenants: send `Authorization: Bearer <tenant token>`"


@dataclass(frozen=True)
class RouteCaller:
    """Whose request this is: `tenant` (None = the fleet, every name as stored) and its bearer header."""

    tenant: str | None = None
    authorization: str = ""  # the tenant's own `Authorization` header, forwarded to the replica

    def session(self, sid: str | None) -> str | None:
        """The registry key of a (checked) client session id; calls without one stay unremembered."""
        return None if sid is None else scoped(self.tenant, sid)

    def version(self, model: str) -> str:
        """The stored name of a request's `model`: `base` and `latest` are everyone's, versions per tenant."""
        return model if self.tenant is None or model in ("", LATEST, BASE) else scoped(self.tenant, model)

    def sees(self, name: str) -> bool:
        """Whether a stored version is the caller's to see and use: the fleet every one, a tenant
        `base` and its own (the replica maps any other name a tenant sends into its namespace)."""
        return self.tenant is None or name == BASE or owner(name) == self.tenant

    def shown(self, name: str) -> str:
        """A stored name as the caller knows it (and as its replica call must say it)."""
        return name if self.tenant is None else local(name)

    def visible(self, names: set[str]) -> list[str]:
        """The stored `names` this caller may see, as it knows them, sorted."""
        return sorted(self.shown(n) for n in names if self.sees(n))

    def say(self, message: str) -> str:
        """An error message in the caller's own names (its namespace's prefix taken out)."""
        return message if self.tenant is None else message.replace(scoped(self.tenant, ""), "")

    def salt(self, salt: str | None) -> str | None:
        """The `cache_salt` the replica's engine uses, so the router hashes prompt blocks as it does."""
        return scoped_salt(self.tenant, salt)

    def upstream(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The headers a generation call is forwarded with: its body's type, its session headers and,
        for a tenant, the tenant's own bearer. Nothing else: never a token of the router's."""
        out = {"content-type": "application/json"}
        out.update({name: headers[name] for name in SESSION_HEADERS if name in headers})
        if self.tenant is not None:
            out["authorization"] = self.authorization
        return out


FLEET = RouteCaller()


def _tenant(tenant_key: str, headers: Mapping[str, str]) -> RouteCaller | None:
    tenant = tenant_of(headers, tenant_key)
    return None if tenant is None else RouteCaller(tenant, headers["authorization"])


def generating(tenant_key: str, headers: Mapping[str, str]) -> RouteCaller:
    """A generation call or `/v1/assign`: anyone without tenancy; with it, a tenant token (401 else,
    the router's cluster token included: it places no sessions of its own)."""
    if not tenant_key:
        return FLEET
    caller = _tenant(tenant_key, headers)
    if caller is None:
        raise RouteError(401, REFUSED, "authentication_error")
    return caller


def reading(tenant_key: str, cluster_token: str, headers: Mapping[str, str]) -> RouteCaller:
    """Traces and `/v1/models`: anyone without tenancy (each replica checks a trace's token itself);
    with it, the router's cluster token (every name as stored) or a tenant token (its own); 401 else."""
    if not tenant_key or bearer_matches(headers, cluster_token):
        return FLEET
    caller = _tenant(tenant_key, headers)
    if caller is None:
        raise RouteError(401, REFUSED, "authentication_error")
    return caller


def resolve(reg: Registry, caller: RouteCaller, key: str | None, model: str) -> str:
    """The stored version a call of session `key` runs on (`Registry.resolve` in the caller's namespace).

    A tenant's `latest` is the newest of its own versions (else `base`) that every pool serves, the
    same gating as for the fleet; a named version is the tenant's own; a pinned session stays pinned.
    """
    return reg.resolve(key, caller.version(model), among=None if caller.tenant is None else caller.sees)


def check_served(reg: Registry, caller: RouteCaller, key: str | None, version: str, model: str) -> None:
    """A new session (or a call without one) on a version nobody serves: the 404 `Registry.place` gives,
    listing only what the caller may use. A known session keeps the registry's answer (re-homed, or 503)."""
    if caller.tenant is None or (key is not None and key in reg.homes):
        return
    models = reg.models()
    if version not in models:
        raise RouteError(404, f"model {model!r} not found; served: {caller.visible(models)}", "not_found_error")
