"""A cgroup leaf per sandbox slot: memory, processes and CPU bounded per snippet tree.

rlimits bound one process each (32 processes x 512 MB, plus memfd and tmpfs pages that no
RLIMIT_AS sees, would take a node down); a cgroup bounds the whole run.  The parent (root)
creates ``privcode-sandbox/slot-<uid>`` once per slot and writes its limits; each run's
pid 1 joins it before anything else happens (``cgroup.procs``), so every process of the
run, daemonised or double-forked, is charged to it, tmpfs and memfd pages included:

* ``memory``: ``memory_mb + disk_mb`` (the address space of the processes plus the run's
  tmpfs /tmp), swap off; the kernel OOM-kills inside the leaf only (counted: the zygote
  reads ``oom_kill`` before and after a run to report status "memory").
* ``pids``: ``max_processes + 2`` tasks (threads count), the run's init included.
* ``cpu``: ``cpus`` CPUs of quota per 100 ms period.

cgroup v2 (one unified hierarchy: ``memory.max``, ``memory.swap.max``, ``pids.max``,
``cpu.max``, ``cgroup.kill``) is used when it has the memory and pids controllers; else
v1 (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``, ``pids.max``,
``cpu.cfs_quota_us``), one leaf per hierarchy.  Unavailable (not root, read-only cgroup
filesystem as in an unprivileged container, missing controllers): :func:`probe` says why,
and the verdicts' isolation level says "no-cgroup".  The kill at the deadline does not
depend on this: it ends the run's pid namespace.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

ROOT_NAME = "privcode-sandbox"
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
    with open(os.path.join(mount, "cgroup.controllers"), encoding="utf-8") as fh:
        have = set(fh.read().split())
    if not {"memory", "pids"} <= have:
        raise OSError(f"cgroup v2 at {mount} lacks the memory/pids controllers ({sorted(have)})")
    wanted = [c for c in ("memory", "pids", "cpu") if c in have]
    enable = " ".join("+" + c for c in wanted)
    _write(os.path.join(mount, "cgroup.subtree_control"), enable)  # EBUSY: a non-root with tasks
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
    if os.geteuid() != 0:
        raise OSError("not root")
    mounts = _mounts()
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
    raise OSError("; ".join(errors) or "no cgroup filesystem mounted")


def probe() -> str | None:
    """None if slot cgroups work here, else the reason (a leaf is created and removed)."""
    try:
        cg = create(f"probe-{os.getpid()}", 64 << 20, 8, 1.0)
    except OSError as exc:
        return f"cgroups unavailable: {exc}"
    cg.remove()
    return None


__all__ = ["SlotCgroup", "create", "probe"]
