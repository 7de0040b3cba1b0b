"""Submit privcode work to a Ray cluster through the Ray Jobs API.
Design notes: docs/kubernetes.md, "privcode/cluster/jobs.py".

Addresses (``address``, else ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``, else the local
head): ``http(s)://...`` a dashboard, as is; ``host:port`` a dashboard if it answers HTTP, else
a GCS whose dashboard URL the GCS keeps; ``auto`` the local head's GCS; ``ray://host:port``
that host at port 8265; nothing: ``http://127.0.0.1:8265``, started by
:func:`privcode.cluster.local.start_head` when no head answers there.

Auth: only the cluster the token belongs to gets ``Authorization: Bearer <token>``
(:func:`privcode.cluster.ray_env.auth_headers`); any other address gets no token. The pipeline
job uploads the repository root minus virtualenvs, VCS data, run outputs, caches and, in a git
checkout, every untracked file (:mod:`privcode.cluster.git_files`), and runs
``python jobs/pipeline.py --config <config> [--set k=v ...]``.

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import sys
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from privcode.cluster import git_files, local, ray_env
from privcode.errors import PrivcodeError

log = logging.getLogger(__name__)

DEFAULT_DASHBOARD = f"http://{local.LOOPBACK}:{local.DEFAULT_DASHBOARD_PORT}"
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
#: How long a submission waits for the head's job agent to come up.
AGENT_WAIT_S = 90.0
# Kept out of the working_dir upload (gitignore syntax, relative to the root):
# the upload limit is 100 MiB and none of these are needed by a job.
WORKING_DIR_EXCLUDES = (
    ".venv/",
    ".git/",
    "/runs/",
    "/reports/",
    "/.cache/",
    "/.tools/",
    "/artifacts/",
    "__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".ruff_cache/",
    ".hypothesis/",
    "*.egg-info/",
    "/build/",
    "/dist/",
)


class JobTimeoutError(PrivcodeError):
    """A job did not reach a terminal state in time; ``status`` is its last state."""

    def __init__(self, message: str, job_id: str, status: str):
        super().__init__(message)
        self.job_id, self.status = job_id, status


# --------------------------------------------------------------------------- addresses


def resolve_dashboard_address(address: str | None = None, start_local: bool = True) -> str:
    """The Jobs API URL for ``address`` (see the module docstring for the forms).

    With no address and no environment variable, returns the local default
    dashboard, starting a local head first when ``start_local`` and none answers.
    """
    explicit = (
        address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or None
    )
    if explicit is None:
        if start_local and local.head_status(DEFAULT_DASHBOARD).get("up") is not True:
            print(f"no Ray head answers at {DEFAULT_DASHBOARD}; starting one", file=sys.stderr)
            local.start_head()
        return DEFAULT_DASHBOARD
    explicit = explicit.strip().rstrip("/")
    if explicit.startswith(("http://", "https://")):
        return explicit
    if explicit.startswith("ray://"):
        host = explicit[len("ray://") :].split("/", 1)[0].rsplit(":", 1)[0]
        return f"http://{host}:{local.DEFAULT_DASHBOARD_PORT}"
    if explicit != "auto":
        status, _ = local._http_get(
            f"http://{explicit}/api/authentication_mode", timeout=2.0, auth=False
        )
        if status:
            return f"http://{explicit}"
    return _dashboard_from_gcs(explicit)


TARGETS = ("local", "ray", "k8s")


def target_address(target: str, address: str | None = None) -> str:
    """The Jobs API URL for a ``make submit-job`` target.

    ``local``: the local head at :data:`DEFAULT_DASHBOARD` (started if none
    answers), whatever ``RAY_ADDRESS`` says; ``ray``: ``address``, else
    ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS``, which must be set.
    (``k8s`` goes through :mod:`privcode.cluster.k8s`, not the Jobs API.)
    """
    if target == "local":
        if address:
            url = resolve_dashboard_address(address, start_local=False)
            if not _is_loopback(url):
                raise PrivcodeError(
                    f"TARGET=local submits to the local head, not to {address}; "
                    "use TARGET=ray for another cluster"
                )
            return url
        if local.head_status(DEFAULT_DASHBOARD).get("up") is not True:
            print(f"no Ray head answers at {DEFAULT_DASHBOARD}; starting one", file=sys.stderr)
            local.start_head()
        return DEFAULT_DASHBOARD
    if target == "ray":
        explicit = (
            address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
        )
        if not explicit:
            raise PrivcodeError(
                "TARGET=ray needs the cluster's address: set RAY_ADDRESS "
                "(e.g. http://127.0.0.1:8265 for a port-forwarded KubeRay head)"
            )
        return resolve_dashboard_address(explicit, start_local=False)
    raise PrivcodeError(f"unknown submit target {target!r}: expected one of {', '.join(TARGETS)}")


def _dashboard_from_gcs(gcs_address: str) -> str:
    """Ask the GCS at ``gcs_address`` ("auto" allowed) for its dashboard URL."""
    ray_env.prepare_driver_env(loopback=ray_env.address_is_loopback(gcs_address))
    from ray.dashboard.utils import ray_address_to_api_server_url

    try:
        return ray_address_to_api_server_url(gcs_address).rstrip("/")
    except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError...
        raise PrivcodeError(
            f"could not find the dashboard of the Ray cluster at {gcs_address!r} "
            f"(neither a dashboard nor a reachable GCS): {exc}"
        ) from exc


@contextlib.contextmanager
def _without_address_env() -> Iterator[None]:
    """Hide RAY_ADDRESS / RAY_API_SERVER_ADDRESS while building a client.

    ``JobSubmissionClient`` lets those variables override its ``address``
    argument; the address has already been resolved here and must win.
    """
    saved = {
        k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


def client(address: str | None = None, start_local: bool = False):
    """A ``JobSubmissionClient`` for ``address`` that sends the token only where it belongs.

    The token goes to the local head or the cluster ``RAY_ADDRESS`` names
    (:func:`~privcode.cluster.ray_env.token_bound_to`); any other URL gets none (an empty
    ``Authorization`` header, which also stops Ray's client from adding its own), and a
    401 from it is a :class:`PrivcodeError` that says how to bind the token there.
    """
    from ray.job_submission import JobSubmissionClient

    url = resolve_dashboard_address(address, start_local=start_local)
    headers = ray_env.auth_headers(url) or {"Authorization": ""}
    with _without_address_env():
        try:
            return JobSubmissionClient(url, headers=headers)
        except Exception as exc:  # ConnectionError, AuthenticationError, ...
            if not ray_env.token_bound_to(url) and _is_auth_refusal(exc):
                raise PrivcodeError(
                    f"the Ray cluster at {url} wants a token, and privcode sends the Ray "
                    "token only to the cluster it belongs to (the local head on 127.0.0.1, "
                    "or the one RAY_ADDRESS / RAY_API_SERVER_ADDRESS names); set "
                    f"RAY_ADDRESS={url} and that cluster's token (RAY_AUTH_TOKEN or "
                    "RAY_AUTH_TOKEN_PATH) to submit there"
                ) from None
            raise PrivcodeError(f"cannot reach the Ray Jobs API at {url}: {exc}") from exc


def _is_auth_refusal(exc: Exception) -> bool:
    """Whether ``exc`` is Ray's client reporting an HTTP 401/403 (a missing or wrong token)."""
    from ray.exceptions import AuthenticationError

    return isinstance(exc, AuthenticationError) or any(
        f"status code {code}" in str(exc) for code in (401, 403)
    )


# --------------------------------------------------------------------------- jobs


def submit_job(
    entrypoint: str,
    address: str | None = None,
    runtime_env: dict[str, Any] | None = None,
    *,
    submission_id: str | None = None,
    metadata: dict[str, str] | None = None,
    entrypoint_num_cpus: float | None = None,
    start_local: bool = False,
) -> str:
    """Submit ``entrypoint`` (a shell command) as a Ray job; returns the job id.

    ``address`` as in :func:`resolve_dashboard_address`; ``runtime_env`` is
    passed to Ray unchanged (working_dir, env_vars, pip...).
    """
    jobs_client = client(address, start_local=start_local)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return jobs_client.submit_job(
                entrypoint=entrypoint,
                runtime_env=runtime_env,
                submission_id=submission_id,
                metadata=metadata,
                entrypoint_num_cpus=entrypoint_num_cpus,
            )
        except RuntimeError as exc:
            # A head that just started (or is busy) may not have its job agent yet; the
            # request created nothing, so asking again is safe.
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def job_status(job_id: str, address: str | None = None) -> str:
    return str(client(address).get_job_status(job_id).value)


def job_logs(job_id: str, address: str | None = None) -> str:
    """Everything the job's driver wrote to stdout/stderr so far."""
    return client(address).get_job_logs(job_id)


def wait_for_job(
    job_id: str,
    address: str | None = None,
    timeout_s: float = 3600.0,
    follow: bool = False,
    out: TextIO | None = None,
    poll_s: float = 1.0,
) -> str:
    """Wait until the job is SUCCEEDED, FAILED or STOPPED; return that status.

    With ``follow`` the job's output is streamed to ``out`` (default stderr)
    as it arrives, through the Jobs API log websocket, or by polling the
    logs when the websocket is not usable (e.g. called inside an event loop).
    Raises :class:`JobTimeoutError` after ``timeout_s``.
    """
    jobs_client = client(address)
    deadline = time.monotonic() + timeout_s
    if follow:
        stream = out or sys.stderr
        if not _tail_websocket(jobs_client, job_id, stream, timeout_s):
            return _poll(jobs_client, job_id, deadline, poll_s, stream)
    return _poll(jobs_client, job_id, deadline, poll_s, None)


def _tail_websocket(jobs_client, job_id: str, out: TextIO, timeout_s: float) -> bool:
    """Stream logs until the server closes the stream; False if streaming is unavailable."""

    async def tail() -> None:
        async for chunk in jobs_client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.get_running_loop()
        return False  # asyncio.run cannot nest; the caller polls instead
    except RuntimeError:
        pass
    try:
        asyncio.run(asyncio.wait_for(tail(), timeout=timeout_s))
    except TimeoutError:
        return True  # _poll reports the timeout with the current status
    except Exception as exc:  # websocket refused or dropped: fall back to polling
        log.info("log streaming for %s stopped (%s); polling instead", job_id, exc)
        return False
    return True


def _poll(jobs_client, job_id: str, deadline: float, poll_s: float, out: TextIO | None) -> str:
    """Poll status (and print new log text to ``out``) until terminal or ``deadline``."""
    printed = 0
    while True:
        status = str(jobs_client.get_job_status(job_id).value)
        if out is not None:
            text = jobs_client.get_job_logs(job_id)
            if len(text) > printed:
                out.write(text[printed:])
                out.flush()
                printed = len(text)
        if status in TERMINAL:
            return status
        if time.monotonic() >= deadline:
            raise JobTimeoutError(f"job {job_id} still {status} at the deadline", job_id, status)
        time.sleep(poll_s)


# --------------------------------------------------------------------------- pipeline


def repo_root() -> Path:
    """The directory holding ``jobs/``: the source checkout of this package, else the cwd."""
    for candidate in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (candidate / "jobs").is_dir():
            return candidate
    raise PrivcodeError(
        "cannot find the privcode repository root (a directory with jobs/); "
        "run from the repository checkout"
    )


def pipeline_runtime_env(runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline job's runtime_env: the repo root as working_dir, merged with ``runtime_env``.

    Keys in ``runtime_env`` win, except ``excludes``, which is appended to
    :data:`WORKING_DIR_EXCLUDES`.  Where the working dir is a git checkout, every
    untracked path in it (ignored or not) is excluded too, so the upload holds
    git's tracked files only (:mod:`privcode.cluster.git_files`).
    """
    env: dict[str, Any] = {"working_dir": str(repo_root()), "excludes": list(WORKING_DIR_EXCLUDES)}
    for key, value in (runtime_env or {}).items():
        env[key] = env["excludes"] + list(value) if key == "excludes" else value
    untracked = git_files.untracked_excludes(env["working_dir"])
    if untracked is not None:
        env["excludes"] = env["excludes"] + untracked
    return env


def pipeline_entrypoint(
    config: str, overrides: Sequence[str] = (), stages: Sequence[str] = ()
) -> str:
    """``python jobs/pipeline.py --config <config> [--set k=v ...] [--stages ...]``, quoted."""
    parts = ["python", "jobs/pipeline.py", "--config", config]
    for item in overrides:
        parts += ["--set", item]
    if stages:
        parts += ["--stages", *stages]
    return shlex.join(parts)


def _config_in_working_dir(config: str | os.PathLike, working_dir: Path) -> str:
    """``config`` as a path relative to the uploaded working dir (where the job runs).

    A relative ``config`` is looked up in the working dir, then in the cwd;
    either way it must lie inside the working dir, and be tracked by git where the
    working dir is a checkout, or the job would not see it.
    """
    path = Path(config)
    candidates = [path] if path.is_absolute() else [working_dir / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            with contextlib.suppress(ValueError):
                rel = candidate.resolve().relative_to(working_dir.resolve()).as_posix()
                if git_files.is_checkout(working_dir) and not git_files.is_tracked(
                    working_dir, rel
                ):
                    raise PrivcodeError(
                        f"config {rel!r} is not tracked by git, and the job's working dir "
                        "uploads tracked files only: git add it (or name a tracked config)"
                    )
                return rel
    raise PrivcodeError(
        f"config {str(config)!r} is not a file inside {working_dir}, the job's working directory"
    )


#: Config paths that must outlive the job's throw-away working-dir copy. A stage that
#: reads one fingerprints it resolved or not at all (``privcode.pipeline.runner.
#: LOCATION_FIELDS``), so the rewrite does not make the job re-run what ``privcode run`` built.
_PERSISTENT_PATHS = ("run.out_dir", "run.reports_dir", "base.cache_dir", "privacy.store")


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", local.LOOPBACK) or host.startswith("127.")


def _absolute_path_overrides(cfg: Any) -> list[str]:
    """On a local head, relative artifact paths resolve against the submitter's cwd.

    A job runs in an uploaded copy of the working dir that Ray deletes later;
    without this, ``runs/`` and ``reports/`` would vanish with it (and a relative
    ``privacy.store``, the budget spent so far, with them). On remote
    clusters the config must name shared storage (a PVC mount) itself.
    """
    extra = []
    for dotted in _PERSISTENT_PATHS:
        section, key = dotted.split(".")
        value = getattr(cfg.section(section), key)
        if value and not os.path.isabs(value):
            extra.append(f"{dotted}={os.path.abspath(value)}")
    return extra


def job_overrides(cfg: Any, overrides: Sequence[str], dashboard: str) -> list[str]:
    """The ``--set`` overrides the submitted job runs with: ``overrides``, and on a local
    head (``dashboard`` on loopback) the relative :data:`_PERSISTENT_PATHS` of ``cfg`` made
    absolute against the cwd (:func:`_absolute_path_overrides`)."""
    if _is_loopback(dashboard):
        return [*overrides, *_absolute_path_overrides(cfg)]
    return list(overrides)


def submit_pipeline(
    config: str = "jobs/configs/demo.yaml",
    address: str | None = None,
    overrides: Sequence[str] = (),
    follow: bool = True,
    timeout_s: float = 3600.0,
    runtime_env: dict[str, Any] | None = None,
    stages: Sequence[str] = (),
) -> dict[str, Any]:
    """Submit ``jobs/pipeline.py`` as a Ray job; follow it when ``follow``.

    The job id and dashboard URL are printed to stderr at once (stdout stays
    free for JSON); with ``follow`` the job's output goes to stderr too.
    Returns ``{job_id, status, dashboard_url, job_url, address}``; ``status``
    is the final one when followed (``timed_out: True`` is added if
    ``timeout_s`` passed first), else the status right after submission.
    """
    from privcode.config import load_config

    env = pipeline_runtime_env(runtime_env)
    working_dir = Path(env["working_dir"])
    rel_config = _config_in_working_dir(config, working_dir)
    # Validate before submitting: a bad config fails here, not minutes later.
    cfg = load_config(working_dir / rel_config, overrides)
    dashboard = resolve_dashboard_address(address, start_local=True)
    overrides = job_overrides(cfg, overrides, dashboard)
    entrypoint = pipeline_entrypoint(rel_config, overrides, stages)
    job_id = submit_job(entrypoint, dashboard, env, metadata={"privcode": "pipeline"})
    job_url = f"{dashboard}/#/jobs/{job_id}"
    print(
        f"submitted job {job_id}: {entrypoint}\ndashboard: {job_url}", file=sys.stderr, flush=True
    )
    result: dict[str, Any] = {
        "job_id": job_id,
        "dashboard_url": dashboard,
        "job_url": job_url,
        "address": dashboard,
    }
    if not follow:
        result["status"] = job_status(job_id, dashboard)
        return result
    try:
        result["status"] = wait_for_job(job_id, dashboard, timeout_s=timeout_s, follow=True)
    except JobTimeoutError as exc:
        result.update(status=exc.status, timed_out=True)
    print(f"job {job_id}: {result['status']}", file=sys.stderr, flush=True)
    return result
