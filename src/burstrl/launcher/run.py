"""`burstrl run`: start the router, the replicas, the trainer and the orchestrator; supervise; tear down.

Why one supervisor: an RL run is only as alive as its weakest role, and a person needs one command
that either finishes or says which role failed and where its log is. The launcher is the owner of
every child: it polls them twice a second, replaces replicas that die (a preemption is routine,
not an error), applies scale requests, the autoscaler and chaos, samples the fleet into
fleet.jsonl, and draws the progress display. Any other role exiting with an error ends the run
with that role's name and log; Ctrl-C or SIGTERM stops every child's process group.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import secrets
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from burstrl.config import RunConfig, Section, dump_toml
from burstrl.deadline import CallFailed, fetch, sync_client
from burstrl.launcher import control
from burstrl.launcher.display import Display, snapshot_eta
from burstrl.launcher.fleet import Fleet, FleetOptions
from burstrl.launcher.preflight import replicas_on_cpu
from burstrl.orchestrator.autoscaler import FleetSignals, decide, wait_fraction
from burstrl.protocol.cores import host_cores
from burstrl.providers import Placement, RoleHandle, make_provider
from burstrl.store import RolloutStore

log = logging.getLogger("burstrl.run")
MAX_FAILED_STARTS = 5  # replica starts that may fail (beyond the first fleet) before the run gives up
SANDBOX_NODE_POLL_S = 3.0  # how often the launcher looks for sandbox nodes that joined or left
CORES_KEY = "engine.vllm.cpu_cores"  # where a replica's own cores go (`Placement.cores`)
# A vLLM replica's SIGTERM to exit: it stops vLLM's process group first (10 s grace, then SIGKILL);
# killing the replica sooner leaves vLLM's engine core to its own parent-death handling.
VLLM_STOP_S = 30.0


class LaunchError(RuntimeError):
    """A role failed or the run cannot start; the message names the role and its log."""


class Stopped(Exception):
    """SIGTERM or SIGINT reached the launcher."""


class JsonTail:
    """New complete lines of a JSON-lines file another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, []  # rows: every line read so far

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.rows
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
        for line in data[:end].splitlines():
            try:
                self.rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.offset += end
        return self.rows


