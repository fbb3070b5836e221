"""Pressure moves: `kv` sheds a small session off a nearly full home before the home evicts anything."""

import math

from burstrl.router.registry import Registry
from burstrl.router.sim import PoolSpec, RouterSimulator, generate_trace, load_config


def loads(*sessions, capacity=10_000):
    return {"num_used_tokens": 0, "max_total_num_tokens": capacity, "versions": ["base"],
            "sessions": [{"session_id": sid, "tokens": tokens} for sid, tokens in sessions]}


MODELS = {"object": "list", "data": [{"id": "base"}]}


def two_replicas(policy="kv"):
    reg = Registry(policy=policy, k=2, seed=0)
    for i in range(2):
        reg.add(f"http://10.0.0.{i}:8000")
        reg.apply_scrape(f"http://10.0.0.{i}:8000", loads(), MODELS)
    home = reg.place("s", "base", 500).id
    return reg, home, next(u for u in reg.replicas if u != home)


CROWD = [(f"c{i}", 3000) for i in range(3)]  # 9000 live tokens of a 10k budget


def test_a_small_session_leaves_a_nearly_full_home_and_its_capture_spans_both():
    reg, home, other = two_replicas()
    reg.apply_scrape(home, loads(("s", 500), *CROWD), MODELS)  # 9.5k live: above 0.9 of 10k
    assert reg.place("s", "base", 600).id == other
    assert reg.counters.rehomes == reg.counters.rehomes_pressure == 1 and reg.counters.rehomes_overflow == 0
    assert reg.trace_homes("s") == [home, other]
    assert reg.stats()["totals"]["rehomes_pressure"] == 1
    assert reg.place("s", "base", 700).id == other  # affinity on the new home


def test_it_stays_when_the_home_has_room_the_session_is_large_or_the_landing_replica_is_full():
    reg, home, _ = two_replicas()
    reg.apply_scrape(home, loads(("s", 500), *CROWD[:2]), MODELS)  # 6.5k: room left
    assert reg.place("s", "base", 600).id == home
    reg, home, _ = two_replicas()
    reg.apply_scrape(home, loads(("s", 1500), *CROWD), MODELS)  # 1.5k > 0.1 of the budget: re-prefill too dear
    assert reg.place("s", "base", 1600).id == home
    reg, home, other = two_replicas()
    reg.apply_scrape(home, loads(("s", 500), *CROWD), MODELS)
    reg.apply_scrape(other, loads(("x", 5800)), MODELS)  # would hold 6.3k > 0.6 of its budget with it
    assert reg.place("s", "base", 600).id == home
    assert reg.counters.rehomes == 0
    rr, home, _ = two_replicas("round_robin")  # only a re-homing policy moves sessions
    rr.apply_scrape(home, loads(("s", 500), *CROWD), MODELS)
    assert rr.place("s", "base", 600).id == home


def test_a_session_never_moves_back_to_a_replica_it_left():
    reg, home, other = two_replicas()
    reg.apply_scrape(home, loads(("s", 500), *CROWD), MODELS)
    assert reg.place("s", "base", 600).id == other
    reg.apply_scrape(other, loads(("s", 600), *CROWD), MODELS)  # now the new home is nearly full
    reg.apply_scrape(home, loads(), MODELS)  # and the old one empty: its part of the capture is there
    assert reg.place("s", "base", 700).id == other and reg.counters.rehomes_pressure == 1


def test_the_simulator_moves_under_pressure_and_every_rollout_finishes():
    cfg = load_config(seed=3, sessions=80, arrival_rate=20.0, size_prior_tokens=4096,
                      pools=[PoolSpec("on_demand", 6, 1, 40_000)], release_finished=True)
    trace = generate_trace(cfg)
    sim = RouterSimulator(cfg, trace, "kv")
    sim.policy.relieve_above = 0.5  # this small fleet is rarely above 0.9
    fig = sim.run()
    assert fig["sessions"] == len(trace) and fig["rehomes_pressure"] > 0
    for homes in sim.past_homes.values():  # a move goes only to a replica the session never lived on
        assert len({id(h) for h in homes}) == len(homes)
    off = RouterSimulator(cfg, trace, "kv")
    off.policy.relieve_above = math.inf
    assert off.run()["rehomes_pressure"] == 0
