"""Disjoint CPU core slices for replicas whose engine binds its threads to cores (vLLM on CPU).

Why: vLLM's CPU backend pins one OpenMP thread to each core of its list (`engine.vllm.cpu_cores`,
VLLM_CPU_OMP_THREADS_BIND; empty = every core the replica may use) and its threads spin while they
wait for each other. Two replicas on one host with the same list each get a share of every core
with threads that spin against the other's, many times slower than a core of their own. So a
provider that starts several such replicas on one host gives each its own slice of that host's
cores, unless the user named a list (then they share it, as asked).

Two owners of a slice, one per provider:
- `CoreSlices` (local provider): the launcher is the only one starting replicas on its host, so an
  in-process table suffices; a slice is free again once the replica holding it has exited.
- `claim_cores` (Ray): replicas of one run land on a node in any order, from several actors, so the
  claim is an exclusive `flock` per core in a directory per run on that node, held by the actor that
  owns the replica; the kernel releases it when that actor's process ends, however it ends.

Standard library only: Ray workers import it to build the role actor.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


class NoFreeCores(RuntimeError):
    """Every core slice of this host is held by a live replica."""


def host_cores() -> list[int]:
    """The cores this process may run on (its affinity), sorted."""
    return sorted(os.sched_getaffinity(0))


def core_list(cores: list[int]) -> str:
    """vLLM's list syntax: "0,1,5"."""
    return ",".join(str(c) for c in cores)


def slice_size(cores: int, replicas: int) -> int:
    """Cores per replica when `replicas` run at once on `cores` cores; ValueError if fewer cores than replicas."""
    if replicas > cores:
        raise ValueError(f"{replicas} replicas at once need at least {replicas} cores for disjoint core lists, "
                         f"this host has {cores}")
    return cores // max(replicas, 1)


class CoreSlices:
    """The host's cores cut into slices of `size` (leftover cores unused); thread-safe.

    `take(alive)` returns a free slice as a core list; a slice is held until the `alive` callable
    given with it returns False (its replica exited), so no release call can be forgotten."""

    def __init__(self, cores: list[int], size: int) -> None:
        if size < 1 or size > len(cores):
            raise ValueError(f"a slice of {size} cores out of {len(cores)}")
        self.size = size
        self.slices = [core_list(cores[i:i + size]) for i in range(0, len(cores) - size + 1, size)]
        self.holders: dict[str, Callable[[], bool]] = {}
        self.lock = threading.Lock()

    def free(self) -> int:
        with self.lock:
            self._forget_dead()
            return len(self.slices) - len(self.holders)

    def take(self, alive: Callable[[], bool]) -> str:
        """A free slice, held while `alive()` is True; NoFreeCores if all are held."""
        with self.lock:
            self._forget_dead()
            for s in self.slices:
                if s not in self.holders:
                    self.holders[s] = alive
                    return s
        raise NoFreeCores(f"all {len(self.slices)} core slices of {self.size} ({', '.join(self.slices)}) are held "
                          "by live replicas")

    def _forget_dead(self) -> None:
        for s, alive in list(self.holders.items()):
            if not alive():
                del self.holders[s]


def claims_dir(run_key: str) -> Path:
    """Where a run's per-core lock files live on a node: one directory per run and user."""
    digest = hashlib.sha256(run_key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"burstrl-cores-{os.getuid()}" / digest


def claim_cores(directory: Path, count: int, cores: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Lock `count` free cores of this node (lowest first); (the cores, the lock fds to keep open).

    A core is held while its fd is open in the process that claimed it. NoFreeCores if fewer than
    `count` are free (the claims taken so far are released)."""
    cores = host_cores() if cores is None else cores
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    got: list[int] = []
    fds: list[int] = []
    for core in cores:
        if len(got) == count:
            break
        fd = os.open(directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        got.append(core)
        fds.append(fd)
    if len(got) < count:
        release(fds)
        raise NoFreeCores(f"{count} free cores wanted on this node, {len(got)} of {len(cores)} are free "
                          f"(the others are claimed by this run's replicas here; {directory})")
    return got, fds


def release(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)  # closing the last fd of the open file drops its flock
