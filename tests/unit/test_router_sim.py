"""The router simulator: determinism, eviction under a small budget, policy ordering, Mooncake replay."""

import json

import pytest

from burstrl.router.replay import TraceError, load_mooncake
from burstrl.router.sim import (
    Call,
    PoolSpec,
    RouterSimulator,
    TaskKind,
    TraceSession,
    generate_trace,
    load_config,
    simulate,
)

MOONCAKE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def small_config(**overrides):
    base = {"sessions": 120, "arrival_rate": 3.0, "kinds": [TaskKind(calls_min=4, calls_max=12, tool_time_s=2.0)],
                "pools": [PoolSpec("reserved", 1, 8, 800_000), PoolSpec("on_demand", 6, 1, 100_000)]}
    base.update(overrides)
    return load_config(**base)


def test_same_seed_same_figures_and_trace():
    cfg = small_config()
    assert generate_trace(cfg) == generate_trace(cfg)
    assert simulate(cfg, ["headroom", "random"]) == simulate(cfg, ["headroom", "random"])
    other = simulate(small_config(seed=1), ["random"])
    assert other != simulate(cfg, ["random"])


def test_grpo_groups_share_the_first_prompt_and_arrive_together():
    """`group_size`: a group's sessions arrive at once and hold the same first-prompt blocks, then
    their own; without groups no two sessions share a block."""
    trace = generate_trace(small_config(sessions=12, group_size=4))
    for g in range(3):
        group = trace[4 * g:4 * g + 4]
        assert len({s.arrival_s for s in group}) == 1 and len({s.kind for s in group}) == 1
        firsts = {s.calls[0].input_hashes for s in group}
        assert len(firsts) == 1
        prompt = firsts.pop()
        for s in group:
            later = s.calls[-1].input_hashes
            assert later[:len(prompt)] == prompt
            own = set(later[len(prompt):]) | set(s.calls[-1].output_hashes)
            assert own and all(own.isdisjoint(set(o.calls[-1].input_hashes)) for o in trace if o is not s)
    assert trace[0].arrival_s < trace[4].arrival_s < trace[8].arrival_s
    plain = generate_trace(small_config(sessions=12))
    blocks = [set(s.calls[-1].input_hashes) for s in plain]
    assert all(a.isdisjoint(b) for i, a in enumerate(blocks) for b in blocks[i + 1:])


def test_small_budget_evicts_and_lowers_hit_rate():
    roomy = simulate(small_config(), ["headroom"])["headroom"]
    tight_pools = [PoolSpec("reserved", 1, 8, 160_000), PoolSpec("on_demand", 6, 1, 20_000)]
    tight = simulate(small_config(pools=tight_pools), ["headroom"])["headroom"]
    assert roomy["sessions"] == tight["sessions"] == 120
    assert tight["evicted_tokens"] > roomy["evicted_tokens"]
    assert tight["refill_tokens"] > 0
    assert tight["hit_rate"] < roomy["hit_rate"]
    assert roomy["hit_rate"] > 0.99


def test_headroom_and_kv_beat_random_on_mixed_pool_near_saturation():
    cfg = small_config(sessions=200, arrival_rate=4.0)
    res = simulate(cfg, ["kv", "headroom", "random", "round_robin"], k=2)
    for name in ("kv", "headroom"):
        assert res[name]["hit_rate"] > res["random"]["hit_rate"] + 0.05
        assert res[name]["hit_rate"] > res["round_robin"]["hit_rate"]
        assert res["random"]["evicted_tokens"] > res[name]["evicted_tokens"]


