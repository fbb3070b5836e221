"""A shared fleet's sandbox nodes (issue 51): `fleet.sandbox_nodes` node agents that `burstrl fleet up`
runs with the fleet's tenant key, so every tenant's SWE sandboxes go to nodes the fleet owns.

Why the tenant key and not a token per run: the agent checks a tenant token itself
(`sandbox/node_tenants.py`), so a run that starts later needs nothing from the fleet but the token
it already has; its sandboxes are its own there, and `fleet.sandbox_tenant_max` caps how many one
tenant may hold per node. The node's own token (FLEET_DIR/sandbox-node.token, mode 600) stays
the fleet's: no tenant is ever given it.

Local provider only: the agents run on the fleet's host, as its children (they die with it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from burstrl.protocol.process import RoleProcess, start_role

TOKEN_FILE = "sandbox-node.token"


class FleetSandboxNodes:
    def __init__(self, cfg: Any, fleet_dir: Path, key_file: str) -> None:
        self.cfg, self.fleet_dir = cfg, Path(fleet_dir)
        self.key_file = self.fleet_dir / key_file
        self.token_file = self.fleet_dir / TOKEN_FILE
        self.procs: list[RoleProcess] = []
        self.state_dirs: list[Path] = []

    def start(self) -> list[dict[str, str]]:
        """Start the agents; their {name, url}. RuntimeError naming the one that did not start."""
        from burstrl.launcher.shared_fleet import write_secret

        if self.cfg.provider != "local":
            raise RuntimeError("fleet.sandbox_nodes: only the local provider runs the fleet's sandbox nodes so far")
        write_secret(self.token_file, secrets.token_hex(32))
        nodes = []
        for i in range(self.cfg.fleet.sandbox_nodes):
            name = f"fleet-sandbox-{i}"
            state = Path(tempfile.mkdtemp(prefix="bfsn", dir="/tmp"))  # short: sandbox socket paths <= 107 bytes
            self.state_dirs.append(state)
            args = ["sandbox", "node", "--name", name, "--backend", self.cfg.orchestrator.swe.backend,
                    "--state-dir", str(state), "--token-file", str(self.token_file),
                    "--tenant-key-file", str(self.key_file)]
            if self.cfg.fleet.sandbox_tenant_max:
                args += ["--tenant-max-sandboxes", str(self.cfg.fleet.sandbox_tenant_max)]
            try:
                proc = start_role(args, self.fleet_dir / "logs", f"{name}.log", timeout=60.0, die_with_parent=True)
            except RuntimeError as exc:
                self.stop()
                raise RuntimeError(f"the fleet's sandbox node {name} failed to start: {exc}") from None
            self.procs.append(proc)
            nodes.append({"name": name, "url": proc.url})
        return nodes

    def dead(self) -> list[str]:
        """Logs of agents that exited."""
        return [str(p.log) for p in self.procs if p.poll() is not None]

    def stop(self) -> None:
        """SIGTERM each agent (it closes the sandboxes it owns), then remove their state dirs."""
        for proc in self.procs:
            proc.stop(timeout=15.0)
        for state in self.state_dirs:
            if state.is_dir() and os.stat(state).st_uid == os.getuid():
                shutil.rmtree(state, ignore_errors=True)
        self.procs, self.state_dirs = [], []
