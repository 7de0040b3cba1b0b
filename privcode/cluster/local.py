"""A local Ray head on 127.0.0.1, token authentication, and the one ``ray.init``.

What Ray 2.60 does about authentication (read from its source, checked live):

* The mode comes from the ``RAY_AUTH_MODE`` environment variable (``token`` or
  ``disabled``); it cannot be set through ``_system_config``.  Ray caches it
  in its C++ config when ``ray`` is imported, so a process that changes the
  variable afterwards must refresh that cache (``ray._raylet.Config.initialize``,
  which is what Ray itself does when it turns token mode on).
* The token is looked up, in this order, in ``RAY_AUTH_TOKEN`` (the value),
  the file named by ``RAY_AUTH_TOKEN_PATH``, and ``~/.ray/auth_token``.
  ``ray get-auth-token --generate`` writes a random 64-hex-digit token to the
  default file if none exists.
* ``ray.init()`` with no address (a new in-process cluster) turns token mode
  on unless ``RAY_AUTH_MODE`` says otherwise, and writes
  ``~/.ray/auth_token`` if no token exists.
* ``ray start --head`` turns token mode on only if ``RAY_AUTH_MODE`` is
  unset *and* a token already exists; otherwise the head starts WITHOUT auth
  (with a warning).  With ``RAY_AUTH_MODE=token`` it requires the token to
  exist already.  :func:`start_head` therefore creates the token first and
  sets ``RAY_AUTH_MODE=token`` explicitly.
* Joining an existing cluster: ``ray.init(address="auto")`` turns token mode
  on when a token is found; an explicit address (argument or ``RAY_ADDRESS``)
  never does, so without ``RAY_AUTH_MODE=token`` the driver is rejected by the
  GCS ("InvalidAuthToken").  :func:`connect` sets it.
* Every process the head spawns (raylet, workers, Jobs drivers) inherits the
  environment of ``ray start``: a job's own ``ray.init()`` sees
  ``RAY_AUTH_MODE=token`` and the token source and connects without help.
* HTTP: the dashboard and the Jobs API want ``Authorization: Bearer <token>``
  (or ``X-Ray-Authorization``, or the ``ray-authentication-token`` cookie).
  Missing token: 401, wrong token: 403.  A few paths are public, among them
  ``/api/authentication_mode``, ``/api/healthz`` and ``/api/gcs_healthz``;
  ``/api/version`` and ``/api/jobs/`` are not.  ``JobSubmissionClient`` adds
  the header only when the calling process is in token mode, so privcode
  passes :func:`auth_headers` explicitly.

Binding to 127.0.0.1: Ray rewrites ``--node-ip-address=127.0.0.1`` (and any
"localhost" address a driver is given) to the machine's routable IP unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; with that variable the head records
127.0.0.1 as its node IP and the GCS, raylet, agents and client server all
listen on 127.0.0.1 only.  The same variable must be set in a driver joining
such a head, or the driver dials the routable IP where nothing listens.  It
also stops other machines from joining, which is what a local head wants.

Privcode's default is token mode; ``RAY_AUTH_MODE=disabled`` in the
environment is respected (for a cluster started without auth).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for "multi-node clusters off": node IP stays 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
DEFAULT_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
# Fixed default ports of two head services; taken ones are replaced by free ones
# so a second head (e.g. the test suite's) does not collide with a developer's.
_CLIENT_SERVER_PORT = 10001
_AGENT_LISTEN_PORT = 52365


# --------------------------------------------------------------------------- auth token


def auth_enabled() -> bool:
    """Whether privcode uses token auth: yes unless ``RAY_AUTH_MODE=disabled``."""
    return os.environ.get(AUTH_MODE_ENV, "token").strip().lower() != "disabled"


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def token_path() -> Path:
    """The token file Ray reads: ``RAY_AUTH_TOKEN_PATH`` if set, else ``~/.ray/auth_token``."""
    custom = os.environ.get(TOKEN_PATH_ENV)
    return Path(custom).expanduser() if custom else default_token_path()


def read_token() -> str | None:
    """The token Ray would use, in Ray's order of precedence; None if there is none."""
    value = os.environ.get(TOKEN_ENV, "").strip()
    if value:
        return value
    path = token_path()
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    return value or None


