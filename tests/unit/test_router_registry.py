"""The router's registry without a network: membership, URL validation, affinity, failover, errors."""

import pytest

from burstrl.router.loads import HOLD_SCRAPES
from burstrl.router.policies import NewSession, projected_headroom
from burstrl.router.registry import Registry, RouteError, validate_url
from burstrl.router.server import parse_json, prometheus_text, session_id_of, task_kind_of
from burstrl.router.soak import SoakConfig, soak_registry


def loads(*sessions, used=0, capacity=10_000, versions=("base",)):
    return {"num_used_tokens": used, "max_total_num_tokens": capacity, "versions": list(versions),
            "sessions": [{"session_id": sid, "tokens": tokens} for sid, tokens in sessions], "cache_hit_rate": 0.5}


def models(*names):
    return {"object": "list", "data": [{"id": n} for n in names]}


def fleet(n=3, policy="headroom", versions=("base",)):
    reg = Registry(policy=policy, k=2, health_failures=2, seed=0)
    for i in range(n):
        url = f"http://10.0.0.{i}:8000"
        reg.add(url)
        reg.apply_scrape(url, loads(versions=versions), models(*versions))
    return reg


def test_validate_url_accepts_http_and_refuses_other_schemes():
    assert validate_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert validate_url("https://replica.example:443") == "https://replica.example:443"
    for bad in ("file:///etc/passwd", "gopher://x", "ftp://host", "http://", "", "http://u:p@host:1"):
        with pytest.raises(RouteError) as err:
            validate_url(bad)
        assert err.value.status == 400


def test_add_remove_and_bad_registration():
    reg = Registry()
    view = reg.add("http://a:1", pool="on_demand", weight=2, capacity_tokens=100)
    assert view.id == "http://a:1" and view.pool == "on_demand" and view.weight == 2.0
    with pytest.raises(RouteError):
        reg.add("http://b:1", pool="spot")
    with pytest.raises(RouteError):
        reg.add("http://b:1", weight=0)
    assert reg.remove("http://a:1/") and not reg.remove("http://a:1")
    assert reg.replicas == {}


def test_scrape_fills_view_and_clears_recent_assignments():
    reg = fleet(1)
    view = reg.place("s1", "base", 50)
    assert len(view.recent_assignments) == 1
    reg.apply_scrape(view.id, loads(("s1", 120), used=120, capacity=4096, versions=("base", "policy-v1")),
                     models("base", "policy-v1"))
    assert view.used_tokens == 120 and view.capacity_tokens == 4096
    assert view.live_sessions == {"s1": 120} and view.versions == {"base", "policy-v1"}
    assert view.recent_assignments == []
    assert reg.models() == {"base", "policy-v1"}


def test_finished_sessions_feed_the_size_model():
    reg = fleet(1)
    url = next(iter(reg.replicas))
    reg.apply_scrape(url, loads(("s1", 3000)), models("base"))
    reg.apply_scrape(url, loads(), models("base"))
    assert reg.sizes.expected("default") < reg.sizes.prior_tokens  # blended toward the 3000 seen


def test_sessions_stick_to_their_replica():
    reg = fleet(3)
    homes = {sid: reg.place(sid, "base").id for sid in ("a", "b", "c", "d")}
    for _ in range(5):
        for sid, home in homes.items():
            assert reg.place(sid, "base").id == home
    assert reg.counters.rehomes == 0
    assert reg.stats()["totals"]["sessions"] == 4


def test_new_sessions_do_not_herd_between_scrapes():
    reg = fleet(3)
    placed = [reg.place(f"s{i}", "base", 3000).id for i in range(9)]
    assert len(set(placed)) == 3


def test_dead_replica_rehomes_its_sessions():
    reg = fleet(3)
    home = reg.place("s", "base").id
    reg.mark_dead(home)
    new_home = reg.place("s", "base").id
    assert new_home != home and new_home in reg.replicas
    assert reg.counters.rehomes == 1 and reg.counters.replicas_dropped == 1
    assert reg.place("s", "base").id == new_home and reg.counters.rehomes == 1


