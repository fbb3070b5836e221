"""The fleet's release of a quiet tenant (`launcher/idle_tenants.py`, issue 51): its versions on every
replica and its sandboxes on every fleet sandbox node (the node token's full report, through
`NodeClient`), never another tenant's; a node that does not answer is counted and skipped, and the
release goes on. A poll deletes at most its cap and stops at its time budget (the fleet supervisor's
loop waits on it); the next poll goes on with the same tenant at once.

The router, the replica and the nodes are one loopback HTTP server speaking the calls the sweep
makes (the real agent's side is tests/integration/test_idle_tenants_node.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from burstrl.deadline import sync_client
from burstrl.launcher import idle_tenants
from burstrl.launcher.idle_tenants import IdleTenants
from tests.loopback import JsonHandler, serving


class Fleet(ThreadingHTTPServer):
    """What the router (`/router`), one replica (`/replica`) and sandbox nodes (`/node-a`, `/node-b`)
    answer; every call made, in order, with its bearer."""

    daemon_threads = True

    def __init__(self, quiet: dict[str, float]) -> None:
        super().__init__(("127.0.0.1", 0), Answer)
        self.base = f"http://127.0.0.1:{self.server_address[1]}"
        self.quiet = quiet
        self.models = ["run-k~policy-v3", "run-a~policy-v1", "base"]
        self.nodes = {"node-a": {"s1": "run-k", "s2": "run-a", "s3": "run-k"}, "node-b": {"s4": "run-k"}}
        self.delete_s = {"node-a": 0.0, "node-b": 0.0}  # how long each node takes to delete one sandbox
        self.calls: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        where, _, rest = path.lstrip("/").partition("/")
        if (where, rest) == ("router", "v1/fleet/tenants"):
            return 200, {"tenants": self.quiet}
        if (where, rest) == ("replica", "v1/models"):
            return 200, {"data": [{"id": m} for m in self.models]}
        if (where, rest, method) == ("replica", "v1/unload_lora_adapter", "POST"):
            self.models.remove(body["lora_name"])
            return 200, {}
        held = self.nodes[where]
        if rest == "v1/node" and method == "GET":
            return 200, {"sandboxes": [{"id": s, "tenant": t} for s, t in held.items()]
                         + [{"id": "untenanted", "tenant": None}]}
        if rest.startswith("v1/sandboxes/") and method == "DELETE":
            time.sleep(self.delete_s[where])
            sid = rest.removeprefix("v1/sandboxes/")
            if held.pop(sid, None) is None:
                return 404, {"error": {"message": f"no sandbox {sid!r}"}}
            return 200, {"deleted": sid}
        return 404, {"error": {"message": f"no route {path}"}}


class Answer(JsonHandler):
    server: Fleet

    def serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        with self.server.lock:
            self.server.calls.append((method, self.path, self.headers.get("Authorization", "")))
        status, answer = self.server.answer(method, self.path, body)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a caller that gave up waiting
            self.send_json(status, answer)

    def do_GET(self) -> None:  # noqa: N802 - the http.server names
        self.serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self.serve("DELETE")


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on exit: nothing listens there


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    srv = Fleet({"run-k": 30.0, "run-a": 1.0})
    with serving(srv):
        yield srv


@pytest.fixture
def http() -> Iterator[Any]:
    client = sync_client(timeout=2.0)
    yield client
    client.close()


def idle(http: Any, fleet: Fleet, nodes: list[str], events: list[str], **kwargs: Any) -> IdleTenants:
    return IdleTenants(http, fleet.url("router"), "cluster", "admin", 10.0,
                       lambda name, detail="": events.append(f"{name} {detail}"), nodes=nodes, node_token="node-tok",
                       **kwargs)


def next_poll(tenants: IdleTenants) -> None:
    """The supervisor's next poll, POLL_S later."""
    tenants.last_poll -= idle_tenants.POLL_S


def test_a_quiet_tenant_loses_its_versions_and_sandboxes_only(http: Any, fleet: Fleet) -> None:
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a"), fleet.url("node-b"), dead_url()], events)
    tenants.check([fleet.url("replica")])
    assert fleet.models == ["run-a~policy-v1", "base"]
    assert fleet.nodes == {"node-a": {"s2": "run-a"}, "node-b": {}}  # run-a's sandbox stays
    node_calls = [c for c in fleet.calls if c[1].startswith(("/node-a", "/node-b"))]
    assert node_calls and all(auth == "Bearer node-tok" for _, _, auth in node_calls)
    [event] = events
    assert event.startswith("tenant_released run-k:")
    assert event.endswith("1 versions unloaded, 0 failed; 3 sandboxes deleted, 0 failed")
    assert tenants.released == 1 and "run-k" not in tenants.noticed


