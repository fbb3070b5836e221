"""KV-token quotas of tenants (`router.tenants.<name>.max_kv_tokens`, issue 51): what a tenant holds.

The figure is the one placement judges replicas by (`policies.projected_headroom`): each session's
projected *final* size from the registry's `SizeModel`, not its size now. Why final sizes: a
session is admitted once and then grows call by call (agent contexts grow with every tool call),
and its later calls always pass admission. Counted at current sizes, a new session would weigh its
first prompt only (often 0: a text prompt), so a tenant could open any number of sessions while it
was small and then fill the fleet's KV as they grow, past any cap: the quota would stop nothing.
Counted at projected final sizes, a tenant at its cap holds exactly the headroom placement set
aside for its sessions, and quota and routing agree on what a session costs.

What a session weighs, as placement sees it: reported live by its home (the last scrape) ->
`SizeModel.project(kind, its tokens now)` (never below its size now, so a session that outgrew its
projection weighs what it holds); placed and not yet shown by a scrape -> `project_new` of its
placement (the caller's hint counts, as in placement); otherwise (its home no longer lists it, or
its placement was forgotten) -> the kind's expected size, until the session is released (trace
DELETE) or pruned, as it keeps its place under `max_sessions`. Units are context tokens (the size
model's): on a replica with sliding-window layers a session's KV is smaller (`ReplicaView.kv_cost`),
so the quota is an upper bound there and the same cap means the same thing on every replica.

A session homed on a removed or unhealthy replica weighs nothing (as in `Shares.live()`): it runs
nowhere. Sessions admitted and not yet homed, and those waiting for a place, weigh their
projection at admission (`Shares` keeps those). Everything here is read-only over the registry.
"""

from __future__ import annotations

from burstrl.protocol.tenants import owner
from burstrl.router.policies import NewSession, kind_of
from burstrl.router.registry import Registry

FLEET_TENANT = ""  # the namespace of sessions without tenancy (as in shares.py)


def new_session_kv(registry: Registry, kind: str, expected_tokens: int) -> float:
    """Projected final size of a new session, as placement will size it (`SizeModel.project_new`):
    the kind's estimate, or the caller's hint if larger (a hint can only raise it)."""
    sizes = registry.sizes
    return sizes.project_new(NewSession(id="", kind=sizes.admit(kind), expected_tokens=max(0, expected_tokens)))


def homed_kv(registry: Registry, tenant: str, up: set[str]) -> tuple[float, set[str]]:
    """Projected tokens of `tenant`'s sessions homed on a healthy replica (`up`), and those sessions.

    O(homes), as `Shares.live()`; run only for a tenant with a KV cap, once per new session.
    """
    sizes, replicas = registry.sizes, registry.replicas
    recent: dict[str, NewSession] = {}
    for url in up:
        for placed in replicas[url].recent_assignments:
            if placed.id:
                recent[placed.id] = placed
    total, counted = 0.0, set()
    for key, url in registry.homes.items():
        if url not in up or (owner(key) or FLEET_TENANT) != tenant:
            continue
        counted.add(key)
        view = replicas[url]
        kind = registry.kinds.get(key) or kind_of(owner(key), "default")
        tokens = view.live_sessions.get(key)
        if tokens is not None:
            total += sizes.project(view.session_kinds.get(key, kind), tokens)
        elif key in recent:
            total += sizes.project_new(recent[key])
        else:
            total += sizes.expected(kind)
    return total, counted


def refusal_message(tenant: str, cap: int, held: float, new: float) -> str:
    """The 429's message: the figures and the setting (OpenAI error shape via `RouteError`)."""
    name = tenant or '""'
    return (f"tenant KV quota reached: its live and waiting sessions are projected to hold {held:.0f} KV tokens "
            f"and this new session {new:.0f} more (router.tenants.{name}.max_kv_tokens = {cap}); "
            "end a session or try again later")
