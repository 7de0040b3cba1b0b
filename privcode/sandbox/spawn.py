"""The template and the processes of a sandbox run: standard library only.

Loaded by path in each slot's zygote (:mod:`privcode.sandbox.zygote`, whose docstring lists
the isolation layers), with the same rules: standard library only (an import-linter
contract in pyproject.toml), few imports, no module with at-fork hooks.  Here: the libc
calls (mount, unshare, prctl), the zygote's namespaces and skeleton root, the *template*
(forked by the zygote before its first request; it never handles request data and forks
each run's first process), the run's pid 1 (its cgroup leaf, mount/IPC/cgroup namespaces,
/proc, chroot), the snippet process (rlimits, uid, seccomp) and its top level.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import json
import math
import os
import resource
import signal
import socket
import sys
import types

_TOP_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_NEWNS, _NEWCGROUP, _NEWUTS, _NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
_NEWPID, _NEWNET = 0x20000000, 0x40000000
_RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT = 1, 2, 4, 8, 32
_BIND, _REC, _PRIVATE = 4096, 16384, 1 << 18
_PDEATHSIG, DUMPABLE, _SET_SECCOMP, SUBREAPER, _NO_NEW_PRIVS = 1, 4, 22, 36, 38  # prctl
_SECCOMP_MODE_FILTER = 2
_TAIL = 4096
_MAX_FDS = 8  # fds in one message between the zygote and its template
# /proc entries masked where proc has no subset=pid (Linux < 5.8): runc's maskedPaths and
# readonlyPaths, and what tells about the host (boot, load, memory, devices, keys).
_MASKED = (
    "acpi asound bus driver dynamic_debug fs irq pressure scsi sys sysvipc tty "
    "buddyinfo cgroups cmdline config.gz consoles cpuinfo crypto devices diskstats dma "
    "execdomains filesystems interrupts iomem ioports kallsyms kcore key-users keys kmsg "
    "kpagecgroup kpagecount kpageflags latency_stats loadavg locks meminfo misc modules mtrr "
    "pagetypeinfo partitions sched_debug schedstat slabinfo softirqs stat swaps sysrq-trigger "
    "timer_list timer_stats uptime version vmallocinfo vmstat zoneinfo"
).split()

_LIBC = None
# The layers this zygote applies (set once by _zygote_main): the seccomp program as a ready
# ``struct sock_fprog`` (and its buffer, kept alive) and the slot's cgroup leaf.
LAYERS: dict = {"fprog": None, "cgroup": None}


def _sys(name: str, *args) -> None:
    """Call a libc function; raise OSError on failure."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        _LIBC.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if getattr(_LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args[:2]}: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    _sys("prctl", option, value, 0, 0, 0)


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    _sys(
        "mount",
        *(x.encode() if x else None for x in (src, dst, fstype)),
        flags,
        data.encode() if data else None,
    )


def unshare(flags: int) -> None:
    os.unshare(flags) if hasattr(os, "unshare") else _sys("unshare", flags)  # 3.12+ / ctypes


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def send_msg(sock: socket.socket, obj: dict, fds: tuple | list = ()) -> None:
    """One message (a JSON object and fds) between the zygote and its template."""
    socket.send_fds(sock, [json.dumps(obj).encode()], list(fds))


