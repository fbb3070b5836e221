"""A shared fleet unloads the versions of a tenant whose run is gone without releasing them.

Why: a run's launcher unloads its versions from every replica when the run ends (`tenant_run.py`),
but a launcher killed with -9 cannot (its trainer and orchestrator die with it: PR_SET_PDEATHSIG),
and its adapters would hold replica memory until the fleet stops. A live launcher asks the router
for the fleet's replicas every 2 s with its tenant token, and the router notes when each tenant
last asked (`router/fleet_routes.py`); a tenant that still has versions on the replicas and has not
asked for `fleet.tenant_idle_s` is released here with the replicas' admin token. A tenant the router
has not heard from since it (re)started gets the same grace from when the supervisor first saw its
versions. Its sessions are not touched: they expire on the replicas' session TTL.

Sandboxes too: a run killed with -9 leaves its sandboxes on the fleet's sandbox node agents
(`fleet.sandbox_nodes`; its orchestrator deletes them on any other end), where they hold processes
and disk and count against the tenant's cap per node, so the same run resumed could be refused. With
the nodes' own token (which sees every sandbox and its owner) a tenant with sandboxes there is a
candidate as one with versions is, and its release deletes them; a node that does not answer is
counted as failed and skipped (the next poll tries again).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import httpx

from burstrl.deadline import CallFailed, fetch
from burstrl.protocol.tenants import owner

log = logging.getLogger("burstrl.fleet")
POLL_S = 5.0  # how often the supervisor looks for idle tenants
MAX_BYTES = 16 << 20


class IdleTenants:
    def __init__(self, http: httpx.Client, router: str, cluster_token: str, admin_token: str, idle_s: float,
                 event: Callable[..., None], nodes: list[str] | None = None, node_token: str = "") -> None:
        self.http, self.router, self.idle_s, self.event = http, router, idle_s, event
        self.nodes = list(nodes or [])  # the fleet's sandbox node agents' URLs
        self.node = {"Authorization": f"Bearer {node_token}"}
        self.cluster = {"Authorization": f"Bearer {cluster_token}"}
        self.admin = {"Authorization": f"Bearer {admin_token}"}
        self.noticed: dict[str, float] = {}  # tenant -> when (monotonic) its versions were first seen here
        self.last_poll = 0.0
        self.released = 0  # tenants released so far

    def check(self, replicas: list[str]) -> None:
        """Every POLL_S: release each tenant with versions on `replicas` that has been quiet too long."""
        if self.idle_s <= 0 or time.monotonic() - self.last_poll < POLL_S:
            return
        self.last_poll = now = time.monotonic()
        try:
            asked = fetch(self.http, "GET", f"{self.router}/v1/fleet/tenants", deadline=5.0,
                          headers=self.cluster).check().json()["tenants"]
        except (CallFailed, ValueError, KeyError) as exc:  # the router restarting: the next poll retries
            log.warning("could not read the tenants' last calls: %s", exc)
            return
        versions, sandboxes = self.versions(replicas), self.sandboxes()
        tenants = {owner(n) for names in versions.values() for n in names} | {
            t for held in sandboxes.values() for t in held.values()}
        for tenant in sorted(tenants - {None}):
            self.noticed.setdefault(tenant, now)
            quiet = asked.get(tenant, now - self.noticed[tenant])
            if quiet > self.idle_s:
                self.release(tenant, versions, quiet, sandboxes)

    def versions(self, replicas: list[str]) -> dict[str, list[str]]:
        """Each replica's adapter names as stored (`<tenant>~<name>`); a replica that does not answer has none."""
        out = {}
        for url in replicas:
            try:
                models = fetch(self.http, "GET", f"{url}/v1/models", deadline=5.0, max_bytes=MAX_BYTES,
                               headers=self.admin).check().json()
                out[url] = [m["id"] for m in models["data"] if owner(m["id"])]
            except (CallFailed, ValueError, KeyError, TypeError) as exc:
                log.warning("%s did not list its versions: %s", url, exc)
        return out

    def sandboxes(self) -> dict[str, dict[str, str]]:
        """Each sandbox node's tenants' sandboxes ({node url: {id: tenant}}, the node token's full report);
        a node that does not answer has none (this poll)."""
        out: dict[str, dict[str, str]] = {}
        for url in self.nodes:
            try:
                report = fetch(self.http, "GET", f"{url}/v1/node", deadline=5.0, max_bytes=MAX_BYTES,
                               headers=self.node).check().json()
                out[url] = {str(s["id"]): s["tenant"] for s in report["sandboxes"] if s.get("tenant")}
            except (CallFailed, ValueError, KeyError, TypeError) as exc:
                log.warning("sandbox node %s did not report: %s", url, exc)
        return out

    def delete_sandboxes(self, tenant: str, sandboxes: dict[str, dict[str, str]]) -> tuple[int, int]:
        """Delete every sandbox of `tenant` on every node (the node token); (deleted, failed)."""
        done, failed = 0, 0
        for url, held in sandboxes.items():
            for sid in (s for s, t in held.items() if t == tenant):
                try:
                    fetch(self.http, "DELETE", f"{url}/v1/sandboxes/{sid}", deadline=15.0, timeout=15.0,
                          headers=self.node).check()
                    done += 1
                except CallFailed as exc:  # gone meanwhile (404) or the node down: the next poll sees
                    failed += 1
                    log.warning("deleting sandbox %s of %s on %s failed: %s", sid, tenant, url, exc)
        return done, failed

    def release(self, tenant: str, versions: dict[str, list[str]], quiet: float,
                sandboxes: dict[str, dict[str, str]] | None = None) -> None:
        """Unload every version of `tenant` on every replica (retiring where sessions still use one)
        and delete its sandboxes on the fleet's sandbox nodes."""
        done, failed = 0, 0
        for url, names in versions.items():
            for name in (n for n in names if owner(n) == tenant):
                try:
                    fetch(self.http, "POST", f"{url}/v1/unload_lora_adapter", deadline=10.0, headers=self.admin,
                          json={"lora_name": name}).check()
                    done += 1
                except CallFailed as exc:  # the next poll tries again
                    failed += 1
                    log.warning("unloading %s from %s failed: %s", name, url, exc)
        deleted, not_deleted = self.delete_sandboxes(tenant, sandboxes or {})
        self.noticed.pop(tenant, None)
        self.released += 1
        self.event("tenant_released", detail=f"{tenant}: no call from its run for {quiet:.0f} s "
                   f"(fleet.tenant_idle_s {self.idle_s:g}); {done} versions unloaded, {failed} failed; "
                   f"{deleted} sandboxes deleted, {not_deleted} failed")
