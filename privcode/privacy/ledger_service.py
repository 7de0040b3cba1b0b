"""The store's ledger over HTTP: one writer per store for a whole Kubernetes release.
Design notes: docs/privacy.md, "privcode/privacy/ledger_service.py".

``privcode budget serve-ledger --store PATH --tokens DIR`` holds the store's lock
(:class:`~privcode.privacy.ledger.StoreLedger`) and answers ``POST /v1/call`` with
``{"method", "args", "kwargs"}`` (:mod:`privcode.privacy.ledger_client` encodes them);
``GET /healthz`` (no token) says whether the writer is usable. ``DIR`` holds one bearer token
per role (``pipeline``, ``serving``, ``operator``); a role may call only its methods
(:data:`ROLES`), and a raise also needs the authority's signed grant
(:mod:`privcode.privacy.raising`). Calls run one at a time (the ledger is not thread-safe); a
body over ``max_body_bytes`` is refused before it is read; errors carry the ledger's own class
and message (aggregates only). FastAPI and uvicorn (the ``serve`` extra).
"""

import hmac
import logging
import threading
from pathlib import Path
from typing import Any

from privcode.errors import (
    AccountingError,
    LedgerConflictError,
    LedgerUnavailableError,
    PrivcodeError,
)
from privcode.privacy.authority import AuthorityError
from privcode.privacy.ledger_client import decode, encode

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ROLES", "build_ledger_app", "load_tokens", "serve_ledger"]

log = logging.getLogger("privcode.ledger")

_READ = frozenset({"describe", "ping"})
_PAC_SERVE = frozenset({"pac_worlds_id", "pac_served", "pac_open", "pac_lease"})
_RAISE = frozenset({"raise_budget", "pac_raise"})
_TRAIN = frozenset(
    {
        "budget_for",
        "admission",
        "admit",
        "import_legacy",
        "reserve",
        "finish",
        "job_spent",
        "run_spent",
        "finish_run",
        "show",
        "pac_records",
    }
)
#: The methods each role's token may call.
ROLES: dict[str, frozenset[str]] = {
    "pipeline": _READ | _TRAIN | _PAC_SERVE | _RAISE,
    "operator": _READ | _TRAIN | _RAISE,
    "serving": _READ | _PAC_SERVE,
}
#: 64 MiB: the identities of ~200k records (19 x 16 bytes each, base64).
DEFAULT_MAX_BODY_BYTES = 64 << 20
_STATUS = {
    "AccountingError": 422,
    "AuthorityError": 403,
    "LedgerConflictError": 409,
    "LedgerUnavailableError": 503,
}


def load_tokens(directory: str | Path) -> dict[str, str]:
    """``{role: token}`` from the files of ``directory`` named after :data:`ROLES`."""
    root = Path(directory)
    tokens = {}
    for role in ROLES:
        path = root / role
        if path.is_file():
            token = path.read_text(encoding="utf-8").strip()
            if len(token) < 16:
                raise PrivcodeError(f"ledger token {path}: at least 16 characters")
            tokens[role] = token
    if not tokens:
        raise PrivcodeError(f"no ledger token in {root} (files named {', '.join(ROLES)})")
    if len(set(tokens.values())) < len(tokens):
        raise PrivcodeError(f"ledger tokens in {root}: each role needs its own token")
    return tokens


def _role(tokens: dict[str, str], header: str | None) -> str | None:
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return None
    found = None
    for role, token in tokens.items():  # compare every one: no early exit on a match
        if hmac.compare_digest(presented.encode(), token.encode()):
            found = role
    return found


def _error(kind: str, message: str, status: int | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body = {"error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status or _STATUS.get(kind, 400))


def build_ledger_app(
    ledger: Any, tokens: dict[str, str], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> Any:
    """The FastAPI app over ``ledger`` (a :class:`StoreLedger`), with ``tokens`` by role."""
    from fastapi import FastAPI, Request

    app = FastAPI(title="privcode ledger", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()
    known = (AccountingError, LedgerConflictError, LedgerUnavailableError, AuthorityError)

    @app.get("/healthz")
    def healthz() -> Any:
        with lock:
            failed = ledger.describe().get("failed")
        return _error("LedgerUnavailableError", "fenced", 503) if failed else {"ok": True}

    @app.post("/v1/call")
    async def call(request: Request) -> Any:
        role = _role(tokens, request.headers.get("authorization"))
        if role is None:
            return _error("Unauthorized", "a ledger token is required", 401)
        size = request.headers.get("content-length")
        if size is None or not size.isdigit() or int(size) > max_body_bytes:
            return _error("TooLarge", f"a call is at most {max_body_bytes} bytes", 413)
        try:
            body = await request.json()
            method, args, kwargs = body["method"], decode(body["args"]), decode(body["kwargs"])
            if not (isinstance(args, list) and isinstance(kwargs, dict)):
                raise TypeError("args must be a list and kwargs an object")
        except (ValueError, KeyError, TypeError) as exc:
            return _error("BadRequest", f"not a ledger call ({type(exc).__name__})", 400)
        if method not in ROLES[role]:
            return _error("Forbidden", f"the {role} token may not call {method!r}", 403)
        from starlette.concurrency import run_in_threadpool

        def run() -> Any:
            with lock:
                return getattr(ledger, method)(*args, **kwargs)

        try:
            result = await run_in_threadpool(run)
        except known as exc:
            return _error(type(exc).__name__, str(exc))
        except (TypeError, ValueError, PrivcodeError) as exc:  # arguments the method refuses
            return _error("BadRequest", f"{method}(): {str(exc)[:300]}", 400)
        return {"result": encode(result)}

    return app


def serve_ledger(
    store: str | Path,
    tokens_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8790,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Hold ``store``'s lock and serve its ledger until stopped (module docstring)."""
    import uvicorn

    from privcode.privacy.ledger import StoreLedger

    tokens = load_tokens(tokens_dir)
    ledger = StoreLedger(store)
    log.info("ledger of store %s on %s:%d, roles %s", ledger.store_id, host, port, sorted(tokens))
    try:
        app = build_ledger_app(ledger, tokens, max_body_bytes=max_body_bytes)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        ledger.close()