def recv_msg(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """(message, fds); (None, []) once the other side is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    except ConnectionResetError:  # the zygote exited with a message unread
        return None, []
    return (json.loads(data) if data else None), fds


def channel() -> tuple[socket.socket, socket.socket]:
    """The zygote's and the template's ends of their channel (one message per send)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _children() -> list[int]:
    """This (single-threaded) process's children, zombies included."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as fh:
            return [int(p) for p in fh.read().split()]
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: scan /proc
        kids = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError), open(f"/proc/{p}/stat", "rb") as fh:
                if int(fh.read().rsplit(b")", 1)[1].split()[1]) == me:
                    kids.append(int(p))
        return kids


def kill_children(keep: tuple[int, ...] = ()) -> None:
    """SIGKILL and reap every child but ``keep`` until none is left.  This process is a child
    subreaper, so a descendant whose parent dies becomes its child: every descendant ends,
    daemons that setsid or double-fork included."""
    for _ in range(10000):
        kids = [p for p in _children() if p not in keep]
        if not kids:
            return
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    raise RuntimeError("descendants of a sandbox run keep forking past SIGKILL")


def setup_namespaces(mnt: str) -> int:
    """Once per zygote: own net/uts/mount namespaces, the read-only skeleton root at ``mnt``.

    Returns an fd of the zygote's own pid namespace (to reset after each run's unshare).
    """
    unshare(_NEWNS | _NEWNET | _NEWUTS)
    _sys("sethostname", b"sandbox", 7)
    mount(None, "/", None, _REC | _PRIVATE)
    mount("tmpfs", mnt, "tmpfs", _NOSUID | _NODEV, "mode=0755,size=1m,nr_inodes=1024")
    bound: list[str] = []
    prefixes = (
        sys.base_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(sys.executable)),
    )
    for path in ["/" + d for d in _TOP_DIRS] + [os.path.realpath(p) for p in prefixes]:
        if os.path.islink(path) and path.count("/") == 1:  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), mnt + path)
        elif (
            os.path.isdir(path)
            and path != "/"
            and not any(path == b or path.startswith(b + "/") for b in bound)
        ):
            os.makedirs(mnt + path, exist_ok=True)
            mount(path, mnt + path, None, _BIND)
            mount(None, mnt + path, None, _BIND | _REMOUNT | _RDONLY | _NOSUID | _NODEV)
            bound.append(path)
    os.mkdir(mnt + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        os.close(os.open(f"{mnt}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        mount("/dev/" + name, f"{mnt}/dev/{name}", None, _BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("shm", "/tmp"),
    ):
        os.symlink(target, f"{mnt}/dev/{name}")
    os.mkdir(mnt + "/tmp", 0o700)
    os.mkdir(mnt + "/proc", 0o555)
    mount(None, mnt, None, _REMOUNT | _RDONLY | _NOSUID | _NODEV)
    return os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


def _mount_proc(path: str) -> None:
    """A proc of the run's pid namespace at ``path`` that shows its processes only: subset=pid
    (Linux 5.8+), else hidepid and the runc-style masks of :data:`_MASKED`."""
    flags = _NOSUID | _NODEV | _NOEXEC
    for opts in ("hidepid=invisible,subset=pid", "hidepid=invisible", "hidepid=2", ""):
        try:
            mount("proc", path, "proc", flags, opts)
            break
        except OSError:
            if not opts:
                raise
    if "subset" not in opts:
        mask_proc(path)


def mask_proc(path: str) -> None:
    """runc's maskedPaths under a proc mounted at ``path``: /dev/null over each file of
    :data:`_MASKED`, an empty read-only tmpfs over each directory."""
    for name in _MASKED:
        target = os.path.join(path, name)
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", _RDONLY | _NOSUID | _NODEV | _NOEXEC, "size=4k")
        elif os.path.exists(target):
            mount("/dev/null", target, None, _BIND)


def template_main(sock: socket.socket, zygote: int, mode: str, pidns: int | None, base):
    """The template's loop: per run, fork its first process from the message's fds and
    ``wait4`` it; nothing of a request but limits, uid and fds ever reaches this process.
    Returns only in a run's snippet process (its way to :func:`snippet_main`)."""
    me = os.getpid()
    prctl(_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote:  # the zygote died before the line above
        os._exit(0)
    prctl(SUBREAPER, 1)  # a run's orphans come back here, to be killed
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):  # the zygote's pipes to the parent are none of its business
        os.dup2(null, fd)
    os.close(null)
    while True:
        spec, fds = recv_msg(sock)
        if spec is None:
            os._exit(0)
        try:
            out = _template_run(sock, spec, fds, mode, pidns, base)
        except BaseException as exc:
            if os.getpid() != me:
                os._exit(70)
            out = {"fatal": f"{type(exc).__name__}: {exc}"}
        if isinstance(out, tuple):
            return out
        send_msg(sock, out)


