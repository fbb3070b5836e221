"""Which sandbox node takes a new sandbox: requests vs measured usage, and the image layers a node holds.

Why a module of pure functions: the same policy code must decide in the live scheduler (fed by
the node agents' reports) and in the cluster simulator (`sandbox/sim.py`), as the router's
policies do; so nothing here does I/O, keeps clocks or threads, and every input is a plain
dataclass a node agent can fill from its cgroup counters and its layer cache.

Three policies share one interface, `choose(nodes, request) -> NodeState | None`:

- `reference`: what the reference cluster runs: requests are fixed fractions of the limits (25% of
  the CPU limit, 40% of the memory limit), most-allocated bin packing, no image affinity.
  Density is bounded by those fixed requests (26 x 0.575 vCPU of a 2.3-vCPU mean is 15 of 16).
- `image_affinity`: the same requests and packing plus a score for the bytes of the image's
  layers already cached on the node.
- `ours`: requests come from measured usage (the fleet's mean use per unit of limit), packing by
  them, plus cached layer bytes, minus the overflow risk from a usage-peak predictor; a node
  admits a sandbox only while the predicted peak of its memory (incompressible: past it come
  evictions and OOM kills) and of its CPU stays within allocatable.

The predictor follows "Take it to the Limit" (Bashir et al., EuroSys '21): the peak of a node's
summed usage is the max of a normal bound over the sum (sum of means + N x sqrt(sum of
variances)) and the sum of each sandbox's own high percentile, applied to the sandboxes running
on the node plus the candidate's prior (its expected use before it has any history).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

GIB = 1 << 30


@dataclass(frozen=True)
class Resources:
    """CPU in vCPU, memory in bytes, pids as a count."""

    cpu: float = 0.0
    mem: float = 0.0
    pids: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.cpu + other.cpu, self.mem + other.mem, self.pids + other.pids)

    def fits_in(self, other: Resources) -> bool:
        return self.cpu <= other.cpu + 1e-9 and self.mem <= other.mem + 1e-9 and self.pids <= other.pids


@dataclass(frozen=True)
class Layer:
    """One image layer: content digest and compressed size in bytes (what a pull moves)."""

    digest: str
    size: int


@dataclass(frozen=True)
class Usage:
    """Measured use of one resource by one sandbox (vCPU or bytes): mean, variance and a high percentile.

    A node agent computes it from its cgroup samples (`Usage.of`); the simulator from running sums.
    """

    mean: float = 0.0
    var: float = 0.0
    high: float = 0.0

    @staticmethod
    def of(samples: Sequence[float], percentile: float = 90.0) -> Usage:
        if not samples:
            return Usage()
        ordered = sorted(samples)
        mean = sum(ordered) / len(ordered)
        var = sum((x - mean) ** 2 for x in ordered) / len(ordered)
        high = ordered[min(len(ordered) - 1, int(len(ordered) * percentile / 100.0))]
        return Usage(mean, var, high)

    def scaled(self, factor: float) -> Usage:
        return Usage(self.mean * factor, self.var * factor * factor, self.high * factor)


@dataclass(frozen=True)
class Prior:
    """Expected use per unit of limit (fractions) of a sandbox with no history yet, for CPU and memory.

    Defaults are the reference workload's figures (CPU mean 20% of the limit, memory mean 5%); a
    live scheduler replaces them with what the fleet measured for the same image or task kind.
    """

    cpu: Usage = Usage(0.20, 0.09, 0.60)
    mem: Usage = Usage(0.05, 0.02, 0.10)


@dataclass(frozen=True)
class SandboxRequest:
    """A sandbox to place: its image's layers and its limits (and what it is expected to use)."""

    name: str
    layers: tuple[Layer, ...]
    limits: Resources
    prior: Prior = Prior()

    @property
    def image_bytes(self) -> int:
        return sum(layer.size for layer in self.layers)


@dataclass(frozen=True)
class PlacedSandbox:
    """A sandbox running on a node: what it reserved, its limits, and its measured use so far."""

    name: str
    requests: Resources
    limits: Resources
    cpu: Usage
    mem: Usage


