"""``privcode serve``: the premium model and the PAC ensemble on Ray Serve until Ctrl-C.

Routes, keys and client limits come from the config's ``serve`` section, the PAC mechanism
from its ``pac`` section (docs/serving.md). Without an API key the command stops before
anything starts; ``--insecure-no-auth`` serves without one, on 127.0.0.1 only, and is refused
on a cluster whose Serve proxy already listens elsewhere (Ray keeps a running proxy's host
and ignores a new one). A key handed to the replicas lives in a private directory that goes
on every way out: return, exception, SIGINT, SIGTERM, SIGHUP, and ``atexit`` behind them.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from privcode.config import PipelineConfig, load_config
from privcode.errors import PrivcodeError, import_extra
from privcode.layout import RunLayout
from privcode.privacy.store import resolve_store
from privcode.serve.guard import KEY_ENV, KEYS_DIR_ENV

__all__ = ["LOOPBACK", "add_serve_parser", "cmd_serve"]


#: Hosts ``privcode serve --insecure-no-auth`` may bind: loopback only.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def cmd_serve(args: argparse.Namespace) -> int:
    import_extra("fastapi", "serve", "privcode serve")  # ray[serve] brings it too
    from privcode.serve.args import guard_args

    if args.pac_only and not args.pac:
        raise PrivcodeError("serve: --pac-only needs --pac WORLDS_DIR")
    if args.insecure_no_auth and args.host not in LOOPBACK:
        raise PrivcodeError(
            f"serve: --insecure-no-auth serves without API keys, so only on 127.0.0.1 "
            f"(not --host {args.host}); set PRIVCODE_API_KEY (or serve.api_keys_dir) instead"
        )
    cfg = load_config(args.config, args.overrides)
    guard = guard_args(cfg.serve, insecure_no_auth=args.insecure_no_auth)
    with replica_keys_dir(guard) as keys_dir:
        if keys_dir is not None:
            guard["api_keys_dir"] = keys_dir
        return _serve_apps(args, cfg, guard)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


#: How ``privcode serve`` ends on each signal: by unwinding, so the replicas' key directory
#: is removed: SIGHUP and SIGTERM exit with 128 + the signal, SIGINT is Ctrl-C (even where
#: the process was started with it ignored), which also deletes the apps.
EXIT_HANDLERS = {
    signal.SIGHUP: _exit_on_signal,
    signal.SIGTERM: _exit_on_signal,
    signal.SIGINT: signal.default_int_handler,
}


@contextlib.contextmanager
def replica_keys_dir(guard: dict) -> Iterator[str | None]:
    """:func:`_keys_dir_for_replicas` for the block; removed on every way out.

    SIGHUP and SIGTERM (whose default would kill the process where it stands) and SIGINT
    unwind instead (:data:`EXIT_HANDLERS`), ``atexit`` removes the directory should the
    unwinding be cut short, and the previous handlers come back afterwards.
    """
    folder = _keys_dir_for_replicas(guard)
    if folder is None:
        yield None
        return

    def remove() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal's rule
        previous = {sig: signal.signal(sig, handler) for sig, handler in EXIT_HANDLERS.items()}
    try:
        yield folder
    finally:
        remove()
        atexit.unregister(remove)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def running_proxy_host() -> str | None:
    """The host the cluster's running Serve proxies listen on; None when Serve is not running.

    Read from the Serve controller's client (Ray has no public call for it). A running
    proxy keeps its host: ``serve.start`` only warns that new HTTP options are ignored.
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else str(client.http_config.host)


def check_proxy_host(insecure_no_auth: bool, wanted: str, running: str | None) -> None:
    """Refuse ``--insecure-no-auth`` where the running Serve proxy listens beyond loopback.

    Without a key the apps must not be reachable from other machines; on such a cluster
    they would be, whatever ``--host`` says.
    """
    if insecure_no_auth and running is not None and running not in LOOPBACK:
        raise PrivcodeError(
            f"serve: --insecure-no-auth refused: this Ray cluster's Serve proxy already "
            f"listens on {running!r}, not on {wanted}, and Ray keeps that host, so the apps "
            "would be open to other machines without a key; set PRIVCODE_API_KEY (or "
            "serve.api_keys_dir), or shut Serve down first (`serve shutdown`)"
        )