def _template_run(sock, spec: dict, fds: list[int], mode: str, pidns: int | None, base):
    """Fork the run's first process (pid 1 of a new pid namespace in mode ns), hand its pidfd
    to the zygote, wait for it and every other process of the run to end."""
    pid = -1
    try:
        if len(fds) != 5:
            raise OSError(f"expected 5 fds for a run, got {len(fds)}")
        if mode == "ns":
            unshare(_NEWPID)  # the next child is pid 1 of a new pid namespace
        pid = os.fork()
    finally:
        if pid != 0:
            if mode == "ns":
                _sys("setns", pidns, _NEWPID)  # the template's later children stay in its own
            for fd in fds:
                os.close(fd)
    if pid == 0:
        sock.close()
        if pidns is not None:
            os.close(pidns)
        return _child(fds[4], _run_first, mode, spec, fds, base)
    pidfd = os.pidfd_open(pid)
    try:
        send_msg(sock, {"pid": pid}, [pidfd])
    finally:
        os.close(pidfd)
    _, status, ru = os.wait4(pid, 0)  # in mode ns: returns once its namespace is empty
    kill_children()  # in mode plain: the daemons it left
    return {"wait_status": status, "cpu": ru.ru_utime + ru.ru_stime}


def _child(st_w: int, fn, *args):
    """Run a forked child's role; on failure report it and _exit, never unwind into the template."""
    try:
        return fn(*args)
    except BaseException as exc:
        try:
            os.write(
                st_w, json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n"
            )
        finally:
            os._exit(70)


def _run_first(mode: str, spec: dict, fds: list[int], base: frozenset):
    """The run's first process: dies with the template, and with the OOM killer's first pick
    (``oom_score_adj`` 1000, inherited by every process of the run)."""
    prctl(_PDEATHSIG, signal.SIGKILL)
    if mode != "ns":  # not root: its own /proc/self (oom_score_adj) needs it dumpable
        prctl(DUMPABLE, 1)
    write_file("/proc/self/oom_score_adj", b"1000")
    return (_ns_init if mode == "ns" else _become_snippet)(spec, fds, base)


def _ns_init(spec: dict, fds: list[int], base: frozenset):
    """pid 1 of the run's pid namespace: its cgroup leaf, then new mount, IPC and cgroup
    namespaces, a fresh /tmp and /proc, chroot; then fork the snippet, reap, report its
    status and exit (the kernel then kills the rest)."""
    for procs in (LAYERS["cgroup"] or {}).get("procs", ()):  # first: all that follows counts
        write_file(procs, b"0")
    mnt, uid = spec["mnt"], spec["uid"]
    unshare(_NEWNS | _NEWIPC | _NEWCGROUP)  # after the leaf: /proc/self/cgroup says "/"
    mount(
        "tmpfs",
        mnt + "/tmp",
        "tmpfs",
        _NOSUID | _NODEV,
        f"mode=0700,uid={uid},gid={uid},size={spec['limits']['disk_mb']}m,nr_inodes=16384",
    )
    _mount_proc(mnt + "/proc")
    os.chroot(mnt)  # a plain chroot: the kernel then refuses it new user namespaces
    os.chdir("/")
    pid = os.fork()
    if pid == 0:
        return _child(fds[4], _become_snippet, spec, fds, base)
    for fd in fds[:4]:
        os.close(fd)
    status, cpu = None, 0.0
    while status is None:
        try:
            child, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if child == pid:
            status, cpu = st, ru.ru_utime + ru.ru_stime
    os.write(fds[4], json.dumps({"wait_status": status, "cpu": cpu}).encode() + b"\n")
    os._exit(0)  # the kernel now kills whatever else is left in the namespace


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _set_rlimits(lim: dict, nproc: int | None) -> None:
    """rlimits of the snippet; ``nproc`` None: RLIMIT_NPROC as high as it goes (a cgroup
    bounds the run's tasks, and NPROC would count the uid's processes node-wide)."""
    mb, cpu = 1 << 20, max(1, math.ceil(lim["cpu_seconds"]))
    for res, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, lim["memory_mb"] * mb, None),
        (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mb, None),
        (resource.RLIMIT_NOFILE, lim["open_files"], None),
        (resource.RLIMIT_CORE, 0, None),
    ) + (((resource.RLIMIT_NPROC, nproc, None),) if nproc is not None else ()):
        cur = resource.getrlimit(res)[1]
        hard = soft if hard is None else hard
        hard = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(res, (min(soft, hard), hard))
    if nproc is None:
        inf = resource.RLIM_INFINITY
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (inf, inf))
        except (OSError, ValueError):  # not allowed to raise the hard limit: up to it
            hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))


