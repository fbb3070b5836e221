"""The commands' own pid namespace (gVisor, issue 49): no command can see or touch the daemon's process.

Why: under runsc the sentry lets any process read /proc/1/environ, maps and auxv of the daemon (pid 1)
and open its fds through /proc/1/fd, whatever its dumpability or uid (runsc 20221219; OCI maskedPaths
are ignored there). What holds is a process that is not in the commands' /proc at all. So:

    daemon (pid 1 of the sandbox, started as the sentry's root with CAP_SYS_ADMIN, CAP_SETUID and
    │       CAP_SETGID only: that root is the sentry's, no host privilege)
    └── spawner (a fork of the daemon before it read its token; outside the commands' namespace)
        ├── init (pid 1 of the commands' pid namespace: a fresh `python3 -I -S` with an empty env,
        │         of a uid of its own (`init_id`); it reaps orphans and ignores every signal)
        └── every command (posix_spawn, in the commands' namespace)

The spawner unshares a pid namespace (gVisor allows that only to a single-threaded process, and a
thread whose children land in another pid namespace can start no thread: hence a process, not a
thread of the daemon), forks the init, which mounts a fresh /proc in place of the sandbox's (the old
one is detached; the daemon keeps an fd of its own fd dir, `guard.hold_fd_dir`), then starts each
command the daemon asks for. Commands therefore see pid 1 = that init and themselves, nothing else:
`kill -9 1` and `kill -9 -1` reach neither the daemon nor the init. The daemon and the spawner then
become `uid`:`gid` (capabilities gone) and install the seccomp filter on themselves (the bundle carries
none: the sentry would apply it to the daemon before the setup, refusing unshare and mount).

The channel (a unix socket pair): the daemon sends `{"argv", "env"}` with the command's stdout, stderr
(and cgroup fd) as SCM_RIGHTS; the spawner answers `{"pid"}` (the pid as the daemon sees it) with the
read end of a pipe that gets the leader's wait status and closes when it exits (what a pidfd gives a
parent), or `{"errno"}`. The leader stays a zombie until the daemon sends `{"reap": pid}`, after its
last kill of the group: a process group id is never reused while the daemon may still signal it.
Standard library only (the daemon imports it inside sandbox images).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from burstrl.sandbox.guard import cgroup_actions, hold_fd_dir, no_inherited_fds

CLONE_NEWPID = 0x20000000
MNT_DETACH = 2
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CAP_VERSION_3 = 0x20080522
HEADER = struct.Struct("!I")
MAX_FDS = 4
STATUS = struct.Struct("i")
KILLED = signal.SIGKILL  # the wait status reported when the spawner is gone (killed by SIGKILL)
# The init: pid 1 of the commands' namespace, exec'd with an empty env and every signal but SIGCHLD
# ignored (SIG_IGN survives exec; CPython installs its SIGINT handler only over SIG_DFL). It reaps
# every orphan of the namespace; with no child left it looks again twice a second.
INIT_CODE = ("import os, time\n"
             "while True:\n"
             "    try:\n        os.wait()\n"
             "    except ChildProcessError:\n        time.sleep(0.5)\n"
             "    except OSError:\n        pass\n")
SIGNALS = tuple(sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}))
IGNORED = tuple(s for s in SIGNALS if s != signal.SIGCHLD)


class CommandNamespace:
    """The daemon's end of the spawner (see the module docstring): thread-safe."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid  # the spawner's
        self._lock = threading.Lock()

    @classmethod
    def start(cls, uid: int, gid: int) -> "CommandNamespace":
        """Fork the spawner (call while single-threaded, holding the capabilities to give it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:  # the spawner: never returns
            ours.close()
            code = 1
            try:
                code = _spawner_main(theirs, uid, gid)
            finally:
                os._exit(code)
        theirs.close()
        return cls(ours, pid)

    def send_filter(self, program: bytes) -> None:
        """Give the spawner its seccomp filter (`install_seccomp`), which it needs before it reports
        ready. Why sent: the file lies in the socket dir, which only `uid` may read and which the
        harness takes back once the daemon is ready."""
        _send(self._sock, {"seccomp": program.hex()}, [])

    def wait_ready(self) -> None:
        """Block until the namespace is made and the spawner serves; OSError with its reason if not.

        Why apart from `start`: the spawner makes the namespace while the daemon imports and reads
        its token; by the daemon's ready line it is (nearly) done.
        """
        msg, _ = _recv(self._sock)
        if msg is None or "ready" not in msg:
            why = (msg or {}).get("error", "the spawner died")
            raise OSError(f"the commands' pid namespace could not be made: {why}")

    def spawn(self, argv: List[str], env: Dict[str, str], fds: List[int]) -> Tuple[int, int]:
        """(pid, exit fd): `argv` started in a session of its own with stdin on /dev/null and `fds`
        as 1, 2 (and guard.CGROUP_FD); OSError as posix_spawn raises it."""
        with self._lock:
            try:
                _send(self._sock, {"argv": argv, "env": env}, fds)
                msg, got = _recv(self._sock)
            except OSError:
                msg, got = None, []
        if msg is None or "pid" not in msg:
            for fd in got:
                os.close(fd)
            code = (msg or {}).get("errno", errno.ENOMEM)  # what fork says when the namespace is gone
            raise OSError(code, os.strerror(code))
        return msg["pid"], got[0]

    def reap(self, pid: int, exit_fd: int) -> int:
        """The leader's wait status (blocks until it exited), then lets the spawner reap it."""
        try:
            data = _read_all(exit_fd)
        finally:
            os.close(exit_fd)
        with self._lock, contextlib.suppress(OSError):
            _send(self._sock, {"reap": pid}, [])
        return STATUS.unpack(data)[0] if len(data) == STATUS.size else KILLED


