"""The seccomp deny-list (issue 15, defect 10): its numbers against the kernel headers, the BPF
program run through a small interpreter for both arches, the OCI profile's shape, and the real
filter installed in a child process, where denied calls fail with EPERM and ordinary work runs.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from burstrl.sandbox.backends import seccomp, seccomp_rules
from burstrl.sandbox.backends.seccomp import (
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    bpf_program,
    oci_profile,
    syscall_numbers,
    write_program_fd,
)
from burstrl.sandbox.backends.seccomp_rules import CLONE_NS_FLAGS, DENIED

AUDIT = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
GETPID = {"x86_64": 39, "aarch64": 172}
TABLES = {"x86_64": seccomp._X86_64, "aarch64": seccomp._AARCH64}
X86_HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
GENERIC_HEADER = Path("/usr/include/asm-generic/unistd.h")
HOST = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
EPERM, ENOSYS = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS


def run_bpf(prog: bytes, nr: int, arch: int, arg0: int = 0, args: tuple[int, ...] = ()) -> int:
    """Evaluate the filter on one seccomp_data (args[0..5]; `arg0` alone for short), with only the
    opcodes the module emits."""
    full = (list(args) if args else [arg0]) + [0] * 6
    data = struct.pack("<iIQ6Q", nr, arch, 0, *full[:6])
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def header_numbers(path: Path) -> dict[str, int]:
    text = path.read_text()
    nums = {n: int(v) for n, v in re.findall(r"#define __NR_(\w+)\s+(\d+)\b", text)}
    for n, alias in re.findall(r"#define __NR_(\w+)\s+__NR3264_(\w+)", text):
        m = re.search(rf"#define __NR3264_{alias}\s+(\d+)", text)
        if m:
            nums[n] = int(m.group(1))
    return nums


def test_deny_list_is_unique_and_covers_the_essentials() -> None:
    assert len(set(DENIED)) == len(DENIED)
    for name in ("keyctl", "add_key", "bpf", "ptrace", "mount", "unshare", "setns",
                 "userfaultfd", "io_uring_setup", "open_by_handle_at", "kexec_load"):
        assert name in DENIED
    assert "personality" not in DENIED
    assert set(DENIED) <= set(seccomp._X86_64)
    missing = set(DENIED) - set(seccomp._AARCH64)
    assert missing == {"create_module", "get_kernel_syms", "query_module", "uselib", "ustat",
                       "sysfs", "_sysctl", "iopl", "ioperm"}


@pytest.mark.skipif(not X86_HEADER.exists(), reason="no x86_64 kernel uapi header")
def test_x86_64_numbers_match_header() -> None:
    nums = header_numbers(X86_HEADER)
    assert {n: nums.get(n) for n in seccomp._X86_64} == seccomp._X86_64


@pytest.mark.skipif(not GENERIC_HEADER.exists(), reason="no asm-generic unistd.h")
def test_aarch64_numbers_match_asm_generic_header() -> None:
    nums = header_numbers(GENERIC_HEADER)
    assert {n: nums.get(n) for n in seccomp._AARCH64} == seccomp._AARCH64


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_program_structure(arch: str) -> None:
    prog = bpf_program(arch)
    assert len(prog) % 8 == 0
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    x32 = 1 if arch == "x86_64" else 0
    rules = seccomp.enforced(arch)  # one JEQ per enforced line of the table, then ALLOW
    dispatch = insns[4 + x32:4 + x32 + len(rules)]
    assert [(code, k) for code, _, _, k in dispatch] == [(0x15, TABLES[arch][r.syscall]) for r in rules]
    assert insns[4 + x32 + len(rules)] == (0x06, 0, 0, RET_ALLOW)
    assert insns[0] == (0x20, 0, 0, 4)  # load arch
    assert insns[1] == (0x15, 1, 0, AUDIT[arch])
    assert insns[2] == (0x06, 0, 0, RET_KILL_PROCESS)
    assert insns[3] == (0x20, 0, 0, 0)  # load nr
    rets = []  # the program ends with ALLOW and one RET per errno used, for the condition blocks
    while insns[-1 - len(rets)][0] == 0x06:
        rets.append(insns[-1 - len(rets)][3])
    assert {RET_ALLOW, EPERM, ENOSYS} <= set(rets) and len(set(rets)) == len(rets)
    for i, (code, jt, jf, _) in enumerate(insns):  # every jump lands inside the program
        assert code == 0x06 or i + 1 + max(jt, jf) < len(insns)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_program_semantics(arch: str) -> None:
    prog, audit, table = bpf_program(arch), AUDIT[arch], TABLES[arch]
    for nr in syscall_numbers(arch).values():
        assert run_bpf(prog, nr, audit) == EPERM
    assert run_bpf(prog, GETPID[arch], audit) == RET_ALLOW
    assert run_bpf(prog, GETPID[arch], 0x40000003) == RET_KILL_PROCESS  # i386 / other ABI
    assert run_bpf(prog, table["clone3"], audit) == ENOSYS
    assert run_bpf(prog, table["clone"], audit, 0x01200011) == RET_ALLOW  # glibc fork()
    assert run_bpf(prog, table["clone"], audit, 0x003D0F00) == RET_ALLOW  # pthread_create
    for bit in range(32):
        if CLONE_NS_FLAGS >> bit & 1:
            assert run_bpf(prog, table["clone"], audit, 0x11 | 1 << bit) == EPERM
    assert run_bpf(prog, GETPID[arch] | 0x40000000, audit) == (EPERM if arch == "x86_64"
                                                               else RET_ALLOW)


def test_unsupported_arch_raises() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'riscv64'"):
        bpf_program("riscv64")
    with pytest.raises(ValueError):
        oci_profile("s390x")
    assert bpf_program("amd64") == bpf_program("x86_64")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_oci_profile_shape(arch: str) -> None:
    prof = oci_profile(arch)
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW"
    assert prof["architectures"] == (["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
                                     if arch == "x86_64" else ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"])
    first = prof["syscalls"][0]
    assert first == {"names": list(syscall_numbers(arch)), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    assert prof["syscalls"][1] == {"names": [n for n in seccomp_rules.ENOSYS_DENIED if n in TABLES[arch]],
                                   "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}
    assert "clone3" in prof["syscalls"][1]["names"]
    clone_rules = [r for r in prof["syscalls"] if r["names"] == ["clone"]]
    assert sum(r["args"][0]["value"] for r in clone_rules) == CLONE_NS_FLAGS
    for r in clone_rules:
        (cond,) = r["args"]
        assert r["names"] == ["clone"] and r["errnoRet"] == errno.EPERM
        assert cond["op"] == "SCMP_CMP_MASKED_EQ" and cond["value"] == cond["valueTwo"]
    json.dumps(prof)  # goes straight into config.json


def test_write_program_fd_holds_the_program() -> None:
    fd = write_program_fd()
    try:
        assert not os.get_inheritable(fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.read(fd, 1 << 16) == bpf_program()
    finally:
        os.close(fd)


# Runs in a child: installs the filter from the fd, then reports each call's errno (0: worked).
CHILD = r"""
import ctypes, json, os, subprocess, sys, tempfile, threading
nums, fd = json.loads(sys.argv[1]), int(sys.argv[2])
data = b""
while chunk := os.read(fd, 65536):
    data += chunk
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
buf = ctypes.create_string_buffer(data, len(data))
prog = Fprog(len(data) // 8, ctypes.cast(buf, ctypes.c_void_p))
U = ctypes.c_ulong
assert libc.prctl(38, U(1), U(0), U(0), U(0)) == 0  # PR_SET_NO_NEW_PRIVS
if libc.prctl(22, U(2), ctypes.byref(prog), U(0), U(0)) != 0:  # PR_SET_SECCOMP, MODE_FILTER
    sys.exit(f"prctl(PR_SET_SECCOMP): errno {ctypes.get_errno()}")
def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *(a if isinstance(a, bytes) else ctypes.c_long(a) for a in args))
    if r == 0 and nr == nums["clone"]:
        os._exit(0)
    if r > 0 and nr == nums["clone"]:
        os.waitpid(r, 0)
    return ctypes.get_errno() if r == -1 else 0
