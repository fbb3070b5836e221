"""What every sandbox backend shares: the spec, the `Sandbox` handle, the limits report, and the
daemon's command line and socket handover as a sandbox's entry process (starting that process and
waiting until the daemon listens: `launch`; the rlimits every process starts with: `limits`).

Why one concrete `Sandbox` class for all backends: a sandbox is, to its user, a daemon client
plus a way to tear everything down; only how it was started differs, so a backend hands over a
`closer` callable and the rest is common.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import burstrl
from burstrl.protocol.process import OWNER_FILE as OWNER_FILE
from burstrl.protocol.process import pid_alive as pid_alive  # re-exported: pool and backends use it
from burstrl.protocol.process import process_start_time as process_start_time
from burstrl.protocol.process import read_owner as read_owner
from burstrl.protocol.process import write_owner as write_owner

if TYPE_CHECKING:
    from burstrl.sandbox.backends.ids import IdLease
    from burstrl.sandbox.backends.quota import SizedDir
    from burstrl.sandbox.images import Image

# Inside the sandbox: where the package's src dir is mounted read-only, and the socket dir.
CODE_MOUNT = "/opt/burstrl"
RUN_MOUNT = "/run/sandbox"
SOCKET_NAME = "sandboxd.sock"
TOKEN_NAME = "token"
# How long a backend waits for the daemon's own /close before killing the sandbox anyway.
CLOSE_GRACE_S = 5.0
# How long a close waits for the killed processes to be gone before it names the ones left: only a
# process stuck in the kernel (D state) takes more than a moment, however busy the machine.
GONE_WAIT_S = 30.0
# sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107

# The bootstrap's own first argument (removed before the daemon parses its argv): after the ready line,
# fds 0-2 become the sandbox's /dev/null (see `_DETACH`).
DETACH_FLAG = "--detach-stdio"
# Where the runtime's stdio are host fds a command can open (gVisor lets commands open /proc/1/fd/*,
# the daemon's being non-dumpable notwithstanding): the ready line goes out on the host's stdout,
# then the daemon holds the sandbox's /dev/null on 0-2 and no host pipe or log file. Nothing the
# daemon writes later reaches the harness there (its tracebacks included): the price of no host fd.
_DETACH = """\
import os
class _Detach:
    def __init__(self, out):
        self.out, self.line = out, False
    def write(self, s):
        self.line = self.line or "\\n" in s
        return self.out.write(s)
    def flush(self):
        self.out.flush()
        if self.line:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            sys.stdout = self.out
"""

# `-I` ignores PYTHONPATH and the user site, so the daemon's import path is exactly the stdlib plus
# the read-only code mount, whatever env the spec gives the commands. PR_SET_PDEATHSIG (prctl 1)
# makes the daemon die with its parent (bwrap's init or `runc run`), so no runtime leaves it behind.
_BOOTSTRAP = f"""\
import runpy, sys
{_DETACH}try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)
except Exception:
    pass
if sys.argv[1:2] == [{DETACH_FLAG!r}]:
    del sys.argv[1]
    sys.stdout = _Detach(sys.stdout)
sys.path.insert(0, {CODE_MOUNT!r})
runpy.run_module("burstrl.sandbox.daemon", run_name="__main__", alter_sys=True)
"""


@dataclass
class SandboxSpec:
    """What a sandbox is made from and what it may use.

    Requests and limits are separate numbers (as in Kubernetes): the limit is enforced, the
    request is what a scheduler packs by. The defaults overcommit like the reference: requests at
    25% of the CPU limit and 40% of the memory limit.
    """

    image: Path | None = None  # an OCI image layout dir; None = the host's system dirs, read-only
    cpu_limit: float = 1.0
    memory_limit_mb: int = 2048
    cpu_request: float | None = None
    memory_request_mb: int | None = None
    pids_limit: int = 256
    workdir_mb: int = 4096  # /work's size: sparse, so the host disk fills only as it is written
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.cpu_request is None:
            self.cpu_request = round(self.cpu_limit * 0.25, 3)
        if self.memory_request_mb is None:
            self.memory_request_mb = int(self.memory_limit_mb * 0.4)


@dataclass(frozen=True)
class LimitsReport:
    """How each limit was enforced ("cgroup-v1", "cgroup-v2", "rlimit", "runtime", or "none";
    for /work's size "ext4-loop", "tmpfs" or "none"), and why not where it was not.

    `oom`: what keeps the OOM killer off the daemon. "cgroup": its commands run in a memory cgroup
    of their own under the sandbox's, which it is not in (`cgroups`), so an OOM there picks commands
    only; "score": only the commands' oom_score_adj (`guard`), which a crowd of commands that keep
    lowering theirs can defeat.

    `uid`: which host uid the sandbox's per-uid kernel counts (inotify instances and watches,
    processes, pending signals, pipe pages, ...) are charged to, and which it shares with whom:
    e.g. "own host uid 1879048193 (leased ...)" as root, "own subordinate uid 100123 (newuidmap):
    ...; still charged to the harness's uid 1000 ...: inotify ..." or "shared with the harness's
    uid 1000 (why): ..." as an ordinary user (`subids`)."""

    cpu: str = "none"
    memory: str = "none"
    pids: str = "none"
    reasons: tuple[str, ...] = ()
    disk: str = "none"
    oom: str = "score"
    uid: str = "not reported"

    @property
    def enforced(self) -> bool:
        return "none" not in (self.cpu, self.memory, self.pids)


