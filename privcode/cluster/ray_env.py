"""Ray token authentication and the environment of privcode's Ray processes.
Design notes: docs/kubernetes.md, "privcode/cluster/ray_env.py".

Ray 2.60 (read from its source, checked live): ``RAY_AUTH_MODE`` (``token`` or ``disabled``)
is cached when ``ray`` is imported; the token comes from ``RAY_AUTH_TOKEN``, the file named by
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``. ``ray start --head`` turns token mode on
only if the mode is unset and a token exists, so :func:`~privcode.cluster.local.start_head`
creates the token first and sets ``RAY_AUTH_MODE=token``; a driver joining an explicit address
needs it too (:func:`prepare_driver_env`). HTTP wants ``Authorization: Bearer <token>``, which
privcode sends only to the cluster the token belongs to (:func:`auth_headers`,
:func:`token_bound_to`). ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps a local head and its
drivers on 127.0.0.1. Privcode's default is token mode; ``RAY_AUTH_MODE=disabled`` in the
environment is respected.

"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import sys
import time
from pathlib import Path

from privcode.errors import PrivcodeError

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for "multi-node clusters off": node IP stays 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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


#: Environment variables that name the cluster a token from the environment belongs to.
ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def _host_of(address: str) -> str:
    """The host part of ``scheme://host:port/...``, ``host:port``, ``[v6]:port`` or ``host``."""
    netloc = address.strip().split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    if netloc.startswith("["):
        return netloc[1:].split("]", 1)[0].lower()
    return (netloc.split(":", 1)[0] if netloc.count(":") == 1 else netloc).lower()


def token_hosts() -> tuple[str, ...]:
    """The non-loopback hosts the token belongs to: those of ``RAY_ADDRESS`` /
    ``RAY_API_SERVER_ADDRESS`` (the cluster the environment set the token up for)."""
    hosts = (_host_of(os.environ.get(name, "")) for name in ADDRESS_ENVS)
    return tuple(h for h in hosts if h and h != "auto")


def token_bound_to(url: str) -> bool:
    """Whether the token may be sent to ``url``.

    Yes for loopback hosts (the local head, which :func:`~privcode.cluster.local.start_head`
    always binds to 127.0.0.1, or a port-forwarded head) and for the hosts of
    :func:`token_hosts`; an address given any other way (``--address``, a config, a
    dashboard URL read back from a GCS) never widens that set.
    """
    host = _host_of(url)
    return _is_loopback_host(host) or host in token_hosts()


def auth_headers(url: str) -> dict[str, str]:
    """HTTP headers for a request to the dashboard / Jobs API at ``url``.

    A bearer token when auth is on, a token exists and :func:`token_bound_to` ``url``;
    else ``{}``: the token never goes to a host it does not belong to.
    """
    if not auth_enabled() or not token_bound_to(url):
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


def address_is_loopback(address: str) -> bool:
    """True for "auto" and for host:port / scheme://host:port addresses on this machine."""
    return address == "auto" or _is_loopback_host(_host_of(address))


# --------------------------------------------------------------------------- process environment


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
