"""The sandbox in which ALL generated (hostile) Python code runs.

Stage II's execution filter and pass@k evaluation run model-written code; every
snippet is treated as hostile: it may try the network, read the private corpus or
secrets (and leak them through its output or whether it passes), write outside its
directory, fork-bomb, exhaust memory or disk, print gigabytes, ignore signals,
daemonise or kill other processes.  Snippets may use the standard library only
(the interpreter runs without site-packages: ``-S -s``).

API: :func:`run_code`, :class:`SandboxPool` (concurrent, order kept), :func:`check_file`,
:func:`isolation_level`; :class:`Verdict`, :class:`SandboxLimits`.  Layers
(``isolation == "namespaces+uid"``: running as root):

* Zygote: each slot has a long-lived ``python -S -s -P`` (scrubbed environment,
  stdlib-only imports) that forks per snippet: no interpreter start-up per snippet.
* Network: the zygote lives in a network namespace without interfaces (loopback
  down): no TCP/UDP, 127.0.0.1 included, no host abstract unix sockets.  Nothing
  persists there between runs (no process outlives a run; the uid cannot configure it).
* Fresh pid, mount and IPC namespaces per snippet: /proc is mounted anew with
  ``hidepid=invisible`` (no other process, nor its environ, is visible); SysV IPC
  objects die with the run.
* Filesystem: a plain chroot (the kernel then also refuses it user namespaces) into a
  minimal root: read-only nosuid binds of /usr, /etc, /bin, /sbin, /lib* and the
  interpreter's prefix; /dev with null, zero, full, random, urandom only; /tmp = the
  work dir (also HOME, TMPDIR, /dev/shm), a fresh size-limited tmpfs of the sandbox
  uid, mode 0700, gone with the run.  /work, /root, /home, /var, /run, /sys, the
  host's /tmp (Ray's sockets), Kubernetes tokens: absent.
* Unprivileged uid/gid ``61000 + slot``, no groups, ``PR_SET_NO_NEW_PRIVS`` (setuid
  binaries and ``setuid(0)`` do not help).  A slot owns its uid exclusively, across
  processes too (an ``flock`` per uid in /run/privcode-sandbox): concurrent
  sandboxes cannot signal each other nor share an RLIMIT_NPROC count.
* rlimits before the code runs: CPU, AS (memory), NPROC, FSIZE, NOFILE, CORE=0.
* Wall clock: the zygote SIGKILLs the run's pid 1; the kernel then kills every
  process of the pid namespace, daemonised grandchildren included (pid 1 also dies
  with the zygote: parent-death signal); after a kill the zygote checks from the host
  that no process of the uid is left.
* Environment: only PATH=/usr/bin:/bin, LANG=C.UTF-8, HOME=TMPDIR=the work dir,
  PYTHONDONTWRITEBYTECODE=1, PYTHONHASHSEED=0.
* Output is read incrementally; past ``output_bytes`` on a stream the run is killed
  (status "output").  Code that does not ``compile()`` (in the parent: compiling runs
  nothing) never runs (status "syntax").

NOT covered: kernel exploits (one shared kernel), side channels, denial of service
within the limits, the uid's kernel keyring (a channel between runs of one slot only).
/etc is readable: keep secrets out of world-readable files there.  On Kubernetes add
depth: execution pods with no network (deny-all NetworkPolicy), no service-account
token, ``readOnlyRootFilesystem``, capabilities dropped to SYS_ADMIN, SETUID, SETGID,
KILL (or ``runAsNonRoot`` and the fallback), optionally gVisor (``runtimeClassName``).

Fallback, never silent (a ``RuntimeWarning`` and an error log, once per process): not
root (a laptop): ``"rlimits-only"``: rlimits, own session and process group, a temp
dir and a scrubbed environment only; the code can use the network, read what you can
read, write where you can, and a daemon escapes the kill.  Root without namespace
support (no CAP_SYS_ADMIN) is refused rather than run hostile code as root.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import ctypes
import fcntl
import json
import math
import os
import resource
import select
import signal
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Parent-side modules (subprocess, logging, tempfile, concurrent.futures...) are imported
# lazily: the zygote loads this file too, and the at-fork hooks of random and threading
# would triple the cost of each of its forks.

NAMESPACES, RLIMITS_ONLY = "namespaces+uid", "rlimits-only"
STATUSES = ("ok", "error", "timeout", "cpu", "memory", "output", "killed", "syntax")
UID_BASE, UID_SPAN = 61000, 1000
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
_TOP_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_NEWNS, _NEWUTS, _NEWIPC, _NEWPID, _NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
_RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT = 1, 2, 4, 8, 32
_BIND, _REC, _PRIVATE = 4096, 16384, 1 << 18
_PDEATHSIG, _DUMPABLE, _NO_NEW_PRIVS = 1, 4, 38  # prctl options
_TAIL = 4096
# The zygote: load this file by path (no site-packages; privcode is not importable) and
# serve.  Only a forked snippet process gets past _zygote_main: it runs the code as main.
_BOOT = (
    "import sys\nb = frozenset(sys.modules)\nimport importlib.util as u\n"
    "s = u.spec_from_file_location('_privcode_sandbox_zygote', sys.argv[1])\n"
    "m = u.module_from_spec(s)\nsys.modules[s.name] = m\ns.loader.exec_module(m)\n"
    "job = m._zygote_main(sys.argv[2], sys.argv[3], b)\n"
    "if job is not None:\n    m._snippet_main(*job)\n"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup, zygote crash): the snippet's verdict is unknown."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-snippet limits.  ``disk_mb`` sizes the private /tmp (namespaces level)."""

    cpu_seconds: float = 5
    wall_seconds: float = 10
    memory_mb: int = 512
    max_processes: int = 32
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 65536
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class Verdict:
    """Outcome of one snippet: ``status`` is one of :data:`STATUSES`, ``passed`` iff "ok"."""

    passed: bool
    status: str
    seconds: float
    returncode: int | None
    stdout: str
    stderr: str
    isolation: str
    error: str | None = None  # exception type name from the last traceback, if any

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- zygote side