out = {
    "keyctl": sc(nums["keyctl"], 0, -3, 0),  # KEYCTL_GET_KEYRING_ID, session keyring
    "add_key": sc(nums["add_key"], b"user", b"burstrl", b"x", 1, -2),
    "mount": sc(nums["mount"], b"none", b"/nonexistent/burstrl", b"tmpfs", 0, 0),
    "clone_newuser": sc(nums["clone"], 0x10000000 | 17, 0, 0, 0, 0),
    "unshare": sc(nums["unshare"], 0x10000000),  # CLONE_NEWUSER
    "clone3": sc(nums["clone3"], 0, 0),
}
if nums["x32"]:
    out["x32_getpid"] = sc(0x40000000 | 39)
out["getpid_ok"] = sc(nums["getpid"]) == 0 and libc.getpid() == os.getpid()
with tempfile.TemporaryDirectory() as d:
    p = os.path.join(d, "f")
    with open(p, "w") as f:
        f.write("hello")
    out["file_ok"] = open(p).read() == "hello"
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork_ok"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
out["exec_ok"] = subprocess.run(["/bin/true"]).returncode == 0
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start(); t.join()
out["thread_ok"] = box == [1]
out["ptrace"] = sc(nums["ptrace"], 0, 0, 0, 0)  # PTRACE_TRACEME: last, had it worked an exec would stop
print(json.dumps(out))
"""


@pytest.mark.skipif(HOST not in ("x86_64", "aarch64") or not sys.platform.startswith("linux"),
                    reason="filter only built for Linux x86_64/aarch64")
def test_filter_installed_in_a_child_denies_and_allows() -> None:
    table = TABLES[HOST]
    nums = {n: table[n] for n in ("keyctl", "add_key", "unshare", "ptrace", "mount", "clone",
                                  "clone3")}
    nums |= {"getpid": GETPID[HOST], "x32": HOST == "x86_64"}
    fd = write_program_fd()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(nums), str(fd)],
                              check=False, pass_fds=(fd,), capture_output=True, text=True,
                              timeout=30)
    finally:
        os.close(fd)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for name in ("keyctl", "add_key", "unshare", "ptrace", "mount", "clone_newuser"):
        assert out[name] == errno.EPERM, (name, out)
    assert out["clone3"] == errno.ENOSYS
    if HOST == "x86_64":
        assert out["x32_getpid"] == errno.EPERM
    assert out["getpid_ok"] and out["file_ok"] and out["fork_ok"] and out["exec_ok"]
    assert out["thread_ok"]
