"""The seccomp table of issue 37, checked line by line where no sandbox is needed: each decision
has a reason, the socket family allow-list and the host-wide pools (AIO, mqueue, secretmem,
hugetlb) come out of the BPF program (run through the unit tests' interpreter) and out of the OCI
profile (through a small model of libseccomp's rule matching) as the table says.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest

from burstrl.sandbox.backends import seccomp
from burstrl.sandbox.backends.seccomp import RET_ALLOW, RET_ERRNO
from burstrl.sandbox.backends.seccomp_rules import ALLOW, FAMILIES, RULES
from tests.unit.test_seccomp import AUDIT, TABLES, run_bpf

ARCHES = ["x86_64", "aarch64"]
PTR = 0x7FFD_1234_5678  # a user-space pointer: high and low halves both non-zero
ALLOWED_FAMILIES = {socket.AF_UNIX, socket.AF_INET, socket.AF_INET6}
NETLINK, NETLINK_ROUTE, NETLINK_SOCK_DIAG = 16, 0, 4


def err(name: str) -> int:
    return RET_ERRNO | getattr(errno, name)


def call(arch: str, name: str, *args: int) -> int:
    """The filter's verdict on syscall `name` with `args` on `arch`."""
    return run_bpf(seccomp.bpf_program(arch), TABLES[arch][name], AUDIT[arch], args=args or (0,))


def test_every_decision_is_one_line_with_a_reason() -> None:
    names = [r.syscall for r in RULES]
    assert len(names) == len(set(names)), "one line per syscall"
    for r in RULES:
        assert len(r.reason) > 10, r
        assert r.action == ALLOW or isinstance(getattr(errno, r.action, None), int), r
        if r.action != ALLOW:
            assert r.syscall in seccomp._X86_64, r  # every refusal exists at least on x86_64
    for f in FAMILIES:
        assert len(f.reason) > 10 and (f.action == ALLOW or hasattr(errno, f.action)), f
        if f.number >= 0 and hasattr(socket, f.name.split("/")[0]):
            assert getattr(socket, f.name.split("/")[0]) == f.number, f
    assert {f.number for f in FAMILIES if f.action == ALLOW and f.protocol is None} == ALLOWED_FAMILIES
    assert [f.name for f in FAMILIES].count("*") == 1


def test_the_issue_37_refusals_are_in_the_table() -> None:
    by_name = {r.syscall: r for r in RULES}
    for name in ("io_setup", "io_submit", "io_getevents", "io_destroy", "io_cancel", "io_pgetevents"):
        assert by_name[name].action == "ENOSYS", name
    for name in ("keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
                 "fanotify_init", "acct", "quotactl"):
        assert by_name[name].action == "EPERM", name
    for name in ("inotify_init1", "personality", "msgget"):  # reviewed, kept open
        assert by_name[name].action == ALLOW, name
    vsock = next(f for f in FAMILIES if f.name == "AF_VSOCK")
    assert vsock.number == 40 and vsock.action != ALLOW


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", ["socket", "socketpair"])
def test_bpf_socket_families_are_an_allow_list(arch: str, name: str) -> None:
    for family in range(0, 80):
        for proto in (0, NETLINK_SOCK_DIAG):
            got = call(arch, name, family, socket.SOCK_STREAM, proto)
            if family in ALLOWED_FAMILIES or (family, proto) == (NETLINK, NETLINK_ROUTE):
                assert got == RET_ALLOW, (family, proto)
            elif family == NETLINK:
                assert got == err("EPROTONOSUPPORT"), (family, proto)
            else:
                assert got == err("EAFNOSUPPORT"), (family, proto)
    # the kernel reads an int: high bits neither open nor close a family
    assert call(arch, name, 1 << 32 | socket.AF_UNIX, socket.SOCK_STREAM, 0) == RET_ALLOW
    assert call(arch, name, 1 << 32 | 40, socket.SOCK_STREAM, 0) == err("EAFNOSUPPORT")


