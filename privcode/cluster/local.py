"""A local Ray head on 127.0.0.1 and the one ``ray.init``.

:func:`start_head` / :func:`stop_head` / :func:`head_status` manage a head bound
to 127.0.0.1 with token authentication; :func:`connect` is the one place privcode
calls ``ray.init``. What Ray 2.60 does about token auth and loopback binding, and
the environment every privcode process gets, is :mod:`privcode.cluster.ray_env`.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import logging
import os
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

from privcode.cluster.ray_env import (
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    address_is_loopback,
    auth_enabled,
    auth_headers,
    ensure_token,
    head_env,
    prepare_driver_env,
)
from privcode.errors import PrivcodeError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265
# Fixed default ports of two head services; taken ones are replaced by free ones
# so a second head (e.g. the test suite's) does not collide with a developer's.
_CLIENT_SERVER_PORT = 10001
_AGENT_LISTEN_PORT = 52365


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
    req = urllib.request.Request(url, headers=auth_headers(url) if auth else {})
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

    Idempotent: a head already answering on both ports (the dashboard accepting our token) gives
    ``started: False``. Otherwise runs ``ray start --head`` from this interpreter's environment with
    :func:`head_env`, then waits until the GCS port and the dashboard's authenticated
    ``/api/version`` and ``/api/jobs/`` answer. ``temp_dir`` is Ray's temp root (keep it short:
    Unix socket paths inside it are limited to ~107 bytes); ``extra_args`` go to ``ray start`` as
    is. Returns ``address`` (GCS, host:port), ``dashboard_url``, ``started``, ``auth_mode``,
    ``log_file`` (``ray start`` output) and ``temp_dir``; raises :class:`PrivcodeError` naming the
    port and log file on failure.
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
    proc = _ray_start(cmd, log_file, wait_s)
    if proc.returncode != 0 and _RAYLET_TIMEOUT in log_file.read_text(errors="replace"):
        # `ray start` gives the raylet a fixed 30 s to register with the GCS; a
        # busy machine can miss it. Clear what it left and try once more.
        log.warning("the raylet of port %d missed Ray's 30 s start-up window; retrying", port)
        stop_head(port)
        proc = _ray_start(cmd, log_file, wait_s)
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


_RAYLET_TIMEOUT = "The current node timed out during startup"


def _ray_start(cmd: list[str], log_file: Path, wait_s: float) -> subprocess.CompletedProcess:
    """Run ``ray start`` with its output in ``log_file``."""
    with open(log_file, "w") as out:
        # New session: the daemons get their own process group, away from the
        # caller's terminal signals (Ctrl-C in a shell must not kill the head).
        return subprocess.run(
            cmd,
            env=head_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            timeout=max(wait_s, 30) + 60,
            check=False,
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

    ``address`` None or "": ``RAY_ADDRESS`` if set, else a new in-process cluster on 127.0.0.1,
    also while a local head runs (join that with ``"auto"``); no dashboard unless
    ``include_dashboard=True``, ``num_cpus`` max(2, CPU count) by default so two-worker stages can
    be scheduled on a small machine. ``"auto"``: join the running local head. ``host:port`` (GCS)
    or ``ray://host:port`` (Ray Client): join it; a dashboard URL (``http://...``) is refused (use
    privcode.cluster.jobs). Joining sets up token auth and loopback addressing
    (:func:`prepare_driver_env`). Idempotent: if Ray is already initialized the current connection
    is reported with ``started: False``. Returns ``{"address", "dashboard_url", "started"}``.
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
    prepare_driver_env(loopback=address_is_loopback(target))
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
