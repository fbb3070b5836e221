"""The five ways the router's registry loses a replica, for tests of what a loss frees."""

from __future__ import annotations

from typing import Any

DEATHS = ("remove", "mark_dead", "scrape_503", "unanswered", "reject")


def end_replica(reg: Any, replica: str, death: str) -> None:
    """Take `replica` out of `reg` (a `router.registry.Registry`) the way `death` names."""
    if death == "remove":
        reg.remove(replica)
    elif death == "mark_dead":
        reg.mark_dead(replica)
    elif death == "scrape_503":
        reg.scrape_failed(replica, 503)
    elif death == "unanswered":
        for _ in range(reg.health_failures):
            reg.scrape_failed(replica)
    elif death == "reject":
        reg.reject(replica, "loads: not JSON")
    else:
        raise ValueError(f"no such death: {death}")
