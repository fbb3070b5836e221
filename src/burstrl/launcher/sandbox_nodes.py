"""A shared fleet's sandbox nodes (issue 51): `fleet.sandbox_nodes` node agents that `burstrl fleet up`
runs with the fleet's tenant key, so every tenant's SWE sandboxes go to nodes the fleet owns.

Why the tenant key and not a token per run: the agent checks a tenant token itself
(`sandbox/node_tenants.py`), so a run that starts later needs nothing from the fleet but the token
it already has; its sandboxes are its own there, `fleet.sandbox_tenant_max` caps how many one
tenant may hold per node, and with `fleet.sandbox_node_slots` the tenants there share a node's
slots by their `router.tenants.<name>.weight` (`sandbox/node_shares.py`). The node's own token
(FLEET_DIR/sandbox-node.token, mode 600) stays the fleet's: no tenant is ever given it.

Local provider only: the agents run on the fleet's host, as its children (they die with it). One
that exits is started again at the same URL (the list the router gives tenants stays true) and
state dir (the new agent sweeps what the dead one left); its sandboxes died with it, as a dead
node's do in any run (the tenant's `ClusterPool` retries such an attempt).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from burstrl.protocol.process import RoleProcess, start_role

TOKEN_FILE = "sandbox-node.token"
RETRY_S = 10.0  # between tries to restart an agent whose restart failed


def write_node_token(fleet_dir: Path) -> str:
    """A new node token for the fleet's agents, in FLEET_DIR/sandbox-node.token (mode 600; the fleet's
    idle sweep reads it there); the token."""
    from burstrl.launcher.control import write_secret

    token = secrets.token_hex(32)
    write_secret(Path(fleet_dir) / TOKEN_FILE, token)
    return token


def tenant_flags(cfg: Any, key_file: Path) -> list[str]:
    """The `burstrl sandbox node` flags that make an agent one of the fleet's: its tenant key, the
    fleet's per-tenant limits, its slots and the tenants' fair-share weights (the same on every
    provider). Why the router's weights: one weight per tenant for the whole fleet, so a run's share
    of sandboxes is its share of generation; the fleet's own sessions ('') are no node tenant."""
    flags = ["--tenant-key-file", str(key_file)]
    if cfg.fleet.sandbox_tenant_max:
        flags += ["--tenant-max-sandboxes", str(cfg.fleet.sandbox_tenant_max)]
    if cfg.fleet.sandbox_node_slots:
        flags += ["--max-sandboxes", str(cfg.fleet.sandbox_node_slots)]
    weights = {name: t.weight for name, t in cfg.router.tenants.items() if name and t.weight != 1}
    if weights:
        flags += ["--tenant-weights", ",".join(f"{name}={w:g}" for name, w in sorted(weights.items()))]
    return flags


class FleetSandboxNodes:
    def __init__(self, cfg: Any, fleet_dir: Path, key_file: str) -> None:
        self.cfg, self.fleet_dir = cfg, Path(fleet_dir)
        self.key_file = self.fleet_dir / key_file
        self.token_file = self.fleet_dir / TOKEN_FILE
        self.procs: list[RoleProcess] = []
        self.state_dirs: list[Path] = []
        self.restarts = 0
        self.next_try: dict[int, float] = {}  # node -> when a failed restart may be tried again

    def start(self) -> list[dict[str, str]]:
        """Start the agents; their {name, url}. RuntimeError naming the one that did not start."""
        if self.cfg.provider != "local":  # on Ray the provider's SandboxAgents run them (shared_fleet.py)
            raise RuntimeError(f"fleet.sandbox_nodes: these agents run on the fleet's host (local provider), not "
                               f"under provider {self.cfg.provider!r}")
        write_node_token(self.fleet_dir)
        nodes = []
        for i in range(self.cfg.fleet.sandbox_nodes):
            self.state_dirs.append(Path(tempfile.mkdtemp(prefix="bfsn", dir="/tmp")))  # short: socket paths <= 107 B
            try:
                proc = self._start(i, port=0)
            except RuntimeError as exc:
                self.stop()
                raise RuntimeError(f"the fleet's sandbox node {i} failed to start: {exc}") from None
            self.procs.append(proc)
            nodes.append({"name": self.name(i), "url": proc.url})
        return nodes

    @staticmethod
    def name(i: int) -> str:
        return f"fleet-sandbox-{i}"

    def _start(self, i: int, port: int) -> RoleProcess:
        args = ["sandbox", "node", "--name", self.name(i), "--backend", self.cfg.orchestrator.swe.backend,
                "--port", str(port), "--state-dir", str(self.state_dirs[i]), "--token-file", str(self.token_file),
                *tenant_flags(self.cfg, self.key_file)]
        return start_role(args, self.fleet_dir / "logs", f"{self.name(i)}.log", timeout=60.0, append=port != 0,
                          die_with_parent=True)

    def replace_dead(self) -> list[str]:
        """Start again, at its URL, each agent that exited; what happened to each, for the fleet's events."""
        done = []
        for i, proc in enumerate(self.procs):
            if proc.poll() is None or time.monotonic() < self.next_try.get(i, 0.0):
                continue
            port = int(proc.url.rsplit(":", 1)[1])
            try:
                self.procs[i] = self._start(i, port)
            except RuntimeError as exc:  # e.g. its port taken meanwhile: tried again in a while
                self.next_try[i] = time.monotonic() + RETRY_S
                done.append(f"{self.name(i)} exited ({proc.returncode}); restart failed: {str(exc)[:300]}")
                continue
            self.restarts += 1
            done.append(f"{self.name(i)} exited ({proc.returncode}); restarted at {self.procs[i].url}")
        return done

    def stop(self) -> None:
        """SIGTERM each agent (it closes the sandboxes it owns), then remove their state dirs."""
        for proc in self.procs:
            proc.stop(timeout=15.0)
        for state in self.state_dirs:
            if state.is_dir() and os.stat(state).st_uid == os.getuid():
                shutil.rmtree(state, ignore_errors=True)
        self.procs, self.state_dirs = [], []