def test_unanswered_scrapes_take_a_replica_out_of_rotation_until_it_answers():
    """A busy replica (or a starved router) misses scrapes: it stops getting sessions but is kept;
    dropping it lost every replica of a loaded run for good (nothing registers them again)."""
    reg = fleet(2)
    url, other = list(reg.replicas)
    assert not reg.scrape_failed(url)
    reg.apply_scrape(url, loads(), models("base"))  # a success resets the count
    assert not reg.scrape_failed(url)
    assert reg.scrape_failed(url)  # the threshold: out of rotation, once
    assert not reg.scrape_failed(url) and not reg.scrape_failed(url)
    assert url in reg.replicas and not reg.replicas[url].healthy
    assert reg.counters.replicas_unanswered == 1 and reg.counters.replicas_dropped == 0
    assert {reg.place(f"s{i}", "base").id for i in range(10)} == {other}
    reg.apply_scrape(url, loads(), models("base"))  # it answers again
    assert reg.replicas[url].healthy
    assert url in {reg.place(f"t{i}", "base").id for i in range(30)}


def test_every_replica_unanswered_is_a_503_then_the_run_goes_on_when_they_answer():
    reg = fleet(2)
    for url in list(reg.replicas):
        reg.scrape_failed(url)
        reg.scrape_failed(url)
    with pytest.raises(RouteError) as err:
        reg.place("s", reg.resolve("s", "latest"))
    assert err.value.status == 503
    for url in list(reg.replicas):
        reg.apply_scrape(url, loads(), models("base"))
    assert reg.place("s", reg.resolve("s", "latest")).id in reg.replicas


def test_unknown_model_is_404_and_lost_version_is_503():
    reg = fleet(2, versions=("base", "policy-v1"))
    with pytest.raises(RouteError) as err:
        reg.place("new", "policy-v9")
    assert err.value.status == 404
    with pytest.raises(RouteError) as err:
        reg.place(None, "policy-v9")
    assert err.value.status == 404
    reg.place("old", "policy-v1")
    for url in list(reg.replicas):  # the version rolls off every replica
        reg.apply_scrape(url, loads(), models("base"))
    with pytest.raises(RouteError) as err:
        reg.place("old", "policy-v1")
    assert err.value.status == 503


def test_session_never_lands_on_a_replica_lacking_its_version():
    reg = fleet(3, versions=("base",))
    url = next(iter(reg.replicas))
    reg.apply_scrape(url, loads(), models("base", "policy-v2"))
    for i in range(10):
        assert reg.place(f"v2-{i}", "policy-v2").id == url


def test_no_session_goes_through_the_policy():
    reg = fleet(3, policy="round_robin")
    urls = list(reg.replicas)
    assert [reg.place(None, "base").id for _ in range(4)] == [urls[0], urls[1], urls[2], urls[0]]
    assert reg.homes == {}
    kv = fleet(3, policy="kv")
    urls = list(kv.replicas)
    for i, url in enumerate(urls):
        kv.apply_scrape(url, loads(*[(f"x{i}{j}", 4000) for j in range([2, 0, 1][i])]), models("base"))
    assert kv.place(None, "base", expected_tokens=500).id == urls[1]  # the emptiest, by projected size


def test_kv_places_by_the_replicas_block_summary():
    from burstrl.protocol.blocks import BLOCK_TOKENS, prefix_block_hashes

    prompt = list(range(100, 100 + 10 * BLOCK_TOKENS))
    hashes = tuple(prefix_block_hashes(prompt, "base"))
    summary = {"block_tokens": BLOCK_TOKENS, "hashes": list(hashes[:8])}
    for sid in ("s0", None):  # a session and a one-off call alike go where 8 of 10 blocks are cached
        reg = fleet(3, policy="kv")
        warm = list(reg.replicas)[2]
        reg.apply_scrape(warm, {**loads(), "prefix_blocks": summary}, models("base"))
        assert reg.replicas[warm].cached_blocks == frozenset(hashes[:8])
        assert reg.place(sid, "base", len(prompt), prefix_hashes=hashes, block_tokens=BLOCK_TOKENS).id == warm
    with pytest.raises(ValueError, match="prefix_blocks"):
        reg.apply_scrape(warm, {**loads(), "prefix_blocks": {"hashes": "nope"}}, models("base"))


