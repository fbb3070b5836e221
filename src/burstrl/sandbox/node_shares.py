"""Weighted fair shares of a sandbox node's slots among its tenants (issue 51).

Why shares and not only caps: a cap (`node_tenants.py`) is fixed, so it either leaves slots idle
while one tenant has work or lets a flood take the node from a tenant that comes later. A share
follows who is there: each *active* tenant (one holding a live sandbox, running or starting, or
one that asked for one, refused or not, within `--tenant-active-s`) gets

    share = slots x weight / (sum of the active tenants' weights)

of the node's slots (`--max-sandboxes`, less what the node's own token holds: that token is not a
tenant and is never refused here). `--tenant-weights a=2,b=1` sets weights; unlisted: 1.

The rule, checked at each create, under the agent's lock: a tenant below its share is admitted
(if a slot is free). A tenant at or above it is admitted only if the slots left free after the
grant still cover what the other active tenants below their shares are owed (share - held,
rounded up, and never past a tenant's cap: slots it may not use are not held for it). So idle
share goes to whoever has work (a tenant alone takes every slot), yet a tenant below its share is
never starved by one above it: as slots free, they are held for it, and the one above gets a 429
naming why. Nothing is preempted: a tenant over its share keeps what it holds until it deletes
it; sandboxes are short-lived rollouts, so the shares converge as they end.

Without `--max-sandboxes` the node has no slot count to divide, so shares are off (caps apply).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from burstrl.sandbox.node_tenants import NodeTenancy, parse_tenant_values

EPS = 1e-9  # float slack: a share of 2.0000000001 is 2


def parse_weights(text: str | None) -> dict[str, float]:
    """`a=2,b=0.5` -> {"a": 2.0, "b": 0.5} (ValueError naming the first bad entry)."""
    return parse_tenant_values(text, "--tenant-weights", _weight, "TENANT=WEIGHT > 0, e.g. a=2,b=1")


def _weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    return weight if 0 < weight < 1e9 else None


def fair_shares(slots: int, weights: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of `slots`, in proportion to its weight among `weights` (the active ones)."""
    total = sum(weights.values())
    return {t: slots * w / total for t, w in weights.items()} if total > 0 else {}


def owed(share: float, held: int, cap: int | None = None) -> int:
    """Slots still owed to a tenant holding `held` of `share` (rounded up; never past its cap)."""
    target = share if cap is None else min(share, cap)
    return max(0, math.ceil(round(target - held, 6) - EPS))


def share_refusal(tenant: str, slots: int, live: Mapping[str | None, int], shares: Mapping[str, float],
                  caps: Callable[[str], int | None] = lambda t: None) -> tuple[int, int] | None:
    """(free after the grant, owed to the others below their shares) when `tenant`, at or over its
    share, must be refused one more sandbox; None when it may have it (a full node with nobody
    owed is the pool's refusal, not a share's). `live` counts every holder's
    running and starting sandboxes (None: the node token's, which take slots but have no share)."""
    if live.get(tenant, 0) < shares.get(tenant, 0.0) - EPS:
        return None
    free_after = slots - sum(live.values()) - 1
    reserve = sum(owed(s, live.get(u, 0), caps(u)) for u, s in shares.items() if u != tenant)
    return (free_after, reserve) if reserve and free_after < reserve else None


class FairShares:
    """The node's tenants' asks and shares; not thread-safe: the agent calls it under its lock."""

    def __init__(self, tenancy: NodeTenancy, slots: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenancy, self.slots, self.clock = tenancy, slots, clock
        self.asked: dict[str, float] = {}  # tenant -> its last ask (monotonic)

    def weight(self, tenant: str) -> float:
        return self.tenancy.weights.get(tenant, 1.0)

    def active(self, live: Mapping[str | None, int]) -> list[str]:
        """The tenants that hold a live sandbox or asked for one within the last `active_s`."""
        now = self.clock()
        self.asked = {t: at for t, at in self.asked.items() if now - at <= self.tenancy.active_s}
        return sorted({t for t, n in live.items() if t is not None and n > 0} | set(self.asked))

    def shares(self, live: Mapping[str | None, int]) -> dict[str, float]:
        """The active tenants' shares of the slots the node's own token does not hold ({} if no slots)."""
        if self.slots is None:
            return {}
        return fair_shares(max(0, self.slots - live.get(None, 0)), {t: self.weight(t) for t in self.active(live)})

    def refusal(self, tenant: str | None, live: Counter[str | None], node: str) -> str | None:
        """Record `tenant`'s ask; why it may not have one more sandbox now (a 429's message), or None."""
        if tenant is None:
            return None
        self.asked[tenant] = self.clock()
        shares = self.shares(live)
        if self.slots is None or not shares:
            return None
        over = share_refusal(tenant, self.slots, live, shares, self.tenancy.cap)
        if over is None:
            return None
        free_after, reserve = over
        return (f"tenant {tenant!r} holds {live[tenant]} sandboxes on node {node}, at or over its fair share "
                f"{shares[tenant]:.2f} of {self.slots} slots (weight {self.weight(tenant):g} of "
                f"{sum(self.weight(t) for t in shares):g} among active tenants, --tenant-weights): "
                f"{free_after + 1} slots free, {reserve} owed to tenants below their shares; retry later")

    def report(self, live: Counter[str | None]) -> dict[str, Any]:
        """Per tenant (active or holding): held, weight, share (None without slots), active."""
        shares, active = self.shares(live), set(self.active(live))
        names = sorted({t for t, n in live.items() if t is not None and n > 0} | active)
        return {"slots": self.slots, "active_s": self.tenancy.active_s,
                "tenants": {t: {"held": live.get(t, 0), "weight": self.weight(t), "share": shares.get(t),
                                "active": t in active} for t in names}}

