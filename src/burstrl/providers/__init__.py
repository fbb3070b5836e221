"""Providers: where the launcher's roles run. `local` starts each role as a subprocess in its own
process group on this machine; `ray` starts the same commands inside Ray actors on a cluster
(providers/ray_provider.py). The launcher only uses the `Provider` surface (start a named role from
its `burstrl` arguments, start the trainer group, ask for capacity, close) and the `RoleHandle` it
gets back (poll, stop, kill), so a provider never needs to know what a role does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from burstrl.config import RunConfig


class RoleHandle(Protocol):
    """A running role. `poll()` is None while it runs, else its exit status (negative: a signal)."""

    url: str
    log: Path
    cause: str  # why it ended, when the provider knows more than the status ("preempted", ...)
    restarts: int  # times the provider restarted it in place (same address)

    def poll(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def stop(self, timeout: float = 15.0) -> None: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Placement:
    """Hints a provider may use; the local provider needs none of them."""

    listen: tuple[str, str] | None = None  # dotted config keys of the host and port the role binds
    pool: str = ""  # a replica's pool: reserved | on_demand
    restartable: bool = False  # restart in place after a crash, at the same address (the router)
    on_driver: bool = False  # beside the launcher, on its machine
    # (dotted config key, count): the role's engine binds its threads to cores (vLLM on CPU); the
    # provider gives it `count` cores no other role of the run with this hint holds on its host, set
    # as `--KEY LIST` (protocol/cores.py says why)
    cores: tuple[str, int] | None = None


class Provider(Protocol):
    def start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float = 180.0,
              append: bool = False, placement: Placement = Placement()) -> RoleHandle:
        """Start `burstrl ARGS` as role `name` (log `logs/NAME.log`); with `wait_ready`, once it listens."""
        ...

    def start_trainer(self, config: Path, world_size: int, resume: bool, append: bool) -> RoleHandle:
        """Start the trainer's `world_size` ranks from a resolved TrainConfig file, as one handle."""
        ...

    def request_capacity(self, replicas: dict[str, int]) -> None:
        """The fleet is about to hold this many replicas per pool (a hint for a cluster autoscaler)."""
        ...

    def close(self) -> None:
        """Release what the provider holds (every role was stopped before)."""
        ...


def make_provider(cfg: RunConfig, run_dir: Path, env: dict[str, str]) -> Provider:
    if cfg.provider == "local":
        from burstrl.providers.local import LocalProvider

        return LocalProvider(run_dir / "logs", env, zygote_model=cfg.model.path if cfg.fleet.zygote else None)
    if cfg.provider == "ray":
        from burstrl.providers.ray_provider import RayProvider

        return RayProvider(cfg.ray, run_dir, env, zygote_model=cfg.model.path if cfg.fleet.zygote else None)
    raise ValueError(f"unknown provider {cfg.provider!r}; choose from local, ray")
