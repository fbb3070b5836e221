"""`NodeClient`'s cap on what one answer may hold and its owners view of a report (`sandbox/node_client.py`),
against a loopback server that answers what a broken or hostile agent might."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from burstrl.sandbox.node_client import NodeClient, NodeError
from tests.loopback import JsonHandler, serving


class Agent(ThreadingHTTPServer):
    """Answers every GET with `body` (bytes) and `status`."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Answer)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.status, self.body = 200, b"{}"


class Answer(JsonHandler):
    server: Agent

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        self.send_json(self.server.status, self.server.body)


@pytest.fixture
def agent() -> Iterator[Agent]:
    srv = Agent()
    with serving(srv):
        yield srv


def report(sandboxes: list[dict[str, object]]) -> bytes:
    return json.dumps({"name": "n", "sandboxes": sandboxes}).encode()


def test_an_answer_over_max_bytes_is_a_node_error_and_one_at_it_is_read(agent: Agent) -> None:
    agent.body = report([{"id": f"s{i}", "tenant": "run-k", "pad": "x" * 1000} for i in range(100)])
    with pytest.raises(NodeError) as over:
        NodeClient(agent.url, "tok", timeout=10, max_bytes=len(agent.body) - 1).report()
    assert over.value.status == 502 and f"over {len(agent.body) - 1} bytes" in over.value.message
    assert len(NodeClient(agent.url, "tok", timeout=10, max_bytes=len(agent.body)).report()["sandboxes"]) == 100
    assert len(NodeClient(agent.url, "tok", timeout=10).report()["sandboxes"]) == 100  # no cap: as before


def test_a_refusal_over_max_bytes_keeps_its_status(agent: Agent) -> None:
    agent.status, agent.body = 401, json.dumps({"error": {"message": "x" * 5000}}).encode()
    with pytest.raises(NodeError) as refused:
        NodeClient(agent.url, "tok", timeout=10, max_bytes=100).report()
    assert refused.value.status == 401 and len(refused.value.message) <= 200


def test_owners_are_the_tenanted_sandboxes_and_a_report_without_them_is_a_node_error(agent: Agent) -> None:
    agent.body = report([{"id": "s1", "tenant": "run-k"}, {"id": 2, "tenant": "run-a"}, {"id": "own", "tenant": None},
                         {"id": "old"}])
    assert NodeClient(agent.url, "tok", timeout=10).owners() == {"s1": "run-k", "2": "run-a"}
    for broken in (b'{"name": "n"}', b'{"sandboxes": [1, 2]}', b'{"sandboxes": [{"tenant": "a"}]}', b"[]"):
        agent.body = broken
        with pytest.raises(NodeError) as bad:
            NodeClient(agent.url, "tok", timeout=10).owners()
        assert bad.value.status == 502, broken
