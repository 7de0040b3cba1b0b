"""A cgroup leaf per sandbox slot: memory, processes and CPU bounded per snippet tree.
Design notes: docs/kubernetes.md, "privcode/sandbox/cgroups.py".

The parent (root) creates ``privcode-sandbox/slot-<uid>`` once per slot and writes its limits;
each run's pid 1 joins it (``cgroup.procs``) before anything else happens, so every process of
the run, daemonised or double-forked, is charged to it, tmpfs and memfd pages included:

* ``memory``: ``memory_mb + disk_mb``, swap off; the kernel OOM-kills inside the leaf only.
* ``pids``: ``max_processes + 2`` tasks (threads count), the run's init included.
* ``cpu``: ``cpus`` CPUs of quota per 100 ms period.

cgroup v2 when it has the memory and pids controllers, else v1; where the standard mounts are
read-only but CAP_SYS_ADMIN is held, a private mount under ``<state dir>/cgroup/``. With
neither, :func:`probe` says why and isolation "full" is refused (``full-no-cgroup`` must be
asked for by name).

"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import tempfile
from dataclasses import dataclass

ROOT_NAME = "privcode-sandbox"
SLOT_PREFIX = "slot-"  # a slot's leaf: slot-<uid>
SERVER_LEAF = "privcode-server"  # where the processes of a delegated v2 root go
PERIOD_US = 100_000


@dataclass
class SlotCgroup:
    """The leaf (or v1 leaves) of one slot, as the zygote uses it (all absolute paths)."""

    version: int
    dirs: dict[str, str]  # controller ("" for v2) -> leaf directory
    procs: tuple[str, ...]  # cgroup.procs of each leaf: a run's pid 1 writes "0" to each
    oom: tuple[str, str]  # (file, key) whose counter counts OOM kills in the leaf
    kill: str | None  # v2 cgroup.kill, else None
    limits: tuple[int, int] | None = None  # (memory bytes, tasks) last written

    def to_dict(self) -> dict:
        return {"procs": list(self.procs), "oom": list(self.oom), "kill": self.kill}

    def set_limits(self, memory: int, tasks: int) -> None:
        """Write the memory (swap off) and task limits, unless they are already these."""
        if self.limits == (memory, tasks):
            return
        if self.version == 2:
            leaf = self.dirs[""]
            _write(os.path.join(leaf, "memory.max"), str(memory))
            with contextlib.suppress(FileNotFoundError):
                _write(os.path.join(leaf, "memory.swap.max"), "0")
            _write(os.path.join(leaf, "pids.max"), str(tasks))
        else:
            mem = self.dirs["memory"]
            files = [os.path.join(mem, "memory.limit_in_bytes")]
            if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                files.append(os.path.join(mem, "memory.memsw.limit_in_bytes"))
            try:  # the kernel keeps memsw >= limit at every write: shrinking, limit first;
                for f in files:  # growing (EINVAL), memsw first.  Whatever a leaf left
                    _write(f, str(memory))  # behind by an earlier owner held.
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                for f in files[::-1]:
                    _write(f, str(memory))
            with open(os.path.join(mem, "memory.limit_in_bytes"), encoding="ascii") as fh:
                if int(fh.read()) > memory:
                    raise OSError(f"the memory limit of {mem} did not take")
            _write(os.path.join(self.dirs["pids"], "pids.max"), str(tasks))
        self.limits = (memory, tasks)

    def remove(self) -> None:
        """rmdir the leaves (they are empty once the slot's last run is over)."""
        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def siblings(self) -> list[str]:
        """The names of the other leaves beside this one (``slot-<uid>`` of other slots)."""
        names: set[str] = set()
        for d in self.dirs.values():
            parent, own = os.path.split(d)
            with contextlib.suppress(OSError):
                names.update(n for n in os.listdir(parent) if n.startswith(SLOT_PREFIX))
            names.discard(own)
        return sorted(names)

    def remove_sibling(self, name: str) -> None:
        """rmdir the leaf ``name`` beside this one in every hierarchy (only an empty leaf
        goes: the kernel refuses to remove a cgroup with processes)."""
        if not name.startswith(SLOT_PREFIX) or "/" in name:
            raise ValueError(f"not a slot leaf: {name!r}")
        for d in self.dirs.values():
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(os.path.dirname(d), name))


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of the cgroup mounts, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                opts = set(rfields[2].split(",")) if len(rfields) > 2 else set()
                out.append((fields[4].replace("\\040", " "), rfields[0], opts))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" for v2."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="utf-8") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _leaf(parent: str, name: str) -> str:
    base = os.path.join(parent, ROOT_NAME)
    os.makedirs(base, mode=0o755, exist_ok=True)
    leaf = os.path.join(base, name)
    os.makedirs(leaf, mode=0o755, exist_ok=True)
    return leaf


