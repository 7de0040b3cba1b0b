"""The sandbox's isolation between runs, from the pod and from the host (issue 43: points 2,
3 (oom_score_adj), 5, 6 and 8), against the real thing.

* uids of the pool's own (a random base inside the uid map): processes of other pods with
  those uids, or of the old fixed 61000+, change no verdict and are left alone;
* no residue: a run's memory holds nothing of the previous run's code, stdin or output;
* /proc shows the run's own processes only, /proc/self/cgroup says "/";
* every process of a run is the OOM killer's first pick;
* rlimits-only: the zygote's memory is closed to the snippet, and daemons die with the run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.sandbox import SandboxLimits, SandboxPool, is_full, isolation_level, spawn, uids
from privcode.sandbox import pool as sb

HOSTILE = Path(__file__).parent / "hostile"


def require_full(cgroup: bool = False) -> None:
    level = isolation_level()
    if not is_full(level):
        require_or_skip(REQUIRE_SANDBOX, f"needs the full sandbox (root); here: {level}")
    if cgroup and not level.endswith("+cgroup"):
        pytest.skip(f"needs a cgroup leaf per slot; here: {level}")


def hostile(name: str) -> str:
    return (HOSTILE / f"{name}.py").read_text()


@pytest.mark.parametrize(
    ("ranges", "lo", "hi"),
    [
        ([(0, 1 << 32)], 1 << 20, (1 << 31) - sb.UID_SPAN),  # the node's user namespace
        ([(0, 65536)], 10_000, 65_534 - sb.UID_SPAN),  # a pod with hostUsers: false
        ([(0, 1000), (2_000_000, 2_001_500)], 2_000_000, 2_001_500 - sb.UID_SPAN),
    ],
)
def test_uid_base_is_random_and_inside_the_map(monkeypatch, ranges, lo, hi):
    monkeypatch.setattr(uids, "_id_ranges", lambda path: ranges)
    bases = {uids.random_uid_base() for _ in range(50)}
    assert all(lo <= b < hi for b in bases), (bases, lo, hi)
    assert len(bases) > 30  # drawn, not fixed
    monkeypatch.setattr(uids, "_id_ranges", lambda path: [(0, 5000)])
    with pytest.raises(OSError, match="no room for 1000 sandbox uids"):
        uids.random_uid_base()


def _foreign(uid: int) -> subprocess.Popen:
    """A process of another pod that happens to have this uid."""
    return subprocess.Popen(["sleep", "120"], user=uid, group=uid, extra_groups=[])


def test_foreign_processes_of_the_slot_uids_change_no_verdict():
    """Processes of the slots' uids outside the pool (and of the old 61000+) neither fail a
    run nor count against its processes; the pool does not kill them either."""
    require_full(cgroup=True)
    limits = SandboxLimits(max_processes=8, wall_seconds=6, cpu_seconds=2)
    fork = (
        "import os, time\nkids = []\nfor _ in range(7):\n    pid = os.fork()\n"
        "    if pid == 0:\n        time.sleep(0.3)\n        os._exit(0)\n    kids.append(pid)\n"
        "print('forked', sum(os.waitpid(p, 0)[1] == 0 for p in kids))\n"
    )
    foreign = []
    try:
        with SandboxPool(workers=2, limits=limits) as pool:
            assert all(v.passed for v in pool.map(["pass", "pass"]))  # the slots are up
            uids = {s.uid for s in pool._slots}
            assert len(uids) == 2 and not uids & set(range(61000, 62000))
            foreign = [_foreign(u) for u in sorted(uids | set(range(61000, 61011)))]
            time.sleep(0.2)
            v = pool.map([fork, "import time\ntime.sleep(60)", fork, "print('ok')"], limits=limits)
        assert [x.status for x in v] == ["ok", "timeout", "ok", "ok"], v
        assert v[0].stdout == v[2].stdout == "forked 7\n"
        assert [p.poll() for p in foreign] == [None] * len(foreign)  # none of ours to kill
    finally:
        for p in foreign:
            p.kill()
            p.wait()


MARKER = "PRIVCODE-{kind}-{value}"


def test_no_residue_of_the_previous_run_in_memory():
    """Run A's code, stdin and output (markers) are nowhere in run B's memory, on one slot;
    B finds its own stdin marker, so the scan works."""
    require_full()
    mark = {k: MARKER.format(kind=k, value=secrets.token_hex(16)) for k in ("CODE", "STDIN", "B")}
    out_marker = mark["STDIN"].replace("STDIN", "OUTPUT")
    code_a = (
        f"# {mark['CODE']}\nimport sys\ncode = {mark['CODE']!r}\ndata = sys.stdin.read()\n"
        "print(data.replace('STDIN', 'OUTPUT'))\nprint(code * 50, file=sys.stderr)\n"
    )
    limits = SandboxLimits(wall_seconds=30, cpu_seconds=20)
    with SandboxPool(workers=1, limits=limits) as pool:
        a = pool.run(code_a, (mark["STDIN"] + "\n") * 200)
        b = pool.run(hostile("memory_residue"), mark["B"] + "\n")
    assert a.passed and out_marker in a.stdout and mark["CODE"] in a.stderr, a
    assert b.passed, b
    own, others = b.stdout.split(" ", 1)
    assert own == "True", b.stdout  # the scan sees what is in its memory
    leaked = [m for m in (mark["CODE"], mark["STDIN"], out_marker) if m in others]
    assert leaked == [], b.stdout


def test_proc_tells_nothing_about_the_host():
    require_full()
    with SandboxPool(workers=1, limits=SandboxLimits(wall_seconds=20)) as pool:
        v = pool.run(hostile("proc_host_info"), "in")
    assert v.passed, v
    lines = v.stdout.splitlines()
    for ln in lines[:9]:  # absent (subset=pid), or masked: an empty /dev/null
        assert ln.endswith(("DENIED FileNotFoundError", "READ 0")), lines
    assert "pressure dir False" in lines or "pressure dir []" in lines, lines
    assert "cgroup ['/']" in lines, lines  # its own cgroup namespace: no host path
    cpus = next(ln for ln in lines if ln.startswith("cpus")).split()
    assert int(cpus[1]) >= 1 and int(cpus[2]) >= 1, lines  # ordinary stdlib still works
    assert "fds ['0', '1', '2'] 2" in lines, lines
    assert "pids ['2']" in lines, lines  # itself only (its init is root's: hidden too)
    assert "oom 1000" in lines and "child oom 1000" in lines, lines


def test_proc_masks_where_subset_is_missing(tmp_path):
    """The fallback for kernels without subset=pid: runc-style masks over a hidepid proc."""
    require_full()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a throwaway mount namespace: nothing of this leaks to the host
        status = 1
        try:
            os.close(read)
            spawn.unshare(spawn._NEWNS)
            spawn.mount(None, "/", None, spawn._REC | spawn._PRIVATE)
            spawn.mount("proc", str(tmp_path), "proc", spawn._NOSUID, "hidepid=invisible")
            spawn.mask_proc(str(tmp_path))
            out = {
                name: (tmp_path / name).read_bytes().decode()
                for name in ("cmdline", "loadavg", "uptime", "key-users")
            }
            out["sys"] = os.listdir(tmp_path / "sys")
            out["pressure"] = os.listdir(tmp_path / "pressure")
            out["self"] = (tmp_path / "self" / "status").read_text()[:5]
            os.write(write, json.dumps(out).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as fh:
        data = fh.read()
    assert os.waitpid(pid, 0)[1] == 0 and data, data
    assert json.loads(data) == {
        "cmdline": "",
        "loadavg": "",
        "uptime": "",
        "key-users": "",
        "sys": [],
        "pressure": [],
        "self": "Name:",
    }


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    """``code`` with the system python3 as uid/gid 65534, privcode from this checkout."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not shutil.which("setpriv") or not python:
        pytest.skip("needs root, setpriv and a system python3 to run unprivileged")
    root = str(Path(sb.__file__).parents[2])
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-S", "-c"]
        + ["import sys\nsys.path.insert(0, sys.argv[1])\n" + code, root],
        capture_output=True,
        text=True,
        timeout=90,
        cwd="/",
    )
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"the checkout is not readable by an unprivileged user: {proc.stderr[-200:]}")
    return proc


