"""Cgroups without a writable host cgroup, and the isolation levels that depend on them.

Issue 43, point 3: in a Kubernetes pod /sys/fs/cgroup is read-only; a snippet held 480 MB
at memory_mb=64 there and was judged "ok".  Each test here runs a child process with its
own mount namespace in which the standard cgroup mounts are read-only or gone: the sandbox
must mount a private cgroup (privcode.sandbox.cgroups) and stop the memory (status
"memory").  Without any cgroup, "full" is refused and "full-no-cgroup" works, by name.
The real tests need root (the full sandbox); the others are pure.
"""

from __future__ import annotations

import argparse
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.config import load_config
from privcode.eval.cli import add_eval_parser
from privcode.sandbox import cgroups, is_full, isolation_level
from privcode.sandbox import pool as sb

HOSTILE = Path(__file__).parent / "hostile"
# The child: own mount namespace; the cgroup mounts remounted read-only ("ro"), unmounted
# ("hide"), or unmounted and no private mount allowed, as without CAP_SYS_ADMIN ("none").
CHILD = r"""
import ctypes, errno, json, os, sys
from pathlib import Path
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
def check(r):
    if r != 0:
        raise OSError(ctypes.get_errno(), "mount setup")
check(libc.unshare(0x20000))  # CLONE_NEWNS
check(libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None))  # MS_REC | MS_PRIVATE
mode, hostile = sys.argv[1], Path(sys.argv[2])
if mode == "ro":
    for line in open("/proc/self/mountinfo"):
        point = line.split()[4]
        if point.startswith("/sys/fs/cgroup"):
            check(libc.mount(None, point.encode(), None, 4096 | 32 | 1, None))  # bind,remount,ro
else:
    check(libc.umount2(b"/sys/fs/cgroup", 2))  # MNT_DETACH
from privcode.sandbox import SandboxError, SandboxLayers, SandboxLimits, SandboxPool, cgroups
from privcode.sandbox import pool as sb
if mode == "none":
    def refused(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    cgroups._mount = refused
out = {"level": sb.isolation_level(), "no_cgroup": sb._NO_CGROUP}
limits = SandboxLimits(memory_mb=64, cpu_seconds=20, wall_seconds=60)
try:
    with SandboxPool(1, limits) as pool:
        v = pool.run((hostile / "spread_memory.py").read_text())
        out["full"] = [v.status, v.isolation, v.stdout]
        out["leaf"] = sorted(pool._slots[0].cgroup.dirs.values())
except SandboxError as exc:
    out["full"] = str(exc)
if mode == "ro":  # the review's memfd experiment: the cgroup alone (seccomp off) bounds it
    with SandboxPool(1, limits, isolation="rlimits-only", layers=SandboxLayers(seccomp=False)) as pool:
        v = pool.run((hostile / "memfd_memory.py").read_text())
        out["memfd"] = [v.status, v.isolation, v.stdout]
if mode == "none":
    with SandboxPool(1, limits, isolation="full-no-cgroup") as pool:
        v = pool.run("print(6 * 7)")
        out["full-no-cgroup"] = [v.status, v.isolation, v.stdout]
print(json.dumps(out))
"""


def run_child(mode: str) -> dict:
    if not is_full(isolation_level()):
        require_or_skip(
            REQUIRE_SANDBOX, f"needs the full sandbox (root); here: {isolation_level()}"
        )
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(HOSTILE)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _private(path: str) -> bool:
    return "/privcode-sandbox/cgroup/" in path and not path.startswith("/sys/fs/cgroup")


@pytest.mark.heavy
def test_read_only_cgroup_mount_gets_a_private_one_and_memory_is_bounded():
    out = run_child("ro")
    assert out["level"] == "namespaces+uid+seccomp+cgroup" and out["no_cgroup"] is None, out
    assert out["leaf"] and all(_private(d) for d in out["leaf"]), out["leaf"]
    status, level, stdout = out["full"]
    assert (status, level) == ("memory", "namespaces+uid+seccomp+cgroup")
    assert "HELD" not in stdout
    status, level, stdout = out["memfd"]  # 900 MB of memfd at memory_mb=64, seccomp off
    assert (status, level) == ("memory", "namespaces+uid+cgroup") and "HELD" not in stdout


@pytest.mark.heavy
def test_no_cgroup_mount_at_all_gets_a_private_one():
    out = run_child("hide")
    assert out["level"] == "namespaces+uid+seccomp+cgroup", out
    assert out["leaf"] and all(_private(d) for d in out["leaf"]), out["leaf"]
    assert out["full"][:2] == ["memory", "namespaces+uid+seccomp+cgroup"]
    assert "HELD" not in out["full"][2]


@pytest.mark.heavy
def test_without_any_cgroup_full_is_refused_and_full_no_cgroup_is_asked_for_by_name():
    out = run_child("none")
    assert out["level"] == "namespaces+uid+seccomp+no-cgroup", out
    assert "could not mount a cgroup of our own" in out["no_cgroup"]
    refusal = out["full"]
    assert isinstance(refusal, str), refusal
    for needle in (
        "sandbox.isolation is 'full' but no cgroup can be had here",
        "Operation not permitted",  # what went wrong
        "CAP_SYS_ADMIN",  # way out 1: a cgroup
        "sandbox.isolation: full-no-cgroup",  # way out 2: by name
    ):
        assert needle in refusal, refusal
    assert out["full-no-cgroup"] == ["ok", "namespaces+uid+seccomp+no-cgroup", "42\n"]


