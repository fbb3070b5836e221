"""A tenant run's nodes file follows the fleet's sandbox nodes (issue 51): on a Ray fleet nodes join
and leave mid-run, and the router's `GET /v1/fleet/sandbox-nodes` follows them; the run's launcher
rewrites RUN_DIR/sandbox_nodes.json from it (at once, mode 600, the tenant token as every node's
bearer) so its SWE env's pool, which re-reads the file when it changes, sees them. An unchanged
list leaves the file alone; an empty one (the router restarting) keeps the last."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from burstrl.deadline import sync_client
from burstrl.launcher.tenant_run import NODES_FILE, TenantLauncher
from burstrl.sandbox.cluster import load_nodes
from tests.loopback import JsonHandler, serving

TOKEN = "run-a.0123456789abcdef"


class NodeListing(JsonHandler):
    """The fleet's router as a tenant's launcher asks it for the sandbox nodes (tenant token only)."""

    nodes: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        ok = self.path == "/v1/fleet/sandbox-nodes" and self.headers.get("Authorization") == f"Bearer {TOKEN}"
        self.send_json(200 if ok else 401, {"nodes": self.nodes} if ok else {"error": {"message": "no"}})


@pytest.fixture
def listing() -> Iterator[tuple[type[NodeListing], str]]:
    handler = type("Listing", (NodeListing,), {"nodes": [{"name": "n0", "url": "http://10.0.0.1:7000"}]})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        yield handler, url


def test_the_runs_nodes_file_follows_the_fleets_list(listing: tuple[type[NodeListing], str], tmp_path: Path) -> None:
    handler, url = listing
    http = sync_client(timeout=5.0)
    events: list[str] = []
    launcher = SimpleNamespace(cfg=SimpleNamespace(orchestrator=SimpleNamespace(envs=["swe"])), http=http, url=url,
                               token=TOKEN, tenant="run-a", run_dir=tmp_path, fleet_nodes=False, last_node_poll=0.0,
                               node_poll_errors=0, event=lambda name, detail="": events.append(name))
    orch = SimpleNamespace(orchestrator=SimpleNamespace(swe=SimpleNamespace(nodes_file="")))
    path = tmp_path / NODES_FILE

    def poll() -> None:
        launcher.last_node_poll = 0.0  # the launcher's loop, without its 3 s between polls
        TenantLauncher.poll_sandbox_nodes(launcher)  # type: ignore[arg-type]

    try:
        poll()  # before the run placed its sandboxes on the fleet's nodes: nothing to follow
        assert not path.exists()
        TenantLauncher.start_sandbox_nodes(launcher, orch)  # type: ignore[arg-type]
        assert orch.orchestrator.swe.nodes_file == str(path) and launcher.fleet_nodes
        first = path.stat()
        poll()  # the same list: the file is left alone (the pool re-reads only on a change)
        assert (path.stat().st_mtime_ns, path.stat().st_ino) == (first.st_mtime_ns, first.st_ino)

        handler.nodes = [*handler.nodes, {"name": "n1", "url": "http://10.0.0.2:7000"}]  # a node joined
        poll()
        refs = load_nodes(path)
        assert [(r.url, r.token) for r in refs] == [("http://10.0.0.1:7000", TOKEN), ("http://10.0.0.2:7000", TOKEN)]
        assert path.stat().st_mode & 0o777 == 0o600

        handler.nodes = []  # the router restarting, an agent between lives: the last list stays
        poll()
        assert len(load_nodes(path)) == 2
        handler.nodes = [{"name": "n1", "url": "http://10.0.0.2:7000"}]  # n0 left
        poll()
        assert [r.url for r in load_nodes(path)] == ["http://10.0.0.2:7000"]
        assert not list(tmp_path.glob(f".{NODES_FILE}.*"))  # no temp file left behind

        launcher.token = "run-a.wrong"  # the router refuses: counted, the run goes on
        poll()
        assert launcher.node_poll_errors == 1 and [r.url for r in load_nodes(path)] == ["http://10.0.0.2:7000"]
    finally:
        http.close()
