"""Trace-driven discrete-event simulation of replicas serving agentic rollouts under a placement policy.

Why a simulator: whether a policy keeps sessions' KV caches hit near saturation depends on fleet
shape, session sizes and load, which a unit test on constructed states cannot show and a live
fleet is too costly to sweep. Every policy runs on the same generated (or replayed) trace.

Model: the KV cache of a replica is a set of fixed-size blocks (hash per block, as in a prefix
cache) with a token budget; a session's context is a chain of blocks, so a call whose session was
evicted re-prefills its whole context (a cache miss). Two eviction models (`eviction`): `block`,
LRU over blocks not used by a running call, earlier blocks of a chain kept more recent than later
ones so LRU trims a context from its tail (vLLM's and SGLang's prefix caches); `session`, LRU over
idle sessions, each evicted whole (burstrl's replica, `inference/kvcache.py`; a block shared by
sessions is held once and belongs to the session that used it last, where burstrl's replica
copies a shared prefix into each session). A call costs prefill (per token not in cache) plus
decode steps whose time grows with the batch; a replica of weight w prefills w times faster,
decodes a batch w times cheaper and runs w times more concurrent sequences. Load figures the policy sees are refreshed by
a scrape every `scrape_interval_s` (stale in between, as in a real router).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from burstrl.config.loading import Section, read_config_file, validate
from burstrl.router.catalog import make_policy
from burstrl.router.policies import (
    NewSession,
    ReplicaView,
    SizeModel,
    live_projection,
    record_assignment,
)


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class TaskKind:
    """One kind of rollout; token counts are means of exponential draws (heterogeneous lengths)."""

    name: str = "swe"
    share: float = 1.0
    calls_min: int = 8
    calls_max: int = 30
    prompt_tokens: int = 3000
    tool_tokens: int = 600  # tool output appended before each later call
    output_tokens: int = 250  # generated per call
    tool_time_s: float = 3.0  # mean gap between calls


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class PoolSpec:
    pool: str = "on_demand"
    count: int = Field(1, ge=0)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    capacity_tokens: int = Field(200_000, gt=0)


class RouterSimConfig(Section):
    """`burstrl route sim`: trace generator, fleet and cost model; set from TOML/JSON files and
    `--key value` overrides like every burstrl config (lists of tables as JSON, e.g. `--pools '[...]'`)."""

    seed: int = Field(0, description="Seed of the generated trace and of the policies' sampling.")
    sessions: int = Field(400, ge=1, description="Sessions in the generated trace.")
    arrival_rate: float = Field(4.0, gt=0, allow_inf_nan=False, description="New sessions per second (Poisson).")
    block_size: int = Field(256, ge=1, description="Tokens per KV block (hash per block, as a prefix cache).")
    kinds: list[TaskKind] = Field(default_factory=lambda: [
        TaskKind(),
        TaskKind(name="math", share=0.5, calls_min=1, calls_max=4, prompt_tokens=800, tool_tokens=200,
                 output_tokens=600, tool_time_s=1.0)], description="Kinds of rollout and their shares.")
    pools: list[PoolSpec] = Field(default_factory=lambda: [
        PoolSpec(pool="reserved", count=2, weight=8, capacity_tokens=1_600_000),
        PoolSpec(pool="on_demand", count=8, weight=1, capacity_tokens=200_000)],
        min_length=1, description="The fleet: replicas per pool, their weight and KV capacity in tokens.")
    prefill_s_per_token: float = Field(1 / 20000, ge=0, description="Prefill seconds per uncached token.")
    decode_base_s: float = Field(0.02, ge=0, description="Seconds of one decode step of a batch.")
    decode_per_seq_s: float = Field(0.0005, ge=0, description="Extra seconds per sequence in the batch.")
    max_seqs: int = Field(32, ge=1, description="Concurrent sequences per unit of weight.")
    scrape_interval_s: float = Field(2.0, gt=0, description="Seconds between the router's load scrapes.")
    thrash_window_s: float = Field(60.0, gt=0, description="An eviction re-filled within this window thrashes.")
    size_prior_tokens: int = Field(8192, ge=1, description="Projected session size before any has finished.")
    eviction: Literal["block", "session"] = Field("block", description=(
        "What a full cache evicts: least recently used blocks, trimming a context from its tail (vLLM, SGLang), "
        "or least recently used idle sessions, whole (burstrl's replica)."))
    group_size: int = Field(1, ge=1, description=(
        "Sessions per GRPO group in the generated trace: a group arrives at once and its sessions share the "
        "first prompt (its blocks); sessions per second stay `arrival_rate`."))
    release_finished: bool = Field(False, description=(
        "Free a session's blocks when its last call ends, as the orchestrator releases a finished rollout "
        "(DELETE /v1/traces); off: they stay in the LRU (chat traffic, where later requests reuse them)."))

    @model_validator(mode="after")
    def _some_replica(self) -> RouterSimConfig:
        if sum(p.count for p in self.pools) < 1:
            raise ValueError("pools must hold at least one replica (every count is 0)")
        return self


def load_config(path: str | Path | None = None, **overrides: object) -> RouterSimConfig:
    """Defaults, then a TOML or JSON file (by suffix), then keyword overrides; unknown keys are errors."""
    data = read_config_file(path) if path is not None else {}
    return validate(RouterSimConfig, {**data, **overrides})


@dataclass
class Call:
    input_hashes: tuple[int, ...]
    output_hashes: tuple[int, ...]  # blocks the output adds to the context (empty: not kept)
    input_tokens: int
    output_tokens: int
    gap_after_s: float = 0.0
    not_before_s: float = 0.0  # a replayed turn arrives no earlier than its timestamp


@dataclass
class TraceSession:
    id: str
    kind: str
    arrival_s: float
    calls: list[Call]


def generate_trace(cfg: RouterSimConfig) -> list[TraceSession]:
    """Agentic rollouts: sessions of several calls whose context grows by tool output and replies."""
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    shares = [k.share for k in cfg.kinds]

    def blocks(mean_tokens: float) -> int:
        return max(1, round(rng.expovariate(bs / mean_tokens)))

    trace, t = [], 0.0
    for i in range(cfg.sessions):
        base = (i + 1) * 10_000_000  # block hashes of this session: base, base + 1, ...
        if i % cfg.group_size == 0:  # a new group (every session, without GRPO groups)
            t += rng.expovariate(cfg.arrival_rate / cfg.group_size)
            kind = rng.choices(cfg.kinds, weights=shares)[0]
            shared, group_base = 0, base  # the group's first prompt: its blocks, its first hash
        ctx, calls = 0, []
        for c in range(rng.randint(kind.calls_min, kind.calls_max)):
            if c == 0:
                new = shared = shared or blocks(kind.prompt_tokens)
            else:
                new = blocks(kind.tool_tokens)
            out = blocks(kind.output_tokens)
            hashes = (*range(group_base, group_base + shared), *range(base + shared, base + ctx + new))
            calls.append(Call(hashes, tuple(range(base + ctx + new, base + ctx + new + out)),
                              (ctx + new) * bs, out * bs, rng.expovariate(1 / kind.tool_time_s)))
            ctx += new + out
        trace.append(TraceSession(f"s{i}", kind.name, t, calls))
    return trace


class SimReplica:
    """Simulated replica: block LRU cache with pinning, a FIFO of waiting calls, busy slots."""

    def __init__(self, view: ReplicaView, cfg: RouterSimConfig) -> None:
        self.view = view
        self.capacity_blocks = view.capacity_tokens // cfg.block_size
        self.slots = max(1, int(cfg.max_seqs * view.weight))
        self.cache: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.pinned: dict[int, int] = {}
        self.evicted_at: dict[int, float] = {}
        self.queue: deque[tuple[TraceSession, int]] = deque()
        self.running = 0
        self.live: dict[str, int] = {}  # session id -> context tokens now
        # eviction = "session": sessions by last use (oldest first) and the cached blocks each used last
        self.session_lru: OrderedDict[str, None] = OrderedDict()
        self.blocks_of: dict[str, set[int]] = {}
        self.owner: dict[int, str] = {}


def pin(r: SimReplica, hashes: list[int] | tuple[int, ...]) -> None:
    for h in hashes:
        r.pinned[h] = r.pinned.get(h, 0) + 1


def unpin(r: SimReplica, hashes: list[int] | tuple[int, ...]) -> None:
    for h in hashes:
        left = r.pinned[h] - 1
        if left:
            r.pinned[h] = left
        else:
            del r.pinned[h]


def own(r: SimReplica, session_id: str, blocks: tuple[int, ...]) -> None:
    """`session` eviction: the call's blocks now belong to its session, the most recently used one."""
    mine = r.blocks_of.setdefault(session_id, set())
    for h in blocks:
        before = r.owner.get(h)
        if before is not None and before != session_id:
            disown(r, h)
        r.owner[h] = session_id
        mine.add(h)
    r.session_lru[session_id] = None
    r.session_lru.move_to_end(session_id)


