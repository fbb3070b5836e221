"""`burstrl route serve` in front of real replicas on loopback: affinity, proxying, failover, registry.

The tests share one router and four replicas (three registered at start, one kept back to be
registered later) and run in file order: the failover test kills a replica, the last one adds one.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from burstrl.inference import process
from burstrl.inference.process import RoleProcess

from .conftest import Server, start_server, stop_server

TOKEN = "test-cluster-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start_router(workdir: Path, *overrides: str, timeout: float = 60.0) -> RoleProcess:
    """`burstrl route serve --port 0 ...` as a child process group, with the test's cluster token."""
    return process.start_router(workdir, "--cluster_token", TOKEN, *overrides, timeout=timeout)


@dataclass
class Cluster:
    router: RoleProcess
    replicas: list[Server]  # the first three are registered at start
    spare: Server

    def url(self, path: str) -> str:
        return self.router.url + path

    def stats(self) -> dict:
        return httpx.get(self.url("/v1/stats"), timeout=10).json()

    def home_of(self, sid: str) -> Server:
        """The replica that holds the session's trace (exactly one must)."""
        found = [s for s in self.replicas + [self.spare]
                 if s.replica.proc.poll() is None and httpx.get(s.url + f"/v1/traces/{sid}", timeout=10).status_code == 200]
        assert len(found) == 1, f"session {sid} found on {len(found)} replicas"
        return found[0]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("router")
    with ThreadPoolExecutor(4) as pool:
        servers = list(pool.map(lambda i: start_server(tiny_model_dir, root / f"r{i}"), range(4)))
    router = None
    try:
        urls = json.dumps([s.url for s in servers[:3]])
        router = start_router(root / "router", "--replicas", urls, "--scrape_s", "0.5",
                              "--request_timeout_s", "60")
        yield Cluster(router=router, replicas=servers[:3], spare=servers[3])
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            stop_server(s)


def complete(cluster: Cluster, sid: str, prompt: str = "Once upon a time", **kw) -> dict:
    body = {"model": "base", "prompt": prompt, "max_tokens": 4, "temperature": 0, "session_id": sid, **kw}
    r = httpx.post(cluster.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_models_and_replicas(cluster: Cluster) -> None:
    assert httpx.get(cluster.url("/health"), timeout=10).json()["status"] == "ok"
    assert [m["id"] for m in httpx.get(cluster.url("/v1/models"), timeout=10).json()["data"]] == ["base"]
    listed = httpx.get(cluster.url("/v1/replicas"), timeout=10).json()["replicas"]
    assert sorted(r["url"] for r in listed) == sorted(s.url for s in cluster.replicas)


def test_sessions_stick_to_one_replica(cluster: Cluster) -> None:
    for sid in ("stick-a", "stick-b", "stick-c"):
        for i in range(3):
            complete(cluster, sid, prompt=f"call {i} of {sid}")
    for sid in ("stick-a", "stick-b", "stick-c"):
        home = cluster.home_of(sid)
        assert len(home.get(f"/v1/traces/{sid}")["calls"]) == 3
    # the session header works as well as the body field
    r = httpx.post(cluster.url("/v1/completions"), headers={"X-Session-ID": "stick-a"},
                   json={"model": "base", "prompt": "via header", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(cluster.home_of("stick-a").get("/v1/traces/stick-a")["calls"]) == 4


def test_openai_client_sync_and_streaming(cluster: Cluster) -> None:
    client = OpenAI(base_url=cluster.url("/v1"), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="base", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"session_id": "oa-sync"})
    assert r.usage.completion_tokens == 6
    stream = client.chat.completions.create(model="base", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"session_id": "oa-stream"})
    text = "".join(ch.delta.content or "" for chunk in stream for ch in chunk.choices)
    assert text == r.choices[0].message.content
    assert len(cluster.home_of("oa-stream").get("/v1/traces/oa-stream")["calls"]) == 1
    legacy = client.completions.create(model="base", prompt="Hello", max_tokens=3)  # no session: least loaded
    assert legacy.usage.completion_tokens == 3


def test_assign_returns_a_registered_replica(cluster: Cluster) -> None:
    r = httpx.post(cluster.url("/v1/assign"), json={"session_id": "assigned", "version": "base",
                                                    "expected_tokens": 100}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["url"] in [s.url for s in cluster.replicas]
    again = httpx.post(cluster.url("/v1/assign"), json={"session_id": "assigned", "version": "base"}, timeout=10)
    assert again.json()["url"] == r.json()["url"]
    latest = httpx.post(cluster.url("/v1/assign"), json={"session_id": "x"}, timeout=10)  # no version: latest
    assert latest.status_code == 200 and latest.json()["version"] == "base", latest.text
    bad = httpx.post(cluster.url("/v1/assign"), json={"version": "base"}, timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()


def test_unknown_model_is_404(cluster: Cluster) -> None:
    r = httpx.post(cluster.url("/v1/completions"), json={"model": "nope", "prompt": "x", "session_id": "u"},
                   timeout=10)
    assert r.status_code == 404
    assert "nope" in r.json()["error"]["message"]


def test_registration_needs_the_token_and_an_http_url(cluster: Cluster) -> None:
    body = {"url": cluster.spare.url, "pool": "on_demand", "weight": 1, "capacity_tokens": 0}
    assert httpx.post(cluster.url("/v1/replicas"), json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(cluster.url("/v1/replicas"), json=body, headers=wrong, timeout=10).status_code == 401
    r = httpx.post(cluster.url("/v1/replicas"), json={**body, "url": "file:///etc/passwd"}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and "http" in r.json()["error"]["message"]
    assert httpx.delete(cluster.url("/v1/replicas"), params={"url": cluster.spare.url}, timeout=10).status_code == 401


def test_killed_replica_sessions_continue_elsewhere(cluster: Cluster) -> None:
    complete(cluster, "victim")
    home = cluster.home_of("victim")
    before = cluster.stats()["totals"]["rehomes"]
    home.replica.stop()
    out = complete(cluster, "victim", prompt="after the crash")
    assert out["choices"][0]["text"] is not None
    new_home = cluster.home_of("victim")
    assert new_home is not home
    assert cluster.stats()["totals"]["rehomes"] == before + 1
    assert home.url not in [r["url"] for r in cluster.stats()["replicas"]]
    metrics = httpx.get(cluster.url("/metrics"), timeout=10).text
    assert f"burstrl_router_rehomes_total {before + 1}" in metrics


def test_newly_registered_replica_receives_new_sessions(cluster: Cluster) -> None:
    body = {"url": cluster.spare.url, "pool": "on_demand", "weight": 1, "capacity_tokens": 0}
    r = httpx.post(cluster.url("/v1/replicas"), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 201, r.text
    assert r.json()["versions"] == ["base"]
    placed = [httpx.post(cluster.url("/v1/assign"), json={"session_id": f"fresh-{i}", "version": "base"},
                         timeout=10).json()["url"] for i in range(12)]
    assert cluster.spare.url in placed
    sid = f"fresh-{placed.index(cluster.spare.url)}"
    complete(cluster, sid)
    assert cluster.home_of(sid) is cluster.spare
    gone = httpx.delete(cluster.url("/v1/replicas"), params={"url": cluster.spare.url}, headers=AUTH, timeout=10)
    assert gone.status_code == 200
    assert cluster.spare.url not in [x["url"] for x in httpx.get(cluster.url("/v1/replicas"), timeout=10).json()["replicas"]]
