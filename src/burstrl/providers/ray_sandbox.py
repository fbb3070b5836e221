"""Sandbox nodes on Ray (issue 18): one `burstrl sandbox node` agent per Ray node that carries the
custom resource `sandbox_node`, and the nodes file the orchestrator's `ClusterPool` reads.

Why a `RoleActor` per agent, pinned to its node by node affinity: the agent is the same command as
on a bare machine (same ready line, same signals, its own process group, dying with its actor's
worker), and the sandboxes it makes are its children, so they die with it when Ray loses the node.
The agent binds the node's IP (`--host`), so the ports it forwards to its sandboxes are reachable
from the orchestrator's node and a rollout's commands go straight to the sandbox's node.

Each agent's allocatable is what Ray says the node has (`CPU`, `memory`), so the placement policy
packs by the same numbers the cluster was declared with. One bearer token for all agents, made by
the launcher, passed in the actor's environment (never argv) and written, mode 0600, only into the
nodes file in the run directory.

A cluster without `sandbox_node` nodes gets no agents and no nodes file: sandboxes stay local.

A shared fleet's agents (`burstrl fleet up --provider ray`, `fleet.sandbox_nodes`) also get the fleet's
tenant key, so each tenant's token acts there for that tenant alone, and the fleet's node token. The
key must be a mode-600 file on the agent's node, which may not be the fleet's host: it travels in the
actor's environment, and a few lines run in the agent's process before the agent (`KEY_THEN_AGENT`)
write it to `--tenant-key-file` (a 0700 dir of this uid under /tmp, one file per start) and exec the
agent without it, so neither its argv nor its environment holds the key. The agent reads the file
as it starts; once it is ready a task on its node removes the file, so no copy of the key stays on a
node after its agent started (one whose node or fleet went first stays, mode 600).

An agent that exits while its node stays alive (a crash, the OOM killer) is started again by a
later poll (once its node is still listed `EXIT_GRACE_S` after), at most `MAX_RESTARTS` times per
node: under a new name (`-r1`, `-r2`, ...) and a new port, so the pool, which never takes back an
address it saw die, adopts it as a new node. Its sandboxes died with it; the attempts that held
them are re-run (the pool confirms their node dead).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from burstrl.providers.ray_actors import ProcessSpec, RoleActor

SANDBOX_RESOURCE = "sandbox_node"
NODES_FILE = "sandbox-nodes.json"
MAX_RESTARTS = 3  # per node and run: an agent that keeps dying on a live node is given up on
EXIT_GRACE_S = 10.0  # an agent exited this long ago on a node Ray still lists: restarted there
ACTOR_GRACE_S = 60.0  # the same when its actor died too (most often with its node)
KEY_ENV = "BURSTRL_FLEET_TENANT_KEY"  # the fleet's tenant key, in the actor's environment only
FLEET_SECRETS = ("BURSTRL_ADMIN_TOKEN", "BURSTRL_CLUSTER_TOKEN")  # the launcher's role env: no agent needs them
log = logging.getLogger("burstrl.ray")


def sandbox_nodes() -> list[dict[str, Any]]:
    """The alive Ray nodes that carry `sandbox_node`, in a stable order (by node id)."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(SANDBOX_RESOURCE, 0) > 0]
    return sorted(nodes, key=lambda n: n["NodeID"])


