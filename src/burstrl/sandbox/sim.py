"""Trace-driven cluster simulator for sandbox placement, one-second ticks, the live policy code.

Why: whether overcommitting sandboxes on measured usage keeps evictions at zero, and how much an
image-aware score lifts the layer-cache hit rate, depend on the workload's bursts and the
cluster's shape; a unit test cannot show it and a real cluster is too costly to sweep. Every
policy sees the same rollouts (`simload`), and decides through `placement`'s code unchanged.

Model, per node and per second:
- CPU is shared in proportion to requests (CFS shares) and capped at each sandbox's limit; a
  throttled rollout's commands and tests progress more slowly (reported as slowdown), while its
  idle time (the model generating) passes at wall speed. CPU never evicts.
- Memory is incompressible: a sandbox above its own limit is OOM-killed; pods' memory above
  allocatable triggers a kubelet eviction (checked every `eviction_interval_s`, the sandboxes
  most above their requests first); above the node's capacity the kernel OOM-kills the largest.
- Each node has an LRU cache of image layers with a capacity (layers of running sandboxes are
  pinned); a miss pulls the missing layers one after another (`pull_mbps`) and unpacks them
  (`zstd_mbps` or `gzip_mbps`), then the sandbox is created (`create_s`).
- Closed loop: `concurrency` x `nodes` rollouts want to run at once; those no node admits wait.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from burstrl.config.loading import Section
from burstrl.sandbox.placement import (
    GIB,
    NodeState,
    PlacedSandbox,
    Policy,
    Prior,
    Resources,
    SandboxRequest,
    Usage,
    make_policy,
)
from burstrl.sandbox.simload import (
    GEN,
    SimRollout,
    WorkloadConfig,
    image_layers,
    make_rollout,
)

BINS = 40  # per-sandbox histogram of use as a fraction of its limit (for its high percentile)


class SimConfig(Section):
    """Cluster, run length and cost model; `workload` is the generator's. `burstrl sandbox sim` takes
    these keys from CONFIG files and `--key value` overrides (`--dry-run` prints them resolved)."""

    nodes: int = Field(8, gt=0)
    concurrency: float = Field(26.0, gt=0)  # rollouts wanting to run, per node
    duration_s: int = Field(3600, gt=0)
    warmup_s: int = Field(900, ge=0)  # figures count from here
    seed: int = 0
    node_cpu: float = Field(16.0, gt=0)
    node_mem_gib: float = Field(64.0, gt=0)
    reserved_cpu: float = Field(1.0, ge=0)  # system and kube reserved, daemonsets (log agent, node agent)
    reserved_mem_gib: float = Field(1.5, ge=0)
    eviction_threshold_gib: float = Field(0.5, ge=0)  # allocatable = capacity - reserved - threshold
    eviction_interval_s: int = Field(10, gt=0)
    pids_per_node: int = Field(32768, gt=0)
    pids_per_sandbox: int = Field(512, gt=0)
    cache_gb: float = Field(70.0, gt=0)  # layer cache per node (compressed bytes); with the image pool: image_affinity ~37%
    pull_mbps: float = Field(300.0, gt=0)
    zstd_mbps: float = Field(800.0, gt=0)  # unpack rates, MB/s of compressed input
    gzip_mbps: float = Field(120.0, gt=0)
    codec: Literal["zstd", "gzip"] = "zstd"
    create_s: float = Field(2.0, ge=0)  # a sandbox's start once its layers are there
    history_weight_s: float = Field(120.0, ge=0)  # seconds of the prior blended into a sandbox's own history
    percentile: float = Field(90.0, gt=0, le=100)
    report_interval_s: int = Field(5, gt=0)  # how often node agents report measured usage to the scheduler
    lookahead: int = Field(4, ge=0)  # waiting rollouts tried past one that fits nowhere
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)

    @model_validator(mode="after")
    def _runnable(self) -> SimConfig:
        """Reject settings the model cannot run (a clear message, not a numpy error)."""
        if not self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        kept_mem = self.reserved_mem_gib + self.eviction_threshold_gib
        if self.node_cpu <= self.reserved_cpu or self.node_mem_gib <= kept_mem:
            raise ValueError("reserved resources leave nothing allocatable")
        return self

    def but(self, **changes: Any) -> SimConfig:
        """A copy with `changes`, validated like the original (sweeps vary one key at a time)."""
        return SimConfig.model_validate({**self.model_dump(), **changes})


class SimLayerCache:
    """One node's LRU layer cache: digest -> (bytes, ready time); layers of running sandboxes are pinned."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.layers: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.pins: dict[str, int] = {}
        self.bytes = 0
        self.pull_free_at = 0.0  # pulls on a node go one after another

    def fetch(self, layers, now: float, pull_s_per_byte: float) -> tuple[float, bool, int]:
        """Pin the image's layers, pulling the missing ones: (ready time, image hit, bytes pulled)."""
        ready, hit, pulled = now, True, 0
        for layer in layers:
            if layer.digest in self.layers:
                size, at = self.layers[layer.digest]
                self.layers.move_to_end(layer.digest)
                hit = hit and at <= now
            else:
                start = max(now, self.pull_free_at)
                at = self.pull_free_at = start + layer.size * pull_s_per_byte
                self.layers[layer.digest] = (layer.size, at)
                self.bytes += layer.size
                hit, pulled = False, pulled + layer.size
            ready = max(ready, at)
            self.pins[layer.digest] = self.pins.get(layer.digest, 0) + 1
        self._evict()
        return ready, hit, pulled

    def release(self, layers) -> None:
        for layer in layers:
            self.pins[layer.digest] -= 1
            if not self.pins[layer.digest]:
                del self.pins[layer.digest]
        self._evict()

    def _evict(self) -> None:
        for digest in list(self.layers):
            if self.bytes <= self.capacity:
                return
            if digest not in self.pins:
                self.bytes -= self.layers.pop(digest)[0]

    def report(self) -> dict[str, int]:
        return {digest: size for digest, (size, _) in self.layers.items()}


