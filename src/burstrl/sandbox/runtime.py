"""Execute sandbox requests in-process: commands, file reads and writes, tar uploads.

The daemon is a thin HTTP shell over `Runtime`; tests and local tools can use it directly.
Standard library only (it runs inside sandbox images that hold nothing but a Python 3).

Commands. Each runs in a new process group (session) with stdin on /dev/null, a minimal default env
(never the daemon's own: it may hold the token) and the requested cwd. Both streams are read
concurrently with a selector and capped per stream, keeping the head and the tail; the cap counts
the bytes the text takes on the wire, JSON-escaped (see `output.OutputCapture`), not the raw bytes.
On timeout the whole process group is SIGKILLed and the partial output returned. When the command's
leader exits, output is read for a short grace (`EXIT_GRACE_S`) until both pipes close, then the
whole group is SIGKILLed: a command that leaves background children behind (`sleep 100 &`) returns
as soon as it exits, and no process outlives the request that started it. That is the choice: every
exec is self-contained; a process that must persist across requests has to escape with `setsid`
(and then lives until the sandbox is torn down).

Private output. A command's stdout and stderr are pipes, and any process of the sandbox's uid may
reopen a pipe through /proc/<pid>/fd/N of a process holding it (the `sh -c` wrapper; under gVisor
the daemon itself, before commands got a pid namespace of their own: `cmdns`) and write into what
the caller reads. An exec with `private_output` gets the
two ends of unix socket pairs instead, which /proc cannot reopen (ENXIO) and pidfd_getfd may not
take (seccomp), so only the command and its children write there. Pipes stay the default: with a
socket, `echo > /dev/stdout` fails (ENXIO), which ordinary scripts do. The grader's sealed run,
whose verdict line is read from stdout, is private.

Files. Paths must resolve (symlinks followed) inside `root`; anything else is a 400. `root` is "/"
inside a real sandbox, whose own walls do the isolating; in tests it is a temp dir. Relative paths
and cwds are taken from `work_dir`. The checks (regular files only, archive members that stay
inside `dest`) are in `files`.

Retries. An exec with a `request_id` already seen returns the recorded result instead of running
again; one still running is waited for. So a client that retries after a dropped connection never
runs a command twice. The kept results are bounded by count and by bytes (`RESULT_BYTES`, oldest
dropped first: a thousand 1 MB outputs would otherwise OOM the daemon); an id whose result was
dropped answers 410, never a second run.

Environment. Every command gets `DEFAULT_ENV`, overlaid by the base env the daemon was started with
(the sandbox spec's and the image's `Env`), overlaid by the request's `env`; nothing else but the
PWD its shell sets (the shell's OLDPWD is unset). Backends hand the base env over as JSON
(SANDBOXD_ENV), never as the daemon's own environment, which a runtime may add to.

Protection (what an unprivileged daemon can do against its own commands). Given the commands'
cgroup.procs (`cgroup_fd`, opened by the harness), every command moves itself into the commands'
own memory cgroup before anything else (`guard.ENTER_CGROUP`): an OOM there never picks the daemon.
Commands also start with `oom_score_adj` 1000, so the OOM killer picks them before the daemon (the
daemon cannot lower its own score without CAP_SYS_RESOURCE; a command may lower its own back to 0,
which a pid 1 daemon undoes within half a second: `guard.reassert_oom_scores`); without that cgroup
this is the only protection, and a crowd of commands that keep lowering theirs defeats it. When the
daemon is pid 1 of its pid namespace, no signal from inside the namespace can kill it (`kill -9 -1`
included) and it reaps the orphans there.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import select
import selectors
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Set, Tuple, Union

from burstrl.sandbox import files
from burstrl.sandbox.cmdns import CommandNamespace
from burstrl.sandbox.files import check_member, decode_content, extract_member, inside, open_regular, os_errors
from burstrl.sandbox.guard import ENTER_CGROUP, ENTER_CGROUP_PY, cgroup_actions, no_inherited_fds, own_cgroup_fd
from burstrl.sandbox.output import OutputCapture
from burstrl.sandbox.protocol import (
    ExecRequest,
    ExecResult,
    ProtocolError,
    ReadFileRequest,
    ReadFileResult,
    UploadRequest,
    UploadResult,
    WriteFileRequest,
    WriteFileResult,
)

DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
EXIT_GRACE_S = 0.05  # reading after the leader exited, for output still in flight from children
POLL_S = 0.05  # leader-exit polling where pidfd_open is missing (Python < 3.9 or old kernels)
READ_CHUNK = 65536
RECENT_RESULTS = 1024
RESULT_BYTES = 32 * 1024 * 1024  # total output kept for retries; the oldest results go first
DROPPED_IDS = 65536  # ids whose result was dropped, remembered so a retry answers 410, not a re-run
# Run first in every shell command: the OOM killer then picks the command, not the daemon. Raising
# one's own score needs no privilege; a missing /proc only loses the protection.
OOM_PREFIX = "{ echo 1000 >/proc/self/oom_score_adj; } 2>/dev/null; "
SHELL = "/bin/sh"
# `cd` exports OLDPWD (the daemon's cwd): no variable of the daemon's reaches a command (issue 49).
CD_UNSET = "unset OLDPWD; "
# Without a shell in the image: enter the cgroup (if argv[1] is "1"), the cwd, raise the score, exec
# (argv: "1" or "", cwd, path, program argv).
NO_SHELL_ENTER = ("import os, sys\n" + ENTER_CGROUP_PY +
                  "try:\n    open('/proc/self/oom_score_adj', 'w').write('1000')\n"
                  "except OSError:\n    pass\n"
                  "os.chdir(sys.argv[2])\n"
                  "os.execv(sys.argv[3], sys.argv[4:])\n")
# Ignored by the daemon (Python ignores SIGPIPE; pid 1 the signals a command could send it) and
# inherited as ignored across exec unless reset: a command starts with every default instead.
RESET_SIGNALS = tuple(sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}))
DRAIN_CHUNKS = 64  # after a kill, read at most this many chunks still buffered in a pipe


class _Recorded:
    """A request id's outcome; `done` is set once the first run finished (or failed)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Optional[ExecResult] = None
        self.error: Optional[ProtocolError] = None
        self.size = 0  # bytes of output held, counted once done