@dataclass
class SandboxState:
    """What a backend has set up for one sandbox so far: its teardown undoes exactly this, whether
    the start failed halfway or the sandbox is being closed. Each backend adds its own parts.

    Why a dataclass and not a dict: the start and the teardown are far apart (and the teardown
    runs on a half-made sandbox), so a misspelt key would surface only as a leaked mount."""

    path: Path  # the sandbox's dir under the backend's state_dir
    proc: subprocess.Popen[bytes] | None = None  # the entry process (bwrap, or `runc run`)
    image: Image | None = None  # pinned in the layer cache until teardown
    image_env: dict[str, str] = field(default_factory=dict)  # the image's `Env`, for the daemon
    sized: list[SizedDir] = field(default_factory=list)  # /work's size-limited filesystems, oldest first
    uid: int | None = None  # the host uid/gid its processes run as (None: ours, run by an ordinary user)
    gid: int | None = None
    lease: IdLease | None = None  # where `uid` is leased for this sandbox alone (released once all are gone)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Say once per process that a limit is not enforced; repeating it per sandbox is noise."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


class Sandbox:
    """A running sandbox: its daemon client and the way to tear it down."""

    def __init__(self, id: str, client: Any, limits: LimitsReport, path: Path,
                 closer: Callable[[], None]) -> None:
        self.id = id
        self.client = client
        self.limits = limits
        self.path = path
        self._closer = closer
        self._lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []
        self.closed = False

    def exec(self, cmd: str | Sequence[str], timeout: float = 60, cwd: str | None = None,
             env: dict[str, str] | None = None, private_output: bool = False) -> Any:
        return self.client.exec(cmd, timeout=timeout, cwd=cwd, env=env, private_output=private_output)

    def read_file(self, path: str) -> bytes:
        return self.client.read_file(path)

    def write_file(self, path: str, data: bytes | str) -> Any:
        return self.client.write_file(path, data)

    def upload(self, *args: Any, **kwargs: Any) -> Any:
        return self.client.upload(*args, **kwargs)

    def close(self) -> None:
        """Stop the daemon, kill every process, remove the dirs and cgroups. Safe to call twice."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self._closer()
        finally:
            for fn in self._on_close:
                fn()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn` after the sandbox is torn down (a pool frees its slot this way)."""
        self._on_close.append(fn)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, path={str(self.path)!r}, closed={self.closed})"


class SandboxBackend(Protocol):
    name: str
    state_dir: Path

    def create(self, spec: SandboxSpec) -> Sandbox: ...


def src_dir() -> Path:
    """The dir holding the `burstrl` package, mounted read-only as the daemon's code."""
    return Path(burstrl.__file__).resolve().parent.parent


