"""The executor service (privcode.sandbox.executor) on 127.0.0.1: protocol, limits against
hostile clients, nothing private in logs or errors, the client's isolation check.

The hostile corpus itself runs through the executor in tests/test_sandbox.py (the
``hostile`` fixture's "executor" backend)."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.cli import main as cli_main
from privcode.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxPool,
    Verdict,
    is_full,
    isolation_level,
)
from privcode.sandbox.executor import (
    MAX_LIMITS,
    ExecutorClient,
    ExecutorServer,
    open_sandbox,
    parse_limits,
    preflight,
)
from privcode.sandbox.executor_protocol import clamp_limits

MARK = "privcode-private-marker-51c2"
TOKEN = "sandbox-executor-test-token-0c9d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RAW_AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


def require_full() -> None:
    if not is_full(isolation_level()):
        require_or_skip(
            REQUIRE_SANDBOX, f"needs the full sandbox (root); here: {isolation_level()}"
        )


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    """The clients' token file (``PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE``)."""
    path = tmp_path / "executor-token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE", str(path))
    return path


@pytest.fixture
def server(request, token_file):
    """A running executor with a token; ``request.param`` may override its settings."""
    require_full()
    kw = getattr(request, "param", {})
    srv = ExecutorServer(("127.0.0.1", 0), workers=2, token=TOKEN, **kw)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        url + "/v1/run", body, {"Content-Type": "application/json", **AUTH, **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def raw_request(port: int, data: bytes, wait: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def test_runs_batches_in_order_with_the_full_level(server):
    client = ExecutorClient(server.url, SandboxLimits(wall_seconds=5))
    assert client.level == isolation_level() and client.workers == 2
    codes = [f"print({i} * 3)" for i in range(40)] + ["import sys; sys.exit(3)", "x = ("]
    v = client.map(codes, [""] * len(codes))
    assert [x.stdout for x in v[:40]] == [f"{i * 3}\n" for i in range(40)]
    assert (v[40].status, v[40].returncode, v[41].status) == ("error", 3, "syntax")
    assert {x.isolation for x in v} == {isolation_level()}
    # per-request limits reach the sandbox
    slow = client.map(["import time; time.sleep(5)"], limits=SandboxLimits(wall_seconds=1))[0]
    assert slow.status == "timeout" and slow.seconds < 3


def test_batches_larger_than_max_batch_are_split(server):
    server.max_batch = 7
    client = ExecutorClient(server.url)
    assert client.max_batch == 7
    assert [v.stdout for v in client.map([f"print({i})" for i in range(20)])] == [
        f"{i}\n" for i in range(20)
    ]


def test_hostile_clients_get_clear_refusals(server):
    url, port = server.url, server.server_address[1]
    ok = json.dumps({"programs": [{"code": "print(1)"}]}).encode()
    assert post(url, ok)[0] == 200
    assert post(url, b"not json")[:2] == (400, {"error": "body is not JSON"})
    assert post(url, b'{"programs": []}')[0] == 400
    assert post(url, b'{"programs": [{"code": 3}]}')[1]["error"].startswith("programs[0]")
    assert post(url, json.dumps({"programs": [{"code": "x", "stdin": 5}]}).encode())[0] == 400
    too_many = json.dumps({"programs": [{"code": "pass"}] * 257}).encode()
    assert post(url, too_many)[0] == 413
    huge = json.dumps({"programs": [{"code": "#" * (1 << 20 + 1)}]}).encode()
    assert post(url, huge)[0] == 413
    for limits, msg in (
        ({"cpu_seconds": 1e9}, "exceeds this executor's cap"),
        ({"wall_seconds": -1}, "wall_seconds must be > 0"),
        ({"uid": 0}, "unknown limits: ['uid']"),
        ({"memory_mb": "lots"}, "memory_mb must be a number"),
    ):
        status, body, _ = post(
            url, json.dumps({"programs": [{"code": "1"}], "limits": limits}).encode()
        )
        assert status == 422 and msg in body["error"], (limits, body)
    no_length = b"POST /v1/run HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + b"\r\n"
    assert b" 411 " in raw_request(port, no_length)
    chunked = no_length[:-2] + b"Transfer-Encoding: chunked\r\n\r\n"
    assert b" 411 " in raw_request(port, chunked)
    big = no_length[:-2] + b"Content-Length: 999999999\r\n\r\n"
    assert b" 413 " in raw_request(port, big)
    assert b" 404 " in raw_request(port, b"GET /v1/other HTTP/1.1\r\nHost: x\r\n\r\n", 2)
    assert b" 405 " in raw_request(port, b"GET /v1/run HTTP/1.1\r\nHost: x\r\n\r\n", 2)
    assert post(url, ok)[0] == 200  # and it still serves


@pytest.mark.parametrize("server", [{"request_deadline_s": 1.0}], indirect=True)
def test_a_stalled_client_is_dropped(server):
    t0 = time.monotonic()
    got = raw_request(server.server_address[1], b"POST /v1/run HTTP/1.1\r\nContent-Le", 10)
    assert got == b"" and time.monotonic() - t0 < 5  # closed after the read timeout
    assert post(server.url, b'{"programs": [{"code": "pass"}]}')[0] == 200


@pytest.mark.parametrize("server", [{"max_inflight": 1}], indirect=True)
def test_busy_executor_answers_429_and_the_client_retries(server):
    slow = json.dumps({"programs": [{"code": "import time; time.sleep(2)"}]}).encode()
    first = threading.Thread(target=post, args=(server.url, slow))
    first.start()
    time.sleep(0.5)
    status, body, headers = post(server.url, b'{"programs": [{"code": "pass"}]}')
    assert (status, headers.get("Retry-After")) == (429, "1") and "busy" in body["error"]
    client = ExecutorClient(server.url)
    assert client.map(["print('after')"])[0].stdout == "after\n"  # retried past the 429
    first.join()


def test_nothing_private_in_logs_or_errors(server, caplog):
    caplog.set_level(logging.DEBUG)
    client = ExecutorClient(server.url)
    v = client.map([f"print({MARK!r})", f"raise ValueError({MARK!r})"], [MARK, MARK])
    assert MARK in v[0].stdout and MARK in v[1].stderr  # the caller gets its verdicts
    bad = json.dumps({"programs": [{"code": MARK, "stdin": 1}]}).encode()
    status, body, _ = post(server.url, bad)
    assert status == 400 and MARK not in json.dumps(body)
    assert MARK not in caplog.text and TOKEN not in caplog.text
    assert "POST /v1/run -> 200" in caplog.text


class _FakeHealth(http.server.BaseHTTPRequestHandler):
    level = "rlimits-only"

    def do_GET(self):  # noqa: N802
        data = json.dumps(
            {"isolation": self.level, "workers": 1, "max_batch": 8, "max_limits": {}}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_client_refuses_a_weak_executor_unless_asked_by_name():
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHealth)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    try:
        with pytest.raises(SandboxError, match="'full' but the executor .* runs 'rlimits-only'"):
            ExecutorClient(url)
        assert ExecutorClient(url, isolation="rlimits-only").level == "rlimits-only"
    finally:
        fake.shutdown()
        fake.server_close()
    with pytest.raises(SandboxError, match="unreachable"):
        ExecutorClient(url, connect_timeout_s=0.5)
    with pytest.raises(SandboxError, match="http"):
        ExecutorClient("file:///etc/passwd")


def test_open_sandbox_picks_the_executor_where_local_runs_are_forbidden(server, monkeypatch):
    monkeypatch.setenv("PRIVCODE_SANDBOX_FORBID_LOCAL", "1")
    with pytest.raises(SandboxError, match="FORBID_LOCAL"):
        open_sandbox(1)
    monkeypatch.setenv("PRIVCODE_SANDBOX_EXECUTOR", server.url)
    with open_sandbox(1, executor="http://127.0.0.1:1") as box:  # the env wins
        assert isinstance(box, ExecutorClient) and box.run("print(2)").stdout == "2\n"
    monkeypatch.delenv("PRIVCODE_SANDBOX_FORBID_LOCAL")
    monkeypatch.delenv("PRIVCODE_SANDBOX_EXECUTOR")
    with open_sandbox(1) as box:
        assert isinstance(box, SandboxPool)


def test_cli_check_on_the_executor(server, tmp_path, capsys):
    f = tmp_path / "a.py"
    f.write_text("print(6 * 7)\n")
    assert cli_main(["sandbox", "check", str(f), "--json", "--executor", server.url]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["status"], row["isolation"]) == ("ok", isolation_level())


def test_parse_limits_defaults_and_types():
    assert parse_limits(None) == SandboxLimits()
    got = parse_limits({"memory_mb": 100.0, "wall_seconds": 2})
    assert (got.memory_mb, type(got.memory_mb), got.wall_seconds) == (100, int, 2.0)
    with pytest.raises(ValueError, match="object"):
        parse_limits([1])
    with pytest.raises(ValueError, match="number"):
        parse_limits({"cpus": True})
    # issue 43 point 7: JSON's -Infinity, Infinity and NaN are a 422 naming the field, not an
    # OverflowError that closed the connection with no answer (over HTTP:
    # tests/test_executor_hostile.py)
    for text in ("-Infinity", "Infinity", "NaN"):
        limits = json.loads('{"wall_seconds": ' + text + ', "memory_mb": 64}')
        with pytest.raises(ValueError, match="limits.wall_seconds must be a finite number"):
            parse_limits(limits)


def test_the_caps_are_clamped_to_the_pods_budget():
    """workers x (memory_mb + disk_mb) + the server's reserve fit --memory-budget-mb;
    workers x disk_mb fits --disk-budget-mb (issue 43, point 3)."""
    assert clamp_limits(2) == MAX_LIMITS  # no budget: the static caps
    got = clamp_limits(2, memory_budget_mb=4096, disk_budget_mb=1024, reserve_mb=448)
    assert (got.memory_mb, got.disk_mb) == (1568, 256)  # the chart's defaults
    assert 2 * (got.memory_mb + got.disk_mb) + 448 <= 4096
    small = clamp_limits(4, memory_budget_mb=3000, disk_budget_mb=300, reserve_mb=200)
    assert (small.memory_mb, small.disk_mb) == (625, 75)
    assert 4 * (small.memory_mb + small.disk_mb) + 200 <= 3000 and 4 * small.disk_mb <= 300
    with pytest.raises(SandboxError, match="memory-budget-mb >= 1352 \\(got 1000\\)"):
        clamp_limits(2, memory_budget_mb=1000, reserve_mb=200)
    with pytest.raises(SandboxError, match="disk-budget-mb >= 128 \\(got 100\\)"):
        clamp_limits(2, disk_budget_mb=100)


class _StandIn:
    workers, level = 2, "stand-in"

    def run(self, code, stdin="", limits=None):
        return Verdict(True, "ok", 0.0, 0, "", "", self.level, None)

    def close(self):
        pass


def test_the_server_reports_and_enforces_its_clamped_caps():
    srv = ExecutorServer(
        ("127.0.0.1", 0), pool=_StandIn(), memory_budget_mb=4096, disk_budget_mb=1024
    )
    try:
        caps = srv.health()["max_limits"]
        assert (caps["memory_mb"], caps["disk_mb"]) == (1568, 256)
        status, answer = srv._answer(
            json.dumps({"programs": [{"code": "1"}], "limits": {"memory_mb": 2048}}).encode()
        )
        assert (
            status == 422 and "memory_mb=2048 exceeds this executor's cap 1568" in answer["error"]
        )
    finally:
        srv.server_close()
    with pytest.raises(SandboxError, match="cannot hold its default limits"):
        ExecutorServer(("127.0.0.1", 0), pool=_StandIn(), memory_budget_mb=1024)


def test_serve_needs_a_token_or_insecure_no_auth_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PRIVCODE_EXECUTOR_TOKEN_FILE", raising=False)
    args = ["sandbox", "serve", "--port", "1", "--isolation", "rlimits-only"]
    assert cli_main(args) == 2
    assert "--token-file PATH" in capsys.readouterr().err
    weak = tmp_path / "weak"
    weak.write_text("short")
    assert cli_main([*args, "--token-file", str(weak)]) == 2
    err = capsys.readouterr().err
    assert "at least 16" in err and "short" not in err.replace(str(weak), "")
    monkeypatch.setenv("PRIVCODE_EXECUTOR_TOKEN_FILE", str(tmp_path / "missing"))
    assert cli_main(args) == 2 and "missing" in capsys.readouterr().err
    tight = [*args, "--insecure-no-auth", "--memory-budget-mb", "900", "--disk-budget-mb", "900"]
    monkeypatch.delenv("PRIVCODE_EXECUTOR_TOKEN_FILE")
    assert cli_main(tight) == 2
    assert "cannot hold its default limits" in capsys.readouterr().err


def test_the_client_sends_its_token_and_a_wrong_one_is_a_clear_error(server, tmp_path, monkeypatch):
    assert preflight("full", server.url) == isolation_level()  # token checked: accepted
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-executor-token-at-all")
    monkeypatch.setenv("PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE", str(wrong))
    with pytest.raises(SandboxError, match="refused the token \\(401\\); token file: .*wrong"):
        preflight("full", server.url)
    with pytest.raises(SandboxError, match="401") as exc:
        ExecutorClient(server.url).map(["print(1)"])
    assert "not-the-executor-token" not in str(exc.value)
    monkeypatch.delenv("PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE")
    with pytest.raises(SandboxError, match="PRIVCODE_SANDBOX_EXECUTOR_TOKEN_FILE is unset"):
        ExecutorClient(server.url).run("print(1)")


def test_the_charts_executor_capabilities_are_enough_for_the_full_sandbox():
    """Root with only executor.securityContext's capabilities (as in the executor pod): full."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    if not is_full(isolation_level()) or not shutil.which("setpriv"):
        pytest.skip("needs root with the full sandbox, and setpriv")
    values = yaml.safe_load((Path(__file__).parents[1] / "charts/privcode/values.yaml").read_text())
    caps = values["executor"]["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    bounding = "-all," + ",".join("+" + c.lower() for c in caps["add"])
    code = (
        "from privcode.sandbox import SandboxPool, isolation_level\n"
        "print(isolation_level())\n"
        "with SandboxPool(1) as p:\n"
        "    v = p.map(['print(6 * 7)', 'import socket; socket.create_connection((\"1.1.1.1\", 53), 1)'])\n"
        "print(v[0].stdout.strip(), v[1].status)\n"
    )
    proc = subprocess.run(
        ["setpriv", "--bounding-set", bounding, "--inh-caps", "-all", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    level, result = proc.stdout.split("\n")[:2]
    assert is_full(level) and result == "42 error", proc.stdout
