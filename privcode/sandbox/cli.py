"""``privcode sandbox check FILE...`` and ``privcode sandbox serve``.

``check`` runs Python files in the sandbox (locally, or on the executor with
``--executor URL`` / ``PRIVCODE_SANDBOX_EXECUTOR``) and reports verdicts: exit code 0 when
every file ran (whatever its verdict), 2 on usage errors (a missing or unreadable file is
named).  ``--json`` prints one JSON object per file per line.  ``serve`` runs the executor
service (:mod:`privcode.sandbox.executor_server`), the process of the chart's executor pods:
it needs a bearer token file (``--token-file``) or ``--insecure-no-auth`` by name.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from privcode.errors import PrivcodeError
from privcode.sandbox import SandboxError, SandboxLimits, file_result
from privcode.sandbox.executor import open_sandbox, serve


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def cmd_sandbox_check(args: argparse.Namespace) -> int:

    codes = []
    for name in args.files:
        path = Path(name)
        if not path.is_file():
            raise PrivcodeError(f"sandbox check: no such file: {name}")
        try:
            codes.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise PrivcodeError(f"sandbox check: cannot read {name}: {exc.strerror}") from None
    defaults = SandboxLimits()
    limits = SandboxLimits(
        cpu_seconds=args.cpu_seconds or defaults.cpu_seconds,
        wall_seconds=args.wall_seconds or defaults.wall_seconds,
        memory_mb=args.memory_mb or defaults.memory_mb,
    )
    try:
        with open_sandbox(
            min(args.workers or 4, len(codes)),
            limits,
            isolation=args.isolation,
            executor=args.executor or "",
        ) as pool:
            verdicts = pool.map(codes)
    except SandboxError as exc:
        raise PrivcodeError(f"sandbox check: {exc}") from None
    results = [file_result(name, v) for name, v in zip(args.files, verdicts, strict=True)]
    if args.json:
        for r in results:
            print(json.dumps(r, sort_keys=True))
    else:
        width = max(len(r["file"]) for r in results)
        print(f"{'FILE':<{width}}  {'STATUS':<8} {'SECONDS':>8}  ERROR")
        for r in results:
            print(
                f"{r['file']:<{width}}  {r['status']:<8} {r['seconds']:>8.3f}  {r['error'] or ''}"
            )
        passed = sum(r["passed"] for r in results)
        print(f"{passed}/{len(results)} passed (isolation: {results[0]['isolation']})")
    return 0


def add_sandbox_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``sandbox`` (with ``check``) to the ``privcode`` subcommands."""
    p = subparsers.add_parser(
        "sandbox",
        help="Run Python files in the execution sandbox (the one Stage II and pass@k use).",
    )
    ssub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = ssub.add_parser(
        "check",
        help="Run each file in the sandbox; print its verdict "
        "(status ok/error/timeout/cpu/memory/output/killed/syntax).",
    )
    c.add_argument("files", nargs="+", metavar="FILE", help="Python files (stdlib only).")
    c.add_argument("--json", action="store_true", help="One JSON object per file per line.")
    c.add_argument("--cpu-seconds", type=_positive(float), help="CPU limit per file (default 5).")
    c.add_argument(
        "--wall-seconds", type=_positive(float), help="Wall limit per file (default 10)."
    )
    c.add_argument("--memory-mb", type=_positive(int), help="Memory limit per file (default 512).")
    c.add_argument("--workers", type=_positive(int), help="Concurrent sandboxes (default 4).")
    _isolation_arg(c)
    c.add_argument(
        "--executor",
        metavar="URL",
        help="Run on this executor service instead of locally (PRIVCODE_SANDBOX_EXECUTOR wins).",
    )
    c.set_defaults(func=cmd_sandbox_check)
    s = ssub.add_parser(
        "serve",
        help="Run the executor service: a sandbox pool behind HTTP (the chart's executor pods).",
    )
    s.add_argument("--host", default="127.0.0.1", help="Bind address (default 127.0.0.1).")
    s.add_argument("--port", type=_positive(int), default=8700, help="Port (default 8700).")
    s.add_argument("--workers", type=_positive(int), default=2, help="Sandbox slots (default 2).")
    _isolation_arg(s)
    s.add_argument(
        "--token-file",
        metavar="PATH",
        help="File holding the bearer token clients must send (default: "
        "$PRIVCODE_EXECUTOR_TOKEN_FILE); without one the server refuses to start.",
    )
    s.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="Serve without a token (tests, a laptop): anyone who reaches the port runs code.",
    )
    s.add_argument(
        "--memory-budget-mb",
        type=_positive(int),
        help="The pod's memory limit: the limits' caps are clamped so that workers x "
        "(memory_mb + disk_mb) and the server fit (refused if the defaults do not).",
    )
    s.add_argument(
        "--disk-budget-mb",
        type=_positive(int),
        help="The pod's /tmp size: workers x disk_mb is clamped to fit.",
    )
    s.add_argument(
        "--max-inflight", type=_positive(int), default=4, help="Batches admitted at once (4)."
    )
    s.add_argument(
        "--max-connections", type=_positive(int), default=64, help="Open connections (64)."
    )
    s.add_argument(
        "--request-deadline-s",
        type=_positive(float),
        default=30.0,
        help="Seconds for a request's headers and body to arrive (default 30).",
    )
    s.set_defaults(func=cmd_sandbox_serve)
    return p


def _isolation_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--isolation",
        choices=("full", "full-no-cgroup", "rlimits-only"),  # pool.ISOLATIONS, not imported here
        default="full",
        help="Weakest isolation accepted (default full: refuse to run without it); "
        "full-no-cgroup = the same without a cgroup, by name; "
        "rlimits-only = weak, verdicts only, no protection.",
    )


def cmd_sandbox_serve(args: argparse.Namespace) -> int:

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(
            args.host,
            args.port,
            workers=args.workers,
            isolation=args.isolation,
            token_file=args.token_file,
            insecure_no_auth=args.insecure_no_auth,
            memory_budget_mb=args.memory_budget_mb,
            disk_budget_mb=args.disk_budget_mb,
            max_inflight=args.max_inflight,
            max_connections=args.max_connections,
            request_deadline_s=args.request_deadline_s,
        )
    except SandboxError as exc:
        raise PrivcodeError(f"sandbox serve: {exc}") from None
    except KeyboardInterrupt:
        pass
    return 0
