"""The allow-list seccomp filter (privcode.sandbox.seccomp), against the real sandbox.

Issue 43, point 4: the calls that reached the kernel through the old deny list fail with
the filter's EPERM, sockets of families other than AF_UNIX/AF_INET/AF_INET6 are not
created, memfd_create is denied (point 3), and a broad standard-library workload still
passes under the filter.  Needs the full sandbox (root); skipped otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.sandbox import SandboxLimits, SandboxPool, is_full, isolation_level, seccomp

HOSTILE = Path(__file__).parent / "hostile"
LIMITS = SandboxLimits(cpu_seconds=10, wall_seconds=30, memory_mb=256)
REVIEW = (
    "modify_ldt memfd_secret vmsplice io_setup io_submit mbind set_mempolicy move_pages "
    "migrate_pages sysfs ustat pidfd_open memfd_create sysinfo"
).split()
WORKLOAD = r"""
import asyncio, concurrent.futures, ctypes, datetime, decimal, hashlib, json, os, re, shutil
import signal, socket, sqlite3, subprocess, sys, tempfile, threading, zlib
out, squares = {}, []
threads = [threading.Thread(target=lambda i=i: squares.append(i * i)) for i in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
out["threads"] = sorted(squares)
p = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
out["subprocess"] = [p.returncode, p.stdout.strip()]
async def main():
    await asyncio.sleep(0.01)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "print(1)", stdout=asyncio.subprocess.PIPE)
    return (await proc.communicate())[0].decode().strip()
out["asyncio"] = asyncio.run(main())
db = sqlite3.connect(":memory:")
db.execute("create table t(x)"); db.executemany("insert into t values (?)", [(1,), (2,)])
out["sqlite"] = db.execute("select sum(x) from t").fetchone()[0]
libc = ctypes.CDLL("libc.so.6")
out["ctypes"] = libc.abs(-5)
CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))
arr = (ctypes.c_int * 3)(3, 1, 2)
libc.qsort(arr, 3, 4, CMP(lambda a, b: a[0] - b[0]))
out["callback"] = list(arr)
out["misc"] = [json.loads("[1]"), bool(re.fullmatch("a+", "aa")),
               str(decimal.Decimal("1.1") + 1), datetime.date(2020, 1, 1).isoformat()]
a, b = socket.socketpair(); a.sendall(b"hi")
out["socketpair"] = b.recv(2).decode()
with tempfile.TemporaryDirectory() as d:
    open(os.path.join(d, "f"), "w").write("x")
    shutil.copy2(os.path.join(d, "f"), os.path.join(d, "g"))
    out["tempfile"] = sorted(os.listdir(d))
out["zlib"] = zlib.decompress(zlib.compress(b"a" * 1000)) == b"a" * 1000
out["hashlib"] = hashlib.sha256(b"x").hexdigest()[:8]
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); os.kill(os.getpid(), signal.SIGUSR1)
signal.signal(signal.SIGALRM, lambda *a: got.append(2)); signal.setitimer(signal.ITIMER_REAL, 0.01)
signal.pause()
out["signals"] = got
with concurrent.futures.ThreadPoolExecutor(2) as ex:
    out["pool"] = list(ex.map(abs, [-1, -2]))
for family in (socket.AF_INET, socket.AF_INET6):
    socket.socket(family, socket.SOCK_DGRAM).close()
out["urandom"] = len(os.urandom(8))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    """The review's syscalls, the socket families, memfd at 900 MB and the stdlib workload,
    through one pool with the filter (with or without a cgroup: the filter is under test)."""
    if not is_full(isolation_level()):
        require_or_skip(
            REQUIRE_SANDBOX, f"needs the full sandbox (root); here: {isolation_level()}"
        )
    names = ("syscall_allowlist", "socket_families", "memfd_memory")
    codes = [(HOSTILE / f"{n}.py").read_text() for n in names] + [WORKLOAD]
    with SandboxPool(workers=2, limits=LIMITS, isolation="full-no-cgroup") as pool:  # any
        verdicts = pool.map(codes)
    return dict(zip((*names, "workload"), verdicts, strict=True))


def _lines(out: str) -> dict[str, str]:
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines()}


def test_the_reviews_syscalls_fail_with_the_filters_eperm(runs):
    v = runs["syscall_allowlist"]
    assert v.status == "ok", v.stderr[-500:]
    got = _lines(v.stdout)
    assert {n: got[n] for n in REVIEW} == {n: "DENIED 1" for n in REVIEW}, v.stdout
    assert got["os.memfd_create"] == "DENIED 1"


def test_only_unix_and_inet_sockets_are_created(runs):
    v = runs["socket_families"]
    assert v.status == "ok", v.stderr[-500:]
    assert v.stdout.splitlines() == [
        "AF_VSOCK DENIED 1",
        "AF_NETLINK DENIED 1",
        "AF_PACKET DENIED 1",
        "AF_ALG DENIED 1",
        "AF_BLUETOOTH DENIED 1",
        "socketpair(AF_INET) DENIED 1",
        "AF_UNIX CREATED",
        "AF_INET CREATED",
        "AF_INET6 CREATED",
        "socketpair(AF_UNIX) CREATED",
    ]


def test_memfd_cannot_hold_memory(runs):
    """The review's experiment: 900 MB of memfd at memory_mb=256 never gets a first memfd."""
    v = runs["memfd_memory"]
    assert (v.status, v.error) == ("error", "PermissionError"), v
    assert "HELD" not in v.stdout and "Operation not permitted" in v.stderr


def test_stdlib_workload_passes_under_the_filter(runs):
    v = runs["workload"]
    assert v.status == "ok" and v.isolation.startswith("namespaces+uid+seccomp"), v.stderr[-2000:]
    assert json.loads(v.stdout) == {
        "threads": [0, 1, 4, 9],
        "subprocess": [0, "42"],
        "asyncio": "1",
        "sqlite": 3,
        "ctypes": 5,
        "callback": [1, 2, 3],
        "misc": [[1], True, "2.1", "2020-01-01"],
        "socketpair": "hi",
        "tempfile": ["f", "g"],
        "zlib": True,
        "hashlib": "2d711642",
        "fork": 7,
        "signals": [1, 2],
        "pool": [1, 2],
        "urandom": 8,
    }


def test_the_filter_is_an_allow_list():
    """Nothing the hostile tests reach for is allowed; socket families are an allow list."""
    allowed = {n for names in seccomp.ALLOWED.values() for n in names}
    denied = {n for names in seccomp.DENIED.values() for n in names}
    assert allowed & denied == set()
    assert set(REVIEW) <= denied
    assert not {"socket", "socketpair", "clone", "clone3"} & allowed  # by argument only
    assert seccomp.SOCKET_FAMILIES == (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
    if seccomp.available() is None:
        prog = seccomp.filter_program()
        assert 0 < len(prog) // 8 < 4096  # the kernel's BPF limit