def ensure_token() -> str:
    """Return the token, creating the token file (mode 0600) if no token exists.

    Same format as ``ray get-auth-token --generate`` (256 random bits, hex).
    Written with O_EXCL so two processes racing here end up with one token.
    """
    existing = read_token()
    if existing:
        return existing
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # Another process is creating it right now: use its token once written.
        for _ in range(100):
            if token := read_token():
                return token
            time.sleep(0.02)
        raise PrivcodeError(
            f"Ray auth token file {path} is empty; delete it or write the cluster's token into it"
        ) from None
    token = secrets.token_hex(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    log.info("generated a Ray auth token in %s", path)
    return token


def auth_headers() -> dict[str, str]:
    """HTTP headers for the dashboard / Jobs API: a bearer token, or {} without auth."""
    if not auth_enabled():
        return {}
    token = read_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _address_is_loopback(address: str) -> bool:
    """True for "auto" and for host:port / scheme://host:port addresses on this machine."""
    if address == "auto":
        return True
    netloc = address.split("://", 1)[-1].split("/", 1)[0]
    if netloc.startswith("["):  # [::1]:6379
        host = netloc[1:].split("]", 1)[0]
    elif netloc.count(":") == 1:  # host:port
        host = netloc.split(":", 1)[0]
    else:  # bare host or bare IPv6
        host = netloc
    return _is_loopback_host(host)


#: Process environment for every privcode process (driver, head, workers), each
#: applied only where the environment has not chosen already:
#: Ray's usage telemetry off (nothing phones home; Ray Data's driver-side usage
#: poller would otherwise query a Prometheus server every 10 s), and OpenMP
#: threads that sleep instead of spinning when they wait: with the default
#: (active) policy a 2-thread torch step on 2 cores beside one busy process
#: took 7.6 s instead of 1.3 s (the spinning thread waits for the descheduled one).
PROCESS_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DATA_USAGE_DISABLED": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
}


#: Ray's setting of its workers' nice value (Ray's default: 15), for :func:`head_env`.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def apply_process_env() -> None:
    """Set :data:`PROCESS_ENV` in this process, unless the environment says otherwise.

    OpenMP reads its policy when torch loads it: call this before importing torch.
    """
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)


def prepare_driver_env(loopback: bool = True) -> None:
    """Set up this process so ``ray.init`` can join a token-auth head on 127.0.0.1.

    Sets ``RAY_AUTH_MODE=token`` (when privcode's auth is on and a token
    exists) and, for a loopback cluster, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``;
    then refreshes Ray's cached copies of both, since ``ray`` may already be
    imported.  Must run before ``ray.init``; child processes inherit the env.

    Also applies :data:`PROCESS_ENV` (Ray telemetry off, passive OpenMP waits)
    unless the environment already chose.
    """
    apply_process_env()
    if auth_enabled() and read_token():
        os.environ[AUTH_MODE_ENV] = "token"
    if loopback:
        os.environ[LOOPBACK_ENV] = "0"
    if "ray" not in sys.modules:
        return  # nothing cached yet; the import will read the environment
    import ray

    if ray.is_initialized():
        return  # refreshing the config under a live driver is not safe
    from ray._private import ray_constants
    from ray._raylet import Config

    if loopback:
        ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")


def head_env() -> dict[str, str]:
    """Environment for ``ray start``: token mode, loopback node IP, this venv first on PATH.

    PATH matters because Jobs entry points say ``python ...`` and run with the
    head's environment: they must find the interpreter that has privcode.
    """
    env = dict(os.environ)
    if auth_enabled():
        env[AUTH_MODE_ENV] = "token"
    env[LOOPBACK_ENV] = "0"
    for key, value in PROCESS_ENV.items():  # the stage tasks inherit it
        env.setdefault(key, value)
    # Ray starts its workers at nice 15 so that they yield to the raylet and drivers; on a
    # local head the workers ARE the user's job, and at nice 15 they also yield every CPU
    # to any other busy process (measured: a demo beside one busy process ran on one of
    # two cores). At 0 they share the machine fairly with the user's other work.
    env.setdefault(WORKER_NICENESS_ENV, "0")
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env.pop("RAY_ADDRESS", None)  # `ray start --head` must not try to join anything
    return env


