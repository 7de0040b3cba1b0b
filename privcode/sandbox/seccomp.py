"""The seccomp filter of the full sandbox: built here with libseccomp, loaded by the zygote.

:func:`filter_program` compiles :data:`DENIED` into a classic-BPF program with libseccomp
(through ``pyseccomp``, a ctypes binding: libseccomp resolves syscall numbers per
architecture and adds the architecture check: a syscall of a foreign ABI, i386's
``int 0x80`` or x32's numbers, kills the process).  The zygote (standard library only)
receives the program's bytes and installs it in each snippet with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`` right after ``PR_SET_NO_NEW_PRIVS``, the
last step before the code runs; the filter is inherited by every child and cannot be
removed.

Policy: allow by default and deny the kernel's attack surface that no stdlib snippet
needs (a deny-by-default list would break ordinary programs in ways tests cannot cover):
io_uring, bpf, userfaultfd, the key store, perf events, ptrace and cross-process memory,
every namespace and mount call, kexec and modules, handle-based opens, plus clock, swap,
reboot, quota, accounting and personality changes.  ``clone`` with a ``CLONE_NEW*`` flag
is denied (plain fork and threads are not) and ``clone3`` answers ENOSYS, whose flags
live in memory a filter cannot read (glibc then falls back to ``clone``).  Denied calls
fail with EPERM, so the code sees an error rather than a kill.
"""

from __future__ import annotations

import errno
import functools
import tempfile

#: Syscalls a snippet may not make, by group (a hostile test per group).
DENIED: dict[str, tuple[str, ...]] = {
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "bpf": ("bpf",),
    "userfaultfd": ("userfaultfd",),
    "keys": ("keyctl", "add_key", "request_key"),
    "perf": ("perf_event_open",),
    "ptrace": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "namespaces": ("unshare", "setns"),
    "mount": (
        "mount",
        "umount2",
        "pivot_root",
        "chroot",
        "fsopen",
        "fsconfig",
        "fsmount",
        "fspick",
        "move_mount",
        "open_tree",
        "mount_setattr",
    ),
    "kexec": ("kexec_load", "kexec_file_load", "reboot"),
    "modules": ("init_module", "finit_module", "delete_module"),
    "handles": ("open_by_handle_at", "name_to_handle_at"),
    "system": (
        "swapon",
        "swapoff",
        "acct",
        "quotactl",
        "settimeofday",
        "clock_settime",
        "clock_adjtime",
        "adjtimex",
        "personality",
        "lookup_dcookie",
        "syslog",
        "vhangup",
    ),
}
#: The CLONE_NEW* flags (cgroup, uts, ipc, user, pid, net, mount, time).
CLONE_NEW_FLAGS = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
CLONE_NEW_FLAGS |= 0x40000000 | 0x00020000 | 0x00000080


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing: the full sandbox cannot be had."""


@functools.cache
def filter_program() -> bytes:
    """The BPF program of the filter (``struct sock_filter`` array, native byte order)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # the binding, or libseccomp.so.2 itself
        raise SeccompUnavailable(
            f"libseccomp is not usable ({type(exc).__name__}: {exc}): install the libseccomp2 "
            "system package and the pyseccomp Python package"
        ) from None
    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in (n for group in DENIED.values() for n in group):
        try:
            f.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):  # not a syscall of this architecture
            continue
    for flag in _flag_bits(CLONE_NEW_FLAGS):
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        prog = fh.read()
    if not prog or len(prog) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed filter ({len(prog)} bytes)")
    return prog


def _flag_bits(mask: int) -> list[int]:
    return [1 << i for i in range(mask.bit_length()) if mask >> i & 1]


def available() -> str | None:
    """None if the filter can be built here, else why not."""
    try:
        filter_program()
    except SeccompUnavailable as exc:
        return str(exc)
    return None


__all__ = ["CLONE_NEW_FLAGS", "DENIED", "SeccompUnavailable", "available", "filter_program"]
