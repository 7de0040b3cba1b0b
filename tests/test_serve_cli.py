"""Issue 43, point 10: `privcode serve` and its key directory.

* ``--insecure-no-auth`` is refused where the cluster's Serve proxy already listens beyond
  loopback (Ray keeps a running proxy's host, whatever ``--host`` says);
* the key directory handed to the replicas goes on every way out, signals included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from serve_support import TEST_KEY

from privcode.errors import PrivcodeError
from privcode.serve import cli


class _Started(Exception):
    """serve.start was reached: every check before it passed."""


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """`privcode serve` up to serve.start, with a Serve proxy whose host the test sets."""
    from ray import serve

    running = SimpleNamespace(host=None)

    def client(raise_if_no_controller_running=True):
        if running.host is None:
            return None
        return SimpleNamespace(http_config=SimpleNamespace(host=running.host))

    def start(**kwargs):
        raise _Started(kwargs)

    monkeypatch.setattr("ray.serve.context._get_global_client", client)
    monkeypatch.setattr("privcode.cluster.local.connect", lambda *a, **k: None)
    monkeypatch.setattr(serve, "start", start)
    monkeypatch.delenv("PRIVCODE_API_KEY", raising=False)
    monkeypatch.delenv("PRIVCODE_API_KEYS_DIR", raising=False)
    return running


def _serve(tmp_path, *extra: str) -> int:
    from privcode.cli import main

    return main(["serve", "--premium", str(tmp_path), "--set", f"run.out_dir={tmp_path}", *extra])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_insecure_no_auth_is_refused_where_the_proxy_listens_beyond_loopback(
    no_ray, tmp_path, capsys, host
):
    no_ray.host = host
    assert _serve(tmp_path, "--insecure-no-auth") == 2
    err = capsys.readouterr().err
    assert "--insecure-no-auth refused" in err and f"listens on {host!r}" in err
    assert "PRIVCODE_API_KEY" in err


def test_insecure_no_auth_goes_on_with_a_loopback_proxy_or_none(no_ray, tmp_path):
    for running in (None, "127.0.0.1"):
        no_ray.host = running
        with pytest.raises(_Started) as started:
            _serve(tmp_path, "--insecure-no-auth")
        assert started.value.args[0]["http_options"]["host"] == "127.0.0.1"


def test_a_keyed_server_may_join_a_proxy_on_every_interface(no_ray, tmp_path, monkeypatch):
    no_ray.host = "0.0.0.0"
    monkeypatch.setenv("PRIVCODE_API_KEY", TEST_KEY)
    with pytest.raises(_Started):
        _serve(tmp_path)
    cli.check_proxy_host(False, "127.0.0.1", "0.0.0.0")  # a key guards it
    with pytest.raises(PrivcodeError, match="refused"):
        cli.check_proxy_host(True, "127.0.0.1", "0.0.0.0")


_SERVE_UNTIL_SIGNALLED = """
import sys, time
from privcode.serve import cli

def serve_apps(args, cfg, guard):
    print(guard["api_keys_dir"], flush=True)
    time.sleep(60)
    return 0

cli._serve_apps = serve_apps
from privcode.cli import main
sys.exit(main(["serve", "--premium", sys.argv[1], "--set", "run.out_dir=" + sys.argv[1]]))
"""


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_the_key_directory_goes_on_every_signal(tmp_path, sig):
    env = {**os.environ, "PRIVCODE_API_KEY": TEST_KEY}
    env.pop("PRIVCODE_API_KEYS_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_UNTIL_SIGNALLED, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        folder = Path(proc.stdout.readline().strip())
        assert (folder / "default").read_text() == TEST_KEY
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not folder.exists(), f"{sig.name} left the key directory behind"
    assert proc.returncode != 0


def test_the_key_directory_goes_on_return_and_error_and_handlers_come_back(monkeypatch):
    monkeypatch.setenv("PRIVCODE_API_KEY", TEST_KEY)
    monkeypatch.delenv("PRIVCODE_API_KEYS_DIR", raising=False)
    before = {sig: signal.getsignal(sig) for sig in cli.EXIT_HANDLERS}
    with cli.replica_keys_dir({"api_keys_dir": None}) as folder:
        assert Path(folder, "default").is_file()
        assert signal.getsignal(signal.SIGHUP) is cli._exit_on_signal
    assert not Path(folder).exists()
    with pytest.raises(RuntimeError), cli.replica_keys_dir({"api_keys_dir": None}) as folder:
        raise RuntimeError("boom")
    assert not Path(folder).exists()
    assert {sig: signal.getsignal(sig) for sig in cli.EXIT_HANDLERS} == before
    with cli.replica_keys_dir({"api_keys_dir": "/keys"}) as none:  # configured: nothing made
        assert none is None
