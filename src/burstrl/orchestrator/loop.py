"""`burstrl orchestrate`: keep groups of attempts in flight and write each finished group to the store.

Asynchronous by construction: groups start whenever fewer than `max_in_flight_groups` run and fewer
than `max_buffered_groups` wait in the store, whatever the trainer is doing; the buffer bound is
what keeps staleness bounded. A group is G attempts at one task, all on the version the router
resolves `latest` to when the group starts. An attempt the fleet fails (a replica died, its capture
was lost) is re-run under a new rollout id and the old id is closed as `requeued` in the store's
attempt ledger; a group whose version no replica serves any more restarts on the newest one. So
every rollout id ends exactly once: stored in a group, requeued, or abandoned.
What the model does to its own sandbox is never a fleet failure: the environment scores it 0 and
the attempt is stored (counted in `attempts_sandbox_lost`), so the run goes on and the policy
cannot erase a failure by wrecking its sandbox.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from burstrl.atomic import write_text
from burstrl.config import OrchestrateConfig
from burstrl.envs import Environment, InfraError, Outcome, Task, get_env
from burstrl.envs.base import close_env
from burstrl.orchestrator.attempt import run_attempt
from burstrl.orchestrator.client import ReplicaFailure, VersionGone, assign
from burstrl.orchestrator.curriculum import Curriculum
from burstrl.protocol.versions import version_number
from burstrl.store import RolloutStore
from burstrl.store.types import Rollout

log = logging.getLogger("burstrl.orchestrate")


class GroupFailed(RuntimeError):
    """A slot of the group ran out of retries: the group restarts (its finished attempts are abandoned)."""


@dataclass
class OrchestratorCounters:
    groups_started: int = 0
    groups_done: int = 0
    groups_restarted: int = 0
    rollouts_done: int = 0
    attempts_requeued: int = 0
    attempts_abandoned: int = 0
    attempts_sandbox_lost: int = 0  # stored with reward 0: the model killed or filled its sandbox


class Orchestrator:
    """The scheduler: curriculum -> groups -> attempts -> store, plus its stats file."""

    def __init__(self, cfg: OrchestrateConfig, admin_token: str) -> None:
        o = cfg.orchestrator
        self.cfg, self.o, self.admin_token = cfg, o, admin_token
        self.run_dir = Path(cfg.run_dir)
        self.router = cfg.router.rstrip("/")
        self.store = RolloutStore(cfg.store or self.run_dir / "store.sqlite")
        self.envs: dict[str, Environment] = {name: get_env(name, o, self.run_dir) for name in o.envs}
        self.curriculum = Curriculum(o.curriculum, dict(o.envs), self.envs, o.seed)
        self.state_path = self.run_dir / "orchestrator_state.json"
        if self.state_path.exists():
            self.curriculum.load_state(json.loads(self.state_path.read_text())["curriculum"])
        self.rng = random.Random(f"{o.seed}:{time.time_ns()}")
        self.max_in_flight = o.max_in_flight_groups
        self.max_buffered = o.max_buffered_groups
        self.counters = OrchestratorCounters()
        self.recent: deque[Outcome] = deque(maxlen=64)
        self.version = 0
        self.groups: set[asyncio.Task] = set()
        self.error: BaseException | None = None  # a group that failed with a bug stops the run

    # ---- the loop ----
    async def run(self) -> None:
        abandoned = await asyncio.to_thread(self.store.abandon_running_attempts, "orchestrator restarted")
        if abandoned:
            log.info("%d attempts left running by an earlier orchestrator marked abandoned", abandoned)
        timeout = httpx.Timeout(self.o.request_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=tenant_headers()) as http:
            stats = asyncio.create_task(self.stats_loop())
            try:
                while not await self.finished():
                    await self.fill(http)
                    await self.wait_a_little()
            finally:
                stats.cancel()
                for t in self.groups:
                    t.cancel()
                await asyncio.gather(stats, *self.groups, return_exceptions=True)
                n = await asyncio.to_thread(self.store.abandon_running_attempts, "orchestrator stopped")
                self.counters.attempts_abandoned += n
                self.write_stats(0.0)
                self.store.close()
                for env in self.envs.values():
                    await close_env(env)

    async def finished(self) -> bool:
        return bool(self.cfg.steps) and await asyncio.to_thread(self.store.last_step) >= self.cfg.steps

    async def fill(self, http: httpx.AsyncClient) -> None:
        """Start groups up to the in-flight bound, unless enough already wait in the store."""
        buffered = await asyncio.to_thread(self.store.buffered_count)
        while len(self.groups) < self.max_in_flight and buffered < self.max_buffered:
            task = self.curriculum.next_task()
            self.counters.groups_started += 1
            g = asyncio.create_task(self.run_group(http, task), name=f"group-{task.id}")
            self.groups.add(g)
            g.add_done_callback(self._group_done)

    def _group_done(self, g: asyncio.Task) -> None:
        self.groups.discard(g)
        if not g.cancelled() and g.exception() is not None:
            self.error = g.exception()  # a bug, not a fault: surfaced by wait_a_little

    async def wait_a_little(self) -> None:
        if self.error is not None:
            raise self.error
        await asyncio.sleep(0.05)

    # ---- one group ----
    async def run_group(self, http: httpx.AsyncClient, task: Task) -> None:
        """G attempts on one version, stored together; restarted if the fleet loses the version."""
        g = self.o.group_size
        while True:
            ids = [self.new_id() for _ in range(g)]
            try:
                version = await assign(http, self.router, ids[0])
            except ReplicaFailure as exc:
                log.warning("group for %s: cannot assign (%s); retrying", task.id, exc)
                await asyncio.sleep(1.0)
                continue
            results = await asyncio.gather(*(self.run_slot(http, task, version, rid) for rid in ids),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if not errors:
                await self.store_group(task, version, results)
                return
            bugs = [e for e in errors if not isinstance(e, (ReplicaFailure, GroupFailed))]
            await self.abandon([r for r in results if isinstance(r, Rollout)], "group restarted")
            if bugs:
                raise bugs[0]
            self.counters.groups_restarted += 1
            log.warning("group for %s restarts: %s", task.id, errors[0])
            await asyncio.sleep(0.5)

    async def run_slot(self, http: httpx.AsyncClient, task: Task, version: str, rid: str) -> Rollout:
        """One attempt, re-run under a fresh id after each fleet failure, up to `attempt_retries` times."""
        env = self.envs[task.env]
        for retry in range(self.o.attempt_retries + 1):
            await asyncio.to_thread(self.store.start_attempt, rid, task.id)
            try:
                return await run_attempt(http, self.router, env, task, rid, version, self.o.temperature,
                                         self.o.max_tokens, self.rng.randrange(2**31), self.admin_token)
            except VersionGone as exc:
                await asyncio.to_thread(self.store.end_attempt, rid, "abandoned", str(exc))
                self.counters.attempts_abandoned += 1
                raise
            except (ReplicaFailure, InfraError) as exc:
                await asyncio.to_thread(self.store.end_attempt, rid, "requeued", str(exc))
                self.counters.attempts_requeued += 1
                log.info("attempt %s requeued: %s", rid, exc)
            except BaseException as exc:  # a bug or cancellation: close the id, then propagate
                await asyncio.shield(asyncio.to_thread(self.store.end_attempt, rid, "abandoned",
                                                       f"{type(exc).__name__}: {exc}"))
                raise
            rid = self.new_id()
            await asyncio.sleep(min(0.2 * 2 ** retry, 2.0))
        raise GroupFailed(f"task {task.id}: an attempt failed {self.o.attempt_retries + 1} times")

    async def store_group(self, task: Task, version: str, rollouts: list[Rollout]) -> None:
        await asyncio.to_thread(self.store.put_task, task.id, asdict(task), float(task.difficulty))
        await asyncio.to_thread(self.store.put_group, task.id, rollouts)
        outcomes = [Outcome(reward=r.reward, parts=r.reward_parts, passed=r.passed)
                    for r in rollouts]
        self.curriculum.report(task, outcomes)
        self.recent.extend(outcomes)
        self.version = max(self.version, version_number(version))
        self.counters.groups_done += 1
        self.counters.rollouts_done += len(rollouts)
        self.counters.attempts_sandbox_lost += sum(r.reward_parts.get("sandbox_lost", 0.0) > 0 for r in rollouts)

    async def abandon(self, rollouts: list[Rollout], why: str) -> None:
        for r in rollouts:
            await asyncio.to_thread(self.store.end_attempt, r.id, "abandoned", why)
            self.counters.attempts_abandoned += 1

    def new_id(self) -> str:
        return uuid.uuid4().hex

    # ---- stats ----
    async def stats_loop(self) -> None:
        last_rollouts, last_t = 0, time.monotonic()
        while True:
            await asyncio.sleep(self.o.stats_interval_s)
            now = time.monotonic()
            rate = (self.counters.rollouts_done - last_rollouts) / max(now - last_t, 1e-6)
            last_rollouts, last_t = self.counters.rollouts_done, now
            await asyncio.to_thread(self.write_stats, rate)

    def write_stats(self, rollouts_per_s: float) -> None:
        """One line of orchestrator.jsonl, and the curriculum state a resumed run continues from."""
        recent = list(self.recent)
        line: dict[str, Any] = {
            "t": time.time(), **asdict(self.counters), "groups_in_flight": len(self.groups),
            "rollouts_per_s": round(rollouts_per_s, 3),
            "pass_rate": sum(o.passed for o in recent) / len(recent) if recent else None,
            "reward_mean": sum(o.reward for o in recent) / len(recent) if recent else None,
            "difficulty": {name: self.curriculum.difficulty(name) for name in self.envs},
            "version": self.version, "curriculum": self.curriculum.state(),
        }
        with open(self.run_dir / "orchestrator.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        write_text(self.state_path, json.dumps({"curriculum": self.curriculum.state()}))


def tenant_headers() -> dict[str, str]:
    """With $BURSTRL_TENANT_TOKEN (a run on a shared fleet), every call to the router carries it: the
    fleet's router and replicas take generation calls only from a tenant, and map the run's session
    ids and versions into its namespace (`router/tenancy.py`)."""
    token = os.environ.get("BURSTRL_TENANT_TOKEN", "")
    return {"Authorization": f"Bearer {token}"} if token else {}


def run_orchestrator(cfg: OrchestrateConfig) -> None:
    """Run until the store has `steps` committed steps (or forever), or until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    token = os.environ.get("BURSTRL_ADMIN_TOKEN", "")
    if not token:
        log.warning("BURSTRL_ADMIN_TOKEN is not set: replicas will refuse to show traces (every attempt "
                    "fails with 401) and finished sessions cannot be released")
    asyncio.run(_main(Orchestrator(cfg, token)))


async def _main(orch: Orchestrator) -> None:
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    # Store writes and sandbox calls run in worker threads; the default pool (cores + 4) is too small
    # for many attempts at once. asyncio.run shuts this executor down on exit.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=64, thread_name_prefix="orchestrator"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main.cancel)
    try:
        await orch.run()
    except asyncio.CancelledError:
        log.info("stopped by signal")
