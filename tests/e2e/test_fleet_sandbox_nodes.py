"""A shared fleet's sandbox nodes (issue 51): `burstrl fleet up --fleet.sandbox_nodes 1` runs a node
agent with the fleet's tenant key, lists it in fleet.json and to tenants (`GET /v1/fleet/sandbox-nodes`);
a tenant run's nodes file (`tenant_run.write_fleet_sandbox_nodes`, what its SWE env reads) holds its
tenant token, never the node's; through it the tenant's `ClusterPool` places sandboxes on the node,
which another tenant cannot see, and past `fleet.sandbox_tenant_max` a tenant is refused while the
other still creates; the fleet's `router.tenants` weights and `fleet.sandbox_node_slots` reach the node. A tenant whose launcher goes quiet (killed with -9; here one that never calls)
loses its sandboxes to the fleet after `fleet.tenant_idle_s`, while the sandbox of a tenant whose
launcher still asks for the replicas stays. Stopping the fleet stops the agent and its sandboxes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from burstrl.deadline import sync_client
from burstrl.launcher.tenant_run import TenantLauncher, write_fleet_sandbox_nodes
from burstrl.protocol.tenants import tenant_token
from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.cluster import ClusterPool, load_nodes
from burstrl.sandbox.node_client import NodeClient, NodeError

from .conftest import alive, start_fleet, wait_until
from .conftest import events as fleet_events

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")]


def agent_pid(url: str) -> int:
    """The pid of the process listening on `url`'s port (ss), i.e. the node agent."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def restarted(url: str, token: str) -> bool:
    try:
        return NodeClient(url, token, timeout=3).report()["counts"]["created"] == 0
    except NodeError:
        return False


