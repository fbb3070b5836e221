"""The seccomp filter inside real bubblewrap (issue 15, defect 10; issue 37): with `--seccomp FD`,
code in the sandbox gets EPERM from keyctl, unshare, mount and clone(CLONE_NEWUSER), which bwrap's
user namespace would otherwise allow, ENOSYS from io_setup, and no socket of a family outside the
allow-list (vsock, packet, netlink other than NETLINK_ROUTE), while python, subprocess, git, unix
socketpairs and inet sockets keep working. Then the same policy as an OCI profile under real runc
(libseccomp), where root and runc are available.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from burstrl.sandbox.backends import seccomp
from burstrl.sandbox.backends.seccomp import write_program_fd

BWRAP = shutil.which("bwrap")
PYTHON = shutil.which("python3")
ARCH = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
TABLE = {"x86_64": seccomp._X86_64, "aarch64": seccomp._AARCH64}.get(ARCH)

pytestmark = [
    pytest.mark.skipif(BWRAP is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.skipif(TABLE is None, reason=f"no seccomp filter for {ARCH}"),
    pytest.mark.skipif(PYTHON is None, reason="no python3 on PATH"),
]

# Inside the sandbox: errno of each probe (0: it worked), then whether git and a thread run.
PROBE = r"""
import ctypes, json, os, shutil, socket, subprocess, sys, threading
nums = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *(a if isinstance(a, bytes) else ctypes.c_long(a) for a in args))
    if r == 0 and nr == nums["clone"]:
        os._exit(0)
    if r > 0 and nr == nums["clone"]:
        os.waitpid(r, 0)
    return ctypes.get_errno() if r == -1 else 0
def family(f, t, p=0, pair=False):
    try:
        (socket.socketpair if pair else socket.socket)(f, t, p)
        return 0
    except OSError as e:
        return e.errno
ctx = ctypes.c_ulong(0)
out = {
    "keyctl": sc(nums["keyctl"], 0, -3, 0),
    "mount": sc(nums["mount"], b"none", b"/tmp", b"tmpfs", 0, 0),
    "clone_newuser": sc(nums["clone"], 0x10000000 | 17, 0, 0, 0, 0),
    "unshare": sc(nums["unshare"], 0x10000000),
    "io_setup": sc(nums["io_setup"], 1, ctypes.addressof(ctx)),
    "vsock": family(40, socket.SOCK_STREAM),
    "vsock_pair": family(40, socket.SOCK_STREAM, pair=True),
    "packet": family(17, socket.SOCK_DGRAM),
    "netlink_diag": family(16, socket.SOCK_RAW, 4),
    "netlink_route": family(16, socket.SOCK_RAW, 0),
    "unix_pair": family(socket.AF_UNIX, socket.SOCK_STREAM, pair=True),
    "inet": family(socket.AF_INET, socket.SOCK_STREAM),
}
git = shutil.which("git")
out["git"] = git is None or b"git version" in subprocess.run([git, "--version"], capture_output=True).stdout
out["true"] = subprocess.run(["true"]).returncode
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start(); t.join()
out["thread"] = box == [1]
print(json.dumps(out))
"""

NUMS = json.dumps({n: TABLE[n] for n in ("keyctl", "mount", "clone", "unshare", "io_setup")} if TABLE else {})
# Issue 37: refused with these errnos (runsc, whose sentry answers every refusal with EPERM, is not
# run here); the allowed families must still work.
REFUSED = {"io_setup": errno.ENOSYS, "vsock": errno.EAFNOSUPPORT, "vsock_pair": errno.EAFNOSUPPORT,
           "packet": errno.EAFNOSUPPORT, "netlink_diag": errno.EPROTONOSUPPORT}
ALLOWED = ("netlink_route", "unix_pair", "inet")


def root_binds() -> list[str]:
    """The host's top-level directories read-only, but not /tmp, /run and the kernel's: `--ro-bind / /`
    binds every mount below it too, and another test's sandbox mount under /tmp that goes away
    mid-way made bwrap fail ("Can't bind mount /oldroot/ ... No such file or directory")."""
    out: list[str] = []
    for name in sorted(os.listdir("/")):
        path = f"/{name}"
        if name in ("tmp", "run", "proc", "dev", "sys"):
            continue
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    return out


def tmp_binds() -> list[str]:
    """The probe's interpreter where it lives under /tmp (a clean clone's venv), read-only."""
    out: list[str] = []
    for path in sorted({sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.abspath(PYTHON)))}):
        if path.startswith("/tmp/"):
            out += ["--ro-bind", path, path]
    return out


def bwrap(*extra: str, pass_fds: tuple[int, ...] = ()) -> dict:
    argv = [BWRAP, "--unshare-all", "--die-with-parent", *root_binds(), "--dev", "/dev",
            "--proc", "/proc", "--tmpfs", "/tmp", *tmp_binds(), *extra, PYTHON, "-c", PROBE, NUMS]
    proc = subprocess.run(argv, check=False, pass_fds=pass_fds, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_bwrap_without_filter_allows_the_probes() -> None:
    """The control: bwrap's own namespaces leave these calls open, so the filter is what denies."""
    out = bwrap()
    if all(out[n] != 0 for n in ("keyctl", "mount", "clone_newuser", "unshare")):
        pytest.skip(f"this host already refuses every probe without the filter: {out}")
    assert out["git"] is True and out["thread"] is True


