"""The sandbox in which ALL generated (hostile) Python code runs: the parent side.
Design notes: docs/kubernetes.md, "privcode/sandbox/pool.py".

Every snippet is hostile (network, secrets, writes, fork bombs, memory, floods of output,
daemons) and may use the standard library only (``-S -s``). API: :func:`run_code`,
:class:`SandboxPool` (concurrent, order kept), :func:`check_file`, :func:`isolation_level`;
:class:`Verdict`, :class:`SandboxLimits`. Each slot owns an exclusive uid
(:mod:`privcode.sandbox.uids`), a cgroup leaf (:mod:`privcode.sandbox.cgroups`) and a zygote
(:mod:`privcode.sandbox.zygote`) whose template forks each snippet. Nothing here counts or
kills processes by uid: a run ends with its pid namespace and cgroup leaf.

``isolation`` (``sandbox.isolation``) is the weakest level accepted: ``"full"`` (the default:
namespaces+uid+seccomp+cgroup; missing, a :class:`SandboxError` naming what is missing),
``"full-no-cgroup"`` or ``"rlimits-only"`` (VERDICTS CAN BE FORGED: it warns, and every
verdict says so, :data:`WEAK_NOTE`), the last two asked for by name; every verdict's
``isolation`` names its layers. Root without namespace support is refused either way.
``PRIVCODE_SANDBOX_FORBID_LOCAL=1`` refuses every local sandbox.

"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from privcode.sandbox import cgroups, seccomp, uids, zygote

FULL, FULL_NO_CGROUP, RLIMITS_ONLY = "full", "full-no-cgroup", "rlimits-only"
ISOLATIONS = (FULL, FULL_NO_CGROUP, RLIMITS_ONLY)
#: The layers every full level starts with; then "+cgroup" or "+no-cgroup".
FULL_LAYERS = "namespaces+uid+seccomp"
WEAK_NOTE = "weak isolation: verdicts only, no protection"
NO_CGROUP_NOTE = "no cgroup: memory and processes bounded per process only"
HOW_TO_GET_CGROUP = (
    "give the process a writable cgroup filesystem (memory and pids controllers), or "
    "CAP_SYS_ADMIN in its own user namespace to mount a private one (Kubernetes: "
    "hostUsers: false, as the Helm chart's executor pods run); or accept per-process limits "
    "by name: sandbox.isolation: full-no-cgroup (CLI: --isolation full-no-cgroup)"
)
FORBID_ENV = "PRIVCODE_SANDBOX_FORBID_LOCAL"
STATUSES = ("ok", "error", "timeout", "cpu", "memory", "output", "killed", "syntax")
UID_SPAN = uids.SPAN
_log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup, zygote crash): the snippet's verdict is unknown."""


def is_full(level: str) -> bool:
    """True for the levels ``isolation: full`` accepts."""
    return level.startswith(FULL_LAYERS)


def isolation_note(level: str) -> str | None:
    """What a report must say about a level weaker than the full one with cgroups."""
    if not is_full(level):
        return WEAK_NOTE
    return NO_CGROUP_NOTE if level.endswith("+no-cgroup") else None


@dataclass(frozen=True)
class SandboxLayers:
    """Layers of the full sandbox that may be switched off, for measurements only
    (bench/bench_sandbox.py): a level without seccomp is not "full"."""

    seccomp: bool = True
    cgroup: bool = True


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
    cpus: float = 1.0  # CPU quota of the whole run (its cgroup's cpu.max)

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