def _v2(mount: str, name: str, cpus: float) -> SlotCgroup:
    wanted = _enable_v2(mount)
    enable = " ".join("+" + c for c in wanted)
    base = os.path.join(mount, ROOT_NAME)
    os.makedirs(base, mode=0o755, exist_ok=True)
    _write(os.path.join(base, "cgroup.subtree_control"), enable)
    leaf = _leaf(mount, name)
    if "cpu" in wanted:
        _write(os.path.join(leaf, "cpu.max"), f"{max(1000, int(cpus * PERIOD_US))} {PERIOD_US}")
    kill = os.path.join(leaf, "cgroup.kill")
    return SlotCgroup(
        2,
        {"": leaf},
        (os.path.join(leaf, "cgroup.procs"),),
        (os.path.join(leaf, "memory.events"), "oom_kill"),
        kill if os.path.exists(kill) else None,
    )


def _enable_v2(mount: str) -> list[str]:
    """Enable memory, pids (and cpu) for the children of ``mount``'s root; the list enabled.

    A non-root cgroup with processes refuses (EBUSY: no internal processes): they move to
    the leaf ``privcode-server`` first, then the write is retried.
    """
    with open(os.path.join(mount, "cgroup.controllers"), encoding="utf-8") as fh:
        have = set(fh.read().split())
    if not {"memory", "pids"} <= have:
        raise OSError(f"cgroup v2 at {mount} lacks the memory/pids controllers ({sorted(have)})")
    wanted = [c for c in ("memory", "pids", "cpu") if c in have]
    control = os.path.join(mount, "cgroup.subtree_control")
    try:
        _write(control, " ".join("+" + c for c in wanted))
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        _evacuate(mount, os.path.join(mount, SERVER_LEAF))
        _write(control, " ".join("+" + c for c in wanted))
    return wanted


def _evacuate(mount: str, leaf: str) -> None:
    """Move every process of ``mount``'s root cgroup (ours: the server's) into ``leaf``."""
    os.makedirs(leaf, mode=0o755, exist_ok=True)
    for _ in range(100):  # a process may fork meanwhile: its child lands in the root too
        with open(os.path.join(mount, "cgroup.procs"), encoding="ascii") as fh:
            pids = fh.read().split()
        if not pids:
            return
        for pid in pids:
            try:
                _write(os.path.join(leaf, "cgroup.procs"), pid)
            except ProcessLookupError:
                continue
    raise OSError(f"the processes of {mount} could not all move to {leaf}")


def _v1(mounts: dict[str, str], name: str, cpus: float) -> SlotCgroup:
    own = _own_paths()
    leaves = {c: _leaf(mounts[c] + own.get(c, "/"), name) for c in mounts}
    if not {"memory", "pids"} <= set(leaves):
        raise OSError(f"cgroup v1 lacks the memory/pids hierarchies (have {sorted(mounts)})")
    if "cpu" in leaves:
        _write(os.path.join(leaves["cpu"], "cpu.cfs_period_us"), str(PERIOD_US))
        _write(os.path.join(leaves["cpu"], "cpu.cfs_quota_us"), str(int(cpus * PERIOD_US)))
    return SlotCgroup(
        1,
        leaves,
        tuple(os.path.join(d, "cgroup.procs") for d in leaves.values()),
        (os.path.join(leaves["memory"], "memory.oom_control"), "oom_kill"),
        None,
    )


def create(name: str, memory_bytes: int, max_tasks: int, cpus: float) -> SlotCgroup:
    """The leaf ``privcode-sandbox/<name>`` with these limits (v2, else v1); OSError if none."""
    cg = _create(name, cpus)
    try:
        cg.set_limits(memory_bytes, max_tasks)
    except OSError:
        cg.remove()
        raise
    return cg


