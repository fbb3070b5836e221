"""The router's registry without a network: membership, URL validation, affinity, failover, errors."""

import pytest

from burstrl.router.registry import Registry, RouteError, validate_url
from burstrl.router.server import prometheus_text, session_id_of


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


def test_failed_scrapes_drop_a_replica_after_the_threshold():
    reg = fleet(2)
    url = next(iter(reg.replicas))
    assert not reg.scrape_failed(url)
    reg.apply_scrape(url, loads(), models("base"))  # a success resets the count
    assert not reg.scrape_failed(url)
    assert reg.scrape_failed(url)
    assert url not in reg.replicas


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


def test_no_session_goes_to_least_loaded():
    reg = fleet(3)
    urls = list(reg.replicas)
    for i, url in enumerate(urls):
        reg.apply_scrape(url, loads(used=[5000, 100, 3000][i]), models("base"))
    assert reg.place(None, "base").id == urls[1]
    assert reg.homes == {}


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
