"""What the SWE grader needs of a sandbox, and of whatever makes one, as `typing.Protocol`s.

Why protocols and not the concrete `burstrl.sandbox.Sandbox`: the grader takes a `SandboxPool`,
a backend, or a test's stand-in, which share no base class; spelling out the five calls it makes
(run a command, read, write, upload, close) is the whole contract, and a checker holds callers
to it where `Any` held no one. Named apart from the concrete `Sandbox` on purpose: one name,
one thing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from burstrl.sandbox.backends.base import SandboxSpec
from burstrl.sandbox.protocol import ExecResult


class GradingSandbox(Protocol):
    """A running sandbox, as the grader drives it (the daemon's calls; errors are `SandboxError`)."""

    def exec(self, cmd: str | Sequence[str], timeout: float = 60, cwd: str | None = None,
             env: dict[str, str] | None = None, private_output: bool = False) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str) -> object: ...

    def upload(self, src: str | os.PathLike[str] | bytes, dest: str) -> object: ...

    def close(self) -> None: ...


class SandboxMaker(Protocol):
    """A `SandboxPool` or a backend: it makes a fresh sandbox from a spec."""

    def create(self, spec: SandboxSpec) -> GradingSandbox: ...
