"""Push without real replicas: target lists, merging rank reports, retries against a fake replica."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from burstrl.weights.push import PushReport, ReplicaTarget, push, read_targets


def test_read_targets_from_urls_and_a_file(tmp_path: Path) -> None:
    urls = tmp_path / "replicas.txt"
    urls.write_text("# pool A\nhttp://10.0.0.1:8000/\n\nhttps://10.0.0.2:8443  # tls\nhttp://10.0.0.1:8000\n")
    got = read_targets(["http://10.0.0.3:8000"], str(urls), "tok", verify="/ca.pem")
    assert [t.url for t in got] == ["http://10.0.0.3:8000", "http://10.0.0.1:8000", "https://10.0.0.2:8443"]
    assert all(t.token == "tok" and t.verify == "/ca.pem" for t in got)
    assert read_targets([], "", "tok") == []
    with pytest.raises(ValueError, match="http"):
        read_targets(["10.0.0.1:8000"], "", "tok")


def test_merge_reports_of_ranks() -> None:
    a = PushReport(ok=["http://a", "http://b"], bytes_sent=10, seconds=1.0, retries=1)
    b = PushReport(ok=["http://a"], failed={"http://b": "HTTP 401: wrong token"}, bytes_sent=5, seconds=2.5)
    c = PushReport(ok=["http://c"], already=["http://c"], unloaded={"http://c": {"policy-v1": "retiring"}})
    merged = PushReport.merge([a, b, c])
    assert merged.ok == ["http://a", "http://c"]  # failed in any rank = failed
    assert merged.failed == {"http://b": "HTTP 401: wrong token"} and merged.already == ["http://c"]
    assert (merged.bytes_sent, merged.seconds, merged.retries) == (15, 2.5, 1)
    assert merged.unloaded == {"http://c": {"policy-v1": "retiring"}}
    targets = [ReplicaTarget(u, "t") for u in ("http://a", "http://b", "http://c")]
    assert [t.url for t in merged.usable(targets)] == ["http://a", "http://c"]
    assert merged.to_json()["failed"] == merged.failed
    assert PushReport.merge([]) == PushReport()


class FlakyReplica(BaseHTTPRequestHandler):
    """A fake replica: the first `fail_shards` shard PUTs get a 503; commit answers `commit_status`."""

    fail_shards = 0
    commit_status = 200
    calls: list[str] = []

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # /v1/models
        self._reply(200, {"data": [{"id": "base"}]})

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.calls.append(f"PUT {self.path.split('?')[0]} {len(body)}")
        if "/shards/" in self.path and FlakyReplica.fail_shards > 0:
            FlakyReplica.fail_shards -= 1
            return self._reply(503, {"error": {"message": "busy"}})
        if "/shards/" in self.path:
            assert hashlib.sha256(body).hexdigest() == self.headers["X-Shard-SHA256"]
        self._reply(200, {})

    def do_POST(self) -> None:
        self.calls.append(f"POST {self.path}")
        self._reply(self.commit_status, {"error": {"message": "boom"}} if self.commit_status >= 400 else {})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky():
    FlakyReplica.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FlakyReplica)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    thread.join()


def adapter(tmp_path: Path) -> Path:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 9000)  # > 2 send slices
    return tmp_path


def test_5xx_is_retried_with_backoff(flaky: str, tmp_path: Path) -> None:
    FlakyReplica.fail_shards, FlakyReplica.commit_status = 2, 200
    report = push(adapter(tmp_path), "policy-v1", [ReplicaTarget(flaky, "t")], senders=2, retries=3,
                  backoff_s=0.01)
    assert report.ok == [flaky] and report.failed == {} and report.retries == 2
    puts = [c for c in FlakyReplica.calls if "/shards/" in c]
    assert len(puts) == 4 and all(int(c.split()[-1]) > 1 << 20 for c in puts)  # every resend is whole
    assert FlakyReplica.calls[-1] == "POST /v1/adapters/policy-v1/commit"


def test_retries_run_out_and_a_failed_commit_is_not_resent(flaky: str, tmp_path: Path) -> None:
    FlakyReplica.fail_shards, FlakyReplica.commit_status = 10, 200
    report = push(adapter(tmp_path), "policy-v1", [ReplicaTarget(flaky, "t")], retries=2, backoff_s=0.01)
    assert report.ok == [] and "HTTP 503: busy (after 2 retries)" in report.failed[flaky]
    assert not any(c.startswith("POST") for c in FlakyReplica.calls)  # no commit after a failed send
    FlakyReplica.fail_shards, FlakyReplica.commit_status = 0, 500
    report = push(adapter(tmp_path), "policy-v2", [ReplicaTarget(flaky, "t")], retries=2, backoff_s=0.01)
    assert "HTTP 500: boom" in report.failed[flaky] and report.retries == 0
    assert sum(c.startswith("POST") for c in FlakyReplica.calls) == 1