def test_a_tenant_with_only_sandboxes_is_released_after_its_grace(http: Any, fleet: Fleet) -> None:
    """A tenant the router never heard from (it never called, or the router restarted) with sandboxes
    but no versions gets `idle_s` from when the fleet first saw them."""
    fleet.quiet, fleet.models = {"run-a": 1.0}, ["run-a~policy-v1"]
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a"), fleet.url("node-b")], events)
    tenants.check([fleet.url("replica")])
    assert events == [] and len(fleet.nodes["node-a"]) == 3
    tenants.noticed["run-k"] -= 11.0  # seen 11 s ago: past its 10 s grace
    next_poll(tenants)
    tenants.check([fleet.url("replica")])
    assert fleet.nodes == {"node-a": {"s2": "run-a"}, "node-b": {}}
    [event] = events
    assert event.startswith("tenant_released run-k:") and "0 versions unloaded, 0 failed; 3 sandboxes deleted" in event


def test_a_failed_delete_is_counted_and_the_rest_go_on(http: Any, fleet: Fleet) -> None:
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a"), fleet.url("node-b")], events)
    sandboxes = tenants.sandboxes()
    assert sandboxes == {fleet.url("node-a"): {"s1": "run-k", "s2": "run-a", "s3": "run-k"},
                         fleet.url("node-b"): {"s4": "run-k"}}, "sandboxes of no tenant are not candidates"
    del fleet.nodes["node-a"]["s1"]  # gone between the report and the delete: a 404
    tenants.release("run-k", {}, 30.0, sandboxes)
    assert fleet.nodes == {"node-a": {"s2": "run-a"}, "node-b": {}}
    assert "2 sandboxes deleted, 1 failed" in events[0] and "left" not in events[0]


def test_no_nodes_no_node_calls(http: Any, fleet: Fleet) -> None:
    events: list[str] = []
    tenants = IdleTenants(http, fleet.url("router"), "cluster", "admin", 10.0,
                          lambda name, detail="": events.append(detail))
    tenants.check([fleet.url("replica")])
    assert not [c for c in fleet.calls if c[1].startswith("/node")]
    assert "1 versions unloaded" in events[0] and "0 sandboxes deleted, 0 failed" in events[0]


def test_a_poll_deletes_at_most_its_cap_and_the_next_goes_on(http: Any, fleet: Fleet) -> None:
    """A tenant that left many sandboxes: each poll deletes `max_deletes` of them (over all nodes and
    tenants), and the tenant stays noticed until none is left: a tenant the router never heard from
    gets no new grace between polls."""
    fleet.quiet = {"run-a": 1.0}  # run-k: never heard of
    fleet.nodes["node-a"].update({f"k{i}": "run-k" for i in range(4)})  # run-k: 7 sandboxes in all
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a"), fleet.url("node-b")], events, max_deletes=3)
    tenants.check([fleet.url("replica")])
    tenants.noticed["run-k"] -= 11.0
    left = []
    for _ in range(3):
        next_poll(tenants)
        tenants.check([fleet.url("replica")])
        left.append(sum(t == "run-k" for held in fleet.nodes.values() for t in held.values()))
    assert left == [4, 1, 0]
    assert events[0].endswith("3 sandboxes deleted, 0 failed; 4 left for the next poll"), events
    assert events[1].endswith("3 sandboxes deleted, 0 failed; 1 left for the next poll"), events
    assert events[2].endswith("1 sandboxes deleted, 0 failed"), events
    assert tenants.released == 1 and "run-k" not in tenants.noticed
    assert fleet.nodes["node-a"] == {"s2": "run-a"} and fleet.models == ["run-a~policy-v1", "base"]


def test_a_slow_node_holds_the_loop_no_longer_than_the_budget(http: Any, fleet: Fleet) -> None:
    """Deletes of 0.3 s each against a 0.5 s budget: the poll starts two and returns; the rest wait."""
    fleet.nodes["node-a"].update({f"k{i}": "run-k" for i in range(10)})
    fleet.delete_s["node-a"] = 0.3
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a")], events, delete_budget_s=0.5)
    start = time.monotonic()
    tenants.check([fleet.url("replica")])
    took = time.monotonic() - start
    assert took < 0.5 + 0.3 + 0.5, f"the poll held the loop {took:.2f} s"
    assert events[0].endswith("2 sandboxes deleted, 0 failed; 10 left for the next poll"), events


def test_a_node_that_stops_answering_gets_no_more_calls_this_poll(http: Any, fleet: Fleet,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete past NODE_TIMEOUT_S is the node down (a 503): its other sandboxes wait for the next poll,
    and the other nodes' deletes go on."""
    monkeypatch.setattr(idle_tenants, "NODE_TIMEOUT_S", 0.3)
    events: list[str] = []
    tenants = idle(http, fleet, [fleet.url("node-a"), fleet.url("node-b")], events)
    sandboxes = tenants.sandboxes()
    fleet.delete_s["node-a"] = 1.0
    tenants.release("run-k", {}, 30.0, sandboxes)
    deletes = [path for method, path, _ in fleet.calls if method == "DELETE"]
    assert deletes == ["/node-a/v1/sandboxes/s1", "/node-b/v1/sandboxes/s4"], deletes
    assert events[0].endswith("1 sandboxes deleted, 1 failed; 1 left for the next poll"), events
    assert tenants.released == 0 and "s3" in fleet.nodes["node-a"] and not fleet.nodes["node-b"]
