"""Providers: where the launcher's roles run. `local` starts each role as a subprocess in its own
process group on this machine; `ray` (later) will start the same commands as Ray actors. The
launcher only uses the `Provider` surface (start a named role from its `burstrl` arguments, get a
handle it can poll, stop and kill), so a provider never needs to know what a role does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from burstrl.inference.process import RoleProcess


class Provider(Protocol):
    def start(self, name: str, args: list[str], *, wait_ready: bool, timeout: float = 180.0,
              append: bool = False) -> RoleProcess:
        """Start `burstrl ARGS` as role `name` (log `logs/NAME.log`); with `wait_ready`, once it listens."""
        ...


def make_provider(name: str, run_dir: Path, env: dict[str, str]) -> Provider:
    if name == "local":
        from burstrl.providers.local import LocalProvider

        return LocalProvider(run_dir / "logs", env)
    raise ValueError(f"unknown provider {name!r}; choose from local")