@pytest.mark.parametrize("arch", ARCHES)
def test_bpf_host_pools(arch: str) -> None:
    for name in ("io_setup", "io_submit", "io_getevents", "io_destroy", "io_cancel", "io_pgetevents",
                 "mq_open", "memfd_secret"):
        assert call(arch, name, 1, PTR) == err("ENOSYS"), name
    private_anon, hugetlb = 0x22, 0x40000
    assert call(arch, "mmap", 0, 1 << 21, 3, private_anon, -1 & 0xFFFFFFFF, 0) == RET_ALLOW
    assert call(arch, "mmap", 0, 1 << 21, 3, private_anon | hugetlb, -1 & 0xFFFFFFFF, 0) == err("ENOMEM")
    assert call(arch, "memfd_create", PTR, 0x1) == RET_ALLOW  # MFD_CLOEXEC
    assert call(arch, "memfd_create", PTR, 0x1 | 0x4) == err("EINVAL")  # MFD_HUGETLB
    assert call(arch, "shmget", 0, 4096, 0o1000 | 0o600) == RET_ALLOW  # IPC_CREAT
    assert call(arch, "shmget", 0, 4096, 0o1000 | 0o4000) == err("EPERM")  # SHM_HUGETLB


@pytest.mark.parametrize("arch", ARCHES)
def test_bpf_prlimit_only_on_itself(arch: str) -> None:
    nofile = 7
    assert call(arch, "prlimit64", 0, nofile, PTR, PTR) == RET_ALLOW  # its own limits
    assert call(arch, "prlimit64", 1, nofile, 0, PTR) == RET_ALLOW  # reading another's
    assert call(arch, "prlimit64", 1, nofile, PTR, 0) == err("EPERM")
    assert call(arch, "prlimit64", 1, nofile, 1 << 32, 0) == err("EPERM")  # only the high half set


def oci_verdict(profile: dict[str, Any], name: str, args: tuple[int, ...]) -> int | None:
    """The errno a profile gives a call (None: allowed), matching rules as libseccomp does: all
    of a rule's comparisons hold, on the full 64-bit argument."""
    ops = {"SCMP_CMP_MASKED_EQ": lambda a, c: a & c["value"] == c["valueTwo"],
           "SCMP_CMP_NE": lambda a, c: a != c["value"], "SCMP_CMP_GE": lambda a, c: a >= c["value"]}
    full = list(args) + [0] * 6
    for rule in profile["syscalls"]:
        if name in rule["names"] and all(ops[c["op"]](full[c["index"]], c) for c in rule.get("args", [])):
            return rule["errnoRet"]
    return None


@pytest.mark.parametrize("clone_rules", [True, False], ids=["runc", "runsc"])
def test_oci_profile_matches_the_table(clone_rules: bool) -> None:
    prof = seccomp.oci_profile("x86_64", clone_rules=clone_rules)
    for name in ("socket", "socketpair"):
        for family in range(0, 80):
            got = oci_verdict(prof, name, (family, 1, 0))
            assert (got is None) == (family in ALLOWED_FAMILIES or family == NETLINK), (name, family)
        assert oci_verdict(prof, name, (NETLINK, 3, NETLINK_SOCK_DIAG)) == errno.EPROTONOSUPPORT
        assert oci_verdict(prof, name, (40, 1, 0)) == errno.EAFNOSUPPORT
        assert oci_verdict(prof, name, (1 << 32 | 40, 1, 0)) is not None  # high bits: refused too
    assert oci_verdict(prof, "io_setup", (1, PTR)) == errno.ENOSYS
    assert oci_verdict(prof, "mmap", (0, 4096, 3, 0x22 | 0x40000)) == errno.ENOMEM
    assert oci_verdict(prof, "mmap", (0, 4096, 3, 0x22)) is None
    assert oci_verdict(prof, "prlimit64", (1, 7, PTR)) == errno.EPERM
    assert oci_verdict(prof, "prlimit64", (0, 7, PTR)) is None
    assert oci_verdict(prof, "prlimit64", (1, 7, 0)) is None
    assert (oci_verdict(prof, "clone3", (PTR, 88)) == errno.ENOSYS) == clone_rules
