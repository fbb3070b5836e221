"""Import SWE-bench-format task files: repositories from a local mirror, runtimes checked first.

Why an import step rather than reading SWE-bench's JSONL directly: its `repo` is a GitHub name
(`owner/name`) and these machines reach no GitHub, and a task whose tests cannot run (no image,
or a host Python without the test runner) would score 0 on every attempt and look like a model
that fixes nothing. So `import_tasks` resolves each `repo` in a mirror directory the user filled
(clones, bare mirrors or `git bundle`s, named `owner__name` as SWE-bench's own tooling does, or
`owner/name`, or `name`), checks the base commit is there, picks the task's image (a layout dir
named after the instance, as SWE-bench names its images), and refuses a task with no runtime
before any run starts, saying which and why. Bundles are cloned once into bare mirrors beside the
output file (a bundle is re-cloned on every export otherwise).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from burstrl.atomic import build_dir
from burstrl.envs.swe.repo import git
from burstrl.envs.swe.task import SweTask, TaskError, dump_tasks

# Fields SWE-bench publishes that are not SweTask fields: kept in `extra`, never lost.
SWEBENCH_EXTRA = ("hints_text", "created_at", "environment_setup_commit")
MIRROR_SUFFIXES = ("", ".git", ".bundle")


@dataclass
class ImportReport:
    """What `import_tasks` did: tasks written, and tasks refused with the reason for each."""

    imported: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"{len(self.imported)} imported, {len(self.refused)} refused"]
        lines += [f"  {tid}: {why}" for tid, why in sorted(self.refused.items())]
        return "\n".join(lines)


def mirror_candidates(repo: str, repos_dir: Path) -> list[Path]:
    """Where `owner/name` may sit in the mirror dir, in the order tried."""
    owner_name = repo.strip("/")
    names = [owner_name.replace("/", "__"), owner_name, owner_name.rsplit("/", 1)[-1]]
    return [repos_dir / f"{n}{suffix}" for n in dict.fromkeys(names) for suffix in MIRROR_SUFFIXES]


def find_mirror(repo: str, repos_dir: Path) -> Path:
    """The local clone, bare mirror or bundle of `repo` (an existing path is taken as it is)."""
    if Path(repo).exists():
        return Path(repo).resolve()
    for path in mirror_candidates(repo, repos_dir):
        if path.is_dir() or path.is_file():
            return path.resolve()
    tried = ", ".join(p.name for p in mirror_candidates(repo, repos_dir))
    raise TaskError(f"repo {repo!r}: no mirror in {repos_dir} (tried {tried})")


def bare_from_bundle(bundle: Path, cache_dir: Path) -> Path:
    """A bare clone of `bundle` under `cache_dir` (made once; a stale half-made one is redone;
    concurrent imports of one bundle each clone, the first published clone is used)."""
    dest = cache_dir / (bundle.name.removesuffix(".bundle") + ".git")
    if (dest / "HEAD").is_file():
        return dest
    build_dir(dest, lambda tmp: git(cache_dir, "clone", "-q", "--bare", "--mirror", str(bundle), str(tmp)),
              force=dest.exists(), accept=lambda made: (made / "HEAD").is_file())
    return dest


def has_commit(repo_dir: Path, commit: str) -> bool:
    proc = subprocess.run(["git", "-C", str(repo_dir), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True)
    return proc.returncode == 0


def image_candidates(instance_id: str, images_dir: Path) -> list[Path]:
    """SWE-bench's image name (`sweb.eval.x86_64.<id>`, `__` written `_1776_`) or the bare id."""
    low = instance_id.lower()
    return [images_dir / instance_id, images_dir / low, images_dir / f"sweb.eval.x86_64.{low}",
            images_dir / f"sweb.eval.x86_64.{low.replace('__', '_1776_')}"]


def find_image(instance_id: str, images_dir: Path | None) -> str:
    """The task's OCI layout dir in `images_dir`, or "" (none there)."""
    if images_dir is None:
        return ""
    for path in image_candidates(instance_id, images_dir):
        if (path / "index.json").is_file():
            return str(path.resolve())
    return ""


def host_runner_problem(test_cmd: str) -> str | None:
    """Why the host's system Python cannot run `test_cmd` (a sandbox without an image uses the
    host's /usr read-only), or None. Only `python3 -m <module>` commands are checked."""
    words = test_cmd.split()
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
        module = words[2]
        proc = subprocess.run(["/usr/bin/python3", "-c", f"import {module}"], capture_output=True, text=True)
        if proc.returncode != 0:
            return (f"no image, and the host's /usr/bin/python3 cannot import {module} for "
                    f"`{test_cmd}` (give --images, or a test_cmd the host runs)")
    return None


def runtime_problem(task: SweTask) -> str | None:
    """Why `task`'s tests have nowhere to run, or None: an image that does not read, or no image
    and a host without the runner."""
    if task.image:
        from burstrl.sandbox.images import ImageError, read_image

        try:
            read_image(Path(task.image))
        except (ImageError, OSError) as exc:
            return f"image {task.image}: {exc}"
        return None
    return host_runner_problem(task.test_cmd)


def check_runtimes(tasks: list[SweTask]) -> dict[str, str]:
    """instance_id -> why it cannot run, for every task without a runtime (empty: all can).
    Checked once per distinct (image, test_cmd): a 2,000-task file costs a few probes."""
    seen: dict[tuple[str, str], str | None] = {}
    out = {}
    for task in tasks:
        key = (task.image, task.test_cmd if not task.image else "")
        if key not in seen:
            seen[key] = runtime_problem(task)
        if seen[key] is not None:
            out[task.instance_id] = seen[key]  # type: ignore[assignment]
    return out


def convert(record: dict[str, Any], repos_dir: Path, images_dir: Path | None, cache_dir: Path,
            test_cmd: str | None) -> SweTask:
    """One SWE-bench record as a runnable SweTask (repo resolved, commit checked, image found)."""
    data = dict(record)
    extra = dict(data.pop("extra", None) or {})
    for name in SWEBENCH_EXTRA:
        if name in data:
            extra[name] = data.pop(name)
    extra.setdefault("repo_name", data.get("repo", ""))
    task = SweTask.from_json({**data, "extra": extra})
    mirror = find_mirror(task.repo, repos_dir)
    if mirror.is_file():
        mirror = bare_from_bundle(mirror, cache_dir)
    if not has_commit(mirror, task.base_commit):
        raise TaskError(f"base_commit {task.base_commit[:12]} is not in {mirror}")
    task.repo = str(mirror)
    task.image = task.image or find_image(task.instance_id, images_dir)
    if test_cmd:
        task.test_cmd = test_cmd
    return task


def import_tasks(src: Path, out: Path, repos_dir: Path, images_dir: Path | None = None,
                 test_cmd: str | None = None) -> ImportReport:
    """Write `out` (JSONL) with every task of `src` that can run; refused ones are reported, not
    written. Bundles become bare mirrors in `out`'s dir under `repos/`."""
    report, tasks = ImportReport(), []
    for n, line in enumerate(Path(src).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{src}:{n}: not JSON: {exc}") from None
        tid = str(record.get("instance_id", f"line {n}"))
        try:
            tasks.append(convert(record, Path(repos_dir), images_dir, Path(out).parent / "repos", test_cmd))
        except (TaskError, RuntimeError) as exc:
            report.refused[tid] = str(exc)
    for tid, why in check_runtimes(tasks).items():
        report.refused[tid] = why
    kept = [t for t in tasks if t.instance_id not in report.refused]
    report.imported = [t.instance_id for t in kept]
    dump_tasks(kept, out)
    return report
