"""benchmarks/router_probes.py's tail recorder (benchmark-only code, tested here; pressure moves are main's code,
tested in test_router_relieve.py)."""

from __future__ import annotations

import sys

from burstrl.router.sim import PoolSpec, generate_trace, load_config, percentile
from tests.benchmark_modules import BENCHMARKS, load_benchmark


def probes():
    if str(BENCHMARKS) not in sys.path:  # it imports its sibling benchmarks by name
        sys.path.insert(0, str(BENCHMARKS))
    return load_benchmark("router_probes")


def tight_config():
    # 6 small replicas, sessions arriving fast: homes fill past half their KV within seconds
    return load_config(seed=3, sessions=80, arrival_rate=20.0, size_prior_tokens=4096,
                       pools=[PoolSpec("on_demand", 6, 1, 40_000)], release_finished=True)


def test_tail_records_every_call_and_its_p99_is_the_simulators() -> None:
    pr = probes()
    cfg = tight_config()
    trace = generate_trace(cfg)
    sim = pr.TailSimulator(cfg, trace, "least_requests")
    fig = sim.run()
    assert len(sim.calls) == sum(len(s.calls) for s in trace)
    assert not sim.started  # every started call was answered
    assert percentile(sorted(c[0] for c in sim.calls), 0.99) == fig["p99_call_s"]
    assert all(c[1] >= 0 and c[3] > 0 for c in sim.calls)