def test_rlimits_only_zygote_memory_is_closed_and_daemons_die():
    """The weak mode: a snippet cannot open its zygote's (or template's) /proc/<pid>/mem, and
    a daemon (setsid + double fork) is gone when the run's verdict is back."""
    code = (
        "import json\nfrom privcode.sandbox import pool as m\n"
        "lim = m.SandboxLimits(wall_seconds=20)\n"
        "for name in ('zygote_memory', 'daemon_pid'):\n"
        "    src = open(sys.argv[1] + '/tests/hostile/' + name + '.py').read()\n"
        "    v = m.run_code(src, lim, isolation='rlimits-only')\n"
        "    print(json.dumps(v.to_dict()), flush=True)\n"
    )
    proc = _as_nobody(code)
    assert proc.returncode == 0, proc.stderr
    mem, daemon = (json.loads(ln) for ln in proc.stdout.splitlines()[-2:])
    assert mem["isolation"] == daemon["isolation"] == "rlimits-only"
    opened = [ln for ln in mem["stdout"].splitlines() if ln.startswith("zygote")]
    assert opened and all(ln.endswith("DENIED PermissionError") for ln in opened), mem
    pid = int(re.fullmatch(r"daemon (\d+)\n", daemon["stdout"]).group(1))
    try:
        assert daemon["status"] == "ok" and not Path(f"/proc/{pid}").exists(), daemon
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
