"""A task's repository on the host: export its base commit without history, apply patches.

Why a fresh one-commit repository: the agent's sandbox must not hold the fix, and a real
repository's `.git` holds every later commit (the fix among them). So the base tree is copied out
with `git archive`, and a new repository is made with a single commit whose author, committer and
date are fixed: the same task always exports to the same commit id, which the grader uses as BASE.

These helpers run on the host with plain git + subprocess; the environment and the grader upload
the resulting directory into a sandbox.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from burstrl.envs.swe.task import SweTask

BASE_TAG = "burstrl-base"
GIT_NAME = "burstrl"
GIT_EMAIL = "burstrl@localhost"
GIT_DATE = "2000-01-01T00:00:00+0000"


def git_env() -> dict[str, str]:
    """Env for reproducible commits that ignore the user's and the system's git config."""
    env = dict(os.environ)
    env.update({
        "GIT_AUTHOR_NAME": GIT_NAME, "GIT_AUTHOR_EMAIL": GIT_EMAIL, "GIT_AUTHOR_DATE": GIT_DATE,
        "GIT_COMMITTER_NAME": GIT_NAME, "GIT_COMMITTER_EMAIL": GIT_EMAIL, "GIT_COMMITTER_DATE": GIT_DATE,
        "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
    })
    return env


def git(repo: Path | str, *args: str, input: bytes | None = None) -> bytes:
    """Run git in `repo`; raise with git's own message when it fails."""
    proc = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True,
                          env=git_env())
    if proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"git {' '.join(args[:2])} in {repo} failed: {msg}")
    return proc.stdout


def init_repo(path: Path) -> None:
    """`git init` with a local identity, so `git commit` works inside a bare sandbox (no HOME config)."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", GIT_NAME)
    git(path, "config", "user.email", GIT_EMAIL)
    git(path, "config", "commit.gpgsign", "false")


def commit_all(path: Path, message: str) -> str:
    """Stage everything and commit with the fixed identity and date; returns the commit id."""
    git(path, "add", "-A")
    git(path, "commit", "-q", "--allow-empty", "-m", message)
    return git(path, "rev-parse", "HEAD").decode().strip()


def _archive(repo: str, commit: str) -> bytes:
    """The tree of `commit` as tar bytes; a bundle file is cloned into a temp dir first."""
    if Path(repo).is_file():
        with tempfile.TemporaryDirectory(prefix="burstrl-bundle-") as tmp:
            git(tmp, "clone", "-q", "--bare", str(Path(repo).resolve()), "src.git")
            return git(Path(tmp) / "src.git", "archive", "--format=tar", commit)
    return git(repo, "archive", "--format=tar", commit)


def export_base(task: SweTask, dest: Path) -> str:
    """Write the task's repository at `base_commit` into `dest` as a new one-commit repository.

    `dest` must be missing or empty. Returns the new base commit id (tagged `burstrl-base`).
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    data = _archive(task.repo, task.base_commit)
    init_repo(dest)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    commit = commit_all(dest, "base")
    git(dest, "tag", BASE_TAG)
    return commit


def apply_patch(repo_dir: Path | str, patch: str) -> tuple[bool, str]:
    """Apply a git diff (binary hunks allowed) to the work tree; (ok, git's message).

    An empty patch applies trivially. Failure leaves the tree untouched (`git apply` is atomic).
    """
    if not patch.strip():
        return True, "empty patch"
    if not patch.endswith("\n"):
        patch += "\n"
    proc = subprocess.run(["git", "-C", str(repo_dir), "apply", "--binary", "--whitespace=nowarn", "-"],
                          input=patch.encode(), capture_output=True, env=git_env())
    message = (proc.stdout + proc.stderr).decode(errors="replace").strip()
    return proc.returncode == 0, message or "applied"
