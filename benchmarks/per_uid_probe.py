"""Which per-uid kernel counts a user namespace separates from its owner (issue 49, item 4).

A holder process takes one resource up to its limit and keeps it, started three ways: in no new
namespace ("none"), in a user namespace mapped to our own uid ("own"), and in one whose root is a
subordinate uid ("subuid", needs newuidmap and a range in /etc/subuid and /etc/subgid). Then this
process (same user, outside any namespace) tries to take one more. `harness_ok` false means the
holder's use is charged to our uid. Run as an ordinary user, stdlib only:

    python3 benchmarks/per_uid_probe.py 100000        # the first subordinate uid (and gid) to use

Measured on Linux 6.18 (2026-12-05): pipe pages and key quotas separate with a subordinate uid;
inotify instances, pending signals and processes (RLIMIT_NPROC) never do (ucounts are charged up
to the namespace's owner).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import time

LIBC = ctypes.CDLL(None, use_errno=True)
F_GETPIPE_SZ = 1032
COUNTS = {"inotify": 200, "pipe": 1100, "sigpending": 100_000, "keys": 250, "nproc": 30}


def take(res: str, n: int) -> int:
    """Take up to `n` of `res` (kept until exit); how many were taken."""
    got = 0
    for i in range(n):
        if not _one(res, i):
            break
        got += 1
    return got


def _one(res: str, i: int) -> bool:
    try:
        if res == "inotify":
            return LIBC.inotify_init1(0) >= 0
        if res == "pipe":
            os.pipe()
            return True
        if res == "nproc":
            if os.fork() == 0:
                time.sleep(100)
                os._exit(0)
            return True
        if res == "sigpending":
            return _queue_signal()
        return LIBC.syscall(248, b"user", f"k{os.getpid()}-{i}".encode(), b"x", 1, -2) >= 0  # add_key
    except OSError:
        return False


def _queue_signal() -> bool:
    """rt_sigqueueinfo to ourselves with the signal blocked: it stays pending."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
    info = (ctypes.c_int * 32)()
    info[0], info[2] = signal.SIGRTMIN, -1  # si_signo, si_code = SI_QUEUE
    return LIBC.syscall(129, os.getpid(), signal.SIGRTMIN, info) == 0


def harness_try(res: str) -> bool:
    """Whether we (outside) still get one more of `res` at full size."""
    if res == "pipe":
        _, w = os.pipe()
        return fcntl.fcntl(w, F_GETPIPE_SZ) == 65536  # one page once the uid is past its soft limit
    if res != "nproc":
        return take(res, 1) == 1
    before = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (COUNTS["nproc"] // 2, before[1]))  # below what the holder has
    try:
        return take(res, 1) == 1
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, before)


def probe(res: str, mode: str, sub: int) -> dict[str, object]:
    prefix = {"none": [], "own": ["unshare", "--user", "--map-root-user"],
              "subuid": ["unshare", "--user", f"--map-users={sub},0,1", f"--map-groups={sub},0,1",
                         "--setuid=0", "--setgid=0"]}[mode]
    holder = subprocess.Popen([*prefix, sys.executable, __file__, "--hold", res], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    held = holder.stdout.readline().strip() if holder.stdout else ""
    ok = harness_try(res)
    os.killpg(holder.pid, signal.SIGKILL)  # the holder and what it forked
    holder.wait()
    time.sleep(0.2)  # the forked ones are reaped by init
    return {"res": res, "mode": mode, "held": held, "harness_ok": ok}


def main() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))  # 1100 pipes are 2200 fds
    if sys.argv[1] == "--hold":
        print(take(sys.argv[2], COUNTS[sys.argv[2]]), flush=True)
        time.sleep(100)
        return
    for res in COUNTS:
        for mode in ("none", "own", "subuid"):
            print(json.dumps(probe(res, mode, int(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