def test_released_sessions_free_their_blocks_for_live_ones():
    """A finished rollout's blocks are fresher than an idle live session's; kept in the LRU they push
    the live one out, released (as the orchestrator does) they do not."""
    trace = [
        TraceSession("live", "swe", 0.0, [Call((100, 101, 102, 103), (), 4, 1, gap_after_s=10.0),
                                          Call((100, 101, 102, 103, 104), (), 5, 1)]),
        TraceSession("done", "swe", 1.0, [Call((200, 201, 202, 203), (), 4, 1)]),
        TraceSession("new", "swe", 5.0, [Call((300, 301, 302, 303), (), 4, 1)]),
    ]
    figures = {}
    for release in (False, True):
        cfg = load_config(block_size=1, pools=[PoolSpec("on_demand", 1, 1, 10)], release_finished=release)
        figures[release] = RouterSimulator(cfg, trace, "round_robin").run()
    assert figures[False]["hit_rate"] == 0.5 and figures[False]["evicted_tokens"] > 0  # the live tail went
    assert figures[True]["hit_rate"] == 1.0 and figures[True]["evicted_tokens"] == 0


def test_session_eviction_takes_the_oldest_idle_session_whole():
    """burstrl's replica evicts an idle session whole (`eviction = "session"`), a prefix cache trims
    the oldest blocks (`block`): the same crowding costs the first session its tail, or all of it."""
    trace = [
        TraceSession("a", "swe", 0.0, [Call((100, 101, 102, 103), (), 4, 1, gap_after_s=10.0),
                                       Call((100, 101, 102, 103, 104), (), 5, 1)]),
        TraceSession("b", "swe", 1.0, [Call((200, 201, 202, 203), (), 4, 1, gap_after_s=10.0),
                                       Call((200, 201, 202, 203, 204), (), 5, 1)]),
        TraceSession("c", "swe", 5.0, [Call((300, 301, 302, 303), (), 4, 1)]),
    ]
    figures = {}
    for eviction in ("block", "session"):
        cfg = load_config(block_size=1, pools=[PoolSpec("on_demand", 1, 1, 10)], eviction=eviction)
        figures[eviction] = RouterSimulator(cfg, trace, "round_robin").run()
    assert figures["block"]["evicted_tokens"] < figures["session"]["evicted_tokens"]
    assert figures["session"]["evicted_tokens"] >= 4  # all of a's 4 blocks, not just the 2 needed
    assert figures["block"]["hit_rate"] > figures["session"]["hit_rate"]
    assert figures["block"]["sessions"] == figures["session"]["sessions"] == 3


def test_session_eviction_sends_kv_to_move_the_evicted_session():
    # the whole session gone from an overflowing home is what makes `kv` re-home it
    tight = [PoolSpec("on_demand", 6, 1, 20_000)]
    res = simulate(small_config(pools=tight, eviction="session"), ["kv", "round_robin"])
    assert res["kv"]["rehomes"] > res["kv"]["rehomes_pressure"] >= 0
    assert res["round_robin"]["rehomes"] == 0
    assert res["kv"]["hit_rate"] > res["round_robin"]["hit_rate"]
    assert res["kv"]["sessions"] == res["round_robin"]["sessions"] == 120


