"""`burstrl run --fleet.url URL --fleet.token TOKEN`: a run on a shared fleet brings only its trainer and orchestrator.

Why a launcher of its own (a `Launcher` without a fleet): the router and the replicas belong to
`burstrl fleet up` (`shared_fleet.py`), which outlives every run; what stays the run's is what
makes it a run: its store, checkpoints, resume, report, its trainer and orchestrator (and their
sandboxes). Both roles get the tenant token where a run with its own fleet gives them the replicas'
admin token (`BURSTRL_ADMIN_TOKEN`: the trainer's pushes, the orchestrator's traces), and the
orchestrator sends it with every call (`BURSTRL_TENANT_TOKEN`), so everything the run names lands
in its namespace on the fleet (`policy-v3` of tenant `run-a` is `run-a~policy-v3` there).

The trainer pushes each version to the replicas listed in RUN_DIR/replicas.txt, as in any run; here
the launcher keeps that list current by asking the fleet (`GET /v1/fleet/replicas`) every few
seconds, and pushes the run's newest version to a replica that joins the fleet late (a replacement,
a scale-up: it cannot read the run's volume as a late joiner of a run's own fleet does) at once,
not at the trainer's next push (`catch_up.py`). When the run ends, however it ends short of
SIGKILL, the launcher unloads the run's versions from every fleet replica with its token (best
effort, counted in fleet.jsonl); its sessions were released by the orchestrator, and any left
expire on the replicas' session TTL.

Sandboxes: where the fleet runs sandbox nodes (`fleet.sandbox_nodes`, `GET /v1/fleet/sandbox-nodes`),
the run's SWE env places its sandboxes there: its nodes file (RUN_DIR/sandbox_nodes.json, mode 600)
holds the tenant token, under which a node shows the run its own sandboxes only; else they stay local.
Its orchestrator deletes them when it stops; any it left (stopped past its grace) the launcher
deletes at the end with the tenant token, and after a -9 the fleet does (`idle_tenants.py`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from burstrl.atomic import write_text
from burstrl.config import RunConfig, dump_toml
from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.launcher.catch_up import CatchUp
from burstrl.launcher.run import SANDBOX_NODE_POLL_S, Launcher, LaunchError

REPLICA_POLL_S = 2.0  # how often the run asks the fleet which replicas its trainer pushes to
NODES_FILE = "sandbox_nodes.json"
log = logging.getLogger("burstrl.run")


def write_fleet_sandbox_nodes(http: Any, url: str, token: str, run_dir: Path) -> Path | None:
    """The fleet's sandbox nodes as a nodes file (`sandbox/cluster.load_nodes`) with the tenant
    token as each node's bearer, or None where the fleet runs none."""
    nodes = fetch(http, "GET", f"{url.rstrip('/')}/v1/fleet/sandbox-nodes", deadline=5.0,
                  headers={"Authorization": f"Bearer {token}"}).check().json()["nodes"]
    if not nodes:
        return None
    path = run_dir / NODES_FILE
    text = json.dumps([{"url": str(n["url"]), "token": token, "name": str(n.get("name", ""))} for n in nodes])
    if not path.exists() or path.read_text() != text:  # unchanged: left alone (the pool re-reads on change)
        write_text(path, text, mode=0o600)  # at once: the SWE env's pool may be reading it
    return path