# --------------------------------------------------------------------------- probes


def ray_binary() -> str:
    """The ``ray`` executable next to the current interpreter (the same venv)."""
    candidate = Path(sys.executable).parent / "ray"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ray")
    if not found:
        raise PrivcodeError(
            f"no `ray` executable next to {sys.executable} or on PATH; "
            "install ray[default] in this environment"
        )
    return found


def _port_open(port: int, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _http_get(url: str, timeout: float = 3.0, auth: bool = True) -> tuple[int, Any]:
    """GET ``url``; (status, parsed JSON or text).  Status 0 means no HTTP answer."""
    req = urllib.request.Request(url, headers=auth_headers() if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException):
        # No HTTP server there (refused, timeout, or e.g. a gRPC port answering).
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def _dashboard_url(dashboard_port: int) -> str:
    return f"http://{LOOPBACK}:{dashboard_port}"


# --------------------------------------------------------------------------- head


def _default_temp_root() -> Path:
    """Ray's default temp root (``$RAY_TMPDIR``/``$TMPDIR``/``/tmp`` + ``/ray``)."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / "ray"


def start_head(
    port: int = DEFAULT_PORT,
    dashboard_port: int = DEFAULT_DASHBOARD_PORT,
    num_cpus: int | None = None,
    temp_dir: str | os.PathLike | None = None,
    wait_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Start a Ray head bound to 127.0.0.1 (GCS ``port``, dashboard ``dashboard_port``).

    Idempotent: when a head already answers on both ports (the dashboard
    accepting our token), returns ``started: False`` without starting another.
    Otherwise runs ``ray start --head`` from this interpreter's environment
    with :func:`head_env`, then waits until the GCS port and the dashboard's
    authenticated ``/api/version`` and ``/api/jobs/`` answer.

    ``temp_dir`` is Ray's temp root (keep it short: Unix socket paths inside
    it are limited to ~107 bytes).  ``extra_args`` go to ``ray start`` as is.

    Returns ``address`` (GCS, host:port), ``dashboard_url``, ``started``,
    ``auth_mode``, ``log_file`` (``ray start`` output) and ``temp_dir``.
    Raises :class:`PrivcodeError` naming the port and log file on failure.
    """
    address = f"{LOOPBACK}:{port}"
    dashboard_url = _dashboard_url(dashboard_port)
    temp_root = Path(temp_dir) if temp_dir else _default_temp_root()
    info: dict[str, Any] = {
        "address": address,
        "dashboard_url": dashboard_url,
        "auth_mode": "token" if auth_enabled() else "disabled",
        "temp_dir": str(temp_root),
        "started": False,
    }

    gcs_up = _port_open(port)
    status, _ = _http_get(f"{dashboard_url}/api/version")
    if gcs_up and status == 200:
        other = head_installation(port)
        if other is not None and other != _ray_package_dir():
            raise PrivcodeError(
                f"the Ray head on port {port} runs another installation's Ray ({other}): its "
                "workers would run that checkout's privcode, not this one's. Stop it there "
                "(make ray-down in that checkout) or pick other ports (RAY_PORT=6390 "
                "DASHBOARD_PORT=8275)"
            )
        log.info("Ray head already running at %s (dashboard %s)", address, dashboard_url)
        mode = _http_get(f"{dashboard_url}/api/authentication_mode", auth=False)[1]
        if isinstance(mode, dict):  # report the running head's mode, not ours
            info["auth_mode"] = mode.get("authentication_mode", info["auth_mode"])
        return info
    if status == 200:
        raise PrivcodeError(
            f"a Ray dashboard answers at {dashboard_url} but nothing listens on "
            f"GCS port {port}: that head uses another --port"
        )
    if status in (401, 403):
        raise PrivcodeError(
            f"a Ray dashboard on port {dashboard_port} rejects our auth token (HTTP {status}); "
            f"point {TOKEN_ENV} or {TOKEN_PATH_ENV} at that cluster's token, or stop it"
        )
    if gcs_up or status or _port_open(dashboard_port):
        raise PrivcodeError(
            f"port {port if gcs_up else dashboard_port} on {LOOPBACK} is in use but no Ray head "
            f"answers at {dashboard_url}; stop that process or pick other ports"
        )

    if auth_enabled():
        ensure_token()
    temp_root.mkdir(parents=True, exist_ok=True)
    log_file = temp_root / f"privcode-ray-start-{port}.log"
    cmd = [
        ray_binary(),
        "start",
        "--head",
        f"--node-ip-address={LOOPBACK}",
        f"--dashboard-host={LOOPBACK}",
        f"--port={port}",
        f"--dashboard-port={dashboard_port}",
        "--disable-usage-stats",
        f"--temp-dir={temp_root}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    joined = " ".join(extra_args)
    if "--ray-client-server-port" not in joined and _port_open(_CLIENT_SERVER_PORT):
        cmd.append(f"--ray-client-server-port={free_port()}")
    if "--dashboard-agent-listen-port" not in joined and _port_open(_AGENT_LISTEN_PORT):
        cmd.append(f"--dashboard-agent-listen-port={free_port()}")
    cmd.extend(extra_args)

    log.info("starting Ray head: %s", " ".join(cmd))
    with open(log_file, "w") as out:
        # New session: the daemons get their own process group, away from the
        # caller's terminal signals (Ctrl-C in a shell must not kill the head).
        proc = subprocess.run(
            cmd,
            env=head_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            timeout=max(wait_s, 30) + 60,
            check=False,
        )
    if proc.returncode != 0:
        raise PrivcodeError(
            f"`ray start --head --port {port}` failed (exit {proc.returncode}); "
            f"see {log_file}:\n{_tail(log_file)}"
        )

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (
            _port_open(port)
            and _http_get(f"{dashboard_url}/api/version")[0] == 200
            and _http_get(f"{dashboard_url}/api/jobs/")[0] == 200
        ):
            info.update(started=True, log_file=str(log_file))
            log.info("Ray head at %s; dashboard %s", address, dashboard_url)
            return info
        time.sleep(0.5)
    raise PrivcodeError(
        f"Ray head on port {port} did not answer within {wait_s:.0f}s (dashboard {dashboard_url}); "
        f"see {log_file} and {temp_root}/session_latest/logs/dashboard.log"
    )


def _ray_package_dir() -> str:
    """The ``ray`` package directory of this interpreter (found without importing ray)."""
    spec = importlib.util.find_spec("ray")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return str(Path(locations[0]).resolve()) if locations else ""


def installation_of(gcs_executable: str) -> str | None:
    """The ``ray`` package directory a GCS server binary belongs to
    (``<site-packages>/ray/core/src/ray/gcs/gcs_server`` -> ``<site-packages>/ray``)."""
    path = Path(gcs_executable).resolve()
    for parent in path.parents:
        if (
            parent.name == "ray"
            and (parent / "core").is_dir()
            and path.is_relative_to(parent / "core")
        ):
            return str(parent)
    return None


def head_installation(port: int) -> str | None:
    """The ``ray`` package directory of the local head whose GCS listens on ``port``
    (None when no such process is found here, e.g. a head in a container)."""
    import psutil

    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            args = p.cmdline()
            if args and f"--gcs_server_port={port}" in args:
                return installation_of(args[0])
    return None


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _find_head(port: int) -> tuple[list, list, set[str]]:
    """(roots, descendants, session dirs) of the head whose GCS listens on ``port``.

    Roots: the GCS (found by its ``--gcs_server_port``), every process whose
    command line names that GCS's session directory (raylet, dashboard,
    monitors) and the Ray client server pointing at the port.  Descendants:
    workers, agents, dashboard modules, Jobs drivers.  The caller and its
    ancestors are never included.
    """
    import psutil

    def cmdline(p: psutil.Process) -> list[str]:
        with contextlib.suppress(psutil.Error):
            return p.cmdline()
        return []

    procs = list(psutil.process_iter())
    session_dirs = set()
    for p in procs:
        args = cmdline(p)
        if f"--gcs_server_port={port}" in args:
            session_dirs.update(a.split("=", 1)[1] for a in args if a.startswith("--session-dir="))
    if not session_dirs:
        return [], [], set()
    me = psutil.Process()
    protected = {me.pid, *(a.pid for a in me.parents())}
    roots: dict[int, psutil.Process] = {}
    for p in procs:
        text = " ".join(cmdline(p)) + " "
        if p.pid not in protected and (
            f"--gcs_server_port={port} " in text
            or any(d in text for d in session_dirs)
            or ("ray.util.client.server" in text and f":{port} " in text)
        ):
            roots[p.pid] = p
    children: dict[int, psutil.Process] = {}
    for p in roots.values():
        with contextlib.suppress(psutil.Error):
            children.update({c.pid: c for c in p.children(recursive=True)})
    return (
        list(roots.values()),
        [c for pid, c in children.items() if pid not in roots and pid not in protected],
        session_dirs,
    )


def head_processes(port: int) -> list:
    """All live processes (psutil) of the local head whose GCS listens on ``port``."""
    roots, children, _ = _find_head(port)
    return [p for p in roots + children if p.is_running()]


def stop_head(
    port: int = DEFAULT_PORT, *, all_local: bool = False, grace_s: float = 15.0
) -> dict[str, Any]:
    """Stop the local head whose GCS listens on ``port``; idempotent.

    Only that head's processes (see :func:`_find_head`) are signalled, so
    other Ray clusters on the machine (another developer's, the test
    suite's) are left alone.  Like ``ray stop``, the daemons get SIGTERM and
    SIGKILL after ``grace_s``; their children (workers, agents, drivers) exit
    with them and are SIGKILLed if still there a few seconds later.
    ``all_local=True`` runs ``ray stop`` instead: every Ray process of this user.
    Returns ``{"stopped": <number of processes>, "port": port}``.
    """
    if all_local:
        proc = subprocess.run([ray_binary(), "stop"], capture_output=True, text=True, check=False)
        return {"stopped": "all", "port": None, "output": proc.stdout.strip()[-2000:]}
    import psutil

    roots, children, session_dirs = _find_head(port)

    def rank(p: psutil.Process) -> int:
        with contextlib.suppress(psutil.Error):
            name = p.name()
            return 0 if name == "raylet" else 2 if name == "gcs_server" else 1
        return 1

    # Ray's own `ray stop` order: raylet first (its agents fate-share with it),
    # GCS last (the others block on a vanished GCS while shutting down).
    ranks = {p.pid: rank(p) for p in roots}
    alive: list = []
    for step in range(3):
        group = [p for p in roots if ranks[p.pid] == step]
        for p in group:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        alive += psutil.wait_procs(group, timeout=grace_s / 3)[1]
    _, orphans = psutil.wait_procs(children, timeout=5)
    for p in alive + orphans:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive + orphans, timeout=5)
    for session_dir in session_dirs:
        # `ray stop` also forgets the "current cluster" that ray.init("auto") reads.
        address_file = Path(session_dir).parent / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if address_file.read_text().strip().endswith(f":{port}"):
                address_file.unlink()
    return {"stopped": len(roots) + len(children), "port": port}


def head_status(
    dashboard_url: str = _dashboard_url(DEFAULT_DASHBOARD_PORT), timeout_s: float = 3.0
) -> dict[str, Any]:
    """What the dashboard at ``dashboard_url`` says: up, auth mode, version, nodes, jobs.

    ``up`` is True only when the authenticated ``/api/version`` answers 200;
    ``error`` explains otherwise (no answer, 401 missing token, 403 wrong token).
    """
    dashboard_url = dashboard_url.rstrip("/")
    out: dict[str, Any] = {"dashboard_url": dashboard_url, "up": False}
    status, mode = _http_get(f"{dashboard_url}/api/authentication_mode", timeout_s, auth=False)
    if status == 0:
        out["error"] = f"no answer from {dashboard_url}"
        return out
    if isinstance(mode, dict):
        out["auth_mode"] = mode.get("authentication_mode")
    status, version = _http_get(f"{dashboard_url}/api/version", timeout_s)
    if status != 200:
        out["error"] = f"/api/version answered HTTP {status}: {str(version)[:200]}"
        return out
    out.update(
        up=True, ray_version=version.get("ray_version"), session_name=version.get("session_name")
    )
    status, nodes = _http_get(f"{dashboard_url}/api/v0/nodes?limit=100", timeout_s)
    if status == 200:
        rows = nodes.get("data", {}).get("result", {}).get("result", [])
        alive = [n for n in rows if n.get("state") == "ALIVE"]
        out["nodes"] = len(alive)
        out["cpus"] = sum(n.get("resources_total", {}).get("CPU", 0) for n in alive)
    status, jobs = _http_get(f"{dashboard_url}/api/jobs/", timeout_s)
    if status == 200 and isinstance(jobs, list):
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.get("status", "?")] = counts.get(job.get("status", "?"), 0) + 1
        out["jobs"] = counts
    return out