def _state_dir() -> str:
    """A 0700 directory of ours for the per-uid locks and the zygotes' mount point."""
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
    """One sandbox slot: an exclusive uid (``base + index``, or the next free one) and a
    zygote (started on first use), one run at a time.  ``base``: the pool's uid base
    (:class:`privcode.sandbox.uids.UidBase`); None: that of this process's ``run_code`` slots."""

    def __init__(self, index: int, base: uids.UidBase | None = None) -> None:
        self.index, self.owner, self.lock = index, os.getpid(), threading.Lock()
        self.base = base or uids.PROCESS_BASE
        self.proc: subprocess.Popen | None = None
        self.uid: int | None = None
        self.level: str | None = None
        self.cgroup: cgroups.SlotCgroup | None = None
        self._lock_fd: int | None = None
        self._lock_dir = ""

    def _start(self, level: str, limits: SandboxLimits) -> None:
        mnt, ns, layers = "-", level.startswith("namespaces"), {}
        if ns:  # uid = first free of base+index, base+index+1, ...
            lock_dir, mnt = _state_dir(), os.path.join(_state_dir(), "mnt")
            try:  # the lock is held by us and the zygote
                self.uid, self._lock_fd = uids.claim(lock_dir, self.base.get(), self.index)
            except OSError as exc:
                raise SandboxError(f"sandbox setup failed ({level}): {exc}") from exc
            self._lock_dir = lock_dir
        try:  # the real binary: a pyenv shim would not start as another uid
            if "+seccomp" in level:
                layers["seccomp"] = seccomp.filter_program().hex()
            if "+cgroup" in level:
                self.cgroup = cgroups.create(
                    f"{cgroups.SLOT_PREFIX}{self.uid}", *_cgroup_limits(limits), cpus=limits.cpus
                )
                _prune_stale_leaves(self.cgroup, self._lock_dir)
                layers["cgroup"] = self.cgroup.to_dict()
            self.proc = subprocess.Popen(
                [
                    os.path.realpath(sys.executable),
                    "-S",
                    "-s",
                    "-P",
                    "-c",
                    zygote.BOOT,
                    os.path.realpath(zygote.__file__),
                    "ns" if ns else "plain",
                    mnt,
                    json.dumps(layers),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=zygote.ENV,
                cwd="/",
                pass_fds=() if self._lock_fd is None else (self._lock_fd,),
                start_new_session=True,
            )
            self.level = level
        except (OSError, seccomp.SeccompUnavailable) as exc:
            self.close(kill=True)
            raise SandboxError(f"sandbox setup failed ({level}): {exc}") from exc
        except BaseException:
            self.close(kill=True)
            raise

    def _request(self, req: dict, timeout: float) -> dict:
        try:
            zygote.send(self.proc.stdin.fileno(), req)
            res = zygote.recv(self.proc.stdout.fileno(), time.monotonic() + timeout)
        except (OSError, TimeoutError) as exc:
            raise SandboxError(f"sandbox zygote failed: {exc}") from exc
        if res is None:
            raise SandboxError(f"sandbox zygote exited unexpectedly (code {self.proc.poll()})")
        if "fatal" in res:
            raise SandboxError(f"sandbox zygote error: {res['fatal']}")
        return res

    def run(self, code: str, stdin: str, limits: SandboxLimits, level: str) -> dict:
        if self.owner != os.getpid():  # forked: the zygote and the uid are the parent's
            self.__init__(self.index, self.base)
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None or self.level != level:
                    self.close()
                    self._start(level, limits)
                if self.cgroup is not None:
                    self.cgroup.set_limits(*_cgroup_limits(limits))
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
        if self.cgroup is not None:  # empty now: its runs' pid namespaces are gone
            self.cgroup.remove()
            self.cgroup = None
        if self._lock_fd is not None:
            uids.release(self._lock_dir, self.uid, self._lock_fd)
            self.uid, self._lock_fd = None, None
        self.level = None


def _prune_stale_leaves(cg: cgroups.SlotCgroup, lock_dir: str) -> None:
    """Remove the leaves of slots whose pool died without closing them (a killed server):
    uids are random per pool, so nothing else would reuse them.  A leaf goes only while
    its uid's lock is free and held by us (no slot can claim it meanwhile) and only if
    empty (the kernel keeps a cgroup with processes)."""
    for name in cg.siblings():
        uid = name.removeprefix(cgroups.SLOT_PREFIX)
        if not uid.isdigit() or (fd := uids.try_lock(lock_dir, int(uid))) is None:
            continue
        try:
            cg.remove_sibling(name)
        finally:
            uids.release(lock_dir, int(uid), fd)


def _cgroup_limits(limits: SandboxLimits) -> tuple[int, int]:
    """(memory bytes, tasks) of a run's leaf: its processes' memory plus its tmpfs /tmp;
    its processes plus the run's init and the snippet's first process."""
    return (limits.memory_mb + limits.disk_mb) << 20, limits.max_processes + 2


_LEVEL: str | None = None
_MISSING: str | None = None  # why the full level cannot be had here
_NO_CGROUP: str | None = None  # why it has no cgroup here
_WARNED: set[str] = set()
_LEVEL_LOCK, _SLOTS_LOCK = threading.Lock(), threading.Lock()
_SLOTS: dict[int, _Slot] = {}
HOW_TO_GET_FULL = (
    "run as root with CAP_SYS_ADMIN, CAP_SETUID, CAP_SETGID, CAP_SYS_CHROOT and CAP_KILL "
    "(in a container: those capabilities and an AppArmor profile that allows mount, or a "
    "gVisor RuntimeClass; the Helm chart's executor pods are set up so), with libseccomp2 "
    "and pyseccomp installed, and a cgroup (a writable one, or CAP_SYS_ADMIN in the "
    "process's user namespace to mount its own); or, for verdicts without protection, ask "
    "for the weak mode by name: sandbox.isolation: rlimits-only (CLI: --isolation "
    "rlimits-only)"
)


def isolation_level() -> str:
    """The strongest level here: ``namespaces+uid+seccomp+cgroup`` (or ``+no-cgroup``; root,
    and one trivial snippet ran so) or ``rlimits-only``.  Probed once per process."""
    global _LEVEL, _MISSING, _NO_CGROUP
    with _LEVEL_LOCK:
        if _LEVEL is None:
            _LEVEL = RLIMITS_ONLY
            if os.geteuid() != 0:
                _MISSING = f"not running as root (uid {os.geteuid()})"
            elif (why := seccomp.available()) is not None:
                _MISSING = why
            else:
                _NO_CGROUP = cgroups.probe()
                level = FULL_LAYERS + ("+no-cgroup" if _NO_CGROUP else "+cgroup")
                if _NO_CGROUP:
                    _log.warning("sandbox: %s (%s)", NO_CGROUP_NOTE, _NO_CGROUP)
                probe = _Slot(UID_SPAN - 1)
                try:
                    res = probe.run("pass", "", SandboxLimits(wall_seconds=30), level)
                    if res["wait_status"] == 0:
                        _LEVEL = level
                    else:
                        _MISSING = f"a trivial snippet failed in it ({res['stderr'][-300:]})"
                except (OSError, SandboxError) as exc:
                    _MISSING = f"the namespace sandbox does not work here: {exc}"
                finally:
                    probe.close()
            if _MISSING:
                _log.error("the full sandbox is not available: %s", _MISSING)
        return _LEVEL


def meets(level: str, isolation: str) -> bool:
    """True if a sandbox at ``level`` is one that ``isolation`` (the weakest accepted) takes:
    "full" wants the full layers and a cgroup, "full-no-cgroup" the layers, "rlimits-only" any."""
    if isolation == FULL:
        return is_full(level) and level.endswith("+cgroup")
    return is_full(level) if isolation == FULL_NO_CGROUP else isolation == RLIMITS_ONLY


def _layer_level(level: str, layers: SandboxLayers) -> str:
    parts = ["namespaces", "uid"] + (["seccomp"] if layers.seccomp else [])
    return "+".join(parts + ["cgroup" if layers.cgroup and "+cgroup" in level else "no-cgroup"])


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        _log.error(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _checked_level(isolation: str = FULL, layers: SandboxLayers | None = None) -> str:
    """The level to run at, given the weakest one accepted; refuses what the module doc says."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if os.environ.get(FORBID_ENV) == "1":
        raise SandboxError(
            f"this process may not run generated code ({FORBID_ENV}=1: it holds private data); "
            "set sandbox.executor (PRIVCODE_SANDBOX_EXECUTOR) to the executor service"
        )
    level = isolation_level()
    if is_full(level):
        if not meets(level, isolation):
            raise SandboxError(
                f"sandbox.isolation is 'full' but no cgroup can be had here ({_NO_CGROUP}): "
                f"memory would be bounded per process only. To get one: {HOW_TO_GET_CGROUP}"
            )
        level = _layer_level(level, layers or SandboxLayers())
        if not meets(level, isolation):  # a layer switched off (measurements only)
            raise ValueError(f"layers {layers} give {level}: not isolation {isolation!r}")
        if level.endswith("+no-cgroup") and (layers is None or layers.cgroup):
            _warn_once(f"privcode sandbox: {NO_CGROUP_NOTE} ({level}, asked for by name)")
        return level
    if isolation != RLIMITS_ONLY:
        raise SandboxError(
            f"sandbox.isolation is {isolation!r} but the full sandbox cannot be had here: "
            f"{_MISSING}. To get it: {HOW_TO_GET_FULL}"
        )
    if os.geteuid() == 0:
        raise SandboxError(
            "refusing to run generated code as root without isolation: the namespace "
            f"sandbox does not work here ({_MISSING}); run as an unprivileged user for the "
            "rlimits-only mode"
        )
    _warn_once(
        f"privcode sandbox isolation is WEAKER than designed ({WEAK_NOTE}; rlimits-only, asked "
        f"for by name: {_MISSING}): rlimits, own process group, temp dir and scrubbed "
        "environment ONLY; NO network or filesystem isolation, the code can read and write "
        "what this user can and escape the kill by daemonising."
    )
    return RLIMITS_ONLY


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
        else:  # the cgroup's OOM killer, or RLIMIT_AS seen as a MemoryError
            status = "memory" if res.get("oom") or "MemoryError" in tail else "killed"
    elif rc == 0:
        status = "ok"
    else:
        status = "memory" if error == "MemoryError" else "error"
    if res.get("oom") and status in ("ok", "error", "killed"):  # a process of the run was
        status = "memory"  # OOM-killed in its cgroup: the run hit its memory limit
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
    code: str,
    limits: SandboxLimits = DEFAULT_LIMITS,
    *,
    stdin: str = "",
    slot: int = 0,
    isolation: str = FULL,
) -> Verdict:
    """Run one snippet in the sandbox of ``slot`` (its own uid and zygote); see the module doc."""
    level = _checked_level(isolation)
    with _SLOTS_LOCK:
        s = _SLOTS.setdefault(slot, _Slot(slot))
    return _run(s, code, stdin, limits, level)


def check_file(
    path: str | os.PathLike, limits: SandboxLimits = DEFAULT_LIMITS, *, isolation: str = FULL
) -> dict:
    """Run a Python file in the sandbox: {file, passed, status, seconds, error, isolation}."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return file_result(path, run_code(fh.read(), limits, isolation=isolation))


def file_result(path: str | os.PathLike, v: Verdict) -> dict:
    return {
        "file": os.fspath(path),
        "passed": v.passed,
        "status": v.status,
        "seconds": v.seconds,
        "error": v.error,
        "isolation": v.isolation,
    }


def stdins_for(codes: Sequence[str], stdins: Sequence[str] | None) -> list[str]:
    """One stdin text per code (empty when none are given); ValueError if they differ."""
    out = [""] * len(codes) if stdins is None else list(stdins)
    if len(out) != len(codes):
        raise ValueError("stdins must have one entry per code")
    return out


class SandboxPool:
    """Runs many snippets concurrently: ``workers`` slots, each its own uid and zygote.

    ``isolation``: the weakest level accepted (module doc); ``layers``: measurements only.
    """

    def __init__(
        self,
        workers: int | None = None,
        limits: SandboxLimits = DEFAULT_LIMITS,
        *,
        isolation: str = FULL,
        layers: SandboxLayers | None = None,
    ) -> None:
        self.workers = workers or len(os.sched_getaffinity(0))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.limits, self.level = limits, _checked_level(isolation, layers)
        base = uids.UidBase()  # this pool's own uids (drawn on first use)
        self._slots = [_Slot(i, base) for i in range(self.workers)]
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for s in self._slots:
            self._free.put(s)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="privcode-sandbox")
        self._closed = False

    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None) -> Verdict:
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        slot = self._free.get()
        try:
            return _run(slot, code, stdin, limits or self.limits, self.level)
        finally:
            self._free.put(slot)

    def map(
        self,
        codes: Sequence[str],
        stdins: Sequence[str] | None = None,
        limits: SandboxLimits | None = None,
    ) -> list[Verdict]:
        """Verdicts in the order of ``codes`` (``stdins``: one stdin text per code;
        ``limits``: these instead of the pool's)."""
        stdins = stdins_for(codes, stdins)
        return list(self._executor.map(self.run, codes, stdins, [limits] * len(codes)))

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
