"""Tenants on a sandbox node (issue 51): whose sandbox is whose, and how many each may hold.

Why the fleet's tenant tokens: a sandbox node run by a shared fleet (`burstrl fleet up
--fleet.sandbox_nodes N`) serves several runs, each of which knows only its own tenant token
(`<tenant>.<hmac>`, `protocol/tenants.py`). An agent given the fleet's tenant key (a mode-600
file, never argv) checks such a token itself, with no table to keep in sync, and acts for that
tenant; the node's own token still acts for the node (every sandbox, the full report).

Why absent, not forbidden: a sandbox a tenant creates is owned by it; another tenant's sandbox
is not in its report and answers its DELETE with the same 404 as an id that never existed, so
a tenant learns nothing of another's ids, addresses, sockets, pids or tokens (a daemon's token is
only ever in its create answer). What a tenant's report keeps of the others is what placement
needs to score the node: one anonymous aggregate (`others`: count, requests, limits, usage) and
the node's totals and cached layer digests.

Why a cap per tenant: the node's slots (`--max-sandboxes`) and allocatable are shared, so one
tenant could take them all; beyond its cap (`--tenant-max-sandboxes`, or its own in
`--tenant-caps a=2,b=8`) a create is a 429 at once, counting its sandboxes still starting. Caps are
fixed; the weighted fair shares of the slots among the tenants there now (`--tenant-weights`) are
`node_shares.py`'s, and a tenant sees only its own share in its report.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from burstrl.protocol.http import bearer_matches
from burstrl.protocol.tenants import check_name, tenant_of

T = TypeVar("T")
OTHERS = "(other tenants)"  # the name of the aggregate in a tenant's `node_state`


def read_tenant_key(path: str | Path) -> str:
    """The fleet's tenant key from `path`, a file of this uid's that nobody else may read or write
    (ValueError naming why not: a key others can read lets them mint any tenant's token)."""
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"tenant key file {p} is not a regular file")
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"tenant key file {p} is uid {st.st_uid}'s with mode {stat.S_IMODE(st.st_mode):o}: "
                             "it must be this user's and mode 600 (chmod 600)")
        key = f.read().strip()
    if not key:
        raise ValueError(f"tenant key file {p} is empty")
    return key


def parse_tenant_values(text: str | None, flag: str, value: Callable[[str], T | None], expected: str) -> dict[str, T]:
    """`a=x,b=y` -> {"a": value("x"), ...} for a `--tenant-...` flag; ValueError naming `flag`, the
    first bad entry and `expected` (an entry whose `value` is None, or that has no `=`, is bad)."""
    out: dict[str, T] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, eq, raw = item.strip().partition("=")
        parsed = value(raw.strip()) if eq else None
        if parsed is None:
            raise ValueError(f"{flag} entry {item!r}: expected {expected}")
        out[check_name(name.strip())] = parsed
    return out


def parse_caps(text: str | None) -> dict[str, int]:
    """`a=2,b=8` -> {"a": 2, "b": 8} (ValueError naming the first bad entry)."""
    return parse_tenant_values(text, "--tenant-caps", lambda v: int(v) if v.isdigit() else None,
                               "TENANT=N, e.g. a=2,b=8")


@dataclass(frozen=True)
class NodeTenancy:
    """The agent's tenant key (empty: no tenants, only the node token passes) and caps."""

    key: str = ""
    max_per_tenant: int | None = None  # live sandboxes (running or starting) per tenant; None: no cap
    caps: Mapping[str, int] = field(default_factory=dict)  # per tenant, over max_per_tenant
    weights: Mapping[str, float] = field(default_factory=dict)  # fair-share weights (`node_shares.py`); unlisted: 1
    active_s: float = 30.0  # a tenant that asked within this long keeps its share (`node_shares.py`)

    def caller(self, headers: Mapping[str, str], node_token: str) -> tuple[bool, str | None]:
        """(authorized, tenant): (True, None) for the node token, (True, name) for a valid tenant
        token, (False, None) else. `headers` lower-cased."""
        if bearer_matches(headers, node_token):
            return True, None
        tenant = tenant_of(headers, self.key)
        return (tenant is not None), tenant

    def cap(self, tenant: str) -> int | None:
        return self.caps.get(tenant, self.max_per_tenant)

    def over_cap(self, tenant: str | None, live: int, node: str) -> str | None:
        """Why tenant `tenant` (with `live` sandboxes running or starting) may not have one more; None if it may."""
        cap = None if tenant is None else self.cap(tenant)
        if cap is None or live < cap:
            return None
        where = "--tenant-caps" if tenant in self.caps else "--tenant-max-sandboxes"
        return (f"tenant {tenant!r} holds {live} sandboxes on node {node}, its cap ({where} = {cap}); "
                "delete one first")


def _sum_usage(entries: list[dict[str, Any]], key: str) -> dict[str, float]:
    us = [e["usage"][key] for e in entries]
    return {"mean": sum(u["mean"] for u in us), "var": sum(u["var"] for u in us),
            "high": sum(u["high"] for u in us), "samples": min((u["samples"] for u in us), default=0)}


def tenant_view(report: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """The node report as `tenant` may see it: its own sandboxes, the others as one anonymous
    aggregate, no paths of the node's sweeps. The node's own token (None) sees it all."""
    if tenant is None:
        return report
    mine = [s for s in report["sandboxes"] if s.get("tenant") == tenant]
    rest = [s for s in report["sandboxes"] if s.get("tenant") != tenant]
    others = {"count": len(rest),
              "requests": {k: sum(s["requests"][k] for s in rest) for k in ("cpu", "mem", "pids")},
              "limits_requested": {k: sum(s["limits_requested"][k] for s in rest) for k in ("cpu", "mem", "pids")},
              "usage": {"cpu": _sum_usage(rest, "cpu"), "mem": _sum_usage(rest, "mem")}}
    hidden = ("swept_at_start", "swept_agent_dirs", "swept_agent_errors", "shares")
    return {**{k: v for k, v in report.items() if k not in hidden}, "sandboxes": mine, "others": others,
            "tenant": tenant, "share": own_share(report.get("shares"), tenant)}


def own_share(shares: Mapping[str, Any] | None, tenant: str) -> dict[str, Any] | None:
    """A tenant's view of the node's fair shares: its own entry and the slot count, never the others'
    names or weights (`node_shares.FairShares.report`)."""
    if not shares:
        return None
    mine = shares["tenants"].get(tenant, {"held": 0, "weight": None, "share": None, "active": False})
    return {"slots": shares["slots"], **mine}