# --------------------------------------------------------------------------- driver


def connect(address: str | None = None, **init_kwargs: Any) -> dict[str, Any]:
    """Initialize Ray in this process: the one place privcode calls ``ray.init``.

    * ``address`` None or "": ``RAY_ADDRESS`` if set, else a new in-process
      cluster on 127.0.0.1, also while a local head runs (join that with
      ``"auto"``) (no dashboard unless ``include_dashboard=True``;
      ``num_cpus`` defaults to max(2, CPU count) so two-worker stages can be
      scheduled on a small machine).
    * ``"auto"``: join the running local head.
    * ``host:port`` (GCS) or ``ray://host:port`` (Ray Client): join it.
      A dashboard URL (``http://...``) is refused: use privcode.cluster.jobs.

    Joining sets up token auth and loopback addressing (see
    :func:`prepare_driver_env`).  Idempotent: if Ray is already initialized
    the current connection is reported with ``started: False``.
    Returns ``{"address", "dashboard_url", "started"}``.
    """
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target and target.startswith(("http://", "https://")):
        raise PrivcodeError(
            f"connect() needs a GCS address (host:port), 'auto' or ray://; "
            f"{target!r} is a dashboard URL (use privcode submit for those)"
        )
    import ray

    if ray.is_initialized():
        return {**_describe(None), "started": False}
    if target is None:
        if auth_enabled():
            # Ray would write ~/.ray/auth_token itself, but not to RAY_AUTH_TOKEN_PATH.
            ensure_token()
        prepare_driver_env(loopback=True)
        kwargs: dict[str, Any] = {
            # "local": a new cluster even when a local head is up (ray.init would join it
            # and then refuse num_cpus: `privcode report` beside `make demo`'s head failed).
            "address": "local",
            "num_cpus": max(2, os.cpu_count() or 1),
            "include_dashboard": False,
            "_node_ip_address": LOOPBACK,
        }
        kwargs.update(init_kwargs)
        if kwargs.get("include_dashboard"):
            kwargs.setdefault("dashboard_host", LOOPBACK)
        ctx = ray.init(**kwargs)
        return {**_describe(ctx), "started": True}
    prepare_driver_env(loopback=_address_is_loopback(target))
    ctx = ray.init(address=target, **init_kwargs)
    return {**_describe(ctx), "started": False}


def _describe(ctx: Any) -> dict[str, Any]:
    """Address and dashboard URL of the current connection (a RayContext or None)."""
    import ray

    address = None
    with contextlib.suppress(Exception):
        address = ray.get_runtime_context().gcs_address
    url = getattr(ctx, "dashboard_url", None)
    if url is None and ctx is None:
        with contextlib.suppress(Exception):
            from ray._private.worker import get_dashboard_url

            url = get_dashboard_url()
    if url and "://" not in url:
        url = f"http://{url}"
    return {"address": address, "dashboard_url": url or None}
