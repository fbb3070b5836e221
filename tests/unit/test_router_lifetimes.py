"""benchmarks/router_lifetimes.py's occupancy peak (benchmark-only code, tested here)."""

from __future__ import annotations

import random
import sys

import numpy as np

from tests.benchmark_modules import BENCHMARKS, load_benchmark


def lifetimes():
    if str(BENCHMARKS) not in sys.path:  # it imports its sibling benchmarks by name
        sys.path.insert(0, str(BENCHMARKS))
    return load_benchmark("router_lifetimes")


def test_peak_is_the_largest_sum_just_before_a_session_ends() -> None:
    lt = lifetimes()
    # at t=10 the first (100 -> 300 by t=10) ends while the second is halfway (0 -> 400 by t=20): 500;
    # at t=20 only the second is left: 400
    ramps = [lt.Ramp(100.0, 300.0, 10.0), lt.Ramp(0.0, 400.0, 20.0)]
    assert lt.peak(ramps, now=0.0) == 500.0
    # a session that ends later than a big one ending early can make the peak its own
    assert lt.peak([lt.Ramp(0.0, 1000.0, 5.0), lt.Ramp(900.0, 900.0, 50.0)], now=0.0) == 1900.0
    assert lt.peak([], now=0.0) == 0.0


def test_the_vectorised_peaks_match_the_plain_one_per_scenario() -> None:
    lt = lifetimes()
    rng = random.Random(0)
    now = 7.0
    size_now = np.array([rng.uniform(0, 5000) for _ in range(6)])
    final = size_now + np.array([[rng.uniform(0, 20000) for _ in range(6)] for _ in range(4)])
    end = now + np.array([[rng.uniform(1, 300) for _ in range(6)] for _ in range(4)])
    fast = lt.sampled_peaks(size_now, final, end, now)
    for d in range(4):
        plain = lt.peak([lt.Ramp(float(size_now[i]), float(final[d, i]), float(end[d, i])) for i in range(6)], now)
        assert abs(fast[d] - plain) < 1e-6 * plain


def test_every_variant_places_every_session() -> None:
    lt = lifetimes()
    for variant in ("kv", *lt.VARIANTS):
        row = lt.job("uniform", 0, variant, 60, 5.0)
        assert row["variant"] == variant and row["sessions"] == 60 and 0.0 < row["hit_rate"] <= 1.0
