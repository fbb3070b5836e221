"""The seccomp filter for sandboxed code, for every backend (issue 15, defect 10; issue 37).

The policy is one table, with every decision's reason: `seccomp_rules.RULES` (one line per syscall)
and `seccomp_rules.FAMILIES` (one line per socket family). This module compiles it, adding only
the ABI checks below.

Two encodings of the same table:

* `bpf_program()`: a classic-BPF filter (the raw `struct sock_filter` array) for bubblewrap's
  `--seccomp FD`; `write_program_fd()` puts it in a memfd for `pass_fds`.
* `oci_profile()`: the OCI runtime-spec `linux.seccomp` object; runc compiles it with libseccomp.
  Under runsc the daemon installs `bpf_program()` on itself once it has made its commands' pid
  namespace (`sandbox.cmdns`), so the sentry answers with the table's own errnos there.

`clone` with any CLONE_NEW* flag is refused (else denying `unshare` is moot) and `clone3` fails with
ENOSYS, whose flags live in memory a filter cannot read; glibc then falls back to `clone` (Docker
does the same). The BPF filter also kills a process on a foreign syscall ABI (i386/arm32 compat)
and, on x86_64, refuses every x32 syscall. Arguments are compared in their low 32 bits where the
kernel reads an int or a flags word (the BPF filter), or with the mask 0xFFFFFFFF (the OCI profile).

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

from burstrl.sandbox.backends.seccomp_rules import ALLOW, DENIED, FAMILIES, FAMILY_LIST, OTHER_PID, RULES, Masked, Rule

__all__ = ["bpf_program", "oci_profile", "write_program_fd"]

OCI_FAMILY_SPAN = 64
"""The OCI profile names families 0..63 one by one (AF_MAX is 46 in 6.x) and refuses >= 64 at once."""

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
    "socket": 41, "socketpair": 53, "io_setup": 206, "io_destroy": 207, "io_getevents": 208,
    "io_submit": 209, "io_cancel": 210, "io_pgetevents": 333, "mq_open": 240,
    "memfd_secret": 447, "mmap": 9, "memfd_create": 319, "shmget": 29, "prlimit64": 302,
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
    "socket": 198, "socketpair": 199, "io_setup": 0, "io_destroy": 1, "io_getevents": 4,
    "io_submit": 2, "io_cancel": 3, "io_pgetevents": 292, "mq_open": 180, "memfd_secret": 447,
    "mmap": 222, "memfd_create": 279, "shmget": 194, "prlimit64": 261,
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
# (little-endian on both arches: an argument's low 32 bits come first)
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


def _arg_hi(i: int) -> int:
    return 16 + 8 * i + 4


_Insn = tuple[int, "int | str", "int | str", int]  # (code, jt, jf, k); jt/jf: 0 or a label


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


def enforced(arch: str | None = None) -> tuple[Rule, ...]:
    """The RULES lines that compile to a check on `arch`: not "allow", and the syscall exists."""
    table = _resolve(arch)[1][0]
    return tuple(r for r in RULES if r.action != ALLOW and r.syscall in table)


def _errno(action: str) -> int:
    return getattr(errno, action)


def _ret(action: str) -> str:
    """The label of the instruction returning `action`'s errno (or allowing)."""
    return "allow" if action == ALLOW else action


def _family_split() -> tuple[set[int], dict[int, tuple[int, str]], dict[int, str], str]:
    """(families allowed whole, {family: (its one allowed protocol, action for the rest)},
    {named family: action}, the action for unlisted families)."""
    whole = {f.number for f in FAMILIES if f.action == ALLOW and f.protocol is None}
    by_proto = {f.number: f.protocol for f in FAMILIES if f.action == ALLOW and f.protocol is not None}
    rest = {f.number: f.action for f in FAMILIES if f.action != ALLOW and f.number >= 0}
    default = next(f.action for f in FAMILIES if f.number < 0)
    protocols = {n: (p, rest.pop(n)) for n, p in by_proto.items()}
    return whole, protocols, rest, default


