"""`burstrl tasks import`: SWE-bench-format records with `owner/name` repos resolved in a local
mirror (clone or bundle), base commits checked, images found by SWE-bench's naming, and tasks
without a runtime refused before a run, with the reason. An imported task then grades its gold
patch as resolved in a real sandbox (`tasks check`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.envs.swe.repo import git
from burstrl.envs.swe.swebench import import_tasks
from burstrl.envs.swe.task import load_tasks
from burstrl.envs.swe.toygen import make_task

UNITTEST = "python3 -m unittest -v"


def _swebench_record(tmp_path: Path, repos: Path, how: str) -> dict:
    """A toy task written as SWE-bench publishes it: repo `octo/calc`, lists as JSON strings,
    extra fields; its repository placed in the mirror as a clone or a bundle."""
    task = make_task(tmp_path / "gen", 0, seed=7, difficulty=1, split="train")
    repos.mkdir(exist_ok=True)
    if how == "clone":
        git(repos, "clone", "-q", task.repo, "octo__calc")
    else:
        git(task.repo, "bundle", "create", str(repos / "calc.bundle"), "--all")
    rec = task.to_json()
    rec.pop("extra")
    rec.update(repo="octo/calc", FAIL_TO_PASS=json.dumps(rec["FAIL_TO_PASS"]),
               PASS_TO_PASS=json.dumps(rec["PASS_TO_PASS"]), hints_text="look at core",
               created_at="2020-01-01T00:00:00Z", environment_setup_commit=rec["base_commit"])
    return rec


@pytest.mark.parametrize("how", ["clone", "bundle"])
def test_import_resolves_the_mirror_and_gold_resolves(tmp_path: Path, how: str) -> None:
    from burstrl.envs.swe.check import check_tasks

    repos = tmp_path / "mirror"
    rec = _swebench_record(tmp_path, repos, how)
    src = tmp_path / "swebench.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    report = import_tasks(src, tmp_path / "out" / "tasks.jsonl", repos, test_cmd=UNITTEST)
    assert report.refused == {} and report.imported == [rec["instance_id"]]
    [task] = load_tasks(tmp_path / "out" / "tasks.jsonl")
    if how == "clone":
        assert task.repo == str((repos / "octo__calc").resolve())
    else:  # a bundle becomes a bare mirror beside the task file, made once
        assert task.repo == str((tmp_path / "out" / "repos" / "calc.git").resolve())
    assert task.extra["hints_text"] == "look at core" and task.extra["repo_name"] == "octo/calc"
    assert task.FAIL_TO_PASS == json.loads(rec["FAIL_TO_PASS"])
    [result] = check_tasks([task], tmp_path / "check", sandbox=True)
    assert result.ok, result


def test_import_refuses_what_cannot_run_and_says_why(tmp_path: Path) -> None:
    repos = tmp_path / "mirror"
    good = _swebench_record(tmp_path, repos, "clone")
    no_mirror = dict(good, instance_id="ghost__x-1", repo="ghost/x")
    no_commit = dict(good, instance_id="octo__calc-2", base_commit="0" * 40)
    no_runner = dict(good, instance_id="octo__calc-3", test_cmd="python3 -m burstrl_no_such_runner")
    src = tmp_path / "swebench.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (good, no_mirror, no_commit, no_runner)))
    report = import_tasks(src, tmp_path / "tasks.jsonl", repos, test_cmd=None)
    assert "no mirror" in report.refused["ghost__x-1"] and "ghost__x" in report.refused["ghost__x-1"]
    assert "is not in" in report.refused["octo__calc-2"]
    assert "burstrl_no_such_runner" in report.refused["octo__calc-3"]
    assert [t.instance_id for t in load_tasks(tmp_path / "tasks.jsonl")] == report.imported
    assert good["instance_id"] in report.imported or "pytest" in report.refused[good["instance_id"]]


def test_images_are_found_by_swebench_naming_and_cli(tmp_path: Path) -> None:
    from burstrl.sandbox.images import build_image

    repos = tmp_path / "mirror"
    rec = _swebench_record(tmp_path, repos, "clone")
    rec["instance_id"] = "octo__calc-42"
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "marker").write_text("x")
    build_image(tmp_path / "ctx", tmp_path / "images" / "sweb.eval.x86_64.octo_1776_calc-42")
    src = tmp_path / "swebench.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    out = tmp_path / "tasks.jsonl"
    proc = subprocess.run([sys.executable, "-m", "burstrl.cli", "tasks", "import", str(src), "--repos", str(repos), "--out", str(out),
                           "--images", str(tmp_path / "images")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 imported, 0 refused" in proc.stdout
    [task] = load_tasks(out)
    assert task.image.endswith("sweb.eval.x86_64.octo_1776_calc-42")
