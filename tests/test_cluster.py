"""Local Ray head, token auth, driver connection and Jobs API submission.

The ``ray``-marked tests run against the real session head from
``conftest.ray_cluster`` (127.0.0.1, token auth on) and submit real jobs
through the Jobs API; nothing is mocked.  The others check the pure helpers.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from privcode.cluster import jobs, local, ray_env
from privcode.errors import PrivcodeError

JOB_TIMEOUT_S = 300


# --------------------------------------------------------------------------- pure helpers


def test_token_is_created_private_and_sent_as_bearer(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    token_file = tmp_path / "sub" / "auth_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))

    assert ray_env.read_token() is None
    token = ray_env.ensure_token()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert ray_env.ensure_token() == token  # never regenerated
    assert ray_env.auth_headers("http://127.0.0.1:8265") == {"Authorization": f"Bearer {token}"}

    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")  # Ray's precedence: value beats file
    assert ray_env.read_token() == "from-env"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_env.auth_headers("http://127.0.0.1:8265") == {}
    assert not ray_env.auth_enabled()


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("auto", True),
        ("127.0.0.1:6379", True),
        ("localhost:6379", True),
        ("ray://127.0.0.1:10001", True),
        ("[::1]:6379", True),
        ("http://127.0.0.1:8265", True),
        ("10.1.2.3:6379", False),
        ("ray://head.svc:10001", False),
        ("https://ray.example:443", False),
    ],
)
def test_loopback_detection(address, loopback):
    assert ray_env.address_is_loopback(address) is loopback


def test_dashboard_address_forms(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert jobs.resolve_dashboard_address("http://10.0.0.5:8265/") == "http://10.0.0.5:8265"
    assert jobs.resolve_dashboard_address("ray://10.0.0.5:10001") == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_ADDRESS", "https://ray.example")
    assert jobs.resolve_dashboard_address(None) == "https://ray.example"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://api:1")  # Ray's own precedence
    assert jobs.resolve_dashboard_address(None) == "http://api:1"


def test_connect_refuses_a_dashboard_url():
    with pytest.raises(PrivcodeError, match="dashboard URL"):
        local.connect("http://127.0.0.1:8265")


def test_pipeline_entrypoint_runtime_env_and_config_path(tmp_path):
    assert jobs.pipeline_entrypoint("jobs/configs/demo.yaml", ["data.size=200", "x.y=a b"]) == (
        "python jobs/pipeline.py --config jobs/configs/demo.yaml "
        "--set data.size=200 --set 'x.y=a b'"
    )

    root = jobs.repo_root()
    assert (root / "jobs").is_dir() and (root / "privcode").is_dir()
    env = jobs.pipeline_runtime_env({"env_vars": {"A": "1"}, "excludes": ["big/"]})
    assert env["working_dir"] == str(root) and env["env_vars"] == {"A": "1"}
    assert {".venv/", ".git/", "/runs/", "/reports/", "__pycache__/", "big/"} <= set(
        env["excludes"]
    )

    config = tmp_path / "jobs" / "configs" / "c.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("{}\n")
    assert jobs._config_in_working_dir("jobs/configs/c.yaml", tmp_path) == "jobs/configs/c.yaml"
    assert jobs._config_in_working_dir(config, tmp_path) == "jobs/configs/c.yaml"
    with pytest.raises(PrivcodeError, match="not a file inside"):
        jobs._config_in_working_dir(config, root)
    with pytest.raises(PrivcodeError, match="not a file inside"):
        jobs._config_in_working_dir("jobs/configs/missing.yaml", tmp_path)


# --------------------------------------------------------------------------- the session head


def _get(url: str, headers: dict[str, str]) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.ray
def test_head_requires_the_token_and_listens_on_loopback_only(ray_cluster):
    import psutil

    url = f"{ray_cluster.dashboard_url}/api/version"
    assert _get(url, {}) == 401
    assert _get(url, {"Authorization": "Bearer not-the-token"}) == 403
    assert _get(url, ray_env.auth_headers(url)) == 200

    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    for port in (ray_cluster.port, ray_cluster.dashboard_port):
        hosts = {ip for ip, p in listening if p == port}
        assert hosts and hosts <= {"127.0.0.1", "::ffff:127.0.0.1"}, (port, hosts)


@pytest.mark.ray
def test_start_head_is_idempotent_and_status_reports_it(ray_cluster):
    again = local.start_head(
        port=ray_cluster.port,
        dashboard_port=ray_cluster.dashboard_port,
        temp_dir=ray_cluster.temp_dir,
    )
    assert again["started"] is False
    assert again["address"] == ray_cluster.address
    assert again["dashboard_url"] == ray_cluster.dashboard_url

    status = local.head_status(ray_cluster.dashboard_url)
    assert status["up"] is True and status["auth_mode"] == "token"
    assert status["ray_version"].startswith("2.60") and status["nodes"] == 1
    # The session head runs this interpreter's Ray; one of another checkout is refused.
    assert local.head_installation(ray_cluster.port) == local._ray_package_dir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local, "head_installation", lambda port: "/elsewhere/.venv/ray")
        with pytest.raises(PrivcodeError, match=r"another installation's Ray \(/elsewhere"):
            local.start_head(
                port=ray_cluster.port,
                dashboard_port=ray_cluster.dashboard_port,
                temp_dir=ray_cluster.temp_dir,
            )


def test_installation_of_a_gcs_binary(tmp_path):
    ray_dir = tmp_path / "venv" / "site-packages" / "ray"
    gcs = ray_dir / "core" / "src" / "ray" / "gcs" / "gcs_server"
    gcs.parent.mkdir(parents=True)
    gcs.write_text("")
    assert local.installation_of(str(gcs)) == str(ray_dir.resolve())
    assert local.installation_of(str(tmp_path / "gcs_server")) is None
    assert local.head_installation(1) is None  # no GCS on port 1


@pytest.mark.ray
def test_a_wrong_token_is_reported_not_papered_over(ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)  # beats the session's token file
    status = local.head_status(ray_cluster.dashboard_url)
    assert status["up"] is False and "403" in status["error"]
    with pytest.raises(PrivcodeError, match="rejects our auth token"):
        local.start_head(port=ray_cluster.port, dashboard_port=ray_cluster.dashboard_port)


@pytest.mark.ray
def test_job_connects_to_ray_with_the_token_and_its_stdout_is_read_back(ray_cluster):
    entrypoint = (
        'python -c "import ray; ray.init(); print(ray.get(ray.remote(lambda: 6*7).remote()))"'
    )
    job_id = jobs.submit_job(entrypoint, address=ray_cluster.dashboard_url)
    status = jobs.wait_for_job(job_id, ray_cluster.dashboard_url, timeout_s=JOB_TIMEOUT_S)
    logs = jobs.job_logs(job_id, ray_cluster.dashboard_url)
    assert status == "SUCCEEDED", logs
    assert "42" in [line.strip() for line in logs.splitlines()], logs


@pytest.mark.ray
def test_failing_job_reports_failed(ray_cluster):
    job_id = jobs.submit_job(
        "python -c \"import sys; print('boom'); sys.exit(3)\"", address=ray_cluster.dashboard_url
    )
    status = jobs.wait_for_job(job_id, ray_cluster.dashboard_url, timeout_s=JOB_TIMEOUT_S)
    assert status == "FAILED"
    assert "boom" in jobs.job_logs(job_id, ray_cluster.dashboard_url)


@pytest.mark.ray
def test_gcs_address_and_followed_logs_with_the_repo_working_dir(ray_cluster):
    """The GCS form of the address resolves to the dashboard; the upload skips .venv/.git."""
    assert jobs.resolve_dashboard_address(ray_cluster.address) == ray_cluster.dashboard_url
    script = "import os; print('LISTING', sorted(os.listdir('.')))"
    job_id = jobs.submit_job(
        f'python -c "{script}"',
        address=ray_cluster.address,
        runtime_env=jobs.pipeline_runtime_env(),
    )
    out = io.StringIO()
    status = jobs.wait_for_job(
        job_id, ray_cluster.address, timeout_s=JOB_TIMEOUT_S, follow=True, out=out
    )
    assert status == "SUCCEEDED", out.getvalue()
    listing = next(line for line in out.getvalue().splitlines() if line.startswith("LISTING"))
    assert "'jobs'" in listing and "'privcode'" in listing
    assert "'.venv'" not in listing and "'.git'" not in listing


@pytest.mark.ray
def test_submit_pipeline_path_with_a_stand_in_entry_point(ray_cluster, tmp_path, capsys):
    """submit_pipeline end to end, with a stand-in jobs/pipeline.py in its own working dir."""
    (tmp_path / "jobs" / "configs").mkdir(parents=True)
    (tmp_path / "jobs" / "configs" / "tiny.yaml").write_text("data: {size: 30}\n")
    (tmp_path / "jobs" / "pipeline.py").write_text(
        textwrap.dedent("""\
        import sys
        print("STAND-IN", " ".join(sys.argv[1:]))
        """)
    )
    result = jobs.submit_pipeline(
        config="jobs/configs/tiny.yaml",
        address=None,
        overrides=["data.size=30"],
        follow=True,
        timeout_s=JOB_TIMEOUT_S,
        runtime_env={"working_dir": str(tmp_path)},
    )
    err = capsys.readouterr().err
    assert result["status"] == "SUCCEEDED", err
    assert result["dashboard_url"] == ray_cluster.dashboard_url  # via RAY_ADDRESS (GCS form)
    assert result["job_id"] in err and result["job_url"] in err
    assert "STAND-IN --config jobs/configs/tiny.yaml --set data.size=30" in err


def test_submit_targets_pick_their_cluster(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(PrivcodeError, match="TARGET=ray needs the cluster's address"):
        jobs.target_address("ray")
    assert jobs.target_address("ray", "http://10.0.0.5:8265") == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.6:8265")
    assert jobs.target_address("ray") == "http://10.0.0.6:8265"
    with pytest.raises(PrivcodeError, match="not to http://10.0.0.5:8265; use TARGET=ray"):
        jobs.target_address("local", "http://10.0.0.5:8265")
    with pytest.raises(PrivcodeError, match="unknown submit target 'moon'"):
        jobs.target_address("moon")
    assert (
        jobs.pipeline_entrypoint("c.yaml", ["a.b=1"], ["data", "base"])
        == "python jobs/pipeline.py --config c.yaml --set a.b=1 --stages data base"
    )


def test_make_submit_job_targets_run_a_stage_on_a_real_head(ray_cluster, tmp_path):
    """cluster/submit-job.sh (what `make submit-job` runs) with TARGET=ray and RAY_ADDRESS in
    GCS form; TARGET=local accepts the same head by its loopback dashboard (the session head
    does not use the default ports, so the local default itself is not exercised here)."""
    import subprocess

    assert jobs.target_address("local", ray_cluster.dashboard_url) == ray_cluster.dashboard_url
    root = jobs.repo_root()
    env = {**os.environ, "TARGET": "ray", "PYTHON": sys.executable}
    cmd = [
        "bash",
        str(root / "cluster" / "submit-job.sh"),
        "--stages",
        "data",
        "--set",
        f"run.out_dir={tmp_path / 'runs'}",
        "--set",
        "run.name=sj",
        "--set",
        "data.size=30",
        # 27 members: one canary row at most (canaries take at most 5% of the training records)
        "--set",
        "data.canary_kinds=[email]",
        "--set",
        "data.canary_placements=[joint]",
        "--set",
        "data.canary_repetitions=[1]",
        "--json",
    ]
    done = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == "SUCCEEDED"
    assert result["dashboard_url"] == ray_cluster.dashboard_url
    assert (tmp_path / "runs" / "sj" / "data" / "train.parquet").is_file()
    assert not (tmp_path / "runs" / "sj" / "base").exists()  # only the stage asked for


@pytest.mark.ray
def test_connect_joins_the_session_head(ray_connected, ray_cluster):
    import ray

    assert ray_connected["address"] == ray_cluster.address
    assert ray_connected["dashboard_url"] == ray_cluster.dashboard_url

    @ray.remote
    def where(x: int) -> tuple[int, str, int]:
        return x * x, ray.util.get_node_ip_address(), os.getpid()

    value, node_ip, pid = ray.get(where.remote(7))
    assert (value, node_ip) == (49, "127.0.0.1") and pid != os.getpid()
    assert ray.get_runtime_context().gcs_address == ray_cluster.address
    assert local.connect()["started"] is False  # idempotent


def test_repo_root_is_the_checkout():
    assert jobs.repo_root() == Path(__file__).resolve().parents[1]


_IN_PROCESS = textwrap.dedent("""\
    import json, psutil, ray
    from privcode.cluster import local
    info = local.connect()
    ip = ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote())
    mine = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
    hosts = sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.pid in mine})
    print("RESULT", json.dumps({**info, "ip": ip, "hosts": hosts, "again": local.connect()}))
    """)


@pytest.mark.ray
def test_connect_without_address_starts_a_loopback_cluster_in_process(tmp_path):
    """The `privcode run` path with no RAY_ADDRESS: a fresh process, its own cluster.

    Also beside a local head (``make demo``'s): ray.init would join the cluster in
    ``ray_current_cluster`` and then refuse num_cpus; connect() starts its own.
    """
    import json
    import subprocess

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE")
    }
    token = tmp_path / "token"
    ray_tmp = Path(tempfile.mkdtemp(prefix="pcr-", dir="/tmp"))  # short socket paths
    env.update(RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(ray_tmp))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # a head's address
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _IN_PROCESS],
            env=env,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["started"] is True and result["address"].startswith("127.0.0.1:")
    assert result["address"] != "127.0.0.1:1"
    assert result["ip"] == "127.0.0.1" and result["again"]["started"] is False
    assert result["hosts"] and set(result["hosts"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}
    assert len(token.read_text().strip()) == 64  # created where RAY_AUTH_TOKEN_PATH says


def test_process_env_telemetry_off_passive_omp_in_drivers_and_head_unless_chosen(monkeypatch):
    for key in ray_env.PROCESS_ENV:
        monkeypatch.delenv(key, raising=False)
    env = ray_env.head_env()
    assert {k: env[k] for k in ray_env.PROCESS_ENV} == {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DATA_USAGE_DISABLED": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    ray_env.apply_process_env()
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_DATA_USAGE_DISABLED"] == "1"
    from ray._common.usage.usage_lib import usage_stats_enabled

    assert not usage_stats_enabled()
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # an explicit choice is kept
    ray_env.apply_process_env()
    assert ray_env.head_env()["RAY_USAGE_STATS_ENABLED"] == "1"


def test_local_head_workers_share_the_cpu_at_nice_0(monkeypatch, ray_connected):
    monkeypatch.delenv(ray_env.WORKER_NICENESS_ENV, raising=False)
    assert ray_env.head_env()[ray_env.WORKER_NICENESS_ENV] == "0"
    monkeypatch.setenv(ray_env.WORKER_NICENESS_ENV, "10")  # an explicit choice is kept
    assert ray_env.head_env()[ray_env.WORKER_NICENESS_ENV] == "10"
    import ray

    # The session head was started with head_env(): its task workers run at nice 0
    # (Ray's default of 15 would hand every CPU to any other busy process).
    assert ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()) == 0


@pytest.mark.parametrize("first_log", [local._RAYLET_TIMEOUT + ".", "some other failure"])
def test_a_raylet_that_misses_rays_start_window_is_retried_once(tmp_path, monkeypatch, first_log):
    """`ray start` gives the raylet a fixed 30 s to register (a busy machine can miss
    it): that one failure is cleared and retried once; any other failure is reported."""
    starts, stops = [], []

    def fake_start(cmd, log_file, wait_s):
        starts.append(cmd)
        log_file.write_text(first_log if len(starts) == 1 else "second failure")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(local, "_ray_start", fake_start)
    monkeypatch.setattr(local, "stop_head", lambda port: stops.append(port))
    port = local.free_port()
    with pytest.raises(PrivcodeError, match="failed \\(exit 1\\)") as failed:
        local.start_head(port=port, dashboard_port=local.free_port(), temp_dir=tmp_path)
    retried = first_log.startswith(local._RAYLET_TIMEOUT)
    assert len(starts) == (2 if retried else 1) and stops == ([port] if retried else [])
    assert ("second failure" if retried else first_log) in str(failed.value)
