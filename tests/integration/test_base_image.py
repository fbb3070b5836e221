"""`burstrl image base`: a Python + pytest + git image built offline from the host's files, on
which a task repo's tests run in a real sandbox that sees none of the host's system dirs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from burstrl.cli import app
from burstrl.sandbox.images import LAYER_ZSTD, build_image, read_image


@pytest.mark.slow
def test_base_image_runs_pytest_and_git_in_a_sandbox(tmp_path: Path) -> None:
    from burstrl.sandbox.backends import SandboxSpec, make_backend
    from burstrl.sandbox.layercache import LayerCache

    if not Path("/usr/bin/python3").exists() or shutil.which("bwrap") is None:
        pytest.skip("needs the host's /usr/bin/python3 and bubblewrap")
    result = CliRunner().invoke(app, ["image", "base", "--out", str(tmp_path / "base")])
    assert result.exit_code == 0, result.output
    base = read_image(tmp_path / "base")
    assert [d.media_type for d in base.layers] == [LAYER_ZSTD]
    assert base.manifest_digest in result.output
    assert "pytest" in base.config["config"]["Labels"]["io.burstrl.base.packages"]
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                                       "def test_zero():\n    assert add(0, 0) == 0\n")
    build_image(repo, tmp_path / "task", base=tmp_path / "base")
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