def _serve_apps(args: argparse.Namespace, cfg: PipelineConfig, guard: dict) -> int:

    from ray import serve

    from privcode.cluster.local import connect
    from privcode.serve.args import ensemble_args, premium_args

    apps = []  # (name, route prefix, application, what): all validated before anything starts
    if not args.pac_only:
        from privcode.serve.premium import app, parse_args

        release = args.premium or str(RunLayout.of(cfg).premium)
        serve_cfg = cfg.serve
        if args.engine:
            serve_cfg = dataclasses.replace(cfg.serve, engine=args.engine)
        options = premium_args(serve_cfg, release, device=args.device, **guard)
        if args.model:
            options["model"] = args.model
        if parse_args(options).engine == "vllm":  # Ray Serve LLM's builder needs Ray: build later
            from privcode.serve.premium_llm import require_vllm

            require_vllm()
            application = partial(app, options)
        else:
            application = app(options)
        apps.append(("premium", cfg.serve.premium_route, application, f"premium model {release}"))
    if args.pac:
        from privcode.pac.ensemble import read_manifest
        from privcode.serve.ensemble import app as pac_app

        read_manifest(args.pac)  # a wrong dir fails here, not later inside the replica
        # The mechanism and budgets come from the config's pac section, the serving policy
        # from its serve section; the curator's state lives in the config's privacy store.
        # The chart renders the same sections (tests/test_serve_config.py).
        store = str(resolve_store(cfg.privacy.store))
        options = ensemble_args(
            cfg.serve, cfg.pac, args.pac, device=args.device, privacy_store=store, **guard
        )
        if args.pac_decoder:
            options["decoder"] = args.pac_decoder
        apps.append(("pac", cfg.serve.pac_route, pac_app(options), f"PAC ensemble {args.pac}"))
    # No key, no app: refused here, before anything starts (the replicas check it again).
    from privcode.serve.args import GuardArgs, guard_limits

    guard_limits(GuardArgs(**guard), PrivcodeError)
    connect(args.address)
    check_proxy_host(args.insecure_no_auth, args.host, running_proxy_host())
    serve.start(http_options={"host": args.host, "port": args.port})
    for name, prefix, application, what in apps:
        if isinstance(application, partial):
            application = application()
        serve.run(application, name=name, route_prefix=prefix)
        base = f"http://{args.host}:{args.port}{prefix.rstrip('/')}"
        extra = " (sessions: /v1/sessions, budget: /v1/privacy)" if name == "pac" else ""
        print(
            f"{what} at {base}/v1/completions (OpenAI completions API; schema: "
            f"{base}/openapi.json){extra}",
            file=sys.stderr,
            flush=True,
        )
    if args.insecure_no_auth:
        print("WARNING: no API key: any local process may query these apps", file=sys.stderr)
    print("Ctrl-C stops serving", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        for name, *_ in apps:
            serve.delete(name)
    return 0


def _keys_dir_for_replicas(guard: dict) -> str | None:
    """$PRIVCODE_API_KEY as a key directory the replicas can read, when it is the only key.

    The replicas run in the Ray cluster's processes (under `make serve`, the head that
    `make ray-up` started), which do not inherit this shell's environment. The key goes to a
    private directory (0700, the file 0600) for as long as `privcode serve` runs, never into
    the Serve config (which the dashboard shows). None when a keys directory is configured."""

    key = os.environ.get(KEY_ENV, "").strip()
    if not key or guard.get("api_keys_dir") or os.environ.get(KEYS_DIR_ENV):
        return None
    folder = tempfile.mkdtemp(prefix="privcode-serve-keys-")
    path = Path(folder) / "default"
    path.touch(mode=0o600)
    path.write_text(key, encoding="utf-8")
    return folder


def add_serve_parser(
    sub: argparse._SubParsersAction, add_config_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    p = sub.add_parser(
        "serve",
        help="Serve the premium model (and with --pac the PAC-private "
        "ensemble) on Ray Serve (OpenAI-compatible completions API) "
        "until Ctrl-C.",
    )
    add_config_args(p)
    p.add_argument(
        "--premium",
        default=None,
        help="Premium release directory (default: <run.out_dir>/<run.name>/premium).",
    )
    p.add_argument("--model", default=None, help="Base model override (default: premium.json's).")
    p.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default=None,
        help="Override serve.engine: transformers (one batching replica, CPU or GPU) or vllm "
        "(Ray Serve LLM on the cluster's GPUs, behind the same routes and keys; needs "
        "vLLM on every node).",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="Device (default %(default)s).",
    )
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default %(default)s).")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s).")
    p.add_argument(
        "--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else a local one)."
    )
    p.add_argument(
        "--pac",
        default=None,
        metavar="WORLDS_DIR",
        help="Also serve the PAC-private ensemble of this worlds artifact (the pac "
        "stage's <run.out_dir>/<run.name>/pac/worlds) at serve.pac_route (/ensemble, the "
        "chart's route), with the config's pac.b, top_k and budgets and serve.pac_* "
        "policy; its curator state (secret and charges) persists in the privacy store.",
    )
    p.add_argument(
        "--pac-decoder",
        choices=("gumbel", "greedy"),
        default=None,
        help="Override serve.pac_decoder (gumbel: requests with temperature > 0 by coupled "
        "Gumbel votes, temperature 0 greedily; greedy: every request greedily).",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="Serve WITHOUT an API key (every answer says so), on 127.0.0.1 only. Without "
        "it the apps refuse to start unless PRIVCODE_API_KEY or serve.api_keys_dir gives "
        "a key.",
    )
    p.add_argument(
        "--pac-only",
        action="store_true",
        help="Serve only the PAC ensemble (with --pac), not the premium model.",
    )
    p.set_defaults(func=cmd_serve)
