"""A replica killed without `close()` leaves its temp state dir (its admin token);
the next replica on the host removes it, and only it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from burstrl.inference.replica import STATE_PREFIX, make_state_dir, sweep_dead_state_dirs
from burstrl.protocol.process import OWNER_FILE, process_start_time


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dir(parent: Path, name: str, owner: dict | str | None, age_s: float = 0.0) -> Path:
    path = parent / (STATE_PREFIX + name)
    path.mkdir()
    (path / "uploads").mkdir()
    if owner is not None:
        (path / OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))
    return path


def test_live_owner_kept_dead_owner_removed(tmp_path: Path) -> None:
    mine = make_state_dir(tmp_path)
    dead = _dir(tmp_path, "dead", {"owner_pid": _dead_pid(), "owner_start": 12345})
    reused = _dir(tmp_path, "reused", {"owner_pid": os.getpid(), "owner_start": (process_start_time(os.getpid()) or 0) + 1})
    removed = sweep_dead_state_dirs(tmp_path)
    assert sorted(removed) == sorted([dead, reused])
    assert mine.is_dir() and not dead.exists() and not reused.exists()


def test_dir_without_owner_judged_by_age(tmp_path: Path) -> None:
    fresh = _dir(tmp_path, "fresh", None)
    torn = _dir(tmp_path, "torn", "{not json", age_s=3600)
    old = _dir(tmp_path, "old", None, age_s=3600)
    assert sorted(sweep_dead_state_dirs(tmp_path, min_age_s=60)) == sorted([torn, old])
    assert fresh.is_dir()


def test_symlinks_files_and_other_names_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / (STATE_PREFIX + "link")).symlink_to(target)
    (tmp_path / (STATE_PREFIX + "file")).write_text("x")
    other = tmp_path / "other-dir"
    other.mkdir()
    assert sweep_dead_state_dirs(tmp_path, min_age_s=0) == []
    assert (target / "keep").exists() and other.is_dir()
