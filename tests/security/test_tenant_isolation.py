"""Tenants sharing one replica (issue 51): what one tenant must never reach of another's.

One replica with `server.tenant_key` set, tenants `run-a` and `run-b`. Each attack comes with an
honest control that must pass, so a test cannot pass because the feature broke (no prefix sharing
at all, no traces at all). The attacks are the ones found from outside before tenants existed: a
session id reused by another client (served on the first client's cache, appended to its
capture), and one-token probes reading another session's prompt from `cached_tokens`.

With tenancy off nothing changes: every other replica test runs without `tenant_key`, among
them tests/integration/test_replica.py::test_a_new_session_reuses_another_sessions_prefix (prefix
sharing across sessions, no token), test_replica_admin.py::test_admin_endpoints_need_the_bearer_token
and the whole of tests/fuzz/test_replica_regressions.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from burstrl.protocol.tenants import tenant_token
from burstrl.weights.push import ReplicaTarget, push
from tests.http_client import HTTP

from ..integration.conftest import ADMIN_TOKEN, Server, start_server, stop_server

KEY = "tenant-isolation-key"
CLUSTER = "tenant-isolation-cluster"
A, B = tenant_token(KEY, "run-a"), tenant_token(KEY, "run-b")
CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "base", "prompt": [5, 6, 7], "max_tokens": 4}
GENERATE = {"model": "base", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("tenants"), "--server.tenant_key", KEY,
                       "--server.cluster_token", CLUSTER)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random LoRA versions of the tiny model, in PEFT format."""
    from burstrl.model.lora import make_random_adapter

    root = tmp_path_factory.mktemp("tenant-adapters")
    return {name: make_random_adapter(tiny_model_dir, root / name, seed=seed)
            for name, seed in (("policy-v1", 1), ("policy-v2", 2))}


