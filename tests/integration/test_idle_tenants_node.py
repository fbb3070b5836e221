"""The fleet's sweep of a quiet tenant's sandboxes (`launcher/idle_tenants.py`) against a real node agent
(`burstrl sandbox node --tenant-key-file`) on loopback: it reads the node's full report with the node's
own token (`NodeClient.owners`), deletes only the quiet tenant's sandboxes, at most `max_deletes` per
poll, and finishes on the next poll; the other tenant's sandbox still runs.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.deadline import sync_client
from burstrl.launcher.idle_tenants import IdleTenants
from burstrl.protocol.process import RoleProcess, start_role
from burstrl.protocol.tenants import tenant_token
from burstrl.sandbox.node_client import NodeClient

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")
NODE_TOKEN = "idle-tenants-node-token"
KEY = "i" * 64
SPEC = {"cpu_limit": 1, "memory_limit_mb": 256, "start_timeout_s": 60}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RoleProcess]:
    state = Path(tempfile.mkdtemp(prefix="sbi", dir="/tmp"))
    key_file = tmp_path / "tenant.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    args = ["sandbox", "node", "--backend", "namespace", "--state-dir", str(state), "--cpus", "8",
            "--memory-mb", "16384", "--name", "fleet-node", "--tenant-key-file", str(key_file),
            "--tenant-max-sandboxes", "4"]
    proc = start_role(args, tmp_path / "agent", "node.log", timeout=60, env={"BURSTRL_NODE_TOKEN": NODE_TOKEN})
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)


def test_a_quiet_tenants_sandboxes_go_a_capped_batch_per_poll(agent: RoleProcess) -> None:
    k = NodeClient(agent.url, tenant_token(KEY, "run-k"))
    a = NodeClient(agent.url, tenant_token(KEY, "run-a"))
    mine = {k.create(**SPEC).id for _ in range(3)}
    theirs = a.create(**SPEC)
    events: list[str] = []
    with sync_client(timeout=5.0) as http:
        tenants = IdleTenants(http, "http://127.0.0.1:1", "cluster", "admin", 10.0,
                              lambda name, detail="": events.append(detail), nodes=[agent.url],
                              node_token=NODE_TOKEN, max_deletes=2)
        seen = tenants.sandboxes()
        assert seen == {agent.url: {**dict.fromkeys(mine, "run-k"), theirs.id: "run-a"}}
        tenants.release("run-k", {}, 30.0, seen)
        assert len(k.report()["sandboxes"]) == 1
        assert events[-1].endswith("2 sandboxes deleted, 0 failed; 1 left for the next poll"), events
        tenants.release("run-k", {}, 35.0, tenants.sandboxes())
    assert events[-1].endswith("1 sandboxes deleted, 0 failed"), events
    assert k.report()["sandboxes"] == [] and tenants.released == 1
    assert [s["id"] for s in a.report()["sandboxes"]] == [theirs.id]
    with theirs.client(timeout=60) as c:
        assert c.exec("echo still").stdout == "still\n"