@dataclass
class NodeState:
    """What a node agent reports: allocatable resources, its sandboxes, and the layers it has cached."""

    name: str
    allocatable: Resources
    sandboxes: list[PlacedSandbox] = field(default_factory=list)
    layers: dict[str, int] = field(default_factory=dict)  # digest -> bytes cached on the node

    def requested(self) -> Resources:
        return Resources(sum(s.requests.cpu for s in self.sandboxes), sum(s.requests.mem for s in self.sandboxes),
                         sum(s.requests.pids for s in self.sandboxes))

    def limited(self) -> Resources:
        return Resources(sum(s.limits.cpu for s in self.sandboxes), sum(s.limits.mem for s in self.sandboxes),
                         sum(s.limits.pids for s in self.sandboxes))

    def cached_bytes(self, request: SandboxRequest) -> int:
        return sum(layer.size for layer in request.layers if layer.digest in self.layers)


def predict_peak(usages: Sequence[Usage], sigmas: float, percentiles: bool = True) -> float:
    """Peak of the summed use: max(sum of means + sigmas x sqrt(sum of variances), sum of high percentiles).

    Why the max of both: the normal bound is tight when many independent sandboxes add up, but
    it underestimates a node of a few heavy-tailed ones, where the sum of their own percentiles
    is the safer bound ("Take it to the Limit", EuroSys '21, found max(N-sigma, RC-like) best).
    `percentiles=False` keeps the normal bound only (for CPU, where a peak past it throttles
    rather than kills, and bursty sandboxes' own percentiles sit near their limits).
    """
    mean = sum(u.mean for u in usages)
    var = sum(u.var for u in usages)
    normal = mean + sigmas * math.sqrt(var)
    return max(normal, sum(u.high for u in usages)) if percentiles else normal


def packing_score(used: Resources, allocatable: Resources) -> float:
    """Most-allocated score in [0, 1]: the mean fill of CPU and memory (kube's MostAllocated)."""
    cpu = used.cpu / allocatable.cpu if allocatable.cpu > 0 else 1.0
    mem = used.mem / allocatable.mem if allocatable.mem > 0 else 1.0
    return (min(cpu, 1.0) + min(mem, 1.0)) / 2.0


def cache_score(node: NodeState, request: SandboxRequest) -> float:
    """Share of the image's bytes already cached on the node, in [0, 1]."""
    total = request.image_bytes
    return node.cached_bytes(request) / total if total > 0 else 1.0


class Policy(Protocol):
    name: str

    def requests(self, request: SandboxRequest) -> Resources:
        """What the sandbox reserves on its node once placed."""
        ...

    def choose(self, nodes: Sequence[NodeState], request: SandboxRequest) -> NodeState | None:
        """The node to place the sandbox on, or None when no node admits it (it waits)."""
        ...


def _choose(policy, nodes: Sequence[NodeState], request: SandboxRequest) -> NodeState | None:
    """The admitting node of highest score; ties go to the earlier node (deterministic in sim and live)."""
    best, best_score = None, -math.inf
    for node in nodes:
        score = policy.evaluate(node, request)
        if score is not None and score > best_score + 1e-12:
            best, best_score = node, score
    return best


@dataclass
class ReferencePolicy:
    """Fixed request ratios, most-allocated packing, no image affinity (the reference cluster)."""

    cpu_request_ratio: float = 0.25
    mem_request_ratio: float = 0.40
    name: str = "reference"

    def requests(self, request: SandboxRequest) -> Resources:
        lim = request.limits
        return Resources(lim.cpu * self.cpu_request_ratio, lim.mem * self.mem_request_ratio, lim.pids)

    def evaluate(self, node: NodeState, request: SandboxRequest) -> float | None:
        """The node's score for the request, or None when its requests would pass allocatable."""
        used = node.requested() + self.requests(request)
        if not used.fits_in(node.allocatable):
            return None
        return packing_score(used, node.allocatable)

    def choose(self, nodes: Sequence[NodeState], request: SandboxRequest) -> NodeState | None:
        return _choose(self, nodes, request)


