"""The executor service against hostile HTTP clients (issue 43, point 7; point 8's
non-dumpable server): the review's experiments as tests.

Most run an in-process server over a counting stand-in pool (no sandbox needed: what is
tested is the HTTP front); the memory and /proc/<pid>/mem checks run the server in a
subprocess, the output cap a real pool."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from privcode.sandbox import Verdict
from privcode.sandbox.executor import ExecutorServer
from privcode.sandbox.executor_protocol import ANSWER_HEAD_BYTES, TAIL_CHARS, verdict_max_bytes

TOKEN = "executor-test-token-7f3a9c1e5b"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"
RUN_ONE = b'{"programs": [{"code": "print(1)"}]}'


class CountingPool:
    """Stands in for a SandboxPool: counts the programs it is given, runs none."""

    workers, level = 2, "stand-in"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, code: str, stdin: str = "", limits: object = None) -> Verdict:
        self.calls += 1
        return Verdict(True, "ok", 0.0, 0, "ran\n", "", self.level, None)

    def close(self) -> None:
        pass


def _dumpable_again() -> None:
    """The in-process server made pytest non-dumpable (by design): undo it for the rest."""
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)


@contextlib.contextmanager
def running(**kw):
    kw.setdefault("pool", CountingPool())
    kw.setdefault("token", TOKEN)
    srv = ExecutorServer(("127.0.0.1", 0), **kw)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.port = srv.server_address[1]
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        _dumpable_again()


def request(body: bytes = RUN_ONE, headers: str = AUTH, path: str = "/v1/run") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """(everything the server sent until it closed, seconds until then)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks), time.monotonic() - t0


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def json_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_no_token_or_a_wrong_token_is_401_and_nothing_runs():
    with running() as srv:
        wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
        for headers in (
            "",
            f"Authorization: Bearer {wrong}\r\n",
            "Authorization: Bearer short\r\n",
            f"Authorization: Basic {TOKEN}\r\n",
            f"Authorization: Bearer {TOKEN}\r\nAuthorization: Bearer {TOKEN}\r\n",
        ):
            answer, _ = exchange(srv.port, request(headers=headers))
            assert status_of(answer) == 401, (headers, answer[:200])
            assert TOKEN not in answer.decode() and "Bearer" in answer.decode()
        # decided on the headers: a 32 MiB body that never comes is refused at once
        head = b"POST /v1/run HTTP/1.1\r\nHost: x\r\nContent-Length: 33554432\r\n\r\n"
        answer, seconds = exchange(srv.port, head)
        assert status_of(answer) == 401 and seconds < 1.5
        assert srv.pool.calls == 0
        health, _ = exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(health) == 200  # no token needed, and it tells only these:
        assert set(json_of(health)) == {"isolation", "workers", "max_batch", "max_limits"}
        answer, _ = exchange(srv.port, request())
        assert status_of(answer) == 200 and srv.pool.calls == 1


def _trickle(port: int, head: bytes, drip: bytes, out: dict, key: str) -> None:
    """Send ``head``, then ``drip`` a byte each 0.2 s; record when the server closed."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        try:
            for i in range(100):
                s.sendall(drip[i % len(drip) : i % len(drip) + 1])
                time.sleep(0.2)
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        break
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        except OSError:  # reset by the server
            pass
        out[key] = time.monotonic() - t0


def test_slowloris_is_dropped_at_the_deadline_however_slowly_bytes_trickle():
    with running(request_deadline_s=2.0) as srv:
        out: dict[str, float] = {}
        body_head = request(b"x" * 100)[:-100]
        runs = [
            ("headers", b"POST /v1/run HTTP/1.1\r\nX-Slow: ", b"a"),
            ("body", body_head, b"{"),
        ]
        threads = [
            threading.Thread(target=_trickle, args=(srv.port, head, drip, out, key))
            for key, head, drip in runs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert set(out) == {"headers", "body"}
        for key, seconds in out.items():
            assert 1.8 <= seconds <= 2.0 + 1.0, (key, seconds)
        assert srv.admitted == 0 and srv.open_connections == 0  # the body's slot came back
        assert status_of(exchange(srv.port, request())[0]) == 200


SERVER = """
import json, sys
from privcode.sandbox.executor_server import ExecutorServer
srv = ExecutorServer(("127.0.0.1", 0), **json.loads(sys.argv[1]))
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


