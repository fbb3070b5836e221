"""The environment registry: names and `module:Class`, each environment's own options model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.config import OrchestratorSection, RunConfig
from burstrl.envs import ENV_NAMES, check_env, env_class, get_env, register
from burstrl.envs.swe.env import SweEnv
from burstrl.envs.toy import ToyEnv

REPO = Path(__file__).resolve().parents[2]
ECHO = "examples.third_party_env:EchoEnv"


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`examples/` is imported as a third party would be: from a directory on the path."""
    monkeypatch.syspath_prepend(str(REPO))


def test_built_in_names_are_the_same_environments_as_before(tmp_path: Path) -> None:
    assert ENV_NAMES == ("toy", "toy_multi", "swe", "functions")
    assert isinstance(get_env("toy"), ToyEnv) and get_env("toy_multi").name == "toy_multi"
    swe = get_env("swe", OrchestratorSection(swe={"toy_tasks": 3}), tmp_path)
    assert isinstance(swe, SweEnv) and swe.cfg.toy_tasks == 3 and swe.run_dir == tmp_path
    assert get_env("swe").cfg.toy_tasks == 64  # no options: the model's defaults
    functions = get_env("functions", OrchestratorSection(env={"functions": {"n_tasks": 5}}), tmp_path)
    assert type(functions).__name__ == "FunctionsEnv" and functions.cfg.n_tasks == 5


def test_a_third_party_environment_by_module_and_class_gets_its_own_validated_options(tmp_path: Path) -> None:
    env = get_env(ECHO, OrchestratorSection(env={"echo": {"words": 2, "reward-exact": 0.5}}), tmp_path)
    assert type(env).__name__ == "EchoEnv" and env.options.words == 2 and env.options.reward_exact == 0.5
    task = env.make_tasks(1, seed=0)[0]
    assert task.env == ECHO and len(task.data["words"]) == 2  # its tasks find it under the name it was asked by
    reply = env.demonstrations([task])[0]["messages"][-1]["content"]
    assert env.grade(task, reply).passed and env.grade(task, reply).reward == 0.5
    assert get_env(ECHO).options.words == 1  # no section: defaults

    with pytest.raises(ValueError, match="orchestrator.env.echo: unknown config key .wordz."):
        get_env(ECHO, OrchestratorSection(env={"echo": {"wordz": 2}}))


def test_unknown_names_and_bad_targets_are_errors_that_say_what_to_write() -> None:
    with pytest.raises(ValueError, match="unknown environment 'nope'; choose from toy, toy_multi, swe"):
        get_env("nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        env_class("no_such_module:Env")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        env_class("examples.third_party_env:Nope")
    with pytest.raises(ValueError, match="not a class"):
        env_class("examples.third_party_env:WORDS")
    with pytest.raises(ValueError, match="takes no options"):
        get_env("toy", OrchestratorSection(env={"toy": {"words": 2}}))
    with pytest.raises(ValueError, match="not both"):
        get_env("swe", OrchestratorSection(swe={"toy_tasks": 3}, env={"swe": {"toy_tasks": 4}}))


def test_register_adds_a_name_without_touching_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    from burstrl.envs import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register("echo", ECHO)
    env = get_env("echo", OrchestratorSection(env={"echo": {"words": 3}}))
    assert env.name == "echo" and env.options.words == 3
    register("echo2", ECHO)  # another name for it: its options stay under the class's name, echo
    env = get_env("echo2", OrchestratorSection(env={"echo": {"words": 2}}))
    assert env.options.words == 2 and env.make_tasks(1, seed=0)[0].env == "echo2"
    with pytest.raises(ValueError, match="reserved"):
        register("a:b", ECHO)


def test_check_env_validates_options_and_leaves_built_ins_unimported() -> None:
    check_env("swe")  # a registered name without a mapping: nothing imported, nothing to check
    check_env(ECHO, OrchestratorSection(env={"echo": {"words": 4}}))
    with pytest.raises(ValueError, match="words"):
        check_env(ECHO, OrchestratorSection(env={"echo": {"words": 0}}))


def test_preflight_names_a_bad_environment_and_its_bad_options() -> None:
    from burstrl.launcher.preflight import _env_problems

    ok = RunConfig.model_validate({"orchestrator": {"envs": {ECHO: 1.0}, "env": {"echo": {"words": 2}}}})
    assert _env_problems(ok) == []
    bad = RunConfig.model_validate({"orchestrator": {"envs": {ECHO: 1.0, "nope": 1.0},
                                                     "env": {"echo": {"words": "many"}}}})
    problems = _env_problems(bad)
    assert len(problems) == 2 and "orchestrator.env.echo" in problems[0] and "'nope'" in problems[1]


def burstrl_eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`burstrl eval` with the repository on PYTHONPATH, on a model dir that stops it before a replica starts."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", "from burstrl.cli import main; main()", "eval", "--model",
                           str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--env", ECHO, *args],
                          check=False, capture_output=True, text=True, timeout=120, env=env)


def test_eval_env_options_of_a_module_class_environment_are_its_own(tmp_path: Path) -> None:
    r = burstrl_eval(tmp_path, "--env-option", "words=3", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "[options]" in r.stdout and "words = 3" in r.stdout
    r = burstrl_eval(tmp_path, "--env-option", "wordz=3", "--difficulty", "99")
    assert r.returncode == 2 and "orchestrator.env.echo: unknown config key 'wordz'" in r.stderr, r.stderr


def test_ecosystem_names_need_their_package_and_say_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix, extra in (("verifiers", "verifiers"), ("openenv", "openenv")):
        monkeypatch.setitem(sys.modules, prefix, None)  # how Python marks a package as not importable
        with pytest.raises(ValueError, match=rf"needs the {prefix} package: pip install 'burstrl\[{extra}\]'"):
            check_env(f"{prefix}:anything")
    with pytest.raises(ValueError, match="name what to run after 'verifiers:'"):
        env_class("verifiers:")


def test_an_ecosystem_name_is_its_adapter_bound_to_what_it_names() -> None:
    from burstrl.envs.ecosystem.openenv_env import OpenEnvEnv
    from burstrl.envs.ecosystem.verifiers_env import VerifiersEnv

    for name, adapter, spec in (("verifiers:vf_sum_v1", VerifiersEnv, "vf_sum_v1"),
                                ("openenv:http://127.0.0.1:9", OpenEnvEnv, "http://127.0.0.1:9")):
        cls = env_class(name)
        assert issubclass(cls, adapter) and cls is not adapter and (cls.spec, cls.name) == (spec, name)
    assert env_class("verifiers:vf_sum_v1") is not env_class("verifiers:vf_tool_v1")
