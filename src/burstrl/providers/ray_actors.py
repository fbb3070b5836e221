"""The Ray actor that runs one burstrl role process on its node.

Why an actor around a process and not the role itself inside the actor: a role is the same
`burstrl ...` command as under the local provider (same logs, same ready line, same signals), so
everything tested locally holds on Ray. The actor is async and holds no logical CPU by default (a
replica's work is its child's, not the actor's); it starts the child in its own process group with
PR_SET_PDEATHSIG, so the child dies with the actor's worker process (`ray.kill`, a node loss), and
`wait()` is the long-running call the provider watches with `ray.wait` to see either die.

A replica may instead be forked by its node's zygote (`fork()`, providers/ray_zygote.py): the
child is then the zygote's, not the actor's; the zygote kills it when this actor's worker exits,
and the actor watches it through a pidfd and learns its exit status from the zygote.

A replica whose engine binds cores (`Placement.cores`: vLLM on CPU) claims its cores on its node in
`_args`, with a lock per core that this actor holds until its process ends (protocol/cores.py).

Kept free of torch (its burstrl imports are the standard-library-only process and core helpers):
workers import this module to build the actor.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from burstrl.protocol.cores import claim_cores, claims_dir, core_list
from burstrl.protocol.process import die_with_parent_signal, ready_url


@dataclass
class ProcessSpec:
    """What to run: `python -c CODE ARGS...` with `env` on top of the worker's, output to `log`."""

    args: list[str]
    log: str
    env: dict[str, str] = field(default_factory=dict)
    code: str = "from burstrl.cli import main; main()"
    ready_line: bool = False  # the child prints a JSON {"event": "ready", "url": ...} line on stdout
    append: bool = False
    host_key: str = ""  # dotted config key of the bind address: set to this node's IP
    port_key: str = ""  # dotted config key of the bind port: set to `port` (0 = any free port)
    port: int = 0
    cores_key: str = ""  # dotted config key set to `cores` cores of this node no other role of the run holds
    cores: int = 0
    cores_run: str = ""  # the run's key: its per-core lock files on the node (protocol/cores.py)


class ForkedChild:
    """A role forked by this node's zygote: what `RoleActor` needs of a Popen, for a non-child.

    Exit is seen through a pidfd (which cannot be waited on by a non-parent); the status comes from
    the zygote, which reaped it (-9 if the zygote is gone: its children die with it)."""

    def __init__(self, pid: int, zygote: Any) -> None:
        self.pid, self.zygote = pid, zygote
        self.returncode: int | None = None
        try:
            self.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone (and reaped)
            self.pidfd = -1

    def running(self) -> bool:
        if self.returncode is not None or self.pidfd < 0:
            return False
        return not select.select([self.pidfd], [], [], 0)[0]

    async def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.running():
            return None
        try:
            code = await self.zygote.exit_code.remote(self.pid, 30.0)
        except RayActorError:
            code = None
        self.returncode = -signal.SIGKILL if code is None else code
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        return self.returncode


