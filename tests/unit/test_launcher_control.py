import json
import os
import threading
from pathlib import Path

import pytest

from burstrl.config import RunConfig, load_config
from burstrl.launcher import control
from burstrl.launcher.preflight import PreflightError, check, kv_bytes_per_token
from burstrl.launcher.run import JsonTail


def test_scale_request_round_trip(tmp_path: Path) -> None:
    control.write_launcher_info(tmp_path, "http://127.0.0.1:1")

    def launcher_side() -> None:
        while (request := control.take_scale_request(tmp_path)) is None:
            pass
        control.answer_scale(tmp_path, request, {"ok": True, "reserved": 1, "on_demand": request["replicas"] - 1})

    t = threading.Thread(target=launcher_side)
    t.start()
    answer = control.request_scale(tmp_path, 4, timeout_s=10)
    t.join()
    assert answer["ok"] and answer["on_demand"] == 3


def test_scale_needs_a_live_launcher(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="no run is in progress"):
        control.request_scale(tmp_path, 2)
    (tmp_path / "launcher.json").write_text(json.dumps({"pid": 2**22 + 12345, "router": ""}))
    with pytest.raises(control.ControlError, match="is gone"):
        control.request_scale(tmp_path, 2)


def test_json_tail_reads_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonTail(path)
    assert tail.read() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert [r["step"] for r in tail.read()] == [1]
    with open(path, "a") as f:
        f.write('}\n{"step": 3}\n')
    assert [r["step"] for r in tail.read()] == [1, 2, 3]


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, [], ["--run_dir", str(tmp_path / "run"), *overrides])


def test_preflight_names_a_missing_model_and_unknown_env(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "--model.path", str(tmp_path / "nope"), "--orchestrator.envs", '{"chess": 1.0}')
    with pytest.raises(PreflightError) as err:
        check(cfg)
    assert "model.path" in str(err.value) and "chess" in str(err.value)


def test_preflight_refuses_a_fleet_that_cannot_fit_in_memory(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = _cfg(tmp_path, "--model.path", str(tiny_model_dir), "--engine.max_total_num_tokens", str(10**10),
               "--fleet.on_demand", "3")
    with pytest.raises(PreflightError, match="impossible resource request: 4 replicas"):
        check(cfg)
    check(_cfg(tmp_path, "--model.path", str(tiny_model_dir)))  # the defaults fit


def test_preflight_chaos_step_must_be_in_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = _cfg(tmp_path, "--model.path", str(tiny_model_dir), "--chaos.kill_fraction", "0.4",
               "--chaos.at_step", "500", "--trainer.steps", "10")
    with pytest.raises(PreflightError, match="chaos.at_step 500"):
        check(cfg)


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer() -> None:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    assert kv_bytes_per_token(cfg) == 2 * 4 * 2 * 32 * 4


def test_launcher_info_is_cleared(tmp_path: Path) -> None:
    control.write_launcher_info(tmp_path, "http://x")
    assert json.loads((tmp_path / "launcher.json").read_text())["pid"] == os.getpid()
    control.clear_launcher_info(tmp_path)
    assert not (tmp_path / "launcher.json").exists()


def test_ray_provider_config_and_preflight(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = _cfg(tmp_path, "--model.path", str(tiny_model_dir), "--provider", "ray", "--ray.on_demand_resources",
               '{"spot": 1}', "--ray.auth_token_file", str(tmp_path / "missing-token"))
    assert cfg.ray.on_demand_resources == {"spot": 1.0}
    with pytest.raises(PreflightError, match="ray.auth_token_file .*missing-token' is not a file"):
        check(cfg)
    (tmp_path / "token").write_text("secret")
    check(_cfg(tmp_path, "--model.path", str(tiny_model_dir), "--provider", "ray", "--ray.auth_token_file",
               str(tmp_path / "token"), "--engine.max_total_num_tokens", str(10**10)))  # the cluster places it
    with pytest.raises(ValueError, match="provider"):
        _cfg(tmp_path, "--provider", "kubernetes")
    with pytest.raises(ValueError, match="ray.replica_gpuz"):
        _cfg(tmp_path, "--provider", "ray", "--ray.replica_gpuz", "1")


def test_ray_namespace_is_one_per_run_directory(tmp_path: Path) -> None:
    from burstrl.providers.ray_provider import run_namespace

    a, b = run_namespace(tmp_path / "run"), run_namespace(tmp_path / "other" / "run")
    assert a.startswith("burstrl-run-") and a != b and run_namespace(tmp_path / "run") == a


class FlakyNodeProvider:
    """A provider whose sandbox-node poll fails once (a Ray GCS hiccup), then finds a node."""

    def __init__(self) -> None:
        self.calls = 0

    def poll_sandbox_nodes(self) -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("GCS unavailable")
        return ["agent on node-2 ready at http://10.0.0.2:1"]

    def close(self) -> None:
        pass


def test_a_failed_sandbox_node_poll_is_counted_and_retried_not_fatal(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from burstrl.launcher import run

    cfg = RunConfig.model_validate({"run_dir": str(tmp_path / "run"), "fleet": {"zygote": False}})
    launcher = run.Launcher(cfg)
    launcher.run_dir.mkdir(parents=True)
    launcher.provider = FlakyNodeProvider()
    monkeypatch.setattr(run, "SANDBOX_NODE_POLL_S", 0.0)
    launcher.poll_sandbox_nodes()
    launcher.poll_sandbox_nodes()
    events = [json.loads(line)["detail"] for line in (launcher.run_dir / "fleet.jsonl").read_text().splitlines()]
    assert launcher.node_poll_errors == 1 and launcher.provider.calls == 2
    assert events[0].startswith("poll failed (ConnectionError") and events[1].startswith("agent on node-2 ready")
