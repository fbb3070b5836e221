"""Replicas forked from the zygote (providers/zygote.py): they serve, and nothing outlives its owner.

The zygote and every replica forked from it are stopped by `LocalProvider.close()`, die when the
launcher is SIGKILLed, and die with the zygote; a provider whose zygote is gone starts replicas
the ordinary way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from burstrl.providers import Placement
from burstrl.providers.local import REPLICA_LISTEN, LocalProvider
from burstrl.providers.zygote import ForkedRole, Zygote, fork_safe
from tests.http_client import HTTP
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
REPLICA = Placement(listen=REPLICA_LISTEN, pool="on_demand")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def gone(pid: int) -> bool:
    """The process has ended: no such pid, or a zombie (it holds no port, memory or GPU; reaping an
    orphan is init's job, which a container's init may not do)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def serve_args(model: Path) -> list[str]:
    return ["serve", "--model", str(model), "--port", "0"]


def test_fork_safe_refuses_while_another_thread_runs() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="holder")
    t.start()
    try:
        assert "holder" in fork_safe()
    finally:
        stop.set()
        t.join()


def test_forked_replicas_serve_and_close_stops_everything(tiny_model_dir: Path, tmp_path: Path) -> None:
    provider = LocalProvider(tmp_path / "logs", {}, zygote_model=str(tiny_model_dir))
    try:
        a = provider.start("replica-1", serve_args(tiny_model_dir), wait_ready=True, timeout=300, placement=REPLICA)
        b = provider.start("replica-2", serve_args(tiny_model_dir), wait_ready=True, timeout=300, placement=REPLICA)
        assert isinstance(a, ForkedRole) and isinstance(b, ForkedRole)
        for r in (a, b):
            assert HTTP.get(f"{r.url}/health", timeout=30).status_code == 200
            assert os.getpgid(r.pid) == r.pid  # its own group: killpg(pid) stops exactly it
            assert r.poll() is None and r.log.exists()
        a.kill()
        assert a.poll() == -signal.SIGKILL
        assert HTTP.get(f"{b.url}/health", timeout=30).status_code == 200  # its sibling serves on
        zygote = provider.zygote.proc.pid
    finally:
        provider.close()
    wait_for(lambda: gone(b.pid) and gone(zygote), 60, "the replica and the zygote to be gone")
    assert b.poll() is not None


def test_zygote_death_kills_its_replicas_and_the_provider_falls_back(tiny_model_dir: Path, tmp_path: Path) -> None:
    provider = LocalProvider(tmp_path / "logs", {}, zygote_model=str(tiny_model_dir))
    try:
        a = provider.start("replica-1", serve_args(tiny_model_dir), wait_ready=True, timeout=300, placement=REPLICA)
        os.kill(provider.zygote.proc.pid, signal.SIGKILL)
        wait_for(lambda: a.poll() is not None, 60, "the forked replica to be reported dead")
        wait_for(lambda: gone(a.pid), 60, "the forked replica to be gone")
        wait_for(lambda: not provider.zygote.alive(), 60, "the provider to see the zygote gone")
        b = provider.start("replica-2", serve_args(tiny_model_dir), wait_ready=True, timeout=300, placement=REPLICA)
        assert not isinstance(b, ForkedRole) and provider.zygote_fallbacks == 1
        assert HTTP.get(f"{b.url}/health", timeout=30).status_code == 200
        b.stop()
    finally:
        provider.close()


def test_a_forked_replica_dies_with_the_owner_it_watches(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A Ray replica's owner is its actor, not the zygote: the zygote kills it when that pid exits,
    and refuses to fork for an owner already gone."""
    zygote = Zygote(tmp_path / "logs", {}, str(tiny_model_dir))
    owner = subprocess.Popen(["sleep", "600"])
    try:
        r = zygote.spawn(serve_args(tiny_model_dir), tmp_path / "r.log", 300, watch=owner.pid, env=dict(os.environ))
        assert HTTP.get(f"{r.url}/health", timeout=30).status_code == 200
        owner.kill()
        owner.wait()
        assert r.exited.wait(60) and r.code == -signal.SIGKILL
        wait_for(lambda: gone(r.pid), 60, "the replica to be gone")
        with pytest.raises(RuntimeError, match=f"its owner {owner.pid} is gone"):
            zygote.spawn(serve_args(tiny_model_dir), tmp_path / "r2.log", 300, watch=owner.pid)
        assert zygote.alive()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        zygote.close()


def test_a_forked_replica_runs_with_the_environment_it_was_given(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`spawn(env=...)` is the child's whole environment (a Ray actor passes its own: CUDA devices,
    tokens), not the zygote's: the admin token from that env guards the replica's admin endpoints."""
    zygote_env = {k: v for k, v in os.environ.items() if k != "BURSTRL_ADMIN_TOKEN"}
    zygote = Zygote(tmp_path / "logs", {}, str(tiny_model_dir))
    try:
        given = zygote.spawn(serve_args(tiny_model_dir), tmp_path / "a.log", 300,
                             env={**zygote_env, "BURSTRL_ADMIN_TOKEN": "token-from-the-owner"})
        plain = zygote.spawn(serve_args(tiny_model_dir), tmp_path / "b.log", 300, env=zygote_env)

        def status(r: ForkedRole, token: str) -> int:
            return HTTP.get(f"{r.url}/v1/traces/nobody", headers={"Authorization": f"Bearer {token}"},
                            timeout=30).status_code

        assert status(given, "token-from-the-owner") == 404 and status(given, "other") == 401
        assert status(plain, "token-from-the-owner") == 401  # a generated token: the env was per child
    finally:
        zygote.close()


OWNER = """
import json, sys, time
from pathlib import Path
from burstrl.providers import Placement
from burstrl.providers.local import REPLICA_LISTEN, LocalProvider
provider = LocalProvider(Path(sys.argv[1]), {}, zygote_model=sys.argv[2])
r = provider.start("replica-1", ["serve", "--model", sys.argv[2], "--port", "0"], wait_ready=True, timeout=300,
                   placement=Placement(listen=REPLICA_LISTEN, pool="reserved"))
print(json.dumps({"zygote": provider.zygote.proc.pid, "replica": r.pid}), flush=True)
time.sleep(3600)
"""


def test_a_launcher_killed_with_sigkill_leaves_no_zygote_or_replica(tiny_model_dir: Path, tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "logs"), str(tiny_model_dir)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})
    try:
        pids = json.loads(owner.stdout.readline())
        assert not gone(pids["zygote"]) and not gone(pids["replica"])
        owner.kill()
        owner.wait()
        wait_for(lambda: gone(pids["zygote"]) and gone(pids["replica"]), 60, "the zygote and its replica to die")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()


WRITER = """
import json, sys
from burstrl.providers.zygote import line_stdout
sys.stdout = line_stdout()
for i in range(3000):
    print(json.dumps({"event": "ready", "url": "http://127.0.0.1:%d" % i, "pid": int(sys.argv[1])}), flush=True)
"""


def test_siblings_sharing_stdout_write_whole_lines_even_unbuffered() -> None:
    """Regression: with PYTHONUNBUFFERED=1, two forked replicas printing their ready lines at once
    produced `{...}{...}` lines, so neither was seen ready and both starts failed."""
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(n)], stdout=write, env=env) for n in range(3)]
    os.close(write)
    with os.fdopen(read) as lines:
        events = [json.loads(line) for line in lines]
    assert [w.wait() for w in writers] == [0, 0, 0]
    assert sorted(e["pid"] for e in events) == sorted([0, 1, 2] * 3000)