class SandboxAgents:
    """The node agents of a run: one per live sandbox node, kept in the nodes file, stopped together.

    `start` waits for the agents of the nodes there at launch; `poll` (called by the launcher's
    supervision loop) starts agents on nodes that joined later without waiting for them, and drops
    agents whose node left, rewriting the nodes file each time the set of ready agents changes.
    """

    def __init__(self, run_dir: Path, logs_dir: Path, env: dict[str, str], backend: str = "auto",
                 timeout_s: float = 120.0, token: str = "", tenant_key: str = "",
                 tenant_flags: Callable[[Path], list[str]] | None = None) -> None:
        """`token`: the agents' bearer (default: a new one). `tenant_key` and `tenant_flags` (the agent
        flags for a key file, `launcher/sandbox_nodes.tenant_flags`): a shared fleet's agents."""
        self.run_dir, self.logs_dir, self.env = Path(run_dir), Path(logs_dir), env
        self.backend, self.timeout_s = backend, timeout_s
        self.token = token or secrets.token_urlsafe(24)
        self.tenant_key, self.tenant_flags = tenant_key, tenant_flags
        self.actors: list[Any] = []
        self.agents: dict[str, dict[str, Any]] = {}  # by Ray node id: actor, ready ref, start time, row
        self.failed: set[str] = set()  # node ids whose agent failed to start: not retried
        self.restarts: dict[str, int] = {}  # by node id: agents started again after exiting on a live node
        self.path = self.run_dir / NODES_FILE

    @property
    def nodes(self) -> list[dict[str, str]]:
        """The nodes file's rows: the ready agents, by node id."""
        return [a["row"] for _, a in sorted(self.agents.items()) if a["row"] is not None]

    def start(self) -> Path | None:
        """One agent per sandbox node; the nodes file's path, or None when the cluster has no such node."""
        found = sandbox_nodes()
        if not found:
            return None
        for node in found:
            self._launch(node)
        for node_id, agent in self.agents.items():
            try:
                url = ray.get(agent["ready"], timeout=self.timeout_s + 30)
            except (RayActorError, GetTimeoutError, RuntimeError) as exc:
                self.stop()
                raise RuntimeError(f"the sandbox node agent on {agent['name']} failed to start: {exc}") from None
            self._adopt(node_id, url)
        self._write()
        return self.path

    def poll(self) -> list[str]:
        """Start agents on new sandbox nodes, adopt those now ready, drop those whose node is gone.

        Never blocks on an agent's start. Returns what changed (for the launcher's events)."""
        alive = {n["NodeID"]: n for n in sandbox_nodes()}
        before = self.nodes
        changes = self._restart_exited(alive)
        for node_id, node in alive.items():
            if node_id not in self.agents and node_id not in self.failed:
                self._launch(node)
                changes.append(f"starting an agent on {_node_name(node)}")
        pending = {a["ready"]: node_id for node_id, a in self.agents.items() if a["row"] is None}
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in done:
            agent = self.agents[pending[ref]]
            try:
                self._adopt(pending[ref], ray.get(ref))
                changes.append(f"agent on {agent['name']} ready at {agent['row']['url']}")
            except (RayError, RuntimeError) as exc:
                self._drop(pending[ref], failed=True)
                changes.append(f"the agent on {agent['name']} failed to start: {exc}")
        for node_id, agent in list(self.agents.items()):
            overdue = agent["row"] is None and time.monotonic() - agent["t0"] > self.timeout_s + 30
            if node_id not in alive or overdue:
                self._drop(node_id, failed=overdue)
                changes.append(f"agent on {agent['name']} dropped ({'start timed out' if overdue else 'node gone'})")
        if self.nodes != before:
            self._write()
        return changes

    def _restart_exited(self, alive: dict[str, dict[str, Any]]) -> list[str]:
        """Start again the ready agents that exited while their node is alive.

        A node going away takes its agent with it, and Ray lists a lost node as alive for a while,
        so an exit is acted on only once its node is still listed a grace period later:
        `EXIT_GRACE_S` when the agent's process exited (its actor answered with the status),
        `ACTOR_GRACE_S` when its actor died too (most often with the node). Before that the
        node-gone check may drop it first."""
        watched = {a["exit"]: node_id for node_id, a in self.agents.items() if a["row"] is not None}
        exited, _ = ray.wait(list(watched), num_returns=len(watched), timeout=0) if watched else ([], [])
        changes = []
        for ref in exited:
            node_id = watched[ref]
            agent = self.agents[node_id]
            try:
                why, grace = f"exited with status {ray.get(ref)}", EXIT_GRACE_S
            except RayError:
                why, grace = "lost its actor", ACTOR_GRACE_S
            agent["exited_at"] = agent.get("exited_at") or time.monotonic()
            if node_id in alive and time.monotonic() - agent["exited_at"] < grace:
                continue
            self._drop(node_id, failed=False)
            if node_id not in alive:
                changes.append(f"agent on {agent['name']} dropped (node gone)")
            elif self.restarts.get(node_id, 0) >= MAX_RESTARTS:
                self.failed.add(node_id)
                changes.append(f"agent on {agent['name']} {why}; given up after {MAX_RESTARTS} restarts")
            else:
                self.restarts[node_id] = self.restarts.get(node_id, 0) + 1
                self._launch(alive[node_id])
                changes.append(f"agent on {agent['name']} {why}; starting it again "
                               f"({self.restarts[node_id]}/{MAX_RESTARTS})")
        return changes

    def _launch(self, node: dict[str, Any]) -> None:
        restarts = self.restarts.get(node["NodeID"], 0)
        name = _node_name(node) + (f"-r{restarts}" if restarts else "")
        key_file = self.key_file(node["NodeID"][:12]) if self.tenant_key else None
        actor = self._actor(node, name, key_file)
        self.agents[node["NodeID"]] = {"actor": actor, "ready": actor.ready.remote(self.timeout_s),
                                       "exit": actor.wait.remote(), "t0": time.monotonic(), "row": None,
                                       "name": name, "key_file": key_file}

    def _adopt(self, node_id: str, url: str) -> None:
        """A ready agent joins the nodes file's rows; the key file it read at start is removed on its node."""
        agent = self.agents[node_id]
        agent["row"] = {"url": url, "token": self.token, "name": agent["name"]}
        if agent["key_file"] is not None:  # not waited on: a node that is gone keeps nothing to remove
            _forget_key.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                str(agent["key_file"]))

    def _drop(self, node_id: str, failed: bool) -> None:
        """Forget a node's agent and kill its actor (its node may be gone: nothing waits on it)."""
        agent = self.agents.pop(node_id)
        if failed:
            self.failed.add(node_id)
        self.actors = [a for a in self.actors if a is not agent["actor"]]
        try:
            ray.kill(agent["actor"], no_restart=True)
        except ValueError:
            pass  # already gone

    def _write(self) -> None:
        """The nodes file, replaced atomically (temp + rename, mode 0600): a reader never sees half of it."""
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.nodes, f)
        os.replace(tmp, self.path)
        log.info("sandbox node agents: %s", ", ".join(f"{n['name']} {n['url']}" for n in self.nodes) or "none")

    def _actor(self, node: dict[str, Any], name: str, key_file: Path | None) -> Any:
        """The agent's actor on `node`: allocatable from the node's Ray resources, a state dir of its own
        (an agent started again there sweeps what the one before it left)."""
        res, short = node["Resources"], node["NodeID"][:12]
        self.actors.append(None)  # reserve the index first: stop() must see every actor made
        args = ["sandbox", "node", "--backend", self.backend, "--name", name,
                "--state-dir", f"/tmp/burstrl-sbn-{os.getuid()}-{short}",  # short: socket paths <= 107 bytes
                "--sweep-glob", f"/tmp/burstrl-sbn-{os.getuid()}-*",  # dirs of agents on nodes that died
                "--layer-cache", str(_cache_root() / f"node-{short}"),
                "--cpus", f"{res.get('CPU', 0) or os.cpu_count() or 1:g}"]
        if res.get("memory"):
            args += ["--memory-mb", str(int(res["memory"]) >> 20)]
        spec = ProcessSpec(args=args, log=str(self.logs_dir / f"sandbox-node-{short}.log"),
                           env={**self.env, "BURSTRL_NODE_TOKEN": self.token}, ready_line=True, host_key="host")
        if key_file is not None:  # a fleet's agent serves tenants: none of the fleet's own tokens but its node's
            spec.args += (self.tenant_flags or _key_flag)(key_file)
            spec.env = {k: v for k, v in spec.env.items() if k not in FLEET_SECRETS}
            spec.env[KEY_ENV], spec.code = self.tenant_key, KEY_THEN_AGENT
        actor = RoleActor.options(num_cpus=0, resources={SANDBOX_RESOURCE: 0.001}, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))).remote(spec)
        self.actors[-1] = actor
        return actor

    def key_file(self, short: str) -> Path:
        """Where an agent about to start on node `short` finds the fleet's tenant key: a name of its own
        (`FLEET-NODE-NONCE.key`), so no agent reads another fleet's key, nor loses its file to the removal
        of the one before it on that node."""
        fleet = hashlib.sha256(str(self.run_dir.absolute()).encode()).hexdigest()[:12]
        return Path(f"/tmp/burstrl-sbk-{os.getuid()}") / f"{fleet}-{short}-{secrets.token_hex(4)}.key"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM each agent (it closes its sandboxes), then kill the actors."""
        live = [a for a in self.actors if a is not None]
        try:
            ray.get([a.stop.remote(timeout) for a in live], timeout=timeout + 15)
        except (RayActorError, GetTimeoutError):
            pass  # an agent whose node is gone cannot answer: its actor is killed below either way
        for a in live:
            try:
                ray.kill(a, no_restart=True)
            except ValueError:
                pass  # already gone
        self.actors = []
        self.agents = {}


def _node_name(node: dict[str, Any]) -> str:
    return f"{node['NodeManagerAddress']}-{node['NodeID'][:6]}"


def _cache_root() -> Path:
    return Path(os.environ.get("BURSTRL_CACHE") or Path.home() / ".cache" / "burstrl") / "sandbox-layers"


@ray.remote(num_cpus=0, max_retries=0)
def _forget_key(path: str) -> None:
    """On an agent's node once it is ready (it read the key as it started): its key file goes."""
    Path(path).unlink(missing_ok=True)


def _key_flag(key_file: Path) -> list[str]:
    return ["--tenant-key-file", str(key_file)]


def _write_key_then_exec_agent() -> None:
    """Runs as the agent's process before the agent (`python -c`, so nothing of burstrl imported): the
    fleet's tenant key from the environment into `--tenant-key-file`, mode 600 in a 0700 dir of this
    uid, then the agent exec'd in this process (same pid, ready line and signals) without the key in its
    environment. A dir that is not this uid's alone is refused: /tmp is everyone's."""
    import os
    import stat
    import sys

    args = sys.argv[1:]
    path = args[args.index("--tenant-key-file") + 1]
    key = os.environ.pop("BURSTRL_FLEET_TENANT_KEY")
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        sys.exit(f"{folder} is not a dir of uid {os.getuid()}'s alone (mode 700): the tenant key is not written there")
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, path)
    agent = "from burstrl.cli import main; main()"
    os.execve(sys.executable, [sys.executable, "-c", agent, *args], dict(os.environ))


KEY_THEN_AGENT = f"{inspect.getsource(_write_key_then_exec_agent)}\n_write_key_then_exec_agent()\n"
