"""Weighted fair shares on a sandbox node (`sandbox/node_shares.py`): a real agent (`burstrl sandbox
node --max-sandboxes N --tenant-weights ...`) on loopback, two tenants with tokens of the fleet's
key. Tenant A floods: alone, it takes every slot (the honest control: idle share goes to whoever
has work). Then B asks: refused while the node is full, but as A deletes, each freed slot goes to B
until B holds its weighted share, while A's asks get a 429 naming its fair share; from then on B's
honest creates succeed, and the rule protects A the same way once A is below its share.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from burstrl.protocol.process import RoleProcess, start_role
from burstrl.protocol.tenants import tenant_token
from burstrl.sandbox.node_client import NodeClient, NodeError, SandboxAddress

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make system-deps` as root")
NODE_TOKEN = "node-shares-test-token"
KEY = "s" * 64
SPEC = {"cpu_limit": 1, "memory_limit_mb": 256, "start_timeout_s": 120}


def start_agent(tmp_path: Path, slots: int, weights: str) -> tuple[RoleProcess, Path]:
    """A node agent with `slots` slots and `weights` (empty: every tenant weight 1)."""
    state = Path(tempfile.mkdtemp(prefix="sbs", dir="/tmp"))
    key_file = tmp_path / "tenant.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    args = ["sandbox", "node", "--backend", "namespace", "--state-dir", str(state), "--cpus", "8",
            "--memory-mb", "16384", "--sample-s", "0.5", "--name", "shared-node", "--tenant-key-file", str(key_file),
            "--max-sandboxes", str(slots), "--tenant-active-s", "600"]  # long: a slow machine must not idle B out
    if weights:
        args += ["--tenant-weights", weights]
    return start_role(args, tmp_path / "agent", "node.log", timeout=120, env={"BURSTRL_NODE_TOKEN": NODE_TOKEN}), state


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[[int, str], RoleProcess]]:
    started: list[tuple[RoleProcess, Path]] = []

    def make(slots: int, weights: str) -> RoleProcess:
        started.append(start_agent(tmp_path, slots, weights))
        return started[-1][0]

    yield make
    for proc, state in started:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)


def refused(client: NodeClient) -> str:
    """The 429 message of `client`'s create (fails the test if it was admitted or failed otherwise)."""
    with pytest.raises(NodeError) as exc:
        made = client.create(**SPEC)
        client.delete(made.id)
    assert exc.value.status == 429, exc.value.message
    return exc.value.message


@pytest.mark.parametrize(("slots", "weights", "b_share"), [(4, "", 2), (3, "a=2,b=1", 1), (3, "b=2", 2)],
                         ids=["equal", "a2-b1", "a1-b2"])
def test_a_flood_cannot_starve_a_tenant_below_its_share(agent_factory: Callable[[int, str], RoleProcess],
                                                        slots: int, weights: str, b_share: int) -> None:
    agent = agent_factory(slots, weights)
    a = NodeClient(agent.url, tenant_token(KEY, "a"))
    b = NodeClient(agent.url, tenant_token(KEY, "b"))
    node = NodeClient(agent.url, NODE_TOKEN)

    # the honest control: A alone is given every slot, its share is the whole node
    mine: list[SandboxAddress] = [a.create(**SPEC) for _ in range(slots)]
    assert a.report()["share"] == {"slots": slots, "held": slots, "weight": 2.0 if "a=2" in weights else 1.0,
                                   "share": slots, "active": True}
    assert "no free sandbox slot" in refused(a)

    # B asks while the node is full: refused (nothing is preempted), but B is now active
    assert "no free sandbox slot" in refused(b)
    theirs: list[SandboxAddress] = []
    while len(theirs) < b_share:  # each slot A frees is held for B: A's own ask is refused
        a.delete(mine.pop().id)
        why = refused(a)
        assert "fair share" in why and "'a'" in why and "'b'" not in why
        theirs.append(b.create(**SPEC))
    assert b.report()["share"]["share"] == pytest.approx(b_share)
    with theirs[0].client(timeout=60) as c:
        assert c.exec("echo ok").stdout == "ok\n"

    # both at their shares, the node full; B's honest create after deleting its own succeeds
    b.delete(theirs.pop().id)
    theirs.append(b.create(**SPEC))
    # A below its share now: the freed slot is held for A, and B (at its share) is refused
    a.delete(mine.pop().id)
    assert "fair share" in refused(b)
    mine.append(a.create(**SPEC))

    report = node.report()
    assert {t: e["held"] for t, e in report["shares"]["tenants"].items()} == {"a": slots - b_share, "b": b_share}
    assert report["counts"]["share_refused"] == b_share + 1
    seen_by_b = b.report()
    assert "shares" not in seen_by_b and set(seen_by_b["share"]) == {"slots", "held", "weight", "share", "active"}
    assert agent.poll() is None