class TenantLauncher(Launcher):
    def __init__(self, cfg: RunConfig, resume: bool = False, live: bool | None = None) -> None:
        # No zygote: it forks replicas, and this run starts none.
        own = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={"zygote": False})})
        self.url, self.token, self.tenant = cfg.fleet.url.rstrip("/"), cfg.fleet.token, cfg.tenant()
        super().__init__(own, resume, live)
        self.admin_token = self.token
        self.replicas_file = self.run_dir / "replicas.txt"
        self.fleet_replicas: list[str] = []
        self.last_replica_poll = 0.0
        self.replica_poll_errors = 0
        self.catch_up: CatchUp | None = None
        self.fleet_nodes = False  # the run's sandboxes are on the fleet's nodes (its nodes file follows them)

    def role_env(self) -> dict[str, str]:
        """The tenant token where a run with its own fleet gives the replicas' admin token, and as the
        orchestrator's bearer for every call (no token of the fleet's: the run has none)."""
        return {"BURSTRL_ADMIN_TOKEN": self.token, "BURSTRL_TENANT_TOKEN": self.token}

    def prepare(self) -> bool:
        """The fleet must answer before the run directory is made; the saved config holds no token
        (a resume passes it again)."""
        self.http = sync_client(timeout=5.0)
        try:
            urls = self.ask_fleet()
        except (CallFailed, ValueError, KeyError, TypeError) as exc:
            raise LaunchError(f"the fleet at {self.url} did not list its replicas for tenant {self.tenant}: {exc}; "
                              "is `burstrl fleet up` running there, and is the token minted from its key?") from None
        if not urls:
            raise LaunchError(f"the fleet at {self.url} has no replica up (GET /v1/fleet/replicas)")
        done = super().prepare()
        if not done:
            fleet = self.cfg.fleet.model_copy(update={"token": ""})
            (self.run_dir / "run_config.toml").write_text(dump_toml(self.cfg.model_copy(update={"fleet": fleet})))
            self.write_replicas(urls)
            self.catch_up = self.make_catch_up()
        return done

    def make_catch_up(self) -> CatchUp:
        """Pushes as the trainer's: its volume, ranks, serving dtype and TLS settings, the tenant token."""
        from burstrl.trainer.publish import serving_dtype

        train = self.cfg.train_config()
        w = train.weights
        return CatchUp(Path(w.volume), self.token, w.ca_file or w.verify_tls,
                       lambda name, detail: self.event(name, detail=detail), senders=train.trainer.world_size,
                       dtype=serving_dtype(train), retries=1)

    def start_roles(self) -> None:
        self.event("fleet_joined", detail=f"{self.url} as tenant {self.tenant}: {len(self.fleet_replicas)} replicas")
        self.start_trainer()
        self.start_orchestrator(self.url)

    def supervise(self) -> None:
        while not self.check_roles():
            self.poll_replicas()
            if self.catch_up is not None:  # after the replicas file is written (see catch_up.py)
                self.catch_up.poll(self.fleet_replicas)
            self.poll_sandbox_nodes()
            self.sample()
            time.sleep(0.5)
        self.sample(force=True)

    def poll_sandbox_nodes(self) -> None:
        """Every few seconds, where the run's sandboxes are on the fleet's nodes: the fleet's list
        again, into the nodes file, so nodes that join the fleet mid-run (a Ray node with
        `sandbox_node`) reach the SWE env's pool, which re-reads the file when it changes. An
        empty list (the router restarting, an agent between lives) leaves the file as it is."""
        if not self.fleet_nodes or time.monotonic() - self.last_node_poll < SANDBOX_NODE_POLL_S:
            return
        self.last_node_poll = time.monotonic()
        try:
            write_fleet_sandbox_nodes(self.http, self.url, self.token, self.run_dir)
        except (CallFailed, ValueError, KeyError, TypeError) as exc:  # the router restarting: the next poll
            self.node_poll_errors += 1
            log.warning("the fleet's sandbox nodes were not listed: %s", exc)

    def start_sandbox_nodes(self, orch: Any) -> None:
        """The SWE env's sandboxes on the fleet's sandbox nodes, with the tenant token (if it runs any)."""
        if "swe" not in self.cfg.orchestrator.envs or orch.orchestrator.swe.nodes_file:
            return
        try:
            path = write_fleet_sandbox_nodes(self.http, self.url, self.token, self.run_dir)
        except (CallFailed, ValueError, KeyError, TypeError) as exc:
            raise LaunchError(f"the fleet at {self.url} did not list its sandbox nodes: {exc}") from None
        if path is not None:
            self.fleet_nodes = True
            orch.orchestrator.swe.nodes_file = str(path)
            self.event("sandbox_nodes", detail=f"the fleet's, as tenant {self.tenant}: {path}")

    def after_restarts(self) -> None:
        """The router is the fleet's; only trainer relaunches are the run's to log."""
        if self.trainer.restarts > self.trainer_restarts:
            self.trainer_restarts = self.trainer.restarts
            self.event("trainer_relaunched", detail=f"relaunch {self.trainer.restarts} from the last checkpoint "
                       f"({self.trainer.cause or 'a rank died'})")

    # ---- the fleet's replicas ----
    def ask_fleet(self) -> list[str]:
        """The fleet's replicas that take new sessions (`GET /v1/fleet/replicas` with the tenant token)."""
        return fetch(self.http, "GET", f"{self.url}/v1/fleet/replicas", deadline=5.0,
                     headers={"Authorization": f"Bearer {self.token}"}).check().json()["replicas"]

    def poll_replicas(self) -> None:
        """Every REPLICA_POLL_S: rewrite replicas.txt when the fleet's list changed."""
        if time.monotonic() - self.last_replica_poll < REPLICA_POLL_S:
            return
        self.last_replica_poll = time.monotonic()
        try:
            urls = self.ask_fleet()
        except (CallFailed, ValueError, KeyError, TypeError):  # the fleet's router restarting: poll again
            self.replica_poll_errors += 1
            return
        if urls != self.fleet_replicas:
            self.event("fleet_replicas", detail=f"{len(self.fleet_replicas)} -> {len(urls)} replicas")
            self.write_replicas(urls)

    def write_replicas(self, urls: list[str]) -> None:
        """The list the trainer re-reads before each push (atomic: it may read at any moment)."""
        write_text(self.replicas_file, "".join(u + "\n" for u in urls))
        self.fleet_replicas = list(urls)

    def sample(self, force: bool = False) -> None:
        """The run's figures; the fleet's (its cache hit rate, all tenants' sessions) are not the run's: None."""
        now = time.monotonic()
        if not force and now - self.last_sample < 1.0:
            return
        self.last_sample = now
        sample = {"t": time.time(), "kind": "sample", "step": self.store.last_step(),
                  "buffered": self.store.buffered_count(), "replicas": {"shared": len(self.fleet_replicas)},
                  "routable": len(self.fleet_replicas), "cache_hit_rate": None, "sessions": None, "spot_losses": None,
                  **(self.catch_up.counts() if self.catch_up is not None else {})}
        self._append(sample)
        self.display.update(self.snapshot(sample))

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.run_dir / "fleet.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    # ---- the end ----
    def teardown(self, outcome: str, detail: str) -> None:
        """Stop the run's roles, release its versions on the fleet, then report (`Launcher.teardown`)."""
        for role in (self.orchestrator, self.trainer):
            if role is not None:
                role.stop(timeout=15.0)
        if self.catch_up is not None:  # a push in flight must not land after the release
            self.catch_up.close()
        if self.http is not None:
            self.release_versions()
        self.release_sandboxes()
        super().teardown(outcome, detail)

    def release_versions(self) -> None:
        """Unload every `policy-vN` of this tenant from every fleet replica (with its token, so only its own)."""
        from burstrl.weights.gc import unload_old
        from burstrl.weights.push import read_targets

        try:
            self.write_replicas(self.ask_fleet())
        except (CallFailed, ValueError, KeyError, TypeError):  # the last list it had, then
            pass
        targets = read_targets(self.fleet_replicas, "", self.token)
        report = unload_old(targets, set(), retries=1)
        names = sorted({n for states in report.unloaded.values() for n in states})
        self.event("versions_released", detail=f"{len(names)} versions on {len(report.ok)} of {len(targets)} "
                   f"replicas ({', '.join(names) or 'none'}); failed: {len(report.failed)}")

    def release_sandboxes(self) -> None:
        """Delete any sandbox of this tenant left on the fleet's sandbox nodes (its token: only its own)."""
        from burstrl.sandbox.cluster import load_nodes
        from burstrl.sandbox.node_client import NodeClient, NodeError

        try:  # the file `start_sandbox_nodes` wrote: only its nodes, with this tenant's token
            refs = [r for r in load_nodes(self.run_dir / NODES_FILE, allow_empty=True) if r.token == self.token]
        except (OSError, ValueError, KeyError, TypeError):
            return
        done, failed = 0, 0
        for ref in refs:
            client = NodeClient(ref.url, self.token, timeout=15.0)
            try:
                ids = [s["id"] for s in client.report()["sandboxes"]]
            except (NodeError, OSError, ValueError, KeyError, TypeError):
                failed += 1
                continue
            for sid in ids:
                try:
                    client.delete(sid)
                    done += 1
                except (NodeError, OSError):
                    failed += 1
        if done or failed:
            self.event("sandboxes_released", detail=f"{done} left on the fleet's sandbox nodes deleted; failed: {failed}")