@contextlib.contextmanager
def server_process(prefix: tuple[str, ...] = (), **kw):
    """An executor in its own process (rlimits-only, nothing runs): (pid, port)."""
    kw = {"isolation": "rlimits-only", "workers": 1, **kw}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", SERVER, json.dumps(kw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).parents[1],
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the executor did not start ({proc.poll()})"
        yield proc.pid, int(line)
    finally:
        proc.kill()
        proc.wait(10)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(ln for ln in status.splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_stalled_uploads_beyond_admission_are_refused_at_once_and_memory_stays_bounded():
    """The review's 8 stalled uploads: 24 -> 295 MiB.  Now 1 is admitted, 7 get 429 on their
    headers, and the server holds at most the admitted body."""
    size = 16 << 20
    kw = {"token": TOKEN, "max_inflight": 1, "max_body_bytes": size, "request_deadline_s": 20}
    with server_process(**kw) as (pid, port):
        assert status_of(exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0]) == 200
        before = rss_mib(pid)
        head = (
            f"POST /v1/run HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: {size}\r\n\r\n"
        ).encode()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=0.5) for _ in range(8)]
        for s in socks:
            s.sendall(head + b" " * (64 << 10))
        answers, t0 = [], time.monotonic()
        for s in socks:
            try:
                answers.append(s.recv(4096))
            except TimeoutError:
                answers.append(b"")  # admitted: it waits for the body
        assert time.monotonic() - t0 < 2.0
        assert sorted(status_of(a) for a in answers) == [0] + [429] * 7, answers
        assert all(b"Retry-After: 1" in a for a in answers if a)
        rest = memoryview(b" " * (size - (64 << 10) - 1))  # all but the last byte: stalled
        pushed: list[socket.socket] = []

        def push(s: socket.socket) -> None:
            with contextlib.suppress(OSError):
                s.settimeout(5.0)
                s.sendall(rest)
                pushed.append(s)

        pushers = [threading.Thread(target=push, args=(s,)) for s in socks]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join(10)
        admitted = socks[[status_of(a) for a in answers].index(0)]
        assert pushed == [admitted]  # the refused ones were closed, unread
        time.sleep(0.5)  # the server drains what the kernel still holds
        grown = rss_mib(pid) - before
        assert grown < size / (1 << 20) + 16, f"RSS grew {grown:.0f} MiB"  # today: 8 bodies
        for s in socks:
            s.close()
        time.sleep(0.2)
        assert status_of(exchange(port, request(b"{}"))[0]) == 400  # the slot is free again


def test_an_answer_is_capped_whatever_the_programs_print():
    """The review's 766-byte request got 6.3 MB back; now tails only, at most the stated cap."""
    n, printed = 8, 60000
    code = (
        f"import sys\nsys.stdout.write('x' * {printed} + 'END')\n"
        f"sys.stderr.write(chr(1) * {printed})\n"
    )
    body = json.dumps({"programs": [{"code": code}] * n}).encode()
    with running(workers=2, isolation="rlimits-only", pool=None) as srv:
        answer, _ = exchange(srv.port, request(body), timeout=60)
    assert status_of(answer) == 200, answer[:300]
    payload = answer.split(b"\r\n\r\n", 1)[1]
    cap = ANSWER_HEAD_BYTES + n * verdict_max_bytes()
    assert len(payload) <= cap < 2 * n * printed / 4, (len(payload), cap)
    verdicts = json.loads(payload)["verdicts"]
    assert len(verdicts) == n and {v["status"] for v in verdicts} == {"ok"}
    for v in verdicts:
        assert v["stdout"].endswith("END") and len(v["stdout"]) == TAIL_CHARS
        assert v["stderr"] == chr(1) * TAIL_CHARS  # 6 bytes each in JSON: the worst case
    assert len(payload) > n * 6 * TAIL_CHARS  # the cap is reached, not avoided


@pytest.mark.parametrize("value", ["-Infinity", "Infinity", "NaN"])
def test_non_finite_limits_are_422_naming_the_field(value):
    body = b'{"programs": [{"code": "print(1)"}], "limits": {"wall_seconds": ' + value.encode()
    with running() as srv:
        answer, _ = exchange(srv.port, request(body + b"}}"))
        assert status_of(answer) == 422
        assert json_of(answer) == {"error": "limits.wall_seconds must be a finite number"}
        assert srv.pool.calls == 0


def test_the_connection_cap_holds():
    """``max_connections`` open: the next gets 503 at once; twice that: closed unanswered."""
    with running(max_connections=3, request_deadline_s=5.0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        time.sleep(0.3)
        assert srv.open_connections == 3
        health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        over = [socket.create_connection(("127.0.0.1", srv.port), timeout=2) for _ in range(3)]
        for s in over:
            s.sendall(health)
        t0 = time.monotonic()
        answers = [s.recv(4096) for s in over]  # 503, lingering for a second: still open
        assert [status_of(a) for a in answers] == [503] * 3 and time.monotonic() - t0 < 1.0
        assert b"Retry-After: 1" in answers[0]
        beyond, seconds = exchange(srv.port, health)
        assert beyond == b"" and seconds < 1.0  # 7 > 2 x 3: closed unanswered
        assert srv.open_connections <= 6
        for s in idle + over:
            s.close()
        time.sleep(0.3)
        assert status_of(exchange(srv.port, health)[0]) == 200


def test_the_server_is_not_dumpable(tmp_path):
    """Point 8: a snippet under the server's uid (rlimits-only) must not open its memory."""
    with running():
        assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("the cross-process check needs root (to run both sides as nobody)")
    nobody = ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups")
    with server_process(nobody) as (pid, port):
        probe = subprocess.run(
            [*nobody, sys.executable, "-c", f"open('/proc/{pid}/mem', 'rb')"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            assert r.status == 200  # the server itself is fine
