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
counted as failed and skipped (the next poll tries again). The node calls go through the one client
of the node API (`sandbox/node_client.NodeClient`, as a tenant run's own release does).

Why the deletes are bounded per poll: they run in the fleet supervisor's loop (`shared_fleet.py`),
which also replaces dead replicas and applies scale requests, and a node deletes a sandbox
synchronously (its processes, its files). A poll starts at most MAX_DELETES deletes, and none after
DELETE_BUDGET_S, each a call of at most NODE_TIMEOUT_S, so one poll holds the loop for at most about
DELETE_BUDGET_S + NODE_TIMEOUT_S however many sandboxes a tenant left. The rest wait for the next poll
(POLL_S later), which goes on with the same tenant at once: its release is not final, and no new grace
starts, until none of its sandboxes is left. No thread: nothing outlives a call of `check`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from burstrl.deadline import CallFailed, fetch
from burstrl.protocol.tenants import owner
from burstrl.sandbox.node_client import NodeClient, NodeError

log = logging.getLogger("burstrl.fleet")
POLL_S = 5.0  # how often the supervisor looks for idle tenants
MAX_BYTES = 16 << 20
NODE_TIMEOUT_S = 5.0  # one node call (a report, a delete)
DELETE_BUDGET_S = 5.0  # a poll starts no sandbox delete after this long
MAX_DELETES = 16  # sandbox deletes one poll starts at most


@dataclass
class DeleteBudget:
    """What one poll may still spend on sandbox deletes: calls, and a monotonic time to start none after."""

    calls: int
    until: float

    @classmethod
    def fresh(cls, calls: int = MAX_DELETES, seconds: float = DELETE_BUDGET_S) -> DeleteBudget:
        return cls(calls, time.monotonic() + seconds)

    def take(self) -> bool:
        """Spend one call if any is left (and there is still time)."""
        if self.calls <= 0 or time.monotonic() >= self.until:
            return False
        self.calls -= 1
        return True


@dataclass
class Deletes:
    """A release's sandbox deletes: done, failed, and left for the next poll (the budget ran out)."""

    done: int = 0
    failed: int = 0
    left: int = 0


class IdleTenants:
    def __init__(self, http: httpx.Client, router: str, cluster_token: str, admin_token: str, idle_s: float,
                 event: Callable[..., None], nodes: list[str] | None = None, node_token: str = "",
                 max_deletes: int = MAX_DELETES, delete_budget_s: float = DELETE_BUDGET_S) -> None:
        self.http, self.router, self.idle_s, self.event = http, router, idle_s, event
        self.nodes = list(nodes or [])  # the fleet's sandbox node agents' URLs
        self.node_token = node_token
        self.max_deletes, self.delete_budget_s = max_deletes, delete_budget_s
        self.cluster = {"Authorization": f"Bearer {cluster_token}"}
        self.admin = {"Authorization": f"Bearer {admin_token}"}
        self.noticed: dict[str, float] = {}  # tenant -> when (monotonic) its versions were first seen here
        self.last_poll = 0.0
        self.released = 0  # tenants released so far (with none of their sandboxes left)

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
        budget = DeleteBudget.fresh(self.max_deletes, self.delete_budget_s)  # shared by this poll's releases
        for tenant in sorted(tenants - {None}):
            self.noticed.setdefault(tenant, now)
            quiet = asked.get(tenant, now - self.noticed[tenant])
            if quiet > self.idle_s:
                self.release(tenant, versions, quiet, sandboxes, budget)

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

    def node(self, url: str) -> NodeClient:
        """The node API's client with the nodes' own token (it sees every sandbox and its owner)."""
        return NodeClient(url, self.node_token, timeout=NODE_TIMEOUT_S, max_bytes=MAX_BYTES)

    def sandboxes(self) -> dict[str, dict[str, str]]:
        """Each sandbox node's tenants' sandboxes ({node url: {id: tenant}}, the node token's full report);
        a node that does not answer has none (this poll)."""
        out: dict[str, dict[str, str]] = {}
        for url in self.nodes:
            try:
                out[url] = self.node(url).owners()
            except NodeError as exc:
                log.warning("sandbox node %s did not report: %s", url, exc)
        return out

    def delete_sandboxes(self, tenant: str, sandboxes: dict[str, dict[str, str]],
                         budget: DeleteBudget | None = None) -> Deletes:
        """Delete `tenant`'s sandboxes on every node while `budget` lasts (a fresh one if None).
        A node that cannot be reached (503: down, or past NODE_TIMEOUT_S) gets no more calls this poll."""
        budget = budget or DeleteBudget.fresh(self.max_deletes, self.delete_budget_s)
        out = Deletes()
        for url, held in sandboxes.items():
            mine = [s for s, t in held.items() if t == tenant]
            client = self.node(url)
            for i, sid in enumerate(mine):
                if not budget.take():
                    out.left += len(mine) - i
                    break
                try:
                    client.delete(sid)
                    out.done += 1
                except NodeError as exc:  # gone meanwhile (404) or the node down: the next poll sees
                    out.failed += 1
                    log.warning("deleting sandbox %s of %s on %s failed: %s", sid, tenant, url, exc)
                    if exc.status == 503:
                        out.left += len(mine) - i - 1
                        break
        return out

    def unload_versions(self, tenant: str, versions: dict[str, list[str]]) -> tuple[int, int]:
        """Unload every version of `tenant` on every replica (retiring where sessions still use one); (done, failed)."""
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
        return done, failed

    def release(self, tenant: str, versions: dict[str, list[str]], quiet: float,
                sandboxes: dict[str, dict[str, str]] | None = None, budget: DeleteBudget | None = None) -> None:
        """Unload `tenant`'s versions and delete its sandboxes (as far as `budget` goes). With sandboxes
        left it stays noticed, so the next poll goes on with it without a new grace."""
        done, failed = self.unload_versions(tenant, versions)
        deletes = self.delete_sandboxes(tenant, sandboxes or {}, budget)
        if not deletes.left:
            self.noticed.pop(tenant, None)
            self.released += 1
        left = f"; {deletes.left} left for the next poll" if deletes.left else ""
        self.event("tenant_released", detail=f"{tenant}: no call from its run for {quiet:.0f} s "
                   f"(fleet.tenant_idle_s {self.idle_s:g}); {done} versions unloaded, {failed} failed; "
                   f"{deletes.done} sandboxes deleted, {deletes.failed} failed{left}")
