"""The replica's bulk shard listener on loopback: a real socket, a real registry, hostile senders."""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import time

import httpx
import pytest
import torch

from burstrl.inference.adapters import AdapterRegistry
from burstrl.inference.bulk import BulkReceiver, tls_context
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


@pytest.fixture
def make_bulk(registry):
    """Receivers with other options than `bulk`'s, each closed at teardown (again, if the test did)."""
    made: list[BulkReceiver] = []

    def make(**options) -> BulkReceiver:
        made.append(BulkReceiver(registry, TOKEN, **{"max_shard_bytes": 1 << 24, "max_connections": 4,
                                                     "idle_timeout_s": 2.0, **options}))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (an EC key: quick to make)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


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


def read_to_end(s: socket.socket) -> bytes:
    """All the listener sends until it closes `s` (a reset ends it too); its timeout if it never does."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def drip(s: socket.socket, data: bytes, interval_s: float = 0.2) -> int:
    """Send `data` a byte every `interval_s` until the listener closes `s`; the bytes sent by then."""
    s.settimeout(interval_s)
    for sent in range(len(data)):
        try:
            s.sendall(data[sent:sent + 1])
            if not s.recv(1):
                return sent + 1
            return -1  # an answer: the listener should not send one to a head it never got
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return sent
    return len(data)


HEAD = (b"PUT /v1/adapters/policy-v1/shards/0?of=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bulk-token\r\n"
        b"Content-Length: 3\r\n\r\n")


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


def test_silent_and_dripping_connections_do_not_hold_the_slots(make_bulk, registry):
    bulk = make_bulk(max_connections=4, header_timeout_s=60.0, idle_timeout_s=60.0)
    silent = [socket.create_connection(("127.0.0.1", bulk.port), timeout=30) for _ in range(8)]
    partial = [raw(bulk, HEAD[:50]) for _ in range(4)]  # half a request line, then nothing
    r = put(bulk, "policy-v1", 0, 1, b"abc")  # accepted after all of them (the accept queue is FIFO)
    assert r.status_code == 200, r.text
    c = bulk.counters
    assert (c.slow_headers, c.crowded_out, c.over_capacity) == (0, 0, 0)  # all 12 were still open meanwhile
    start = time.monotonic()
    bulk.close()  # shuts them down and joins their threads: no waiting for their 60 s deadline
    assert time.monotonic() - start < 30
    for s in silent + partial:
        with s:
            assert read_to_end(s) == b""


def test_a_head_dripped_byte_by_byte_is_closed_at_its_deadline(make_bulk, registry):
    bulk = make_bulk(header_timeout_s=1.0, idle_timeout_s=60.0)  # a byte per 0.2 s resets no deadline
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", bulk.port), timeout=30) as s:
        sent = drip(s, HEAD)
    assert time.monotonic() - start >= 1.0 and 0 <= sent < len(HEAD), sent  # ~25 s to drip it all
    wait_for(lambda: bulk.counters.slow_headers == 1, 30, "the slow head to be counted", interval=0.02)
    assert bulk.counters.shards == 0 and registry.staged() == []


def test_the_oldest_connection_without_a_head_is_crowded_out(make_bulk, registry):
    bulk = make_bulk(max_pending=4, header_timeout_s=60.0, idle_timeout_s=60.0)
    silent = [socket.create_connection(("127.0.0.1", bulk.port), timeout=30) for _ in range(5)]
    with silent[0] as s:
        assert read_to_end(s) == b""  # the fifth one crowded out the first
    r = put(bulk, "policy-v1", 0, 1, b"abc")  # and this one the second
    assert r.status_code == 200, r.text
    with silent[1] as s:
        assert read_to_end(s) == b""
    wait_for(lambda: bulk.counters.crowded_out == 2, 30, "two crowded out", interval=0.02)
    for s in silent[2:]:
        s.close()


@pytest.mark.parametrize("method", [b"PUT", b"GET"])
def test_a_wrong_token_is_answered_401_first_and_the_connection_closed(make_bulk, registry, method):
    bulk = make_bulk(header_timeout_s=60.0, idle_timeout_s=60.0)  # so only the refusal can close it
    head = HEAD.replace(b"PUT", method).replace(b"bulk-token", b"wrong").replace(b": 3", b": 1000")
    with raw(bulk, head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")) as s:
        reply = read_to_end(s)  # the 1000 body bytes never sent: no waiting for them
    assert reply.startswith(b"HTTP/1.1 401") and b"Connection: close" in reply, reply  # no 100 Continue
    assert bulk.counters.refused == 1 and registry.staged() == []


def test_authenticated_requests_past_max_connections_are_answered_503(make_bulk, registry):
    bulk = make_bulk(max_connections=4, header_timeout_s=60.0, idle_timeout_s=60.0)  # the held ones stay
    expecting = HEAD.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    held = [raw(bulk, expecting) for _ in range(4)]
    for s in held:  # 100 Continue comes once the request holds its slot; the bodies are held back
        assert s.recv(4096).startswith(b"HTTP/1.1 100")
    with raw(bulk, HEAD) as s:
        reply = read_to_end(s)
    assert reply.startswith(b"HTTP/1.1 503") and bulk.counters.over_capacity == 1, reply
    held[0].sendall(b"abc")
    with held[0] as s:
        assert b"HTTP/1.1 200" in s.recv(4096)
    for s in held[1:]:
        s.close()  # truncated bodies: their slots come free too
    wait_for(lambda: bulk.counters.truncated == 3, 30, "the held bodies dropped", interval=0.02)
    assert put(bulk, "policy-v1", 0, 1, b"abc").status_code == 200


def test_a_tls_handshake_counts_against_the_head_deadline(make_bulk, registry, tls_files):
    from burstrl.weights.bulk_send import BulkConnection

    cert, key = tls_files
    bulk = make_bulk(ssl_context=tls_context(str(cert), str(key)), max_connections=2, header_timeout_s=2.0,
                     idle_timeout_s=60.0)
    silent = [socket.create_connection(("127.0.0.1", bulk.port), timeout=30) for _ in range(3)]  # no ClientHello
    conn = BulkConnection("127.0.0.1", bulk.port, TOKEN, tls=True, verify=str(cert))
    try:
        status, answer = conn.put("/v1/adapters/policy-v1/shards/0", {"of": 1}, b"abc", {})
    finally:
        conn.close()
    assert status == 200, answer
    for s in silent:
        with s:
            assert read_to_end(s) == b""
    wait_for(lambda: bulk.counters.slow_headers >= 3, 30, "the silent handshakes counted", interval=0.02)


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