def test_mooncake_replay_shares_prefixes(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 100, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 4]},
        {"timestamp": 200, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
        {"timestamp": 300, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = load_mooncake(path)
    assert [s.arrival_s for s in trace] == [0.0, 0.1, 0.2, 0.3]
    cfg = load_config(block_size=512, pools=[PoolSpec("reserved", 1, 8, 100_000)])
    res = simulate(cfg, ["cache_aware", "random", "kv"], trace=trace)
    for fig in res.values():  # one replica: every shared prefix is found
        assert fig["sessions"] == 4
        assert fig["hit_rate"] == 1.0
        assert fig["prefix_hit_rate"] == pytest.approx((1024 + 1000) / (1500 + 1200 + 600 + 1000))


def write_rows(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_mooncake_times_are_relative_and_scaled(tmp_path):
    epoch = 1_700_000_000_000  # absolute epoch ms once hung the replay for hours of simulated time
    rows = [{"timestamp": epoch + dt, "input_length": 600, "output_length": 5, "hash_ids": [i, i + 100]}
            for i, dt in enumerate((4000, 0, 2000))]
    path = write_rows(tmp_path / "t.jsonl", rows)
    assert [s.arrival_s for s in load_mooncake(path)] == [0.0, 2.0, 4.0]
    assert [s.arrival_s for s in load_mooncake(path, rate_scale=4)] == [0.0, 0.5, 1.0]
    with pytest.raises(TraceError, match="rate_scale"):
        load_mooncake(path, rate_scale=0)


def test_mooncake_sessions_inferred_from_hash_chains(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 100, "hash_ids": [0, 1, 2]},  # a: 2 full blocks
        {"timestamp": 10, "input_length": 700, "output_length": 50, "hash_ids": [0, 7]},  # b: shares only block 0
        {"timestamp": 60_000, "input_length": 1700, "output_length": 80, "hash_ids": [0, 1, 3, 4]},  # a, turn 2
        {"timestamp": 61_000, "input_length": 1300, "output_length": 9, "hash_ids": [0, 1, 5]},  # not a: turn 2 took it
        {"timestamp": 62_000, "input_length": 900, "output_length": 9, "hash_ids": [0, 7]},  # shorter than b's turn
    ]
    path = write_rows(tmp_path / "t.jsonl", rows)
    trace = load_mooncake(path, sessions="infer", block_tokens=512)
    assert [[c.input_tokens for c in s.calls] for s in trace] == [[1100, 1700], [700], [1300], [900]]
    assert trace[0].calls[1].not_before_s == 60.0
    assert len(load_mooncake(path)) == 5  # per request
    cfg = load_config(block_size=512, pools=[PoolSpec("reserved", 1, 8, 100_000)])
    fig = simulate(cfg, ["kv"], trace=trace)["kv"]
    assert fig["sessions"] == 4
    # hits: b's system block (512), a's two full blocks twice (1024 + 1024), all of the last (900: a repeat)
    assert fig["prefix_hit_rate"] == pytest.approx((512 + 1024 + 1024 + 900) / (1100 + 700 + 1700 + 1300 + 900))


def test_whole_mooncake_trace_parses_into_sessions():
    per_request = load_mooncake(MOONCAKE)
    inferred = load_mooncake(MOONCAKE, sessions="infer")
    requests = sum(len(s.calls) for s in inferred)
    assert len(per_request) == requests == 12031
    assert 0.25 < 1 - len(inferred) / requests < 0.45  # "about a third continue an earlier one"
    assert per_request[0].arrival_s == 0.0


BAD_TRACES = [
    ([], "empty trace"),
    (["", "   "], "empty trace"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [[1]]}'], ":1: 'hash_ids' must be a flat"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["1"]}'], ":1: 'hash_ids' must be a flat"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "12"}'], ":1: 'hash_ids' must be a flat"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [true]}'], ":1: 'hash_ids' must be a flat"),
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
      '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}'], ":2: 'input_length' must be finite"),
    (['{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}'], ":1: 'output_length' must be"),
    (['{"timestamp": -3, "input_length": 5, "output_length": 1, "hash_ids": [1]}'], ":1: 'timestamp' must be"),
    (['{"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [1]}'], ":1: 'timestamp' must be a number"),
    (['{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [1]}'], ":1: 'input_length' must be an integer"),
    (['{"timestamp": 0, "output_length": 1, "hash_ids": [1]}'], ":1: 'input_length' must be an integer, got None"),
    (["", '{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}'], ":2: 'timestamp' must be finite"),
    (["[1, 2]"], ":1: a request must be a JSON object"),
    (["{nope"], ":1: not JSON"),
    (["[" * 100_000], ":1: not JSON"),
]


