"""A client of the store's ledger served over HTTP (:mod:`privcode.privacy.ledger_service`).
Design notes: docs/privacy.md, "privcode/privacy/ledger_client.py".

:func:`remote_ledger` returns it when ``PRIVCODE_LEDGER_URL`` and ``PRIVCODE_LEDGER_TOKEN_FILE``
(a role's bearer token) are set; the ledger helpers
(:func:`~privcode.privacy.ledger_actor.open_ledger`, ``get_ledger``, ``ledger_call``,
:func:`~privcode.privacy.budget.call`) then use it instead of a Ray actor. Arguments and results
are JSON, ``bytes`` as ``{"$b64": ...}``. The ledger's errors come back as the same classes and
messages; anything else (no answer, a timeout, a 5xx) is a
:class:`~privcode.errors.LedgerUnavailableError`: nothing may train. A call is sent once, never
repeated (``reserve`` carries its own request id). Transport: :mod:`privcode.http` (no retries,
answers capped at :data:`MAX_ANSWER_BYTES`).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from pathlib import Path
from typing import Any

from privcode import http
from privcode.errors import AccountingError, LedgerConflictError, LedgerUnavailableError
from privcode.privacy.authority import AuthorityError

__all__ = [
    "TOKEN_FILE_ENV",
    "URL_ENV",
    "RemoteLedger",
    "decode",
    "encode",
    "remote_ledger",
]

URL_ENV = "PRIVCODE_LEDGER_URL"
TOKEN_FILE_ENV = "PRIVCODE_LEDGER_TOKEN_FILE"
_B64 = "$b64"
#: The largest answer read: the service's own cap on a call
#: (:data:`privcode.privacy.ledger_service.DEFAULT_MAX_BODY_BYTES`).
MAX_ANSWER_BYTES = 64 << 20


def encode(value: Any) -> Any:
    """JSON-ready ``value``: bytes as ``{"$b64": ...}``, tuples as lists."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {_B64: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, dict):
        if set(value) == {_B64} and isinstance(value[_B64], str):
            return base64.b64decode(value[_B64], validate=True)
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _errors() -> dict[str, type[Exception]]:

    return {
        cls.__name__: cls
        for cls in (AccountingError, LedgerConflictError, LedgerUnavailableError, AuthorityError)
    }


class RemoteLedger:
    """The ledger at ``url`` called with ``token`` (module docstring)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 120.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise LedgerUnavailableError(f"{URL_ENV} must be an http(s) URL, got {url!r}")
        if not token:
            raise LedgerUnavailableError("the ledger's token is empty")
        self.url, self._token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self._http: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the token
        return f"RemoteLedger({self.url!r})"

    def __reduce__(self) -> Any:  # pickled into Ray tasks: re-read from their own env
        return (remote_ledger, ())

    def _session(self) -> Any:
        with self._lock:
            if self._http is None:
                self._http = http.session(retries=0)
            return self._http

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on the ledger; its errors re-raised here."""
        body = {"method": method, "args": encode(list(args)), "kwargs": encode(kwargs)}
        try:
            reply = http.send(
                self._session(),
                "POST",
                f"{self.url}/v1/call",
                body=json.dumps(body).encode(),
                headers={
                    "Authorization": f"Bearer {self._token}",
                    "Content-Type": "application/json",
                },
                timeout_s=timeout_s or self.timeout_s,
                max_bytes=MAX_ANSWER_BYTES,
            )
        except http.HttpError as exc:
            raise LedgerUnavailableError(
                f"the privacy store's ledger at {self.url} cannot be reached or gave no "
                f"usable answer ({exc}); nothing may train"
            ) from None
        try:
            payload = reply.json()
        except (ValueError, UnicodeDecodeError):
            payload = {}
        if reply.status == 200 and isinstance(payload, dict) and "result" in payload:
            return decode(payload["result"])
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) and error.get("type") in _errors():
            raise _errors()[error["type"]](str(error.get("message", ""))[:2000])
        raise LedgerUnavailableError(
            f"the privacy store's ledger at {self.url} answered {method}() with HTTP "
            f"{reply.status} ({str(error or reply.reason)[:300]}); nothing may train"
        )


def remote_ledger(url: str | None = None, *, timeout_s: float = 120.0) -> RemoteLedger | None:
    """The ledger at ``url`` (default ``PRIVCODE_LEDGER_URL``) with the token read from
    ``PRIVCODE_LEDGER_TOKEN_FILE``, or None when no URL is set (a local store: its Ray
    actor or a plain ledger)."""
    url = (url if url is not None else os.environ.get(URL_ENV, "")).strip()
    if not url:
        return None
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if not path:
        raise LedgerUnavailableError(f"the ledger {url} needs a token: {TOKEN_FILE_ENV} is unset")
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise LedgerUnavailableError(
            f"the ledger token file {path} cannot be read ({exc.strerror})"
        ) from None
    return RemoteLedger(url, token, timeout_s=timeout_s)
