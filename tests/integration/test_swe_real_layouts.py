"""Honest tasks pass (issue 48): real upstream bug fixes (more-itertools, boltons, cachetools; see
`tests/realrepos.py`), graded in real sandboxes with pytest where real task images put it, must
resolve with their gold fix and not without it, and `tasks check` must call every one ok.

The layouts: pytest from an image layer on PYTHONPATH (`/work/.pydeps`, the host's python3), and
a virtualenv at /opt/venv in the read-only root of `burstrl image base`. The seal once trusted only
the interpreter's install and the repository's unchanged files, so every honest fix in the first
layout was `tampered: sealed run forged_message ... (from /work/.pydeps/pluggy/...)`. The seal may
trust what the image provides, but never a file written while the tests run: the adversarial twin
plants a module in a trusted directory (the PYTHONPATH layer, a virtualenv's site-packages under
the writable /work) and reaches a frame from it; it must stay `tampered`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from burstrl.envs.swe.check import check_tasks, format_results
from burstrl.envs.swe.grade import GradeResult, grade
from burstrl.envs.swe.task import SweTask
from burstrl.sandbox.pool import SandboxPool
from tests.realrepos import (
    FIXES,
    LAYOUTS,
    PYDEPS,
    VENV,
    WORK_VENV,
    SdistUnavailable,
    base_image,
    build_task,
    for_layout,
    on_host,
    planted_module_patch,
    pydeps_image,
    sandbox_python,
    venv_image,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or not Path("/usr/bin/python3").exists(),
                                 reason="needs bubblewrap (bwrap: `make system-deps` as root) and the host's "
                                        "/usr/bin/python3 (the sandbox's interpreter)")
IDS = [f.instance_id for f in FIXES]


@dataclass
class Real:
    """The real tasks (plain `python3 -m pytest`), one image per layout, and a sandbox pool."""

    root: Path
    tasks: list[SweTask]
    images: dict[str, Path]
    pool: SandboxPool

    def task(self, instance_id: str, layout: str) -> SweTask:
        return for_layout(next(t for t in self.tasks if t.instance_id == instance_id), layout, self.images[layout])


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SweTask]]:
    root = tmp_path_factory.mktemp("realrepos")
    try:
        return root, [build_task(fix, root) for fix in FIXES]
    except SdistUnavailable as exc:
        pytest.skip(f"the real repositories' sdists are neither cached nor downloadable: {exc}")


@pytest.fixture(scope="module")
def real(tasks: tuple[Path, list[SweTask]]) -> Iterator[Real]:
    """Images built once (about 2 s in all), a layer cache of this module's own."""
    from burstrl.sandbox.backends import make_backend
    from burstrl.sandbox.layercache import LayerCache

    if shutil.which("bwrap") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("needs bubblewrap and the host's /usr/bin/python3")
    root, built = tasks
    images = {"pydeps": pydeps_image(root), "venv": venv_image(root, base_image(root)),
              "workvenv": venv_image(root, None, WORK_VENV)}
    backend = make_backend("namespace", layer_cache=LayerCache(root / "layers", max_bytes=2 << 30))
    pool = SandboxPool(backend, max_concurrent=None)
    yield Real(root, built, images, pool)
    pool.close_all()


def _timed_grade(task: SweTask, patch: str, pool: SandboxPool, gold: bool = False) -> GradeResult:
    start = time.monotonic()
    result = grade(task, patch, pool, gold=gold)
    print(f"{task.instance_id} {'gold' if gold else 'patch' if patch else 'empty'}: {time.monotonic() - start:.2f}s "
          f"(tests {result.test_seconds:.2f}s)")
    return result


def test_the_real_tasks_hold_on_the_host(tasks: tuple[Path, list[SweTask]]) -> None:
    """Before any sandbox: plain `python -m pytest` (this interpreter's) says each target test fails
    at the release with the bug and passes with the upstream fix, and each existing one passes."""
    from burstrl.envs.swe.check import check_task

    root, built = tasks
    results = [check_task(on_host(t), root / "host-check", sandbox=False) for t in built]
    assert all(r.ok for r in results), format_results(results)
    for task, r in zip(built, results, strict=True):
        assert all(r.at_base[t] == "failed" and r.at_gold[t] == "passed" for t in task.FAIL_TO_PASS), r
        assert all(r.at_base[t] == r.at_gold[t] == "passed" for t in task.PASS_TO_PASS), r


