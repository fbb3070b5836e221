"""The router's prefix index against real replicas: the replica's `/v1/loads` block summary speaks the
router's keys, and the default `kv` policy sends a prompt (with or without a session) where it is cached."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from burstrl.protocol.blocks import BLOCK_TOKENS, prefix_block_hashes
from tests.http_client import HTTP
from tests.waiting import wait_for

# Two replica processes and a router for one test (~19 s of the fast lane's time): `make test` runs
# it; the fast lane keeps the index's unit tests (tests/unit/test_prefix.py, test_router_policies.py).
pytestmark = pytest.mark.slow

from .conftest import routed_replicas

TOKEN = "prefix-cluster-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with routed_replicas(tiny_model_dir, tmp_path_factory.mktemp("router-prefix"), 2,
                         ("--server.cluster_token", TOKEN),
                         ("--cluster_token", TOKEN, "--policy", "kv", "--scrape_s", "0.3")) as pair:
        yield pair


def summary(url: str) -> set[int]:
    loads = HTTP.get(url + "/v1/loads", headers=AUTH, timeout=30).json()
    assert loads["prefix_blocks"]["block_tokens"] == BLOCK_TOKENS
    return set(loads["prefix_blocks"]["hashes"])


def complete(router_url: str, ids: list[int], session: str | None) -> None:
    body = {"model": "base", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if session is not None:
        body["session_id"] = session
    HTTP.post(router_url + "/v1/completions", json=body, timeout=120).raise_for_status()


def queried(urls: list[str]) -> list[int]:
    return [HTTP.get(u + "/v1/loads", timeout=30).json()["prefix_cache_queries_tokens"] for u in urls]


def test_summary_holds_the_routers_keys_and_kv_follows_them(pair):
    router, servers = pair
    urls = [s.url for s in servers]
    anonymous = HTTP.get(urls[0] + "/v1/loads", timeout=30).json()
    assert "prefix_blocks" not in anonymous  # what is cached is for the fleet, not for anyone
    rng = random.Random(0)
    for i in range(2):
        prompt = [rng.randrange(100, 1500) for _ in range(32 * BLOCK_TOKENS + 5)]
        keys = set(prefix_block_hashes(prompt, "base"))
        complete(router.url, prompt, f"a{i}")
        home = HTTP.post(router.url + "/v1/assign", json={"session_id": f"a{i}"}, timeout=30).json()["url"]
        assert keys <= summary(home)  # the replica reports every full block of the prompt it holds
        other = next(u for u in urls if u != home)
        assert not keys & summary(other)
        # scraped or not, the router knows: a new session with the same first prompt goes there,
        complete(router.url, prompt + [7, 8, 9], f"b{i}")
        assert HTTP.post(router.url + "/v1/assign", json={"session_id": f"b{i}"}, timeout=30).json()["url"] == home
        # and so does a call without a session (it is placed by the policy, not by load alone)
        before = queried(urls)
        complete(router.url, prompt + [10, 11], None)
        wait_for(lambda b=before: queried(urls) != b, 60, "the call to be counted")
        after = queried(urls)
        assert after[urls.index(home)] > before[urls.index(home)] and after[urls.index(other)] == before[urls.index(other)]