def test_kv_rehomes_a_session_its_overflowing_home_evicted():
    reg = fleet(2, policy="kv")
    a, b = list(reg.replicas)
    home = reg.place("s", "base").id
    other = b if home == a else a
    evicted = {"session_id": "s", "tokens": 0, "context_tokens": 3000, "busy": False}
    crowd = [{"session_id": f"c{i}", "tokens": 4000} for i in range(3)]  # 12k live on a 10k budget
    reg.apply_scrape(home, {**loads(), "sessions": [evicted, *crowd]}, models("base"))
    reg.apply_scrape(other, loads(), models("base"))
    assert reg.place("s", "base").id == other
    assert reg.counters.rehomes == reg.counters.rehomes_overflow == 1
    assert reg.place("s", "base").id == other  # affinity again on the new home
    # a home with room keeps an evicted session (moving would not help), and so does any other policy
    reg.apply_scrape(other, {**loads(), "sessions": [evicted]}, models("base"))
    assert reg.place("s", "base").id == other
    rr = fleet(2, policy="round_robin")
    first = rr.place("s", "base").id
    rr.apply_scrape(first, {**loads(), "sessions": [evicted, *crowd]}, models("base"))
    assert rr.place("s", "base").id == first and rr.counters.rehomes == 0


def test_an_overflow_move_keeps_the_old_home_for_the_capture_and_never_returns_there():
    reg = fleet(3, policy="kv")
    a, b, c = list(reg.replicas)
    reg.remove(c)  # two replicas first: the second move has nowhere new to go
    home = reg.place("s", "base").id
    other = b if home == a else a
    evicted = {"session_id": "s", "tokens": 0, "context_tokens": 3000, "busy": False}
    crowd = [{"session_id": f"c{i}", "tokens": 4000} for i in range(3)]
    reg.apply_scrape(home, {**loads(), "sessions": [evicted, *crowd]}, models("base"))
    assert reg.place("s", "base").id == other and reg.trace_homes("s") == [home, other]
    # the old home keeps listing the session (it holds the capture): it is not live there any more,
    # and its leaving there is not a finished session for the size model
    observed = reg.sizes.generation
    reg.apply_scrape(home, {**loads(), "sessions": [{**evicted, "context_tokens": 3100}, *crowd]}, models("base"))
    assert "s" not in reg.replicas[home].live_sessions and reg.sizes.generation == observed
    # the new home overflows too: the only other replica is the one it left, so it stays
    reg.apply_scrape(other, {**loads(), "sessions": [evicted, *crowd]}, models("base"))
    assert reg.place("s", "base").id == other and reg.counters.rehomes_overflow == 1
    # a replica it never lived on takes it, and the capture spans all three in order
    reg.add(c)
    reg.apply_scrape(c, loads(), models("base"))
    assert reg.place("s", "base").id == c and reg.trace_homes("s") == [home, other, c]
    assert reg.counters.rehomes == reg.counters.rehomes_overflow == 2
    # a part of the capture on a replica that is gone: 503, not a trace with calls missing
    reg.remove(home)
    with pytest.raises(RouteError) as err:
        reg.trace_homes("s")
    assert err.value.status == 503 and home in err.value.message
    reg.forget("s")
    assert reg.map_sizes()["past_homes"] == 0


def test_an_evicted_session_stays_where_its_prompt_is_still_cached():
    from burstrl.protocol.blocks import BLOCK_TOKENS, prefix_block_hashes

    prompt = list(range(100, 100 + 20 * BLOCK_TOKENS))
    hashes = tuple(prefix_block_hashes(prompt, "base"))
    evicted = {"session_id": "s", "tokens": 0, "context_tokens": len(prompt), "busy": False}
    crowd = [{"session_id": f"c{i}", "tokens": 4000} for i in range(3)]  # 12k live on a 10k budget
    for sibling_holds_it in (True, False):
        reg = fleet(2, policy="kv")
        home = reg.place("s", "base").id
        other = next(u for u in reg.replicas if u != home)
        # a GRPO sibling on the home still holds the shared first prompt (the replica copies it across sessions)
        summary = {"block_tokens": BLOCK_TOKENS, "hashes": list(hashes) if sibling_holds_it else []}
        reg.apply_scrape(home, {**loads(), "sessions": [evicted, *crowd], "prefix_blocks": summary}, models("base"))
        reg.apply_scrape(other, {**loads(), "sessions": crowd[:1]}, models("base"))
        assert reg.may_move("s")
        placed = reg.place("s", "base", len(prompt), prefix_hashes=hashes, block_tokens=BLOCK_TOKENS).id
        assert placed == (home if sibling_holds_it else other)
        assert reg.counters.rehomes_overflow == (0 if sibling_holds_it else 1)