@ray.remote(num_cpus=0, max_restarts=0)
class RoleActor:
    """One role process. Construct with a spec to start at once (a restarted actor restarts it)."""

    def __init__(self, spec: ProcessSpec | None = None) -> None:
        self.proc: subprocess.Popen | ForkedChild | None = None
        self.url = ""
        self.spec = spec
        self.stopping = False
        self.core_locks: list[int] = []  # held as long as this actor (and so its child) lives
        self.core_args: list[str] = []  # `--KEY LIST` for those cores
        if spec is not None:
            self._spawn(spec)

    def _args(self, spec: ProcessSpec) -> list[str]:
        args = list(spec.args)
        if spec.host_key:
            args += [f"--{spec.host_key}", ray.util.get_node_ip_address()]
        if spec.port_key:
            args += [f"--{spec.port_key}", str(spec.port)]
        if not self.core_locks:  # once: a fork that falls back to a plain start keeps the cores it claimed
            self.core_args, self.core_locks = claim_role_cores(spec)  # NoFreeCores: a failed start
        args += self.core_args
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        return args

    def _spawn(self, spec: ProcessSpec) -> None:
        args = self._args(spec)
        with open(spec.log, "a" if spec.append else "w") as log:
            out = subprocess.PIPE if spec.ready_line else log
            self.proc = subprocess.Popen([sys.executable, "-c", spec.code, *args], stdout=out, stderr=log,
                                         text=True, start_new_session=True, env={**os.environ, **spec.env},
                                         preexec_fn=die_with_parent_signal)

    async def start(self, spec: ProcessSpec) -> int:
        """Start the child (actors made without a spec, like trainer ranks); returns its pid."""
        self.spec = spec
        self._spawn(spec)
        return self.proc.pid

    async def fork(self, spec: ProcessSpec, zygote: Any, timeout: float) -> dict[str, Any]:
        """Have this node's zygote fork the child (a `burstrl` role with a ready line), tied to this
        worker; {"pid", "url"} once it is ready, else the zygote's {"error", "zygote_alive"}."""
        self.spec = spec
        env = {**os.environ, **spec.env}  # what a child Popen'd here would get (CUDA_VISIBLE_DEVICES, ...)
        try:
            got = await zygote.spawn.remote(self._args(spec), spec.log, timeout, spec.append, env, os.getpid())
        except RayActorError as exc:
            return {"error": f"the zygote actor is gone: {exc}", "zygote_alive": False}
        if "error" not in got:
            self.proc = ForkedChild(got["pid"], zygote)
            self.url = got["url"]
        return got

    async def _poll(self) -> int | None:
        if isinstance(self.proc, ForkedChild):
            return await self.proc.poll()
        return self.proc.poll()

    async def ready(self, timeout: float) -> str:
        """The child's URL from its ready line ("" for roles without one); RuntimeError if it dies first."""
        if self.url or not self.spec.ready_line:
            return self.url
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = await asyncio.wait_for(loop.run_in_executor(None, self.proc.stdout.readline),
                                              timeout=max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                break
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}; log {self.spec.log}:\n{_tail(self.spec.log)}")
            url = ready_url(line)
            if url is not None:
                self.url = url
                loop.run_in_executor(None, _drain, self.proc.stdout)  # keep the pipe from filling
                return self.url
        raise RuntimeError(f"not ready after {timeout:.0f} s; log {self.spec.log}:\n{_tail(self.spec.log)}")

    async def wait(self, exit_with_child: bool = False) -> int:
        """Block until the child exits; its exit status (negative: killed by that signal).

        `exit_with_child`: a child that fails takes the actor down with it, so that Ray restarts
        the actor (and the child, at the same address) when the actor has restarts left.
        """
        while await self._poll() is None:
            await asyncio.sleep(0.2)
        if exit_with_child and self.proc.returncode != 0 and not self.stopping:
            os._exit(1)
        return self.proc.returncode

    async def node(self) -> dict[str, object]:
        """Where this actor runs: node IP, node id, a free TCP port there, the worker's pid."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "free_port": port,
                "pid": os.getpid()}

    async def child(self) -> int | None:
        """The child's pid (tests, `ps`); None before it started."""
        return None if self.proc is None else self.proc.pid

    async def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL after `timeout`; returns its status."""
        self.stopping = True
        if self.proc is None:
            return None
        if await self._poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while await self._poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if await self._poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
                while await self._poll() is None:
                    await asyncio.sleep(0.05)
        return self.proc.returncode


def claim_role_cores(spec: ProcessSpec) -> tuple[list[str], list[int]]:
    """`--KEY LIST` for a spec that asks for cores of its own on this node, and the lock fds that hold
    them while open; ([], []) for one that asks for none. NoFreeCores if too few are free."""
    if not spec.cores_key:
        return [], []
    cores, fds = claim_cores(claims_dir(spec.cores_run), spec.cores)
    return [f"--{spec.cores_key}", core_list(cores)], fds


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _drain(stream) -> None:
    for _ in iter(stream.readline, ""):
        pass


def _tail(path: str, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""
