"""The seccomp policy for sandboxed code, as data: one line per syscall decision (`RULES`) and one
per socket family decision (`FAMILIES`), each with its reason (issue 15, defect 10; issue 37).

Why: namespaces and dropped capabilities keep model-written code away from the host's files and
processes, but every syscall still reaches the host kernel. Some calls are rarely needed by Python,
git, pip, pytest or gcc yet make up much of the kernel's attack surface (keyrings, bpf, perf,
userfaultfd, io_uring, the mount API, modules, namespace creation), reach outside the sandbox
(ptrace, process_vm_*, kcmp, pidfd_getfd, handle-based open), or draw on a pool or counter the
kernel keeps once for the whole host or per host uid, which namespaces do not divide (vsock's port
space, `fs.aio-max-nr`, key quotas, POSIX message queue bytes, the hugetlb pool): one sandbox could
use it up for the host and every other sandbox (issue 37, findings 1 and 2).

Lines whose action is "allow" were reviewed and kept open; they compile to nothing, since anything
not listed is allowed, and are there so that this table is also the documentation. Socket families
are the other way round: an allow-list (AF_UNIX, AF_INET, AF_INET6, and AF_NETLINK for
NETLINK_ROUTE only), everything else refused, for `socket` and `socketpair` alike. References:
Docker's default profile (moby/profiles/seccomp/default.json) and gVisor's syscall table (what a
sentry implements is what sandboxed code may expect to find).

Why a module of its own: the table is what a reviewer reads and changes; how it is compiled (to
classic BPF for bwrap, to an OCI profile for runc and runsc) is `seccomp`, which no policy change
should need to touch.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CLONE_NS_FLAGS", "DENIED", "ENOSYS_DENIED", "FAMILIES", "RULES", "Family", "Masked", "Rule"]

CLONE_NS_FLAGS = 0x7E020000
"""CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: `clone` with any of them -> EPERM."""

ALLOW = "allow"
FAMILY_LIST = "family not in FAMILIES"
"""Condition of the socket rules: the family (args[0]) and protocol (args[2]) are not allowed."""
OTHER_PID = "another process, with a new limit"
"""Condition of the prlimit64 rule: args[0] (pid) is not 0 and args[2] (new limit) is not NULL."""


class Masked(NamedTuple):
    """Condition: the rule applies only when `args[arg] & mask` is not 0 (low 32 bits)."""

    arg: int
    mask: int


class Rule(NamedTuple):
    """One syscall decision: its action ("allow" or an errno name), why, and when it applies."""

    syscall: str
    action: str
    reason: str
    when: Masked | str | None = None


class Family(NamedTuple):
    """One socket family decision (`protocol` None: any protocol of the family)."""

    name: str
    number: int
    protocol: int | None
    action: str
    reason: str


_ATTACK = "kernel attack surface that sandboxed work does not need"
_MOUNT = "the mount API: the sandbox's mounts are made before it starts; nothing inside mounts"
_MACHINE = "machine-wide state (needs host privileges; refused before the kernel looks)"
_AIO = ("fs.aio-max-nr is one pool for the host: two io_setup calls from inside took all 65,536 and "
        "the host's own io_setup failed (issue 37, finding 2); ENOSYS, as a kernel without "
        "CONFIG_AIO, so libaio users fall back to threads (glibc's aio_* never call these)")
_HUGETLB = ("the hugetlb pool (vm.nr_hugepages) is the host's, and no memory cgroup here counts it: "
            "a sandbox could take the pages reserved for the host's own work")
_NS = "new namespaces: a sandbox gets its namespaces from the backend, never makes its own"

RULES: tuple[Rule, ...] = (
    # host-wide pools and per-uid counters (issue 37)
    Rule("socket", "EAFNOSUPPORT", "families outside FAMILIES: vsock is one port space for the "
         "machine and reaches the hypervisor (finding 1); packet, alg, key, bluetooth... are attack "
         "surface with no use inside", FAMILY_LIST),
    Rule("socketpair", "EAFNOSUPPORT", "the same family allow-list as socket (only AF_UNIX has "
         "socketpairs; the rest answer EOPNOTSUPP anyway)", FAMILY_LIST),
    Rule("io_setup", "ENOSYS", _AIO),
    Rule("io_destroy", "ENOSYS", "with io_setup: no AIO context can exist"),
    Rule("io_getevents", "ENOSYS", "with io_setup: no AIO context can exist"),
    Rule("io_pgetevents", "ENOSYS", "with io_setup: no AIO context can exist"),
    Rule("io_submit", "ENOSYS", "with io_setup: no AIO context can exist"),
    Rule("io_cancel", "ENOSYS", "with io_setup: no AIO context can exist"),
    Rule("keyctl", "EPERM", "keyrings: key quotas (kernel.keys.maxkeys/maxbytes) per host uid, "
         "shared across sandboxes; " + _ATTACK),
    Rule("add_key", "EPERM", "keyrings: see keyctl"),
    Rule("request_key", "EPERM", "keyrings: see keyctl; it can also call out to a host helper"),
    Rule("mq_open", "ENOSYS", "POSIX message queue bytes count per host uid (RLIMIT_MSGQUEUE), "
         "shared by every sandbox of that uid; ENOSYS as a kernel without CONFIG_POSIX_MQUEUE "
         "(SysV msgget stays: its limits are per IPC namespace, which each sandbox has)"),
    Rule("memfd_secret", "ENOSYS", "secretmem pages leave the kernel's direct map (a host-wide "
         "cost) and count as locked memory; ENOSYS, as where secretmem is disabled (the default)"),
    Rule("mmap", "ENOMEM", "MAP_HUGETLB: " + _HUGETLB + "; ENOMEM, as an empty pool, so callers "
         "fall back to normal pages", Masked(3, 0x40000)),
    Rule("memfd_create", "EINVAL", "MFD_HUGETLB: " + _HUGETLB + "; EINVAL, as without hugetlbfs",
         Masked(1, 0x4)),
    Rule("shmget", "EPERM", "SHM_HUGETLB: " + _HUGETLB + "; EPERM, as for a caller outside "
         "vm.hugetlb_shm_group", Masked(2, 0x800)),
    Rule("fanotify_init", "EPERM", "fanotify groups and marks count per host uid; " + _ATTACK),
    Rule("userfaultfd", "EPERM", "stalls kernel paths at will (a classic exploit aid); " + _ATTACK),
    Rule("perf_event_open", "EPERM", "perf events and their locked buffers (per uid, "
         "kernel.perf_event_mlock_kb) leak host activity; " + _ATTACK),
    Rule("bpf", "EPERM", _ATTACK + " (verifier bugs); maps are locked kernel memory"),
    Rule("io_uring_setup", "EPERM", _ATTACK + "; its rings count as the uid's locked memory"),
    Rule("io_uring_enter", "EPERM", "with io_uring_setup"),
    Rule("io_uring_register", "EPERM", "with io_uring_setup"),
    Rule("prlimit64", "EPERM", "commands share the daemon's uid: prlimit(1, RLIMIT_NOFILE, 4) left "
         "the daemon unable to start any command; a process may still set its own limits (pid 0)",
         OTHER_PID),
    # reaching other processes, also outside the sandbox
    Rule("ptrace", "EPERM", "reaches other processes of the uid, the daemon's included"),
    Rule("process_vm_readv", "EPERM", "reads other processes' memory"),
    Rule("process_vm_writev", "EPERM", "writes other processes' memory"),
    Rule("pidfd_getfd", "EPERM", "takes other processes' fds"),
    Rule("kcmp", "EPERM", "compares other processes' kernel objects (an ASLR oracle)"),
    # new namespaces (clone with CLONE_NEW* below; clone3's flags cannot be read)
    Rule("unshare", "EPERM", _NS),
    Rule("setns", "EPERM", _NS),
    Rule("clone", "EPERM", "with a CLONE_NEW* flag: " + _NS, Masked(0, CLONE_NS_FLAGS)),
    Rule("clone3", "ENOSYS", "its flags are in memory no filter can read; ENOSYS makes glibc "
         "fall back to clone, whose flags are checked"),
    # the mount API, old and new
    *(Rule(n, "EPERM", _MOUNT) for n in ("mount", "umount2", "pivot_root", "move_mount",
                                          "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
                                          "mount_setattr")),
    Rule("open_by_handle_at", "EPERM", "file handles bypass the mount namespace (the 'shocker' "
         "escape)"),
    Rule("name_to_handle_at", "EPERM", "with open_by_handle_at"),
    # kernel, modules, machine-wide state
    *(Rule(n, "EPERM", _MACHINE) for n in (
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
        "create_module", "get_kernel_syms", "query_module", "reboot", "swapon", "swapoff", "acct",
        "quotactl", "quotactl_fd", "syslog", "vhangup", "nfsservctl", "lookup_dcookie", "uselib",
        "ustat", "sysfs", "_sysctl", "iopl", "ioperm", "settimeofday", "clock_settime",
        "adjtimex", "clock_adjtime")),
    # reviewed and kept: allowed
    Rule("inotify_init", ALLOW, "instances and watches count per host uid (finding 3), but "
         "editors, test watchers, tail -f and node need them: held by a host uid per sandbox"),
    Rule("inotify_init1", ALLOW, "the same per-uid instances as inotify_init"),
    Rule("epoll_ctl", ALLOW, "watches count per host uid (fs.epoll.max_user_watches): held by a "
         "host uid per sandbox; every event loop needs it"),
    Rule("pipe2", ALLOW, "pipe pages count per host uid (fs.pipe-user-pages-soft): held by a host "
         "uid per sandbox; every shell needs it"),
    Rule("rt_sigqueueinfo", ALLOW, "pending signals count per host uid (RLIMIT_SIGPENDING): held "
         "by a host uid per sandbox and explicit rlimits"),
    Rule("timer_create", ALLOW, "as rt_sigqueueinfo (each timer holds a pending signal)"),
    Rule("msgget", ALLOW, "SysV IPC limits are per IPC namespace, and each sandbox has its own"),
    Rule("semget", ALLOW, "SysV semaphores: per IPC namespace, as msgget"),
    Rule("mlock", ALLOW, "RLIMIT_MEMLOCK is per process and locked pages count in the sandbox's "
         "memory cgroup"),
    Rule("mlockall", ALLOW, "per process and in the memory cgroup, as mlock"),
    Rule("personality", ALLOW, "changes only the caller's own exec domain (setarch -R, gdb); not "
         "a pool"),
    Rule("chroot", ALLOW, "needs CAP_SYS_CHROOT, which no sandbox process holds"),
    Rule("sethostname", ALLOW, "the sandbox's own UTS namespace"),
    Rule("mbind", ALLOW, "NUMA placement of the caller's own memory (torch, numactl); moving "
         "other processes' pages needs CAP_SYS_NICE"),
    Rule("set_mempolicy", ALLOW, "the caller's own NUMA policy, as mbind"),
    Rule("migrate_pages", ALLOW, "own pages; others' need CAP_SYS_NICE, as mbind"),
    Rule("move_pages", ALLOW, "own pages; others' need CAP_SYS_NICE, as mbind"),
    Rule("sync", ALLOW, "host-wide writeback is a cost, not a pool; tools call it"),
)
"""Every syscall decision, one line each (see the module docstring)."""

FAMILIES: tuple[Family, ...] = (
    Family("AF_UNIX", 1, None, ALLOW, "the daemon's socket, pipes between tools, socketpair"),
    Family("AF_INET", 2, None, ALLOW, "loopback servers and test clients; the sandbox's network "
           "namespace has only lo and no route out (runsc: --network=none)"),
    Family("AF_INET6", 10, None, ALLOW, "loopback over IPv6, with no route out, as AF_INET"),
    Family("AF_NETLINK/NETLINK_ROUTE", 16, 0, ALLOW, "getifaddrs and if_nameindex (node's "
           "os.networkInterfaces, gloo, psutil, `ip`) and glibc's AI_ADDRCONFIG read it; it sees "
           "only the sandbox's network namespace, read-only without CAP_NET_ADMIN"),
    Family("AF_NETLINK", 16, None, "EPROTONOSUPPORT", "every other netlink protocol (sock_diag, "
           "audit, uevent, netfilter, generic, xfrm...): host-wide or attack surface; EPROTONO"
           "SUPPORT, as a kernel without it (`ss` then reads /proc/net)"),
    Family("AF_VSOCK", 40, None, "EAFNOSUPPORT", "not namespaced: one port space for the machine, "
           "reaching the hypervisor (CID 2) and other guests (issue 37, finding 1)"),
    Family("AF_PACKET", 17, None, "EAFNOSUPPORT", "raw link-layer access; " + _ATTACK),
    Family("AF_ALG", 38, None, "EAFNOSUPPORT", "the kernel crypto API; " + _ATTACK),
    Family("AF_KEY", 15, None, "EAFNOSUPPORT", "IPsec key management; " + _ATTACK),
    Family("AF_BLUETOOTH", 31, None, "EAFNOSUPPORT", "host radio hardware"),
    Family("AF_XDP", 44, None, "EAFNOSUPPORT", "raw access to network devices"),
    Family("AF_CAN", 29, None, "EAFNOSUPPORT", "host bus hardware"),
    Family("AF_TIPC", 30, None, "EAFNOSUPPORT", "cluster IPC; " + _ATTACK),
    Family("AF_RDS", 21, None, "EAFNOSUPPORT", "RDMA sockets; " + _ATTACK),
    Family("AF_QIPCRTR", 42, None, "EAFNOSUPPORT", "modem/firmware IPC on the host"),
    Family("*", -1, None, "EAFNOSUPPORT", "every other family: not needed, so refused by default "
           "(EAFNOSUPPORT, as a kernel without it)"),
)
"""Every socket family decision for `socket` and `socketpair`; unlisted families take the "*" line."""


def _unconditional(action: str) -> tuple[str, ...]:
    return tuple(r.syscall for r in RULES if r.when is None and r.action == action)


DENIED: tuple[str, ...] = _unconditional("EPERM")
"""Syscalls always refused with EPERM (derived from RULES)."""

ENOSYS_DENIED: tuple[str, ...] = _unconditional("ENOSYS")
"""Syscalls always refused with ENOSYS: libc and libraries then act as on a kernel without them."""
