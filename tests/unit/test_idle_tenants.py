"""The fleet's release of a quiet tenant (`launcher/idle_tenants.py`, issue 51): its versions on every
replica and its sandboxes on every fleet sandbox node (the node token's full report), never another
tenant's; a node that does not answer is counted and skipped, and the release goes on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from burstrl.deadline import CallFailed, sync_client
from burstrl.launcher import idle_tenants
from burstrl.launcher.idle_tenants import IdleTenants

ROUTER, REPLICA, NODE_A, NODE_B, NODE_DOWN = ("http://router", "http://replica", "http://node-a", "http://node-b",
                                              "http://node-down")


class Reply:
    def __init__(self, body: Any) -> None:
        self.body = body

    def check(self) -> Reply:
        return self

    def json(self) -> Any:
        return json.loads(json.dumps(self.body))


class Fleet:
    """What the router, one replica and the sandbox nodes answer; every call made, in order."""

    def __init__(self, quiet: dict[str, float]) -> None:
        self.quiet = quiet
        self.models = ["run-k~policy-v3", "run-a~policy-v1", "base"]
        self.nodes = {NODE_A: {"s1": "run-k", "s2": "run-a", "s3": "run-k"}, NODE_B: {"s4": "run-k"}}
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def fetch(self, http: Any, method: str, url: str, *, deadline: float, max_bytes: int | None = None,
              headers: dict[str, str] | None = None, **kwargs: Any) -> Reply:
        self.calls.append((method, url, headers or {}))
        if url.startswith(NODE_DOWN):
            raise CallFailed(url, "connection refused", "refused")
        if url == f"{ROUTER}/v1/fleet/tenants":
            return Reply({"tenants": self.quiet})
        if url == f"{REPLICA}/v1/models":
            return Reply({"data": [{"id": m} for m in self.models]})
        if url == f"{REPLICA}/v1/unload_lora_adapter":
            self.models.remove(kwargs["json"]["lora_name"])
            return Reply({})
        node, _, path = url.partition("/v1/")
        if path == "node" and method == "GET":
            return Reply({"sandboxes": [{"id": s, "tenant": t} for s, t in self.nodes[node].items()]
                          + [{"id": "untenanted", "tenant": None}]})
        if path.startswith("sandboxes/") and method == "DELETE":
            sid = path.removeprefix("sandboxes/")
            if sid not in self.nodes[node]:
                raise CallFailed(url, "404", "status")
            del self.nodes[node][sid]
            return Reply({"deleted": sid})
        raise AssertionError(f"unexpected call {method} {url}")


@pytest.fixture
def http() -> Any:
    client = sync_client(timeout=2.0)
    yield client
    client.close()


def idle(http: Any, fleet: Fleet, monkeypatch: pytest.MonkeyPatch, nodes: list[str],
         events: list[str]) -> IdleTenants:
    monkeypatch.setattr(idle_tenants, "fetch", fleet.fetch)
    return IdleTenants(http, ROUTER, "cluster", "admin", 10.0,
                       lambda name, detail="": events.append(f"{name} {detail}"), nodes=nodes, node_token="node-tok")


def test_a_quiet_tenant_loses_its_versions_and_sandboxes_only(http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, events = Fleet({"run-k": 30.0, "run-a": 1.0}), []
    tenants = idle(http, fleet, monkeypatch, [NODE_A, NODE_B, NODE_DOWN], events)
    tenants.check([REPLICA])
    assert fleet.models == ["run-a~policy-v1", "base"]
    assert fleet.nodes == {NODE_A: {"s2": "run-a"}, NODE_B: {}}  # run-a's sandbox stays
    node_calls = [c for c in fleet.calls if c[1].startswith(("http://node-a", "http://node-b"))]
    assert node_calls and all(h == {"Authorization": "Bearer node-tok"} for _, _, h in node_calls)
    [event] = events
    assert event.startswith("tenant_released run-k:")
    assert "1 versions unloaded, 0 failed; 3 sandboxes deleted, 0 failed" in event
    assert tenants.released == 1


def test_a_tenant_with_only_sandboxes_is_released_after_its_grace(http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant the router never heard from (it never called, or the router restarted) with sandboxes
    but no versions gets `idle_s` from when the fleet first saw them."""
    fleet, events = Fleet({"run-a": 1.0}), []
    fleet.models = ["run-a~policy-v1"]
    clock = [1000.0]
    monkeypatch.setattr(idle_tenants.time, "monotonic", lambda: clock[0])
    tenants = idle(http, fleet, monkeypatch, [NODE_A, NODE_B], events)
    tenants.check([REPLICA])
    assert events == [] and len(fleet.nodes[NODE_A]) == 3
    clock[0] += 11.0
    tenants.check([REPLICA])
    assert fleet.nodes == {NODE_A: {"s2": "run-a"}, NODE_B: {}}
    [event] = events
    assert event.startswith("tenant_released run-k:") and "0 versions unloaded, 0 failed; 3 sandboxes deleted" in event


def test_a_failed_delete_is_counted_and_the_rest_go_on(http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, events = Fleet({"run-k": 30.0, "run-a": 1.0}), []
    tenants = idle(http, fleet, monkeypatch, [NODE_A, NODE_B], events)
    sandboxes = tenants.sandboxes()
    del fleet.nodes[NODE_A]["s1"]  # gone between the report and the delete: a 404
    tenants.release("run-k", {}, 30.0, sandboxes)
    assert fleet.nodes == {NODE_A: {"s2": "run-a"}, NODE_B: {}}
    assert "2 sandboxes deleted, 1 failed" in events[0]


def test_no_nodes_no_node_calls(http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, events = Fleet({"run-k": 30.0}), []
    monkeypatch.setattr(idle_tenants, "fetch", fleet.fetch)
    tenants = IdleTenants(http, ROUTER, "cluster", "admin", 10.0, lambda name, detail="": events.append(detail))
    tenants.check([REPLICA])
    assert not [c for c in fleet.calls if "node" in c[1]]
    assert "1 versions unloaded" in events[0] and "0 sandboxes deleted, 0 failed" in events[0]