@needs_bwrap
@pytest.mark.slow
def test_the_layouts_put_pytest_where_the_task_says(real: Real) -> None:
    """How the images mount: the PYTHONPATH layer is seeded into the sandbox's own (writable) /work
    on the host's system dirs; /opt/venv is part of the base image's read-only root."""
    from burstrl.sandbox.backends import SandboxSpec

    probe = "import sys, pytest; print(sys.executable, sys.prefix, pytest.__file__)"
    python = sandbox_python()
    expect = {
        "pydeps": ("python3", f"{PYDEPS}/pytest/__init__.py", f"touch {PYDEPS}/w && echo writable"),
        "venv": (f"{VENV}/bin/python", f"{VENV}/lib/python{python}/site-packages/pytest/__init__.py",
                 f"touch {VENV}/w 2>/dev/null || echo read-only"),
    }
    for layout, (py, where, write) in expect.items():
        task = real.task(IDS[0], layout)
        with real.pool.create(SandboxSpec(image=Path(task.image))) as sb:
            env = "PYTHONPATH=" + LAYOUTS[layout][1] if LAYOUTS[layout][1] else ""
            out = sb.exec(f"{env} {py} -c '{probe}'; {write}")
        assert out.exit_code == 0 and where in out.stdout, (layout, out)
        assert ("writable" if layout == "pydeps" else "read-only") in out.stdout, (layout, out)
        if layout == "venv":
            assert f" {VENV} " in out.stdout, out  # sys.prefix: the venv, not the base image's python


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pydeps", "venv"])
@pytest.mark.parametrize("instance_id", IDS)
def test_the_gold_fix_resolves_and_the_base_does_not(real: Real, instance_id: str, layout: str) -> None:
    task = real.task(instance_id, layout)
    gold = _timed_grade(task, task.patch, real.pool, gold=True)
    assert not gold.tampered and not gold.reason and not gold.infra_error, (gold.reason, gold.infra_error, gold.log[-3000:])
    assert gold.sealed and gold.resolved, (gold.statuses, gold.log[-3000:])
    base = _timed_grade(task, "", real.pool)
    assert not base.tampered and not base.infra_error and base.sealed, (base.reason, base.infra_error)
    assert not base.resolved and base.reason == "", base.reason
    assert {t: base.statuses[t] for t in task.FAIL_TO_PASS} == dict.fromkeys(task.FAIL_TO_PASS, "failed")
    assert all(base.statuses[t] == "passed" for t in task.PASS_TO_PASS), base.statuses


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pydeps", "venv"])
def test_tasks_check_calls_every_real_task_ok(real: Real, layout: str, tmp_path: Path) -> None:
    """`burstrl tasks check`'s own steps, sandboxed: never an honest gold patch called tampered."""
    results = check_tasks([real.task(i, layout) for i in IDS], tmp_path, backend=real.pool.backend)
    table = format_results(results)
    print(table)
    assert all(r.ok for r in results) and "3 ok, 0 flawed" in table, table


@needs_bwrap
@pytest.mark.slow
@pytest.mark.parametrize("layout,where", [("pydeps", PYDEPS),
                                          ("workvenv", f"{WORK_VENV}/lib/python{{python}}/site-packages")])
def test_a_module_planted_at_run_time_in_a_trusted_dir_stays_untrusted(real: Real, layout: str, where: str) -> None:
    """The gold fix resolves in this layout too (the honest control); its twin, which writes a module
    into the trusted dir while the tests run and reaches a frame from it, is tampered by the seal."""
    task = real.task("boltons-26.1.0-singularize-double-s", layout)
    honest = _timed_grade(task, task.patch, real.pool, gold=True)
    assert honest.resolved and honest.sealed and not honest.tampered, (honest.reason, honest.log[-3000:])
    twin = _timed_grade(task, planted_module_patch(task, where.format(python=sandbox_python())), real.pool)
    assert twin.apply_ok and not twin.infra_error, (twin.apply_error, twin.infra_error)
    assert twin.tampered.startswith("sealed run") and not twin.resolved, (twin.reason, twin.statuses, twin.log[-3000:])
