"""A pool that starts sandboxes concurrently, bounds how many run at once, and always cleans up:
on `close_all`, at interpreter exit, and, for a harness killed with SIGKILL, through the
runtime dying with its parent plus `sweep_stale` for the dirs and cgroups left on disk.

Also the three-line entry point: `sb = open_sandbox(); sb.exec("ls"); sb.close()`.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from burstrl.sandbox.backends import SandboxBackend, make_backend
from burstrl.sandbox.backends.base import Sandbox, SandboxSpec, pid_alive, read_owner, remove_tree
from burstrl.sandbox.backends.cgroups import kill_and_remove
from burstrl.sandbox.backends.oci import sweep_orphan_cgroups
from burstrl.sandbox.backends.quota import sweep_sized_dirs

_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    """Tracks every sandbox it created; at most `max_concurrent` are alive at once (None: no bound).

    A slot is held from `create` until the sandbox is closed, so `create` waits for a free one.
    """

    def __init__(self, backend: SandboxBackend | str = "auto", max_concurrent: int | None = 8) -> None:
        self.backend = make_backend(backend) if isinstance(backend, str) else backend
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self._live: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        _pools.add(self)

    def create(self, spec: SandboxSpec | None = None, timeout: float | None = None) -> Sandbox:
        """Start one sandbox, waiting up to `timeout` seconds for a free slot."""
        if self._slots is not None and not self._slots.acquire(timeout=timeout):
            raise TimeoutError(f"no free sandbox slot within {timeout}s ({self.max_concurrent} running)")
        try:
            sandbox = self.backend.create(spec or SandboxSpec())
        except BaseException:
            self._release()
            raise
        with self._lock:
            self._live[sandbox.id] = sandbox
        sandbox.on_close(lambda: self._forget(sandbox.id))
        return sandbox

    def create_many(self, specs: Sequence[SandboxSpec]) -> list[Sandbox]:
        """Start all at once (one thread each); if any fails, close the others and raise."""
        if self.max_concurrent is not None and len(specs) > self.max_concurrent:
            raise ValueError(f"{len(specs)} sandboxes asked for, the pool runs at most {self.max_concurrent}")
        if not specs:
            return []
        with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="sandbox-create") as ex:
            futures = [ex.submit(self.create, spec) for spec in specs]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for f in futures:
                if f.exception() is None:
                    f.result().close()
            raise errors[0]  # type: ignore[misc]
        return [f.result() for f in futures]

    @property
    def live(self) -> list[Sandbox]:
        with self._lock:
            return list(self._live.values())

    def close_all(self) -> None:
        for sandbox in self.live:
            sandbox.close()

    def _forget(self, sid: str) -> None:
        with self._lock:
            if self._live.pop(sid, None) is None:
                return
        self._release()

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_pools):
        pool.close_all()


def sweep_stale(state_dir: Path, min_age_s: float = 60.0) -> list[str]:
    """Remove sandbox dirs (and their processes and cgroups) whose owner process is dead, then
    the oci backend's cgroups whose dir is gone (found by name: runc can drop its state first).

    A dir with no owner record yet is left alone for `min_age_s`: its owner may be creating it.
    Returns the ids removed.
    """
    removed = []
    for path in sorted(Path(state_dir).iterdir()) if Path(state_dir).is_dir() else []:
        if not path.is_dir() or path.name.startswith("."):  # .runc-state etc.: the runtime's own
            continue
        owner = read_owner(path)
        if owner is None:
            if time.time() - path.stat().st_mtime < min_age_s:
                continue
        elif pid_alive(owner["owner_pid"], owner.get("owner_start")):
            continue
        _kill_leftovers(owner or {})
        sweep_sized_dirs(path)  # /work's overlay and sized filesystems: rmtree must not walk them
        remove_tree(path)
        removed.append(path.name)
    return removed + [sid for sid in sweep_orphan_cgroups(state_dir) if sid not in removed]


def _kill_leftovers(owner: dict[str, Any]) -> None:
    pid = owner.get("pid")
    if pid and pid_alive(pid, owner.get("pid_start")):
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
    kill_and_remove(owner.get("cgroups") or [])
    if owner.get("cleanup_argv"):  # the oci backend: `runc delete --force ID` removes its cgroup
        subprocess.run(owner["cleanup_argv"], capture_output=True)


_default: tuple[str, SandboxPool] | None = None
_default_lock = threading.Lock()


def open_sandbox(image: Path | str | None = None, backend: str = "auto", **spec_fields: Any) -> Sandbox:
    """The three-line use: `sb = open_sandbox(); print(sb.exec("ls").stdout); sb.close()`.

    Sandboxes from here belong to one unbounded process-wide pool per backend name, closed at
    interpreter exit.
    """
    global _default
    with _default_lock:
        if _default is None or _default[0] != backend:
            _default = (backend, SandboxPool(backend, max_concurrent=None))
        pool = _default[1]
    return pool.create(SandboxSpec(image=Path(image) if image is not None else None, **spec_fields))
