"""The cluster simulator's workload: agent rollouts' CPU and memory over time, and the images they boot.

Why generated and fitted: no trace of per-sandbox usage is available here, so the generator is
fitted to the reference cluster's published figures (task CPU limits 1-8 vCPU with mean 2.3; CPU
use mean 20% / p99 100% of the limit; memory mean 5% / p99 87%) and to how an agent rollout
behaves: idle while the model generates, short commands, and bursts when tests run (some tests
use every core they may, a few use most of the memory). `fit()` measures what was generated, so
the benchmark shows how close the fit is.

Every rollout is drawn from its own seed (`seed`, index), so the trace is the same for every
policy and every load, whichever rollouts a run happens to consume.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from burstrl.config.loading import Section
from burstrl.sandbox.placement import GIB, Layer

GEN, CMD, TEST = 0, 1, 2


class WorkloadConfig(Section):
    """Fitted to the reference figures; every field can be overridden (`--workload.zipf 1.1`)."""

    cpu_limits: tuple[int, ...] = (1, 2, 4, 8)
    cpu_limit_probs: tuple[float, ...] = (0.42, 0.36, 0.15, 0.07)  # mean 2.30 vCPU
    mem_gib_per_cpu: float = 2.0
    duration_median_s: float = 480.0  # ideal length of a rollout (no throttling)
    duration_sigma: float = 0.6
    gen_mean_s: float = 12.0  # model generating: the sandbox idles
    cmd_mean_s: float = 4.0
    test_mean_s: float = 20.0
    test_share: float = 0.12  # of the agent's commands, the share that run tests
    gen_cpu: float = 0.03
    cmd_cpu: float = 0.40
    test_parallel_share: float = 0.50  # tests that use every core of the limit; others one core
    mem_base_median: float = 0.025
    heavy_test_share: float = 0.12  # tests that take most of the memory limit (75% to the max below)
    heavy_test_mem_max: float = 0.97  # > 1 makes some tests pass their limit (OOM kills)
    light_test_mem: float = 0.05
    images: int = 3000
    repos: int = 40
    zipf: float = 0.9  # popularity skew of the images (with `images` and the sim's cache size: image_affinity ~37%)


@dataclass
class SimRollout:
    """One rollout: its image and limits, and per-second CPU and memory fractions of its limits."""

    index: int
    image: int
    cpu_limit: float
    mem_limit: float
    cpu: np.ndarray  # fraction of the CPU limit wanted, one value per second of ideal progress
    mem: np.ndarray  # fraction of the memory limit used
    kind: np.ndarray  # GEN, CMD or TEST per second


def make_rollout(cfg: WorkloadConfig, seed: int, index: int) -> SimRollout:
    rng = np.random.default_rng([seed, index, 1])
    cpu_limit = float(rng.choice(cfg.cpu_limits, p=cfg.cpu_limit_probs))
    length = int(np.clip(rng.lognormal(np.log(cfg.duration_median_s), cfg.duration_sigma), 60, 4 * 3600))
    kinds, levels, mems = _phases(cfg, rng, length, cpu_limit)
    image = _zipf_pick(cfg, seed, rng)
    return SimRollout(index, image, cpu_limit, cpu_limit * cfg.mem_gib_per_cpu * GIB, levels, mems, kinds)


def _phases(cfg: WorkloadConfig, rng: np.random.Generator, length: int,
            cpu_limit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turns of (generate, command or test) until `length` seconds; per-second kind, CPU and memory."""
    turns = int(length / (cfg.gen_mean_s + cfg.cmd_mean_s)) * 2 + 4
    gen = np.maximum(1, rng.exponential(cfg.gen_mean_s, turns)).astype(int)
    is_test = rng.random(turns) < cfg.test_share
    work = np.maximum(1, np.where(is_test, rng.exponential(cfg.test_mean_s, turns),
                                  rng.exponential(cfg.cmd_mean_s, turns))).astype(int)
    parallel = rng.random(turns) < cfg.test_parallel_share
    test_cpu = np.where(parallel, 1.0, min(1.0, 1.0 / cpu_limit))
    cmd_cpu = np.clip(rng.normal(cfg.cmd_cpu, 0.15, turns), 0.05, 1.0)
    heavy = rng.random(turns) < cfg.heavy_test_share
    heavy_mem = rng.uniform(0.75, cfg.heavy_test_mem_max, turns)
    test_mem = np.where(heavy, heavy_mem, rng.exponential(cfg.light_test_mem, turns))
    base_mem = min(0.3, rng.lognormal(np.log(cfg.mem_base_median), 0.5))
    lens = np.stack([gen, work], axis=1).ravel()
    kind = np.stack([np.full(turns, GEN), np.where(is_test, TEST, CMD)], axis=1).ravel()
    cpu = np.stack([np.full(turns, cfg.gen_cpu), np.where(is_test, test_cpu, cmd_cpu)], axis=1).ravel()
    mem = np.stack([np.zeros(turns), np.where(is_test, test_mem, 0.0)], axis=1).ravel()
    kinds = np.repeat(kind, lens)[:length].astype(np.int8)
    cpus = np.repeat(cpu, lens)[:length].astype(np.float32)
    mems = np.minimum(cfg.heavy_test_mem_max, base_mem + np.repeat(mem, lens)[:length]).astype(np.float32)
    return kinds, cpus, mems


def _zipf_pick(cfg: WorkloadConfig, seed: int, rng: np.random.Generator) -> int:
    weights = 1.0 / np.arange(1, cfg.images + 1) ** cfg.zipf
    # a per-seed shuffle, so the popular images differ between seeds (and so their repos)
    order = np.random.default_rng([seed, 0, 2]).permutation(cfg.images)
    return int(order[rng.choice(cfg.images, p=weights / weights.sum())])


def image_layers(cfg: WorkloadConfig, image: int) -> tuple[Layer, ...]:
    """Layers of an image: a shared OS layer, one of 3 Python bases, its repo's environment, its own.

    Sizes are SWE-style compressed sizes: ~1.6 GB of shared bases, 1-2.5 GB per repo environment
    (shared by that repo's tasks), 0.1-0.6 GB per task.
    """
    rng = np.random.default_rng([image, 7])
    repo = int(rng.integers(cfg.repos))
    repo_rng = np.random.default_rng([repo, 11])
    python = repo % 3
    return (
        Layer("sha256:os", int(0.08e9)),
        Layer(f"sha256:python{python}", int(0.6e9)),
        Layer(f"sha256:repo{repo}", int(repo_rng.uniform(1.0e9, 2.5e9))),
        Layer(f"sha256:task{image}", int(rng.uniform(0.1e9, 0.6e9))),
    )


def fit(cfg: WorkloadConfig, seed: int = 0, rollouts: int = 400) -> dict[str, float]:
    """Measured figures of the generated workload, to set beside the reference figures."""
    drawn = [make_rollout(cfg, seed, i) for i in range(rollouts)]
    cpu = np.concatenate([r.cpu for r in drawn])
    mem = np.concatenate([r.mem for r in drawn])
    return {
        "cpu_limit_mean": float(np.mean([r.cpu_limit for r in drawn])),
        "cpu_use_mean": float(cpu.mean()), "cpu_use_p99": float(np.percentile(cpu, 99)),
        "mem_use_mean": float(mem.mean()), "mem_use_p99": float(np.percentile(mem, 99)),
        "test_time_share": float(np.mean(np.concatenate([r.kind for r in drawn]) == TEST)),
        "duration_mean_s": float(np.mean([len(r.cpu) for r in drawn])),
    }
