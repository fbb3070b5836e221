"""Tenants on a sandbox node (issue 51): a real agent (`burstrl sandbox node --tenant-key-file`) on
loopback, two tenants with tokens of the fleet's key. Tenant B is hostile: it must not see, read
the address or token of, exec in, or delete tenant A's sandbox; forged tokens are refused; a tenant
at its cap gets a 429 at once while the other still creates (the honest control), and A's own
create/delete works throughout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from burstrl.protocol.process import RoleProcess, start_role
from burstrl.protocol.tenants import tenant_token
from burstrl.sandbox.client import SandboxError
from burstrl.sandbox.node_client import NodeClient, NodeError, SandboxAddress, node_state
from burstrl.sandbox.node_tenants import read_tenant_key

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")
NODE_TOKEN = "node-tenant-test-token"
KEY = "k" * 64
SPEC = {"cpu_limit": 1, "memory_limit_mb": 256, "start_timeout_s": 60}


def agent_args(state: Path, key_file: Path) -> list[str]:
    return ["sandbox", "node", "--backend", "namespace", "--state-dir", str(state), "--cpus", "8",
            "--memory-mb", "16384", "--sample-s", "0.2", "--name", "fleet-node", "--tenant-key-file", str(key_file),
            "--tenant-max-sandboxes", "2", "--tenant-caps", "b=3"]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RoleProcess]:
    state = Path(tempfile.mkdtemp(prefix="sbt", dir="/tmp"))
    key_file = tmp_path / "tenant.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    proc = start_role(agent_args(state, key_file), tmp_path / "agent", "node.log", timeout=60,
                      env={"BURSTRL_NODE_TOKEN": NODE_TOKEN})
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)


def status_of(call: object) -> int:
    try:
        call()  # type: ignore[operator]
    except NodeError as exc:
        return exc.status
    return 200


def test_tenants_see_and_touch_only_their_own_sandboxes(agent: RoleProcess) -> None:
    a = NodeClient(agent.url, tenant_token(KEY, "a"))
    b = NodeClient(agent.url, tenant_token(KEY, "b"))
    node = NodeClient(agent.url, NODE_TOKEN)

    a1 = a.create(**SPEC)
    with a1.client(timeout=60) as c:
        c.write_file("/work/secret", "a's data")
    b1 = b.create(**SPEC)

    # B's report: its own sandbox only; nothing of A's id, URL, socket, pid or token
    seen_by_b = b.report()
    assert [s["id"] for s in seen_by_b["sandboxes"]] == [b1.id]
    dump = json.dumps(seen_by_b)
    for secret in (a1.id, a1.url, a1.token, a1.socket, b1.token):
        assert secret and secret not in dump
    assert seen_by_b["others"]["count"] == 1 and "swept_at_start" not in seen_by_b
    assert [s.name for s in node_state(seen_by_b).sandboxes] == [b1.id, "(other tenants)"]  # placement still sees load
    assert [s["id"] for s in a.report()["sandboxes"]] == [a1.id]
    everything = node.report()  # the node's own token sees all, with their owners
    assert {(s["id"], s["tenant"]) for s in everything["sandboxes"]} == {(a1.id, "a"), (b1.id, "b")}

    # B cannot delete A's sandbox: the same 404 as an id that never existed
    with pytest.raises(NodeError) as theirs:
        b.delete(a1.id)
    with pytest.raises(NodeError) as unknown:
        b.delete("no-such-sandbox")
    assert theirs.value.status == unknown.value.status == 404
    assert theirs.value.message.replace(a1.id, "X") == unknown.value.message.replace("no-such-sandbox", "X")

    # B cannot exec in A's sandbox: its own daemon token does not open A's port, and A's is never handed to B
    with pytest.raises(SandboxError), SandboxAddress(a1.id, a1.url, b1.token).client(timeout=10) as c:
        c.exec("cat /work/secret")
    with a1.client(timeout=60) as c:  # A's sandbox is untouched
        assert c.read_file("/work/secret") == b"a's data"

    # forged and absent tokens: 401
    forged = ["", "a", "a.", "a." + "0" * 64, tenant_token("other-key", "a"), tenant_token(KEY, "a") + "0",
              "A." + tenant_token(KEY, "a").split(".", 1)[1], NODE_TOKEN + "x"]
    for token in forged:
        bad = NodeClient(agent.url, token)
        assert status_of(bad.report) == 401, token
        assert status_of(lambda bad=bad: bad.create(**SPEC)) == 401, token
        assert status_of(lambda bad=bad: bad.delete(a1.id)) == 401, token

    # caps: A (default cap 2) is refused at once past it; B (its own cap 3) still creates
    a2 = a.create(**SPEC)
    with pytest.raises(NodeError) as refused:
        a.create(**SPEC)
    assert refused.value.status == 429 and "cap" in refused.value.message and "'a'" in refused.value.message
    b2 = b.create(**SPEC)
    b3 = b.create(**SPEC)
    assert status_of(lambda: b.create(**SPEC)) == 429
    assert node.report()["counts"]["tenant_refused"] == 2

    # A's own delete works and frees its slot
    a.delete(a1.id)
    with pytest.raises(SandboxError), a1.client(timeout=5) as c:
        c.exec("true")
    a3 = a.create(**SPEC)
    assert {s["id"] for s in a.report()["sandboxes"]} == {a2.id, a3.id}
    assert {s["id"] for s in b.report()["sandboxes"]} == {b1.id, b2.id, b3.id}
    with a3.client(timeout=60) as c:
        assert c.exec("echo ok").stdout == "ok\n"
    assert agent.poll() is None


def test_the_tenant_key_file_must_be_private(tmp_path: Path) -> None:
    key_file = tmp_path / "tenant.key"
    key_file.write_text(KEY)
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="mode 600"):
        read_tenant_key(key_file)
    state = Path(tempfile.mkdtemp(prefix="sbt", dir="/tmp"))
    try:
        env = {**os.environ, "BURSTRL_NODE_TOKEN": NODE_TOKEN}
        done = subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()",
                               *agent_args(state, key_file)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "mode 600" in done.stderr
    finally:
        shutil.rmtree(state, ignore_errors=True)
    key_file.chmod(0o600)
    assert read_tenant_key(key_file) == KEY
