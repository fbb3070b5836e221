"""A real replica on loopback: admin auth, sharded uploads, version retirement, bad input, disconnects."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from burstrl.protocol.adapters import pack_adapter
from tests.http_client import HTTP

from .conftest import Server

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` (<= 2 min) does not

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def models(server: Server) -> list[str]:
    return [m["id"] for m in server.get("/v1/models")["data"]]


def upload(server: Server, name: str, directory: Path, shards: int, corrupt: int | None = None,
           headers: dict | None = None) -> httpx.Response:
    manifest, parts = pack_adapter(directory, shards, name)
    headers = server.admin() if headers is None else headers
    for i, data in enumerate(parts):
        if i == corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        r = HTTP.put(f"{server.url}/v1/adapters/{name}/shards/{i}", params={"of": shards},
                     content=data, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    r = HTTP.put(f"{server.url}/v1/adapters/{name}/manifest", json=manifest.to_json(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return HTTP.post(f"{server.url}/v1/adapters/{name}/commit", headers=headers, timeout=60)


def test_admin_endpoints_need_the_bearer_token(server: Server, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "x", "lora_path": str(adapters["policy-v1"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        assert HTTP.post(server.url + "/v1/load_lora_adapter", json=body, headers=headers).status_code == 401
        assert HTTP.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "x"},
                         headers=headers).status_code == 401
        assert HTTP.put(server.url + "/v1/adapters/x/shards/0", params={"of": 1}, content=b"abc",
                        headers=headers).status_code == 401
        assert HTTP.delete(server.url + "/v1/traces/anything", headers=headers).status_code == 401
    r = HTTP.post(server.url + "/v1/load_lora_adapter", json=body)
    assert r.json()["error"]["type"] == "authentication_error"
    assert "x" not in models(server)


def test_sharded_upload_is_verified_before_serving(server: Server, adapters: dict[str, Path]) -> None:
    bad = upload(server, "policy-v7", adapters["policy-v1"], shards=3, corrupt=1)
    assert bad.status_code == 422 and "sha256" in bad.json()["error"]["message"]
    assert "policy-v7" not in models(server)
    r = HTTP.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "policy-v7"})
    assert r.status_code == 404

    incomplete_name = "policy-v8"
    manifest, parts = pack_adapter(adapters["policy-v1"], 2, incomplete_name)
    HTTP.put(f"{server.url}/v1/adapters/{incomplete_name}/shards/0", params={"of": 2}, content=parts[0],
             headers=server.admin())
    HTTP.put(f"{server.url}/v1/adapters/{incomplete_name}/manifest", json=manifest.to_json(), headers=server.admin())
    r = HTTP.post(f"{server.url}/v1/adapters/{incomplete_name}/commit", headers=server.admin())
    assert r.status_code == 422 and "missing" in r.json()["error"]["message"]

    r = HTTP.put(f"{server.url}/v1/adapters/policy-v9/shards/0", params={"of": 1}, content=b"data",
                 headers={**server.admin(), "X-Shard-SHA256": "0" * 64})
    assert r.status_code == 400

    good = upload(server, "policy-v7", adapters["policy-v1"], shards=3)
    assert good.status_code == 200, good.text
    assert "policy-v7" in models(server)
    r = HTTP.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "policy-v7"})
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "policy-v7"


def test_a_version_is_kept_while_a_session_uses_it(server: Server, adapters: dict[str, Path]) -> None:
    r = HTTP.post(server.url + "/v1/load_lora_adapter", headers=server.admin(),
                  json={"lora_name": "policy-v3", "lora_path": str(adapters["policy-v2"])})
    assert r.status_code == 200
    first = {**CHAT, "model": "policy-v3", "session_id": "pinned"}
    assert HTTP.post(server.url + "/v1/chat/completions", json=first).status_code == 200
    r = HTTP.post(server.url + "/v1/unload_lora_adapter", headers=server.admin(), json={"lora_name": "policy-v3"})
    assert r.json()["status"] == "retiring"
    assert "policy-v3" not in models(server)
    new = HTTP.post(server.url + "/v1/chat/completions", json={**first, "session_id": "new-one"})
    assert new.status_code == 404
    # the pinned session finishes on its version
    assert HTTP.post(server.url + "/v1/completions", json={"model": "policy-v3", "prompt": "more",
                                                            "session_id": "pinned"}).status_code == 200
    wrong = HTTP.post(server.url + "/v1/chat/completions", json={**CHAT, "session_id": "pinned"})
    assert wrong.status_code == 409 and "pinned" in wrong.json()["error"]["message"]
    assert "policy-v3" in server.get("/v1/loads")["retiring_versions"]
    r = HTTP.delete(server.url + "/v1/traces/pinned", headers=server.admin())
    assert r.status_code == 200 and r.json()["calls"] == 2
    assert "policy-v3" not in server.get("/v1/loads")["retiring_versions"]
    assert HTTP.get(server.url + "/v1/traces/pinned", headers=server.admin()).status_code == 404


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({**CHAT, "model": "policy-v99"}).encode(), 404, "not found"),
    (json.dumps({**CHAT, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({**CHAT, "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({**CHAT, "n": 0}).encode(), 400, "n must be an integer from 1 to 64"),
    (json.dumps({**CHAT, "n": 65}).encode(), 400, "n must be an integer from 1 to 64"),
    (json.dumps({**CHAT, "n": 2, "stream": True}).encode(), 400, "n > 1 is answered whole"),
    (json.dumps({**CHAT, "session_id": "bad id with spaces"}).encode(), 400, "session_id"),
    (json.dumps({**CHAT, "messages": []}).encode(), 400, "messages"),
    (json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x " * 5000}]}).encode(), 400, "maximum context"),
    (json.dumps({**CHAT, "max_tokens": 10 ** 6}).encode(), 400, "maximum context"),
    (json.dumps({"model": "base"}).encode(), 400, "messages"),
])
def test_bad_input_gets_a_4xx_json_error(server: Server, body: bytes, status: int, needle: str) -> None:
    r = HTTP.post(server.url + "/v1/chat/completions", content=body,
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_completion_input_and_oversized_body(server: Server) -> None:
    r = HTTP.post(server.url + "/v1/completions", json={"model": "base", "prompt": [1, 2, 10 ** 9]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = HTTP.post(server.url + "/v1/completions", json={"model": "base", "prompt": ""})
    assert r.status_code == 400
    huge = b'{"model": "base", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = HTTP.post(server.url + "/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert HTTP.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_session_calls_run_one_at_a_time(server: Server) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json={
            "model": "base", "prompt": "a", "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "session_id": "busy"}) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        second = HTTP.post(server.url + "/v1/completions", json={"model": "base", "prompt": "b", "session_id": "busy"})
        assert second.status_code == 409, (second.text, server.get("/v1/loads")["sessions"])


def _wait_idle(server: Server) -> dict:
    """The replica's loads once no request runs and no session is busy (or at the deadline)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loads = server.get("/v1/loads")
        if loads["num_running_reqs"] == 0 and not any(s["busy"] for s in loads["sessions"]):
            break
        time.sleep(0.2)
    return loads


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server: Server) -> None:
    # an earlier test's abandoned stream is counted when the server notices it: wait for that first
    assert _wait_idle(server)["num_running_reqs"] == 0
    before = server.metric("burstrl:client_disconnects_total")
    body = json.dumps({"model": "base", "prompt": "tell me", "max_tokens": 3000, "ignore_eos": True,
                       "stream": True, "session_id": "gone"})
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while b"data:" not in received:  # headers first, then the first event
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    sock.close()
    assert _wait_idle(server)["num_running_reqs"] == 0
    assert server.metric("burstrl:client_disconnects_total") == before + 1
    calls = server.get("/v1/traces/gone")["calls"]
    assert calls[0]["finish_reason"] == "abort" and len(calls[0]["completion_ids"]) < 3000