def _family_block(label: str) -> list[tuple[str | None, _Insn]]:
    """socket/socketpair: allowed families pass, one protocol of a protocol-limited family passes."""
    whole, protocols, rest, default = _family_split()
    out: list[tuple[str | None, _Insn]] = [(label, (_LD_W_ABS, 0, 0, _arg_lo(0)))]
    out += [(None, (_JEQ_K, "allow", 0, f)) for f in sorted(whole)]
    out += [(None, (_JEQ_K, f"{label}.{f}", 0, f)) for f in sorted(protocols)]
    out += [(None, (_JEQ_K, _ret(a), 0, f)) for f, a in sorted(rest.items())]
    out.append((None, (_JGE_K, _ret(default), 0, 0)))  # always true (unsigned): a plain jump
    for f, (proto, action) in sorted(protocols.items()):
        out += [(f"{label}.{f}", (_LD_W_ABS, 0, 0, _arg_lo(2))),
                (None, (_JEQ_K, "allow", _ret(action), proto))]
    return out


def _other_pid_block(label: str, action: str) -> list[tuple[str | None, _Insn]]:
    """prlimit64: pid 0 (itself) passes, so does a NULL new limit (a read); the rest get `action`."""
    return [(label, (_LD_W_ABS, 0, 0, _arg_lo(0))), (None, (_JEQ_K, "allow", 0, 0)),
            (None, (_LD_W_ABS, 0, 0, _arg_lo(2))), (None, (_JEQ_K, 0, _ret(action), 0)),
            (None, (_LD_W_ABS, 0, 0, _arg_hi(2))), (None, (_JEQ_K, "allow", _ret(action), 0))]


def _condition_block(rule: Rule, label: str) -> list[tuple[str | None, _Insn]]:
    if isinstance(rule.when, Masked):
        return [(label, (_LD_W_ABS, 0, 0, _arg_lo(rule.when.arg))),
                (None, (_JSET_K, _ret(rule.action), "allow", rule.when.mask))]
    if rule.when == FAMILY_LIST:
        return _family_block(label)
    if rule.when == OTHER_PID:
        return _other_pid_block(label, rule.action)
    raise AssertionError(f"seccomp: unknown condition {rule.when!r} of {rule.syscall}")


def _assemble(lines: list[tuple[str | None, _Insn]]) -> bytes:
    """Resolve label jumps to relative offsets and pack each `struct sock_filter`."""
    labels = {name: i for i, (name, _) in enumerate(lines) if name is not None}
    out = bytearray()
    for i, (_, (code, jt, jf, k)) in enumerate(lines):
        offs = [t if isinstance(t, int) else labels[t] - i - 1 for t in (jt, jf)]
        if not all(0 <= o <= 255 for o in offs):
            raise AssertionError(f"seccomp: jump out of range at instruction {i}")
        out += struct.pack("<HBBI", code, offs[0], offs[1], k)
    return bytes(out)


@functools.cache  # bytes, made once per arch: every namespace sandbox start hands it to bwrap
def bpf_program(arch: str | None = None) -> bytes:
    """The filter as a raw `struct sock_filter` array (8 bytes per instruction, little-endian).

    Layout: the ABI check, one JEQ per enforced syscall (to its return, or to its condition's
    block), ALLOW for everything else, the condition blocks, then ALLOW and one RET per errno
    used (classic BPF jumps only forward, so the blocks' returns come after them).
    arch: "x86_64" or "aarch64" (None: `platform.machine()`); anything else raises ValueError.
    """
    _, (table, audit_arch, x32_bit, _) = _resolve(arch)
    rules = enforced(arch)
    lines: list[tuple[str | None, _Insn]] = [
        (None, (_LD_W_ABS, 0, 0, _OFF_ARCH)),
        (None, (_JEQ_K, 1, 0, audit_arch)),  # native ABI: skip the kill
        (None, (_RET_K, 0, 0, RET_KILL_PROCESS)),
        (None, (_LD_W_ABS, 0, 0, _OFF_NR)),
    ]
    if x32_bit is not None:  # x32 calls are x86_64 numbers | 0x40000000: refuse them all
        lines.append((None, (_JGE_K, "EPERM", 0, x32_bit)))
    lines += [(None, (_JEQ_K, _ret(r.action) if r.when is None else f"if.{r.syscall}", 0,
                      table[r.syscall])) for r in rules]
    lines.append((None, (_RET_K, 0, 0, RET_ALLOW)))  # every syscall not named
    for r in rules:
        if r.when is not None:
            lines += _condition_block(r, f"if.{r.syscall}")
    used = sorted({t for _, (_, jt, jf, _) in lines for t in (jt, jf) if isinstance(t, str)}
                  - {name for name, _ in lines if name is not None} - {"allow"}, key=_errno)
    lines.append(("allow", (_RET_K, 0, 0, RET_ALLOW)))  # BPF jumps only forward: the blocks' ALLOW
    lines += [(a, (_RET_K, 0, 0, RET_ERRNO | _errno(a))) for a in used]
    return _assemble(lines)


