"""Several RL runs (tenants) on one fleet of replicas vs each on a dedicated share, simulated.

Why: issue 51 claims a shared fleet serves bursts of experiments better than one fleet per run,
because each run leaves its replicas idle while its trainer steps and while the last long
rollouts of a batch finish. On one machine every replica shares the same cores, so the gain can
only show where replicas are separate devices: this module gives the router simulator
(`burstrl.router.sim`) tenants, trainer pauses and bursty arrivals, with the same replica, KV,
prefill and decode cost model, so its throughput means what the router benchmark's means.

Model of one tenant (an asynchronous GRPO run): step s trains on batch s (B sessions, GRPO groups
sharing a first prompt, released over about `burst_s` seconds); batch s may be released once the
trainer has finished step s - 1 - async_level (the staleness limit: async_level 0 is synchronous,
1 lets batch s + 1 sample while step s trains); at most `max_in_flight` sessions are submitted and
unfinished (the orchestrator's limit), the rest wait at the tenant. The trainer steps on a batch
once all its sessions are done and the previous step has finished; a step takes `step_s` seconds
times a uniform jitter.

Fleet modes at equal replicas N: `shared` (one group of N replicas, every tenant) and `dedicated`
(tenant i gets N * w_i / sum(w) replicas, largest remainder, at least one, and only its own). A
group admits at most `sessions_per_replica` sessions per replica at once (beyond that a session's
context no longer fits the KV and it would thrash); the rest wait at the router in a queue per
tenant, and a free place goes to the waiting tenant with the fewest admitted sessions per unit of
weight (weighted fair share: a tenant below its share is served first, idle share goes to whoever
waits). Placement inside the group is the router's policy (`kv` by default).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from burstrl.router.sim import (
    Call,
    PoolSpec,
    RouterSimConfig,
    RouterSimulator,
    SimReplica,
    TaskKind,
    TraceSession,
    generate_trace,
    load_config,
    percentile,
)

Mode = Literal["shared", "dedicated"]


@dataclass
class TenantSpec:
    """One RL run: its weight, batch, trainer step and staleness limit."""

    name: str
    weight: float = 1.0
    batch: int = 128  # sessions per step (16 prompts x GRPO groups of 8)
    group_size: int = 8
    step_s: float = 60.0  # trainer compute per step, mean
    step_jitter: float = 0.2  # the step takes step_s * uniform(1 - jitter, 1 + jitter)
    async_level: int = 1  # batch s may be released once step s - 1 - async_level is trained
    burst_s: float = 10.0  # a batch's groups arrive over about this many seconds (Poisson)
    max_in_flight: int | None = None  # submitted, unfinished sessions; None: batch * (1 + async_level)
    start_s: float = 0.0
    kind: TaskKind = field(default_factory=TaskKind)  # sim.py's default `swe` rollout (8-30 calls)

    def in_flight_limit(self) -> int:
        return self.max_in_flight if self.max_in_flight is not None else self.batch * (1 + self.async_level)


@dataclass
class TenantSimConfig:
    """The fleet and the run length; `router` holds the cost model shared with `sim.py`."""

    tenants: list[TenantSpec]
    replicas: int = 128
    capacity_tokens: int = 200_000  # KV per replica (weight 1), as the router benchmark's on-demand pool
    sessions_per_replica: int = 16  # ~200k KV / ~12k mean live tokens of a `swe` session
    horizon_s: float = 1800.0
    seed: int = 0
    policy: str = "kv"
    router: RouterSimConfig | None = None  # None: sim.py's defaults, finished rollouts released

    def router_config(self) -> RouterSimConfig:
        base = self.router or load_config(release_finished=True, size_prior_tokens=32768)
        return base.model_copy(update={"seed": self.seed, "pools": [
            PoolSpec(pool="on_demand", count=self.replicas, weight=1.0, capacity_tokens=self.capacity_tokens)]})


def dedicated_split(replicas: int, weights: list[float]) -> list[int]:
    """Replicas per tenant in proportion to weight, rounded by largest remainder (sums to `replicas`).

    Why largest remainder: plain rounding can hand out one replica more or less than the fleet
    has, and then the comparison is no longer at equal replicas. Every tenant gets at least one
    (taken from the largest shares) when there are enough replicas.
    """
    if replicas < len(weights):
        raise ValueError(f"{replicas} replicas cannot give each of {len(weights)} tenants one")
    total = sum(weights)
    exact = [replicas * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: replicas - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        while counts[i] < 1:
            donor = max(range(len(counts)), key=lambda j: (counts[j], -j))
            counts[donor] -= 1
            counts[i] += 1
    return counts


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 when all equal, 1/n when one has all."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def pick_fair(queues: list[deque], admitted: list[int], weights: list[float]) -> int | None:
    """The tenant whose waiting session is admitted next: fewest admitted per unit of weight among
    those waiting, ties to the longest-waiting head (its submission time); None when none waits."""
    waiting = [i for i, q in enumerate(queues) if q]
    if not waiting:
        return None
    return min(waiting, key=lambda i: (admitted[i] / weights[i], queues[i][0].arrival_s, i))


class AdmissionGroup:
    """Replicas that serve a set of tenants, with the router's admission queues for them."""

    def __init__(self, replicas: list[SimReplica], tenants: list[int], per_replica: int) -> None:
        self.replicas = replicas
        self.views = [r.view for r in replicas]
        self.tenants = tenants
        self.capacity = per_replica * len(replicas)
        self.admitted = 0


