"""A seccomp deny-list for sandboxed code, for both backends (issue 15, defect 10).

Why: namespaces and dropped capabilities keep model-written code away from the host's files and
processes, but every syscall still reaches the host kernel. A handful of syscalls are rarely needed
by Python, git, pip, pytest or gcc yet make up much of the kernel's attack surface (keyrings, bpf,
perf, userfaultfd, io_uring, the mount API, module loading, namespace creation) or reach outside
the sandbox (ptrace, process_vm_*, kcmp, pidfd_getfd, handle-based open). Denying them with EPERM,
as Docker's default profile does, costs nothing for real workloads and closes those paths.

Two encodings of the same policy:

* `bpf_program()`: a classic-BPF filter (the raw `struct sock_filter` array) for bubblewrap's
  `--seccomp FD`; `write_program_fd()` puts it in a memfd for `pass_fds`.
* `oci_profile()`: the OCI runtime-spec `linux.seccomp` object; runc compiles it with libseccomp.

Beyond the named deny list, both refuse `clone` with any CLONE_NEW* flag (else denying `unshare`
is moot) and make `clone3` fail with ENOSYS, whose flags live in memory a filter cannot read;
glibc then falls back to `clone` (Docker does the same). The BPF filter also kills a process on
a foreign syscall ABI (i386/arm32 compat) and, on x86_64, refuses every x32 syscall.

Numbers come from the kernel's tables (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64:
include/uapi/asm-generic/unistd.h) and are checked against the installed headers in the tests.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct
import tempfile

__all__ = ["CLONE_NS_FLAGS", "DENIED", "ENOSYS_DENIED", "bpf_program", "oci_profile",
           "write_program_fd"]

DENIED: tuple[str, ...] = (
    # keyrings (not namespaced), bpf, perf, userfaultfd, io_uring: kernel attack surface
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    # reaching other processes, also outside the sandbox
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # new namespaces (clone with CLONE_NEW* is refused separately)
    "unshare", "setns",
    # the mount API, old and new
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr",
    # file handles bypass the mount namespace
    "open_by_handle_at", "name_to_handle_at",
    # kernel, modules, machine-wide state
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "get_kernel_syms", "query_module", "reboot", "swapon", "swapoff", "acct",
    "quotactl", "quotactl_fd", "syslog", "vhangup", "nfsservctl", "lookup_dcookie", "uselib",
    "ustat", "sysfs", "_sysctl", "iopl", "ioperm",
    # clocks
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
)
"""Syscalls refused with EPERM (personality, chroot, sethostname and the NUMA calls stay allowed)."""

ENOSYS_DENIED: tuple[str, ...] = ("clone3",)
"""Syscalls refused with ENOSYS so that libc falls back to one the filter can inspect."""

CLONE_NS_FLAGS = 0x7E020000
"""CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: `clone` with any of them -> EPERM."""

# x86_64: arch/x86/entry/syscalls/syscall_64.tbl (common/64 entries).
_X86_64: dict[str, int] = {
    "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "fanotify_init": 300, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "pidfd_getfd": 438, "kcmp": 312, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
    "pivot_root": 155, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsmount": 432,
    "fsconfig": 431, "fspick": 433, "mount_setattr": 442, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "create_module": 174, "get_kernel_syms": 177,
    "query_module": 178, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
    "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "vhangup": 153, "nfsservctl": 180,
    "lookup_dcookie": 212, "uselib": 134, "ustat": 136, "sysfs": 139, "_sysctl": 156, "iopl": 172,
    "ioperm": 173, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159,
    "clock_adjtime": 305, "clone": 56, "clone3": 435,
}

# aarch64: include/uapi/asm-generic/unistd.h. It has no create_module, get_kernel_syms,
# query_module, uselib, ustat, sysfs, _sysctl, iopl or ioperm.
_AARCH64: dict[str, int] = {
    "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
    "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "fanotify_init": 262, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
    "pidfd_getfd": 438, "kcmp": 272, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
    "pivot_root": 41, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsmount": 432,
    "fsconfig": 431, "fspick": 433, "mount_setattr": 442, "open_by_handle_at": 265,
    "name_to_handle_at": 264, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225,
    "acct": 89, "quotactl": 60, "quotactl_fd": 443, "syslog": 116, "vhangup": 58,
    "nfsservctl": 42, "lookup_dcookie": 18, "settimeofday": 170, "clock_settime": 112,
    "adjtimex": 171, "clock_adjtime": 266, "clone": 220, "clone3": 435,
}

# name -> (syscall table, AUDIT_ARCH_* of the native ABI, x32 bit or None, OCI architectures)
_ARCHES: dict[str, tuple[dict[str, int], int, int | None, list[str]]] = {
    "x86_64": (_X86_64, 0xC000003E, 0x40000000,
               ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]),
    "aarch64": (_AARCH64, 0xC00000B7, None, ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]),
}
_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}

# classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
# offsets in struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6];}
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16


def _resolve(arch: str | None) -> tuple[str, tuple[dict[str, int], int, int | None, list[str]]]:
    name = (arch or platform.machine()).lower()
    name = _ALIASES.get(name, name)
    if name not in _ARCHES:
        raise ValueError(f"seccomp: unsupported architecture {name!r} "
                         f"(supported: {', '.join(sorted(_ARCHES))})")
    return name, _ARCHES[name]


def syscall_numbers(arch: str | None = None) -> dict[str, int]:
    """Number of each DENIED syscall that exists on `arch` (None: this host), in DENIED order."""
    table = _resolve(arch)[1][0]
    return {n: table[n] for n in DENIED if n in table}


@functools.cache  # bytes, made once per arch: every namespace sandbox start hands it to bwrap
def bpf_program(arch: str | None = None) -> bytes:
    """The filter as a raw `struct sock_filter` array (8 bytes per instruction, little-endian).

    arch: "x86_64" or "aarch64" (None: `platform.machine()`); anything else raises ValueError.
    """
    _, (table, audit_arch, x32_bit, _) = _resolve(arch)
    # (code, jt, jf, k) where jt/jf are 0 (next instruction) or the name of a label below
    prog: list[tuple[int, int | str, int | str, int]] = [
        (_LD_W_ABS, 0, 0, _OFF_ARCH),
        (_JEQ_K, 1, 0, audit_arch),  # native ABI: skip the kill
        (_RET_K, 0, 0, RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _OFF_NR),
    ]
    if x32_bit is not None:  # x32 calls are x86_64 numbers | 0x40000000: refuse them all
        prog.append((_JGE_K, "eperm", 0, x32_bit))
    prog += [(_JEQ_K, "eperm", 0, nr) for nr in syscall_numbers(arch).values()]
    prog += [(_JEQ_K, "enosys", 0, table[n]) for n in ENOSYS_DENIED if n in table]
    prog += [
        (_JEQ_K, 0, "allow", table["clone"]),
        (_LD_W_ABS, 0, 0, _OFF_ARG0_LO),  # clone's flags (low 32 bits) on both arches
        (_JSET_K, "eperm", "allow", CLONE_NS_FLAGS),
    ]
    labels = {"allow": len(prog), "eperm": len(prog) + 1, "enosys": len(prog) + 2}
    prog += [(_RET_K, 0, 0, RET_ALLOW), (_RET_K, 0, 0, RET_ERRNO | errno.EPERM),
             (_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS)]

    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offs = [t if isinstance(t, int) else labels[t] - i - 1 for t in (jt, jf)]
        if not all(0 <= o <= 255 for o in offs):
            raise AssertionError(f"seccomp: jump out of range at instruction {i}")
        out += struct.pack("<HBBI", code, offs[0], offs[1], k)
    return bytes(out)


def oci_profile(arch: str | None = None, clone_rules: bool = True) -> dict:
    """The OCI runtime-spec `linux.seccomp` object for the same policy (for runc/libseccomp).

    syscalls[0] is the EPERM deny list; later entries refuse clone3 (ENOSYS) and clone with a
    CLONE_NEW* flag (one rule per flag: libseccomp has no "masked != 0" operator). Without
    `clone_rules` (runsc: its sentry answers the clone3 rule with EPERM, not ENOSYS, so no thread
    could start) only the deny list; a namespace made inside gVisor is gVisor's, not the host's.
    """
    _, (table, _, _, oci_arches) = _resolve(arch)
    ns_bits = [1 << b for b in range(32) if CLONE_NS_FLAGS >> b & 1]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(oci_arches),
        "syscalls": [
            {"names": [n for n in DENIED if n in table], "action": "SCMP_ACT_ERRNO",
             "errnoRet": errno.EPERM},
            *([{"names": [n for n in ENOSYS_DENIED if n in table], "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.ENOSYS}] if clone_rules else []),
            *({"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
               "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]}
              for bit in (ns_bits if clone_rules else [])),
        ],
    }


def write_program_fd(arch: str | None = None) -> int:
    """A new fd, offset 0, holding `bpf_program(arch)`: for `bwrap --seccomp FD` via pass_fds.

    The caller owns it and must close it. bwrap reads it to EOF, and the offset is shared by every
    copy of the fd, so use one fd per bwrap launch (or lseek it back to 0 before each). It is
    close-on-exec in this process; subprocess's pass_fds hands it down under the same number:

        fd = write_program_fd()
        try:
            subprocess.run([bwrap, ..., "--seccomp", str(fd), ...], pass_fds=(fd,))
        finally:
            os.close(fd)
    """
    data = bpf_program(arch)
    try:
        fd = os.memfd_create("burstrl-seccomp", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # no memfd: an unlinked temp file does the same
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())  # non-inheritable, like the memfd
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
