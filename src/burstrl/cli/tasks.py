"""`burstrl tasks ...`: make, check and import SWE task files."""

from __future__ import annotations

from pathlib import Path

import typer

from burstrl.cli.app import (
    fail,
    tasks_app,
)


@tasks_app.command("make-toy")
def tasks_make_toy(
    out: Path = typer.Argument(..., help="Directory to write: OUT/tasks.jsonl and OUT/repos/ID (missing or empty)."),
    n: int = typer.Option(50, "--n", min=1, help="Number of tasks."),
    seed: int = typer.Option(0, "--seed", help="Seed; with index, difficulty and split it fixes each task."),
    difficulty: int = typer.Option(1, "--difficulty", min=0, max=4,
                                   help="0: one bug, the fix stated; 1: one bug; 2: one bug behind a wrapper; "
                                   "3: two; 4: three, two calls deep."),
    split: str = typer.Option("train", "--split", help="train or test (held out: other templates and names)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty OUT."),
) -> None:
    """Generate toy Python repositories with injected bugs, and their task file."""
    from burstrl.envs.swe.toygen import make_toy_tasks

    _check_output(out, split, force)
    tasks = make_toy_tasks(out, n, seed=seed, difficulty=difficulty, split=split)
    typer.echo(f"{len(tasks)} tasks -> {out / 'tasks.jsonl'}")


@tasks_app.command("make-functions")
def tasks_make_functions(
    out: Path = typer.Argument(..., help="Directory to write: OUT/tasks.jsonl and OUT/repo (missing or empty)."),
    n: int = typer.Option(300, "--n", min=1, help="Number of tasks (distinct problems)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the problems' names, arguments, constants and tests."),
    split: str = typer.Option("train", "--split", help="train, or test (held out: other templates, and "
                              "constants training never sees)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty OUT."),
) -> None:
    """Generate one-function Python problems (a def line and docstring to complete; hidden tests)."""
    from burstrl.envs.functions.tasks import make_function_tasks

    _check_output(out, split, force)
    try:
        tasks = make_function_tasks(out, n, seed=seed, split=split)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"{len(tasks)} tasks -> {out / 'tasks.jsonl'}")


def _check_output(out: Path, split: str, force: bool) -> None:
    """A generator's arguments: a known split, and an OUT it may write into."""
    if split not in ("train", "test"):
        fail(f"--split must be train or test, not {split!r}")
    if out.exists() and any(out.iterdir()) and not force:
        fail(f"{out} is not empty (use --force)")


@tasks_app.command("check")
def tasks_check(
    file: Path = typer.Argument(..., help="Task file (JSONL)."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Where exports go (default: a temp dir, removed)."),
    host: bool = typer.Option(False, "--host", help="Run the tests on the host instead of in sandboxes."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Tasks checked at once."),
    flawed_out: Path | None = typer.Option(None, "--flawed-out", help="Write the flawed task ids here, one a line."),
    hacks: bool = typer.Option(False, "--hacks", help="Also grade a battery of generic, fix-free reward hacks "
                               "against each task (envs/swe/hacks.py); one that scores above 0 makes it flawed."),
    suspicious: str = typer.Option("zero", "--suspicious", help="With --hacks: the static scan's setting the "
                                   "task set trains with (zero or flag)."),
) -> None:
    """Check that target tests fail at the base and pass with the gold patch, and existing tests pass
    both ways; print a table and exit 1 if any task is flawed."""
    if hacks and host:
        fail("--hacks runs the hacks as attempts are graded, in sandboxes: drop --host")
    if suspicious not in ("zero", "flag"):
        fail(f"--suspicious must be zero or flag, not {suspicious!r}")
    import tempfile

    from burstrl.envs.swe.check import check_tasks, format_results
    from burstrl.envs.swe.task import TaskError, load_tasks

    try:
        tasks = load_tasks(file)
    except (OSError, TaskError) as exc:
        fail(str(exc))
    with tempfile.TemporaryDirectory(prefix="burstrl-check-") as tmp:
        results = check_tasks(tasks, workdir or Path(tmp), sandbox=not host, jobs=jobs,
                              hacks=suspicious if hacks else "")
    typer.echo(format_results(results))
    if flawed_out is not None:
        flawed_out.write_text("".join(f"{r.instance_id}\n" for r in results if not r.ok))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@tasks_app.command("import")
def tasks_import(
    src: Path = typer.Argument(..., help="SWE-bench-format task file (JSONL, fields as published)."),
    repos: Path = typer.Option(..., "--repos", help="Mirror dir: clones, bare mirrors or bundles named "
                               "owner__name, owner/name or name (with .git / .bundle)."),
    out: Path = typer.Option(..., "--out", help="Task file to write (JSONL): only tasks that can run."),
    images: Path | None = typer.Option(None, "--images", help="Dir of OCI layouts named after the instance "
                                       "(sweb.eval.x86_64.<id>, or the id)."),
    test_cmd: str | None = typer.Option(None, "--test-cmd", help="Test command for every task (default: pytest)."),
    strict: bool = typer.Option(True, "--strict/--keep-going", help="Exit 1 if any task was refused."),
) -> None:
    """Import SWE-bench tasks: resolve each repo in the mirror, check its base commit, find its image,
    and refuse (with the reason) every task whose tests have nowhere to run."""
    from burstrl.envs.swe.swebench import import_tasks
    from burstrl.envs.swe.task import TaskError

    try:
        report = import_tasks(src, out, repos, images, test_cmd)
    except (OSError, TaskError) as exc:
        fail(str(exc))
    typer.echo(report.summary())
    typer.echo(f"-> {out}")
    if report.refused and strict:
        raise typer.Exit(1)