class FleetPrior:
    """What the fleet measured per unit of limit, over every running sandbox-second: the prior of a new sandbox."""

    def __init__(self, start: Prior, weight: float = 3600.0) -> None:
        self.n = weight
        self.sums = {k: [u.mean * weight, (u.var + u.mean ** 2) * weight]
                     for k, u in (("cpu", start.cpu), ("mem", start.mem))}
        self.hist = {k: np.zeros(BINS) for k in ("cpu", "mem")}
        self.start = start

    def add(self, cpu: np.ndarray, mem: np.ndarray) -> None:
        self.n += len(cpu)
        for key, x in (("cpu", cpu), ("mem", mem)):
            self.sums[key][0] += float(x.sum())
            self.sums[key][1] += float((x * x).sum())
            self.hist[key] += np.bincount(_bins(x), minlength=BINS)

    def prior(self, percentile: float) -> Prior:
        out = {}
        for key in ("cpu", "mem"):
            mean = self.sums[key][0] / self.n
            var = max(0.0, self.sums[key][1] / self.n - mean * mean)
            hist = self.hist[key]
            high = _hist_percentile(hist, percentile) if hist.sum() > 0 else getattr(self.start, key).high
            out[key] = Usage(mean, var, high)
        return Prior(out["cpu"], out["mem"])


def _bins(frac: np.ndarray) -> np.ndarray:
    return np.minimum(BINS - 1, (np.maximum(frac, 0.0) * BINS).astype(int))


def _hist_percentile(hist: np.ndarray, percentile: float) -> float:
    cum = np.cumsum(hist)
    return float(np.searchsorted(cum, cum[-1] * percentile / 100.0) + 1) / BINS


def share_cpu(node_of: np.ndarray, want: np.ndarray, weight: np.ndarray, capacity: float, nodes: int) -> np.ndarray:
    """CPU each sandbox gets: shares in proportion to `weight` (requests), none past what it wants (<= limit).

    Water-filling: what a satisfied sandbox does not take is shared again among the others.
    """
    got = np.zeros_like(want)
    left = want.astype(np.float64)
    free = np.full(nodes, capacity)
    weight = np.maximum(weight, 1e-3)
    for _ in range(8):
        hungry = left > 1e-9
        wsum = np.bincount(node_of, weight * hungry, minlength=nodes)
        give = np.where(hungry, free[node_of] * weight / np.maximum(wsum[node_of], 1e-12), 0.0)
        give = np.minimum(give, left)
        got += give
        left -= give
        free = np.maximum(0.0, free - np.bincount(node_of, give, minlength=nodes))
        if not (hungry & (free[node_of] > 1e-6) & (left > 1e-9)).any():
            break
    return got


