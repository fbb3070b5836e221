"""A soak of the router's session maps: a day of sessions through `Registry` on a simulated clock.

Why: the router hears when a session starts but not always when it ends (a crashed harness never
releases it), so its maps must be pruned from what the replicas report. This drives the real
`Registry` through hours of arrivals, releases, expiries and replica replacements in seconds and
samples the maps' sizes and traced memory, so "flat memory" is a measured figure, not a hope.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass


@dataclass
class SoakConfig:
    """A day of sessions through the router's `Registry` on a simulated clock (no sockets, no sleeps).

    Sessions arrive at `rate` per second, call every `call_gap_s` for an exponential lifetime, and
    end one of three ways: released (the orchestrator's DELETE: forgotten at once), left to expire
    on their replica after `replica_ttl_s`, or abandoned before their first call (never reported).
    Every `replace_every_s` a replica dies and a fresh one joins, so sessions re-home or are orphaned.
    """

    hours: float = 24.0
    rate: float = 10.0
    replicas: int = 16
    scrape_s: float = 10.0
    call_gap_s: float = 30.0
    lifetime_s: float = 120.0
    released: float = 0.9  # share of finished sessions released through the router (the rest crashed)
    abandoned: float = 0.05  # share of sessions assigned but never called
    replica_ttl_s: float = 1800.0
    grace_s: float = 1800.0
    max_sessions: int = 1_000_000
    replace_every_s: float = 3600.0
    samples: int = 24
    policy: str = "headroom"
    seed: int = 0


class RegistrySoak:
    """The replicas' side of the soak: which sessions each one reports live, and the session events."""

    def __init__(self, cfg: SoakConfig) -> None:
        from burstrl.router.registry import Registry

        self.cfg, self.now = cfg, 0.0
        self.rng = random.Random(cfg.seed)
        self.reg = Registry(cfg.policy, seed=cfg.seed, max_sessions=cfg.max_sessions, grace_s=cfg.grace_s,
                            clock=lambda: self.now)
        self.live: dict[str, dict[str, float]] = {}  # replica url -> session id -> reported until (inf: running)
        self.events: list[tuple[float, int, str, str]] = [(0.0, 0, "arrive", "")]  # (time, seq, what, session)
        self.kind: dict[str, str] = {}  # running sessions only
        self.seq = self.next_replica = self.sessions = 0
        for _ in range(cfg.replicas):
            self.add_replica()

    def add_replica(self) -> None:
        url = f"http://soak-{self.next_replica}:8000"
        self.next_replica += 1
        self.reg.add(url, capacity_tokens=2_000_000)
        self.live[url] = {}
        self.scrape(url)

    def replace_replica(self) -> None:
        url = self.rng.choice(sorted(self.live))
        self.reg.mark_dead(url)
        del self.live[url]
        self.add_replica()

    def scrape(self, url: str) -> None:
        live = self.live[url]
        for sid in [s for s, until in live.items() if until <= self.now]:
            del live[sid]  # expired on the replica
        sessions = [{"session_id": sid, "tokens": 1000} for sid in live]
        loads = {"num_used_tokens": 1000 * len(sessions), "max_total_num_tokens": 2_000_000, "sessions": sessions}
        self.reg.apply_scrape(url, loads, {"data": [{"id": "base"}]})

    def push(self, t: float, what: str, sid: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, what, sid))

    def call(self, sid: str) -> None:
        """One call: the registry places it, then the replica it went to holds the session."""
        self.live[self.reg.place(sid, "base", 0, self.kind[sid]).id][sid] = math.inf

    def arrive(self) -> None:
        self.push(self.now + self.rng.expovariate(self.cfg.rate), "arrive", "")
        sid, self.sessions = f"s{self.sessions}", self.sessions + 1
        kind = "swe" if self.rng.random() < 0.5 else "math"
        if self.rng.random() < self.cfg.abandoned:
            self.reg.place(sid, "base", 0, kind)  # `/v1/assign`, then the harness died
            return
        self.kind[sid] = kind
        self.call(sid)
        self.push(self.now + self.rng.expovariate(1 / self.cfg.lifetime_s), "end", sid)
        self.push(self.now + self.cfg.call_gap_s, "call", sid)

    def end(self, sid: str) -> None:
        del self.kind[sid]
        live = self.live.get(self.reg.homes.get(sid, ""))
        if live is None or sid not in live:
            return  # its replica died: no DELETE can reach it, the router prunes it after the grace
        if self.rng.random() < self.cfg.released:
            del live[sid]
            self.reg.forget(sid)  # what a successful DELETE through the router does
        else:
            live[sid] = self.now + self.cfg.replica_ttl_s  # idle on its replica until its TTL

    def step(self, until: float) -> None:
        """Run the events up to `until`, then scrape every replica and prune, as the router's loop does."""
        while self.events[0][0] <= until:
            self.now, _, what, sid = heapq.heappop(self.events)
            if what == "arrive":
                self.arrive()
            elif what == "end":
                self.end(sid)
            elif sid in self.kind:
                self.call(sid)
                self.push(self.now + self.cfg.call_gap_s, "call", sid)
        self.now = until
        for url in self.live:
            self.scrape(url)
        self.reg.prune()


def soak_registry(cfg: SoakConfig, trace_memory: bool = True) -> dict:
    """Run the soak; `samples` snapshots of the registry's map sizes (and traced memory, MiB)."""
    import tracemalloc

    if trace_memory:
        tracemalloc.start()
    soak, samples = RegistrySoak(cfg), []
    end_s, every = cfg.hours * 3600, cfg.hours * 3600 / cfg.samples
    t, next_sample, next_replace = 0.0, every, cfg.replace_every_s
    while t < end_s:
        t = min(end_s, t + cfg.scrape_s)
        soak.step(t)
        if t >= next_replace:
            soak.replace_replica()
            next_replace += cfg.replace_every_s
        if t >= next_sample or t >= end_s:
            mem = tracemalloc.get_traced_memory()[0] / 2**20 if trace_memory else 0.0
            samples.append({"hour": round(t / 3600, 3), "sessions_started": soak.sessions,
                            "pruned": soak.reg.counters.sessions_pruned, "rehomes": soak.reg.counters.rehomes,
                            "traced_mib": round(mem, 2), **soak.reg.map_sizes()})
            next_sample += every
    peak = tracemalloc.get_traced_memory()[1] / 2**20 if trace_memory else 0.0
    if trace_memory:
        tracemalloc.stop()
    return {"config": asdict(cfg), "samples": samples, "traced_peak_mib": round(peak, 2)}
