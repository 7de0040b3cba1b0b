"""The sandbox's zygote, template and snippet processes: standard library only.
Design notes: docs/kubernetes.md, "privcode/sandbox/zygote.py".

The parent (:mod:`privcode.sandbox.pool`) uses only BOOT, ENV, send and recv. A slot's zygote is
``python -S -s -P -c BOOT <this file> ns|plain <mnt> <layers JSON>``, serving one request per
snippet, one JSON line each way (:func:`send`/:func:`recv`). Rules for this file: standard
library only (an import-linter contract in pyproject.toml) and few imports (start-up time of
every zygote; modules with at-fork hooks would triple the cost of each fork).

The zygote forks, before its first request, a *template* that never handles request data; each
run is a copy of the template (its code: :mod:`privcode.sandbox.spawn`), so nothing of an
earlier run, nor the zygote's heap, is in its memory. Layers of mode ``ns`` (the parent is
root): a network namespace without interfaces, fresh pid, mount, IPC and cgroup namespaces, a
chroot into a minimal read-only root with a fresh tmpfs /tmp, an unprivileged uid per slot,
rlimits, the slot's cgroup leaf, seccomp last, a wall-clock kill of the pid namespace, a
scrubbed environment and capped output. NOT covered: kernel exploits, side channels, denial of
service within the limits, the uid's kernel keyring; /etc is readable. Mode ``plain``
(rlimits-only, not root): VERDICTS CAN BE FORGED.

"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import time

ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
_TAIL = 4096
# The zygote's entry: load this file, then spawn.py beside it, by path and serve.  Only a
# snippet process (a fork of the template) gets past _zygote_main: it runs the code as __main__.
BOOT = (
    "import sys\nb = frozenset(sys.modules)\nimport importlib.util as u\n"
    "def load(name, path):\n    s = u.spec_from_file_location(name, path)\n"
    "    m = u.module_from_spec(s)\n    sys.modules[name] = m\n    s.loader.exec_module(m)\n"
    "    return m\n"
    "z = load('_privcode_sandbox_zygote', sys.argv[1])\n"
    "p = load('_privcode_sandbox_spawn', sys.argv[1].rpartition('/')[0] + '/spawn.py')\n"
    "job = z._zygote_main(p, sys.argv[2], sys.argv[3], sys.argv[4], b)\n"
    "if job is not None:\n    p.snippet_main(*job)\n"
)
sp = None  # privcode.sandbox.spawn, in the zygote (_zygote_main); unused by the parent


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


def _monitor(tpl, out_r: int, err_r: int, lim: dict, mode: str) -> dict:
    """Read capped output, enforce the wall clock, until the run is over: its pid 1 gone (mode
    ns: its pidfd, readable once its pid namespace is empty) or the template's report (mode
    plain: sent after it killed the run's daemons).  Returns the raw result."""
    cap, t0, grace = lim["output_bytes"], time.monotonic(), 5.0 if mode == "ns" else 0.3
    bufs, sizes, tail = {out_r: bytearray(), err_r: bytearray()}, {out_r: 0, err_r: 0}, bytearray()
    reason, exited, status, cpu, poller = None, None, None, 0.0, select.poll()
    run: dict = {"pid": None, "pidfd": None}

    def kill() -> None:  # before the template said which pid: when it does
        if run["pidfd"] is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(run["pidfd"], signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run["pid"], signal.SIGKILL) if mode != "ns" else None  # its group
        if (sp.LAYERS["cgroup"] or {}).get("kill"):  # v2: every task of the leaf at once
            with contextlib.suppress(OSError):
                sp.write_file(sp.LAYERS["cgroup"]["kill"], b"1")

    # 0: the parent's requests (an event mid-run = it is gone); tpl: the template's reports
    for fd in (out_r, err_r, 0, tpl.fileno()):
        poller.register(fd, select.POLLIN)
    open_fds = {out_r, err_r}
    try:
        while exited is None or (open_fds and time.monotonic() < exited + grace):
            now = time.monotonic()
            if exited is None and reason is None and now >= t0 + lim["wall_seconds"]:
                reason = "timeout"
                kill()
            end = exited + grace if exited is not None else t0 + lim["wall_seconds"]
            wait = end - now if exited is not None or reason is None else 0.05
            for fd, _ in poller.poll(max(0.0, wait) * 1000):
                if fd == 0:
                    poller.unregister(0)
                    reason = reason or "killed"
                    if exited is None:
                        kill()
                elif fd == tpl.fileno():
                    msg = _template_report(tpl, run)
                    if "pid" in msg and mode == "ns":
                        poller.register(run["pidfd"], select.POLLIN)
                    if "pid" in msg and reason is not None:
                        kill()
                    elif "cpu" in msg:
                        poller.unregister(fd)
                        exited = exited or time.monotonic()
                        status, cpu = msg["wait_status"], msg["cpu"]
                elif fd == run["pidfd"]:
                    poller.unregister(fd)
                    exited = exited or time.monotonic()
                elif not (chunk := os.read(fd, 65536)):
                    poller.unregister(fd)
                    open_fds.discard(fd)
                else:
                    sizes[fd] += len(chunk)
                    bufs[fd] += chunk[: max(0, cap - len(bufs[fd]))]
                    tail = (tail + chunk)[-_TAIL:] if fd == err_r else tail
                    if sizes[fd] > cap and reason is None:
                        reason = "output"
                        if exited is None:
                            kill()
    finally:
        if run["pidfd"] is not None:
            os.close(run["pidfd"])
    return {
        "reason": reason,
        "seconds": exited - t0,
        "wait_status": status,
        "cpu": cpu,
        "stdout": bufs[out_r].decode("utf-8", "replace"),
        "stderr": bufs[err_r].decode("utf-8", "replace"),
        "stderr_tail": tail.decode("utf-8", "replace") if sizes[err_r] > cap else None,
    }