def test_in_flight_counts_follow_calls():
    reg = fleet(2)
    url = list(reg.replicas)[0]
    reg.call_started(url)
    reg.call_started(url)
    reg.call_ended(url)
    assert reg.replicas[url].in_flight == 1
    reg.call_ended(url)
    reg.call_ended(url)  # never below zero
    reg.call_ended("http://gone:1")  # a dropped replica: ignored
    assert reg.replicas[url].in_flight == 0
    reg.apply_scrape(url, {**loads(), "num_running_reqs": 3, "num_waiting_reqs": 2}, models("base"))
    assert reg.replicas[url].running_requests == 5


def test_no_replica_at_all_is_an_error_not_a_crash():
    reg = Registry()
    with pytest.raises(RouteError) as err:
        reg.place("s", "base")
    assert err.value.status == 404


def test_session_id_from_body_or_headers():
    assert session_id_of({"session_id": "b"}, {"x-session-id": "h"}) == "b"
    assert session_id_of({}, {"x-smg-routing-key": "r"}) == "r"
    assert session_id_of({}, {"x-dynamo-session-id": "d"}) == "d"
    assert session_id_of({"session_id": ""}, {}) is None


def test_stats_and_prometheus_text():
    reg = fleet(2)
    reg.place("s", "base")
    stats = reg.stats()
    assert stats["totals"]["replicas"] == 2 and stats["totals"]["sessions"] == 1
    row = stats["replicas"][0]
    assert row["capacity_tokens"] == 10_000 and row["versions"] == ["base"] and "projected_headroom" in row
    text = prometheus_text(stats)
    assert "burstrl_router_rehomes_total 0" in text
    assert 'burstrl_router_replica_capacity_tokens{replica="http://10.0.0.0:8000",pool="reserved"} 10000.0' in text


def test_latest_waits_for_the_configured_pools():
    reg = Registry(seed=0, version_pools=("reserved",))
    reg.add("http://10.0.0.1:8000", pool="reserved")
    reg.add("http://10.0.0.2:8000", pool="on_demand")
    reg.apply_scrape("http://10.0.0.1:8000", loads(versions=("base", "policy-v2")), models("base", "policy-v2"))
    reg.apply_scrape("http://10.0.0.2:8000", loads(versions=("base",)), models("base"))
    assert reg.resolve(None, "latest") == "policy-v2"  # only the reserved pool is required
    every = Registry(seed=0)
    every.replicas = reg.replicas
    assert every.resolve(None, "latest") == "base"  # default: every pool with a healthy replica


# --- dead engines, task kinds, pruning (issue 14) ---------------------------------------------


def test_a_503_scrape_drops_the_replica_at_once_a_timeout_needs_the_threshold():
    reg = fleet(3)
    dead, slow, _ = list(reg.replicas)
    home = reg.place("s", "base").id
    assert reg.scrape_failed(dead, status=503)  # the replica answered that it cannot serve
    assert dead not in reg.replicas and reg.counters.replicas_dropped == 1
    assert not reg.scrape_failed(slow, status=None)  # no answer: may be a blip
    assert reg.scrape_failed(slow, status=None) and not reg.replicas[slow].healthy  # two in a row
    for i in range(10):  # nothing new goes to the dead or the unanswering replica
        assert reg.place(f"new-{i}", "base").id not in (dead, slow)
    assert reg.place("s", "base").id != dead and reg.counters.rehomes == (1 if home == dead else 0)


def test_task_kinds_reach_the_size_model():
    reg = fleet(1)
    url = next(iter(reg.replicas))
    for i in range(20):  # finished sessions: swe ones end at 30k tokens, math ones at 500
        reg.place(f"swe-{i}", "base", kind="swe")
        reg.place(f"math-{i}", "base", kind="math")
    reg.apply_scrape(url, loads(*[(f"swe-{i}", 30_000) for i in range(20)],
                                *[(f"math-{i}", 500) for i in range(20)], capacity=10**7), models("base"))
    assert reg.replicas[url].session_kinds["swe-0"] == "swe"
    reg.apply_scrape(url, loads(capacity=10**7), models("base"))
    assert reg.sizes.expected("swe") == 30_000 and reg.sizes.expected("math") == 500
    view = reg.replicas[url]
    swe = projected_headroom(view, NewSession("new", kind="swe", version="base"), reg.sizes)
    math_ = projected_headroom(view, NewSession("new", kind="math", version="base"), reg.sizes)
    assert math_ - swe == 29_500  # the same replica, two very different projections
    reg.place("live-swe", "base", kind="swe")
    reg.place("live-swe", "base", kind="math")  # a session keeps the kind it started with
    assert reg.kinds["live-swe"] == "swe"