_LIBC = None


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


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    _sys(
        "mount",
        *(x.encode() if x else None for x in (src, dst, fstype)),
        flags,
        data.encode() if data else None,
    )


def _unshare(flags: int) -> None:
    os.unshare(flags) if hasattr(os, "unshare") else _sys("unshare", flags)  # 3.12+ / ctypes


def _send(fd: int, obj: dict) -> None:
    view = memoryview(json.dumps(obj).encode() + b"\n")  # JSON escapes newlines: one line
    while view:
        view = view[os.write(fd, view) :]


def _recv(fd: int, deadline: float | None = None) -> dict | None:
    """One JSON line; one message is in flight at a time, so no read spans two."""
    data = b""
    while not data.endswith(b"\n"):
        if (
            deadline is not None
            and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
        ):
            raise TimeoutError("no answer from the sandbox zygote")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _setup_zygote_namespaces(mnt: str) -> int:
    """Once per zygote: own net/uts/mount namespaces, the read-only skeleton root at ``mnt``.

    Returns an fd of the zygote's own pid namespace (to reset after each run's unshare).
    """
    _unshare(_NEWNS | _NEWNET | _NEWUTS)
    _sys("sethostname", b"sandbox", 7)
    _mount(None, "/", None, _REC | _PRIVATE)
    _mount("tmpfs", mnt, "tmpfs", _NOSUID | _NODEV, "mode=0755,size=1m,nr_inodes=1024")
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
            _mount(path, mnt + path, None, _BIND)
            _mount(None, mnt + path, None, _BIND | _REMOUNT | _RDONLY | _NOSUID | _NODEV)
            bound.append(path)
    os.mkdir(mnt + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        os.close(os.open(f"{mnt}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
        _mount("/dev/" + name, f"{mnt}/dev/{name}", None, _BIND)
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
    _mount(None, mnt, None, _REMOUNT | _RDONLY | _NOSUID | _NODEV)
    return os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)


def _become_snippet(spec: dict, baseline: frozenset) -> tuple:
    """In the snippet process: session, stdio, rlimits, uid, cwd, env.  Nothing hostile ran yet."""
    lim, uid, workdir = spec["limits"], spec["uid"], spec["workdir"]
    os.setsid()
    for fd, target in zip(spec["fds"], (0, 1, 2, 3), strict=True):  # stdin, out, err, status
        os.dup2(fd, target)
    os.closerange(4, 1 << 20)
    mb, cpu = 1 << 20, max(1, math.ceil(lim["cpu_seconds"]))
    for res, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, lim["memory_mb"] * mb, None),
        (resource.RLIMIT_NPROC, spec["nproc_base"] + lim["max_processes"], None),
        (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mb, None),
        (resource.RLIMIT_NOFILE, lim["open_files"], None),
        (resource.RLIMIT_CORE, 0, None),
    ):
        cur = resource.getrlimit(res)[1]
        hard = soft if hard is None else hard
        hard = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(res, (min(soft, hard), hard))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
            raise OSError("could not drop privileges")
        _sys("prctl", _DUMPABLE, 1, 0, 0, 0)  # its own /proc/self, as after an exec
    _sys("prctl", _NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(workdir)
    os.umask(0o077)
    os.environ.clear()
    os.environ.update(_ENV, HOME=workdir, TMPDIR=workdir)
    os.write(3, b'{"ready": true}\n')
    os.close(3)
    return spec["code"], os.path.join(workdir, "snippet.py"), baseline


def _child(st_w: int, fn, *args):
    """Run a forked child's role; on failure report it and _exit, never unwind into the zygote."""
    try:
        return fn(*args)
    except BaseException as exc:
        try:
            os.write(
                st_w, json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n"
            )
        finally:
            os._exit(70)


def _ns_init(spec: dict, baseline: frozenset):
    """pid 1 of the run's pid namespace: new mount + IPC namespaces, a fresh /tmp and /proc,
    chroot; then fork the snippet, reap, report its status and exit (killing the rest)."""
    _sys("prctl", _PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    mnt, uid = spec["mnt"], spec["uid"]
    _unshare(_NEWNS | _NEWIPC)
    _mount(
        "tmpfs",
        mnt + "/tmp",
        "tmpfs",
        _NOSUID | _NODEV,
        f"mode=0700,uid={uid},gid={uid},size={spec['limits']['disk_mb']}m,nr_inodes=16384",
    )
    for opts in ("hidepid=invisible", "hidepid=2", ""):  # invisible: Linux 5.8+
        try:
            _mount("proc", mnt + "/proc", "proc", _NOSUID | _NODEV | _NOEXEC, opts)
            break
        except OSError:
            if not opts:
                raise
    os.chroot(mnt)  # a plain chroot: the kernel then refuses it new user namespaces
    os.chdir("/")
    pid = os.fork()
    if pid == 0:
        return _child(spec["fds"][3], _become_snippet, spec, baseline)
    for fd in spec["fds"][:3]:
        os.close(fd)
    status, cpu = None, 0.0
    while status is None:
        try:
            child, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if child == pid:
            status, cpu = st, ru.ru_utime + ru.ru_stime
    os.write(spec["fds"][3], json.dumps({"wait_status": status, "cpu": cpu}).encode() + b"\n")
    os._exit(0)  # the kernel now kills whatever else is left in the namespace


def _reap(block_s: float = 0.0) -> None:
    """Reap whatever children of the zygote have finished (waiting up to ``block_s``)."""
    end = time.monotonic() + block_s
    try:
        while os.waitpid(-1, os.WNOHANG)[0] != 0 or time.monotonic() < end:
            time.sleep(0.001)
    except ChildProcessError:
        pass


def _sweep(uid: int) -> bool:
    """From the host: SIGKILL every process of ``uid`` until none is left.  True if any was.

    Detection: a child running as ``uid`` with RLIMIT_NPROC=2 can fork iff no other process
    (zombies included) of ``uid`` exists.  (kill(-1) cannot tell: it returns 0 regardless.)
    """
    for attempt in range(1000):
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                resource.setrlimit(resource.RLIMIT_NPROC, (2, 2))
                os.setresuid(uid, uid, uid)
                try:
                    code = 0 if os.fork() == 0 else os.wait()[1] and 2
                except BlockingIOError:
                    os.kill(-1, signal.SIGKILL)
                    code = 1
            finally:
                os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 1:
            if code != 0:
                raise SandboxError(f"cannot check the processes of sandbox uid {uid}")
            return attempt > 0
        _reap(0.002)
    raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL")


def _monitor(pid: int, out_r: int, err_r: int, lim: dict, mode: str) -> dict:
    """Read capped output, enforce the wall clock, reap.  Returns the raw result."""
    cap, t0, grace = lim["output_bytes"], time.monotonic(), 5.0 if mode == "ns" else 0.3
    bufs, sizes, tail = {out_r: bytearray(), err_r: bytearray()}, {out_r: 0, err_r: 0}, bytearray()
    reason, exited, status, cpu, poller = None, None, None, 0.0, select.poll()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL) if mode == "ns" else os.killpg(pid, signal.SIGKILL)

    try:
        pidfd = os.pidfd_open(pid)  # Linux 5.3+: wakes us at exit; else 10 ms ticks
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):
        pidfd = None
    for fd in (out_r, err_r, 0):  # 0: the parent's requests; an event mid-run = it is gone
        poller.register(fd, select.POLLIN)
    open_fds = {out_r, err_r}
    while exited is None or (open_fds and time.monotonic() < exited + grace):
        now = time.monotonic()  # after the exit, plain mode stops soon: a daemon may hold a pipe
        if exited is None and reason is None and now >= t0 + lim["wall_seconds"]:
            reason = "timeout"
            kill()
        end = exited + grace if exited is not None else t0 + lim["wall_seconds"]
        wait = end - now if exited is not None or reason is None else 0.05
        for fd, _ in poller.poll(max(0.0, wait if pidfd is not None else min(wait, 0.01)) * 1000):
            if fd == 0:
                poller.unregister(0)
                reason = reason or "killed"
                if exited is None:
                    kill()
            elif fd != pidfd and not (chunk := os.read(fd, 65536)):
                poller.unregister(fd)
                open_fds.discard(fd)
            elif fd != pidfd:
                sizes[fd] += len(chunk)
                bufs[fd] += chunk[: max(0, cap - len(bufs[fd]))]
                tail = (tail + chunk)[-_TAIL:] if fd == err_r else tail
                if sizes[fd] > cap and reason is None:
                    reason = "output"
                    if exited is None:
                        kill()
        if exited is None and (done := os.wait4(pid, os.WNOHANG))[0]:
            exited, status, cpu = time.monotonic(), done[1], done[2].ru_utime + done[2].ru_stime
            if pidfd is not None:
                poller.unregister(pidfd)
                os.close(pidfd)
                pidfd = None
            if mode != "ns":
                kill()  # the rest of its process group
            _reap()
    return {
        "reason": reason,
        "seconds": exited - t0,
        "wait_status": status,
        "cpu": cpu,
        "stdout": bufs[out_r].decode("utf-8", "replace"),
        "stderr": bufs[err_r].decode("utf-8", "replace"),
        "stderr_tail": tail.decode("utf-8", "replace") if sizes[err_r] > cap else None,
    }


