"""The local provider: every role a subprocess of the launcher, in its own process group.

Secrets (admin and cluster tokens) go to the children through the environment, never argv, so
they do not show in `ps`. Children die with the launcher (PR_SET_PDEATHSIG), so `kill -9` of the
launcher leaves no orphan holding a port or a GPU. `burstrl train` starts its own ranks here.
"""

from __future__ import annotations

from pathlib import Path

from burstrl.protocol.process import RoleProcess, start_role
from burstrl.providers import Placement


class LocalProvider:
    def __init__(self, logs_dir: Path, env: dict[str, str]) -> None:
        self.logs_dir = logs_dir
        self.env = env

    def start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float = 180.0,
              append: bool = False, placement: Placement = Placement()) -> RoleProcess:
        return start_role(args, self.logs_dir, f"{name}.log", timeout, env=self.env, wait_ready=wait_ready,
                          append=append, die_with_parent=True)

    def start_trainer(self, config: Path, world_size: int, resume: bool, append: bool) -> RoleProcess:
        args = ["train", str(config)] + (["--resume"] if resume else [])
        return self.start("trainer", args, wait_ready=False, append=append)

    def request_capacity(self, replicas: dict[str, int]) -> None:
        return None

    def close(self) -> None:
        return None
