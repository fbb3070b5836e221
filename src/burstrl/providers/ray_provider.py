"""The Ray provider: the run's roles as actors on a Ray cluster, with the local provider's behaviour.

The launcher is the Ray driver (`ray.init(address, namespace=<run id>)`), so every actor shares its
fate: when the launcher exits or dies, Ray reclaims the actors and their children die with them.

- Replicas: one async `RoleActor` each (no logical CPU unless `ray.replica_cpus`; `ray.replica_gpus`
  GPUs, so Ray sets CUDA_VISIBLE_DEVICES; the pool's custom resources, e.g. `{spot = 1}`), running
  the same `burstrl serve` command as the local provider, bound to the node's IP. The actor's
  long-running `wait()` call is watched with `ray.wait`: the child exiting, `ActorDiedError`
  (`preempted` when Ray drained the node for a preemption) and `ActorUnavailableError` all end the
  replica, and the launcher deregisters it and starts a replacement that loads the newest version.
  With `fleet.zygote`, a replica's process is forked by a zygote on its node (one per node, started
  by the first replica there; providers/ray_zygote.py), so a replacement skips the imports, and
  when replicas hold no resources a spare placed actor per pool waits for the next one, so it
  skips Ray's worker start too. Each start's phases (placement, process start to ready) go to
  `logs/ray_starts.jsonl`.
- Router: an actor pinned to the driver's node with `max_restarts`; a restarted router listens at
  the same address, and the launcher re-sends the replica list (its `restarts` count goes up).
- Trainer: `trainer.world_size` rank actors in one placement group (STRICT_PACK when the ranks fit
  on one node, PACK across nodes); bundle 0 is pinned to the driver's node because rank 0 opens the
  SQLite store. Rank 0 reports its IP and a free port (MASTER_ADDR/MASTER_PORT). If a rank dies
  (signal, actor or node death) the group is torn down and relaunched with `--resume` from the last
  committed checkpoint, up to `ray.trainer_restarts` times.
- The orchestrator owns the store and runs beside the driver as a local process.
- Nothing waits forever: an actor or placement group not placed in `ray.placement_timeout_s` fails
  with the resources it asked for and what the cluster has.

On a multi-node cluster the run directory must be at the same path on every node (a shared
filesystem): role configs, logs, checkpoints and the adapter volume live there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from burstrl.config import RayConfig
from burstrl.providers import Placement
from burstrl.providers.local import REPLICA_LISTEN, LocalProvider
from burstrl.providers.ray_actors import ProcessSpec, RoleActor
from burstrl.providers.ray_zygote import NodeZygotes, SpareActors, zygote_is_gone

log = logging.getLogger("burstrl.ray")
RANK_CODE = "from burstrl.trainer.launch import rank_main; rank_main()"


def run_namespace(run_dir: Path) -> str:
    """One Ray namespace per run directory."""
    digest = hashlib.sha256(str(run_dir.absolute()).encode()).hexdigest()[:8]
    return f"burstrl-{run_dir.name}-{digest}"


def connect(cfg: RayConfig, namespace: str) -> bool:
    """ray.init on the configured cluster; True if this call started Ray (and must shut it down)."""
    if ray.is_initialized():
        return False
    if cfg.auth_token_file:
        os.environ["RAY_AUTH_TOKEN_PATH"] = cfg.auth_token_file
    if "RAY_AUTH_MODE" not in os.environ and (cfg.auth_token_file or os.environ.get("RAY_AUTH_TOKEN")
                                               or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        # A token given: token mode. Ray 2.60's driver sends one only in that mode (read at import; this
        # sets it and re-reads it, for this process and its children): a token alone met "Authentication
        # token is missing or incorrect ... RAY_AUTH_MODE is currently 'disabled'" from a token-auth cluster.
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    extra: dict[str, Any] = {} if address else {"include_dashboard": False}
    ray.init(address=address, namespace=namespace, log_to_driver=False, **extra)
    return True


def _resources_text() -> str:
    avail, total = ray.available_resources(), ray.cluster_resources()
    keep = sorted(k for k in total if not k.startswith("node:") and "memory" not in k)
    return ", ".join(f"{k} {avail.get(k, 0):g}/{total[k]:g} free" for k in keep)


class RayRole:
    """A role inside a RoleActor; `poll()` looks at the actor's `wait()` call without blocking."""

    def __init__(self, provider: "RayProvider", actor: Any, name: str, log_path: Path,
                 restartable: bool) -> None:
        self.provider, self.actor, self.name, self.log = provider, actor, name, log_path
        self.restartable = restartable
        self.url = ""
        self.cause = ""
        self.restarts = 0
        self._code: int | None = None
        self.watch = actor.wait.remote(restartable)

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ready, _ = ray.wait([self.watch], timeout=0)
        if not ready:
            return None
        lost = True
        try:
            code, cause, lost = ray.get(ready[0]), "", False  # a plain exit: the status says it all
        except ActorUnavailableError:
            code, cause = -9, "unavailable"
        except ActorDiedError as exc:
            code, cause = -9, "preempted" if exc.preempted else "actor died"
        except RayActorError as exc:  # any other way of losing the actor
            code, cause = -9, f"actor lost: {type(exc).__name__}"
        if lost and self.restartable and self._back_after_restart():
            return None
        self._code, self.cause = code, cause
        if cause == "unavailable":  # stop routing to it for good: it may come back, we do not wait
            ray.kill(self.actor, no_restart=True)
        return code

    def _back_after_restart(self) -> bool:
        """A restartable actor that Ray brought back (same address): watch it again.

        While Ray restarts it, calls fail with ActorUnavailableError: that is asked again until
        the placement timeout (on a loaded machine the restart outlasted the first call, and the
        run ended for a router Ray was bringing back). Dead for good, or not back in time: False.
        """
        deadline = time.monotonic() + self.provider.cfg.placement_timeout_s
        while True:
            try:
                url = ray.get(self.actor.ready.remote(60.0), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ActorUnavailableError:
                if time.monotonic() >= deadline:
                    return False
                self.provider.unavailable_retries += 1
                time.sleep(0.5)
            except (RayActorError, GetTimeoutError, RuntimeError):
                return False
        self.restarts += 1
        self.url = url or self.url
        self.watch = self.actor.wait.remote(True)
        log.warning("%s restarted by Ray (%d) at %s", self.name, self.restarts, self.url)
        return True

    @property
    def returncode(self) -> int | None:
        return self._code

    def stop(self, timeout: float = 15.0) -> None:
        if self._code is None:
            try:
                self._code = ray.get(self.actor.stop.remote(timeout), timeout=timeout + 15)
            except (RayActorError, GetTimeoutError):
                self._code = -9
        ray.kill(self.actor, no_restart=True)

    def kill(self) -> None:
        """Kill the actor, as a preemption would: its child dies with it."""
        ray.kill(self.actor, no_restart=True)
        self._code, self.cause = -9, "killed"


class RayTrainer:
    """The trainer's ranks as one handle; relaunched from the last checkpoint when a rank dies."""

    def __init__(self, provider: "RayProvider", config: Path, world: int, resume: bool, append: bool) -> None:
        self.provider, self.config, self.world = provider, config, world
        self.log = provider.logs_dir / "trainer.log"
        self.url, self.cause, self.restarts = "", "", 0
        self._code: int | None = None
        self.actors: list[Any] = []
        self.watches: list[Any] = []
        self.pg: Any = None
        self._launch(resume, append)

    def _launch(self, resume: bool, append: bool) -> None:
        cfg, p = self.provider.cfg, self.provider
        bundle = {"CPU": cfg.trainer_cpus, "GPU": cfg.trainer_gpus}
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        bundles = [dict(bundle) for _ in range(self.world)]
        bundles[0][f"node:{p.driver_ip}"] = 0.001  # rank 0 opens the store, which lives with the driver
        strategy = "STRICT_PACK" if p.fits_one_node(bundle, self.world) else "PACK"
        self.pg = p.placement_group(bundles, strategy, "the trainer")
        opts = {"num_cpus": bundle.get("CPU", 0.001), "num_gpus": bundle.get("GPU", 0)}
        self.actors = [RoleActor.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=i)).remote() for i in range(self.world)]
        head = p.wait_placed(self.actors[0], "trainer rank 0", opts)
        env = {**p.env, "BURSTRL_WORLD_SIZE": str(self.world), "MASTER_ADDR": str(head["ip"]),
               "MASTER_PORT": str(head["free_port"])}
        starts = []
        for rank, actor in enumerate(self.actors):
            log_path = self.log if rank == 0 else p.logs_dir / f"rank-{rank}.log"
            spec = ProcessSpec(args=[str(self.config), "1" if resume else "0"], log=str(log_path),
                               env={**env, "BURSTRL_RANK": str(rank)}, code=RANK_CODE, append=append)
            starts.append(actor.start.remote(spec))
        ray.get(starts, timeout=cfg.placement_timeout_s)
        self.watches = [a.wait.remote(False) for a in self.actors]

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ready, _ = ray.wait(self.watches, num_returns=len(self.watches), timeout=0)
        codes = []
        for ref in ready:
            try:
                codes.append(ray.get(ref))
            except RayActorError as exc:  # the rank's actor or node died
                self.cause = "preempted" if getattr(exc, "preempted", False) else "actor died"
                codes.append(-9)
        failed = [c for c in codes if c != 0]
        if not failed:
            if len(codes) == self.world:
                self._teardown()
                self._code = 0
            return self._code
        self._teardown()
        if failed[0] < 0 and self.restarts < self.provider.cfg.trainer_restarts:
            self.restarts += 1
            log.warning("a trainer rank died (%s); relaunching the group from its last checkpoint (%d/%d)",
                        failed[0], self.restarts, self.provider.cfg.trainer_restarts)
            try:
                self._launch(resume=True, append=True)
            except (RuntimeError, RayActorError, GetTimeoutError) as exc:  # e.g. its resources are gone
                self._teardown()
                self._code, self.cause = 1, f"relaunch failed: {exc}"
                return self._code
            return None
        self._code = failed[0]
        return self._code

    @property
    def returncode(self) -> int | None:
        return self._code

    def _teardown(self, timeout: float = 15.0) -> None:
        stops = [a.stop.remote(timeout) for a in self.actors]
        try:
            ray.get(stops, timeout=timeout + 15)
        except (RayActorError, GetTimeoutError):
            pass  # a dead rank's actor cannot answer: it is killed below either way
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.actors, self.watches, self.pg = [], [], None

    def stop(self, timeout: float = 15.0) -> None:
        if self._code is None:
            self._teardown(timeout)
            self._code = -15

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self._teardown(1.0)
        self._code = -9


