"""The seccomp filter of the full sandbox: built here with libseccomp, loaded by the zygote.
Design notes: docs/kubernetes.md, "privcode/sandbox/seccomp.py".

:func:`filter_program` compiles :data:`ALLOWED` into a classic-BPF program with libseccomp
(``pyseccomp``), which adds the architecture check: a syscall of a foreign ABI kills the
process. The zygote installs it in each snippet right after ``PR_SET_NO_NEW_PRIVS``, the last
step before the code runs; the filter is inherited by every child and cannot be removed.

Policy: an allow list, deny by default (EPERM): Docker's default profile narrowed to what
standard-library Python needs; ``clone`` without a ``CLONE_NEW*`` flag, sockets of
:data:`SOCKET_FAMILIES` only, ``clone3`` answers ENOSYS (glibc falls back to ``clone``, whose
flags the filter checks). :data:`DENIED` lists the groups a hostile test reaches for.

"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


#: Syscalls a snippet may make, by group (Docker's default profile, narrowed).
ALLOWED: dict[str, tuple[str, ...]] = {
    "files": _names(
        """
        read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 open openat
        openat2 creat close close_range lseek dup dup2 dup3 fcntl flock ioctl stat fstat
        lstat newfstatat statx statfs fstatfs access faccessat faccessat2 readlink
        readlinkat getdents getdents64 getcwd chdir fchdir mkdir mkdirat rmdir unlink
        unlinkat rename renameat renameat2 link linkat symlink symlinkat mknod mknodat chmod
        fchmod fchmodat fchmodat2 chown fchown fchownat lchown umask utime utimes utimensat
        futimesat truncate ftruncate fallocate fadvise64 readahead fsync fdatasync sync
        syncfs sync_file_range sendfile copy_file_range splice tee getxattr lgetxattr
        fgetxattr listxattr llistxattr flistxattr setxattr lsetxattr fsetxattr removexattr
        lremovexattr fremovexattr
        """
    ),
    "memory": _names(
        """
        brk mmap munmap mprotect mremap madvise mincore msync membarrier
        """
    ),
    "processes": _names(
        """
        fork vfork execve execveat exit exit_group wait4 waitid set_tid_address
        set_robust_list get_robust_list rseq arch_prctl prctl futex futex_waitv getpid
        getppid gettid getpgid getpgrp setpgid getsid setsid getuid geteuid getgid getegid
        getresuid getresgid getgroups setuid setgid setreuid setregid setresuid setresgid
        setgroups setfsuid setfsgid capget capset getpriority setpriority getrlimit
        setrlimit prlimit64 getrusage times sched_yield sched_getaffinity sched_setaffinity
        sched_getparam sched_getscheduler sched_get_priority_max sched_get_priority_min
        sched_rr_get_interval getcpu uname getrandom seccomp
        """
    ),
    "signals": _names(
        """
        rt_sigaction rt_sigprocmask rt_sigreturn rt_sigsuspend rt_sigpending rt_sigtimedwait
        rt_sigqueueinfo rt_tgsigqueueinfo sigaltstack kill tkill tgkill pause alarm
        restart_syscall
        """
    ),
    "time": _names(
        """
        clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time getitimer
        setitimer timer_create timer_settime timer_gettime timer_getoverrun timer_delete
        timerfd_create timerfd_settime timerfd_gettime
        """
    ),
    "events": _names(
        """
        pipe pipe2 select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl
        epoll_wait epoll_pwait epoll_pwait2 eventfd eventfd2 signalfd signalfd4
        """
    ),
    "sockets": _names(
        """
        connect bind listen accept accept4 sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg
        shutdown getsockname getpeername getsockopt setsockopt
        """
    ),
}
#: The socket families ``socket()`` may create (vsock, netlink, packet... are denied).
SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
#: The kernel surface a hostile snippet reaches for, by group: none is in ALLOWED (a test
#: each; "review" is issue 43's list of calls that reached the kernel under the old filter).
DENIED: dict[str, tuple[str, ...]] = {
    "io_uring": _names(
        """
        io_uring_setup io_uring_enter io_uring_register
        """
    ),
    "bpf": _names(
        """
        bpf
        """
    ),
    "userfaultfd": _names(
        """
        userfaultfd
        """
    ),
    "keys": _names(
        """
        keyctl add_key request_key
        """
    ),
    "perf": _names(
        """
        perf_event_open
        """
    ),
    "ptrace": _names(
        """
        ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd
        """
    ),
    "namespaces": _names(
        """
        unshare setns
        """
    ),
    "mount": _names(
        """
        mount umount2 pivot_root chroot fsopen fsconfig fsmount fspick move_mount open_tree
        mount_setattr
        """
    ),
    "kexec": _names(
        """
        kexec_load kexec_file_load reboot
        """
    ),
    "modules": _names(
        """
        init_module finit_module delete_module
        """
    ),
    "handles": _names(
        """
        open_by_handle_at name_to_handle_at
        """
    ),
    "system": _names(
        """
        swapon swapoff acct quotactl settimeofday clock_settime clock_adjtime adjtimex
        personality lookup_dcookie syslog vhangup
        """
    ),
    "memfd": _names(
        """
        memfd_create memfd_secret
        """
    ),
    "review": _names(
        """
        modify_ldt memfd_secret vmsplice io_setup io_submit mbind set_mempolicy move_pages
        migrate_pages sysfs ustat pidfd_open
        """
    ),
    "ipc": _names(
        """
        shmget shmat msgget semget mq_open
        """
    ),
    "host": _names(
        """
        sysinfo
        """
    ),
    "mlock": _names(
        """
        mlock mlock2 mlockall
        """
    ),
}
#: The CLONE_NEW* flags (cgroup, uts, ipc, user, pid, net, mount, time).
CLONE_NEW_FLAGS = 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
CLONE_NEW_FLAGS |= 0x40000000 | 0x00020000 | 0x00000080


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing: the full sandbox cannot be had."""


def _binding():
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # the binding, or libseccomp.so.2 itself
        raise SeccompUnavailable(
            f"libseccomp is not usable ({type(exc).__name__}: {exc}): install the libseccomp2 "
            "system package and the pyseccomp Python package"
        ) from None
    return sc


def _add(f, action, name: str, *args) -> bool:
    """Add one rule; False if ``name`` is not a syscall this libseccomp knows here."""
    try:
        f.add_rule(action, name, *args)
    except (OSError, ValueError, RuntimeError):
        return False
    return True


@functools.cache
def filter_program() -> bytes:
    """The BPF program of the filter (``struct sock_filter`` array, native byte order)."""
    sc = _binding()
    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    try:  # a binary tree of syscall numbers (libseccomp >= 2.5), else a linear list
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    except (OSError, ValueError, RuntimeError):
        pass
    for name in (n for group in ALLOWED.values() for n in group):
        _add(f, sc.ALLOW, name)
    for family in SOCKET_FAMILIES:
        _add(f, sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family))
    _add(f, sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    _add(f, sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEW_FLAGS, 0))
    _add(f, sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        prog = fh.read()
    if not prog or len(prog) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed filter ({len(prog)} bytes)")
    return prog


def available() -> str | None:
    """None if the filter can be built here, else why not."""
    try:
        filter_program()
    except SeccompUnavailable as exc:
        return str(exc)
    return None


__all__ = [
    "ALLOWED",
    "CLONE_NEW_FLAGS",
    "DENIED",
    "SOCKET_FAMILIES",
    "SeccompUnavailable",
    "available",
    "filter_program",
]