def _create(name: str, cpus: float) -> SlotCgroup:
    """The leaf in the standard cgroup mounts, else in mounts of our own (module doc)."""
    if os.geteuid() != 0:
        raise OSError("not root")
    errors = []
    for where, mounts in (("mounted", _mounts), ("private", _private_mounts)):
        try:
            return _create_in(mounts(), name, cpus)
        except OSError as exc:
            errors.append(f"{where}: {exc}")
    raise OSError("; ".join(errors))


def _create_in(mounts: list[tuple[str, str, set[str]]], name: str, cpus: float) -> SlotCgroup:
    errors = []
    for point, fstype, _ in mounts:
        if fstype == "cgroup2":
            try:
                return _v2(point, name, cpus)
            except OSError as exc:
                errors.append(f"v2: {exc}")
    v1 = {}
    for point, fstype, opts in mounts:
        for c in ("memory", "pids", "cpu"):
            if fstype == "cgroup" and c in opts and c not in v1:
                v1[c] = point
    if v1:
        try:
            return _v1(v1, name, cpus)
        except OSError as exc:
            errors.append(f"v1: {exc}")
    raise OSError(", ".join(errors) or "no cgroup filesystem mounted")


def _private_mounts() -> list[tuple[str, str, set[str]]]:
    """Mount (once) a cgroup2 and the v1 hierarchies of memory, pids and cpu of our own.

    Under ``<state dir>/cgroup/``: ``unified``, and one directory per v1 hierarchy named
    by its controllers (as /proc/cgroups groups them: ``cpu,cpuacct`` mount together).
    """
    base = os.path.join(_state_dir(), "cgroup")
    wanted: dict[str, tuple[str, str]] = {"unified": ("cgroup2", "")}
    for names in _v1_hierarchies(("memory", "pids", "cpu")):
        wanted[",".join(names)] = ("cgroup", ",".join(names))
    out, errors = [], []
    for dirname, (fstype, opts) in wanted.items():
        point = os.path.join(base, dirname)
        try:
            os.makedirs(point, mode=0o755, exist_ok=True)
            if not os.path.ismount(point):
                _mount(fstype, point, fstype, _NOSUID | _NODEV | _NOEXEC, opts)
        except OSError as exc:
            errors.append(f"{fstype}{f' ({opts})' if opts else ''} at {point}: {exc}")
            continue
        out.append((point, fstype, set(opts.split(",")) if opts else set()))
    if not out:
        hint = "" if _has_sys_admin() else " (no CAP_SYS_ADMIN in this user namespace)"
        raise OSError(f"could not mount a cgroup of our own{hint}: " + "; ".join(errors))
    return out


def _v1_hierarchies(controllers: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The v1 hierarchies holding ``controllers``, each as all the controllers it holds."""
    by_id: dict[str, list[str]] = {}
    with open("/proc/cgroups", encoding="ascii") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) == 4 and fields[1] != "0" and fields[3] == "1":
                by_id.setdefault(fields[1], []).append(fields[0])
    return [tuple(n) for n in by_id.values() if set(n) & set(controllers)]


def _state_dir() -> str:
    """Our 0700 directory (as the pool's: /run/privcode-sandbox, else in the temp dir)."""
    for base in ("/run", tempfile.gettempdir()):
        path = os.path.join(base, ROOT_NAME)
        with contextlib.suppress(OSError):  # it exists, or the base is not writable
            os.mkdir(path, 0o700)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return path
    raise OSError("no state directory of ours for a private cgroup mount")


_NOSUID, _NODEV, _NOEXEC = 2, 4, 8


def _mount(src: str, target: str, fstype: str, flags: int, data: str) -> None:
    """mount(2) through libc: the standard library has no binding (nor a package we trust)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(src.encode(), target.encode(), fstype.encode(), flags, data.encode() or None):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _has_sys_admin() -> bool:
    with open("/proc/self/status", encoding="ascii") as fh:
        caps = next((ln.split()[1] for ln in fh if ln.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> 21 & 1)


def probe() -> str | None:
    """None if slot cgroups work here, else the reason (a leaf is created and removed)."""
    try:
        cg = create(f"probe-{os.getpid()}", 64 << 20, 8, 1.0)
    except OSError as exc:
        return f"cgroups unavailable: {exc}"
    cg.remove()
    return None


__all__ = ["SlotCgroup", "create", "probe"]
