"""`burstrl image base`: a Python + pytest + git image built offline from the host's files, on
which a task repo's tests run in a real sandbox that sees none of the host's system dirs."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from burstrl.cli import app
from burstrl.sandbox.images import LAYER_ZSTD, build_image, read_image

pytestmark = pytest.mark.skipif(not Path("/usr/bin/python3").exists() or shutil.which("bwrap") is None,
                                reason="needs the host's /usr/bin/python3 and bubblewrap (bwrap)")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    result = CliRunner().invoke(app, ["image", "base", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_image(out).manifest_digest in result.output
    return out


@pytest.mark.slow
def test_base_image_runs_pytest_and_git_in_a_sandbox(base_dir: Path, tmp_path: Path) -> None:
    from burstrl.sandbox.backends import SandboxSpec, make_backend
    from burstrl.sandbox.layercache import LayerCache

    base = read_image(base_dir)
    assert [d.media_type for d in base.layers] == [LAYER_ZSTD]
    assert "pytest" in base.config["config"]["Labels"]["io.burstrl.base.packages"]
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                                       "def test_zero():\n    assert add(0, 0) == 0\n")
    build_image(repo, tmp_path / "task", base=base_dir)
    backend = make_backend("namespace", layer_cache=LayerCache(tmp_path / "cache", max_bytes=1 << 31))
    with backend.create(SandboxSpec(image=tmp_path / "task")) as sb:
        env = sb.exec("echo $PATH $LANG; for p in python3 pytest git; do command -v $p; done; test -e /usr/bin/apt || echo no-host-dirs")
        tests = sb.exec("pytest -q -p no:cacheprovider test_calc.py")
        git = sb.exec("git init -q . && git add -A && git -c user.name=t -c user.email=t@t commit -qm base "
                      "&& sed -i 's/a - b/a + b/' calc.py && git diff --stat && python3 -m pytest -q")
    assert env.stdout.split() == ["/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "C.UTF-8",
                                  "/usr/bin/python3", "/usr/local/bin/pytest", "/usr/bin/git", "no-host-dirs"], env
    assert tests.exit_code == 1 and "1 failed, 1 passed" in tests.stdout, tests
    assert git.exit_code == 0 and "calc.py" in git.stdout and "2 passed" in git.stdout, git
    again = CliRunner().invoke(app, ["image", "base", "--out", str(tmp_path / "base2")])
    assert again.exit_code == 0, again.output
    assert read_image(tmp_path / "base2").manifest_digest == base.manifest_digest  # deterministic


@pytest.mark.slow
def test_a_pytest_task_is_graded_on_an_imported_base_image(base_dir: Path, tmp_path: Path) -> None:
    """End to end: the base image goes out as an OCI archive and comes back through `image import`;
    a task on it with the default test_cmd (pytest) grades gold resolved and an empty patch not,
    its commands running the image's pytest (the host's python3 has none)."""
    from burstrl.envs.swe.grade import grade
    from burstrl.envs.swe.repo import commit_all, init_repo
    from burstrl.envs.swe.task import SweTask
    from burstrl.sandbox.archive import import_archive
    from burstrl.sandbox.pool import SandboxPool

    archive = tmp_path / "base.oci.tar"
    with tarfile.open(archive, "w") as tar:
        for p in sorted(base_dir.rglob("*")):
            tar.add(p, p.relative_to(base_dir).as_posix(), recursive=False)
    import_archive(archive, tmp_path / "imported")
    repo = tmp_path / "repo"
    init_repo(repo)
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (repo / "test_calc.py").write_text("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5"
                                       "\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n")
    base_commit = commit_all(repo, "buggy base")
    (repo / "calc.py").write_text((repo / "calc.py").read_text().replace("a - b", "a + b"))
    gold = subprocess.run(["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=True).stdout
    subprocess.run(["git", "-C", str(repo), "checkout", "--", "calc.py"], check=True)
    task = SweTask(instance_id="calc-1", repo=str(repo), base_commit=base_commit, problem_statement="add subtracts",
                   FAIL_TO_PASS=["test_calc.py::test_add"], PASS_TO_PASS=["test_calc.py::test_mul"], patch=gold,
                   image=str(tmp_path / "imported"), cpu=1.0, memory=1024)
    with SandboxPool("namespace", max_concurrent=2) as pool:
        resolved = grade(task, gold, pool, timeout_s=120)
        empty = grade(task, "", pool, timeout_s=120)
    assert resolved.resolved and not resolved.infra_error, resolved
    assert not empty.resolved and not empty.infra_error and empty.statuses["test_calc.py::test_mul"] == "passed", empty
