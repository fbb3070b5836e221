"""Two runs training at once on one shared fleet (`burstrl fleet up` + `burstrl run --fleet.url`), issue 51.

The fleet (router + 2 replicas with a tenant key) outlives both runs; each run brings only its
trainer and orchestrator, as tenant run-a or run-b. A third run, killed with -9, cannot release
its versions: the fleet does after `fleet.tenant_idle_s`. Before it is killed, with its trainer
paused (no push of its own can come), `burstrl scale` adds a replica: the run's launcher pushes its
newest version there (the catch-up push, `launcher/catch_up.py`). Checks read the runs' own records (store ledger,
metrics.jsonl, fleet.jsonl) and the replicas' adapter lists as the fleet's admin token sees them.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import tomllib

from .conftest import alive, audit, burstrl_cmd, events, finish, read_jsonl, start_fleet, start_run, wait_until

pytestmark = pytest.mark.slow


def token(fleet_dir: Path, tenant: str) -> str:
    r = subprocess.run(burstrl_cmd("fleet", "token", tenant, "--key-file", str(fleet_dir / "tenant.key")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def stored_versions(router: str, admin: str) -> set[str]:
    """Every adapter name on every replica, as stored (`<tenant>~<name>`)."""
    names: set[str] = set()
    for r in httpx.get(f"{router}/v1/replicas", timeout=5).json()["replicas"]:
        models = httpx.get(f"{r['url']}/v1/models", headers={"Authorization": f"Bearer {admin}"}, timeout=5)
        names |= {m["id"] for m in models.json()["data"]}
    return names


def tenant_models(url: str, tok: str) -> list[str]:
    """The versions a replica serves as the tenant sees them."""
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {tok}"}, timeout=5)
    return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []


def newest_version(run_dir: Path) -> int:
    return max(int(p.name.removeprefix("policy-v")) for p in (run_dir / "adapters").glob("policy-v*"))


def catch_up_on_a_new_replica(fleet_dir: Path, router: str, run_dir: Path, tok: str, proc: subprocess.Popen) -> None:
    """Issue 51: a replica added while the run's trainer is paused serves the run's newest version
    within seconds (pushed by the run's launcher); without the catch-up it would wait for the next push."""
    trainer = [int(p) for p in subprocess.run(["pgrep", "-f", str(run_dir / "roles" / "train.toml")],
                                              capture_output=True, text=True).stdout.split()]
    assert trainer, "the run's trainer is found by its config's path"
    for pid in trainer:
        os.kill(pid, signal.SIGSTOP)
    try:
        def listed() -> set[str]:
            r = httpx.get(f"{router}/v1/fleet/replicas", headers={"Authorization": f"Bearer {tok}"}, timeout=5)
            return set(r.json()["replicas"])

        before, newest = listed(), newest_version(run_dir)
        scaled = subprocess.run(burstrl_cmd("scale", str(fleet_dir), "--replicas", "3"), capture_output=True,
                                text=True, timeout=120)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        new = wait_until(lambda: listed() - before, 180, "the added replica to be listed", proc, run_dir)
        joined, (url,) = time.monotonic(), new
        wait_until(lambda: f"policy-v{newest}" in tenant_models(url, tok), 30,
                   f"the added replica to serve policy-v{newest}", proc, run_dir)
        print(f"added replica serves policy-v{newest} {time.monotonic() - joined:.2f} s after it was listed")
        assert newest_version(run_dir) == newest, "the trainer was paused: no push of its own reached it"
        # logged by the launcher's loop once the push's thread is done (within a second)
        wait_until(lambda: [e for e in events(run_dir, "catch_up_push")
                            if e["detail"].startswith(f"policy-v{newest} to {url} in ")], 10, "the catch-up's event")
        pushed = events(run_dir, "catch_up_push")
        assert all(url in e["detail"] for e in pushed), f"only the new replica was caught up: {pushed}"
    finally:
        for pid in trainer:
            os.kill(pid, signal.SIGCONT)


def fleet_pids(fleet_dir: Path) -> list[int]:
    """Processes whose command line names the fleet's directory (its replicas, router, zygote)."""
    out = subprocess.run(["pgrep", "-f", str(fleet_dir)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_two_runs_train_at_once_on_one_fleet_and_release_it(tmp_path: Path, warm_model: Path) -> None:
    fleet_dir = tmp_path / "fleet"
    fleet = start_fleet(fleet_dir, warm_model, "--fleet.reserved", "1", "--fleet.on_demand", "1",
                        "--fleet.tenant_idle_s", "8")
    runs_started: list[subprocess.Popen] = []
    try:
        info = wait_until(lambda: (fleet_dir / "fleet.json").exists() and json.loads(
            (fleet_dir / "fleet.json").read_text()), 240, "the fleet's ready file", fleet, fleet_dir)
        router, admin = info["router"], (fleet_dir / "admin.token").read_text().strip()
        assert os.stat(fleet_dir / "tenant.key").st_mode & 0o077 == 0
        runs = {name: tmp_path / name for name in ("run-a", "run-b")}
        procs = {name: start_run(d, warm_model, "--fleet.url", router, "--fleet.token", token(fleet_dir, name),
                                 "--trainer.steps", "4") for name, d in runs.items()}
        runs_started.extend(procs.values())
        seen: set[str] = set()
        done = threading.Event()

        def watch() -> None:  # the replicas' adapters while the runs train
            while not done.is_set():
                try:
                    seen.update(stored_versions(router, admin))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.3)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            for name, proc in procs.items():
                finish(proc, runs[name], timeout=300)
        finally:
            done.set()
            watcher.join(timeout=10)
        for name, run_dir in runs.items():
            print(name, "attempts:", audit(run_dir, steps=4))
            # rollouts sampled by the tenant's own versions were stored (a trace naming them as
            # stored, `run-a~policy-v1`, once made every such attempt re-run: the run never got past them)
            with sqlite3.connect(run_dir / "store.sqlite") as db:
                assert db.execute("SELECT MAX(version) FROM rollouts").fetchone()[0] >= 1, f"{name}: base only"
            pushed = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("push_ok")]
            assert pushed and all(not m["push_failed"] for m in pushed), f"{name} pushed to the fleet's replicas"
            assert not events(run_dir, "catch_up_push"), "no replica joined late: the trainer's pushes did it all"
            released = events(run_dir, "versions_released")
            assert released and "policy-v1" in released[-1]["detail"], released
            assert "failed: 0" in released[-1]["detail"], released
            saved = tomllib.loads((run_dir / "run_config.toml").read_text())["fleet"]
            assert saved["url"] == router and saved["token"] == "", "the run's saved config holds no token"
        assert {"run-a~policy-v1", "run-b~policy-v1"} <= seen, f"each tenant's own versions: {sorted(seen)}"
        # both runs ended: their versions are gone from every replica, the fleet serves on
        left = stored_versions(router, admin)
        assert not [n for n in left if "~" in n], f"versions left after both runs ended: {sorted(left)}"
        assert httpx.get(f"{router}/health", timeout=5).json()["replicas"] == 2
        chat = httpx.post(f"{router}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {token(fleet_dir, 'run-c')}"},
                          json={"model": "latest", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        status = subprocess.run(burstrl_cmd("fleet", "status", "--run_dir", str(fleet_dir), "--json"),
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        answer = json.loads(status.stdout)
        assert answer["router_up"] and len(answer["replicas"]) == 2 and all(r["healthy"] for r in answer["replicas"])
        # a run killed with -9 cannot release its versions: the fleet does, once it has been quiet for 8 s
        killed = tmp_path / "run-k"
        tok_k = token(fleet_dir, "run-k")
        proc = start_run(killed, warm_model, "--fleet.url", router, "--fleet.token", tok_k, "--trainer.steps", "1000")
        runs_started.append(proc)
        wait_until(lambda: "run-k~policy-v1" in stored_versions(router, admin), 240, "run-k's first version", proc,
                   killed)
        catch_up_on_a_new_replica(fleet_dir, router, killed, tok_k, proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_until(lambda: not [n for n in stored_versions(router, admin) if n.startswith("run-k~")], 90,
                   "the fleet to release run-k's versions")
        assert [e for e in events(fleet_dir, "tenant_released") if e["detail"].startswith("run-k:")]
        assert not [e for e in events(fleet_dir, "tenant_released") if e["detail"].startswith(("run-a", "run-b"))]
        pids = fleet_pids(fleet_dir)
        assert pids, "the fleet's processes are found by its directory"
    finally:
        for run in runs_started:  # a failed check must not leave a run (run-k trains 1000 steps) behind
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(timeout=30)
        if fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGTERM)
        code = fleet.wait(timeout=120)
    assert code == 130, (tmp_path / "fleet.out").read_text()[-3000:]
    wait_until(lambda: not any(alive(p) for p in pids), 30, "every process of the fleet to exit")
    assert not (fleet_dir / "fleet.json").exists()
