"""Replica zygotes on Ray: one per node, so a replacement replica there is a fork, not a fresh process.

Why: a replica's start is mostly imports (providers/zygote.py); on Ray every replica was a fresh
`burstrl serve` process under its `RoleActor`, so a replacement paid them again (8.2 s against
1.0 s for a local fork). The provider starts a `ZygoteActor` the first time a replica lands on a
node (pinned there, no logical CPU); the replica's `RoleActor` asks it to fork the replica.

Ownership: the provider owns the zygote actors (`NodeZygotes.close()` stops them at the end of
the run; as actors of the driver they also die with it). A zygote actor's worker owns its zygote
process (SIGKILL when the worker dies) and the zygote owns its children (SIGKILL when it dies).
A forked replica's real owner is its `RoleActor`, which is not its parent: the spawn request
names the actor's worker pid and the zygote SIGKILLs the replica's group the moment that worker
exits (`ray.kill`, a crash), as PR_SET_PDEATHSIG does for a replica the actor started itself.
A zygote that is gone makes the provider start that replica the ordinary way (counted) and
start a new zygote on that node for the next one.

Kept free of torch: workers import this module to build the actor; the zygote process does the
imports.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from burstrl.providers.zygote import ForkedRole, Zygote

log = logging.getLogger("burstrl.ray")


@ray.remote(num_cpus=0, max_restarts=0)
class ZygoteActor:
    """A `Zygote` on this actor's node. Async, so that concurrent spawns wait in parallel."""

    def __init__(self, logs_dir: str, env: dict[str, str], model_path: str, name: str) -> None:
        # The zygote's death signal is tied to the thread that starts it: an async actor's __init__
        # runs on the worker's event-loop thread, which lives as long as the worker.
        self.zygote = Zygote(Path(logs_dir), env, model_path, name=name)
        self.children: dict[int, ForkedRole] = {}

    async def spawn(self, args: list[str], log: str, timeout: float, append: bool, env: dict[str, str],
                    watch: int) -> dict[str, Any]:
        """Fork `burstrl ARGS`: {"pid", "url"} once ready, else {"error", "zygote_alive"}."""
        try:
            child = await asyncio.to_thread(self.zygote.spawn, args, Path(log), timeout, append, env, watch)
        except RuntimeError as exc:
            # A write that met a broken pipe can come before the reader saw EOF: ask the process too.
            return {"error": str(exc), "zygote_alive": self.zygote.alive() and self.zygote.proc.poll() is None}
        self.children[child.pid] = child
        return {"pid": child.pid, "url": child.url}

    async def exit_code(self, pid: int, timeout: float) -> int | None:
        """A forked child's exit status once the zygote reaped it (None: unknown pid or not yet).

        Exited children stay in `children` (a run forks a few hundred replicas per node at most): the
        owning actor may ask from several calls at once (its `wait` and its `stop`), and each must get
        the status, not a KeyError or an "unknown pid"."""
        child = self.children.get(pid)
        if child is None:
            return None
        await asyncio.to_thread(child.exited.wait, timeout)
        return child.code

    async def pid(self) -> int:
        """The zygote process's pid (tests, `ps`)."""
        return self.zygote.proc.pid

    async def close(self) -> None:
        """Stop every child still running, then the zygote process."""
        await asyncio.to_thread(self.zygote.close)


def zygote_is_gone(result: dict[str, Any]) -> bool:
    """Whether a failed spawn's result says the zygote, not the replica, failed (then start it plainly)."""
    return "error" in result and not result.get("zygote_alive", False)


class NodeZygotes:
    """The provider's zygote actors, one per node id, each started by the first replica there."""

    def __init__(self, logs_dir: Path, env: dict[str, str], model_path: str) -> None:
        self.logs_dir, self.env, self.model_path = logs_dir, env, model_path
        self.lock = threading.Lock()  # the fleet starts replicas from several threads
        self.actors: dict[str, Any] = {}
        self.started = 0  # zygote actors started (a lost one is replaced by the next replica there)

    def get(self, node_id: str) -> Any:
        with self.lock:
            if node_id not in self.actors:
                self.started += 1
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                self.actors[node_id] = ZygoteActor.options(scheduling_strategy=strategy).remote(
                    str(self.logs_dir), self.env, self.model_path, f"zygote-{node_id[:8]}-{self.started}")
            return self.actors[node_id]

    def forget(self, node_id: str, actor: Any) -> None:
        """Drop a zygote that is gone (the next replica on its node starts a new one)."""
        with self.lock:
            if self.actors.get(node_id) is actor:
                del self.actors[node_id]
        ray.kill(actor, no_restart=True)

    def close(self, timeout: float = 30.0) -> None:
        """Stop every zygote (children first) and its actor."""
        with self.lock:
            actors, self.actors = list(self.actors.values()), {}
        closes = [a.close.remote() for a in actors]
        try:
            ray.get(closes, timeout=timeout)
        except (RayActorError, GetTimeoutError) as exc:  # a zygote actor already gone: killed below either way
            log.warning("a zygote did not close cleanly: %s", exc)
        for actor in actors:
            ray.kill(actor, no_restart=True)


class SpareActors:
    """One placed, idle `RoleActor` per pool, taken by the next replica there and then replaced.

    Why: once replicas fork, the largest part of a replacement on Ray is starting the new actor's
    worker process (Python and Ray's imports: ~4 s of ~5 s on the loaded 2-core dev machine). Only
    for replica shapes that hold no resources (no logical CPU, GPU or custom resource), so a spare
    never takes capacity a replica could use. The provider owns the spares and kills them at close.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: dict[str, tuple[Any, Any]] = {}  # pool -> (actor, its node() call, made with it)

    def take(self, pool: str) -> tuple[Any, Any] | None:
        """(actor, ref of its node() answer): asked when the spare was made, so that a replacement
        does not wait for one more call to an actor that was placed long ago."""
        with self.lock:
            return self.idle.pop(pool, None)

    def refill(self, pool: str, opts: dict[str, Any]) -> None:
        """Start a spare for `pool` (in the background: Ray places it) unless it has one or its
        replicas hold resources."""
        if opts.get("num_cpus") or opts.get("num_gpus") or any(opts.get("resources", {}).values()):
            return
        from burstrl.providers.ray_actors import RoleActor

        with self.lock:
            if pool not in self.idle:
                actor = RoleActor.options(**opts).remote()
                self.idle[pool] = (actor, actor.node.remote())

    def close(self) -> None:
        with self.lock:
            idle, self.idle = list(self.idle.values()), {}
        for actor, _ in idle:
            ray.kill(actor, no_restart=True)