def disown(r: SimReplica, h: int) -> None:
    """A block left the cache (or changed hands): its session forgets it, and a session with none left goes."""
    session_id = r.owner.pop(h, None)
    if session_id is None:
        return
    mine = r.blocks_of[session_id]
    mine.discard(h)
    if not mine:
        del r.blocks_of[session_id]
        del r.session_lru[session_id]


def block_victims(r: SimReplica, need: int) -> list[int]:
    """The `need` least recently used blocks no running call holds."""
    victims = []
    for h in r.cache:  # oldest first
        if h not in r.pinned:
            victims.append(h)
            if len(victims) == need:
                break
    return victims


def session_victims(r: SimReplica, need: int) -> list[int]:
    """Whole idle sessions, least recently used first, until at least `need` blocks are freed."""
    victims: list[int] = []
    for session_id in r.session_lru:  # oldest first
        if len(victims) >= need:
            break
        blocks = r.blocks_of[session_id]
        if not any(h in r.pinned for h in blocks):  # a session with a running call is not idle
            victims.extend(blocks)
    if len(victims) < need:  # idle blocks of running sessions (a shared prefix's history): by block LRU
        taken = set(victims)
        victims += islice((h for h in r.cache if h not in r.pinned and h not in taken), need - len(victims))
    return victims


