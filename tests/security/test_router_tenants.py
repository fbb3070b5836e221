"""Tenants sharing a router and its replicas (issue 51): what one tenant must never reach of another's.

A router in front of two replicas, all with the same tenant key; tenants `run-a` and `run-b` call
through the router only. Each attack comes with an honest control that must pass, so a test cannot
pass because the feature broke (nothing routable, no traces, no cache). The replica-side attacks
(cached-token probing, uploads into another namespace) are tests/security/test_tenant_isolation.py;
the mapping itself is tests/unit/test_router_tenancy.py. Without `tenant_key` the router is as
before: every other router test runs without it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from burstrl.protocol import process
from burstrl.protocol.process import RoleProcess
from burstrl.protocol.tenants import tenant_token
from burstrl.router.server import VERSION_HEADER
from burstrl.weights.push import ReplicaTarget, push
from tests.http_client import HTTP

from ..integration.conftest import ADMIN_TOKEN, Server, start_server, stop_server

KEY = "router-tenants-key"
CLUSTER = "router-tenants-cluster"
A, B = tenant_token(KEY, "run-a"), tenant_token(KEY, "run-b")
FORGED = (None, "run-a", "run-a." + "0" * 64, "run-a." + B.partition(".")[2], tenant_token("another-key", "run-a"),
          "wrong")
CHAT = {"model": "latest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "latest", "prompt": [5, 6, 7], "max_tokens": 4}
GENERATE = {"model": "latest", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}}


@dataclass
class Fleet:
    router: RoleProcess
    replicas: list[Server]

    def url(self, path: str) -> str:
        return self.router.url + path


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("router-tenants")
    tenancy = ("--server.tenant_key", KEY, "--server.cluster_token", CLUSTER)
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda i: start_server(tiny_model_dir, root / f"r{i}", *tenancy), range(2)))
    router = None
    try:
        router = process.start_router(root / "router", "--cluster_token", CLUSTER, "--tenant_key", KEY,
                                      "--replicas", json.dumps([s.url for s in replicas]), "--scrape_s", "0.5")
        yield Fleet(router, replicas)
    finally:
        if router is not None:
            router.stop()
        for s in replicas:
            stop_server(s)


@pytest.fixture(scope="module")
def policy_v1(fleet: Fleet, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tenant A's `policy-v1`, pushed to both replicas with A's token, once the router has scraped it."""
    from burstrl.model.lora import make_random_adapter

    adapter = make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("router-tenant-adapter") / "v1", seed=1)
    report = push(adapter, "policy-v1", [ReplicaTarget(s.url, A) for s in fleet.replicas])
    assert report.failed == {}, report
    deadline = time.monotonic() + 30
    while "policy-v1" not in models(fleet, A):
        assert time.monotonic() < deadline, "the router never scraped A's policy-v1"
        time.sleep(0.2)
    return "policy-v1"


def auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def post(fleet: Fleet, token: str | None, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return HTTP.post(fleet.url(path), json=body, headers=auth(token), timeout=120)


def complete(fleet: Fleet, token: str, ids: list[int], sid: str | None = None, model: str = "latest",
             **extra: Any) -> httpx.Response:
    """A greedy token-in completion through the router (in session `sid`), which must succeed."""
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if sid is not None:
        body["session_id"] = sid
    r = post(fleet, token, body)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def trace(fleet: Fleet, token: str | None, sid: str, method: str = "GET") -> httpx.Response:
    return HTTP.request(method, fleet.url(f"/v1/traces/{sid}"), headers=auth(token), timeout=30)


def models(fleet: Fleet, token: str | None) -> list[str]:
    r = HTTP.get(fleet.url("/v1/models"), headers=auth(token), timeout=30)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def assign(fleet: Fleet, token: str | None, sid: str, version: str = "latest") -> httpx.Response:
    return HTTP.post(fleet.url("/v1/assign"), json={"session_id": sid, "version": version}, headers=auth(token),
                     timeout=30)


def sessions(fleet: Fleet) -> int:
    """Sessions in the router's table (`/v1/stats`)."""
    return HTTP.get(fleet.url("/v1/stats"), timeout=30).json()["totals"]["sessions"]


def refused(r: httpx.Response) -> bool:
    return r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/inference/v1/generate", GENERATE)])
def test_generation_through_the_router_needs_a_tenant_token(fleet: Fleet, path: str, body: dict[str, Any]) -> None:
    for token in (*FORGED, CLUSTER, ADMIN_TOKEN):  # the replicas' admin token is not the router's to honour
        assert refused(post(fleet, token, body, path)), token
    r = post(fleet, A, body, path)  # control: a tenant's call is forwarded with its own bearer
    assert r.status_code == 200 and r.headers[VERSION_HEADER] == "base", r.text


def test_every_tenant_route_refuses_a_bad_token(fleet: Fleet) -> None:
    for token in FORGED:
        assert refused(assign(fleet, token, "s-refused")), token
        assert refused(HTTP.get(fleet.url("/v1/models"), headers=auth(token), timeout=30)), token
        for method in ("GET", "DELETE"):
            assert refused(trace(fleet, token, "s-refused", method)), (token, method)
    assert refused(assign(fleet, CLUSTER, "s-refused"))  # the cluster token places no sessions
    # controls: a tenant; the router's cluster token keeps its replica routes and reads models
    assert assign(fleet, A, "s-refused").status_code == 200
    assert "base" in models(fleet, CLUSTER)
    assert HTTP.get(fleet.url("/v1/replicas"), timeout=30).status_code == 200
    r = HTTP.post(fleet.url("/v1/replicas/drain"), json={"url": "http://127.0.0.1:1"}, headers=auth(A), timeout=30)
    assert r.status_code == 401  # a tenant token is no cluster token


def test_reusing_another_tenants_session_id_is_a_new_session(fleet: Fleet) -> None:
    sid, mine = "reused-sid", [5, 6, 7, 8]
    first = complete(fleet, A, mine, sid)
    before = trace(fleet, A, sid).json()
    assert len(before["calls"]) == 1
    placed = sessions(fleet)
    theirs = complete(fleet, B, [9, 10, 11], sid)  # placed as B's own session, not on A's history
    assert sessions(fleet) == placed + 1  # a new entry in the router's session table, not A's
    assert cached(theirs) == 0 and theirs.json()["meta_info"]["session_id"] == sid
    b_trace = trace(fleet, B, sid).json()
    assert [c["prompt_ids"] for c in b_trace["calls"]] == [[9, 10, 11]]
    after = trace(fleet, A, sid).json()
    assert after["calls"] == before["calls"] and after["replica"] == before["replica"]  # A's capture unchanged
    # control: A's next call continues on A's home, on A's cached tokens
    second = complete(fleet, A, mine + first.json()["choices"][0]["token_ids"] + [12], sid)
    assert cached(second) > 0
    again = trace(fleet, A, sid).json()
    assert len(again["calls"]) == 2 and again["replica"] == before["replica"]
    # the replicas got each tenant's own bearer: they stored both sessions in their tenants' namespaces
    stored = {r.url: {name: HTTP.get(r.url + f"/v1/traces/{name}", headers=r.admin(), timeout=30).status_code
                      for name in (sid, f"run-a~{sid}", f"run-b~{sid}")} for r in fleet.replicas}
    assert all(codes[sid] == 404 for codes in stored.values()), stored
    assert stored[before["replica"]][f"run-a~{sid}"] == 200 and stored[b_trace["replica"]][f"run-b~{sid}"] == 200


def test_another_tenants_traces_are_unknown_through_the_router(fleet: Fleet) -> None:
    sid = "trace-a"
    complete(fleet, A, [5, 6, 7], sid)
    complete(fleet, A, [5, 6, 7], "group", n=2, temperature=1.0, seed=3)
    for name in (sid, f"run-a~{sid}", "group/0"):
        for method in ("GET", "DELETE"):
            r = trace(fleet, B, name, method)
            assert r.status_code == 404 and "run-a" not in r.json()["error"]["message"].replace(name, ""), r.text
    # controls: the router's cluster token reads it by its stored name; A reads and releases its own
    assert trace(fleet, CLUSTER, f"run-a~{sid}").status_code == 200
    assert trace(fleet, A, "group/0").status_code == 200
    got = trace(fleet, A, sid)
    assert got.status_code == 200 and got.json()["session_id"] == sid and len(got.json()["calls"]) == 1
    r = trace(fleet, A, sid, "DELETE")
    assert r.status_code == 200 and r.json()["released"] is True, r.text
    assert trace(fleet, A, sid).status_code == 404


def test_a_tenants_latest_is_its_own(fleet: Fleet, policy_v1: str) -> None:
    ours = complete(fleet, A, [5, 6, 7])
    assert ours.headers[VERSION_HEADER] == policy_v1 and ours.json()["model"] == policy_v1
    theirs = complete(fleet, B, [5, 6, 7])
    assert theirs.headers[VERSION_HEADER] == "base" and theirs.json()["model"] == "base"
    assert models(fleet, A) == ["base", policy_v1] and models(fleet, B) == ["base"]
    assert "run-a~policy-v1" in models(fleet, CLUSTER)
    # B can neither name A's version nor see its name in the error
    for model in (policy_v1, "run-a~policy-v1"):
        r = post(fleet, B, {**COMPLETION, "model": model})
        assert r.status_code == 404 and "run-a" not in r.json()["error"]["message"].replace(model, ""), r.text
    assert assign(fleet, A, "assigned-latest").json()["version"] == policy_v1
    assert assign(fleet, B, "assigned-latest").json()["version"] == "base"


def test_pins_and_assignments_are_per_tenant(fleet: Fleet, policy_v1: str) -> None:
    sid = "pinned-sid"
    mine = assign(fleet, A, sid, policy_v1)
    assert mine.status_code == 200 and mine.json() == {"url": mine.json()["url"], "session_id": sid,
                                                       "version": policy_v1}
    r = post(fleet, A, {**COMPLETION, "model": "base", "session_id": sid})
    assert r.status_code == 409 and r.json()["error"]["message"] == \
        f"session '{sid}' is pinned to '{policy_v1}', not 'base'", r.text
    # B's session of the same id is B's: its own pin (base), not A's pin
    theirs = assign(fleet, B, sid)
    assert theirs.status_code == 200 and theirs.json()["version"] == "base"
    assert complete(fleet, B, [5, 6, 7], sid, model="base").headers[VERSION_HEADER] == "base"
    # control: A's call runs on A's pin, on the replica A was assigned
    done = complete(fleet, A, [5, 6, 7], sid)
    assert done.headers[VERSION_HEADER] == policy_v1
    assert trace(fleet, A, sid).json()["replica"] == mine.json()["url"]


OPEN_READS = ("/v1/replicas", "/v1/stats", "/metrics")


def read(fleet: Fleet, path: str, token: str | None) -> httpx.Response:
    r = HTTP.get(fleet.url(path), headers=auth(token), timeout=30)
    assert r.status_code == 200, (path, token, r.text)  # open routes: a launcher's sample, fleet status, Prometheus
    return r


def test_open_read_routes_show_a_tenants_versions_to_that_tenant_only(fleet: Fleet, policy_v1: str) -> None:
    """`/v1/replicas`, `/v1/stats` and `/metrics` need no token, and listed every version as stored
    (`run-a~policy-v1`) to anyone: B, a forged token or nobody must not learn A's names from them."""
    sid = "open-read-a"
    complete(fleet, A, [5, 6, 7], sid, model=policy_v1)  # a live session on A's version: per-version stats
    deadline = time.monotonic() + 30
    while f"run-a~{policy_v1}" not in read(fleet, "/v1/stats", CLUSTER).json()["versions"]["live_sessions"]:
        assert time.monotonic() < deadline, "the router never scraped A's live session"
        time.sleep(0.2)
    for token in (*FORGED, B, ADMIN_TOKEN):
        for path in OPEN_READS:
            text = read(fleet, path, token).text
            assert "run-a" not in text and policy_v1 not in text, (path, token, text[:2000])
        replicas = read(fleet, "/v1/replicas", token).json()["replicas"]
        assert len(replicas) == 2 and all(r["versions"] == ["base"] and r["healthy"] for r in replicas), replicas
        stats = read(fleet, "/v1/stats", token).json()
        assert stats["versions"]["latest"] == "base" and set(stats["versions"]["live_sessions"]) <= {"base"}
        assert stats["totals"]["sessions"] >= 1 and len(stats["replicas"]) == 2  # counts stay: they name nobody
    # controls: A sees its own version as it knows it, and its own latest; the cluster token every name as stored
    for path in OPEN_READS:
        text = read(fleet, path, A).text
        assert policy_v1 in text and "run-a~" not in text, (path, text[:2000])
    assert all(r["versions"] == ["base", policy_v1] for r in read(fleet, "/v1/replicas", A).json()["replicas"])
    mine = read(fleet, "/v1/stats", A).json()["versions"]
    assert mine["latest"] == policy_v1 and mine["live_sessions"][policy_v1] >= 1, mine
    assert f'version="{policy_v1}"' in read(fleet, "/metrics", A).text
    everything = read(fleet, "/v1/stats", CLUSTER).json()
    assert everything["versions"]["latest"] == f"run-a~{policy_v1}"
    assert all(f"run-a~{policy_v1}" in r["versions"] for r in everything["replicas"])
    assert f"run-a~{policy_v1}" in read(fleet, "/v1/replicas", CLUSTER).text
    assert f'version="run-a~{policy_v1}"' in read(fleet, "/metrics", CLUSTER).text
    assert trace(fleet, A, sid, "DELETE").status_code == 200