def _errno_rule(names: list[str], action: str, args: list[dict] | None = None) -> dict:
    rule: dict = {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": _errno(action)}
    if args:
        rule["args"] = args
    return rule


def _masked_eq(index: int, mask: int, value: int) -> dict:
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _oci_families(names: list[str]) -> list[dict]:
    """One rule per refused family number below OCI_FAMILY_SPAN, one for all above, one per
    protocol-limited family (libseccomp has no "not in" operator: the refusals are listed)."""
    whole, protocols, rest, default = _family_split()
    out = [_errno_rule(names, rest.get(f, default), [_masked_eq(0, 0xFFFFFFFF, f)])
           for f in range(OCI_FAMILY_SPAN) if f not in whole and f not in protocols]
    out.append(_errno_rule(names, default, [{"index": 0, "value": OCI_FAMILY_SPAN, "op": "SCMP_CMP_GE"}]))
    out += [_errno_rule(names, action, [_masked_eq(0, 0xFFFFFFFF, f),
                                        {"index": 2, "value": proto, "op": "SCMP_CMP_NE"}])
            for f, (proto, action) in sorted(protocols.items())]
    return out


def _oci_conditional(rule: Rule) -> list[dict]:
    """A conditional RULES line as OCI rules (a Masked one: one rule per bit of its mask)."""
    if isinstance(rule.when, Masked):
        bits = [1 << b for b in range(32) if rule.when.mask >> b & 1]
        return [_errno_rule([rule.syscall], rule.action, [_masked_eq(rule.when.arg, bit, bit)])
                for bit in bits]
    if rule.when == FAMILY_LIST:
        return _oci_families([rule.syscall])
    if rule.when == OTHER_PID:
        return [_errno_rule([rule.syscall], rule.action,
                            [{"index": 0, "value": 0, "op": "SCMP_CMP_NE"},
                             {"index": 2, "value": 0, "op": "SCMP_CMP_NE"}])]
    raise AssertionError(f"seccomp: unknown condition {rule.when!r} of {rule.syscall}")


def oci_profile(arch: str | None = None, clone_rules: bool = True) -> dict:
    """The OCI runtime-spec `linux.seccomp` object for the same table (for runc/libseccomp, runsc).

    syscalls[0] is the unconditional EPERM list, then one entry per other errno's unconditional
    list (ENOSYS: clone3, io_*...), then the conditional lines' rules. Without `clone_rules`
    (for runsc's `--oci-seccomp`, whose sentry answers every refusal with EPERM whatever `errnoRet`
    says, seen with runsc 20221219, and an EPERM clone3 leaves glibc no fallback, so no thread could
    start) clone3 and clone are left out. Sandboxes under runsc no longer use it: their daemon
    installs `bpf_program()`, whose errnos the sentry keeps.
    """
    _, (table, _, _, oci_arches) = _resolve(arch)
    skip = set() if clone_rules else {"clone", "clone3"}
    rules = [r for r in enforced(arch) if r.syscall not in skip]
    actions = list(dict.fromkeys(r.action for r in rules if r.when is None))
    actions.sort(key=lambda a: a != "EPERM")
    syscalls = [_errno_rule([r.syscall for r in rules if r.when is None and r.action == a], a)
                for a in actions]
    for r in rules:
        if r.when is not None:
            syscalls += _oci_conditional(r)
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": list(oci_arches),
            "syscalls": syscalls}


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
