"""Issue 43, point 10: the Ray token goes only to its own cluster; uploads hold tracked files.

The token test runs ``jobs.client`` in a fresh interpreter in Ray's token mode (as a
job driver is) against a stand-in dashboard on this machine's non-loopback address,
which records the Authorization header it gets.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from privcode.cluster import git_files, jobs, ray_env
from privcode.errors import PrivcodeError

TOKEN = "f" * 64


def test_token_is_bound_to_loopback_and_the_environment_cluster(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    for name in ray_env.ADDRESS_ENVS:
        monkeypatch.delenv(name, raising=False)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert ray_env.auth_headers("http://127.0.0.1:8265") == bearer
    assert ray_env.auth_headers("http://[::1]:8265") == bearer
    assert ray_env.auth_headers("http://localhost:8265/api/jobs/") == bearer
    for foreign in (
        "http://10.0.0.5:8265",
        "https://ray.example",
        "http://127.0.0.1.evil.example:8265",
        "http://127.0.0.1@evil.example:8265",
    ):
        assert ray_env.auth_headers(foreign) == {}, foreign
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.5:10001")
    assert ray_env.auth_headers("http://10.0.0.5:8265") == bearer
    assert ray_env.auth_headers("http://10.0.0.6:8265") == {}
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "https://Ray.Example/")
    assert ray_env.auth_headers("https://ray.example:443") == bearer


def _routable_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), else None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


class _Dashboard(http.server.BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        auth = self.headers.get("Authorization")
        _Dashboard.seen.append(auth)
        ok = auth == f"Bearer {TOKEN}"
        body = json.dumps({"ray_version": "2.60.0"} if ok else {"error": "no token"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def foreign_dashboard():
    ip = _routable_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this machine")
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Dashboard.seen = []
    yield f"http://{ip}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


_CLIENT = """
import sys
from privcode.cluster import jobs
from privcode.errors import PrivcodeError
try:
    jobs.client(sys.argv[1])
    print("CONNECTED")
except PrivcodeError as exc:
    print("ERROR", exc)
"""


def _client_in_token_mode(url: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ray_env.ADDRESS_ENVS}
    base.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN, **env)
    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, url], env=base, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_foreign_dashboard_gets_no_token_and_a_401_is_a_clear_error(foreign_dashboard):
    out = _client_in_token_mode(foreign_dashboard)
    assert _Dashboard.seen and all(not auth for auth in _Dashboard.seen), _Dashboard.seen
    assert "ERROR the Ray cluster at" in out and f"RAY_ADDRESS={foreign_dashboard}" in out
    assert TOKEN not in out

    _Dashboard.seen = []  # the cluster the environment names gets it
    out = _client_in_token_mode(foreign_dashboard, RAY_ADDRESS=foreign_dashboard)
    assert "CONNECTED" in out, out
    assert _Dashboard.seen and set(_Dashboard.seen) == {f"Bearer {TOKEN}"}


# --------------------------------------------------------------------------- working_dir


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "jobs" / "configs").mkdir(parents=True)
    (repo / "jobs" / "pipeline.py").write_text("print('hi')\n")
    (repo / "jobs" / "configs" / "c.yaml").write_text("{}\n")
    (repo / ".gitignore").write_text("ignored.key\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (repo / "secret.txt").write_text("untracked secret\n")
    (repo / "ignored.key").write_text("ignored secret\n")
    (repo / "scratch").mkdir()
    (repo / "scratch" / "dump.jsonl").write_text("{}\n")
    (repo / "jobs" / "odd [name]*.txt").write_text("untracked\n")
    (repo / "jobs" / "configs" / "new.yaml").write_text("{}\n")
    return repo


def test_working_dir_upload_holds_only_tracked_files(checkout, tmp_path):
    from ray._private.runtime_env.packaging import create_package

    env = jobs.pipeline_runtime_env({"working_dir": str(checkout)})
    package = tmp_path / "pkg.zip"
    # Ray's own .gitignore handling off: the excludes alone must keep everything out.
    create_package(str(checkout), package, include_gitignore=False, excludes=env["excludes"])
    names = {n for n in zipfile.ZipFile(package).namelist() if not n.endswith("/")}
    assert names == {".gitignore", "jobs/pipeline.py", "jobs/configs/c.yaml"}
    assert "/secret.txt" in env["excludes"] and "/scratch/" in env["excludes"]

    assert jobs._config_in_working_dir("jobs/configs/c.yaml", checkout) == "jobs/configs/c.yaml"
    with pytest.raises(PrivcodeError, match="'jobs/configs/new.yaml' is not tracked by git"):
        jobs._config_in_working_dir("jobs/configs/new.yaml", checkout)


def test_outside_a_checkout_only_the_fixed_excludes_apply(tmp_path):
    assert git_files.untracked_excludes(tmp_path) is None
    env = jobs.pipeline_runtime_env({"working_dir": str(tmp_path)})
    assert env["excludes"] == list(jobs.WORKING_DIR_EXCLUDES)
