"""`burstrl run --provider ray` on a local Ray instance: learning, elastic replicas, faults, placement.

One Ray instance serves the module (16 logical CPUs, 4 logical GPUs, one `sandbox_node`, no
dashboard, a small object store, usage stats off); every run is a separate driver in its own
namespace (one per run directory). Only the shared fleet's test starts sandbox node agents there
(a run starts them only for the swe env). The two-node spot-loss test, with its own
`ray.cluster_utils.Cluster`, is in test_ray_spot.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from burstrl.envs.toy_eval import held_out_greedy
from tests.http_client import HTTP

from .conftest import (
    SMALL,
    alive,
    audit,
    burstrl_cmd,
    events,
    finish,
    init_local_ray,
    interrupt,
    last_step,
    output,
    read_jsonl,
    scale,
    start_fleet,
    start_ray_run,
    wait_until,
)

pytestmark = pytest.mark.slow
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


@pytest.fixture(scope="module")
def ray_address():
    import ray

    ctx = init_local_ray(num_cpus=16, num_gpus=4, resources={"sandbox_node": 1}, include_dashboard=False,
                         object_store_memory=100 * 2**20, namespace="burstrl-tests", log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def served(url: str) -> set[str]:
    try:
        return {m["id"] for m in HTTP.get(f"{url}/v1/models", timeout=5).json()["data"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return set()


def served_replicas(router: str) -> int:
    """The replicas a router routes to (0 while it does not answer: a restart)."""
    try:
        return HTTP.get(f"{router}/health", timeout=5).json().get("replicas", 0)
    except (httpx.HTTPError, ValueError):
        return 0


def newest_version(run_dir: Path) -> int:
    from burstrl.weights.volume import latest

    found = latest(run_dir / "adapters")
    return found[0] if found else 0


def replaced(run_dir: Path, name: str) -> list[dict]:
    return [e for e in events(run_dir, "replica_started") if f"(replaces {name})" in e["detail"]]


def test_ray_replicas_scale_die_and_come_back_on_the_current_version(tmp_path: Path, warm_model: Path,
                                                                     ray_address: str) -> None:
    """Replicas started the ordinary way (each a child of its actor's worker); forked ones are
    tested by test_replicas_fork_from_their_nodes_zygote_and_die_with_their_actor."""
    run_dir = tmp_path / "elastic"
    # more steps than the test can take: the run must still be going when the test stops it (200 once
    # finished first on a fast machine, and the final SIGTERM found no process group)
    proc = start_ray_run(run_dir, warm_model, ray_address, "--trainer.steps", "100000", "--fleet.on_demand", "1",
                         "--fleet.zygote", "false")
    try:
        wait_until(lambda: last_step(run_dir) >= 2 and (run_dir / "launcher.json").exists(), 300, "step 2", proc,
                   run_dir)
        scale(run_dir, 3)  # add: 1 reserved + 1 on-demand -> 3 replicas
        wait_until(lambda: [e for e in events(run_dir, "replica_started") if "burstrl scale" in e["detail"]],
                   200, "the added replica", proc, run_dir)

        # the replica's process is SIGKILLed: the actor's wait() returns -9
        serve_pids = pgrep(str(run_dir / "roles" / "serve.toml"))
        assert len(serve_pids) == 3
        os.kill(serve_pids[0], signal.SIGKILL)
        dead = wait_until(lambda: events(run_dir, "replica_died"), 60, "the death to be seen", proc, run_dir)[0]
        assert "exit -9" in dead["detail"]
        new = wait_until(lambda: replaced(run_dir, dead["replica"]), 200, "a replacement", proc, run_dir)[0]
        url = new["detail"].split()[0]
        wait_until(lambda: f"policy-v{newest_version(run_dir)}" in served(url), 60,
                   "the replacement to serve the current version", proc, run_dir)

        # the actor's worker process dies (as on a lost node): ActorDiedError
        child = pgrep(str(run_dir / "roles" / "serve.toml"))[0]
        os.kill(parent(child), signal.SIGKILL)
        died = wait_until(lambda: [e for e in events(run_dir, "replica_died") if "actor died" in e["detail"]], 60,
                          "ActorDiedError to be seen", proc, run_dir)[0]
        wait_until(lambda: replaced(run_dir, died["replica"]), 200, "its replacement", proc, run_dir)
        assert not alive(child), "the replica process outlived its actor"

        # the router's process dies: Ray restarts the actor at the same address, the launcher re-registers
        step_then = last_step(run_dir)
        os.kill(pgrep(str(run_dir / "roles" / "router.toml"))[0], signal.SIGKILL)
        wait_until(lambda: events(run_dir, "router_restarted"), 120, "the router restart", proc, run_dir)
        wait_until(lambda: last_step(run_dir) >= step_then + 2, 300, "steps after the router restart", proc,
                   run_dir)

        # remove: back to 2 replicas, one drains and stops
        scale(run_dir, 2)
        wait_until(lambda: events(run_dir, "replica_stopped"), 120, "a drained replica to stop", proc, run_dir)
        wait_until(lambda: len(pgrep(str(run_dir / "roles" / "serve.toml"))) == 2, 60, "2 replica processes")
    finally:
        interrupt(proc, run_dir)
    audit(run_dir, last_step(run_dir))
    wait_until(lambda: not pgrep(str(run_dir / "roles")), 30, "every role process to end")


def test_a_killed_trainer_rank_relaunches_the_group_from_its_checkpoint(tmp_path: Path, warm_model: Path,
                                                                       ray_address: str) -> None:
    run_dir = tmp_path / "ranks"
    steps = 6
    proc = start_ray_run(run_dir, warm_model, ray_address, "--trainer.steps", str(steps),
                         "--trainer.world_size", "2")
    wait_until(lambda: last_step(run_dir) >= 2, 300, "step 2", proc, run_dir)
    ranks = pgrep(f"rank_main.*{run_dir}")  # this run's: other workers' runs have ranks too
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    finish(proc, run_dir, timeout=400)
    relaunch = events(run_dir, "trainer_relaunched")
    assert len(relaunch) == 1, output(run_dir)
    audit(run_dir, steps)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()


def test_kill_9_of_the_launcher_takes_every_actor_with_it_then_resume_and_learn(tmp_path: Path, warm_model: Path,
                                                                                 ray_address: str) -> None:
    """The launcher is the Ray driver: its actors, and their children, share its fate. Then the
    quickstart (4 groups of 8, difficulty 1, every role but the orchestrator in a Ray actor) resumes
    and finishes its 8 steps, and the adapter beats the warm model greedily, as the local quickstart
    test checks (tests/e2e/test_run.py::test_quickstart_killed_mid_step_resumes_and_learns; the 30-step
    curve on Ray is `benchmarks/learning.py --provider ray`)."""
    run_dir = tmp_path / "driver"
    steps = 8
    quickstart = ("--trainer.steps", str(steps), "--trainer.batch_groups", "4", "--orchestrator.group_size", "8",
                  "--orchestrator.curriculum.max_difficulty", "1")
    proc = start_ray_run(run_dir, warm_model, ray_address, *quickstart)
    wait_until(lambda: last_step(run_dir) >= 2, 300, "step 2", proc, run_dir)
    roles = pgrep(str(run_dir / "roles"))
    assert len(roles) == 3, roles  # router, trainer rank, orchestrator
    forked = pgrep(str(run_dir / "logs" / "zygote"))  # the node's zygote and 3 replicas (forks keep its argv)
    assert len(forked) == 4, forked
    roles += forked
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until(lambda: not any(alive(p) for p in roles), 60, "every role process to die with the driver")
    proc = start_ray_run(run_dir, warm_model, ray_address, *quickstart, "--resume")
    finish(proc, run_dir, timeout=600)
    audit(run_dir, steps, batch_groups=4, group_size=8)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    assert len(events(run_dir, "replica_started")) == 6  # 3 per launch
    assert not pgrep(str(run_dir / "roles")), "role processes outlived the run"
    assert not pgrep(str(run_dir / "logs" / "zygote")), "a zygote or a replica forked from it outlived the run"
    before, after = held_out_greedy(warm_model, None), held_out_greedy(warm_model, run_dir / "adapters" / f"policy-v{steps}")
    print(f"greedy held-out on Ray, across a launcher kill {before:.3f} -> {after:.3f}")
    assert after >= before + 0.2, (before, after)


def test_what_cannot_be_placed_times_out_with_a_clear_message(tmp_path: Path, warm_model: Path,
                                                             ray_address: str) -> None:
    from burstrl.config import RayConfig
    from burstrl.providers import Placement
    from burstrl.providers.ray_provider import RayProvider

    provider = RayProvider(RayConfig(placement_timeout_s=2, on_demand_resources={"spot": 1}), tmp_path, {})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"placement group of the test \(2 x \{'GPU': 4.0\}, STRICT_PACK\) could "
                                           r"not be placed in 2 s; the cluster has .*GPU 4/4 free"):
        provider.placement_group([{"GPU": 4.0}, {"GPU": 4.0}], "STRICT_PACK", "the test")
    with pytest.raises(RuntimeError, match="replica-x could not be placed in 2 s: it needs spot 1"):
        provider.start("replica-x", ["serve", "--help"], wait_ready=True, placement=Placement(pool="on_demand"))
    assert time.monotonic() - t0 < 30
    # growing the fleet asks Ray's cluster autoscaler for the replicas' shapes (what it reads from the GCS)
    provider.request_capacity({"reserved": 1, "on_demand": 2})
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    if not is_autoscaler_v2():
        assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == [{"spot": 1.0}, {"spot": 1.0}]
    provider.close()

    # The same through `burstrl run`: it ends, naming the trainer. The timeout holds for every role, and
    # the router (which needs nothing) must still be placed in it: 3 s was once too short on the loaded
    # test machine ("router could not be placed in 3 s: it needs nothing; the cluster has CPU 16/16 free").
    run_dir = tmp_path / "infeasible"
    r = subprocess.run(burstrl_cmd("run", "--run_dir", str(run_dir), "--model.path", str(warm_model), *SMALL,
                                   "--provider", "ray", "--ray.address", ray_address, "--ray.trainer_gpus", "8",
                                   "--ray.placement_timeout_s", "20"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "the trainer failed to start: the placement group of the trainer" in r.stderr
    assert not pgrep(str(run_dir / "roles"))


def test_replicas_fork_from_their_nodes_zygote_and_die_with_their_actor(tmp_path: Path, warm_model: Path,
                                                                       ray_address: str) -> None:
    """`fleet.zygote` on Ray: replicas are forks of their node's zygote actor's process; a killed
    replica reports its status, a dead actor takes its forked replica with it (checked by pid), a
    dead zygote makes the next start an ordinary one (counted) and a new zygote the one after, and
    `close()` stops the zygotes."""
    import ray

    from burstrl.config import RayConfig
    from burstrl.providers import Placement
    from burstrl.providers.local import REPLICA_LISTEN
    from burstrl.providers.ray_provider import RayProvider

    provider = RayProvider(RayConfig(address=ray_address), tmp_path, {}, zygote_model=str(warm_model))
    place = Placement(listen=REPLICA_LISTEN, pool="on_demand")

    def start(name: str):
        role = provider.start(name, ["serve", "--model", str(warm_model)], wait_ready=True, timeout=300,
                              placement=place)
        return role, ray.get(role.actor.child.remote()), ray.get(role.actor.node.remote())["pid"]

    def zygote_pid() -> int:
        [actor] = provider.zygotes.actors.values()
        return ray.get(actor.pid.remote())

    try:
        (a, a_pid, _), (b, b_pid, b_worker) = start("replica-a"), start("replica-b")
        first = zygote_pid()
        assert parent(a_pid) == first and parent(b_pid) == first
        for role in (a, b):
            assert HTTP.get(f"{role.url}/health", timeout=30).status_code == 200

        os.kill(a_pid, signal.SIGKILL)  # the replica dies: its status comes through the zygote
        assert wait_until(lambda: a.poll() is not None, 60, "replica-a's death") and a.returncode == -9
        os.kill(b_worker, signal.SIGKILL)  # its actor's worker dies (as on a lost node): the replica with it
        wait_until(lambda: not alive(b_pid), 60, "replica-b to die with its actor")
        wait_until(lambda: b.poll() is not None, 60, "replica-b's actor death to be seen")
        assert b.cause == "actor died"

        os.kill(first, signal.SIGKILL)  # the zygote dies: the next start is an ordinary one, counted
        c, c_pid, c_worker = start("replica-c")
        assert provider.zygote_fallbacks == 1 and parent(c_pid) == c_worker
        d, d_pid, _ = start("replica-d")  # and the one after forks from a new zygote on the node
        second = zygote_pid()
        assert second != first and parent(d_pid) == second
        starts = [json.loads(line) for line in (tmp_path / "logs" / "ray_starts.jsonl").read_text().splitlines()]
        assert [s["how"] for s in starts] == ["fork", "fork", "fallback", "fork"]
        # replicas that hold no resources: after the first, each takes the spare actor the one before left
        assert [s["spare"] for s in starts] == [False, True, True, True]
        spare = provider.spares.idle["on_demand"][0]
    finally:
        provider.close()
    wait_until(lambda: not alive(second) and not alive(d_pid) and not alive(c_pid), 60,
               "close() to stop the zygote and every replica")
    with pytest.raises(ray.exceptions.RayActorError):  # and the spare actor
        ray.get(spare.node.remote(), timeout=60)


def listed_nodes(router: str, token: str) -> list[dict]:
    """The fleet's sandbox nodes as the router lists them to a tenant ([] while it does not answer)."""
    try:
        return HTTP.get(f"{router}/v1/fleet/sandbox-nodes", headers={"Authorization": f"Bearer {token}"},
                        timeout=5).json()["nodes"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def fleet_agents(fleet_dir: Path) -> list[int]:
    """The fleet's sandbox node agents: the processes whose --tenant-key-file is this fleet's
    (`SandboxAgents.key_file`: /tmp/burstrl-sbk-UID/FLEET-NODE-NONCE.key)."""
    fleet = hashlib.sha256(str(fleet_dir.absolute()).encode()).hexdigest()[:12]
    return pgrep(f"/tmp/burstrl-sbk-{os.getuid()}/{fleet}-")


def check_the_fleets_sandbox_node(router: str, fleet_dir: Path) -> dict:
    """The agent on the cluster's `sandbox_node` node, as a tenant sees it: listed (not its token); a
    sandbox a tenant makes there is its own (another tenant's token gets a 404); the fleet's node token
    sees its owner; the tenant key is in neither the agent's argv nor its environment, and the file it
    read it from (mode 600: tests/unit/test_fleet_sandbox_node_list.py) is gone. Returns the node as listed."""
    from burstrl.protocol.tenants import tenant_token
    from burstrl.sandbox.node_client import NodeClient, NodeError

    key = (fleet_dir / "tenant.key").read_text().strip()
    tok_a, tok_b = tenant_token(key, "run-a"), tenant_token(key, "run-b")
    node_token = (fleet_dir / "sandbox-node.token").read_text().strip()
    [node] = listed_nodes(router, tok_a)
    assert json.loads((fleet_dir / "fleet.json").read_text())["sandbox_nodes"] == [node]
    [agent] = fleet_agents(fleet_dir)
    argv = Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
    key_file = Path(argv[argv.index(b"--tenant-key-file") + 1].decode())
    assert key.encode() not in Path(f"/proc/{agent}/environ").read_bytes() + b"\0".join(argv)
    wait_until(lambda: not key_file.exists(), 60, "the agent's key file to be removed once it is ready")
    a, b = NodeClient(node["url"], tok_a), NodeClient(node["url"], tok_b)
    box = a.create(cpu_limit=1, memory_limit_mb=256, start_timeout_s=120)
    with pytest.raises(NodeError) as theirs:
        b.delete(box.id)
    assert theirs.value.status == 404
    assert NodeClient(node["url"], node_token).owners() == {box.id: "run-a"}  # what the idle sweep reads
    a.delete(box.id)
    assert a.report()["sandboxes"] == []
    return node


def test_a_shared_fleet_on_ray_serves_a_tenant_run_replaces_a_replica_and_stops_every_actor(
        tmp_path: Path, warm_model: Path, ray_address: str) -> None:
    """Issue 51 on Ray: `burstrl fleet up --provider ray` runs its router, replicas (forked from the
    node's zygote) and spare actors on the cluster, and (with bwrap) a sandbox node agent with the
    fleet's tenant key on the `sandbox_node` node; a tenant run (its trainer an actor too, its
    orchestrator beside its driver) trains 2 steps on it and releases its versions; a killed replica
    is replaced from the spare; a killed agent is started again at a new address, which the router
    then lists, also after its own restart; SIGTERM ends the fleet with every one of its actors and
    processes."""
    from ray._private import state  # the GCS's tables: this cluster runs no dashboard for ray.util.state

    from burstrl.protocol.tenants import tenant_token

    fleet_dir = tmp_path / "fleet"
    sandboxes = shutil.which("bwrap") is not None  # the agents' namespace backend needs it
    fleet = start_fleet(fleet_dir, warm_model, "--provider", "ray", "--ray.address", ray_address,
                        "--fleet.reserved", "1", "--fleet.on_demand", "1",  # output(fleet_dir) shows fleet.out
                        *(["--fleet.sandbox_nodes", "1", "--orchestrator.swe.backend", "namespace"] if sandboxes else []))
    tenant: subprocess.Popen | None = None
    try:
        info = wait_until(lambda: (fleet_dir / "fleet.json").exists() and json.loads(
            (fleet_dir / "fleet.json").read_text()), 180, "the fleet's ready file", fleet, fleet_dir)
        router = info["router"]
        wait_until(lambda: served_replicas(router) == 2, 120, "both replicas routable", fleet, fleet_dir)
        node = check_the_fleets_sandbox_node(router, fleet_dir) if sandboxes else None

        run_dir = tmp_path / "run-a"
        tok = tenant_token((fleet_dir / "tenant.key").read_text().strip(), "run-a")
        tenant = start_ray_run(run_dir, warm_model, ray_address, "--fleet.url", router, "--fleet.token", tok,
                               "--trainer.steps", "2")
        finish(tenant, run_dir, timeout=300)
        audit(run_dir, 2)
        pushed = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("push_ok")]
        assert pushed and all(not m["push_failed"] for m in pushed), "the trainer pushed to the fleet's replicas"
        released = events(run_dir, "versions_released")
        assert released and "on 2 of 2 replicas" in released[-1]["detail"] and "failed: 0" in released[-1]["detail"]
        assert fleet.poll() is None, "the fleet outlives its tenant"

        # a replica's process dies: the fleet replaces it (forked, in the spare actor)
        zygote = pgrep(str(fleet_dir / "logs" / "zygote"))
        replicas = [p for p in zygote if parent(p) in zygote]  # forks keep the zygote's argv
        assert len(replicas) == 2, zygote
        os.kill(replicas[0], signal.SIGKILL)
        wait_until(lambda: [e for e in events(fleet_dir, "replica_started") if "(replaces " in e["detail"]], 120,
                   "the dead replica's replacement", fleet, fleet_dir)
        wait_until(lambda: served_replicas(router) == 2, 60, "2 replicas routable again", fleet, fleet_dir)

        if node is not None:  # the agent dies: started again at a new address, which the router lists
            [agent] = fleet_agents(fleet_dir)
            os.kill(agent, signal.SIGKILL)
            node = wait_until(lambda: [n for n in listed_nodes(router, tok) if n["url"] != node["url"]], 120,
                              "the router to list the agent started again", fleet, fleet_dir)[0]

        # the router's process dies: Ray restarts its actor at the same address, the fleet re-registers
        [router_pid] = pgrep(str(fleet_dir / "roles" / "router.toml"))
        os.kill(router_pid, signal.SIGKILL)
        wait_until(lambda: events(fleet_dir, "router_restarted"), 120, "the router's restart", fleet, fleet_dir)
        wait_until(lambda: served_replicas(router) == 2, 60, "2 replicas routable after the restart", fleet,
                   fleet_dir)
        if node is not None:  # it started with its config's list: the fleet tells it the current one again
            wait_until(lambda: listed_nodes(router, tok) == [node], 60, "the restarted router's node list", fleet,
                       fleet_dir)
            check_the_fleets_sandbox_node(router, fleet_dir)

        # the fleet's actors: those of the Ray job whose driver is the fleet's process
        [job] = [j["JobID"] for j in state.jobs() if j["DriverPid"] == fleet.pid]
        actors = {a["ActorID"]: a for a in state.actors().values() if a["JobID"] == job and a["State"] == "ALIVE"}
        kinds = sorted(a["ActorClassName"] for a in actors.values())
        assert kinds.count("ZygoteActor") == 1 and kinds.count("RoleActor") >= 3, kinds  # router, 2 replicas
        processes = pgrep(str(fleet_dir)) + fleet_agents(fleet_dir) + [a["Pid"] for a in actors.values()]
    finally:
        if tenant is not None and tenant.poll() is None:  # a failed check must not leave the run behind
            os.killpg(tenant.pid, signal.SIGKILL)
            tenant.wait(timeout=30)
        if fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGTERM)
        code = fleet.wait(timeout=120)
    assert code == 130, output(fleet_dir)
    assert "fleet stopped" in output(fleet_dir)
    wait_until(lambda: not any(alive(p) for p in processes), 60, "every actor's worker and process to exit")
    wait_until(lambda: all(state.actors(actor_id=i)["State"] == "DEAD" for i in actors), 60,
               "every actor of the fleet to be dead in Ray")
    assert not (fleet_dir / "fleet.json").exists() and not pgrep(str(fleet_dir))
