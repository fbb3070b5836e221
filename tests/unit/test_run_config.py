"""RunConfig derives each role's config; every command shares one grammar (files, overrides, --dry-run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from burstrl.config import (
    ConfigError,
    EvalConfig,
    OrchestrateConfig,
    RouteConfig,
    RunConfig,
    ServeConfig,
    SftConfig,
    TrainConfig,
    dump_toml,
    load_config,
    parse_command_line,
    validate,
)
from burstrl.router.sim import RouterSimConfig

REPO = Path(__file__).resolve().parents[2]


def burstrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "burstrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_roles_get_the_shared_settings_from_one_place(tmp_path: Path) -> None:
    cfg = load_config(RunConfig, [], ["--run_dir", str(tmp_path / "run"), "--orchestrator.temperature", "0.5",
                                      "--trainer.batch_groups", "3", "--model.path", "/m"])
    roles = cfg.role_configs("http://127.0.0.1:9")
    train, orch, serve, router = roles["train"], roles["orchestrate"], roles["serve"], roles["router"]
    assert train.temperature == 0.5 and orch.orchestrator.temperature == 0.5
    assert orch.orchestrator.max_in_flight_groups == 3 and orch.orchestrator.max_buffered_groups == 3
    assert orch.router == "http://127.0.0.1:9" and orch.steps == cfg.trainer.steps
    assert serve.adapter_volume == train.weights.volume == str(tmp_path / "run" / "adapters")
    assert train.weights.replicas_file == str(tmp_path / "run" / "replicas.txt")
    assert serve.model.path == train.model.path == "/m" and router.port == 0 and router.replicas == []


def test_group_bounds_set_by_the_user_are_kept() -> None:
    cfg = load_config(RunConfig, [], ["--trainer.batch_groups", "3", "--orchestrator.max_buffered_groups", "7"])
    assert (cfg.orchestrator.max_in_flight_groups, cfg.orchestrator.max_buffered_groups) == (3, 7)
    replayed = validate(RunConfig, tomllib.loads(dump_toml(cfg)))  # the saved run_config.toml
    assert replayed == cfg


@pytest.mark.parametrize(("override", "key"), [
    ("--trainer.temperature", "trainer.temperature"),  # one temperature: orchestrator.temperature
    ("--batch_groups", "batch_groups"),
])
def test_mirrored_fields_are_gone(override: str, key: str) -> None:
    cls = RunConfig if override.startswith("--trainer") else OrchestrateConfig
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(cls, [], [override, "1"])


def test_one_parser_for_files_and_overrides() -> None:
    files, tree = parse_command_line(["a.toml", "--x.y", "1", "b.toml", "--z=true", "--s", "policy-v1"])
    assert files == ["a.toml", "b.toml"] and tree == {"x": {"y": 1}, "z": True, "s": "policy-v1"}
    with pytest.raises(ConfigError, match="has no value"):
        parse_command_line(["--x.y"])


def test_run_dry_run_prints_what_each_role_receives(tmp_path: Path) -> None:
    r = burstrl("run", str(REPO / "examples" / "toy-swe.toml"), "--run_dir", str(tmp_path / "run"),
                "--model.path", "/models/m", "--trainer.steps", "3", "--dry-run")
    assert r.returncode == 0, r.stderr
    headers = re.findall(r"^# (\S+):", r.stdout, flags=re.M)
    run = tmp_path / "run"
    assert headers == [str(run / "run_config.toml")] + [str(run / "roles" / f"{n}.toml")
                                                         for n in ("router", "serve", "train", "orchestrate")]
    parts = re.split(r"^# .*\n", r.stdout, flags=re.M)[1:]
    cfg = validate(RunConfig, tomllib.loads(parts[0]))
    expected = cfg.role_configs("(the router's URL, known once it listens)")
    for part, cls, name in zip(parts[1:], (RouteConfig, ServeConfig, TrainConfig, OrchestrateConfig), expected, strict=False):
        assert validate(cls, tomllib.loads(part)) == expected[name]
    assert expected["train"].trainer.steps == 3 and expected["train"].temperature == 0.7


def test_run_dry_run_shows_the_quickstart_model_path_without_building_it(tmp_path: Path) -> None:
    env_cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "burstrl.cli", "run", "--dry-run"], capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "BURSTRL_CACHE": str(env_cache)})
    assert r.returncode == 0, r.stderr
    assert f'path = "{env_cache / "tiny-qwen3-warm"}"' in r.stdout and not env_cache.exists()


def test_sft_and_eval_take_config_files_overrides_and_dry_run(tmp_path: Path) -> None:
    config = tmp_path / "sft.toml"
    config.write_text('model = "/m"\ndata = "d.jsonl"\nsteps = 5\n')
    r = burstrl("sft", str(config), "--out", "/o", "--batch-size", "4", "--lora", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert validate(SftConfig, tomllib.loads(r.stdout)) == SftConfig(model="/m", data="d.jsonl", out="/o", steps=5,
                                                                     batch_size=4, lora=True)
    r = burstrl("eval", "--model", "/m", "--env-option", "reward=f2p", "--max-turns", "2", "--exclude", "a",
                "--exclude", "b", "--dry-run")
    assert r.returncode == 0, r.stderr
    cfg = validate(EvalConfig, tomllib.loads(r.stdout))
    assert cfg.swe.reward == "f2p" and cfg.swe.max_turns == 2 and cfg.exclude == ["a", "b"]
    assert cfg.env_options().swe.max_sandboxes == cfg.max_sandboxes == 4
    for command in ("sft", "eval"):
        r = burstrl(command, "--model", "/m", "--bogus", "1", "--dry-run")
        assert r.returncode == 2 and "unknown config key 'bogus'" in r.stderr, r.stderr


def test_eval_knobs_are_not_set_twice() -> None:
    with pytest.raises(ConfigError, match="set max_turns"):
        load_config(EvalConfig, [], ["--model", "/m", "--max_turns", "2", "--swe.max_turns", "3"])


def test_sim_config_joins_the_grammar_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(RouterSimConfig, [], ["--sessions", "9", "--pools", '[{"pool": "reserved", "count": 2}]'])
    assert cfg.sessions == 9 and cfg.pools[0].count == 2 and cfg.pools[0].weight == 1.0
    assert validate(RouterSimConfig, tomllib.loads(dump_toml(cfg))) == cfg  # [[pools]] and [[kinds]] tables
    with pytest.raises(ConfigError, match="unknown config key 'pools.0.bogus'"):
        load_config(RouterSimConfig, [], ["--pools", '[{"bogus": 1}]'])
    r = burstrl("route", "sim", "--sessions", "12", "--dry-run")
    assert r.returncode == 0 and "sessions = 12" in r.stdout, r.stderr