def _send(sock: socket.socket, msg: Dict[str, object], fds: List[int]) -> None:
    data = json.dumps(msg).encode()
    data = HEADER.pack(len(data)) + data
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv(sock: socket.socket) -> Tuple[Optional[Dict[str, object]], List[int]]:
    """One message and the fds that came with it (close-on-exec); (None, []) at EOF."""
    data, anc, _, _ = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
    fds: List[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]))
    data += _recv_exact(sock, HEADER.size - len(data)) if data else b""
    if len(data) < HEADER.size:
        for fd in fds:
            os.close(fd)
        return None, []
    body = _recv_exact(sock, HEADER.unpack(data)[0])
    return json.loads(body), fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 64)
        except InterruptedError:
            continue
        if not chunk:
            return out
        out += chunk


def fork_early(argv: List[str]) -> Optional[CommandNamespace]:
    """The spawner for a daemon whose `argv` asks for `--commands-ns UID:GID`, forked now (the
    daemon module calls this before its other imports); None for any other daemon."""
    if "--commands-ns" not in argv[:-1]:
        return None
    uid, _, gid = argv[argv.index("--commands-ns") + 1].partition(":")
    no_inherited_fds()  # what the runtime left inheritable must not reach the spawner's commands
    hold_fd_dir()  # the daemon's own fds stay listable once the commands' /proc replaces the sandbox's
    return CommandNamespace.start(int(uid), int(gid))


# ---- the spawner (a process of its own) ----


def _spawner_main(sock: socket.socket, uid: int, gid: int) -> int:
    """Make the namespace and its init, drop to `uid`:`gid` under `seccomp`, serve the daemon."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the runtime's stdio (host pipes) stay with the daemon alone
        os.dup2(null, fd)
    os.close(null)
    try:
        _check(_libc().unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
        _start_init(uid, gid)
        drop_ids(uid, gid)
        msg, _ = _recv(sock)
        install_seccomp(bytes.fromhex(str((msg or {}).get("seccomp", ""))))
    except OSError as exc:
        _send(sock, {"error": str(exc)}, [])
        return 1
    _send(sock, {"ready": True}, [])
    _CommandSpawner(sock).serve()
    return 0


def _start_init(uid: int, gid: int) -> None:
    """Fork pid 1 of the new namespace; return once it mounted the commands' /proc and exec'd the
    reaper (else OSError): until that exec its memory is a copy of the daemon's."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _become_init(w, uid, gid)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into the daemon
            with contextlib.suppress(OSError):
                os.write(w, f"E{exc}".encode())
        os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read()  # "K" once /proc is the namespace's, then EOF at the exec (close-on-exec)
    if why != b"K":
        raise OSError(f"init: {why[1:].decode(errors='replace') or 'died'}")