# Reports the template still owes (one per run, after the run's pid and its end): mode ns
# answers at its pid 1's end, and takes the run's report before the next run.
_OWED = {"reports": 0}


def _template_report(tpl, run: dict) -> dict:
    """The template's next report of a run: its pid (and pidfd, into ``run``) or its end."""
    msg, fds = sp.recv_msg(tpl)
    if msg is None or "fatal" in msg:
        raise RuntimeError(f"sandbox template: {(msg or {}).get('fatal', 'exited')}")
    if "pid" in msg:
        if len(fds) != 1:
            raise RuntimeError("sandbox template: no pidfd with the pid")
        run["pid"], run["pidfd"] = msg["pid"], fds[0]
    else:
        _OWED["reports"] -= 1
    return msg


def _memfd(text: str) -> int:
    """A read-only fd of a memfd holding ``text`` (the run cannot change it for the next)."""
    mfd = os.memfd_create("privcode-sandbox", os.MFD_CLOEXEC)
    try:
        os.write(mfd, text.encode("utf-8", "surrogatepass"))
        return os.open(f"/proc/self/fd/{mfd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(mfd)


def _plain_workdir() -> tuple[str, int]:
    """Mode plain: a temp dir, and the processes of this user (RLIMIT_NPROC counts them)."""
    import tempfile  # plain mode only: it imports random (an at-fork hook)

    nproc = 0
    if os.getuid() != 0:
        for p in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                nproc += os.stat(f"/proc/{p}").st_uid == os.getuid()
    return tempfile.mkdtemp(prefix="privcode-sbx-"), nproc


def _zygote_run(req: dict, mode: str, mnt: str, tpl) -> dict:
    """One snippet: hand its fds to the template, monitor the run, collect the result."""
    lim, uid = req["limits"], (req["uid"] if mode == "ns" else None)
    workdir, nproc = ("/tmp", 0) if mode == "ns" else _plain_workdir()
    spec = {
        "limits": lim,
        "uid": uid,
        "workdir": workdir,
        "nproc_base": nproc,
        "mnt": mnt,
        "env": ENV,
    }
    (out_r, out_w), (err_r, err_w), (st_r, st_w) = os.pipe(), os.pipe(), os.pipe()
    try:
        theirs = [_memfd(req["code"]), _memfd(req.get("stdin") or ""), out_w, err_w, st_w]
        while _OWED["reports"]:  # the end of the previous run (its pid 1 is gone already)
            _template_report(tpl, {})
        oom_before = _oom_kills()
        try:
            sp.send_msg(tpl, spec, theirs)
            _OWED["reports"] = 1
        finally:
            for fd in theirs:
                os.close(fd)
        res, lines = _monitor(tpl, out_r, err_r, lim, mode), b""
        while chunk := os.read(st_r, 65536):
            lines += chunk
    finally:
        for fd in (out_r, err_r, st_r):
            os.close(fd)
        if mode != "ns":
            import shutil

            shutil.rmtree(workdir, onerror=lambda f, p, e: os.path.isdir(p) and os.chmod(p, 0o700))
            shutil.rmtree(workdir, ignore_errors=True)
    if res["reason"] is not None:
        _drain_cgroup()
    res["oom"] = _oom_kills() > oom_before
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    res["ready"] = any(r.get("ready") for r in records)
    res["setup_error"] = next((r["setup_error"] for r in records if "setup_error" in r), None)
    if mode == "ns":  # the snippet's status, from its init (None: killed before it reported)
        res["wait_status"], res["cpu"] = None, 0.0
        for r in records:
            res.update(r if "wait_status" in r else {})
    return res


def _drain_cgroup() -> None:
    """After a kill: the slot's leaf must be empty.  Only this slot's runs join it, so what is
    left there is the run's: SIGKILL it (``cgroup.kill`` too) until the leaf is empty."""
    cg = sp.LAYERS["cgroup"]
    for _ in range(500 if cg else 0):
        pids = set()
        for procs in cg["procs"]:
            with open(procs, "rb") as fh:
                pids.update(int(p) for p in fh.read().split())
        if not pids:
            return
        if cg.get("kill"):
            sp.write_file(cg["kill"], b"1")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    if cg:
        raise RuntimeError("processes of a run outlive it in the slot's cgroup leaf")


def _oom_kills() -> int:
    """OOM kills so far in the slot's cgroup leaf (0 without one)."""
    cg = sp.LAYERS["cgroup"]
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


def _zygote_main(spawn, mode: str, mnt: str, conf: str, base: frozenset) -> tuple | None:
    """The zygote: set up, fork the template, then one request in, one result out, per
    snippet, until EOF.  Returns only in a snippet process (a fork of the template).
    ``spawn``: :mod:`privcode.sandbox.spawn`, loaded by BOOT."""
    global sp
    sp = spawn
    sp.prctl(sp.DUMPABLE, 0)  # no /proc/<pid>/mem, environ... of the zygote for its own uid
    sp.prctl(sp.SUBREAPER, 1)  # the template's orphans, should it die, come back here
    sp.set_layers(conf)
    os.umask(0o022)
    pidns = sp.setup_namespaces(mnt) if mode == "ns" else None
    gc.freeze()  # forked runs' collections skip the zygote's objects (fewer copied pages)
    tpl, theirs = sp.channel()
    me, template = os.getpid(), os.fork()
    if template == 0:  # before any request: the template's memory holds none
        tpl.close()
        return sp.template_main(theirs, me, mode, pidns, base)
    theirs.close()
    if pidns is not None:
        os.close(pidns)
    try:
        while (req := recv(0)) is not None:
            try:
                out = _zygote_run(req, mode, mnt, tpl)
            except BaseException as exc:
                out = {"fatal": f"{type(exc).__name__}: {exc}"}
            if "fatal" in out or mode != "ns":  # none, unless the template died
                try:
                    sp.kill_children(keep=(template,))
                except RuntimeError as exc:
                    out = {"fatal": str(exc)}
            try:
                send(1, out)
            except OSError:  # the parent is gone
                return None
    finally:  # EOF to the template: it exits, and its CPU time rolls up into ours
        tpl.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(template, 0)
    return None
