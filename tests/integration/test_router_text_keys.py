"""Chat prompts' text prefix keys (router/text_keys.py) against real replicas: a GRPO group of G chat
sessions with one first prompt, submitted together, lands on one replica, whose prefix cache serves the
siblings; sessions with different prompts are still spread by load."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.http_client import HTTP

# Three replica processes and a router (~30 s): `make test` runs it; the fast lane keeps the unit tests
# (tests/unit/test_router_text_keys.py).
pytestmark = pytest.mark.slow

from .conftest import routed_replicas

TOKEN = "text-keys-cluster-token"
G, GROUPS = 4, 3
WORDS = "apple river stone cloud seven orange quiet table music bridge lamp forest".split()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with routed_replicas(tiny_model_dir, tmp_path_factory.mktemp("router-text-keys"), 3,
                         ("--server.cluster_token", TOKEN),
                         ("--cluster_token", TOKEN, "--policy", "kv", "--scrape_s", "0.3")) as fleet:
        yield fleet


def prompt(rng: random.Random) -> list[dict[str, str]]:
    """A first prompt of ~1000 tokens by the router's estimate: enough to outweigh G-1 siblings' load."""
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(600))}]


def run_session(router_url: str, sid: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    """One session's first call through the router: its home and the tokens its replica had cached."""
    body = {"model": "base", "messages": messages, "max_tokens": 4, "temperature": 1.0, "session_id": sid}
    r = HTTP.post(router_url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    home = HTTP.post(router_url + "/v1/assign", json={"session_id": sid}, timeout=60).json()["url"]
    return home, cached


def run_all(router_url: str, sessions: list[tuple[str, list[dict[str, str]]]]) -> list[tuple[str, int]]:
    with ThreadPoolExecutor(len(sessions)) as pool:
        return list(pool.map(lambda s: run_session(router_url, *s), sessions))


def test_a_group_shares_a_replica_and_its_cache_while_other_prompts_spread(fleet):
    router, servers = fleet
    rng = random.Random(0)
    for wave in range(2):  # two waves of GROUPS groups, each wave submitted at once
        prompts = [prompt(rng) for _ in range(GROUPS)]
        sessions = [(f"w{wave}-g{g}-{i}", prompts[g]) for g in range(GROUPS) for i in range(G)]
        results = run_all(router.url, sessions)
        homes = [{results[g * G + i][0] for i in range(G)} for g in range(GROUPS)]
        assert all(len(h) == 1 for h in homes), homes  # every group on one replica
        assert len(set().union(*homes)) >= 2, homes  # and the groups themselves spread by load
        # the replica copies a finished sibling's prompt (measured: 3 of 4 siblings, ~1550 cached tokens each;
        # with router.text_prefix_keys off the groups spread over all 3 replicas)
        assert all(any(results[g * G + i][1] > 0 for i in range(G)) for g in range(GROUPS)), results
    # the honest control: sessions with different first prompts are placed by load, not piled up
    spread = run_all(router.url, [(f"solo-{i}", prompt(rng)) for i in range(GROUPS * G)])
    assert len({home for home, _ in spread}) >= 2, spread