def _zygote_run(req: dict, mode: str, mnt: str, pidns: int | None, baseline: frozenset):
    """One snippet: fork its process tree, monitor it, collect the result (in the zygote)."""
    lim, uid = req["limits"], (req["uid"] if mode == "ns" else None)
    (out_r, out_w), (err_r, err_w), (st_r, st_w) = os.pipe(), os.pipe(), os.pipe()
    mfd = os.memfd_create("privcode-sandbox-stdin", os.MFD_CLOEXEC)
    os.write(mfd, (req.get("stdin") or "").encode("utf-8", "surrogatepass"))
    in_fd = os.open(f"/proc/self/fd/{mfd}", os.O_RDONLY | os.O_CLOEXEC)  # read-only for it
    os.close(mfd)
    workdir, nproc = "/tmp", 0
    if mode != "ns":
        import tempfile

        workdir = tempfile.mkdtemp(prefix="privcode-sbx-")
        if os.getuid() != 0:  # RLIMIT_NPROC counts all the user's processes: add them
            for p in filter(str.isdigit, os.listdir("/proc")):
                try:
                    nproc += os.stat(f"/proc/{p}").st_uid == os.getuid()
                except OSError:
                    pass
    spec = {
        "code": req["code"],
        "limits": lim,
        "uid": uid,
        "workdir": workdir,
        "fds": (in_fd, out_w, err_w, st_w),
        "nproc_base": nproc,
        "mnt": mnt,
    }
    if mode == "ns":
        _unshare(_NEWPID)  # the next child is pid 1 of a new pid namespace
    try:
        pid = os.fork()
    finally:
        if mode == "ns" and os.getpid() != 1:
            _sys("setns", pidns, _NEWPID)  # the zygote's later children stay in its own
    if pid == 0:
        for fd in (out_r, err_r, st_r) + ((pidns,) if pidns is not None else ()):
            os.close(fd)
        return _child(st_w, _ns_init if mode == "ns" else _become_snippet, spec, baseline)
    for fd in (in_fd, out_w, err_w, st_w):
        os.close(fd)
    try:
        res, lines = _monitor(pid, out_r, err_r, lim, mode), b""
        while chunk := os.read(st_r, 65536):
            lines += chunk
    finally:
        for fd in (out_r, err_r, st_r):
            os.close(fd)
        if mode != "ns":
            import shutil

            shutil.rmtree(workdir, onerror=lambda f, p, e: os.path.isdir(p) and os.chmod(p, 0o700))
            shutil.rmtree(workdir, ignore_errors=True)
    if uid is not None and res["reason"] is not None:
        res["survivors"] = _sweep(uid)
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    res["ready"] = any(r.get("ready") for r in records)
    res["setup_error"] = next((r["setup_error"] for r in records if "setup_error" in r), None)
    if mode == "ns":  # the snippet's status, from its init (None: killed before it reported)
        res["wait_status"], res["cpu"] = None, 0.0
        for r in records:
            res.update(r if "wait_status" in r else {})
    return res