def _become_init(report: int, uid: int, gid: int) -> None:
    """In the namespace's pid 1: the sandbox's /proc replaced by this namespace's, then `init_id`
    (not root, not the commands': they can neither signal it nor open its /proc files), "K" on
    `report` (close-on-exec), stdio on /dev/null, every other fd closed, and exec the reaper with an
    empty env."""
    import ctypes

    libc = _libc()
    _check(libc.umount2(b"/proc", MNT_DETACH), "umount /proc")
    _check(libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None),
           "mount /proc")
    drop_ids(*init_id(uid, gid))
    os.write(report, b"K")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, report)
    os.closerange(report + 1, 65536)
    for sig in IGNORED:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN)
    os.execve(sys.executable, [sys.executable, "-I", "-S", "-c", INIT_CODE], {})


class _CommandSpawner:
    """The spawner's loop: spawn requests and reaps from the daemon, exits of the leaders it started."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.running: Dict[int, int] = {}  # leader pid -> write end of its exit pipe
        self.zombies: Set[int] = set()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.sock, self.wake_r], [], [], 1.0)
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            self._report_exits()
            if self.sock in ready and not self._serve_one():
                return

    def _serve_one(self) -> bool:
        msg, fds = _recv(self.sock)
        if msg is None:
            return False  # the daemon is gone
        try:
            if "reap" in msg:
                self._reap(int(msg["reap"]))  # type: ignore[arg-type]
            else:
                self._spawn(msg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _spawn(self, msg: Dict[str, object], fds: List[int]) -> None:
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, fds[0], 1), (os.POSIX_SPAWN_DUP2, fds[1], 2),
                   *cgroup_actions(fds[2] if len(fds) > 2 else None)]
        argv, env = msg["argv"], msg["env"]
        try:
            pid = os.posix_spawn(argv[0], argv, env, setsid=True, setsigmask=(),  # type: ignore[index]
                                 setsigdef=SIGNALS, file_actions=actions)
        except OSError as exc:
            _send(self.sock, {"errno": exc.errno or errno.ENOMEM}, [])
            return
        r, w = os.pipe()
        self.running[pid] = w
        try:
            _send(self.sock, {"pid": pid}, [r])
        finally:
            os.close(r)

    def _report_exits(self) -> None:
        for pid in list(self.running):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is None or info.si_pid == 0:
                continue
            status = info.si_status << 8 if info.si_code == os.CLD_EXITED else info.si_status & 0x7F
            w = self.running.pop(pid)
            with contextlib.suppress(OSError):
                os.write(w, STATUS.pack(status))
            os.close(w)
            self.zombies.add(pid)

    def _reap(self, pid: int) -> None:
        if pid in self.zombies:
            self.zombies.discard(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


# ---- privileges ----


def init_id(uid: int, gid: int) -> Tuple[int, int]:
    """The init's ids: neither root (nothing in a sandbox runs as root) nor the commands' `uid`:`gid`
    (a process of their uid they could signal, and gVisor does not shield a namespace's pid 1)."""
    return 65533 if uid != 65533 else 65532, 65533 if gid != 65533 else 65532


def drop_ids(uid: int, gid: int) -> None:
    """Become `uid`:`gid` in every id (no supplementary group) and hold no capability: leaving uid 0
    clears them, and staying uid 0 drops them with capset (no exec follows that could regain them
    other than the init's, whose no_new_privs bounds them by these)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = struct.pack("Ii", CAP_VERSION_3, 0)
    _check(_libc().capset(header, bytes(24)), "capset")


def install_seccomp(program: bytes) -> None:
    """Put the calling thread (and every thread and process it starts later) under `program`, a
    classic BPF filter (`backends.seccomp.bpf_program`): what the bundle gives runc's processes."""
    if not program:
        return
    import ctypes

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    prog = _Prog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def read_bytes(path: Optional[str]) -> bytes:
    """The file's bytes; none for no file."""
    if path is None:
        return b""
    with open(path, "rb") as f:
        return f.read()


def _libc() -> Any:
    """libc through ctypes, imported here: a daemon that never makes the namespace needs neither."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
