"""A fleet's sandbox node list on Ray, where agents come and go with the `sandbox_node` nodes.

The router's list is replaced by the fleet's supervisor (`PUT /v1/fleet/sandbox-nodes`, the cluster
token); tenants read it and never write it. The agent's key-writing preamble (`KEY_THEN_AGENT`) puts
the fleet's tenant key on the agent's node as a mode-600 file in a private dir, and refuses a dir
that is not this user's alone. The live fleet on Ray is tests/e2e/test_ray.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from burstrl.config.roles import RouteConfig
from burstrl.protocol.tenants import tenant_token

KEY = "fleet-key"
TENANT = {"Authorization": f"Bearer {tenant_token(KEY, 'run-a')}"}
CLUSTER = {"Authorization": "Bearer cluster"}


def test_the_supervisor_replaces_the_list_tenants_read_it() -> None:
    from burstrl.router.server import Router, build_app

    first = [{"name": "n0", "url": "http://10.0.0.1:7000"}]
    router = Router(RouteConfig(tenant_key=KEY, cluster_token="cluster", scrape_s=3600, sandbox_nodes=first),
                    "cluster")
    with TestClient(build_app(router)) as client:
        assert client.get("/v1/fleet/sandbox-nodes", headers=TENANT).json() == {"nodes": first}
        joined = [*first, {"name": "n1", "url": "http://10.0.0.2:7000/"}]
        for headers in ({}, TENANT):  # a tenant cannot change where the others' sandboxes go
            assert client.put("/v1/fleet/sandbox-nodes", headers=headers, json={"nodes": []}).status_code == 401
        r = client.put("/v1/fleet/sandbox-nodes", headers=CLUSTER, json={"nodes": joined})
        assert r.status_code == 200, r.text
        listed = client.get("/v1/fleet/sandbox-nodes", headers=TENANT).json()["nodes"]
        assert listed == [first[0], {"name": "n1", "url": "http://10.0.0.2:7000"}]
        for bad in ({"nodes": [{"name": "x", "url": "file:///etc/passwd"}]}, {"nodes": "n0"}, ["n0"]):
            assert client.put("/v1/fleet/sandbox-nodes", headers=CLUSTER, json=bad).status_code == 400
        assert client.get("/v1/fleet/sandbox-nodes", headers=TENANT).json()["nodes"] == listed  # unchanged


def preamble(key_file: Path) -> subprocess.CompletedProcess:
    """The agent's process as its actor starts it, with `--help` so the exec'd agent only prints its usage."""
    from burstrl.providers.ray_sandbox import KEY_ENV, KEY_THEN_AGENT

    return subprocess.run([sys.executable, "-c", KEY_THEN_AGENT, "sandbox", "node", "--tenant-key-file",
                           str(key_file), "--help"], env={**os.environ, KEY_ENV: "the-key"}, capture_output=True,
                          text=True, timeout=120)


def test_the_agent_preamble_writes_the_key_private_then_runs_the_agent(tmp_path: Path) -> None:
    key_file = tmp_path / "keys" / "fleet-node.key"
    done = preamble(key_file)
    assert done.returncode == 0 and "--tenant-key-file" in done.stdout, done.stderr  # the agent's usage
    assert key_file.read_text() == "the-key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in key_file.parent.iterdir()] == [key_file.name]  # no temp file left

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    done = preamble(shared / "fleet-node.key")
    assert done.returncode != 0 and "mode 700" in done.stderr and not list(shared.iterdir())