def _zygote_main(mode: str, mnt: str, baseline: frozenset) -> tuple | None:
    """The zygote's loop: one request in, one result out, per snippet, until EOF."""
    import gc

    me = os.getpid()
    os.umask(0o022)
    pidns = _setup_zygote_namespaces(mnt) if mode == "ns" else None
    gc.freeze()  # forked snippets' collections skip the zygote's objects (fewer copied pages)
    while (req := _recv(0)) is not None:
        try:
            out = (
                {"survivors": _sweep(req["sweep"])}
                if "sweep" in req
                else _zygote_run(req, mode, mnt, pidns, baseline)
            )
        except BaseException as exc:
            if os.getpid() != me:  # never let a forked child carry on as a zygote
                os._exit(70)
            out = {"fatal": f"{type(exc).__name__}: {exc}"}
        if isinstance(out, tuple):
            return out  # the snippet process, on its way to _snippet_main
        try:
            _send(1, out)
        except OSError:  # the parent is gone
            return None
    return None


_KEPT_MODULES: list = []


def _snippet_main(code: str, path: str, baseline: frozenset) -> None:
    """Top level of the snippet process (uid dropped, limits set): run the code as __main__."""
    import builtins
    import types

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
        import traceback

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


# ----------------------------------------------------------------------------- parent side