def test_caller_supplied_kinds_are_capped():
    reg = Registry(seed=0)
    reg.sizes.max_kinds = 4
    assert [reg.sizes.admit(f"k{i}") for i in range(5)] == ["k0", "k1", "k2", "default", "default"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sessions_no_replica_reports_are_pruned_after_the_grace():
    clock = Clock()
    reg = Registry(seed=0, grace_s=100, clock=clock)
    url = "http://10.0.0.1:8000"
    reg.add(url)
    reg.apply_scrape(url, loads(), models("base"))
    for sid in ("live", "finished", "abandoned"):
        reg.place(sid, "base", kind="swe")
    clock.now = 50
    reg.apply_scrape(url, loads(("live", 10), ("finished", 10)), models("base"))
    clock.now = 120  # `finished` ended after the scrape at 50; `abandoned` was never reported
    reg.apply_scrape(url, loads(("live", 10)), models("base"))
    assert reg.prune() == 1 and "abandoned" not in reg.homes
    clock.now = 151
    assert reg.prune() == 1
    assert set(reg.homes) == set(reg.pinned) == set(reg.kinds) == set(reg.seen) == {"live"}
    assert reg.stats()["totals"]["sessions_pruned"] == 2
    assert "burstrl_router_sessions_pruned_total 2" in prometheus_text(reg.stats())


def test_max_sessions_drops_the_longest_unseen_first():
    clock = Clock()
    reg = Registry(seed=0, max_sessions=3, clock=clock)
    reg.add("http://10.0.0.1:8000")
    reg.apply_scrape("http://10.0.0.1:8000", loads(), models("base"))
    for i, sid in enumerate(("a", "b", "c")):
        clock.now = i
        reg.place(sid, "base")
    clock.now = 3
    reg.place("a", "base")  # a call: `a` is now the most recently seen
    reg.place("d", "base")
    assert list(reg.homes) == ["a", "c", "d"] and reg.counters.sessions_pruned == 1


@pytest.mark.slow  # 2-6 s: kept out of the fast lane
def test_short_soak_keeps_the_session_maps_bounded():
    cfg = SoakConfig(hours=1.0, replica_ttl_s=300, grace_s=300, replace_every_s=600, samples=12)
    samples = soak_registry(cfg, trace_memory=False)["samples"]
    warm = [s for s in samples if s["hour"] >= 0.25]  # past lifetime + TTL + grace
    homes = [s["homes"] for s in warm]
    assert max(homes) <= 1.25 * min(homes), homes
    end = samples[-1]
    assert end["homes"] == end["pinned"] == end["kinds"] == end["seen"]
    assert end["homes"] < end["sessions_started"] / 5 and end["pruned"] > 0 and end["rehomes"] > 0
    assert end["session_kinds"] == end["live_sessions"] and end["size_model_kinds"] == 2
    capped = soak_registry(SoakConfig(hours=0.1, max_sessions=500, samples=3), trace_memory=False)["samples"]
    assert all(s["homes"] <= 500 for s in capped) and capped[-1]["pruned"] > 0


def test_bad_bodies_are_400_not_500():
    for raw in (b'{"model": "\\ud800"}', b'{"model": "\xed\xa0\x80"}', b"[" * 100_000, b"[1, 2]", b'"x"',
                b"\xff\xfe", b"{", b""):
        with pytest.raises(RouteError) as err:
            parse_json(raw)
        assert err.value.status == 400, raw[:20]
    assert parse_json('{"content": "\\ud83d\\ude00 é 한"}'.encode()) == {"content": "\U0001F600 é 한"}
    assert task_kind_of({"task_kind": "swe"}, {"x-task-kind": "math"}) == "swe"
    assert task_kind_of({}, {"x-task-kind": "math"}) == "math" and task_kind_of({}, {}) == "default"
    for bad in (5, "", "k" * 200, None):
        with pytest.raises(RouteError):
            task_kind_of({"task_kind": bad}, {})


def test_prefix_block_keys_are_the_same_in_every_process():
    import subprocess
    import sys

    from burstrl.protocol.blocks import prefix_block_hashes
    from burstrl.router.server import prompt_blocks

    tokens = list(range(5, 5 + 100))
    code = "from burstrl.protocol.blocks import prefix_block_hashes as h; print(h(list(range(5, 105)), 'base'))"
    for seed in ("1", "2"):  # str hashing differs per process; these keys must not
        out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(prefix_block_hashes(tokens, "base"))
    keys = prefix_block_hashes(tokens, "base")
    assert len(keys) == 3 and keys != prefix_block_hashes(tokens, "policy-v1")  # per version
    assert prefix_block_hashes(tokens[:64] + [0] * 36, "base")[:2] == keys[:2]  # chained: a prefix's keys
    assert prompt_blocks({"input_ids": tokens}, "base") == tuple(keys)
    assert prompt_blocks({"prompt": [tokens]}, "base") == tuple(keys)
    for body in ({"prompt": "text"}, {"input_ids": [1, -2] * 40}, {"input_ids": [1 << 40] * 40},
                 {"input_ids": [True] * 40}, {"messages": []}):
        assert prompt_blocks(body, "base") == ()


def test_a_scrape_keeps_the_placements_made_after_it_was_sent():
    # the answer to a scrape sent before a placement may not list that session yet: forgetting the
    # placement would let the next choice herd onto the same replica (or miss the prefix sent there)
    reg = fleet(1)
    url = list(reg.replicas)[0]
    reg.place("before", "base", 500)
    mark = reg.scrape_mark(url)
    reg.place("after", "base", 500)
    reg.apply_scrape(url, loads(("before", 500)), models("base"), mark)
    assert [s.id for s in reg.replicas[url].recent_assignments] == ["after"]
    reg.apply_scrape(url, loads(("before", 500), ("after", 500)), models("base"), reg.scrape_mark(url))
    assert reg.replicas[url].recent_assignments == []
    # the replica re-registered while a scrape was out: every placement on the new view came later
    reg.place("third", "base", 500)
    stale = reg.scrape_mark(url)
    reg.add(url)
    reg.apply_scrape(url, loads(), models("base"), reg.scrape_mark(url))
    reg.place("fourth", "base", 500)
    reg.apply_scrape(url, loads(), models("base"), stale)
    assert [s.id for s in reg.replicas[url].recent_assignments] == ["fourth"]
    reg.apply_scrape(url, loads(), models("base"))  # no mark (the simulator, the soak): forget them all
    assert reg.replicas[url].recent_assignments == []


def test_a_placement_the_scrape_does_not_show_yet_stays_a_few_scrapes_more():
    # a scrape sent after a placement can be answered before the call's prefill reaches the block
    # summary: dropping the placement then would let the next sibling miss the prefix just sent
    reg = fleet(2, policy="kv")
    hashes = (11, 12, 13)
    home = reg.place("s", "base", 512, prefix_hashes=hashes, block_tokens=128)
    url = home.id
    reg.apply_scrape(url, loads(), models("base"), reg.scrape_mark(url))  # not listed yet
    assert [s.id for s in home.recent_assignments] == ["s"] and home.held_over == [1]
    assert reg.place("sibling", "base", 512, prefix_hashes=hashes, block_tokens=128) is home
    listed = {**loads(("s", 512), ("sibling", 512)), "prefix_blocks": {"hashes": list(hashes)}}
    reg.apply_scrape(url, listed, models("base"), reg.scrape_mark(url))  # both shown: both go
    assert home.recent_assignments == [] and home.held_over == []
    # listed, but its prompt not yet in the summary (a prefill slower than the scrapes on a loaded
    # replica): kept HOLD_SCRAPES scrapes, then gone even if still not shown (a call that failed)
    reg.place("t", "base", 512, prefix_hashes=(21, 22), block_tokens=128)
    t_home = reg.replicas[reg.homes["t"]]
    for n in range(HOLD_SCRAPES + 1):
        assert [s.id for s in t_home.recent_assignments] == ["t"] and t_home.held_over == ([n] if n else [])
        reg.apply_scrape(t_home.id, loads(("t", 512)), models("base"), reg.scrape_mark(t_home.id))
    assert t_home.recent_assignments == [] and t_home.held_over == []
