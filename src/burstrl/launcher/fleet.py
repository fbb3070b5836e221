"""The launcher's replicas: start, register, replace, drain and kill them while the run goes on.

Why the launcher owns this and not the router: starting a process is a provider's job, and the
router only learns of a replica when it registers. A replica is `starting` (its process loads the
model and the newest version from the volume, in a worker thread so supervision never blocks) ->
`up` (registered with the router, listed in `replicas.txt`, which the trainer re-reads before each
push) -> gone (died, killed, or drained and stopped). Every transition is an event in fleet.jsonl.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from burstrl.atomic import write_text
from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.providers import Placement, Provider, RoleHandle

log = logging.getLogger("burstrl.run")
POOLS = ("reserved", "on_demand")
MAX_ANSWER_BYTES = 16 << 20  # a replica's `/v1/models` or `/v1/loads` answer, read at most this far


@dataclass
class FleetReplica:
    name: str
    pool: str
    handle: RoleHandle | None = None
    state: str = "starting"  # starting -> up -> draining -> gone
    started: float = field(default_factory=time.time)
    drain_deadline: float = 0.0

    @property
    def url(self) -> str:
        return self.handle.url if self.handle is not None else ""


@dataclass(frozen=True)
class FleetOptions:
    """How the run's replicas are started and registered; fixed for the run.

    Why an object: eight values, three of them strings and two paths, passed once by the launcher;
    by name, no two of them can swap places unnoticed."""

    serve_args: list[str]  # the `burstrl` arguments a replica process runs with
    router: str  # the router's URL, where replicas register
    cluster_token: str  # bearer for the router's replica endpoints
    admin_token: str  # bearer for a replica's admin endpoints (loading an adapter)
    run_dir: Path  # holds replicas.txt, the list the trainer pushes versions to
    weights: dict[str, float]  # the router's weight of a replica, by pool
    start_timeout_s: float  # a start that is not ready by then failed
    volume: Path  # where published versions live (a new replica catches up from it)
    cores: tuple[str, int] | None = None  # cores of its own per replica (`Placement.cores`; vLLM on CPU)
    stop_timeout_s: float = 5.0  # SIGTERM to SIGKILL at the run's end (a vLLM replica stops its vLLM first)


class Fleet:
    """Replicas by name; thread-safe (starts finish in worker threads)."""

    def __init__(self, provider: Provider, options: FleetOptions, event: Callable[..., None]) -> None:
        o = options
        self.provider, self.serve_args, self.router, self.volume = provider, o.serve_args, o.router, o.volume
        self.cluster_token, self.admin_token = o.cluster_token, o.admin_token
        self.replicas_file = o.run_dir / "replicas.txt"
        self.weights, self.event, self.start_timeout_s = o.weights, event, o.start_timeout_s
        self.cores, self.stop_timeout_s = o.cores, o.stop_timeout_s
        self.replicas: dict[str, FleetReplica] = {}
        self.lock = threading.Lock()
        self.file_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="replica-start")
        # router and replica calls, from the start threads too (httpx clients are thread-safe);
        # one client: a top-level httpx call builds a TLS context each time (~40 ms CPU). Every call
        # has an overall deadline (`burstrl.deadline`): a replica dripping its answer a byte at a time
        # must not hold a start thread or the drain loop (httpx's own timeouts are per read).
        self.http = sync_client()
        self.starts: list[Future] = []
        self.counter = 0
        self.failed_starts = 0
        self.last_failure = ""  # why the latest start failed (the provider's message: it quotes the log)
        self.spot_losses = 0  # replicas whose node was preempted (the provider knows; Ray does)
        self.write_replicas_file()

    # ---- membership ----
    def count(self, pool: str) -> int:
        """Replicas of the pool that are starting or up (draining ones are on their way out)."""
        with self.lock:
            return sum(1 for r in self.replicas.values() if r.pool == pool and r.state in ("starting", "up"))

    def alive(self) -> dict[str, int]:
        with self.lock:
            return {p: sum(1 for r in self.replicas.values() if r.pool == p and r.state == "up") for p in POOLS}

    def up(self) -> list[FleetReplica]:
        with self.lock:
            return [r for r in self.replicas.values() if r.state == "up"]

    def start(self, pool: str, why: str = "") -> FleetReplica:
        """Begin starting one replica of `pool`; it registers itself when ready."""
        with self.lock:
            self.counter += 1
            replica = FleetReplica(name=f"replica-{self.counter}-{pool}", pool=pool)
            self.replicas[replica.name] = replica
        self.starts.append(self.pool.submit(self._bring_up, replica, why))
        return replica

    def _bring_up(self, replica: FleetReplica, why: str) -> None:
        try:
            handle = self.provider.start(replica.name, self.serve_args, wait_ready=True, timeout=self.start_timeout_s,
                                         placement=Placement(listen=("server.host", "server.port"), pool=replica.pool,
                                                             cores=self.cores))
        except Exception as exc:  # a failed start is a fault to count and retry, not a crash
            with self.lock:
                replica.state = "gone"
                self.failed_starts += 1
                self.last_failure = f"{replica.name}: {exc}"
            self.event("replica_failed_start", replica=replica.name, pool=replica.pool, detail=str(exc)[-300:])
            return
        with self.lock:
            replica.handle = handle
            if replica.state != "starting":  # the run ended or it was scaled away while starting
                handle.stop()
                return
        try:
            self._register(replica)
        except CallFailed as exc:
            handle.kill()
            with self.lock:
                replica.state = "gone"
                self.failed_starts += 1
            self.event("replica_failed_start", replica=replica.name, pool=replica.pool, detail=f"register: {exc}")
            return
        with self.lock:
            replica.state = "up"
        self.write_replicas_file()
        self._catch_up(replica)
        self.event("replica_started", replica=replica.name, pool=replica.pool, detail=f"{replica.url} {why}".strip())

    def _register(self, replica: FleetReplica) -> None:
        body = {"url": replica.url, "pool": replica.pool, "weight": self.weights[replica.pool]}
        fetch(self.http, "POST", f"{self.router}/v1/replicas", deadline=30, json=body,
              headers={"Authorization": f"Bearer {self.cluster_token}"}).check()

    def _catch_up(self, replica: FleetReplica) -> None:
        """Load the newest version if one was published between the replica's start and its listing.

        Why: the replica loaded the newest version on the volume when it started, and the trainer
        pushes only to replicas listed in replicas.txt, so a version published in between would
        otherwise reach it one step late. A failure here is harmless: the next push brings it.
        """
        from burstrl.protocol.versions import version_name
        from burstrl.weights.volume import latest

        found = latest(self.volume)
        if found is None:
            return
        name = version_name(found[0])
        auth = {"Authorization": f"Bearer {self.admin_token}"}
        try:
            models = fetch(self.http, "GET", f"{replica.url}/v1/models", deadline=10, max_bytes=MAX_ANSWER_BYTES)
            served = {m["id"] for m in models.json()["data"]}
            if name not in served:
                fetch(self.http, "POST", f"{replica.url}/v1/load_lora_adapter", deadline=60, headers=auth,
                      json={"lora_name": name, "lora_path": str(found[1])}).check()
        except (CallFailed, ValueError, KeyError, TypeError) as exc:
            log.warning("%s could not catch up to %s: %s", replica.name, name, exc)

    def reregister(self) -> None:
        """Send every live replica to the router again (it restarted and knows none)."""
        for r in self.up():
            try:
                self._register(r)
            except CallFailed as exc:  # the next restart check or a replacement covers it
                log.warning("re-registering %s failed: %s", r.name, exc)

    def _deregister(self, replica: FleetReplica) -> None:
        try:
            fetch(self.http, "DELETE", f"{self.router}/v1/replicas", deadline=10, params={"url": replica.url},
                  headers={"Authorization": f"Bearer {self.cluster_token}"})
        except CallFailed as exc:  # the router drops it on failed scrapes anyway
            log.warning("deregistering %s failed: %s", replica.name, exc)

    def write_replicas_file(self) -> None:
        """The URLs the trainer pushes each version to (atomic: it may read at any moment)."""
        with self.file_lock:  # listing and writing in one go: concurrent starts end with the last state
            write_text(self.replicas_file, "".join(r.url + "\n" for r in self.up()))

    # ---- faults and scaling ----
    def reap(self) -> list[FleetReplica]:
        """Replicas whose process exited on its own: deregistered, listed as gone, returned."""
        dead = []
        with self.lock:
            for r in self.replicas.values():
                if r.state in ("up", "draining") and r.handle is not None and r.handle.poll() is not None:
                    dead.append(r)
                    r.state = "gone"
        for r in dead:
            self._deregister(r)
            cause = r.handle.cause
            if cause == "preempted":
                self.spot_losses += 1
            self.event("replica_died", replica=r.name, pool=r.pool,
                       detail=f"exit {r.handle.returncode}" + (f" ({cause})" if cause else ""))
        if dead:
            self.write_replicas_file()
        return dead

    def kill(self, replica: FleetReplica, why: str) -> None:
        """SIGKILL a replica's process group, as a preemption would; the router learns by failing calls."""
        with self.lock:
            replica.state = "gone"
        replica.handle.kill()
        self.write_replicas_file()
        self.event("replica_killed", replica=replica.name, pool=replica.pool, detail=why)
        self._deregister(replica)

    def drain(self, pool: str, n: int, drain_s: float = 30.0) -> list[FleetReplica]:
        """Take `n` replicas of `pool` out gracefully: no new sessions, stopped once idle or after `drain_s`."""
        with self.lock:
            chosen = [r for r in self.replicas.values() if r.pool == pool and r.state == "up"][-n:] if n else []
            for r in chosen:
                r.state, r.drain_deadline = "draining", time.monotonic() + drain_s
        for r in chosen:
            try:
                fetch(self.http, "POST", f"{self.router}/v1/replicas/drain", deadline=10, json={"url": r.url},
                      headers={"Authorization": f"Bearer {self.cluster_token}"})
            except CallFailed as exc:
                log.warning("draining %s failed: %s", r.name, exc)
            self.event("replica_draining", replica=r.name, pool=r.pool, detail=r.url)
        self.write_replicas_file()
        return chosen

    def finish_drains(self) -> None:
        """Stop draining replicas that have no live sessions left, or whose drain time is up."""
        with self.lock:
            draining = [r for r in self.replicas.values() if r.state == "draining"]
        for r in draining:
            if time.monotonic() < r.drain_deadline and _live_sessions(self.http, r.url) > 0:
                continue
            self._deregister(r)
            r.handle.stop()
            with self.lock:
                r.state = "gone"
            self.event("replica_stopped", replica=r.name, pool=r.pool, detail="drained")

    def cancel_starting(self, pool: str, n: int) -> int:
        """Scale down first by cancelling replicas that are still starting."""
        with self.lock:
            starting = [r for r in self.replicas.values() if r.pool == pool and r.state == "starting"][-n:] if n else []
            for r in starting:
                r.state = "gone"
        return len(starting)

    def close(self) -> None:
        """Stop every replica (the run is over or failed); starts in flight stop themselves."""
        with self.lock:
            for r in self.replicas.values():
                r.state = "gone" if r.handle is not None else "cancelled"
            handles = [r.handle for r in self.replicas.values() if r.handle is not None]
        for h in handles:
            h.stop(timeout=self.stop_timeout_s)
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self.lock:  # starts that finished while we shut down
            late = [r.handle for r in self.replicas.values() if r.handle is not None and r.handle not in handles]
        for h in late:
            h.stop(timeout=self.stop_timeout_s)
        self.http.close()


def _live_sessions(client: httpx.Client, url: str) -> int:
    try:
        loads: dict[str, Any] = fetch(client, "GET", f"{url}/v1/loads", deadline=5, max_bytes=MAX_ANSWER_BYTES).json()
    except (CallFailed, ValueError):
        return 0
    # the count is public; the per-session list needs a token
    return int(loads.get("num_sessions", 0)) + int(loads.get("num_running_reqs", 0))
