"""The local provider: every role a subprocess of the launcher, in its own process group.

Secrets (admin and cluster tokens) go to the children through the environment, never argv, so
they do not show in `ps`. Children die with the launcher (PR_SET_PDEATHSIG), so `kill -9` of the
launcher leaves no orphan holding a port or a GPU. `burstrl train` starts its own ranks here.

With `zygote_model` set, replicas (roles that bind `server.host`/`server.port` and have a pool)
are forked from a zygote that has the imports done (providers/zygote.py): a replacement then
only loads weights. A replica the zygote cannot give (it died) starts the ordinary way; those
are counted in `zygote_fallbacks`.

A role whose placement asks for cores (`Placement.cores`: vLLM replicas on CPU) gets its own slice of
this host's cores, held until its process exits (protocol/cores.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from burstrl.protocol.cores import CoreSlices, NoFreeCores, host_cores
from burstrl.protocol.process import RoleProcess, start_role
from burstrl.providers import Placement, RoleHandle
from burstrl.providers.zygote import Zygote

log = logging.getLogger("burstrl.run")
REPLICA_LISTEN = ("server.host", "server.port")


class LocalProvider:
    def __init__(self, logs_dir: Path, env: dict[str, str], zygote_model: str | None = None) -> None:
        self.logs_dir = logs_dir
        self.env = env
        self.zygote_fallbacks = 0
        # Started here, on the launcher's main thread: its death signal is tied to the starting thread.
        self.zygote = Zygote(logs_dir, env, zygote_model) if zygote_model is not None else None
        self.core_slices: CoreSlices | None = None  # made at the first role that asks for cores

    def start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float = 180.0,
              append: bool = False, placement: Placement = Placement()) -> RoleHandle:
        if placement.cores is None:
            return self._start(name, args, wait_ready=wait_ready, timeout=timeout, append=append,
                               placement=placement)
        key, count = placement.cores
        if self.core_slices is None:
            self.core_slices = CoreSlices(host_cores(), count)
        holder = _Holder()
        try:
            cores = self.core_slices.take(holder)
        except NoFreeCores as exc:
            raise RuntimeError(f"{name}: no cores for its engine: {exc}") from None
        try:
            holder.handle = self._start(name, [*args, f"--{key}", cores], wait_ready=wait_ready, timeout=timeout,
                                        append=append, placement=placement)
        finally:
            holder.starting = False
        return holder.handle

    def _start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float, append: bool,
               placement: Placement) -> RoleHandle:
        if self.zygote is not None and wait_ready and placement.pool and placement.listen == REPLICA_LISTEN:
            if self.zygote.alive():
                return self.zygote.spawn(args, self.logs_dir / f"{name}.log", timeout, append=append)
            self.zygote_fallbacks += 1
            log.warning("the zygote is gone (%s): starting %s the ordinary way", self.zygote.log, name)
        return self._start_process(name, args, wait_ready=wait_ready, timeout=timeout, append=append)

    def _start_process(self, name: str, args: list[str], *, wait_ready: bool, timeout: float,
                       append: bool) -> RoleProcess:
        return start_role(args, self.logs_dir, f"{name}.log", timeout, env=self.env, wait_ready=wait_ready,
                          append=append, die_with_parent=True)

    def start_trainer(self, config: Path, world_size: int, resume: bool, append: bool) -> RoleProcess:
        args = ["train", str(config)] + (["--resume"] if resume else [])
        return self._start_process("trainer", args, wait_ready=False, timeout=180.0, append=append)

    def request_capacity(self, replicas: dict[str, int]) -> None:
        return None

    def close(self) -> None:
        """Stop the zygote (and any replica forked from it that is still running)."""
        if self.zygote is not None:
            self.zygote.close()


class _Holder:
    """Whether a core slice's role still holds it: while it starts, then while its process runs."""

    def __init__(self) -> None:
        self.handle: RoleHandle | None = None
        self.starting = True

    def __call__(self) -> bool:
        return self.starting or (self.handle is not None and self.handle.poll() is None)
