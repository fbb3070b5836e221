"""The replica's bulk shard listener on loopback: a real socket, a real registry, hostile senders."""

from __future__ import annotations

import hashlib
import socket

import httpx
import pytest
import torch

from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.bulk import BulkReceiver
from burstrl.model.lora import make_random_adapter
from burstrl.protocol.adapters import pack_adapter
from tests.http_client import HTTP
from tests.waiting import wait_for

TOKEN = "bulk-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", seed=3)


@pytest.fixture
def registry(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    return AdapterRegistry(tmp_path / "state", layers, torch.float32, CPU, max_staged_bytes=1 << 26)


@pytest.fixture
def bulk(registry):
    receiver = BulkReceiver(registry, TOKEN, max_shard_bytes=1 << 24, max_connections=4, idle_timeout_s=2.0)
    yield receiver
    receiver.close()


def url(bulk: BulkReceiver, name: str, index: int) -> str:
    return f"http://127.0.0.1:{bulk.port}/v1/adapters/{name}/shards/{index}"


def put(bulk: BulkReceiver, name: str, index: int, of: int, data: bytes, sha: str | None = None,
        headers: dict | None = None) -> httpx.Response:
    h = {**AUTH, **({"X-Shard-SHA256": sha} if sha else {}), **(headers or {})}
    return HTTP.put(url(bulk, name, index), params={"of": of}, content=data, headers=h, timeout=30)


def raw(bulk: BulkReceiver, head: bytes, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", bulk.port), timeout=30)
    s.sendall(head + body)
    return s


def test_shards_out_of_order_and_resent_commit(bulk, registry, adapter_dir):
    manifest, shards = pack_adapter(adapter_dir, 3, "policy-v1")
    for i in (2, 0, 1, 0):  # out of order, shard 0 twice (a retry replaces it)
        r = put(bulk, "policy-v1", i, 3, shards[i], manifest.shard_sha256[i])
        assert r.status_code == 200 and r.json()["bytes"] == len(shards[i]), r.text
    assert registry.staged_bytes() == manifest.total_bytes
    registry.put_manifest("policy-v1", manifest.to_json())
    adapter = registry.commit("policy-v1")
    assert registry.names() == ["policy-v1"] and adapter.path == f"upload:sha256:{manifest.sha256}"
    assert bulk.counters.shards == 4 and bulk.counters.refused == 0


def test_keep_alive_connection_takes_many_shards(bulk, registry, adapter_dir):
    manifest, shards = pack_adapter(adapter_dir, 4, "policy-v2")
    with httpx.Client(headers=AUTH, timeout=30) as client:
        for i, shard in enumerate(shards):
            r = client.put(url(bulk, "policy-v2", i), params={"of": 4}, content=shard)
            assert r.status_code == 200, r.text
    registry.put_manifest("policy-v2", manifest.to_json())
    registry.commit("policy-v2")
    assert registry.names() == ["policy-v2"]


@pytest.mark.parametrize("auth", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}])
def test_wrong_token_is_refused_before_the_body(bulk, registry, auth):
    r = HTTP.put(url(bulk, "policy-v1", 0), params={"of": 1}, content=b"x" * 1000, headers=auth, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert registry.staged() == [] and bulk.counters.refused == 1


def test_wrong_hash_is_refused_and_nothing_staged(bulk, registry):
    r = put(bulk, "policy-v1", 0, 1, b"data", sha=hashlib.sha256(b"other").hexdigest())
    assert r.status_code == 400 and "sha256 mismatch" in r.json()["error"]["message"]
    assert registry.staged() == []


def test_oversized_shard_is_refused_from_its_length(bulk, registry):
    s = raw(bulk, b"PUT /v1/adapters/policy-v1/shards/0?of=1 HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer bulk-token\r\nContent-Length: %d\r\n\r\n" % ((1 << 24) + 1))
    with s:
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413") and registry.staged() == []


@pytest.mark.parametrize("index,of,status", [(1, 1, 400), (0, 0, 400), (0, 5000, 400), (0, "x", 404)])
def test_bad_index_is_refused(bulk, registry, index, of, status):
    r = HTTP.put(url(bulk, "policy-v1", index), params={"of": of}, content=b"abc", headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    assert registry.staged() == []


@pytest.mark.parametrize("name", ["base", "..", "a%2Fb", "x" * 65, "sp%20ace"])
def test_bad_names_are_refused(bulk, registry, name):
    assert put(bulk, name, 0, 1, b"abc").status_code in (400, 404)
    assert registry.staged() == []


def test_truncated_body_is_dropped(bulk, registry):
    s = raw(bulk, b"PUT /v1/adapters/policy-v1/shards/0?of=1 HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer bulk-token\r\nContent-Length: 100000\r\n\r\n", b"x" * 1000)
    s.shutdown(socket.SHUT_WR)
    with s:
        assert s.recv(4096) == b""  # closed without an answer: there is nothing to answer
    wait_for(lambda: bulk.counters.truncated == 1, 30, "the truncated shard to be counted", interval=0.02)
    assert registry.staged() == []


def test_chunked_body_and_missing_length_are_refused(bulk, registry):
    chunks = (b for b in (b"abc", b"def"))
    r = HTTP.put(url(bulk, "policy-v1", 0), params={"of": 1}, content=chunks, headers=AUTH, timeout=30)
    assert r.status_code == 411
    s = raw(bulk, b"PUT /v1/adapters/policy-v1/shards/0?of=1 HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer bulk-token\r\n\r\n")
    with s:
        assert s.recv(4096).startswith(b"HTTP/1.1 411")
    assert registry.staged() == []


def test_other_methods_and_paths_are_refused(bulk, registry):
    assert HTTP.get(url(bulk, "policy-v1", 0), headers=AUTH, timeout=30).status_code == 405
    assert HTTP.post(url(bulk, "policy-v1", 0), headers=AUTH, timeout=30).status_code == 405
    r = HTTP.put(f"http://127.0.0.1:{bulk.port}/v1/adapters/policy-v1/manifest", content=b"{}", headers=AUTH,
                 timeout=30)
    assert r.status_code == 404 and registry.staged() == []


def test_full_staging_refuses_before_the_body(bulk, registry):
    registry.max_staged_bytes = 10
    assert put(bulk, "policy-v1", 0, 2, b"12345678").status_code == 200
    r = put(bulk, "policy-v1", 1, 2, b"12345678")
    assert r.status_code == 400 and "exceed" in r.json()["error"]["message"]
    assert registry.staged_bytes() == 8


def test_garbage_request_line_does_not_stop_the_listener(bulk, registry):
    for junk in (b"\x16\x03\x01\x00\xa5garbage\r\n\r\n", b"PUT " + b"/" * 70000 + b" HTTP/1.1\r\n\r\n", b"\r\n"):
        with raw(bulk, junk) as s:
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    assert put(bulk, "policy-v1", 0, 1, b"abc").status_code == 200


def test_connections_past_the_limit_are_closed_and_stalled_ones_time_out(bulk, registry):
    idle = [socket.create_connection(("127.0.0.1", bulk.port), timeout=30) for _ in range(4)]
    extra = socket.create_connection(("127.0.0.1", bulk.port), timeout=30)
    with extra:
        assert extra.recv(1) == b""  # closed at once: every slot is held
    assert bulk.counters.over_capacity >= 1
    for s in idle:  # idle_timeout_s (2 s) frees the slots held by stalled senders
        with s:
            assert s.recv(1) == b""
    wait_for(lambda: put(bulk, "policy-v1", 0, 1, b"abc").status_code == 200, 30, "a free slot", interval=0.02)


def test_close_stops_the_listener(registry):
    receiver = BulkReceiver(registry, TOKEN)
    port = receiver.port
    receiver.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_senders_raw_connection_keeps_alive_and_reports_refusals(bulk, registry, adapter_dir):
    from burstrl.weights.bulk_send import BulkConnection
    from burstrl.weights.push import PushReport, TargetFailed, bulk_put

    manifest, shards = pack_adapter(adapter_dir, 3, "policy-v1")
    conn = BulkConnection("127.0.0.1", bulk.port, TOKEN, tls=False)
    for i, shard in enumerate(shards):
        status, answer = conn.put(f"/v1/adapters/policy-v1/shards/{i}", {"of": 3}, shard,
                                  {"X-Shard-SHA256": manifest.shard_sha256[i]})
        assert status == 200, answer
    sock = conn._sock
    assert sock is not None  # one connection for all three
    conn.close()
    registry.put_manifest("policy-v1", manifest.to_json())
    registry.commit("policy-v1")
    report = PushReport()
    with pytest.raises(TargetFailed, match="HTTP 401: bulk listener: missing or wrong bearer token"):
        bulk_put(BulkConnection("127.0.0.1", bulk.port, "wrong", tls=False), "/v1/adapters/policy-v2/shards/0",
                 {"of": 1}, b"abc", {}, report, retries=2, backoff_s=0.01)
    assert report.retries == 0  # a 4xx is final
    with pytest.raises(TargetFailed, match="sha256 mismatch"):
        bulk_put(BulkConnection("127.0.0.1", bulk.port, TOKEN, tls=False), "/v1/adapters/policy-v2/shards/0",
                 {"of": 1}, b"abc", {"X-Shard-SHA256": "0" * 64}, report, retries=2, backoff_s=0.01)


def test_a_closed_bulk_port_fails_the_target_at_once(registry):
    from burstrl.weights.bulk_send import BulkConnection
    from burstrl.weights.push import PushReport, TargetFailed, bulk_put

    receiver = BulkReceiver(registry, TOKEN)
    port = receiver.port
    receiver.close()
    report = PushReport()
    with pytest.raises(TargetFailed, match="ConnectionRefused"):
        bulk_put(BulkConnection("127.0.0.1", port, TOKEN, tls=False), "/v1/adapters/x/shards/0", {"of": 1},
                 b"abc", {}, report, retries=3, backoff_s=0.01)
    assert report.retries == 0


def test_an_unreachable_bulk_port_falls_back_to_the_main_server(registry):
    import httpx

    from burstrl.weights.push import ReplicaTarget, bulk_connection

    receiver = BulkReceiver(registry, TOKEN)
    port = receiver.port
    receiver.close()  # nothing listens there now, as behind a proxy that forwards only the main port

    def main_server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"port": port, "tls": False})

    with httpx.Client(transport=httpx.MockTransport(main_server), base_url="http://127.0.0.1:1") as client:
        assert bulk_connection(ReplicaTarget("http://127.0.0.1:1", TOKEN), client, 30.0) is None