def _become_snippet(spec: dict, fds: list[int], base: frozenset) -> tuple:
    """In the snippet process: the code (from its memfd), session, stdio, rlimits, uid, cwd,
    env.  Nothing hostile ran yet."""
    lim, uid, workdir = spec["limits"], spec["uid"], spec["workdir"]
    code = _read_fd(fds[0]).decode("utf-8", "surrogatepass")
    os.setsid()
    for fd, target in zip(fds[1:], (0, 1, 2, 3), strict=True):  # stdin, out, err, status
        os.dup2(fd, target)
    os.closerange(4, 1 << 20)
    tasks_bounded = LAYERS["cgroup"] is not None and uid is not None
    _set_rlimits(lim, None if tasks_bounded else spec["nproc_base"] + lim["max_processes"])
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
            raise OSError("could not drop privileges")
    prctl(DUMPABLE, 1)  # its own /proc/self, as after an exec (a copy of the template only)
    prctl(_NO_NEW_PRIVS, 1)
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(spec["env"], HOME=workdir, TMPDIR=workdir)
    if LAYERS["fprog"] is not None:  # last: the calls above (setgroups...) are never denied
        _sys("prctl", _SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(LAYERS["fprog"]), 0, 0)
    os.write(3, b'{"ready": true}\n')
    os.close(3)
    return code, os.path.join(workdir, "snippet.py"), base


def set_layers(conf: str) -> None:
    """The seccomp program (hex of ``struct sock_filter[]``) and cgroup leaf of this zygote."""
    layers = json.loads(conf)
    if layers.get("seccomp"):
        prog = bytes.fromhex(layers["seccomp"])

        class SockFprog(ctypes.Structure):
            _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
        fprog._buf = buf  # type: ignore[attr-defined]  # the filter's memory lives with it
        LAYERS["fprog"] = fprog
    LAYERS["cgroup"] = layers.get("cgroup")


_KEPT_MODULES: list = []


def snippet_main(code: str, path: str, baseline: frozenset) -> None:
    """Top level of the snippet process (uid dropped, limits set): run the code as __main__."""
    # A fresh interpreter's module table: the zygote's imports leave it (kept alive, so
    # nothing is torn down here) and are imported afresh if the code wants them.
    _KEPT_MODULES.extend(sys.modules.pop(n) for n in list(sys.modules) if n not in baseline)
    atexit._clear()  # the zygote's exit handlers are not the snippet's
    try:  # the source, for tracebacks
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, code.encode("utf-8", "surrogatepass"))
        os.close(fd)
    except (OSError, ValueError):
        pass
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"], sys.argv[:] = main, [path]
    compiled, status = compile(code, path, "exec", dont_inherit=True), 0
    try:
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        import traceback  # on failure only; the module table is fresh anyway

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    # What the interpreter does at exit, minus tearing down the zygote's heap (slow):
    # join non-daemon threads, run the snippet's atexit handlers, flush, exit.
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = status or 120
    os._exit(status & 0xFF)
