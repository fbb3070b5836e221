"""The tenant layer of a replica: who is calling a route, and which names it reaches.

Why at the entry of each route: with `server.tenant_key` set, several runs (tenants) share the
replica. Every route first turns the request's bearer token into a `Caller`, and every name the
request carries (session id, model/adapter version, `cache_salt`, trace id) goes through that
caller into its tenant's namespace (`protocol.tenants`) before anything is looked up. So a tenant
can only ever address its own sessions, versions and cached prefixes; another tenant's are not
forbidden but absent (a 404 exactly like an unknown name), and prefix sharing (keyed by version
and salt in both engines) never crosses tenants, so `cached_tokens` tells nothing about them.

Who is who, with tenancy on: the admin token is the fleet (full access, internal `tenant~name`
names); the cluster token reads traces and per-session loads (the router's scrapes); a tenant
token acts in its own namespace; anyone else may only read health, metrics and the base model.
With `tenant_key` empty every function here answers exactly as the replica did before tenants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from burstrl.inference.api_common import ApiError, is_reader, require_admin, require_reader
from burstrl.inference.replica import InferenceReplica
from burstrl.protocol.http import SESSION_ID, bearer_matches
from burstrl.protocol.tenants import local, owner, scoped, scoped_salt, tenant_of


@dataclass(frozen=True)
class Caller:
    """Whose request this is: `tenant` (None = the fleet's own names) and whether it sees every name."""

    tenant: str | None = None
    fleet: bool = True  # admin or cluster token, or tenancy off: every name, as stored

    def name(self, name: str) -> str:
        """A session id, trace id or adapter name as stored: in the caller's namespace."""
        return scoped(self.tenant, name)

    def session(self, sid: str | None) -> str | None:
        """The session key of a call's client id (checked here, so `~` never comes from a client)."""
        if sid is None:
            return None
        if not SESSION_ID.fullmatch(sid):
            raise ApiError(400, "session_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
        return self.name(sid)

    def version(self, model: str, base: str) -> str:
        """The registry name of a request's `model`: the base model is everyone's, versions are per tenant."""
        return model if model == base else self.name(model)

    def salt(self, salt: str | None) -> str | None:
        """The `cache_salt` the engine gets (prefix sharing stays inside the tenant)."""
        return scoped_salt(self.tenant, salt)

    def sees(self, name: str) -> bool:
        """Whether a stored name is the caller's to see (listings; lookups go through `name`)."""
        return self.fleet or (self.tenant is not None and owner(name) == self.tenant)

    def shown(self, name: str) -> str:
        """A stored name as the caller knows it: a tenant's without its prefix."""
        return name if self.fleet else local(name)

    def visible(self, names: list[str]) -> list[str]:
        """The stored `names` this caller may see, as it knows them."""
        return [self.shown(n) for n in names if self.sees(n)]

    def say(self, message: str) -> str:
        """An error message in the caller's own names (its namespace's prefix taken out)."""
        return message if self.tenant is None else message.replace(scoped(self.tenant, ""), "")


FLEET = Caller()
ANONYMOUS = Caller(fleet=False)


def _tenant(rep: InferenceReplica, request: Request) -> Caller | None:
    tenant = tenant_of(request.headers, rep.cfg.server.tenant_key)
    return None if tenant is None else Caller(tenant, fleet=False)


def generating(rep: InferenceReplica, request: Request) -> Caller:
    """A generation call: anyone without tenancy; with it, a tenant token or the admin token (401 else)."""
    if not rep.cfg.server.tenant_key or bearer_matches(request.headers, rep.admin_token):
        return FLEET
    caller = _tenant(rep, request)
    if caller is None:
        raise ApiError(401, "this replica is shared by tenants: send `Authorization: Bearer <tenant token>`",
                       "authentication_error")
    return caller


def _fleet_or_tenant(rep: InferenceReplica, request: Request,
                     require: Callable[[InferenceReplica, Request], None]) -> Caller:
    """The fleet if the request passes `require` (a fleet token check), else the tenant of its tenant
    token; neither: `require`'s 401."""
    try:
        require(rep, request)
    except ApiError:
        caller = _tenant(rep, request)
        if caller is None:
            raise
        return caller
    return FLEET


def reading_traces(rep: InferenceReplica, request: Request) -> Caller:
    """Reading a trace: the admin or cluster token (every session), or a tenant token (its own)."""
    return _fleet_or_tenant(rep, request, require_reader)


def owning(rep: InferenceReplica, request: Request) -> Caller:
    """Releasing a session or pushing, loading and unloading versions: the admin token (any name),
    or a tenant token (its own namespace); 401 else."""
    return _fleet_or_tenant(rep, request, require_admin)


def viewing(rep: InferenceReplica, request: Request) -> Caller:
    """Listing versions (`/v1/models`, `/v1/loads`), which needs no token: without tenancy everyone
    sees everything, as before; with it a tenant sees its own versions, the fleet all, others none."""
    if not rep.cfg.server.tenant_key or is_reader(rep, request):
        return FLEET
    return _tenant(rep, request) or ANONYMOUS