@pytest.mark.parametrize("lines,message", BAD_TRACES)
def test_bad_traces_name_file_and_line(tmp_path, lines, message):
    path = write_rows(tmp_path / "bad.jsonl", lines) if lines else tmp_path / "bad.jsonl"
    if not lines:
        path.write_text("")
    with pytest.raises(TraceError) as err:
        load_mooncake(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_config_file_toml_and_json(tmp_path):
    toml = tmp_path / "sim.toml"
    toml.write_text('sessions = 7\n[[pools]]\npool = "on_demand"\ncount = 2\ncapacity_tokens = 5000\n')
    cfg = load_config(toml)
    assert cfg.sessions == 7 and cfg.pools[0].count == 2 and cfg.pools[0].capacity_tokens == 5000
    js = tmp_path / "sim.json"
    js.write_text(json.dumps({"kinds": [{"name": "a", "calls_max": 2}]}))
    assert load_config(js).kinds[0].calls_max == 2
    with pytest.raises(ValueError, match="unknown"):
        load_config(bogus=1)


def test_cli_route_sim_json_and_bad_policy(tmp_path):
    from typer.testing import CliRunner

    from burstrl.cli import app

    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps({"sessions": 20, "pools": [{"pool": "on_demand", "count": 3}]}))
    runner = CliRunner()
    result = runner.invoke(app, ["route", "sim", "--config", str(cfg), "--policies", "headroom,random", "--k", "3", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    assert set(figures) == {"headroom", "random"} and figures["headroom"]["sessions"] == 20
    table = runner.invoke(app, ["route", "sim", "--config", str(cfg), "--policies", "round_robin"])
    assert table.exit_code == 0 and "round_robin" in table.output and "hit_rate" in table.output
    bad = runner.invoke(app, ["route", "sim", "--policies", "nope"])
    assert bad.exit_code == 2 and "unknown policy" in bad.output


BAD_CONFIGS = [
    ({"sessions": 0}, "sessions"),
    ({"arrival_rate": 0}, "arrival_rate"),
    ({"pools": [{"count": 2, "capacity_tokens": 0}]}, "capacity_tokens"),
    ({"pools": [{"count": 0}]}, "at least one replica"),
    ({"pools": []}, "pools"),
    ({"pools": [{"weight": 0}]}, "weight"),
    ({"eviction": "lru"}, "eviction"),
]


@pytest.mark.parametrize("data,message", BAD_CONFIGS)
def test_cli_route_sim_rejects_bad_config(tmp_path, data, message):
    from typer.testing import CliRunner

    from burstrl.cli import app

    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["route", "sim", "--config", str(cfg), "--policies", "kv"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


def test_cli_route_sim_replays_and_rejects_bad_traces(tmp_path):
    from typer.testing import CliRunner

    from burstrl.cli import app

    runner = CliRunner()
    good = write_rows(tmp_path / "good.jsonl", [
        {"timestamp": 1_700_000_000_000, "input_length": 1100, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 1_700_000_060_000, "input_length": 1700, "output_length": 80, "hash_ids": [0, 1, 3, 4]}])
    ok = runner.invoke(app, ["route", "sim", "--trace", str(good), "--sessions", "infer", "--rate-scale", "4",
                             "--policies", "kv,cache_aware", "--json", "--pools", '[{"count": 2}]'])
    assert ok.exit_code == 0, ok.output
    figures = json.loads(ok.output)
    assert figures["kv"]["sessions"] == 1 and figures["kv"]["prefix_hit_rate"] == pytest.approx(1024 / 2800)
    bad = write_rows(tmp_path / "bad.jsonl", ['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [[1]]}'])
    for args, message in ((["--trace", str(bad)], f"{bad}:1: 'hash_ids'"),
                          (["--trace", str(tmp_path / "empty.jsonl")], "No such file"),
                          (["--trace", str(good), "--sessions", "bogus"], "sessions must be one of"),
                          (["--trace", str(good), "--rate-scale", "0"], "rate_scale")):
        result = runner.invoke(app, ["route", "sim", "--policies", "kv", *args])
        assert result.exit_code == 2 and message in result.output, result.output
