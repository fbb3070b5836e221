"""`burstrl fleet up`: a long-lived router and replicas that several runs (tenants) share.

Why a `Launcher` without a trainer: everything a run's launcher does for its fleet (start the router
and the replicas from the run config's `fleet`/`engine`/`model` sections, replace dead replicas,
apply `burstrl scale FLEET_DIR`, drain, sample fleet.jsonl, stop every process group on
SIGTERM/SIGINT) is what a shared fleet needs, so it is reused as it is; what differs is that the
fleet has no store and no end: it serves until it is stopped. Its router and replicas run with a
tenant key (`router.tenant_key`, `server.tenant_key`), kept in FLEET_DIR/tenant.key (mode 600;
kept across restarts, so tokens stay valid), from which `burstrl fleet token` mints each run's
token. FLEET_DIR/fleet.json says where the router is and where the key and the admin token are.

A tenant whose run was killed with -9 (so nothing of it released its versions) is released by the
fleet after `fleet.tenant_idle_s` without a call from its launcher (`idle_tenants.py`), its sandboxes
on the fleet's sandbox nodes deleted with it.

The run's autoscaler is not applied here: its signals (the trainer's wait, the store's buffer) are one
run's. With `autoscale.enabled` the fleet's own (`fleet_autoscale.py`) sizes the on-demand pool from
all tenants' demand as the router's admission sees it (sessions waiting for a place, places in use),
so it needs `router.max_sessions_per_replica` > 0 (issue 51).

With `fleet.sandbox_nodes` N the fleet also runs N sandbox node agents (`sandbox_nodes.py`) with its
tenant key, listed in fleet.json and to tenants by the router (`GET /v1/fleet/sandbox-nodes`).
On Ray (any N > 0) it runs one agent on each node carrying `sandbox_node` instead (the provider's
`SandboxAgents`, with the same tenant flags and the fleet's node token); those nodes come and go, so
the supervisor polls them and tells the router (`PUT /v1/fleet/sandbox-nodes`, cluster token), fleet.json
and the idle-tenant sweep each new list, and tells a restarted router again.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from burstrl.atomic import write_text
from burstrl.config import RunConfig, dump_toml
from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.launcher import control
from burstrl.launcher.control import write_secret
from burstrl.launcher.fleet_autoscale import FleetAutoscaler
from burstrl.launcher.idle_tenants import IdleTenants
from burstrl.launcher.run import (
    SANDBOX_NODE_POLL_S,
    Launcher,
    LaunchError,
    _cause,
    _get_json,
    _tail,
)
from burstrl.launcher.sandbox_nodes import TOKEN_FILE, FleetSandboxNodes, tenant_flags, write_node_token

KEY_FILE = "tenant.key"
ADMIN_FILE = "admin.token"
INFO_FILE = "fleet.json"


def tenant_key(fleet_dir: Path) -> str:
    """The fleet's tenant key: FLEET_DIR/tenant.key's, else a new one written there."""
    path = fleet_dir / KEY_FILE
    if path.exists():
        key = path.read_text().strip()
        if key:
            return key
    key = secrets.token_hex(32)
    write_secret(path, key)
    return key


def fleet_info(fleet_dir: Path) -> dict[str, Any]:
    """FLEET_DIR/fleet.json of a fleet that is up; LaunchError if there is none."""
    path = fleet_dir / INFO_FILE
    if not path.exists():
        raise LaunchError(f"{fleet_dir}: no fleet is up there (no {INFO_FILE}; start one with burstrl fleet up)")
    return json.loads(path.read_text())


class SharedFleet(Launcher):
    def __init__(self, cfg: RunConfig, live: bool | None = False) -> None:
        self.autoscaler = FleetAutoscaler(cfg)  # before the provider starts: refuses a config it cannot serve
        super().__init__(cfg, resume=False, live=live)
        self.key = ""
        self.idle: IdleTenants | None = None
        self.sandbox_nodes: FleetSandboxNodes | None = None  # local provider; on Ray: the provider's agents
        self.info: dict[str, Any] = {}  # fleet.json's
        self.told_router: list[dict[str, str]] | None = None  # the node list the router has now (Ray)
        self.last_router_push = 0.0

    STOP_LINE = "stopped: taking the fleet down (its router, replicas and sandbox nodes; tenants' runs lose them)"

    def prepare(self) -> bool:
        """The fleet directory, its tenant key and admin token; a live fleet there is refused."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            control.live_launcher(self.run_dir)
        except control.ControlError:
            pass
        else:
            raise LaunchError(f"{self.run_dir}: a fleet is already up there (launcher.json); stop it first")
        self.key = tenant_key(self.run_dir)
        write_secret(self.run_dir / ADMIN_FILE, self.admin_token)
        Path(self.cfg.volume()).mkdir(parents=True, exist_ok=True)
        (self.run_dir / "fleet_config.toml").write_text(dump_toml(self.cfg))
        self.event("fleet_started")
        return False

    def start_roles(self) -> None:
        """The router and the replicas with the tenant key (their role files, which hold it, mode 600)."""
        nodes = self.start_fleet_sandbox_nodes()
        self.told_router = nodes
        router = self.cfg.router_config().model_copy(update={"tenant_key": self.key, "sandbox_nodes": nodes})
        serve = self.cfg.serve_config()
        serve.server = serve.server.model_copy(update={"tenant_key": self.key})
        (self.run_dir / "roles").mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.run_dir / "roles", 0o700)
        self.start_fleet(router, serve)
        self.wait_for_first_replica()
        control.write_launcher_info(self.run_dir, self.router.url)  # `burstrl scale FLEET_DIR` finds it
        token_file = self.run_dir / TOKEN_FILE if self.cfg.fleet.sandbox_nodes else None
        self.info = {"router": self.router.url, "key_file": str(self.run_dir / KEY_FILE),
                     "admin_token_file": str(self.run_dir / ADMIN_FILE), "pid": os.getpid(), "started": time.time(),
                     "sandbox_nodes": nodes, "sandbox_node_token_file": str(token_file) if token_file else None}
        write_text(self.run_dir / INFO_FILE, json.dumps(self.info))
        self.http = sync_client(timeout=2.0)
        self.idle = IdleTenants(self.http, self.router.url, self.cluster_token, self.admin_token,
                                self.cfg.fleet.tenant_idle_s, self.event, nodes=[n["url"] for n in nodes],
                                node_token=token_file.read_text().strip() if token_file else "")
        print(f"fleet ready at {self.router.url} ({len(self.fleet.up())} replicas up); tenant tokens: burstrl fleet "
              f"token NAME --key-file {self.run_dir / KEY_FILE}", flush=True)

    def start_fleet_sandbox_nodes(self) -> list[dict[str, str]]:
        """The fleet's sandbox node agents ({name, url}) with its tenant key and node token: N on this
        host (local provider), or one on each Ray node carrying `sandbox_node` (none there yet: an empty
        list, and agents on the nodes that join)."""
        if not self.cfg.fleet.sandbox_nodes:
            return []
        try:
            if self.cfg.provider != "ray":
                self.sandbox_nodes = FleetSandboxNodes(self.cfg, self.run_dir, KEY_FILE)
                nodes = self.sandbox_nodes.start()
            else:
                token = write_node_token(self.run_dir)
                self.provider.start_sandbox_nodes(self.cfg.orchestrator.swe.backend, token=token, tenant_key=self.key,
                                                  tenant_flags=lambda key_file: tenant_flags(self.cfg, key_file))
                nodes = self.provider.sandbox_node_list()
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from None
        self.event("sandbox_nodes", detail=", ".join(f"{n['name']} {n['url']}" for n in nodes) or
                   "none yet: agents start on the sandbox_node nodes that join")
        return nodes

    def follow_sandbox_nodes(self) -> None:
        """Ray: agents on sandbox nodes that joined, none on those that left (`poll_sandbox_nodes`); each new
        list goes to fleet.json, the idle-tenant sweep and the router. A router that did not take it
        (restarting) is told again a few seconds later."""
        if self.cfg.provider != "ray" or not self.cfg.fleet.sandbox_nodes:
            return
        self.poll_sandbox_nodes()
        nodes = self.provider.sandbox_node_list()
        if nodes != self.info["sandbox_nodes"]:
            self.info["sandbox_nodes"] = nodes
            write_text(self.run_dir / INFO_FILE, json.dumps(self.info))
            self.idle.nodes = [n["url"] for n in nodes]
        if nodes == self.told_router or time.monotonic() - self.last_router_push < SANDBOX_NODE_POLL_S:
            return
        self.last_router_push = time.monotonic()
        try:
            fetch(self.http, "PUT", f"{self.router.url}/v1/fleet/sandbox-nodes", deadline=5.0, json={"nodes": nodes},
                  headers={"Authorization": f"Bearer {self.cluster_token}"}).check()
        except CallFailed as exc:
            self.event("sandbox_nodes", detail=f"the router did not take the node list ({exc}); retrying")
            return
        self.told_router = nodes
        self.event("sandbox_nodes", detail="the router lists " + (", ".join(n["url"] for n in nodes) or "none"))

    def supervise(self) -> None:
        """Until SIGTERM/SIGINT (`Stopped`) or a router that cannot be kept up (`LaunchError`)."""
        while not self.check_roles():
            self.replace_dead()
            self.apply_scale_request()
            self.autoscaler.check(self)
            self.fleet.finish_drains()
            self.idle.check([r.url for r in self.fleet.up()])
            for change in self.sandbox_nodes.replace_dead() if self.sandbox_nodes else []:
                self.event("sandbox_nodes", detail=change)
            self.follow_sandbox_nodes()
            self.sample()
            time.sleep(0.5)

    def check_roles(self) -> bool:
        """Never done; a router that exited (and was not restarted in place) ends the fleet."""
        if self.router.poll() is not None:
            raise LaunchError(f"the router exited with status {self.router.returncode}{_cause(self.router)}; log: "
                              f"{self.router.log}\n{_tail(self.router.log)}")
        if self.router.restarts > self.router_restarts:
            self.router_restarts = self.router.restarts
            self.event("router_restarted", detail=f"restart {self.router.restarts} at {self.router.url}")
            self.fleet.reregister()
            self.told_router = None  # it lists its config's sandbox nodes again: `follow_sandbox_nodes` re-tells it
        return False

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_sample < 1.0:
            return
        self.last_sample = now
        self.router_stats = _get_json(self.http, f"{self.router.url}/v1/stats") or self.router_stats
        totals = self.router_stats.get("totals", {})
        sample = {"t": time.time(), "kind": "sample", "replicas": self.fleet.alive(),
                  "routable": totals.get("replicas", 0), "cache_hit_rate": totals.get("cache_hit_rate", 0.0),
                  "sessions": totals.get("sessions", 0), "spot_losses": self.fleet.spot_losses}
        with open(self.run_dir / "fleet.jsonl", "a") as f:
            f.write(json.dumps(sample) + "\n")

    def teardown(self, outcome: str, detail: str) -> None:
        """Stop every replica and the router; the key stays (tokens minted from it stay valid)."""
        (self.run_dir / INFO_FILE).unlink(missing_ok=True)
        self.stop_children()
        if self.sandbox_nodes is not None:
            self.sandbox_nodes.stop()
        self.event(outcome.replace("run_", "fleet_"), detail=detail)
        print(f"fleet stopped ({outcome.replace('run_', '')})", file=sys.stderr, flush=True)