class Launcher:
    def __init__(self, cfg: RunConfig, resume: bool = False, live: bool | None = None) -> None:
        self.cfg, self.resume = cfg, resume
        self.run_dir = Path(cfg.run_dir).absolute()
        self.admin_token = secrets.token_urlsafe(24)
        self.cluster_token = secrets.token_urlsafe(24)
        self.env = {**self.role_env(), "PYTHONUNBUFFERED": "1"}
        self.provider = make_provider(cfg, self.run_dir, self.env)
        self.router: RoleHandle | None = None
        self.trainer: RoleHandle | None = None
        self.orchestrator: RoleHandle | None = None
        self.router_restarts = 0
        self.trainer_restarts = 0
        self.fleet: Fleet | None = None
        self.store: RolloutStore | None = None
        self.live = live
        self.display: Display | None = None
        self.events: deque[str] = deque(maxlen=8)
        self.metrics = JsonTail(self.run_dir / "metrics.jsonl")
        self.orch_stats = JsonTail(self.run_dir / "orchestrator.jsonl")
        self.started = time.monotonic()
        self.rng = random.Random(cfg.orchestrator.seed)
        self.chaos_done = False
        self.last_autoscale = 0.0
        self.last_sample = 0.0
        self.last_node_poll = 0.0
        self.node_poll_errors = 0  # sandbox-node polls that failed (each retried at the next poll)
        self.router_stats: dict[str, Any] = {}
        self.http: httpx.Client | None = None  # the 1 Hz router poll: one client (one TLS context) per run

    def role_env(self) -> dict[str, str]:
        """The secrets every role gets in its environment (never argv: `ps` shows that)."""
        return {"BURSTRL_ADMIN_TOKEN": self.admin_token, "BURSTRL_CLUSTER_TOKEN": self.cluster_token}

    # ---- the run ----
    STOP_LINE = "stopped: tearing the run down"  # said on SIGTERM/SIGINT (a fleet says its own)

    def run(self) -> int:
        """Run to the last step; returns the exit status (0 done, 1 a role failed, 130 stopped)."""
        try:
            done = self.prepare()
        except BaseException:
            self.provider.close()  # the local provider's zygote started with it
            raise
        if done:
            self.provider.close()
            print(f"{self.run_dir}: all {self.cfg.trainer.steps} steps are already committed", file=sys.stderr)
            return 0
        previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
        status, outcome, detail = 1, "run_failed", "launcher error"
        try:
            self.start_roles()
            self.supervise()
            status, outcome, detail = 0, "run_finished", ""
        except LaunchError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            detail = str(exc).splitlines()[0][:500]
        except (Stopped, KeyboardInterrupt) as exc:
            print(self.STOP_LINE, file=sys.stderr, flush=True)
            status, outcome, detail = 130, "run_stopped", str(exc)
        finally:
            self.teardown(outcome, detail)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return status

    def prepare(self) -> bool:
        """Run directory, resolved configs, the store check; True if there is nothing left to do."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.store = RolloutStore(self.run_dir / "store.sqlite")
        last = self.store.last_step()
        if last and not self.resume:
            raise LaunchError(f"{self.run_dir} already has {last} committed steps: pass --resume to continue, "
                              "or choose another run_dir")
        if last >= self.cfg.trainer.steps:
            return True
        (self.run_dir / "run_config.toml").write_text(dump_toml(self.cfg))
        self.event("run_started", detail=f"resume from step {last}" if self.resume else "")
        return False

    def role_config(self, name: str, cfg: Section) -> str:
        """Write a role's config (derived by RunConfig, not assembled here) to RUN_DIR/roles/NAME.toml."""
        path = self.run_dir / "roles" / f"{name}.toml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(dump_toml(cfg))
        return str(path)

    def start_roles(self) -> None:
        self.start_fleet(self.cfg.router_config(), self.cfg.serve_config())
        self.start_trainer()
        self.wait_for_first_replica()
        self.start_orchestrator(self.router.url)

    def start_fleet(self, router: Section, serve: Any) -> None:
        """The router, then the first replicas' starts (they finish in the fleet's threads)."""
        c = self.cfg
        self.router = self._start("router", ["route", "serve", self.role_config("router", router)],
                                  ready=True, placement=Placement(listen=("host", "port"), restartable=True,
                                                                  on_driver=True))
        vllm = c.engine.backend == "vllm"
        options = FleetOptions(serve_args=["serve", self.role_config("serve", serve)], router=self.router.url,
                               cluster_token=self.cluster_token, admin_token=self.admin_token, run_dir=self.run_dir,
                               weights={"reserved": c.fleet.reserved_weight, "on_demand": c.fleet.on_demand_weight},
                               start_timeout_s=c.replica_start_timeout_s(), volume=Path(serve.adapter_volume),
                               cores=self.replica_cores(), stop_timeout_s=VLLM_STOP_S if vllm else 5.0)
        self.fleet = Fleet(self.provider, options, self.event)
        for pool, n in (("reserved", c.fleet.reserved), ("on_demand", c.fleet.on_demand)):
            for _ in range(n):
                self.fleet.start(pool)

    def start_trainer(self) -> None:
        train = self.cfg.train_config()
        try:
            self.trainer = self.provider.start_trainer(Path(self.role_config("train", train)),
                                                       train.trainer.world_size, self.resume, append=self.resume)
        except RuntimeError as exc:
            raise LaunchError(f"the trainer failed to start: {exc}") from None

    def start_orchestrator(self, router_url: str) -> None:
        orch = self.cfg.orchestrate_config(router_url)
        self.start_sandbox_nodes(orch)
        self.orchestrator = self._start("orchestrator", ["orchestrate", self.role_config("orchestrate", orch)],
                                        ready=False, placement=Placement(on_driver=True))
        control.write_launcher_info(self.run_dir, router_url)
        self.display = Display(self.run_dir, self.cfg.trainer.steps, live=self.live)

    def start_sandbox_nodes(self, orch: Any) -> None:
        """With a provider that has sandbox nodes (Ray: `sandbox_node`), the SWE env places its sandboxes there."""
        start = getattr(self.provider, "start_sandbox_nodes", None)
        if start is None or "swe" not in self.cfg.orchestrator.envs or orch.orchestrator.swe.nodes_file:
            return
        try:
            path = start(orch.orchestrator.swe.backend)
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from None
        if path is not None:
            orch.orchestrator.swe.nodes_file = str(path)
            self.event("sandbox_nodes", detail=str(path))

    def poll_sandbox_nodes(self) -> None:
        """Every few seconds: agents for sandbox nodes that joined the cluster mid-run (the SWE env's
        pool reads the rewritten nodes file), none for nodes that left."""
        poll = getattr(self.provider, "poll_sandbox_nodes", None)
        if poll is None or time.monotonic() - self.last_node_poll < SANDBOX_NODE_POLL_S:
            return
        self.last_node_poll = time.monotonic()
        try:
            changes = poll()
        except Exception as exc:  # a Ray GCS hiccup must not end the run: the next poll retries
            self.node_poll_errors += 1
            self.event("sandbox_nodes", detail=f"poll failed ({type(exc).__name__}: {exc}); retrying")
            return
        for change in changes:
            self.event("sandbox_nodes", detail=change)

    def _start(self, name: str, args: list[str], ready: bool, placement: Placement) -> RoleHandle:
        try:
            return self.provider.start(name, args, wait_ready=ready, timeout=120.0, append=self.resume,
                                       placement=placement)
        except RuntimeError as exc:
            raise LaunchError(f"the {name} failed to start: {exc}") from None

    def replica_cores(self) -> tuple[str, int] | None:
        """`Placement.cores` for the replicas: cores of their own for vLLM on CPU (RunConfig.replica_cores)."""
        c = self.cfg
        if c.engine.backend != "vllm":
            return None
        try:
            count = c.replica_cores(len(host_cores()), replicas_on_cpu(c))
        except ValueError as exc:  # preflight said so already; a config changed since (tests) says it here
            raise LaunchError(str(exc)) from None
        return (CORES_KEY, count) if count else None

    def wait_for_first_replica(self) -> None:
        timeout = self.cfg.replica_start_timeout_s()
        deadline = time.monotonic() + timeout
        while not self.fleet.up():
            self.check_roles()
            if all(r.state == "gone" for r in self.fleet.replicas.values()):
                raise LaunchError(f"no replica could start; see {self.run_dir / 'logs'}/replica-*.log; the last "
                                  f"failure: {self.fleet.last_failure}")
            if time.monotonic() > deadline:
                raise LaunchError(f"no replica was ready in {timeout:.0f} s (fleet.start_timeout_s); "
                                  f"see {self.run_dir / 'logs'}/replica-*.log")
            time.sleep(0.2)

    # ---- supervision ----
    def supervise(self) -> None:
        while not self.check_roles():
            self.replace_dead()
            self.apply_scale_request()
            self.autoscale()
            self.chaos()
            self.fleet.finish_drains()
            self.poll_sandbox_nodes()
            self.sample()
            time.sleep(0.5)
        self.sample(force=True)

    def check_roles(self) -> bool:
        """True once the trainer finished; LaunchError if any other role (or the trainer) failed."""
        code = self.trainer.poll()
        if code == 0:
            return True
        if code is not None:
            raise LaunchError(f"the trainer exited with status {code}{_cause(self.trainer)}; log: "
                              f"{self.trainer.log}\n{_tail(self.trainer.log)}")
        for name, role in (("router", self.router), ("orchestrator", self.orchestrator)):
            if role is self.orchestrator and role is not None and role.poll() == 0:
                continue  # it stops by itself once the last step is committed
            if role is not None and role.poll() is not None:
                raise LaunchError(f"the {name} exited with status {role.returncode}{_cause(role)}; log: {role.log}\n"
                                  f"{_tail(role.log)}")
        self.after_restarts()
        return False

    def after_restarts(self) -> None:
        """A router restarted in place knows no replica: send it the list again. Trainer relaunches are logged."""
        if self.router.restarts > self.router_restarts:
            self.router_restarts = self.router.restarts
            self.event("router_restarted", detail=f"restart {self.router.restarts} at {self.router.url}")
            self.fleet.reregister()
        if self.trainer.restarts > self.trainer_restarts:
            self.trainer_restarts = self.trainer.restarts
            self.event("trainer_relaunched", detail=f"relaunch {self.trainer.restarts} from the last checkpoint "
                       f"({self.trainer.cause or 'a rank died'})")

    def replace_dead(self) -> None:
        for r in self.fleet.reap():
            if self.cfg.fleet.replace_dead:
                self.fleet.start(r.pool, f"(replaces {r.name})")
        if self.fleet.failed_starts > MAX_FAILED_STARTS:
            raise LaunchError(f"{self.fleet.failed_starts} replica starts failed; see {self.run_dir / 'logs'}/"
                              "replica-*.log")

    def scale_on_demand(self, target: int, why: str) -> None:
        """Grow or shrink the on-demand pool to `target` (new replicas start; extra ones drain)."""
        have = self.fleet.count("on_demand")
        if target > have:
            self.provider.request_capacity({"reserved": self.fleet.count("reserved"), "on_demand": target})
        for _ in range(target - have):
            self.fleet.start("on_demand", why)
        if target < have:
            extra = have - target
            extra -= self.fleet.cancel_starting("on_demand", extra)
            self.fleet.drain("on_demand", extra)
        if target != have:
            self.event("scale", pool="on_demand", detail=f"{have} -> {target} ({why})")

    def apply_scale_request(self) -> None:
        request = control.take_scale_request(self.run_dir)
        if request is None:
            return
        total = int(request.get("replicas", -1))
        reserved = self.fleet.count("reserved")
        if total < reserved:
            control.answer_scale(self.run_dir, request, {"ok": False, "error": f"replicas must be >= the "
                                                         f"{reserved} reserved replicas, got {total}"})
            return
        most = self.most_replicas_here()
        if most is not None and total > most:
            control.answer_scale(self.run_dir, request, {"ok": False, "error": f"{total} replicas do not fit: each "
                                 f"vLLM replica binds {self.fleet.cores[1]} cores of its own and this host has "
                                 f"{len(host_cores())} ({most} at most): the slices are cut at start for the "
                                 "most replicas the run holds at once: start it with fleet.max_replicas, or set "
                                 "engine.vllm.cpu_cores to share cores"})
            return
        self.scale_on_demand(total - reserved, "burstrl scale")
        control.answer_scale(self.run_dir, request, {"ok": True, "reserved": reserved, "on_demand": total - reserved})

    def most_replicas_here(self) -> int | None:
        """The most replicas that fit this host's cores (vLLM on CPU, local provider); None = no such bound."""
        if self.fleet.cores is None or self.cfg.provider != "local":
            return None
        return len(host_cores()) // self.fleet.cores[1]

    def autoscale(self) -> None:
        a = self.cfg.autoscale
        now = time.monotonic()
        if not a.enabled or now - self.last_autoscale < a.interval_s:
            return
        have = self.fleet.count("on_demand")
        signals = FleetSignals(wait_fraction(self.metrics.read()), self.store.buffered_count(),
                               self.cfg.trainer.batch_groups, have)
        delta = decide(a, signals)
        if delta:
            self.last_autoscale = now
            self.scale_on_demand(have + delta, f"autoscale: trainer waiting {signals.wait_fraction}, "
                                               f"{signals.buffered_groups} groups buffered")

    def chaos(self) -> None:
        """Kill `kill_fraction` of the replicas once, halfway into step `at_step`."""
        c = self.cfg.chaos
        if self.chaos_done or c.kill_fraction <= 0:
            return
        last = self.store.last_step()
        if last < c.at_step - 1:
            return
        if not self.store.counts()["attempts"].get("running"):
            return  # mid-step means rollouts in flight: wait for the orchestrator to have some
        up = self.fleet.up()
        victims = self.rng.sample(up, min(len(up), max(1, math.ceil(c.kill_fraction * len(up)))))
        self.chaos_done = True
        self.event("chaos", detail=f"killing {len(victims)} of {len(up)} replicas during step {last + 1}")
        for r in victims:
            self.fleet.kill(r, f"chaos during step {last + 1}")
            if self.cfg.fleet.replace_dead:
                self.fleet.start(r.pool, f"(replaces {r.name})")

    # ---- observation ----
    def event(self, name: str, replica: str = "", pool: str = "", detail: str = "") -> None:
        line = {"t": time.time(), "kind": "event", "event": name, "replica": replica, "pool": pool, "detail": detail}
        with open(self.run_dir / "fleet.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        self.events.append(" ".join(x for x in (name, replica, detail) if x))
        log.info("%s %s %s", name, replica, detail)

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_sample < 1.0:
            return
        self.last_sample = now
        if self.http is None:
            self.http = sync_client(timeout=2.0)
        self.router_stats = _get_json(self.http, f"{self.router.url}/v1/stats") or self.router_stats
        totals = self.router_stats.get("totals", {})
        sample = {"t": time.time(), "kind": "sample", "step": self.store.last_step(),
                  "buffered": self.store.buffered_count(), "replicas": self.fleet.alive(),
                  "routable": totals.get("replicas", 0), "cache_hit_rate": totals.get("cache_hit_rate", 0.0),
                  "sessions": totals.get("sessions", 0), "spot_losses": self.fleet.spot_losses}
        with open(self.run_dir / "fleet.jsonl", "a") as f:
            f.write(json.dumps(sample) + "\n")
        self.display.update(self.snapshot(sample))

    def snapshot(self, sample: dict[str, Any]) -> dict[str, Any]:
        steps, orch = self.metrics.read(), self.orch_stats.read()
        last, o = (steps[-1] if steps else {}), (orch[-1] if orch else {})
        elapsed = time.monotonic() - self.started
        done_here = sample["step"] - (steps[0]["step"] - 1 if steps else 0)
        eta = snapshot_eta(elapsed, done_here, self.cfg.trainer.steps - (sample["step"] - done_here))
        return {"step": sample["step"], "steps": self.cfg.trainer.steps, "reward": last.get("reward_mean"),
                "pass_rate": o.get("pass_rate"), "staleness": last.get("staleness_mean"),
                "replicas": sample["replicas"], "routable": sample["routable"],
                "cache_hit_rate": sample["cache_hit_rate"], "rollouts_per_s": o.get("rollouts_per_s"),
                "buffered": sample["buffered"], "elapsed_s": elapsed, "eta_s": eta, "events": list(self.events)}

    # ---- teardown ----
    def teardown(self, outcome: str, detail: str) -> None:
        """Stop every child (orchestrator first, so its attempts close in the ledger), then report."""
        for role in (self.orchestrator, self.trainer):
            if role is not None:
                role.stop(timeout=15.0)
        self.stop_children()
        if self.store is not None:
            self.event(outcome, detail=detail)
            self.store.close()
            self.write_report()

    def stop_children(self) -> None:
        """Stop every replica, the router and the provider, close the HTTP client and the display, and
        take launcher.json away: how both a run (`teardown`) and a shared fleet (`SharedFleet.teardown`) end."""
        if self.fleet is not None:
            self.fleet.close()
        if self.router is not None:
            self.router.stop(timeout=5.0)
        self.provider.close()
        if self.http is not None:
            self.http.close()
        if self.display is not None:
            self.display.close()
        control.clear_launcher_info(self.run_dir)

    def write_report(self) -> None:
        from burstrl.eval.report import write_report

        try:
            png, md = write_report(self.run_dir)
        except (ValueError, OSError) as exc:  # a report is a convenience: it must not fail the run
            print(f"warning: no report written: {exc}", file=sys.stderr)
            return
        print(f"report: {md} and {png}", file=sys.stderr)


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _get_json(client: httpx.Client, url: str) -> dict[str, Any] | None:
    """The router's answer within 2 s in all (`burstrl.deadline`): the 1 Hz poll runs in the supervising
    loop, which a router dripping its answer a byte at a time must not hold (httpx's timeouts are per read)."""
    try:
        return fetch(client, "GET", url, deadline=2.0, max_bytes=64 << 20).json()
    except (CallFailed, ValueError):
        return None


def _cause(role: RoleHandle) -> str:
    return f" ({role.cause})" if role.cause else ""


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_launcher(cfg: RunConfig, resume: bool = False, launcher: type[Launcher] = Launcher) -> int:
    """`burstrl run`: the launcher (`launcher`: on a shared fleet, `tenant_run.TenantLauncher`); its exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return launcher(cfg, resume).run()