def _log():
    import logging

    return logging.getLogger(__name__)


def _state_dir() -> str:
    """A 0700 directory of ours for the per-uid locks and the zygotes' mount point."""
    import tempfile

    for base in ("/run", tempfile.gettempdir()):
        path = os.path.join(base, "privcode-sandbox")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            os.makedirs(os.path.join(path, "mnt"), mode=0o700, exist_ok=True)
            return path
    raise SandboxError(
        "no safe state directory for the sandbox (tried /run/privcode-sandbox "
        "and privcode-sandbox in the temp dir: must be ours, mode 0700)"
    )


class _Slot:
    """One sandbox slot: an exclusive uid and a zygote (started on first use), one run at a time."""

    def __init__(self, index: int) -> None:
        self.index, self.lock, self.proc, self.uid, self._lock_fd = (
            index,
            _thread.allocate_lock(),
            None,
            None,
            None,
        )
        self.owner = os.getpid()

    def _start(self, level: str) -> None:
        import subprocess

        mnt = "-"
        if level == NAMESPACES:  # uid = first free of 61000+index, 61000+index+1, ...
            lock_dir, mnt = _state_dir(), os.path.join(_state_dir(), "mnt")
            for i in range(UID_SPAN):
                uid = UID_BASE + (self.index + i) % UID_SPAN
                fd = os.open(
                    os.path.join(lock_dir, f"uid-{uid}.lock"),
                    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by us and the zygote
                    self.uid, self._lock_fd = uid, fd
                    break
                except BlockingIOError:
                    os.close(fd)
            else:
                raise SandboxError(f"all {UID_SPAN} sandbox uids from {UID_BASE} are in use")
        try:  # the real binary: a pyenv shim would not start as another uid
            self.proc = subprocess.Popen(
                [
                    os.path.realpath(sys.executable),
                    "-S",
                    "-s",
                    "-P",
                    "-c",
                    _BOOT,
                    os.path.realpath(__file__),
                    "ns" if level == NAMESPACES else "plain",
                    mnt,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=_ENV,
                cwd="/",
                pass_fds=() if self._lock_fd is None else (self._lock_fd,),
                start_new_session=True,
            )
            if self.uid is not None:  # leftovers of a crashed previous owner of this uid
                self._request({"sweep": self.uid}, 60.0)
        except BaseException:
            self.close(kill=True)
            raise

    def _request(self, req: dict, timeout: float) -> dict:
        try:
            _send(self.proc.stdin.fileno(), req)
            res = _recv(self.proc.stdout.fileno(), time.monotonic() + timeout)
        except (OSError, TimeoutError) as exc:
            raise SandboxError(f"sandbox zygote failed: {exc}") from exc
        if res is None:
            raise SandboxError(f"sandbox zygote exited unexpectedly (code {self.proc.poll()})")
        if "fatal" in res:
            raise SandboxError(f"sandbox zygote error: {res['fatal']}")
        return res

    def run(self, code: str, stdin: str, limits: SandboxLimits, level: str) -> dict:
        if self.owner != os.getpid():  # forked: the zygote and the uid are the parent's
            self.__init__(self.index)
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self.close()
                    self._start(level)
                res = self._request(
                    {"code": code, "stdin": stdin, "uid": self.uid, "limits": asdict(limits)},
                    limits.wall_seconds + 60.0,
                )
                if not res["ready"] and res["reason"] is None:
                    raise SandboxError(
                        f"sandbox setup failed ({level}): "
                        f"{res['setup_error'] or 'no report from the sandbox'}"
                    )
            except BaseException:
                self.close(kill=True)  # a fresh zygote next time
                raise
        if res.get("survivors"):
            _log().error(
                "processes of sandbox uid %s outlived their pid namespace; killed", self.uid
            )
        return res

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                if kill:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.stdin.close()  # EOF: the zygote exits
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - whatever went wrong, make sure it is gone
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            proc.stdout.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self.uid, self._lock_fd = None, None


_LEVEL: str | None = None
_WARNED = False
_LEVEL_LOCK, _SLOTS_LOCK = _thread.allocate_lock(), _thread.allocate_lock()
_SLOTS: dict[int, _Slot] = {}


def isolation_level() -> str:
    """ "namespaces+uid" (root, and one trivial snippet ran so) or "rlimits-only"."""
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            _LEVEL = RLIMITS_ONLY
            if os.geteuid() == 0:
                probe = _Slot(UID_SPAN - 1)
                try:
                    if (
                        probe.run("pass", "", SandboxLimits(wall_seconds=30), NAMESPACES)[
                            "wait_status"
                        ]
                        == 0
                    ):
                        _LEVEL = NAMESPACES
                except (OSError, SandboxError) as exc:
                    _log().error("the namespaces+uid sandbox does not work here: %s", exc)
                finally:
                    probe.close()
        return _LEVEL


def _checked_level() -> str:
    """The level; refuses root without isolation, warns (once) about the weak fallback."""
    global _WARNED
    level = isolation_level()
    if level != NAMESPACES and os.geteuid() == 0:
        raise SandboxError(
            "refusing to run generated code as root without isolation: the "
            "namespaces+uid sandbox does not work here (needs CAP_SYS_ADMIN, "
            "CAP_SETUID/SETGID; see the log); run as an unprivileged user for "
            "the weaker rlimits-only fallback"
        )
    if level != NAMESPACES and not _WARNED:
        import warnings

        _WARNED = True
        msg = (
            "privcode sandbox isolation is WEAKER than designed (rlimits-only: not running "
            "as root): rlimits, own process group, temp dir and scrubbed environment ONLY; "
            "NO network or filesystem isolation, the code can read and write what this user "
            "can and escape the kill by daemonising. Do not run untrusted generated code "
            "like this: run as root (namespaces+uid) or in a locked-down pod."
        )
        _log().error(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return level


def _exception_name(text: str) -> str | None:
    """Type name on the last traceback's final line (``json.decoder.X: msg`` -> ``X``)."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")]
    for ln in reversed(lines[starts[-1] + 1 :] if starts else []):
        if ln and not ln[0].isspace():
            head = ln.split(":", 1)[0].strip()
            return head.rsplit(".", 1)[-1] if head.replace(".", "_").isidentifier() else None
    return None


def _verdict(res: dict, limits: SandboxLimits, level: str) -> Verdict:
    st, err, tail = res["wait_status"], res["stderr"], res["stderr_tail"] or res["stderr"]
    rc, error = (None if st is None else os.waitstatus_to_exitcode(st)), _exception_name(tail)
    if res["reason"] in ("timeout", "output", "killed"):
        status = res["reason"]
    elif rc is not None and rc < 0:  # killed by signal -rc
        if -rc == signal.SIGXCPU or (
            -rc == signal.SIGKILL and res["cpu"] >= max(1, math.ceil(limits.cpu_seconds))
        ):
            status = "cpu"
        else:
            status = "memory" if "MemoryError" in tail else "killed"
    elif rc == 0:
        status = "ok"
    else:
        status = "memory" if error == "MemoryError" else "error"
    return Verdict(
        status == "ok", status, round(res["seconds"], 4), rc, res["stdout"], err, level, error
    )


def _run(slot: _Slot, code: str, stdin: str, limits: SandboxLimits, level: str) -> Verdict:
    try:
        compile(code, "<snippet>", "exec", dont_inherit=True)  # compiling runs nothing
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as exc:
        return Verdict(
            False,
            "syntax",
            0.0,
            None,
            "",
            f"{type(exc).__name__}: {exc}",
            level,
            type(exc).__name__,
        )
    return _verdict(slot.run(code, stdin, limits, level), limits, level)


def run_code(
    code: str, limits: SandboxLimits = DEFAULT_LIMITS, *, stdin: str = "", slot: int = 0
) -> Verdict:
    """Run one snippet in the sandbox of ``slot`` (its own uid and zygote); see the module doc."""
    level = _checked_level()
    with _SLOTS_LOCK:
        s = _SLOTS.setdefault(slot, _Slot(slot))
    return _run(s, code, stdin, limits, level)


def check_file(path: str | os.PathLike, limits: SandboxLimits = DEFAULT_LIMITS) -> dict:
    """Run a Python file in the sandbox: {file, passed, status, seconds, error, isolation}."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return file_result(path, run_code(fh.read(), limits))


def file_result(path: str | os.PathLike, v: Verdict) -> dict:
    return {
        "file": os.fspath(path),
        "passed": v.passed,
        "status": v.status,
        "seconds": v.seconds,
        "error": v.error,
        "isolation": v.isolation,
    }


class SandboxPool:
    """Runs many snippets concurrently: ``workers`` slots, each its own uid and zygote."""

    def __init__(self, workers: int | None = None, limits: SandboxLimits = DEFAULT_LIMITS) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        self.workers = workers or len(os.sched_getaffinity(0))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.limits, self.level = limits, _checked_level()
        self._slots = [_Slot(i) for i in range(self.workers)]
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for s in self._slots:
            self._free.put(s)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="privcode-sandbox")
        self._closed = False

    def run(self, code: str, stdin: str = "") -> Verdict:
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        slot = self._free.get()
        try:
            return _run(slot, code, stdin, self.limits, self.level)
        finally:
            self._free.put(slot)

    def map(self, codes: Sequence[str], stdins: Sequence[str] | None = None) -> list[Verdict]:
        """Verdicts in the order of ``codes`` (``stdins``: one stdin text per code)."""
        stdins = [""] * len(codes) if stdins is None else list(stdins)
        if len(stdins) != len(codes):
            raise ValueError("stdins must have one entry per code")
        return list(self._executor.map(self.run, codes, stdins))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True)
            for s in self._slots:
                s.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_slots() -> None:
    with _SLOTS_LOCK:
        slots = list(_SLOTS.values())
        _SLOTS.clear()
    for s in slots:
        s.close()