class RayProvider:
    def __init__(self, cfg: RayConfig, run_dir: Path, env: dict[str, str], zygote_model: str | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir.absolute()
        self.logs_dir = self.run_dir / "logs"
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.local = LocalProvider(self.logs_dir, env)
        self.started_ray = connect(cfg, run_namespace(self.run_dir))
        self.driver_ip = ray.util.get_node_ip_address()
        self.roles: list[RayRole] = []
        self.sandbox_agents: Any = None
        self.zygotes = NodeZygotes(self.logs_dir, self.env, zygote_model) if zygote_model is not None else None
        self.zygote_fallbacks = 0  # replicas started the ordinary way because their node's zygote was gone
        self.unavailable_retries = 0  # calls to a restarting actor asked again (ActorUnavailableError)
        self.spares = SpareActors()  # with the zygote: a placed actor waiting for the next replica of a pool
        self.starts_lock = threading.Lock()

    # ---- placement ----
    def wait_placed(self, actor: Any, what: str, resources: dict[str, Any]) -> dict[str, Any]:
        """The actor's node once it runs; RuntimeError naming the resources if Ray cannot place it in time."""
        try:
            return ray.get(actor.node.remote(), timeout=self.cfg.placement_timeout_s)
        except GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"{what} could not be placed in {self.cfg.placement_timeout_s:.0f} s: it needs "
                               f"{_asked(resources)}; the cluster has {_resources_text()}") from None

    def placement_group(self, bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=self.cfg.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            shown = [{k: v for k, v in b.items() if not k.startswith("node:")} for b in bundles]
            raise RuntimeError(f"the placement group of {what} ({len(bundles)} x {shown[-1]}, {strategy}) could "
                               f"not be placed in {self.cfg.placement_timeout_s:.0f} s; the cluster has "
                               f"{_resources_text()}")
        return pg

    def fits_one_node(self, bundle: dict[str, float], count: int) -> bool:
        """Whether `count` bundles fit in one alive node's total resources (then STRICT_PACK)."""
        for node in ray.nodes():
            if node.get("Alive") and all(node["Resources"].get(k, 0) >= v * count for k, v in bundle.items()):
                return True
        return False

    def replica_resources(self, pool: str) -> dict[str, Any]:
        custom = self.cfg.on_demand_resources if pool == "on_demand" else self.cfg.reserved_resources
        return {"num_cpus": self.cfg.replica_cpus, "num_gpus": self.cfg.replica_gpus, "resources": dict(custom)}

    # ---- the Provider surface ----
    def start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float = 180.0,
              append: bool = False, placement: Placement = Placement()) -> Any:
        if placement.on_driver and not placement.restartable:
            return self.local.start(name, args, wait_ready=wait_ready, timeout=timeout, append=append)
        opts: dict[str, Any] = self.replica_resources(placement.pool) if placement.pool else {"num_cpus": 0}
        host_key, port_key = placement.listen or ("", "")
        port = _free_port() if placement.restartable and placement.on_driver else 0  # a restart keeps the address
        if placement.on_driver:
            opts["resources"] = {**opts.get("resources", {}), f"node:{self.driver_ip}": 0.001}
        if placement.restartable:
            opts.update(max_restarts=self.cfg.router_restarts, max_task_retries=0)
        log_path = self.logs_dir / f"{name}.log"
        cores_key, cores = placement.cores or ("", 0)
        spec = ProcessSpec(args=list(args), log=str(log_path), env=self.env, ready_line=wait_ready, append=append,
                           host_key=host_key, port_key=port_key, port=port, cores_key=cores_key, cores=cores,
                           cores_run=str(self.run_dir))
        fork = self.zygotes is not None and wait_ready and bool(placement.pool) and placement.listen == REPLICA_LISTEN
        t0 = time.time()
        actor, node = self._spare(placement.pool) if fork else (None, None)
        spare = actor is not None
        if actor is None:
            actor = RoleActor.options(**opts).remote(None if fork else spec)
        try:
            node = node or self.wait_placed(actor, name, opts)
            placed = time.time()
            if fork:
                url, how = self._fork(actor, node["node_id"], spec, name, timeout)
            else:
                url, how = ray.get(actor.ready.remote(timeout), timeout=timeout + 30), "process"
        except (RayActorError, GetTimeoutError) as exc:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"{name} failed to start: {exc}") from None
        except RuntimeError:
            ray.kill(actor, no_restart=True)
            raise
        self._record_start({"name": name, "t": t0, "how": how, "node": node["node_id"][:8], "spare": spare,
                            "placed_s": round(placed - t0, 3), "ready_s": round(time.time() - placed, 3)})
        if fork:
            self.spares.refill(placement.pool, opts)
        role = RayRole(self, actor, name, log_path, placement.restartable)
        role.url = url
        self.roles.append(role)
        return role

    def _spare(self, pool: str) -> tuple[Any, dict[str, Any] | None]:
        """The pool's spare actor and its node, or (None, None): no spare, or it was lost (with its node)."""
        got = self.spares.take(pool)
        if got is None:
            return None, None
        actor, node = got
        try:
            return actor, ray.get(node, timeout=self.cfg.placement_timeout_s)
        except (RayActorError, GetTimeoutError):
            ray.kill(actor, no_restart=True)
            return None, None

    def _fork(self, actor: Any, node_id: str, spec: ProcessSpec, name: str, timeout: float) -> tuple[str, str]:
        """The replica forked by its node's zygote: (url, "fork"); a zygote that is gone is
        forgotten and the replica started the ordinary way: (url, "fallback"), counted."""
        zygote = self.zygotes.get(node_id)
        got = ray.get(actor.fork.remote(spec, zygote, timeout), timeout=timeout + 30)
        if "error" not in got:
            return got["url"], "fork"
        if not zygote_is_gone(got):
            raise RuntimeError(f"{name} failed to start: {got['error']}")
        self.zygotes.forget(node_id, zygote)
        with self.starts_lock:
            self.zygote_fallbacks += 1
        log.warning("the zygote on node %s is gone (%s): starting %s the ordinary way", node_id[:8], got["error"],
                    name)
        ray.get(actor.start.remote(spec), timeout=self.cfg.placement_timeout_s)
        return ray.get(actor.ready.remote(timeout), timeout=timeout + 30), "fallback"

    def _record_start(self, row: dict[str, Any]) -> None:
        """One line per role start in logs/ray_starts.jsonl: where a start's time went."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        with self.starts_lock, open(self.logs_dir / "ray_starts.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def start_trainer(self, config: Path, world_size: int, resume: bool, append: bool) -> RayTrainer:
        return RayTrainer(self, config, world_size, resume, append)

    def start_sandbox_nodes(self, backend: str, token: str = "", tenant_key: str = "",
                            tenant_flags: Callable[[Path], list[str]] | None = None) -> Path | None:
        """Node agents on the `sandbox_node` nodes (providers/ray_sandbox.py); their nodes file, or None.

        With `tenant_key` (a shared fleet's agents: its node `token`, its tenant key and `tenant_flags`)
        the agents are kept even when no node carries `sandbox_node` yet: the fleet serves on, and nodes
        that join get agents at the next `poll_sandbox_nodes`."""
        from burstrl.providers.ray_sandbox import SandboxAgents

        self.sandbox_agents = SandboxAgents(self.run_dir, self.logs_dir, self.env, backend,
                                            timeout_s=self.cfg.placement_timeout_s + 60, token=token,
                                            tenant_key=tenant_key, tenant_flags=tenant_flags)
        path = self.sandbox_agents.start()
        if path is None and not tenant_key:
            self.sandbox_agents = None  # no sandbox node at launch: a run's sandboxes stay local, none join later
        return path

    def sandbox_node_list(self) -> list[dict[str, str]]:
        """The ready agents as {name, url}, without their token (what a fleet's router lists to tenants)."""
        rows = self.sandbox_agents.nodes if self.sandbox_agents is not None else []
        return [{"name": r["name"], "url": r["url"]} for r in rows]

    def poll_sandbox_nodes(self) -> list[str]:
        """Agents for sandbox nodes that joined since, none for those that left (the nodes file follows)."""
        return self.sandbox_agents.poll() if self.sandbox_agents is not None else []

    def request_capacity(self, replicas: dict[str, int]) -> None:
        if not self.cfg.request_resources:
            return
        from ray.autoscaler.sdk import request_resources

        bundles = []
        for pool, n in replicas.items():
            r = self.replica_resources(pool)
            shape = {"CPU": r["num_cpus"], "GPU": r["num_gpus"], **r["resources"]}
            bundles += [{k: v for k, v in shape.items() if v > 0}] * n
        request_resources(bundles=[b for b in bundles if b])

    def close(self) -> None:
        if self.sandbox_agents is not None:
            self.sandbox_agents.stop()
        for role in self.roles:
            try:
                ray.kill(role.actor, no_restart=True)
            except ValueError:
                pass  # already gone
        self.spares.close()
        if self.zygotes is not None:
            self.zygotes.close()
        if self.started_ray:
            ray.shutdown()


def _asked(resources: dict[str, Any]) -> str:
    flat = {"CPU": resources.get("num_cpus", 0), "GPU": resources.get("num_gpus", 0),
            **resources.get("resources", {})}
    return ", ".join(f"{k} {v:g}" for k, v in flat.items() if v and not k.startswith("node:")) or "nothing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