def test_health_loads_and_metrics_shapes(server: Server) -> None:
    assert server.get("/health")["status"] == "ok"
    loads = server.get("/v1/loads")
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
                "token_usage", "cache_hit_rate", "sessions"):
        assert key in loads
    text = HTTP.get(server.url + "/metrics").text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "burstrl:kv_thrash_total"):
        assert f"{name}{{" in text


@pytest.mark.slow
def test_tls_serves_https(tiny_model_dir: Path, tmp_path: Path, tls_cert: tuple[Path, Path]) -> None:
    from .conftest import start_server, stop_server

    cert, key = tls_cert
    srv = start_server(tiny_model_dir, tmp_path / "tls", "--server.ssl_certfile", str(cert),
                       "--server.ssl_keyfile", str(key))
    try:
        assert srv.url.startswith("https://")
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, verify=str(cert))
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            HTTP.get(srv.url.replace("https://", "http://") + "/health", timeout=5)
    finally:
        stop_server(srv)


@pytest.mark.parametrize("header", ["X-Session-ID", "X-SMG-Routing-Key", "X-Dynamo-Session-ID"])
def test_session_id_from_headers(server: Server, header: str) -> None:
    sid = f"hdr-{header.lower()}"
    r = HTTP.post(server.url + "/v1/chat/completions", json=CHAT, headers={header: sid})
    assert r.status_code == 200 and r.json()["meta_info"]["session_id"] == sid
    assert len(server.get(f"/v1/traces/{sid}")["calls"]) == 1
