"""Version gating and fleet metrics of the router: network-free registry checks, then a live rollout.

The live test runs the router in front of three real replicas (two `on_demand`, one `reserved`)
and rolls a new adapter version out one replica at a time: `latest` must move to the new version
only once every pool has a replica serving it, and a session begun on the old version must keep
running on it, on its own replica, throughout.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from burstrl.router.registry import Registry, RouteError
from burstrl.router.server import VERSION_HEADER, first_call_tokens, prometheus_text
from tests.http_client import HTTP

from .conftest import Server, stop_server
from .test_router import AUTH, start_replica, start_router


def scraped(versions: tuple[str, ...], sessions: tuple[tuple[str, str], ...] = (), thrash: int = 0) -> dict:
    return {"num_used_tokens": 0, "max_total_num_tokens": 10_000, "versions": list(versions),
            "sessions": [{"session_id": sid, "version": v, "tokens": 10} for sid, v in sessions],
            "thrash": thrash, "evictions": 2 * thrash, "cache_hit_rate": 0.5,
            "prefix_cache_hit_tokens": 50, "prefix_cache_queries_tokens": 100}


def models(versions: tuple[str, ...]) -> dict:
    return {"data": [{"id": v} for v in versions]}


def two_pools(reserved: tuple[str, ...], on_demand: tuple[str, ...]) -> Registry:
    reg = Registry(seed=0)
    for url, pool, versions in (("http://r:1", "reserved", reserved), ("http://o:1", "on_demand", on_demand)):
        reg.add(url, pool)
        reg.apply_scrape(url, scraped(versions), models(versions))
    return reg


def test_latest_needs_every_pool_and_sessions_stay_pinned() -> None:
    reg = two_pools(("base", "policy-v1", "policy-v2"), ("base", "policy-v1"))
    assert reg.resolve("a", "latest") == "policy-v1"  # v2 only on the reserved pool
    reg.place("a", "policy-v1")
    reg.apply_scrape("http://o:1", scraped(("base", "policy-v1", "policy-v2")), models(("base", "policy-v1", "policy-v2")))
    assert reg.resolve("b", None) == "policy-v2"
    assert reg.resolve("a", "latest") == "policy-v1"  # pinned
    assert reg.resolve("a", "policy-v1") == "policy-v1"
    with pytest.raises(RouteError) as err:
        reg.resolve("a", "policy-v2")
    assert err.value.status == 409


def test_latest_with_nothing_common_is_503() -> None:
    reg = two_pools(("policy-v2",), ("policy-v1",))
    with pytest.raises(RouteError) as err:
        reg.resolve("s", "latest")
    assert err.value.status == 503


def test_stats_report_thrash_spread_and_fleet_hit_rate() -> None:
    reg = two_pools(("base", "policy-v1"), ("base", "policy-v1"))
    reg.apply_scrape("http://r:1", scraped(("base", "policy-v1"), (("s1", "policy-v1"), ("s2", "base")), thrash=3),
                     models(("base", "policy-v1")))
    reg.apply_scrape("http://o:1", scraped(("base", "policy-v1"), (("s3", "policy-v1"),), thrash=1),
                     models(("base", "policy-v1")))
    stats = reg.stats()
    assert stats["versions"] == {"live_sessions": {"base": 1, "policy-v1": 2}, "in_use": 2, "latest": "policy-v1"}
    assert stats["totals"]["thrash"] == 4 and stats["totals"]["evictions"] == 8
    assert stats["totals"]["cache_hit_rate"] == pytest.approx(0.5)
    assert {r["url"]: r["thrash"] for r in stats["replicas"]} == {"http://r:1": 3, "http://o:1": 1}
    text = prometheus_text(stats)
    assert "burstrl_router_fleet_thrash 4.0" in text
    assert "burstrl_router_versions_in_use 2" in text
    assert 'burstrl_router_version_live_sessions{version="policy-v1"} 2' in text
    assert 'burstrl_router_replica_thrash{replica="http://r:1",pool="reserved"} 3.0' in text


def test_evicted_session_counts_at_its_context_size_and_token_in_calls_hint_size() -> None:
    reg = two_pools(("base",), ("base",))
    loads = scraped(("base",))
    loads["sessions"] = [{"session_id": "e", "version": "base", "tokens": 0, "context_tokens": 900}]
    reg.apply_scrape("http://r:1", loads, models(("base",)))
    assert reg.replicas["http://r:1"].live_sessions == {"e": 900}
    assert first_call_tokens({"input_ids": [1] * 40, "max_tokens": 16}) == 56
    assert first_call_tokens({"prompt": "text", "max_tokens": 16}) == 0


# --- live: router + three real replicas ----------------------------------------------------


def load_adapter(server: Server, name: str, path: Path) -> None:
    r = HTTP.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                  headers=server.admin(), timeout=60)
    assert r.status_code == 200, r.text


def call(router_url: str, sid: str, model: str = "latest") -> httpx.Response:
    body = {"model": model, "prompt": f"turn of {sid}", "max_tokens": 3, "temperature": 0, "session_id": sid}
    r = HTTP.post(router_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def wait_for_latest(router_url: str, version: str, timeout: float = 30.0) -> None:
    """Poll `/v1/stats` until the router's scrapes show `version` as the newest routable one."""
    deadline = time.monotonic() + timeout
    latest = None
    while time.monotonic() < deadline:
        latest = HTTP.get(router_url + "/v1/stats", timeout=10).json()["versions"]["latest"]
        if latest == version:
            return
        time.sleep(0.1)
    raise AssertionError(f"router still routes latest to {latest!r}, expected {version!r}")


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll `condition` until it holds; fail after `timeout` (generous: the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def trace_version(server: Server, sid: str) -> str | None:
    r = HTTP.get(server.url + f"/v1/traces/{sid}", headers=server.admin(), timeout=10)
    return r.json()["version"] if r.status_code == 200 else None


@pytest.mark.slow  # two replicas, three versions pushed: ~15-20 s
def test_rollout_gates_latest_and_keeps_old_sessions(tiny_model_dir: Path, adapters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda i: start_replica(tiny_model_dir, tmp_path / f"r{i}"), range(3)))
    router = None
    try:
        router = start_router(tmp_path / "router", "--scrape_s", "0.2", "--request_timeout_s", "60")
        reserved, od_a, od_b = servers
        for server, pool_name in ((reserved, "reserved"), (od_a, "on_demand"), (od_b, "on_demand")):
            load_adapter(server, "policy-v1", adapters["policy-v1"])
            r = HTTP.post(router.url + "/v1/replicas", json={"url": server.url, "pool": pool_name},
                          headers=AUTH, timeout=30)
            assert r.status_code == 201, r.text
        wait_for_latest(router.url, "policy-v1")

        old = call(router.url, "old-session")
        assert old.headers[VERSION_HEADER] == "policy-v1"
        old_home = next(s for s in servers if trace_version(s, "old-session") == "policy-v1")

        load_adapter(reserved, "policy-v2", adapters["policy-v2"])  # the on-demand pool lacks v2
        wait_until(lambda: "policy-v2" in [m["id"] for m in HTTP.get(router.url + "/v1/models",
                                                                     timeout=10).json()["data"]])
        for i in range(4):
            assert call(router.url, f"mid-{i}").headers[VERSION_HEADER] == "policy-v1"
        assert call(router.url, "old-session").headers[VERSION_HEADER] == "policy-v1"

        load_adapter(od_a, "policy-v2", adapters["policy-v2"])
        wait_for_latest(router.url, "policy-v2")
        placed = []
        for i in range(6):
            r = call(router.url, f"new-{i}")
            assert r.headers[VERSION_HEADER] == "policy-v2"
            assert trace_version(od_b, f"new-{i}") is None  # od_b lacks v2: never chosen
            placed.append(next(s for s in (reserved, od_a) if trace_version(s, f"new-{i}") == "policy-v2"))
        assigned = HTTP.post(router.url + "/v1/assign", json={"session_id": "assigned-new"}, timeout=10).json()
        assert assigned["version"] == "policy-v2" and assigned["url"] in (reserved.url, od_a.url)

        for _ in range(2):  # the old session still runs on v1, on the replica it started on
            assert call(router.url, "old-session").headers[VERSION_HEADER] == "policy-v1"
        assert len(old_home.get("/v1/traces/old-session")["calls"]) == 4
        conflict = HTTP.post(router.url + "/v1/completions", json={"model": "policy-v2", "prompt": "x",
                                                                    "max_tokens": 1, "session_id": "old-session"},
                             timeout=30)
        assert conflict.status_code == 409

        def spread() -> dict:
            return HTTP.get(router.url + "/v1/stats", timeout=10).json()["versions"]["live_sessions"]

        # a scrape after the calls (with the cluster token, so the replicas list their sessions)
        wait_until(lambda: spread().get("policy-v2", 0) >= 6 and spread().get("policy-v1", 0) >= 5)
        stats = HTTP.get(router.url + "/v1/stats", timeout=10).json()
        assert stats["versions"]["in_use"] == 2
        assert all("thrash" in r and "cache_hit_rate" in r for r in stats["replicas"])
        assert stats["totals"]["rehomes"] == 0
        metrics = HTTP.get(router.url + "/metrics", timeout=10).text
        assert 'burstrl_router_version_live_sessions{version="policy-v2"}' in metrics
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            stop_server(s)