def test_levels_each_isolation_accepts():
    full, bare = "namespaces+uid+seccomp+cgroup", "namespaces+uid+seccomp+no-cgroup"
    weak = "rlimits-only"
    assert sb.ISOLATIONS == ("full", "full-no-cgroup", "rlimits-only")
    table = {iso: [sb.meets(lv, iso) for lv in (full, bare, weak)] for iso in sb.ISOLATIONS}
    assert table == {
        "full": [True, False, False],
        "full-no-cgroup": [True, True, False],
        "rlimits-only": [True, True, True],
    }
    assert not sb.meets("namespaces+uid+cgroup", "full")  # seccomp off: not full


def test_full_refused_without_a_cgroup(monkeypatch):
    """In-process: the level probe found no cgroup; "full" says what and the two ways out."""
    monkeypatch.setattr(sb, "_LEVEL", "namespaces+uid+seccomp+no-cgroup")
    monkeypatch.setattr(sb, "_NO_CGROUP", "cgroups unavailable: read-only file system")
    with pytest.raises(sb.SandboxError, match="no cgroup can be had here .*read-only") as exc:
        sb._checked_level("full")
    assert "CAP_SYS_ADMIN" in str(exc.value) and "full-no-cgroup" in str(exc.value)
    monkeypatch.setattr(sb, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="no cgroup: .* asked for by name"):
        assert sb._checked_level("full-no-cgroup") == "namespaces+uid+seccomp+no-cgroup"
    with pytest.raises(ValueError, match="not isolation 'full-no-cgroup'"):
        sb._checked_level("full-no-cgroup", sb.SandboxLayers(seccomp=False))


def test_config_and_cli_take_full_no_cgroup(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("sandbox:\n  isolation: full-no-cgroup\n")
    assert load_config(cfg).sandbox.isolation == "full-no-cgroup"
    cfg.write_text("sandbox:\n  isolation: none\n")
    with pytest.raises(Exception, match="'none' is not one of .*'full-no-cgroup'"):
        load_config(cfg)
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["eval", "--samples", "x.jsonl", "--isolation", "full-no-cgroup"])
    assert args.isolation == "full-no-cgroup"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--samples", "x.jsonl", "--isolation", "none"])
    assert "full-no-cgroup" in capsys.readouterr().err


def test_v2_root_with_processes_moves_them_to_a_leaf(tmp_path, monkeypatch):
    """cgroup2's no-internal-processes rule: enabling controllers under a root that holds
    the server fails (EBUSY) until its processes move to the leaf privcode-server."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.procs").write_text("101\n102\n")
    (root / "cgroup.subtree_control").write_text("")
    moved: list[str] = []

    def fake_write(path: str, value: str) -> None:
        p = Path(path)
        if p == root / "cgroup.subtree_control":
            if (root / "cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy")
            p.write_text(value)
        elif p == root / cgroups.SERVER_LEAF / "cgroup.procs":
            left = [x for x in (root / "cgroup.procs").read_text().split() if x != value]
            (root / "cgroup.procs").write_text("\n".join(left))
            if value == "102":  # it exited between the read and the move
                raise ProcessLookupError(errno.ESRCH, "No such process")
            moved.append(value)
        else:
            raise AssertionError(path)

    monkeypatch.setattr(cgroups, "_write", fake_write)
    assert cgroups._enable_v2(str(root)) == ["memory", "pids", "cpu"]
    assert moved == ["101"] and (root / "cgroup.subtree_control").read_text() == (
        "+memory +pids +cpu"
    )
    (root / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(OSError, match="lacks the memory/pids controllers"):
        cgroups._enable_v2(str(root))


def test_v1_hierarchies_mount_with_their_companions(monkeypatch, tmp_path):
    """A private v1 mount must name every controller of the hierarchy (cpu,cpuacct)."""
    table = tmp_path / "cgroups"
    table.write_text(
        "#subsys_name\thierarchy\tnum_cgroups\tenabled\n"
        "cpuset\t3\t1\t1\ncpu\t2\t5\t1\ncpuacct\t2\t5\t1\nmemory\t4\t9\t1\n"
        "pids\t0\t5\t1\nhugetlb\t5\t1\t0\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda f, *a, **k: real_open(table if f == "/proc/cgroups" else f, *a, **k),
    )
    assert cgroups._v1_hierarchies(("memory", "pids", "cpu")) == [("cpu", "cpuacct"), ("memory",)]


@pytest.mark.heavy
def test_leaves_of_dead_pools_are_pruned_and_live_ones_kept():
    """A pool killed without closing leaves its slots' leaves behind (uids are random per
    pool: nothing reuses them); the next pool's start removes those whose uid lock is free,
    and keeps the leaf of a slot whose lock is held (another live pool)."""
    if not isolation_level().endswith("+cgroup"):
        pytest.skip(f"needs the full sandbox with a cgroup; here: {isolation_level()}")
    with sb.SandboxPool(1) as pool:
        assert pool.run("print(1)").status == "ok"
        cg = pool._slots[0].cgroup
        assert cg is not None
        parents = {Path(d).parent for d in cg.dirs.values()}
    lock_dir = sb._state_dir()
    dead, live = "slot-4000000001", "slot-4000000002"
    for parent in parents:
        (parent / dead).mkdir(exist_ok=True)
        (parent / live).mkdir(exist_ok=True)
    held = sb.uids.try_lock(lock_dir, 4000000002)
    assert held is not None
    try:
        with sb.SandboxPool(1) as pool:
            assert pool.run("print(1)").status == "ok"
        assert all(not (p / dead).exists() for p in parents), parents
        assert all((p / live).is_dir() for p in parents), parents
    finally:
        sb.uids.release(lock_dir, 4000000002, held)
        for parent in parents:
            (parent / live).rmdir()