def daemon_argv(python: str = "python3", fds: tuple[int, int] | None = None,
                detach_stdio: bool = False) -> list[str]:
    """The daemon's command line. Its commands' base env comes as JSON in SANDBOXD_ENV
    (`namespace.daemon_env`), never from the daemon's own env (no `--inherit-env`).

    `fds` (listening socket, token pipe) as inherited by the daemon: the socket then exists only
    on the host and nothing of it is mounted inside; without them the daemon makes its socket in
    the bound socket dir and reads the token file there (runtimes that cannot pass fds: runsc).
    `detach_stdio`: once the ready line is out the daemon's stdio are the sandbox's /dev/null, for a
    runtime whose commands can open the daemon's fds (runsc; see `_DETACH`).
    """
    if fds is not None:
        where = ["--listen-fd", str(fds[0]), "--token-fd", str(fds[1])]
    else:
        where = ["--socket", f"{RUN_MOUNT}/{SOCKET_NAME}", "--token-file", f"{RUN_MOUNT}/{TOKEN_NAME}"]
    return [python, "-I", "-c", _BOOTSTRAP, *([DETACH_FLAG] if detach_stdio else []), *where]


class Handover:
    """The daemon's listening socket, made on the host, and a pipe holding its token: inherited
    by the sandbox's entry process (fds >= 10, so a runtime can move them to 3 and 4 without a
    clash), closed here once the daemon has them.

    Why: a socket the daemon made in a dir mounted inside is a file its commands (same uid) can
    unlink and replace with their own server; a socket made here is not in the sandbox at all.
    """

    def __init__(self, run: Path, token: str) -> None:
        path = run / SOCKET_NAME
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))  # in `run` (0700): no one else reaches it before the chmod
        os.chmod(path, 0o600)  # never os.umask: it is process-wide, and other threads make sandboxes
        listener.listen(128)
        read, write = os.pipe()
        os.write(write, token.encode())
        os.close(write)
        self.fds = (fcntl.fcntl(listener.fileno(), fcntl.F_DUPFD, 10), fcntl.fcntl(read, fcntl.F_DUPFD, 10))
        listener.close()
        os.close(read)
        for fd in self.fds:
            os.set_inheritable(fd, True)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = (-1, -1)


def trusted_client(path: Path, token: str) -> Any:
    """A client bound to the listener at `path` as it is now, before any command runs: every
    later connection checks its pid (SO_PEERCRED), so a socket swapped in is refused instead of
    believed. (With a `Handover` the listener is ours and the socket never inside; where the
    daemon made it, it is the daemon.)"""
    from burstrl.sandbox.client import SandboxClient, socket_peer

    pid, uid, _ = socket_peer(str(path))
    return SandboxClient(socket_path=str(path), token=token, expected_pid=pid, expected_uid=uid)


def make_run_dir(path: Path, token_file: bool = True) -> tuple[Path, str]:
    """The per-sandbox socket dir and a fresh token, written there (0600) if `token_file`: for
    a runtime whose daemon makes its socket in this dir, bound at /run/sandbox."""
    run = path / "run"
    run.mkdir(mode=0o700)
    token = os.urandom(24).hex()
    if token_file:
        fd = os.open(run / TOKEN_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
    sock = run / SOCKET_NAME
    if len(str(sock)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {sock} is longer than {MAX_SOCKET_PATH} bytes; "
                         "use a shorter state_dir")
    return run, token


def remove_tree(path: Path) -> None:
    """rmtree that also removes what sandboxed code made unwritable (chmod 000 dirs)."""
    def fix(func: Callable[..., Any], p: str, _exc: Any) -> None:
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
            shutil.rmtree(p, ignore_errors=True)
        else:
            func(p)
    if not path.exists():
        return
    work = path / "work"
    if os.path.ismount(work):  # an overlay /work (namespace backend): unmount, never delete through it
        subprocess.run(["umount", "-l", str(work)], capture_output=True)
    try:
        shutil.rmtree(path, onerror=fix)
    except PermissionError:
        if os.geteuid() == 0:
            raise
        _remove_subordinate(path)


def _remove_subordinate(path: Path) -> None:
    """An ordinary user's sandbox dir left with files of its subordinate uid (a harness that died
    before its close): removed from a user namespace mapping the user's subordinate ids."""
    from burstrl.sandbox.backends import subids

    found = subids.detect()
    err = subids.remove_owned(path, found.sub) if found.sub is not None else found.why
    if path.exists():
        raise PermissionError(f"cannot remove {path}: {err}")


class SandboxNotGone(RuntimeError):
    """A sandbox's close could not end every process of it: `pids` (host pids) are still there.
    Everything else of the sandbox is removed; what is left is for an operator to look at."""

    def __init__(self, sid: str, pids: list[int]) -> None:
        super().__init__(f"sandbox {sid}: processes still running after close: {pids}")
        self.pids = pids