def launchers_asking(router: str, tokens: list[str], stop: threading.Event) -> threading.Thread:
    """What live runs' launchers do: ask the fleet for its replicas every second (the fleet then
    knows they are there and releases nothing of theirs)."""
    def ask() -> None:
        while not stop.wait(1.0):
            for tok in tokens:
                try:
                    httpx.get(f"{router}/v1/fleet/replicas", headers={"Authorization": f"Bearer {tok}"}, timeout=3)
                except httpx.HTTPError:
                    pass

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def test_fleet_sandbox_nodes_serve_tenants_apart(tmp_path: Path, tiny_model_dir: Path) -> None:
    fleet_dir = tmp_path / "fleet"
    proc = start_fleet(fleet_dir, tiny_model_dir, "--fleet.reserved", "1", "--fleet.on_demand", "0",
                       "--fleet.sandbox_nodes", "1", "--fleet.sandbox_tenant_max", "1",
                       "--fleet.sandbox_node_slots", "4", "--router.tenants.run-b.weight", "2",
                       "--orchestrator.swe.backend", "namespace", "--fleet.tenant_idle_s", "4")
    pool, stop = None, threading.Event()
    try:
        info = wait_until(lambda: (fleet_dir / "fleet.json").exists() and json.loads((fleet_dir / "fleet.json").read_text()),
                          150, "the fleet up", proc)
        [node] = info["sandbox_nodes"]
        node_token_file = Path(info["sandbox_node_token_file"])
        assert node_token_file.stat().st_mode & 0o077 == 0
        node_token = node_token_file.read_text().strip()
        key = (fleet_dir / "tenant.key").read_text().strip()
        tok_a, tok_b = tenant_token(key, "run-a"), tenant_token(key, "run-b")
        launchers_asking(info["router"], [tok_a, tok_b], stop)  # run-a and run-b are live runs

        listed = httpx.get(f"{info['router']}/v1/fleet/sandbox-nodes", headers={"Authorization": f"Bearer {tok_a}"},
                           timeout=5)
        assert listed.status_code == 200 and listed.json()["nodes"] == [{"name": node["name"], "url": node["url"]}]
        assert httpx.get(f"{info['router']}/v1/fleet/sandbox-nodes", timeout=5).status_code == 401
        assert httpx.get(f"{info['router']}/v1/fleet/sandbox-nodes", timeout=5,
                         headers={"Authorization": f"Bearer {tenant_token('not-the-key', 'run-a')}"}).status_code == 401

        run_dir = tmp_path / "run-a"
        run_dir.mkdir()
        http = sync_client(timeout=5.0)
        try:
            path = write_fleet_sandbox_nodes(http, info["router"], tok_a, run_dir)
            # the run's launcher: its orchestrator's swe section gets that nodes file (a run's own stays)
            events: list[str] = []
            launcher = SimpleNamespace(cfg=SimpleNamespace(orchestrator=SimpleNamespace(envs=["swe"])), http=http,
                                       url=info["router"], token=tok_a, tenant="run-a", run_dir=run_dir,
                                       event=lambda name, detail="": events.append(name))
            orch = SimpleNamespace(orchestrator=SimpleNamespace(swe=SimpleNamespace(nodes_file="")))
            TenantLauncher.start_sandbox_nodes(launcher, orch)  # type: ignore[arg-type]
            assert orch.orchestrator.swe.nodes_file == str(path) and events == ["sandbox_nodes"]
            own = SimpleNamespace(orchestrator=SimpleNamespace(swe=SimpleNamespace(nodes_file="/mine.json")))
            TenantLauncher.start_sandbox_nodes(launcher, own)  # type: ignore[arg-type]
            assert own.orchestrator.swe.nodes_file == "/mine.json"
        finally:
            http.close()
        assert path is not None and path.stat().st_mode & 0o077 == 0
        assert node_token not in path.read_text()
        [ref] = load_nodes(path)
        assert (ref.url, ref.token) == (node["url"], tok_a)

        pool = ClusterPool([ref], refresh_s=0.2)  # what run-a's SWE env makes of its nodes file
        mine = pool.create(SandboxSpec(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60), timeout=60)
        assert mine.client.exec("echo ok").stdout == "ok\n"

        a, b = NodeClient(node["url"], tok_a), NodeClient(node["url"], tok_b)
        assert [s["id"] for s in a.report()["sandboxes"]] == [mine.id]
        assert b.report()["sandboxes"] == [] and mine.id not in json.dumps(b.report())
        with pytest.raises(NodeError) as gone:
            b.delete(mine.id)
        assert gone.value.status == 404
        with pytest.raises(NodeError) as capped:  # run-a holds its cap (1) on this node
            a.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)
        assert capped.value.status == 429
        theirs = b.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)  # run-b is not starved
        b.delete(theirs.id)
        assert mine.client.exec("echo still").stdout == "still\n"
        pool.close()
        pool = None
        assert a.report()["sandboxes"] == []
        whole = NodeClient(node["url"], node_token).report()  # the fleet's own token sees the node
        assert whole["counts"]["tenant_refused"] == 1
        # the fleet's weights and slots reach its node (weighted shares: tests/security/test_sandbox_node_shares.py)
        shares = whole["shares"]
        assert shares["slots"] == 4 and shares["tenants"]["run-b"]["weight"] == 2.0, shares
        assert shares["tenants"]["run-a"]["weight"] == 1.0 and "shares" not in a.report(), shares

        # an agent that dies is started again at the same URL (the list tenants read stays true)
        os.kill(agent_pid(node["url"]), signal.SIGKILL)
        wait_until(lambda: restarted(node["url"], node_token), 60, "the sandbox node restarted", proc)
        again = a.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)
        assert [s["id"] for s in a.report()["sandboxes"]] == [again.id]

        # run-k's launcher goes quiet (a -9; here it never calls): the fleet deletes its sandbox after
        # fleet.tenant_idle_s, with the node's token; run-a's, whose launcher asks, stays
        k = NodeClient(node["url"], tenant_token(key, "run-k"))
        lost = k.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60)
        assert [s["id"] for s in k.report()["sandboxes"]] == [lost.id]
        [released] = wait_until(lambda: [e for e in fleet_events(fleet_dir, "tenant_released")
                                         if e["detail"].startswith("run-k:")], 30, "the fleet to release run-k", proc)
        assert k.report()["sandboxes"] == []
        assert "1 sandboxes deleted, 0 failed" in released["detail"]
        assert not [e for e in fleet_events(fleet_dir, "tenant_released") if e["detail"].startswith(("run-a", "run-b"))]
        assert [s["id"] for s in a.report()["sandboxes"]] == [again.id]
        assert again.id in [s["id"] for s in NodeClient(node["url"], node_token).report()["sandboxes"]]
        k.delete(k.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=60).id)  # run-k resumed: under its cap
        # run-a ends: its launcher deletes what its orchestrator left there (its token, its own only)
        TenantLauncher.release_sandboxes(launcher)  # type: ignore[arg-type]
        assert a.report()["sandboxes"] == [] and events[-1] == "sandboxes_released"
    finally:
        stop.set()
        if pool is not None:
            pool.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    with pytest.raises(NodeError):  # the agent went with the fleet
        NodeClient(node["url"], node_token, timeout=3).health()
    assert not alive(proc.pid)
    assert "stopped: taking the fleet down" in (tmp_path / "fleet.out").read_text()  # a fleet's own stop line