@dataclass
class ImageAffinityPolicy(ReferencePolicy):
    """The reference requests and packing, plus `cache_weight` x the share of the image's bytes cached."""

    cache_weight: float = 1.0
    name: str = "image_affinity"

    def evaluate(self, node: NodeState, request: SandboxRequest) -> float | None:
        packing = super().evaluate(node, request)
        return None if packing is None else packing + self.cache_weight * cache_score(node, request)


@dataclass
class OursPolicy:
    """Requests from measured usage, cached layer bytes + packing - overflow risk, admission by predicted peak.

    - requests: the prior's mean use (what the fleet measured per unit of limit), never below
      `min_request_ratio` of the limit, so that CPU shares stay proportional to real use;
    - admission: requests within allocatable, AND the predicted peak of memory (`mem_sigmas`, and the
      sum of high percentiles: memory is incompressible) and of CPU (`cpu_sigmas`, the normal bound
      only: CPU past it throttles, it does not kill) over the node's sandboxes plus the candidate's
      prior within allocatable;
    - score: `cache_weight` x cached share + packing by requests - `risk_weight` x the predicted
      peak's fill (a node close to its predicted limit is a worse home than an equally packed calm one).

    Why `cpu_sigmas` is as low as 0.25: rollouts idle most of their wall time while the model
    generates, so CPU throttled in their test bursts slows them little; in the simulator, rollouts
    finished per node-hour keep rising down to 0 sigmas, and 0.25 keeps the p99 rollout slowdown near
    1.25 (docs/benchmarks.md, "Sandboxes and placement" and "sandbox_sim.py", has the figures).
    """

    cache_weight: float = 1.0
    risk_weight: float = 1.0
    cpu_sigmas: float = 0.25
    mem_sigmas: float = 4.0
    min_request_ratio: float = 0.05
    name: str = "ours"

    def requests(self, request: SandboxRequest) -> Resources:
        lim, prior = request.limits, request.prior
        cpu = max(prior.cpu.mean, self.min_request_ratio) * lim.cpu
        mem = max(prior.mem.mean, self.min_request_ratio) * lim.mem
        return Resources(min(cpu, lim.cpu), min(mem, lim.mem), lim.pids)

    def predicted(self, node: NodeState, request: SandboxRequest) -> tuple[float, float]:
        """Predicted (CPU, memory) peak of the node with the candidate added."""
        lim = request.limits
        cpu = [s.cpu for s in node.sandboxes] + [request.prior.cpu.scaled(lim.cpu)]
        mem = [s.mem for s in node.sandboxes] + [request.prior.mem.scaled(lim.mem)]
        return predict_peak(cpu, self.cpu_sigmas, percentiles=False), predict_peak(mem, self.mem_sigmas)

    def evaluate(self, node: NodeState, request: SandboxRequest) -> float | None:
        """None past allocatable (requests, or the predicted peak); else cache + packing - risk."""
        used, alloc = node.requested() + self.requests(request), node.allocatable
        if not used.fits_in(alloc):
            return None
        cpu, mem = self.predicted(node, request)
        if cpu > alloc.cpu or mem > alloc.mem:
            return None
        risk = max(cpu / alloc.cpu, mem / alloc.mem)
        return self.cache_weight * cache_score(node, request) + packing_score(used, alloc) - self.risk_weight * risk

    def choose(self, nodes: Sequence[NodeState], request: SandboxRequest) -> NodeState | None:
        return _choose(self, nodes, request)


POLICY_NAMES = ("reference", "image_affinity", "ours")


def make_policy(name: str, **options: float) -> Policy:
    """A policy by name; `options` set its fields (e.g. `cpu_sigmas=1.0`); unknown names or options raise ValueError."""
    classes = {"reference": ReferencePolicy, "image_affinity": ImageAffinityPolicy, "ours": OursPolicy}
    if name not in classes:
        raise ValueError(f"unknown placement policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    try:
        return classes[name](**options)
    except TypeError as exc:
        raise ValueError(f"policy {name}: {exc}") from None