class TenantState:
    """Where one run stands: batches released and trained, sessions waiting, submitted, admitted."""

    def __init__(self, spec: TenantSpec) -> None:
        self.spec = spec
        self.released = 0  # batches released so far (the next one is batch `released`)
        self.trained = 0  # steps finished
        self.training = False
        self.left: dict[int, int] = {}  # batch -> sessions not yet finished
        self.pending: deque[TraceSession] = deque()  # released, held back by max_in_flight
        self.in_flight = 0  # submitted to the router, unfinished
        self.admitted = 0  # placed on a replica, unfinished
        self.completed = 0
        self.completed_all_active = 0  # finished while every tenant had work
        self.latency_s: list[float] = []


class TenantSimulator(RouterSimulator):
    """`sim.py`'s replicas, cost model and policy, driven by tenants instead of a fixed trace."""

    def __init__(self, cfg: TenantSimConfig, mode: Mode) -> None:
        super().__init__(cfg.router_config(), [], cfg.policy)
        self.tcfg, self.mode = cfg, mode
        self.tenants = [TenantState(spec) for spec in cfg.tenants]
        self.weights = [spec.weight for spec in cfg.tenants]
        if mode == "shared":
            self.groups = [AdmissionGroup(self.replicas, list(range(len(self.tenants))), cfg.sessions_per_replica)]
        else:
            self.groups, start = [], 0
            for i, n in enumerate(dedicated_split(cfg.replicas, self.weights)):
                self.groups.append(AdmissionGroup(self.replicas[start:start + n], [i], cfg.sessions_per_replica))
                start += n
        self.group_of = {i: g for g in self.groups for i in g.tenants}
        self.queues: list[deque[TraceSession]] = [deque() for _ in self.tenants]
        self.session_owner: dict[str, tuple[int, int]] = {}  # session id -> (tenant, batch)
        self.last_t = 0.0
        self.slot_s = [0.0] * len(self.tenants)  # admitted session-seconds
        self.backlogged_slot_s = [0.0] * len(self.tenants)  # the same while every tenant waits at the router
        self.backlogged_s = 0.0
        self.all_active_s = 0.0

    # --- workload -------------------------------------------------------------------------------

    def batch_sessions(self, i: int, step: int, t0: float) -> list[TraceSession]:
        """Batch `step` of tenant i: the same sessions in both modes (seeded by tenant and step)."""
        spec = self.tenants[i].spec
        sub = self.cfg.model_copy(update={
            "seed": self.tcfg.seed * 1_000_003 + i * 10_007 + step, "sessions": spec.batch,
            "arrival_rate": spec.batch / max(spec.burst_s, 1e-6), "kinds": [spec.kind],
            "group_size": spec.group_size})
        offset = (i * 100_000 + step + 1) * 10**15  # block hashes unique across tenants and batches
        out = []
        for s in generate_trace(sub):
            calls = [Call(tuple(h + offset for h in c.input_hashes), tuple(h + offset for h in c.output_hashes),
                             c.input_tokens, c.output_tokens, c.gap_after_s) for c in s.calls]
            sid = f"{spec.name}/b{step}/{s.id}"
            self.session_owner[sid] = (i, step)
            self.kind_by_id[sid] = s.kind
            out.append(TraceSession(sid, s.kind, t0 + s.arrival_s, calls))
        return out

    def step_time(self, i: int, step: int) -> float:
        spec = self.tenants[i].spec
        rng = random.Random(self.tcfg.seed * 7_919 + i * 104_729 + step)
        return spec.step_s * rng.uniform(1 - spec.step_jitter, 1 + spec.step_jitter)

    def release_batches(self, t: float, i: int) -> None:
        """Release every batch the staleness limit allows: batch s once s <= trained + async_level."""
        ts = self.tenants[i]
        while ts.released <= ts.trained + ts.spec.async_level:
            step = ts.released
            sessions = self.batch_sessions(i, step, t)
            ts.left[step] = len(sessions)
            ts.released += 1
            for s in sessions:
                self.push(s.arrival_s, "ready", (i, s))

    def maybe_train(self, t: float, i: int) -> None:
        ts = self.tenants[i]
        if not ts.training and ts.left.get(ts.trained) == 0:
            ts.training = True
            self.push(t + self.step_time(i, ts.trained), "trained", i)

    # --- router ---------------------------------------------------------------------------------

    def submit(self, t: float, i: int) -> None:
        """The tenant submits what its in-flight limit allows; the router queues it per tenant."""
        ts = self.tenants[i]
        while ts.pending and ts.in_flight < ts.spec.in_flight_limit():
            s = ts.pending.popleft()
            s.arrival_s = t  # latency counts from submission to the router
            ts.in_flight += 1
            self.queues[i].append(s)
        self.admit(t, self.group_of[i])

    def admit(self, t: float, g: AdmissionGroup) -> None:
        """Fill the group's free places in weighted-fair order across its waiting tenants."""
        queues = [self.queues[i] for i in g.tenants]
        admitted = [self.tenants[i].admitted for i in g.tenants]
        weights = [self.weights[i] for i in g.tenants]
        while g.admitted < g.capacity:
            k = pick_fair(queues, admitted, weights)
            if k is None:
                return
            s = queues[k].popleft()
            admitted[k] += 1
            self.tenants[g.tenants[k]].admitted += 1
            g.admitted += 1
            self.arrive(t, s)

    def in_group(self, s: TraceSession) -> AdmissionGroup:
        return self.group_of[self.session_owner[s.id][0]]

    def arrive(self, t: float, s: TraceSession) -> None:
        """Place within the session's group only (a dedicated fleet never lends a replica)."""
        every, self.views = self.views, self.in_group(s).views
        try:
            super().arrive(t, s)
        finally:
            self.views = every

    def home_for_call(self, s: TraceSession, idx: int) -> SimReplica:
        every, self.views = self.views, self.in_group(s).views
        try:
            return super().home_for_call(s, idx)
        finally:
            self.views = every

    def done(self, t: float, r: SimReplica, s: TraceSession, idx: int, pinned: bool) -> None:
        super().done(t, r, s, idx, pinned)
        if idx + 1 < len(s.calls):
            return
        i, step = self.session_owner.pop(s.id)
        ts = self.tenants[i]
        if self.all_active():
            ts.completed_all_active += 1
        ts.in_flight -= 1
        ts.admitted -= 1
        ts.completed += 1
        ts.latency_s.append(t - s.arrival_s)
        ts.left[step] -= 1
        self.group_of[i].admitted -= 1
        self.maybe_train(t, i)
        self.submit(t, i)  # its own held-back sessions, then the group's free place to the fairest waiting

    # --- accounting -----------------------------------------------------------------------------

    def all_active(self) -> bool:
        """Every tenant has work: sessions submitted and unfinished, or held back by its limit."""
        return all(ts.in_flight or ts.pending for ts in self.tenants)

    def account(self, t: float) -> None:
        """Integrate admitted sessions per tenant up to t (the state holds since the last event)."""
        dt = t - self.last_t
        if dt <= 0:
            return
        backlogged = all(self.queues)
        for i, ts in enumerate(self.tenants):
            self.slot_s[i] += ts.admitted * dt
            if backlogged:
                self.backlogged_slot_s[i] += ts.admitted * dt
        self.backlogged_s += dt if backlogged else 0.0
        self.all_active_s += dt if self.all_active() else 0.0
        self.last_t = t

    def simulate(self) -> dict:
        for i, ts in enumerate(self.tenants):
            self.push(ts.spec.start_s, "start", i)
        self.push(0.0, "scrape", None)
        horizon = self.tcfg.horizon_s
        while self.events and self.events[0][0] <= horizon:
            t, _, what, payload = heapq.heappop(self.events)
            self.account(t)
            if what == "call":
                session, idx = payload
                self.enqueue(t, self.home_for_call(session, idx), session, idx)
            elif what == "done":
                self.done(t, *payload)
            elif what == "ready":
                i, s = payload
                self.tenants[i].pending.append(s)
                self.submit(t, i)
            elif what == "trained":
                ts = self.tenants[payload]
                ts.trained += 1
                ts.training = False
                self.release_batches(t, payload)
                self.maybe_train(t, payload)
            elif what == "start":
                self.release_batches(t, payload)
            elif what == "scrape":
                self.scrape()
                self.push(t + self.cfg.scrape_interval_s, "scrape", None)
        self.account(horizon)
        return self.figures()

    def figures(self) -> dict:
        h = self.tcfg.horizon_s
        per = []
        for i, ts in enumerate(self.tenants):
            per.append({"name": ts.spec.name, "weight": ts.spec.weight, "replicas": len(self.group_of[i].replicas)
                        if self.mode == "dedicated" else None, "steps": ts.trained,
                        "steps_per_hour": ts.trained * 3600 / h, "rollouts": ts.completed,
                        "rollouts_per_s": ts.completed / h, "slot_share": self.slot_s[i] / max(sum(self.slot_s), 1e-9)})
        w = sum(self.weights)
        served = [ts.completed_all_active for ts in self.tenants]
        lat = sorted(x for ts in self.tenants for x in ts.latency_s)
        capacity = sum(g.capacity for g in self.groups)
        fair_active = [s / max(sum(served), 1) / (wi / w) for s, wi in zip(served, self.weights, strict=True)]
        fair_backlog = [s / max(sum(self.backlogged_slot_s), 1e-9) / (wi / w)
                        for s, wi in zip(self.backlogged_slot_s, self.weights, strict=True)]
        return {
            "mode": self.mode,
            "rollouts_per_s": sum(ts.completed for ts in self.tenants) / h,
            "steps_per_hour": sum(ts.trained for ts in self.tenants) * 3600 / h,
            "p50_session_s": percentile(lat, 0.50),
            "p95_session_s": percentile(lat, 0.95),
            "jain_all_active": jain(fair_active),
            "all_active_s": self.all_active_s,
            "jain_backlogged": jain(fair_backlog) if self.backlogged_s > 0 else None,
            "backlogged_s": self.backlogged_s,
            "slot_occupancy": sum(self.slot_s) / (capacity * h),
            "hit_rate": self.stats["hit_tokens"] / max(self.stats["reusable_tokens"], 1),
            "tenants": per,
        }


def run_modes(cfg: TenantSimConfig, modes: tuple[Mode, ...] = ("shared", "dedicated")) -> dict[str, dict]:
    """Both fleet modes on the same seeded workload."""
    return {mode: TenantSimulator(cfg, mode).simulate() for mode in modes}