class Runtime:
    """Runs requests against this machine (or sandbox); thread-safe, one per daemon."""

    def __init__(self, root: str = "/", work_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                 base_env: Optional[Dict[str, str]] = None, cgroup_fd: Optional[int] = None,
                 cmdns: Optional[CommandNamespace] = None):
        """`env` replaces `DEFAULT_ENV`; `base_env` (the spec's and image's env) overlays it;
        `cgroup_fd`: the commands' cgroup.procs, open for writing (taken over: see the docstring);
        `cmdns`: where commands start, if not as the daemon's own children (gVisor: `cmdns`)."""
        self.root = os.path.realpath(root)
        self.work_dir = os.path.realpath(work_dir) if work_dir else self.root
        self.env = dict(DEFAULT_ENV if env is None else env, **(base_env or {}))
        self.env.setdefault("HOME", self.work_dir)
        self._lock = threading.Lock()
        self._recent: "OrderedDict[str, _Recorded]" = OrderedDict()
        self._dropped: "OrderedDict[str, None]" = OrderedDict()
        self._kept_bytes = 0
        self._running: Set[int] = set()
        self._cgroup_fd = own_cgroup_fd(cgroup_fd)
        self._cmdns = cmdns

    # ---- commands ----

    def exec(self, req: ExecRequest) -> ExecResult:
        """Run `req` once per request id (see the module docstring); errors are ProtocolErrors."""
        if req.request_id is None:
            return self._run(req)
        rec, first = self._claim(req.request_id)
        if not first:
            rec.done.wait()
            if rec.error is not None:
                raise rec.error
            assert rec.result is not None
            return rec.result
        try:
            rec.result = self._run(req)
        except ProtocolError as exc:
            rec.error = exc
            raise
        except Exception as exc:
            rec.error = ProtocolError(500, f"exec failed: {exc}")
            raise
        finally:
            rec.done.set()
            self._account(req.request_id, rec)
        return rec.result

    def close(self) -> None:
        """Kill the process group of every command still running (the daemon is going away)."""
        with self._lock:
            groups = list(self._running)
        for pgid in groups:
            _kill_group(pgid)

    def _claim(self, request_id: str) -> Tuple[_Recorded, bool]:
        with self._lock:
            if request_id in self._dropped:
                raise ProtocolError(410, f"request id '{request_id}' already ran and its result was dropped "
                                         "from memory; it is not run again")
            rec = self._recent.get(request_id)
            if rec is not None:
                self._recent.move_to_end(request_id)
                return rec, False
            rec = self._recent[request_id] = _Recorded()
            self._evict()
            return rec, True

    def _account(self, request_id: str, rec: _Recorded) -> None:
        """Count a finished result's bytes, then drop the oldest finished results over the bounds."""
        res = rec.result
        size = len(res.stdout) + len(res.stderr) if res is not None else 0
        with self._lock:
            if self._recent.get(request_id) is rec:
                rec.size = size
                self._kept_bytes += size
            self._evict()

    def _evict(self) -> None:
        """Drop finished results, oldest first, while over RECENT_RESULTS or RESULT_BYTES (lock held).

        A running entry is kept (its retry must wait for it, not run it again); a waiter already
        holding a dropped entry still gets its result by reference.
        """
        for request_id in list(self._recent):
            if len(self._recent) <= RECENT_RESULTS and self._kept_bytes <= RESULT_BYTES:
                return
            rec = self._recent[request_id]
            if not rec.done.is_set():
                continue
            del self._recent[request_id]
            self._kept_bytes -= rec.size
            self._dropped[request_id] = None
            while len(self._dropped) > DROPPED_IDS:
                self._dropped.popitem(last=False)

    def _run(self, req: ExecRequest) -> ExecResult:
        cwd = self._cwd(req.cwd)
        env = dict(self.env, **(req.env or {}))
        start = time.monotonic()
        argv = _command_argv(req.cmd, env, cwd, move=self._cgroup_fd is not None)
        if isinstance(argv, OSError):  # like a shell: 127 when not found, 126 when not executable
            code = 127 if argv.errno == errno.ENOENT else 126
            return ExecResult(stdout="", stderr=f"{req.cmd[0]}: {argv.strerror}\n", exit_code=code,
                              duration_s=time.monotonic() - start)
        ours, theirs = _output_channels(req.private_output)
        try:
            with self._lock:  # a pid 1 reaper must never reap a leader before it is in _running
                pid, exit_fd = self._start(argv, env, theirs)
                self._running.add(pid)
        except OSError as exc:  # e.g. EAGAIN: the sandbox's process limit, reached by its own commands
            for fd in ours:
                os.close(fd)
            code = 127 if exc.errno == errno.ENOENT else 126
            return ExecResult(stdout="", stderr=f"{argv[0]}: {exc.strerror}\n", exit_code=code,
                              duration_s=time.monotonic() - start)
        finally:
            for fd in theirs:
                os.close(fd)
        try:
            out, err, timed_out = _collect(pid, ours, start + req.timeout, req.max_output_bytes, exit_fd)
        finally:
            _kill_group(pid)  # leader not reaped yet, so the group id cannot have been reused
            status = os.waitpid(pid, 0)[1] if exit_fd is None else self._cmdns.reap(pid, exit_fd)  # type: ignore[union-attr]
            with self._lock:
                self._running.discard(pid)
        stdout, stderr = out.text(), err.text()  # first: fitting the wire may elide more
        return ExecResult(stdout=stdout, stderr=stderr, exit_code=_exit_code(status), timed_out=timed_out,
                          truncated=bool(out.elided or err.elided), stdout_elided_bytes=out.elided,
                          stderr_elided_bytes=err.elided, duration_s=time.monotonic() - start)

    def _start(self, argv: List[str], env: Dict[str, str], fds: Tuple[int, int]) -> Tuple[int, Optional[int]]:
        """(pid, None) of a child of ours, or (pid, exit fd) of one the commands' namespace started."""
        if self._cmdns is None:
            return _spawn(argv, env, fds, self._cgroup_fd), None
        return self._cmdns.spawn(argv, env, [*fds, *([] if self._cgroup_fd is None else [self._cgroup_fd])])

    def reap_orphans(self) -> int:
        """Reap exited children no request waits for; returns how many.

        Why: a daemon that is pid 1 of its namespace inherits every orphan there (`cmd &`), and
        unreaped zombies hold pids until fork fails. Leaders in `_running` are left to their request.
        """
        reaped = 0
        while True:
            with self._lock:
                try:
                    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    return reaped
                if info is None or info.si_pid == 0 or info.si_pid in self._running:
                    return reaped
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(info.si_pid, os.WNOHANG)
                reaped += 1

    def _cwd(self, cwd: Optional[str]) -> str:
        path = self.work_dir if cwd is None else os.path.join(self.work_dir, cwd)
        if not os.path.isdir(path):
            raise ProtocolError(400, f"field 'cwd': no such directory '{cwd}'")
        return path

    # ---- files ----

    def read_file(self, req: ReadFileRequest) -> ReadFileResult:
        """The first `max_bytes` of a regular file, base64-encoded."""
        real = self.resolve(req.path)
        with os_errors(req.path):
            fd = open_regular(req.path, real, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                data = f.read(req.max_bytes + 1)
        truncated = len(data) > req.max_bytes
        data = data[:req.max_bytes]
        return ReadFileResult(path=real, content_b64=base64.b64encode(data).decode("ascii"),
                              size=max(st.st_size, len(data)), truncated=truncated)

    def write_file(self, req: WriteFileRequest) -> WriteFileResult:
        """Write (create or truncate) a file with `mode`, creating parent directories if asked."""
        real = self.resolve(req.path)
        data = decode_content(req)
        with os_errors(req.path):
            if req.mkdir:
                os.makedirs(os.path.dirname(real), exist_ok=True)
            fd = open_regular(req.path, real, os.O_WRONLY | os.O_CREAT, req.mode)
            try:
                os.ftruncate(fd, 0)  # only now: a fifo or device must never be truncated or written
                os.fchmod(fd, req.mode)  # the umask and an existing file's mode must not win
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        return WriteFileResult(path=real, size=len(data))

    def upload(self, req: UploadRequest) -> UploadResult:
        """Unpack a tar archive into `dest`; no member may land or link outside `dest`."""
        import io
        import tarfile  # lazy: most sandboxes never upload, and the daemon's start time counts

        dest = self.resolve(req.dest)
        try:
            with tarfile.open(fileobj=io.BytesIO(req.archive), mode="r:*") as tar:
                members = tar.getmembers()
                for member in members:
                    check_member(member)
                with os_errors(req.dest):
                    os.makedirs(dest, exist_ok=True)
                    for member in members:
                        extract_member(tar, member, dest)
        except tarfile.TarError as exc:
            raise ProtocolError(400, f"bad tar archive: {exc}") from None
        return UploadResult(dest=dest, files=len(members))

    def resolve(self, path: str) -> str:
        """The real path (symlinks followed) of `path`, which must lie inside the root, else 400."""
        real = os.path.realpath(os.path.join(self.work_dir, path))
        if not inside(real, self.root):
            raise ProtocolError(400, f"path '{path}' is outside the sandbox root")
        return real


def _output_channels(private: bool) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((our stdout end, our stderr end), (the command's)): pipes, or for a private exec unix
    socket pairs, each one-way (the command cannot read what we never write, nor we write to it)."""
    ours, theirs = [], []
    for _ in range(2):
        if private:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            a.shutdown(socket.SHUT_WR)
            b.shutdown(socket.SHUT_RD)
            r, w = a.detach(), b.detach()
        else:
            r, w = os.pipe()
        ours.append(r)
        theirs.append(w)
    return (ours[0], ours[1]), (theirs[0], theirs[1])


def _collect(pid: int, fds: Tuple[int, int], deadline: float, limit: int,
             exit_fd: Optional[int] = None) -> Tuple[OutputCapture, OutputCapture, bool]:
    """Read both streams (our ends `fds`, closed here) until they close after the leader exited
    (+ grace) or the deadline passes. `exit_fd` (readable once the leader exited) stands for the
    pidfd of a leader that is not our child."""
    caps = {fds[0]: OutputCapture(limit), fds[1]: OutputCapture(limit)}
    out_fd, err_fd = fds
    sel = selectors.DefaultSelector()
    for fd in caps:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = _pidfd_open(pid) if exit_fd is None else os.dup(exit_fd)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)  # readable once the leader exits
    open_fds = set(caps)
    exited_at: Optional[float] = None
    timed_out = False
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and (_has_exited(pid) if exit_fd is None else _readable(exit_fd)):
                exited_at = now
            if exited_at is not None and (not open_fds or now >= exited_at + EXIT_GRACE_S):
                break
            if now >= deadline:
                timed_out = True
                break
            wait = deadline - now
            if exited_at is not None:
                wait = min(wait, exited_at + EXIT_GRACE_S - now)
            elif pidfd is None:
                wait = min(wait, POLL_S)
            for key, _ in sel.select(wait):
                if key.fd == pidfd:
                    sel.unregister(pidfd)  # level-triggered: it would stay readable forever
                elif not _read_into(key.fd, caps[key.fd]):
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
        _kill_group(pid)
        for fd in open_fds:  # what the killed group had written is still in the pipe buffer
            for _ in range(DRAIN_CHUNKS):
                if not _read_into(fd, caps[fd], drain=True):
                    break
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        os.close(out_fd)
        os.close(err_fd)
    return caps[out_fd], caps[err_fd], timed_out


def _read_into(fd: int, cap: OutputCapture, drain: bool = False) -> bool:
    """Read one chunk; False at EOF (or, when draining, when nothing is left to read now)."""
    try:
        data = os.read(fd, READ_CHUNK)
    except BlockingIOError:
        return not drain
    if not data:
        return False
    cap.feed(data)
    return True


def _has_exited(pid: int) -> bool:
    """Whether the leader has exited, without reaping it (so its group id stays ours to kill)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None and info.si_pid != 0


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _pidfd_open(pid: int) -> Optional[int]:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def _command_argv(cmd: Union[str, List[str]], env: Dict[str, str], cwd: str,
                  move: bool = False) -> Union[List[str], OSError]:
    """The argv to spawn for `cmd`: the shell with a prefix that (if `move`) enters the commands'
    cgroup, enters `cwd` and raises the command's oom_score_adj, then runs the string or execs the
    program. A program that cannot be found or run is the OS's error instead (127/126, as a shell
    reports it), decided here without spawning anything."""
    enter = (ENTER_CGROUP if move else "") + f"cd -- {_quote(os.path.abspath(cwd))} || exit 126; " + CD_UNSET + OOM_PREFIX
    if isinstance(cmd, str):
        return [SHELL, "-c", enter + cmd]
    found = files.find_program(cmd[0], env.get("PATH", ""), cwd)
    if found is None:
        code = errno.EACCES if files.program_exists(cmd[0], env.get("PATH", ""), cwd) else errno.ENOENT
        return OSError(code, os.strerror(code))
    if not os.path.exists(SHELL):  # an image without a shell: the program, entered by `python3 -c`
        return [sys.executable, "-I", "-S", "-c", NO_SHELL_ENTER, "1" if move else "", cwd, found, *cmd]
    return [SHELL, "-c", enter + 'exec "$@"', "sh", *cmd]


def _spawn(argv: List[str], env: Dict[str, str], fds: Tuple[int, int], cgroup_fd: Optional[int] = None) -> int:
    """Start `argv` in a session of its own, stdin on /dev/null, stdout/stderr on `fds`, the cgroup
    fd (if any) at `guard.CGROUP_FD` for the prefix to use and close; its pid.

    posix_spawn, not fork + exec: `subprocess` reports a failed exec through a pipe the daemon holds,
    and under gVisor a command could open the daemon's fds through /proc/1/fd and write there, which
    broke the exec being started (issue 37; under gVisor commands now start from `cmdns`). posix_spawn (glibc: vfork-style) has no such pipe. It
    passes on every fd not close-on-exec, so every one above 2 is marked first (`no_inherited_fds`:
    the daemon's inherited listening socket was one, issue 49); every signal disposition goes back
    to its default (the daemon ignores SIGPIPE, and as pid 1 the signals of `guard.guard_signals`).
    """
    no_inherited_fds()
    return os.posix_spawn(argv[0], argv, env, setsid=True, setsigmask=(), setsigdef=RESET_SIGNALS,
                          file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                        (os.POSIX_SPAWN_DUP2, fds[0], 1), (os.POSIX_SPAWN_DUP2, fds[1], 2),
                                        *cgroup_actions(cgroup_fd)])


def _exit_code(status: int) -> int:
    """A wait status as `subprocess` reports it: the exit code, or minus the killing signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _quote(text: str) -> str:
    """`text` as one single-quoted shell word."""
    return "'" + text.replace("'", "'\\''") + "'"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
