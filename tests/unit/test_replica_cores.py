"""Replicas on vLLM under `burstrl run`: the engine settings reach every replica, each vLLM replica on CPU
gets cores of its own (protocol/cores.py), and its start deadline allows vLLM's start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.config import RunConfig, ServeConfig, load_config
from burstrl.protocol.cores import CoreSlices, NoFreeCores, claim_cores, release, slice_size
from burstrl.providers import Placement
from burstrl.providers.local import LocalProvider


def _cfg(*args: str) -> RunConfig:
    return load_config(RunConfig, [], ["--model.path", "/m", *args])


def test_every_replica_reads_the_runs_engine_backend_and_vllm_settings() -> None:
    serve = _cfg("--engine.backend", "vllm", "--engine.vllm.kv_cache_gib", "3", "--engine.vllm.max_loras",
                 "3").serve_config()
    assert serve.engine.backend == "vllm"
    assert serve.engine.vllm.kv_cache_gib == 3 and serve.engine.vllm.max_loras == 3


def test_the_replica_start_deadline_follows_the_engine_unless_set() -> None:
    assert _cfg().replica_start_timeout_s() == 180.0
    vllm = _cfg("--engine.backend", "vllm", "--engine.vllm.start_timeout_s", "300")
    assert vllm.replica_start_timeout_s() == 420.0  # vLLM's own deadline and the replica's start around it
    assert _cfg("--engine.backend", "vllm", "--fleet.start_timeout_s", "90").replica_start_timeout_s() == 90.0


def test_vllm_replicas_on_cpu_split_the_hosts_cores_by_the_most_replicas_at_once() -> None:
    two = _cfg("--engine.backend", "vllm", "--fleet.reserved", "1", "--fleet.on_demand", "1")
    assert two.replica_cores(host_cores=8, cpu=True) == 4
    grown = _cfg("--engine.backend", "vllm", "--fleet.on_demand", "0", "--autoscale.enabled", "true",
                 "--autoscale.max_on_demand", "3")
    assert grown.replica_cores(host_cores=8, cpu=True) == 2  # 1 reserved + up to 3 on demand
    planned = _cfg("--engine.backend", "vllm", "--fleet.on_demand", "0", "--fleet.max_replicas", "2")
    assert planned.replica_cores(host_cores=2, cpu=True) == 1, "room for one more by `burstrl scale`"
    assert _cfg("--fleet.on_demand", "1").replica_cores(8, cpu=True) == 0, "the own engine binds no cores"
    assert two.replica_cores(8, cpu=False) == 0, "vLLM on a GPU binds no cores"
    named = _cfg("--engine.backend", "vllm", "--engine.vllm.cpu_cores", "0-1", "--fleet.on_demand", "4")
    assert named.replica_cores(2, cpu=True) == 0, "a list the user named is shared, as asked"
    with pytest.raises(ValueError, match="up to 3 replicas at once on this host's 2 cores"):
        _cfg("--engine.backend", "vllm", "--fleet.on_demand", "2").replica_cores(2, cpu=True)


def test_vllm_replicas_on_ray_take_their_cpus_as_cores_and_need_some() -> None:
    ray = _cfg("--engine.backend", "vllm", "--provider", "ray", "--ray.replica_cpus", "2")
    assert ray.replica_cores(host_cores=1, cpu=True) == 2  # the node's, not the driver's
    with pytest.raises(ValueError, match="ray.replica_cpus >= 1"):
        _cfg("--engine.backend", "vllm", "--provider", "ray").replica_cores(8, cpu=True)


def test_core_slices_are_disjoint_and_free_again_once_their_replica_exited() -> None:
    slices = CoreSlices([0, 1, 2, 3, 4], slice_size(5, 2))
    assert slices.slices == ["0,1", "2,3"]  # the leftover core stays unused
    running = {"a": True, "b": True}
    assert slices.take(lambda: running["a"]) == "0,1"
    assert slices.take(lambda: running["b"]) == "2,3"
    with pytest.raises(NoFreeCores, match="all 2 core slices of 2"):
        slices.take(lambda: True)
    running["a"] = False
    assert slices.free() == 1 and slices.take(lambda: True) == "0,1"
    with pytest.raises(ValueError, match="need at least 3 cores"):
        slice_size(2, 3)


def test_core_claims_on_a_node_are_exclusive_and_end_with_their_holder(tmp_path: Path) -> None:
    cores, fds = claim_cores(tmp_path, 2, cores=[0, 1, 2, 3])
    assert cores == [0, 1]
    other, other_fds = claim_cores(tmp_path, 2, cores=[0, 1, 2, 3])
    assert other == [2, 3]
    with pytest.raises(NoFreeCores, match="2 free cores wanted on this node, 0 of 4"):
        claim_cores(tmp_path, 2, cores=[0, 1, 2, 3])
    release(fds)
    assert claim_cores(tmp_path, 1, cores=[0, 1, 2, 3])[0] == [0]
    # a holder process that dies releases its cores (the actor's death, however it ends)
    code = ("import sys, os; from pathlib import Path; from burstrl.protocol.cores import claim_cores; "
            "claim_cores(Path(sys.argv[1]), 1, cores=[5]); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    assert claim_cores(tmp_path, 1, cores=[5])[0] == [5]
    release(other_fds)


class _Handle:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


def test_the_local_provider_gives_each_replica_its_own_cores_on_its_command_line(tmp_path: Path,
                                                                                monkeypatch) -> None:
    provider = LocalProvider(tmp_path, {})
    started: list[list[str]] = []
    handles: list[_Handle] = []

    def fake_start(name, args, **kwargs):
        started.append(args)
        handles.append(_Handle())
        return handles[-1]

    monkeypatch.setattr(provider, "_start", fake_start)
    monkeypatch.setattr("burstrl.providers.local.host_cores", lambda: [0, 1])
    placement = Placement(listen=("server.host", "server.port"), pool="reserved",
                          cores=("engine.vllm.cpu_cores", 1))
    provider.start("replica-1", ["serve", "s.toml"], wait_ready=True, placement=placement)
    provider.start("replica-2", ["serve", "s.toml"], wait_ready=True, placement=placement)
    assert started == [["serve", "s.toml", "--engine.vllm.cpu_cores", "0"],
                       ["serve", "s.toml", "--engine.vllm.cpu_cores", "1"]]
    with pytest.raises(RuntimeError, match="replica-3: no cores for its engine"):
        provider.start("replica-3", ["serve", "s.toml"], wait_ready=True, placement=placement)
    handles[0].code = -9  # replica-1 died: its replacement gets its cores
    provider.start("replica-4", ["serve", "s.toml"], wait_ready=True, placement=placement)
    assert started[-1][-1] == "0"
    provider.start("router", ["route"], wait_ready=True, placement=Placement())
    assert started[-1] == ["route"], "a role without the hint gets no cores"
    for args in started[:2]:  # what the replica's config makes of them (a one-core list reads as a number)
        serve = load_config(ServeConfig, [], ["--model.path", "/m", "--engine.backend", "vllm", *args[2:]])
        assert serve.engine.vllm.cpu_cores == args[-1]


def test_a_core_list_is_checked_and_a_single_core_given_as_a_number_is_its_list() -> None:
    assert load_config(ServeConfig, [], ["--model.path", "/m", "--engine.vllm.cpu_cores", "3"]).engine.vllm.cpu_cores == "3"
    assert load_config(ServeConfig, [], ["--model.path", "/m", "--engine.vllm.cpu_cores", "0-1,4"]).engine.vllm.cpu_cores == "0-1,4"
    for bad in ("all", "-1", "0-", "0,,1"):
        with pytest.raises(ValueError, match="cpu_cores"):
            load_config(ServeConfig, [], ["--model.path", "/m", "--engine.vllm.cpu_cores", bad])


def test_a_ray_replica_claims_cores_of_its_own_on_its_node(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("ray")
    from burstrl.providers.ray_actors import ProcessSpec, claim_role_cores

    monkeypatch.setattr("burstrl.protocol.cores.host_cores", lambda: [0, 1])
    monkeypatch.setattr("burstrl.protocol.cores.tempfile.gettempdir", lambda: str(tmp_path))  # no litter in /tmp
    spec = ProcessSpec(args=["serve"], log="x.log", cores_key="engine.vllm.cpu_cores", cores=1,
                       cores_run=str(tmp_path / "run"))
    first, first_fds = claim_role_cores(spec)
    second, second_fds = claim_role_cores(spec)
    assert (first, second) == (["--engine.vllm.cpu_cores", "0"], ["--engine.vllm.cpu_cores", "1"])
    with pytest.raises(NoFreeCores):
        claim_role_cores(spec)
    other_run = ProcessSpec(args=["serve"], log="x.log", cores_key="engine.vllm.cpu_cores", cores=1,
                            cores_run=str(tmp_path / "other"))
    other_args, other_fds = claim_role_cores(other_run)
    assert other_args[-1] == "0", "another run's claims are its own"
    assert claim_role_cores(ProcessSpec(args=["route"], log="x.log")) == ([], [])
    release(first_fds + second_fds + other_fds)


def test_preflight_refuses_more_vllm_replicas_than_cores_naming_the_keys(tmp_path: Path, monkeypatch) -> None:
    from burstrl.launcher import preflight

    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda _pid: {0, 1})
    cfg = load_config(RunConfig, [], ["--model.path", str(tmp_path), "--model.device", "cpu", "--engine.backend",
                                      "vllm", "--fleet.on_demand", "2", "--engine.vllm.python", str(tmp_path / "py")])
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(cfg)
    assert "up to 3 replicas at once on this host's 2 cores" in str(err.value)
    assert "engine.vllm.python" in str(err.value) and "is not a file" in str(err.value)


def test_burstrl_scale_past_the_hosts_core_slices_is_refused_naming_the_keys(tmp_path: Path, monkeypatch) -> None:
    import json

    from burstrl.launcher import control, run

    class _Fleet:
        cores = ("engine.vllm.cpu_cores", 1)

        def count(self, pool: str) -> int:
            return 1 if pool == "reserved" else 0

    launcher = run.Launcher.__new__(run.Launcher)  # no provider, no processes: the scale decision only
    launcher.cfg, launcher.run_dir, launcher.fleet = _cfg("--engine.backend", "vllm"), tmp_path, _Fleet()
    monkeypatch.setattr(run, "host_cores", lambda: [0, 1])
    control._write(tmp_path / "control" / "scale.json", {"id": "r1", "replicas": 3})
    launcher.apply_scale_request()
    answer = json.loads((tmp_path / "control" / "scale.ack.json").read_text())
    assert answer["id"] == "r1" and not answer["ok"]
    assert "3 replicas do not fit" in answer["error"] and "fleet.max_replicas" in answer["error"]