class RouterSimulator:
    """Runs one policy over one trace; `run()` returns the figures."""

    def __init__(self, cfg: RouterSimConfig, trace: list[TraceSession], policy_name: str, k: int = 2) -> None:
        self.cfg, self.trace = cfg, trace
        self.sizes = SizeModel(prior_tokens=cfg.size_prior_tokens)
        self.policy = make_policy(policy_name, k=k, sizes=self.sizes)
        self.rng = random.Random(cfg.seed + 1)
        self.replicas: list[SimReplica] = []
        for p in cfg.pools:
            for j in range(p.count):
                view = ReplicaView(f"{p.pool}-{j}", p.pool, p.weight, p.capacity_tokens, versions={"v1"})
                replica = SimReplica(view, cfg)
                view.cached_blocks = replica.cache  # the replica's block summary; here exact and live
                self.replicas.append(replica)
        self.views = [r.view for r in self.replicas]
        self.by_view = {id(r.view): r for r in self.replicas}
        self.home: dict[str, SimReplica] = {}
        self.past_homes: dict[str, list[SimReplica]] = {}  # every replica a re-homed session lived on
        self.kind_by_id = {s.id: s.kind for s in trace}
        self.events: list = []
        self.seq = 0
        self.seen: set[int] = set()
        self.stats = {"input_tokens": 0, "output_tokens": 0, "hit_tokens": 0, "reusable_tokens": 0, "evicted_tokens": 0,
                          "refill_tokens": 0, "thrash_tokens": 0, "rehomes": 0, "rehomes_pressure": 0}
        self.rollout_s: list[float] = []
        self.call_start: dict[tuple[str, int], float] = {}  # (session, call) -> when it reached its replica
        self.call_s: list[float] = []  # per call: queueing + prefill + decode
        self.live_fraction_sum = [0.0] * len(self.replicas)  # summed over scrapes, for the imbalance
        self.fleet_live: list[float] = []  # live tokens / fleet capacity at each scrape
        self.total_capacity = sum(r.view.capacity_tokens for r in self.replicas)

    def push(self, t: float, what: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, what, payload))

    def run(self) -> dict:
        for s in self.trace:
            self.push(s.arrival_s, "arrive", s)
        self.push(0.0, "scrape", None)
        t = 0.0
        while self.events and len(self.rollout_s) < len(self.trace):
            t, _, what, payload = heapq.heappop(self.events)
            if what == "arrive":
                self.arrive(t, payload)
            elif what == "call":
                session, idx = payload
                self.enqueue(t, self.home_for_call(session, idx), session, idx)
            elif what == "done":
                self.done(t, *payload)
            elif what == "scrape":
                self.scrape()
                self.push(t + self.cfg.scrape_interval_s, "scrape", None)
        return self.report(t)

    def arrive(self, t: float, s: TraceSession) -> None:
        first = s.calls[0]
        session = NewSession(s.id, s.kind, "v1", expected_tokens=first.input_tokens, prefix_hashes=first.input_hashes,
                             block_tokens=self.cfg.block_size)
        view = self.policy.choose(session, self.views, self.rng)
        record_assignment(view, session)
        replica = self.by_view[id(view)]
        self.home[s.id] = replica
        replica.live[s.id] = 0
        self.enqueue(t, replica, s, 0)

    def home_for_call(self, s: TraceSession, idx: int) -> SimReplica:
        """The session's home, or a new one where the policy moves it (mirrors `Registry.place`).

        A re-homing policy (`kv`) moves a session whose context is gone from a home over its
        projected KV budget where its `rehome` finds it cheaper than staying, and a small session
        off a nearly full home before that (`relieve`); only to a replica the session never lived
        on (its earlier homes hold parts of its capture), else it stays.
        """
        home = self.home[s.id]
        call = s.calls[idx]
        if not getattr(self.policy, "rehomes", False) or not call.input_hashes:
            return home
        session = NewSession(s.id, s.kind, "v1", expected_tokens=call.input_tokens, prefix_hashes=call.input_hashes,
                             block_tokens=self.cfg.block_size)
        evicted = call.input_hashes[0] not in home.cache
        if evicted and live_projection(home.view, self.sizes) <= home.view.capacity_tokens:
            return home
        pressed = getattr(self.policy, "pressed", None)
        if not evicted and (pressed is None or not pressed(session, home.view)):
            return home
        past = self.past_homes.get(s.id, [home])
        others = [v for v in self.views if all(v is not r.view for r in past)]
        if not others:
            return home
        pick = self.policy.rehome if evicted else self.policy.relieve
        view = pick(session, home.view, others, self.rng)
        if view is None or view is home.view:
            return home
        record_assignment(view, session)
        new = self.by_view[id(view)]
        new.live[s.id] = home.live.pop(s.id)
        self.home[s.id] = new
        self.past_homes[s.id] = [*past, new]
        self.stats["rehomes"] += 1
        self.stats["rehomes_pressure"] += not evicted
        return new

    def enqueue(self, t: float, r: SimReplica, s: TraceSession, idx: int) -> None:
        """A call reaches its replica: the router counts it in flight until it is answered."""
        r.view.in_flight += 1
        self.call_start[(s.id, idx)] = t
        r.queue.append((s, idx))
        self.try_start(t, r)

    def try_start(self, t: float, r: SimReplica) -> None:
        while r.queue and r.running < r.slots:
            session, idx = r.queue[0]
            if not self.start(t, r, session, idx):
                return  # head of line waits for KV to free up
            r.queue.popleft()

    def start(self, t: float, r: SimReplica, s: TraceSession, idx: int) -> bool:
        call, bs = s.calls[idx], self.cfg.block_size
        blocks = call.input_hashes + call.output_hashes
        matched = 0
        for h in call.input_hashes:
            if h not in r.cache:
                break
            matched += 1
        reusable = 0
        for h in call.input_hashes:
            if h not in self.seen:
                break
            reusable += 1
        fits = len(blocks) <= r.capacity_blocks
        if fits:
            cached = [h for h in blocks if h in r.cache]
            pin(r, cached)  # the call's own cached blocks must not be evicted to make room for it
            new = [h for h in blocks if h not in r.cache]
            free = r.capacity_blocks - len(r.cache)
            if free + len(r.cache) - len(r.pinned) < len(new):
                unpin(r, cached)
                return False
            self.evict(t, r, len(new) - free)
            pin(r, new)
            for h in reversed(blocks):  # earlier blocks end most recent: LRU trims from the tail
                r.cache[h] = None
                r.cache.move_to_end(h)
            if self.cfg.eviction == "session":
                own(r, s.id, blocks)
        for h in call.input_hashes[matched:]:
            if h in r.evicted_at:
                self.stats["refill_tokens"] += bs
                if t - r.evicted_at.pop(h) <= self.cfg.thrash_window_s:
                    self.stats["thrash_tokens"] += bs
        self.seen.update(blocks)
        hit = min(matched * bs, call.input_tokens)
        self.stats["hit_tokens"] += hit
        self.stats["reusable_tokens"] += min(reusable * bs, call.input_tokens)
        self.stats["input_tokens"] += call.input_tokens
        self.stats["output_tokens"] += call.output_tokens
        r.running += 1
        w = r.view.weight
        step = self.cfg.decode_base_s + self.cfg.decode_per_seq_s * r.running / w
        duration = (call.input_tokens - hit) * self.cfg.prefill_s_per_token / w + call.output_tokens * step
        self.push(t + duration, "done", (r, s, idx, fits))
        return True

    def evict(self, t: float, r: SimReplica, need: int) -> None:
        if need <= 0:
            return
        victims = session_victims(r, need) if self.cfg.eviction == "session" else block_victims(r, need)
        for h in victims:
            del r.cache[h]
            disown(r, h)
            r.evicted_at[h] = t
        self.stats["evicted_tokens"] += len(victims) * self.cfg.block_size

    def done(self, t: float, r: SimReplica, s: TraceSession, idx: int, pinned: bool) -> None:
        call = s.calls[idx]
        r.running -= 1
        r.view.in_flight -= 1
        self.call_s.append(t - self.call_start.pop((s.id, idx)))
        if pinned:
            unpin(r, call.input_hashes + call.output_hashes)
        size = call.input_tokens + call.output_tokens
        if idx + 1 < len(s.calls):
            r.live[s.id] = size
            self.push(max(t + call.gap_after_s, s.calls[idx + 1].not_before_s), "call", (s, idx + 1))
        else:
            del r.live[s.id]
            self.sizes.observe(s.kind, size)
            if self.cfg.release_finished:
                self.release(r, call.input_hashes + call.output_hashes)
            self.rollout_s.append(t - s.arrival_s)
        self.try_start(t, r)

    def release(self, r: SimReplica, hashes: tuple[int, ...]) -> None:
        """Drop a finished session's blocks (not an eviction); blocks a running call still holds stay."""
        for h in hashes:
            if h in r.cache and h not in r.pinned:
                del r.cache[h]
                disown(r, h)

    def scrape(self) -> None:
        """Refresh the views as a load scrape would, and sample each replica's live KV fraction."""
        for i, r in enumerate(self.replicas):
            r.view.used_tokens = len(r.cache) * self.cfg.block_size
            r.view.live_sessions = dict(r.live)
            r.view.session_kinds = {sid: self.kind_by_id[sid] for sid in r.live}
            r.view.recent_assignments.clear()
            r.view.held_over.clear()
            r.view.running_requests = r.running + len(r.queue)
            self.live_fraction_sum[i] += sum(r.live.values()) / r.view.capacity_tokens
        self.fleet_live.append(sum(sum(r.live.values()) for r in self.replicas) / self.total_capacity)

    def report(self, t_end: float) -> dict:
        st, times = self.stats, sorted(self.rollout_s)
        mean_fraction = statistics.fmean(self.live_fraction_sum)
        # max over mean of each replica's time-averaged live KV fraction (1.0 = perfectly even)
        imbalance = max(self.live_fraction_sum) / mean_fraction if mean_fraction > 0 else 1.0
        makespan = max(t_end - self.trace[0].arrival_s, 1e-9) if self.trace else 1e-9
        return {
            "hit_rate": st["hit_tokens"] / max(st["reusable_tokens"], 1),
            "prefix_hit_rate": st["hit_tokens"] / max(st["input_tokens"], 1),
            "evicted_tokens": st["evicted_tokens"],
            "refill_tokens": st["refill_tokens"],
            "thrash_tokens": st["thrash_tokens"],
            "throughput_tok_s": (st["input_tokens"] + st["output_tokens"]) / makespan,
            "p50_rollout_s": percentile(times, 0.50),
            "p99_rollout_s": percentile(times, 0.99),
            "p50_call_s": percentile(sorted(self.call_s), 0.50),
            "p99_call_s": percentile(sorted(self.call_s), 0.99),
            "imbalance": imbalance,
            "makespan_s": makespan,
            "kv_live_mean": statistics.fmean(self.fleet_live) if self.fleet_live else 0.0,
            "kv_live_peak": max(self.fleet_live, default=0.0),
            "sessions": len(times),
            "rehomes": st["rehomes"],
            "rehomes_pressure": st["rehomes_pressure"],
        }


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list (0 for an empty one)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def simulate(cfg: RouterSimConfig, policies: list[str], k: int = 2,
             trace: list[TraceSession] | None = None) -> dict[str, dict]:
    """Run each policy on the same trace (generated from cfg.seed unless given); figures per policy."""
    trace = trace if trace is not None else generate_trace(cfg)
    return {name: RouterSimulator(cfg, trace, name, k=k).run() for name in policies}


def format_table(results: dict[str, dict]) -> str:
    """A plain-text table, one row per policy."""
    cols = [("hit_rate", "{:.4f}"), ("prefix_hit_rate", "{:.4f}"), ("evicted_tokens", "{:d}"),
            ("thrash_tokens", "{:d}"), ("throughput_tok_s", "{:.0f}"), ("p50_rollout_s", "{:.1f}"),
            ("p99_rollout_s", "{:.1f}"), ("imbalance", "{:.2f}")]
    rows = [["policy"] + [c for c, _ in cols]]
    for name, fig in results.items():
        rows.append([name] + [fmt.format(fig[c]) for c, fmt in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=False)) for row in rows)


def config_dict(cfg: RouterSimConfig) -> dict:
    """The config as plain data (for the benchmark's JSON line)."""
    return cfg.model_dump()