class Simulator:
    """One run: one policy, one seed, one load. `run()` returns the figures."""

    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.n = cfg.nodes
        self.slots = max(1, round(cfg.concurrency * cfg.nodes))
        self.alloc = Resources(cfg.node_cpu - cfg.reserved_cpu,
                               (cfg.node_mem_gib - cfg.reserved_mem_gib - cfg.eviction_threshold_gib) * GIB,
                               cfg.pids_per_node)
        self.mem_capacity = (cfg.node_mem_gib - cfg.reserved_mem_gib) * GIB
        unpack = cfg.zstd_mbps if cfg.codec == "zstd" else cfg.gzip_mbps
        self.pull_s_per_byte = 1 / (cfg.pull_mbps * 1e6) + 1 / (unpack * 1e6)
        self.caches = [SimLayerCache(cfg.cache_gb * 1e9) for _ in range(self.n)]
        self.fleet = FleetPrior(Prior())
        s = self.slots
        self.active = np.zeros(s, bool)
        self.node = np.zeros(s, int)
        self.start_at = np.zeros(s)
        self.pos = np.zeros(s)
        self.length = np.zeros(s, int)
        self.off = np.zeros(s, int)
        self.cpu_lim, self.mem_lim, self.cpu_req, self.mem_req = (np.zeros(s) for _ in range(4))
        self.cnt, self.cpu_s, self.cpu_q, self.mem_s, self.mem_q = (np.zeros(s) for _ in range(5))
        self.hist_cpu, self.hist_mem = np.zeros((s, BINS)), np.zeros((s, BINS))
        self.layers: list[tuple] = [()] * s
        self.names: list[str] = [""] * s
        self.views: list[NodeState] | None = None  # the scheduler's view, refreshed by the agents' reports
        self.viewed_at = -1
        self.image_layers: dict[int, tuple] = {}
        self.seen: set[int] = set()  # images started before anywhere: a later start of one could hit
        self.arena_cpu, self.arena_mem = np.zeros(1 << 16, np.float32), np.zeros(1 << 16, np.float32)
        self.arena_kind, self.arena_end = np.zeros(1 << 16, np.int8), 0
        self.pending: list[int] = []
        self.drawn: dict[int, SimRollout] = {}
        self.next_id = 0
        self.dirty = True
        self.m = {"evictions": 0, "oom_limit": 0, "oom_node": 0, "starts": 0, "hits": 0, "bytes_pulled": 0,
                  "bytes_wanted": 0, "first_seen": 0, "finished": 0, "demand": 0.0, "delivered": 0.0, "occupancy": 0.0,
                  "peak_mem_fill": 0.0}
        self.start_s: list[float] = []
        self.slowdown: list[float] = []

    def run(self) -> dict:
        for t in range(self.cfg.duration_s):
            while len(self.pending) + int(self.active.sum()) < self.slots:
                self.pending.append(self.next_id)
                self.next_id += 1
            if self.pending and self.dirty:
                self._schedule(t)
            self._step(t)
        return self._report()

    # placement -------------------------------------------------------------------------------

    def _schedule(self, t: int) -> None:
        prior = self.fleet.prior(self.cfg.percentile)
        if self.views is None or t - self.viewed_at >= self.cfg.report_interval_s:
            self.views = [self._node_state(i, prior) for i in range(self.n)]
            self.viewed_at = t
        failures = 0
        for rid in list(self.pending):
            if rid not in self.drawn:
                self.drawn[rid] = make_rollout(self.cfg.workload, self.cfg.seed, rid)
            rollout = self.drawn[rid]
            if rollout.image not in self.image_layers:
                self.image_layers[rollout.image] = image_layers(self.cfg.workload, rollout.image)
            layers = self.image_layers[rollout.image]
            limits = Resources(rollout.cpu_limit, rollout.mem_limit, self.cfg.pids_per_sandbox)
            request = SandboxRequest(f"r{rid}", layers, limits, prior)
            node = self.policy.choose(self.views, request)
            if node is None:
                failures += 1
                if failures > self.cfg.lookahead:  # a short look-ahead past rollouts that fit nowhere
                    break
                continue
            i = int(node.name)
            requests = self.policy.requests(request)
            self._place(t, i, rollout, request, requests)
            self.pending.remove(rid)
            del self.drawn[rid]
            node.sandboxes.append(PlacedSandbox(request.name, requests, limits, prior.cpu.scaled(limits.cpu),
                                                prior.mem.scaled(limits.mem)))
            node.layers = self.caches[i].report()
        self.dirty = False

    def _node_state(self, i: int, prior: Prior) -> NodeState:
        slots = np.nonzero(self.active & (self.node == i))[0]
        cpu = self._usage(slots, self.cpu_lim, self.cpu_s, self.cpu_q, self.hist_cpu, prior.cpu)
        mem = self._usage(slots, self.mem_lim, self.mem_s, self.mem_q, self.hist_mem, prior.mem)
        pids = self.cfg.pids_per_sandbox
        sandboxes = [PlacedSandbox(self.names[s], Resources(self.cpu_req[s], self.mem_req[s], pids),
                                   Resources(self.cpu_lim[s], self.mem_lim[s], pids), c, m)
                     for s, c, m in zip(slots, cpu, mem, strict=False)]
        return NodeState(str(i), self.alloc, sandboxes, self.caches[i].report())

    def _usage(self, slots, lim, sums, squares, hist, prior: Usage) -> list[Usage]:
        """Each sandbox's own history blended with `history_weight_s` seconds of the prior (young ones lean on it)."""
        k, n, lim = self.cfg.history_weight_s, self.cnt[slots], lim[slots]
        mean = (sums[slots] + k * prior.mean * lim) / (n + k)
        ex2 = (squares[slots] + k * (prior.var + prior.mean ** 2) * lim * lim) / (n + k)
        var = np.maximum(0.0, ex2 - mean * mean)
        cum = np.cumsum(hist[slots], axis=1)
        own = ((cum >= cum[:, -1:] * self.cfg.percentile / 100.0).argmax(axis=1) + 1) / BINS * lim
        high = (n * own + k * prior.high * lim) / (n + k)
        return [Usage(float(a), float(b), float(c)) for a, b, c in zip(mean, var, high, strict=False)]

    def _place(self, t: int, i: int, rollout: SimRollout, request: SandboxRequest, requests: Resources) -> None:
        s = int(np.argmin(self.active))
        ready, hit, pulled = self.caches[i].fetch(request.layers, t, self.pull_s_per_byte)
        start = ready - t + self.cfg.create_s
        size = len(rollout.cpu)
        self._grow(size)
        a, b = self.arena_end, self.arena_end + size
        self.arena_cpu[a:b], self.arena_mem[a:b], self.arena_kind[a:b] = rollout.cpu, rollout.mem, rollout.kind
        self.arena_end = b
        first = rollout.image not in self.seen
        self.seen.add(rollout.image)
        self.active[s], self.node[s], self.start_at[s], self.pos[s] = True, i, t + start, 0.0
        self.length[s], self.off[s], self.layers[s], self.names[s] = size, a, request.layers, request.name
        self.cpu_lim[s], self.mem_lim[s] = rollout.cpu_limit, rollout.mem_limit
        self.cpu_req[s], self.mem_req[s] = requests.cpu, requests.mem
        self.cnt[s] = self.cpu_s[s] = self.cpu_q[s] = self.mem_s[s] = self.mem_q[s] = 0.0
        self.hist_cpu[s], self.hist_mem[s] = 0.0, 0.0
        if t >= self.cfg.warmup_s:
            self.m["starts"] += 1
            self.m["first_seen"] += int(first)
            self.m["hits"] += int(hit)
            self.m["bytes_pulled"] += pulled
            self.m["bytes_wanted"] += request.image_bytes
            self.start_s.append(start)

    def _grow(self, size: int) -> None:
        while self.arena_end + size > len(self.arena_cpu):
            self.arena_cpu = np.concatenate([self.arena_cpu, np.zeros_like(self.arena_cpu)])
            self.arena_mem = np.concatenate([self.arena_mem, np.zeros_like(self.arena_mem)])
            self.arena_kind = np.concatenate([self.arena_kind, np.zeros_like(self.arena_kind)])

    # one second of the cluster ------------------------------------------------------------------

    def _step(self, t: int) -> None:
        counting = t >= self.cfg.warmup_s
        if counting:
            self.m["occupancy"] += float(self.active.sum())
        idx = np.nonzero(self.active & (self.start_at <= t))[0]
        if not idx.size:
            return
        p = self.off[idx] + self.pos[idx].astype(int)
        want = self.arena_cpu[p] * self.cpu_lim[idx]
        mem = self.arena_mem[p] * self.mem_lim[idx]
        got = share_cpu(self.node[idx], want, self.cpu_req[idx], self.alloc.cpu, self.n)
        busy = self.arena_kind[p] != GEN
        self.pos[idx] += np.where(busy & (want > 0), got / np.maximum(want, 1e-12), 1.0)
        if counting:
            self.m["demand"] += float(want.sum())
            self.m["delivered"] += float(got.sum())
        self._measure(idx, got, mem)
        self._memory(t, idx, mem)
        done = idx[self.active[idx] & (self.pos[idx] >= self.length[idx])]
        for s in done:
            if counting:
                self.m["finished"] += 1
                self.slowdown.append((t + 1 - self.start_at[s]) / self.length[s])
            self._end(int(s))

    def _measure(self, idx: np.ndarray, got: np.ndarray, mem: np.ndarray) -> None:
        """What a node agent reads from cgroups each second: used CPU and memory, per sandbox."""
        cpu_frac, mem_frac = got / self.cpu_lim[idx], mem / self.mem_lim[idx]
        self.cnt[idx] += 1
        self.cpu_s[idx] += got
        self.cpu_q[idx] += got * got
        self.mem_s[idx] += mem
        self.mem_q[idx] += mem * mem
        self.hist_cpu[idx, _bins(cpu_frac)] += 1
        self.hist_mem[idx, _bins(mem_frac)] += 1
        self.fleet.add(cpu_frac, mem_frac)

    def _memory(self, t: int, idx: np.ndarray, mem: np.ndarray) -> None:
        """OOM kills above a sandbox's limit or the node's capacity; kubelet evictions above allocatable."""
        for s in idx[mem > self.mem_lim[idx]]:
            self._kill(t, int(s), "oom_limit")
        live = self.active[idx]
        idx, mem = idx[live], mem[live]
        per_node = np.bincount(self.node[idx], mem, minlength=self.n)
        if t >= self.cfg.warmup_s:
            self.m["peak_mem_fill"] = max(self.m["peak_mem_fill"], float(per_node.max()) / self.alloc.mem)
        check_evictions = t % self.cfg.eviction_interval_s == 0
        for i in np.nonzero(per_node > (self.alloc.mem if check_evictions else self.mem_capacity))[0]:
            on = idx[self.node[idx] == i]
            use = mem[self.node[idx] == i]
            if per_node[i] > self.mem_capacity:  # the kernel acts first: the largest goes
                order, reason, limit = np.argsort(-use), "oom_node", self.mem_capacity
            else:  # kubelet: most above its request first
                order, reason, limit = np.argsort(-(use - self.mem_req[on])), "evictions", self.alloc.mem
            total = per_node[i]
            for j in order:
                if total <= limit:
                    break
                total -= use[j]
                self._kill(t, int(on[j]), reason)

    def _kill(self, t: int, s: int, reason: str) -> None:
        if t >= self.cfg.warmup_s:
            self.m[reason] += 1
        self._end(s)

    def _end(self, s: int) -> None:
        self.active[s] = False
        self.caches[self.node[s]].release(self.layers[s])
        self.layers[s] = ()
        if self.views is not None:  # the agent reports a closed sandbox at once
            view = self.views[self.node[s]]
            view.sandboxes = [x for x in view.sandboxes if x.name != self.names[s]]
        self.dirty = True

    def _report(self) -> dict:
        m, cfg = self.m, self.cfg
        ticks = cfg.duration_s - cfg.warmup_s
        starts = np.array(self.start_s) if self.start_s else np.zeros(1)
        slow = np.array(self.slowdown) if self.slowdown else np.ones(1)
        return {
            "policy": self.policy.name, "seed": cfg.seed, "concurrency": cfg.concurrency,
            "density": round(m["occupancy"] / ticks / self.n, 3),
            "evictions": m["evictions"], "oom_limit": m["oom_limit"], "oom_node": m["oom_node"],
            "starts": m["starts"], "finished": m["finished"],
            "rollouts_per_node_h": round(m["finished"] / self.n / (ticks / 3600), 2),
            "image_hit_rate": round(m["hits"] / max(1, m["starts"]), 4),
            "hit_rate_bound": round(1 - m["first_seen"] / max(1, m["starts"]), 4),
            "byte_hit_rate": round(1 - m["bytes_pulled"] / max(1, m["bytes_wanted"]), 4),
            "start_p50_s": round(float(np.percentile(starts, 50)), 2),
            "start_p99_s": round(float(np.percentile(starts, 99)), 2),
            "cpu_throttled": round(1 - m["delivered"] / max(1e-9, m["demand"]), 4),
            "cpu_util": round(m["delivered"] / ticks / self.n / self.alloc.cpu, 4),
            "slowdown_mean": round(float(slow.mean()), 4),
            "slowdown_p99": round(float(np.percentile(slow, 99)), 4),
            "peak_mem_fill": round(m["peak_mem_fill"], 4),
            "waiting_at_end": len(self.pending),
        }


