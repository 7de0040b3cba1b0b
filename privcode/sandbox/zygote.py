"""The sandbox's zygote and snippet processes: standard library only.

Everything here runs in a zygote or a snippet; the parent (:mod:`privcode.sandbox.pool`)
uses only BOOT, ENV, send and recv.  A slot's zygote is
``python -S -s -P -c BOOT <this file> ns|plain <mnt> <layers JSON>``, which loads this file by path (no
site-packages; privcode is not importable there), serves one request per snippet on stdin
and answers on stdout (:func:`send`/:func:`recv`: one JSON line each), and forks each
snippet's process tree.  Hence the rules for this file: standard library only (an
import-linter contract in pyproject.toml), and few imports: each one is start-up time of
every zygote, and modules with at-fork hooks (random, threading: ``tempfile``,
``concurrent.futures``...) would triple the cost of each of its forks.

Isolation layers (``isolation == "namespaces+uid"``, mode ``ns``: the parent runs as root):

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
  processes too (the parent holds an ``flock`` per uid in /run/privcode-sandbox, and
  passes it to the zygote): concurrent sandboxes cannot signal each other nor share an
  RLIMIT_NPROC count.
* rlimits before the code runs: CPU, AS (memory), NPROC, FSIZE, NOFILE, CORE=0.
* A cgroup leaf per slot (:mod:`privcode.sandbox.cgroups`, when the cgroup filesystem is
  writable): the run's pid 1 joins it first, so memory (tmpfs and memfd pages included),
  tasks and CPU are bounded for the whole process tree, not per process.
* seccomp, last before the code runs: the BPF program the parent built with libseccomp
  (:mod:`privcode.sandbox.seccomp`: io_uring, bpf, userfaultfd, keys, perf, ptrace,
  namespaces, mounts, kexec, modules, handle-based opens... fail with EPERM).
* Wall clock: the zygote SIGKILLs the run's pid 1; the kernel then kills every
  process of the pid namespace, daemonised grandchildren included (pid 1 also dies
  with the zygote: parent-death signal); after a kill the zygote checks from the host
  that no process of the uid is left.
* Environment: only PATH=/usr/bin:/bin, LANG=C.UTF-8, HOME=TMPDIR=the work dir,
  PYTHONDONTWRITEBYTECODE=1, PYTHONHASHSEED=0.
* Output is read incrementally; past ``output_bytes`` on a stream the run is killed
  (status "output").  Code that does not ``compile()`` (checked in the parent:
  compiling runs nothing) never gets here (status "syntax").

NOT covered: kernel exploits (one shared kernel), side channels, denial of service
within the limits, the uid's kernel keyring (a channel between runs of one slot only).
/etc is readable: keep secrets out of world-readable files there.  On Kubernetes add
depth: execution pods with no network (deny-all NetworkPolicy), no service-account
token, ``readOnlyRootFilesystem``, capabilities dropped to SYS_ADMIN, SETUID, SETGID,
KILL (or ``runAsNonRoot`` and the fallback), optionally gVisor (``runtimeClassName``).

Mode ``plain`` (the rlimits-only fallback, not root): rlimits, own session and process
group, a temp dir and the scrubbed environment only.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import gc
import json
import math
import os
import resource
import select
import signal
import sys
import time
import types

ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
_TOP_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_NEWNS, _NEWUTS, _NEWIPC, _NEWPID, _NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000
_RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT = 1, 2, 4, 8, 32
_BIND, _REC, _PRIVATE = 4096, 16384, 1 << 18
_PDEATHSIG, _DUMPABLE, _NO_NEW_PRIVS, _SET_SECCOMP = 1, 4, 38, 22  # prctl options
_SECCOMP_MODE_FILTER = 2
_TAIL = 4096
# The zygote's entry: load this file by path and serve.  Only a forked snippet process
# gets past _zygote_main: it runs the code as __main__.
BOOT = (
    "import sys\nb = frozenset(sys.modules)\nimport importlib.util as u\n"
    "s = u.spec_from_file_location('_privcode_sandbox_zygote', sys.argv[1])\n"
    "m = u.module_from_spec(s)\nsys.modules[s.name] = m\ns.loader.exec_module(m)\n"
    "job = m._zygote_main(sys.argv[2], sys.argv[3], sys.argv[4], b)\n"
    "if job is not None:\n    m._snippet_main(*job)\n"
)


_LIBC = None
# The layers this zygote applies (set once by _zygote_main): the seccomp program as a ready
# ``struct sock_fprog`` (and its buffer, kept alive) and the slot's cgroup leaf.
_LAYERS: dict = {"fprog": None, "cgroup": None}


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


def send(fd: int, obj: dict) -> None:
    view = memoryview(json.dumps(obj).encode() + b"\n")  # JSON escapes newlines: one line
    while view:
        view = view[os.write(fd, view) :]


def recv(fd: int, deadline: float | None = None) -> dict | None:
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
    os.environ.update(ENV, HOME=workdir, TMPDIR=workdir)
    if _LAYERS["fprog"] is not None:  # last: the calls above (setgroups...) are never denied
        _sys("prctl", _SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(_LAYERS["fprog"]), 0, 0)
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
    for procs in (_LAYERS["cgroup"] or {}).get("procs", ()):  # first: all that follows counts
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)
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
                raise RuntimeError(f"cannot check the processes of sandbox uid {uid}")
            return attempt > 0
        _reap(0.002)
    raise RuntimeError(f"processes of sandbox uid {uid} survive SIGKILL")


def _monitor(pid: int, out_r: int, err_r: int, lim: dict, mode: str) -> dict:
    """Read capped output, enforce the wall clock, reap.  Returns the raw result."""
    cap, t0, grace = lim["output_bytes"], time.monotonic(), 5.0 if mode == "ns" else 0.3
    bufs, sizes, tail = {out_r: bytearray(), err_r: bytearray()}, {out_r: 0, err_r: 0}, bytearray()
    reason, exited, status, cpu, poller = None, None, None, 0.0, select.poll()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL) if mode == "ns" else os.killpg(pid, signal.SIGKILL)
        if (_LAYERS["cgroup"] or {}).get("kill"):  # v2: every task of the leaf at once
            with contextlib.suppress(OSError):
                fd = os.open(_LAYERS["cgroup"]["kill"], os.O_WRONLY)
                os.write(fd, b"1")
                os.close(fd)

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
        import tempfile  # plain mode only: it imports random (an at-fork hook per fork)

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
    oom_before = _oom_kills()
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
    res["oom"] = _oom_kills() > oom_before
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    res["ready"] = any(r.get("ready") for r in records)
    res["setup_error"] = next((r["setup_error"] for r in records if "setup_error" in r), None)
    if mode == "ns":  # the snippet's status, from its init (None: killed before it reported)
        res["wait_status"], res["cpu"] = None, 0.0
        for r in records:
            res.update(r if "wait_status" in r else {})
    return res


def _oom_kills() -> int:
    """OOM kills so far in the slot's cgroup leaf (0 without one)."""
    cg = _LAYERS["cgroup"]
    if not cg:
        return 0
    try:
        with open(cg["oom"][0], encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == cg["oom"][1]:
                    return int(value)
    except OSError:
        pass
    return 0


def _set_layers(conf: str) -> None:
    """The seccomp program (hex of ``struct sock_filter[]``) and cgroup leaf of this zygote."""
    layers = json.loads(conf)
    if layers.get("seccomp"):
        prog = bytes.fromhex(layers["seccomp"])

        class SockFprog(ctypes.Structure):
            _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

        buf = ctypes.create_string_buffer(prog, len(prog))
        fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
        fprog._buf = buf  # type: ignore[attr-defined]  # the filter's memory lives with it
        _LAYERS["fprog"] = fprog
    _LAYERS["cgroup"] = layers.get("cgroup")


def _zygote_main(mode: str, mnt: str, conf: str, baseline: frozenset) -> tuple | None:
    """The zygote's loop: one request in, one result out, per snippet, until EOF."""

    me = os.getpid()
    _set_layers(conf)
    os.umask(0o022)
    pidns = _setup_zygote_namespaces(mnt) if mode == "ns" else None
    gc.freeze()  # forked snippets' collections skip the zygote's objects (fewer copied pages)
    while (req := recv(0)) is not None:
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
            send(1, out)
        except OSError:  # the parent is gone
            return None
    return None


_KEPT_MODULES: list = []


def _snippet_main(code: str, path: str, baseline: frozenset) -> None:
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