def test_bwrap_with_filter_denies_and_keeps_tools_working() -> None:
    fd = write_program_fd()
    try:
        out = bwrap("--seccomp", str(fd), pass_fds=(fd,))
    finally:
        os.close(fd)
    for name in ("keyctl", "mount", "clone_newuser", "unshare"):
        assert out[name] == errno.EPERM, (name, out)
    assert {n: out[n] for n in REFUSED} == REFUSED
    assert {n: out[n] for n in ALLOWED} == dict.fromkeys(ALLOWED, 0)
    assert out["git"] is True
    assert out["true"] == 0
    assert out["thread"] is True


def test_program_fd_is_read_once_per_launch() -> None:
    """bwrap consumes the fd to EOF; a second launch needs a fresh fd (or an lseek back to 0)."""
    fd = write_program_fd()
    try:
        bwrap("--seccomp", str(fd), pass_fds=(fd,))
        assert os.lseek(fd, 0, os.SEEK_CUR) == len(seccomp.bpf_program())
        os.lseek(fd, 0, os.SEEK_SET)
        assert bwrap("--seccomp", str(fd), pass_fds=(fd,))["keyctl"] == errno.EPERM
    finally:
        os.close(fd)


def runc(tmp: Path, profile: dict | None) -> dict | str:
    """Run PROBE in a runc container (host /usr, /etc, ... bound read-only): its report, or
    runc's stderr when the container did not run."""
    (tmp / "rootfs").mkdir(exist_ok=True)
    subprocess.run(["runc", "spec"], cwd=tmp, check=True, capture_output=True)
    (tmp / "config.json").rename(tmp / "default.json")
    config = json.loads((tmp / "default.json").read_text())
    config["root"] = {"path": "rootfs", "readonly": True}
    config["process"].update(terminal=False, args=["/usr/bin/python3", "-c", PROBE, NUMS])
    config["mounts"] += [{"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro"]}
                         for d in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc")
                         if os.path.exists(d)]
    if profile is not None:
        config["linux"]["seccomp"] = profile
    (tmp / "config.json").write_text(json.dumps(config))
    name, root = f"burstrl-seccomp-{uuid.uuid4().hex[:8]}", str(tmp / "state")
    try:
        proc = subprocess.run(["runc", "--root", root, "run", "--bundle", str(tmp), name],
                              check=False, capture_output=True, text=True, timeout=30)
    finally:
        subprocess.run(["runc", "--root", root, "delete", "--force", name], capture_output=True,
                       check=False)
    (tmp / "config.json").unlink()
    return json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr


@pytest.mark.skipif(shutil.which("runc") is None, reason="runc is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="the bundle here is a rootful one")
@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="no /usr/bin/python3")
def test_runc_with_oci_profile_denies(tmp_path: Path) -> None:
    control = runc(tmp_path, None)
    if isinstance(control, str):
        pytest.skip(f"runc cannot run a container here: {control.strip()[-300:]}")
    out = runc(tmp_path, seccomp.oci_profile())
    assert isinstance(out, dict), out
    for name in ("keyctl", "mount", "clone_newuser", "unshare"):
        assert out[name] == errno.EPERM, (name, out)
    assert {n: out[n] for n in REFUSED} == REFUSED  # libseccomp compiled the family rules as meant
    assert {n: out[n] for n in ALLOWED} == dict.fromkeys(ALLOWED, 0)
    assert out["git"] is True and out["true"] == 0 and out["thread"] is True
