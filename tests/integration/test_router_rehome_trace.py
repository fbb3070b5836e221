"""A session the default policy moves off its home (overflowing, or nearly full) keeps its whole
capture: real replicas.

The old home holds the calls it served; the router's trace GET concatenates every home's part in
order (the orchestrator refuses a trace with a call missing, so without this every such move would
cost a whole rollout), and its DELETE releases every part.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from burstrl.protocol import process
from tests.http_client import HTTP
from tests.waiting import wait_for

from .conftest import ADMIN_TOKEN, start_server, stop_server

TOKEN = "rehome-cluster-token"
CLUSTER = {"Authorization": f"Bearer {TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def two_replicas_and_router(model_dir: Path, tmp_path: Path, small_budget: int):
    small = start_server(model_dir, tmp_path / "small", "--server.cluster_token", TOKEN,
                         "--engine.max_total_num_tokens", str(small_budget))
    big = router = None
    try:
        big = start_server(model_dir, tmp_path / "big", "--server.cluster_token", TOKEN)
        router = process.start_router(tmp_path / "router", "--cluster_token", TOKEN, "--policy", "kv",
                                      "--scrape_s", "0.3", "--replicas", f'["{small.url}"]')
        yield router, small, big
    finally:
        if router is not None:
            router.stop()
        for s in (small, big):
            if s is not None:
                stop_server(s)


@pytest.fixture()
def small_and_big(tiny_model_dir: Path, tmp_path: Path):
    yield from two_replicas_and_router(tiny_model_dir, tmp_path, 700)


@pytest.fixture()
def crowded_and_big(tiny_model_dir: Path, tmp_path: Path):
    yield from two_replicas_and_router(tiny_model_dir, tmp_path, 2000)


def complete(url: str, ids: list[int], session: str) -> list[int]:
    body = {"model": "base", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "session_id": session}
    r = HTTP.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def router_stats(router_url: str) -> dict:
    return HTTP.get(router_url + "/v1/stats", timeout=30).json()


def start_s_on_small_then_crowd_it(router, small, big, rng: random.Random, tokens: int, crowd: int,
                                   crowd_tokens: int) -> tuple[list[int], list[int]]:
    """Session `s`'s first call through the router (the small replica is the only one yet), then the
    big replica joins and `crowd` sessions sent straight to the small one fill it; (prompt, output)."""
    first = [rng.randrange(100, 1500) for _ in range(tokens)]
    out = complete(router.url, first, "s")
    HTTP.post(router.url + "/v1/replicas", json={"url": big.url}, headers=CLUSTER, timeout=30).raise_for_status()
    for i in range(crowd):
        complete(small.url, [rng.randrange(100, 1500) for _ in range(crowd_tokens)], f"crowd{i}")
    return first, out


def capture_spans_both_then_released(router, small, big, prompts: list[list[int]], first_out: list[int]) -> None:
    """Session `s` moved from `small` to `big`: its trace through the router is both parts in order,
    and a DELETE releases both (the router forgets it)."""
    trace = HTTP.get(router.url + "/v1/traces/s?full=true", headers=ADMIN, timeout=30).json()
    assert trace["replicas"] == [small.url, big.url] and trace["replica"] == big.url
    assert [c["prompt_ids"] for c in trace["calls"]] == prompts
    assert trace["calls"][0]["completion_ids"] == first_out
    released = HTTP.delete(router.url + "/v1/traces/s", headers=ADMIN, timeout=30)
    assert released.status_code == 200 and released.json()["replicas"] == [small.url, big.url]
    for url in (small.url, big.url, router.url):  # every part released, and the router forgot it
        assert HTTP.get(url + "/v1/traces/s", headers=ADMIN, timeout=30).status_code == 404


@pytest.mark.slow  # two replicas and a router of its own (~20 s)
def test_a_session_moved_on_overflow_keeps_its_whole_capture(small_and_big):
    router, small, big = small_and_big
    rng = random.Random(0)
    # two other sessions fill the small replica: the idle session's cache is evicted
    first, out = start_s_on_small_then_crowd_it(router, small, big, rng, 300, crowd=2, crowd_tokens=300)
    evicted = HTTP.get(small.url + "/v1/loads", headers=CLUSTER, timeout=30).json()["sessions"]
    assert {"s": 0} == {x["session_id"]: x["tokens"] for x in evicted if x["session_id"] == "s"}
    wait_for(lambda: all(r["evictions"] > 0 or r["url"] != small.url for r in router_stats(router.url)["replicas"])
             and len(router_stats(router.url)["replicas"]) == 2, 60, "the router to scrape the eviction")
    second = first + out + [rng.randrange(100, 1500) for _ in range(20)]
    complete(router.url, second, "s")
    assert router_stats(router.url)["totals"]["rehomes_overflow"] == 1
    capture_spans_both_then_released(router, small, big, [first, second], out)


@pytest.mark.slow  # two replicas and a router of its own (~20 s)
def test_a_small_session_leaves_a_nearly_full_home_before_anything_is_evicted(crowded_and_big):
    # the pressure move (KvAwarePolicy.relieve): the home's live context passes 0.9 of its budget
    # (2000 tokens) with no eviction yet; the small session calling next moves, capture whole
    router, small, big = crowded_and_big
    rng = random.Random(1)
    # 3 x 604 idle tokens: 1916 live with s, above 0.9 x 2000, nothing evicted
    first, out = start_s_on_small_then_crowd_it(router, small, big, rng, 100, crowd=3, crowd_tokens=600)
    small_loads = HTTP.get(small.url + "/v1/loads", headers=CLUSTER, timeout=30).json()
    assert small_loads["evictions"] == 0 and len(small_loads["sessions"]) == 4

    def scraped() -> bool:  # a scrape after the last crowd call ended (one during it lists that session at 0 tokens)
        views = {r["url"]: r for r in router_stats(router.url)["replicas"]}
        return (big.url in views and views[big.url]["capacity_tokens"] > 0 and views[small.url]["live_sessions"] == 4
                and views[small.url]["used_tokens"] == small_loads["num_used_tokens"])

    wait_for(scraped, 60, "the router to scrape the crowded home and the new replica")
    second = first + out + [rng.randrange(100, 1500) for _ in range(20)]
    complete(router.url, second, "s")
    totals = router_stats(router.url)["totals"]
    assert totals["rehomes_pressure"] == 1 and totals["rehomes_overflow"] == 0
    assert HTTP.get(small.url + "/v1/loads", headers=CLUSTER, timeout=30).json()["evictions"] == 0
    capture_spans_both_then_released(router, small, big, [first, second], out)