def simulate(cfg: SimConfig, policy: Policy) -> dict:
    """Run one policy on one seed and load; the figures as a dict (see `Simulator._report`)."""
    return Simulator(cfg, policy).run()


def config_dict(cfg: SimConfig) -> dict:
    return cfg.model_dump(mode="json")


# sweeps: the benchmark's and the CLI's figures -------------------------------------------------

def run_seeds(cfg: SimConfig, policy: str, options: dict, seeds: list[int]) -> dict:
    """One policy at one load over several seeds: the mean of every figure, and whether all were clean."""
    runs = [simulate(cfg.but(seed=seed), make_policy(policy, **options)) for seed in seeds]
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k != "seed"]
    out = {k: round(float(np.mean([r[k] for r in runs])), 4) for k in keys}
    out["policy"], out["seeds"] = policy, list(seeds)
    out["clean"] = all(r["evictions"] == 0 and r["oom_limit"] == 0 and r["oom_node"] == 0 for r in runs)
    out["evictions"] = sum(r["evictions"] for r in runs)
    out["ooms"] = sum(r["oom_limit"] + r["oom_node"] for r in runs)
    return out


def max_density(cfg: SimConfig, policy: str, options: dict, seeds: list[int], loads: list[float]) -> dict:
    """Highest sandboxes per node with 0 evictions and 0 OOM kills in every seed, sweeping the offered load.

    The sweep stops at the first load with an eviction or OOM kill, or once density stops rising
    (the policy admits no more: the rest wait).
    """
    best, sweep, previous = None, [], None
    for load in sorted(loads):
        point = run_seeds(cfg.but(concurrency=load), policy, options, seeds)
        sweep.append({k: point[k] for k in ("concurrency", "density", "clean", "evictions", "ooms", "slowdown_mean")})
        if not point["clean"]:
            break
        if best is None or point["density"] > best["density"]:
            best = point
        if previous is not None and point["density"] < previous + 0.25:
            break
        previous = point["density"]
    return {"max_density": best["density"] if best else 0.0, "at": best, "sweep": sweep}


def compare(cfg: SimConfig, policies: dict[str, dict], seeds: list[int], loads: list[float],
            equal_load: float | None = None) -> dict:
    """Every policy's max clean density, then every policy at one equal load (default: the reference's density)."""
    dens = {name: max_density(cfg, name, options, seeds, loads) for name, options in policies.items()}
    if equal_load is None:
        base = dens.get("reference") or next(iter(dens.values()))
        equal_load = float(np.floor(base["max_density"])) or cfg.concurrency
    equal = {name: run_seeds(cfg.but(concurrency=equal_load), name, options, seeds)
             for name, options in policies.items()}
    return {"max_density": dens, "equal_load": equal_load, "at_equal_load": equal}
