"""`burstrl route serve` in front of real replicas on loopback: affinity, proxying, failover, registry.

The first tests share one router and four replicas (three registered at start, one kept back to be
registered later) and run in file order: the failover test kills a replica, the last one adds one.
The regression tests of issue 14 then put a router in front of `FakeReplica`s (small stdlib HTTP
servers defined below) that fail exactly as told: dying mid-stream, dropping a call they had
accepted, refusing connections, or reporting a dead engine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai import APIError, OpenAI

from burstrl.protocol import process
from burstrl.protocol.process import RoleProcess
from tests.http_client import HTTP

from .conftest import Server, start_server, stop_server

TOKEN = "test-cluster-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start_router(workdir: Path, *overrides: str, timeout: float = 60.0) -> RoleProcess:
    """`burstrl route serve --port 0 ...` as a child process group, with the test's cluster token."""
    return process.start_router(workdir, "--cluster_token", TOKEN, *overrides, timeout=timeout)


def start_replica(model_dir: Path, workdir: Path, *overrides: str) -> Server:
    """A real replica that shares the router's cluster token (it lists its sessions only to that token)."""
    return start_server(model_dir, workdir, "--server.cluster_token", TOKEN, *overrides)


@dataclass
class Cluster:
    router: RoleProcess
    replicas: list[Server]  # the first three are registered at start
    spare: Server

    def url(self, path: str) -> str:
        return self.router.url + path

    def stats(self) -> dict:
        return HTTP.get(self.url("/v1/stats"), timeout=10).json()

    def home_of(self, sid: str) -> Server:
        """The replica that holds the session's trace (exactly one must)."""
        found = [s for s in self.replicas + [self.spare] if s.replica.proc.poll() is None
                 and HTTP.get(s.url + f"/v1/traces/{sid}", headers=s.admin(), timeout=10).status_code == 200]
        assert len(found) == 1, f"session {sid} found on {len(found)} replicas"
        return found[0]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("router")
    with ThreadPoolExecutor(4) as pool:
        servers = list(pool.map(lambda i: start_replica(tiny_model_dir, root / f"r{i}"), range(4)))
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
    r = HTTP.post(cluster.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_models_and_replicas(cluster: Cluster) -> None:
    assert HTTP.get(cluster.url("/health"), timeout=10).json()["status"] == "ok"
    assert [m["id"] for m in HTTP.get(cluster.url("/v1/models"), timeout=10).json()["data"]] == ["base"]
    listed = HTTP.get(cluster.url("/v1/replicas"), timeout=10).json()["replicas"]
    assert sorted(r["url"] for r in listed) == sorted(s.url for s in cluster.replicas)


def test_sessions_stick_to_one_replica(cluster: Cluster) -> None:
    for sid in ("stick-a", "stick-b", "stick-c"):
        for i in range(3):
            complete(cluster, sid, prompt=f"call {i} of {sid}")
    for sid in ("stick-a", "stick-b", "stick-c"):
        home = cluster.home_of(sid)
        assert len(home.get(f"/v1/traces/{sid}")["calls"]) == 3
    # the session header works as well as the body field
    r = HTTP.post(cluster.url("/v1/completions"), headers={"X-Session-ID": "stick-a"},
                  json={"model": "base", "prompt": "via header", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(cluster.home_of("stick-a").get("/v1/traces/stick-a")["calls"]) == 4


def test_traces_through_the_router_need_a_token(cluster: Cluster) -> None:
    complete(cluster, "traced")
    r = HTTP.get(cluster.url("/v1/traces/traced"), headers=AUTH, timeout=10)  # the cluster token
    assert r.status_code == 200 and r.json()["replica"] == cluster.home_of("traced").url, r.text
    anonymous = HTTP.get(cluster.url("/v1/traces/traced"), timeout=10)
    assert anonymous.status_code == 401 and "error" in anonymous.json()


def test_scrapes_see_the_sessions_with_the_cluster_token(cluster: Cluster) -> None:
    complete(cluster, "scraped")
    url = cluster.home_of("scraped").url
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = next(r for r in cluster.stats()["replicas"] if r["url"] == url)
        if row["live_sessions"] > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the router never saw a live session on {url}: {row}")


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
    legacy = client.completions.create(model="base", prompt="Hello", max_tokens=3)  # no session: placed by the policy
    assert legacy.usage.completion_tokens == 3


def test_assign_returns_a_registered_replica(cluster: Cluster) -> None:
    r = HTTP.post(cluster.url("/v1/assign"), json={"session_id": "assigned", "version": "base",
                                                    "expected_tokens": 100}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["url"] in [s.url for s in cluster.replicas]
    again = HTTP.post(cluster.url("/v1/assign"), json={"session_id": "assigned", "version": "base"}, timeout=10)
    assert again.json()["url"] == r.json()["url"]
    latest = HTTP.post(cluster.url("/v1/assign"), json={"session_id": "x"}, timeout=10)  # no version: latest
    assert latest.status_code == 200 and latest.json()["version"] == "base", latest.text
    bad = HTTP.post(cluster.url("/v1/assign"), json={"version": "base"}, timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()


def test_unknown_model_is_404(cluster: Cluster) -> None:
    r = HTTP.post(cluster.url("/v1/completions"), json={"model": "nope", "prompt": "x", "session_id": "u"},
                  timeout=10)
    assert r.status_code == 404
    assert "nope" in r.json()["error"]["message"]


def test_a_groups_samples_are_traced_through_the_router(cluster: Cluster) -> None:
    """n > 1: the replica captures sample i as `<sid>/i`; the router finds it where `<sid>` lives."""
    out = complete(cluster, "group", n=2, temperature=1.0, seed=3)
    assert out["meta_info"]["session_ids"] == ["group/0", "group/1"]
    for i in range(2):
        r = HTTP.get(cluster.url(f"/v1/traces/group/{i}"), headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["calls"][0]["request_id"].endswith(f"-{i}")
    assert HTTP.get(cluster.url("/v1/traces/group/x"), headers=AUTH, timeout=10).status_code == 404


def test_registration_needs_the_token_and_an_http_url(cluster: Cluster) -> None:
    body = {"url": cluster.spare.url, "pool": "on_demand", "weight": 1, "capacity_tokens": 0}
    assert HTTP.post(cluster.url("/v1/replicas"), json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert HTTP.post(cluster.url("/v1/replicas"), json=body, headers=wrong, timeout=10).status_code == 401
    r = HTTP.post(cluster.url("/v1/replicas"), json={**body, "url": "file:///etc/passwd"}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and "http" in r.json()["error"]["message"]
    assert HTTP.delete(cluster.url("/v1/replicas"), params={"url": cluster.spare.url}, timeout=10).status_code == 401


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
    # out of rotation: dropped by the failed call, or (a scrape saw it first) listed as unhealthy
    assert all(not r["healthy"] for r in cluster.stats()["replicas"] if r["url"] == home.url)
    metrics = HTTP.get(cluster.url("/metrics"), timeout=10).text
    assert f"burstrl_router_rehomes_total {before + 1}" in metrics


def test_newly_registered_replica_receives_new_sessions(cluster: Cluster) -> None:
    body = {"url": cluster.spare.url, "pool": "on_demand", "weight": 1, "capacity_tokens": 0}
    r = HTTP.post(cluster.url("/v1/replicas"), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 201, r.text
    assert r.json()["versions"] == ["base"]
    placed = [HTTP.post(cluster.url("/v1/assign"), json={"session_id": f"fresh-{i}", "version": "base"},
                        timeout=10).json()["url"] for i in range(12)]
    assert cluster.spare.url in placed
    sid = f"fresh-{placed.index(cluster.spare.url)}"
    complete(cluster, sid)
    assert cluster.home_of(sid) is cluster.spare
    gone = HTTP.delete(cluster.url("/v1/replicas"), params={"url": cluster.spare.url}, headers=AUTH, timeout=10)
    assert gone.status_code == 200
    assert cluster.spare.url not in [x["url"] for x in HTTP.get(cluster.url("/v1/replicas"), timeout=10).json()["replicas"]]


# --- regressions of issue 14, against replicas that fail on cue ------------------------------


class FakeReplica:
    """A stdlib HTTP server that answers like a replica until told to fail (`mode`).

    Modes: `ok`; `drop` (reads a generation call, then closes the connection without an answer);
    `cut` (streams two SSE events, then drops the connection mid-stream); `dead_engine` (503 on
    `/v1/loads` and `/v1/models`, as a replica whose engine died). It records every request as
    (method, path, Authorization header), and lists its sessions only to the cluster token.
    """

    def __init__(self) -> None:
        self.mode = "ok"
        self.requests: list[tuple[str, str, str]] = []
        self.sessions: set[str] = set()
        self.connections: list[socket.socket] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                fake.connections.append(self.connection)

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake.requests.append(("GET", self.path, self.headers.get("authorization", "")))
                fake.answer_get(self)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                fake.requests.append(("POST", self.path, self.headers.get("authorization", "")))
                fake.answer_post(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def calls(self) -> int:
        return sum(1 for method, _, _ in self.requests if method == "POST")

    def scrapes(self) -> int:
        return sum(1 for method, path, _ in self.requests if path == "/v1/loads")

    def answer_get(self, h: BaseHTTPRequestHandler) -> None:
        reader = h.headers.get("authorization", "") == AUTH["Authorization"]
        if self.mode == "dead_engine" and h.path in ("/v1/loads", "/v1/models"):
            return send_json(h, 503, {"error": {"message": "engine is not running", "code": 503}})
        if h.path == "/v1/loads":
            sessions = [{"session_id": s, "tokens": 10} for s in sorted(self.sessions)] if reader else None
            return send_json(h, 200, {"num_used_tokens": 0, "max_total_num_tokens": 100_000,
                                      "versions": ["base"], **({"sessions": sessions} if reader else {})})
        if h.path == "/v1/models":
            return send_json(h, 200, {"object": "list", "data": [{"id": "base"}]})
        if h.path.startswith("/v1/traces/") and not reader:
            return send_json(h, 401, {"error": {"message": "token", "code": 401}})
        send_json(h, 200 if h.path.startswith("/v1/traces/") else 404, {"session_id": h.path[11:], "calls": []})

    def answer_post(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        self.sessions.add(body.get("session_id", ""))
        if self.mode == "drop":  # the call arrived; the replica dies before it answers
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if not body.get("stream"):
            return send_json(h, 200, {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("transfer-encoding", "chunked")
        h.end_headers()
        events = [f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode() for i in range(3)]
        if self.mode == "cut":  # two whole events, half of the third, then the connection is gone
            events = events[:2] + [events[2][:10]]
        else:
            events.append(b"data: [DONE]\n\n")
        for data in events:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()
        if self.mode == "cut":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(b"0\r\n\r\n")

    def close(self) -> None:
        """Stop as a killed process would: the listening socket and every open connection go."""
        self.server.shutdown()
        self.server.server_close()
        for conn in self.connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def send_json(h: BaseHTTPRequestHandler, status: int, data: dict) -> None:
    raw = json.dumps(data).encode()
    h.send_response(status)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(raw)))
    h.end_headers()
    h.wfile.write(raw)


@pytest.fixture
def fakes(tmp_path: Path):
    """Two fake replicas, A registered at start and B registered once the test has homed a session on A.

    `health_failures` is high so that only a definitive answer (a 503, a broken call) drops a replica.
    """
    a, b = FakeReplica(), FakeReplica()
    router = start_router(tmp_path / "router", "--replicas", json.dumps([a.url]), "--scrape_s", "0.2",
                          "--health_failures", "1000", "--request_timeout_s", "30")
    try:
        yield router, a, b
    finally:
        router.stop()
        a.close()
        b.close()


def home_on_a_then_add_b(router: RoleProcess, b: FakeReplica, sid: str) -> None:
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": sid},
                  timeout=30)
    assert r.status_code == 200, r.text
    r = HTTP.post(router.url + "/v1/replicas", json={"url": b.url}, headers=AUTH, timeout=30)
    assert r.status_code == 201 and r.json()["scraped"], r.text


def replica_urls(router: RoleProcess) -> list[str]:
    return [r["url"] for r in HTTP.get(router.url + "/v1/replicas", timeout=10).json()["replicas"]]


def dropped(router: RoleProcess) -> int:
    return HTTP.get(router.url + "/v1/stats", timeout=10).json()["totals"]["replicas_dropped"]


def rehomes(router: RoleProcess) -> int:
    return HTTP.get(router.url + "/v1/stats", timeout=10).json()["totals"]["rehomes"]


def test_regression_replica_dies_mid_stream_client_gets_an_error_event(fakes) -> None:
    """Issue 14: a broken stream used to just end, so a half answer looked complete."""
    router, a, b = fakes
    home_on_a_then_add_b(router, b, "cut")
    a.mode = "cut"
    body = {"model": "base", "prompt": "x", "session_id": "cut", "stream": True}
    with HTTP.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    error = json.loads(events[2])["error"]  # the cut third event is dropped, not passed on half
    assert len(events) == 3 and error["code"] == 503 and error["type"] == "server_error"
    assert "[DONE]" not in events and "retry" in error["message"].lower()
    assert dropped(router) == 1  # it may be back already: given with --replicas, it still answers scrapes
    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="base", prompt="again", stream=True, extra_body={"session_id": "cut"})
    assert [c.choices[0].text for c in stream] == ["t0", "t1", "t2"]  # re-homed on B, whole
    assert b.calls() == 1 and rehomes(router) == 1


def test_regression_openai_client_raises_on_a_cut_stream(fakes) -> None:
    router, a, _ = fakes
    a.mode = "cut"
    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="base", prompt="x", stream=True, extra_body={"session_id": "oa"})
    texts = []
    with pytest.raises(APIError, match="mid-stream"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["t0", "t1"]


def test_regression_call_accepted_then_lost_is_not_retried(fakes) -> None:
    """Issue 14: a call the replica may have run used to be retried elsewhere (so it could run twice)."""
    router, a, b = fakes
    home_on_a_then_add_b(router, b, "once")
    a.mode = "drop"
    before = a.calls()
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": "once"},
                  timeout=30)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "safe" in error["message"] and "not retried" in error["message"]
    assert a.calls() == before + 1 and b.calls() == 0  # sent once, never a second time
    assert dropped(router) == 1  # it may be back already: given with --replicas, it still answers scrapes
    again = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": "once"},
                      timeout=30)
    assert again.status_code == 200 and b.calls() == 1 and rehomes(router) == 1


def test_refused_connection_is_retried_on_another_replica(fakes) -> None:
    """The other side of the rule: a call that never reached a replica is retried, once."""
    router, a, b = fakes
    home_on_a_then_add_b(router, b, "moved")
    a.close()  # nothing listens any more: the connection is refused
    r = HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": "moved"},
                  timeout=30)
    assert r.status_code == 200, r.text
    assert b.calls() == 1 and rehomes(router) == 1 and a.url not in replica_urls(router)


def test_regression_dead_engine_leaves_rotation_within_one_scrape(fakes) -> None:
    """Issue 14: a replica whose engine died kept getting new sessions (10 of 20)."""
    router, a, b = fakes
    home_on_a_then_add_b(router, b, "first")
    assert all(auth == AUTH["Authorization"] for _, path, auth in a.requests if path == "/v1/loads")
    scrapes = a.scrapes()
    a.mode = "dead_engine"
    deadline = time.monotonic() + 30
    while a.url in replica_urls(router):
        assert time.monotonic() < deadline, "the dead-engine replica is still in rotation"
        time.sleep(0.05)
    assert a.scrapes() <= scrapes + 1  # one scrape (health_failures is 1000)
    placed = [HTTP.post(router.url + "/v1/assign", json={"session_id": f"n{i}"}, timeout=10).json()["url"]
              for i in range(10)]
    assert placed == [b.url] * 10


def test_trace_reads_forward_the_callers_token(fakes) -> None:
    router, a, _ = fakes
    assert HTTP.post(router.url + "/v1/completions", json={"model": "base", "prompt": "x", "session_id": "t"},
                     timeout=30).status_code == 200
    assert HTTP.get(router.url + "/v1/traces/t", timeout=10).status_code == 401
    r = HTTP.get(router.url + "/v1/traces/t", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["replica"] == a.url
    assert ("GET", "/v1/traces/t", AUTH["Authorization"]) in a.requests