def auth(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def post(server: Server, token: str | None, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers=auth(token), timeout=120)


def complete(server: Server, token: str, ids: list[int], sid: str | None = None, **extra: Any) -> dict[str, Any]:
    """A greedy completion of token ids (in session `sid`), which must succeed."""
    body = {"model": "base", "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    if sid is not None:
        body["session_id"] = sid
    r = post(server, token, body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict[str, Any]) -> int:
    got = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert answer["meta_info"]["cached_tokens"] == got
    return got


def trace(server: Server, token: str | None, sid: str) -> httpx.Response:
    return HTTP.get(server.url + f"/v1/traces/{sid}", headers=auth(token), timeout=30)


def models(server: Server, token: str | None) -> list[str]:
    r = HTTP.get(server.url + "/v1/models", headers=auth(token), timeout=30)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/inference/v1/generate", GENERATE)])
def test_generation_needs_a_valid_tenant_token(server: Server, path: str, body: dict[str, Any]) -> None:
    mac_of_b = B.partition(".")[2]
    for token in (None, "run-a", "run-a." + "0" * 64, "run-a." + mac_of_b, tenant_token("another-key", "run-a"),
                  CLUSTER, "wrong"):
        r = post(server, token, body, path)
        assert r.status_code == 401, (token, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert post(server, A, body, path).status_code == 200  # control: a tenant
    assert post(server, ADMIN_TOKEN, body, path).status_code == 200  # the admin keeps full access


def test_reusing_another_tenants_session_id_starts_a_fresh_session(server: Server) -> None:
    sid, mine = "reused-sid", [5, 6, 7, 8]
    first = complete(server, A, mine, sid)
    before = trace(server, A, sid).json()
    assert len(before["calls"]) == 1
    theirs = complete(server, B, [9, 10, 11], sid)  # not an extension of A's history: B is not on A's session
    assert theirs["meta_info"]["session_id"] == sid and cached(theirs) == 0
    [b_call] = trace(server, B, sid).json()["calls"]
    assert b_call["prompt_ids"] == [9, 10, 11]
    after = trace(server, A, sid).json()
    assert after["calls"] == before["calls"] and after["session_id"] == sid  # A's capture unchanged
    # control: A's next call still extends A's own history, on A's own cache
    history = mine + first["choices"][0]["token_ids"]
    second = complete(server, A, history + [12], sid)
    assert cached(second) > 0 and second["meta_info"]["session_id"] == sid
    calls = trace(server, A, sid).json()["calls"]
    assert len(calls) == 2 and all(c.get("prompt_ids") != [9, 10, 11] for c in calls)
    # the admin sees both sessions under their internal names; anyone without a token sees none
    for tenant, n in (("run-a", 2), ("run-b", 1)):
        assert len(trace(server, ADMIN_TOKEN, f"{tenant}~{sid}").json()["calls"]) == n
    sessions = HTTP.get(server.url + "/v1/loads", headers=auth(ADMIN_TOKEN), timeout=30).json()["sessions"]
    assert {"run-a~" + sid, "run-b~" + sid} <= {s["session_id"] for s in sessions}
    assert "sessions" not in HTTP.get(server.url + "/v1/loads", headers=auth(A), timeout=30).json()


def test_cached_tokens_reveal_nothing_across_tenants(server: Server) -> None:
    secret = list(range(300, 364))  # 64 tokens: four KV blocks of 16
    complete(server, A, secret + [5], "secret-a")
    # B probes every block-aligned prefix, in sessions and without, with no salt and with A's scoped
    # salt. Each probe has a salt of its own: B's probes would share B's own earlier probes' prefixes.
    probes = [(64, None, "probe-nosalt"), (64, "run-a~", None)]
    probes += [(n, f"probe-{n}-{i}", f"probe-{n}" if i else None) for n in (16, 32, 48, 64) for i in range(2)]
    for n, salt, sid in probes:
        probe = complete(server, B, secret[:n] + [7], sid, **({} if salt is None else {"cache_salt": salt}))
        assert cached(probe) == 0, (n, salt, sid)
    # controls: A shares its own prefix with its own new session; B shares its own probe with itself
    assert cached(complete(server, A, secret[:48] + [7], "secret-a-2")) == 48
    assert cached(complete(server, B, secret[:64] + [7], "probe-again", cache_salt="probe-64-1")) == 64


def test_another_tenants_traces_are_unknown(server: Server) -> None:
    sid = "trace-a"
    complete(server, A, [5, 6, 7], sid)
    unknown = trace(server, B, "no-such-session")
    assert unknown.status_code == 404
    for name in (sid, f"run-a~{sid}"):
        for r in (trace(server, B, name), HTTP.delete(server.url + f"/v1/traces/{name}", headers=auth(B))):
            assert r.status_code == 404, r.text
            assert r.json()["error"]["message"] == unknown.json()["error"]["message"].replace("no-such-session", name)
    assert trace(server, None, sid).status_code == 401
    assert HTTP.delete(server.url + f"/v1/traces/{sid}", headers=auth(CLUSTER)).status_code == 401
    # controls: the router (cluster token) reads it by its internal name; A reads and releases its own
    assert trace(server, CLUSTER, f"run-a~{sid}").status_code == 200
    got = trace(server, A, sid)
    assert got.status_code == 200 and got.json()["session_id"] == sid and len(got.json()["calls"]) == 1
    r = HTTP.delete(server.url + f"/v1/traces/{sid}", headers=auth(A))
    assert r.status_code == 200 and r.json() == {"session_id": sid, "released": True, "calls": 1}
    assert trace(server, A, sid).status_code == 404


def test_n_samples_stay_in_the_tenants_namespace(server: Server) -> None:
    out = complete(server, A, [5, 6, 7], "group", n=2, temperature=1.0, seed=3)
    assert out["meta_info"]["session_id"] == "group"
    assert out["meta_info"]["session_ids"] == ["group/0", "group/1"]
    for i in range(2):
        assert trace(server, A, f"group/{i}").status_code == 200
        assert trace(server, B, f"group/{i}").status_code == 404


def test_a_tenants_versions_are_its_own(server: Server, adapters: dict[str, Path]) -> None:
    name = "policy-v7"
    report = push(adapters["policy-v1"], name, [ReplicaTarget(server.url, A)])  # a trainer with its tenant token
    assert report.failed == {}, report
    assert models(server, A) == ["base", name]
    assert models(server, B) == ["base"] and models(server, None) == ["base"]
    assert f"run-a~{name}" in models(server, ADMIN_TOKEN)
    ours = complete(server, A, [5, 6, 7], sid="a-own-version", model=name)
    assert ours["model"] == name and ours["meta_info"]["weight_version"] == name
    # its trace names the version as A does (the orchestrator checks each call's version against the
    # one it pinned: stored names there re-ran every attempt of a run past its first version)
    for full in (False, True):
        got = HTTP.get(server.url + "/v1/traces/a-own-version", params={"full": full}, headers=auth(A), timeout=30)
        assert got.json()["version"] == name and {c["version"] for c in got.json()["calls"]} == {name}, got.text
    fleet_view = trace(server, ADMIN_TOKEN, "run-a~a-own-version").json()
    assert {c["version"] for c in fleet_view["calls"]} == {f"run-a~{name}"}
    # B can neither use, unload, load over nor upload into A's version
    for model in (name, f"run-a~{name}"):
        r = post(server, B, {**COMPLETION, "model": model})
        assert r.status_code == 404 and "run-a" not in r.json()["error"]["message"].replace(model, ""), r.text
        r = HTTP.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": model}, headers=auth(B))
        assert r.status_code == 404, r.text
    r = HTTP.post(server.url + "/v1/load_lora_adapter", headers=auth(B),
                  json={"lora_name": name, "lora_path": str(adapters["policy-v2"])})
    assert r.status_code == 403 and "uploads" in r.json()["error"]["message"]
    r = HTTP.put(server.url + f"/v1/adapters/run-a~{name}/shards/0", params={"of": 1}, content=b"x",
                 headers=auth(B))
    assert r.status_code == 400, r.text
    # B's own version of the same name is B's alone; A's is untouched
    assert push(adapters["policy-v2"], name, [ReplicaTarget(server.url, B)]).failed == {}
    assert models(server, B) == ["base", name]
    again = complete(server, A, [5, 6, 7], model=name)
    assert again["choices"][0]["token_ids"] == ours["choices"][0]["token_ids"]
    loads = HTTP.get(server.url + "/v1/loads", headers=auth(B), timeout=30).json()
    assert loads["versions"] == ["base", name] and "sessions" not in loads
    assert HTTP.get(server.url + "/v1/loads", timeout=30).json()["versions"] == ["base"]
    # control: A unloads its own version; B's serves on
    r = HTTP.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth(A))
    assert r.status_code == 200 and r.json()["lora_name"] == name, r.text
    assert models(server, A) == ["base"] and models(server, B) == ["base", name]


def test_the_bulk_listener_stages_a_tenants_shards_in_its_namespace(server: Server) -> None:
    port = HTTP.get(server.url + "/v1/adapters/bulk", headers=auth(A), timeout=30).json()["port"]
    assert port, "the bulk listener is on by default"
    shard = f"http://127.0.0.1:{port}/v1/adapters/%s/shards/0"
    r = HTTP.put(shard % "bulk-v1", params={"of": 2}, content=b"abc", headers=auth(A), timeout=30)
    assert r.status_code == 200 and r.json()["name"] == "bulk-v1", r.text
    for token in (None, tenant_token("another-key", "run-a"), CLUSTER):
        r = HTTP.put(shard % "bulk-v1", params={"of": 2}, content=b"abc", headers=auth(token), timeout=30)
        assert r.status_code == 401, r.text
    r = HTTP.put(shard % "run-a~bulk-v1", params={"of": 2}, content=b"abc", headers=auth(B), timeout=30)
    assert r.status_code == 400, r.text
    # A's staged upload is not B's to commit: B has nothing staged under that name
    r = HTTP.post(server.url + "/v1/adapters/bulk-v1/commit", headers=auth(B), timeout=30)
    assert r.status_code == 422 and "run-" not in r.json()["error"]["message"], r.text
