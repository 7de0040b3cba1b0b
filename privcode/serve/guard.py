"""What stands between a hostile client and a serving app: keys, rate limits, body caps.

Pure Python (no Ray, no torch); both apps put :class:`GuardMiddleware` in front of their
FastAPI routes (:mod:`privcode.serve.api`). :class:`KeyRing`: API keys, one per client (a
*principal*); a bearer token is hashed (SHA-256) and compared with EVERY key's hash by
:func:`hmac.compare_digest`, so the time depends on neither which key matched nor how much of
it did; no key is an error unless ``insecure_no_auth``. :class:`RateLimiter`: a token bucket
per principal (``burst``, then ``rate`` per second; ``Retry-After``). :class:`GuardMiddleware`
(ASGI): 413 over ``max_body_bytes`` (before any route reads the body), 401 without a valid
key, 429 past the rate; ``/healthz`` is open. Its error bodies name limits and sizes only,
never what the client sent. Details: docs/serving.md, "privcode/serve/guard.py".
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError

__all__ = [
    "ANONYMOUS",
    "INSECURE_WARNING",
    "KEYS_DIR_ENV",
    "KEY_ENV",
    "GuardError",
    "GuardMiddleware",
    "KeyRing",
    "RateLimiter",
    "error_body",
]

KEY_ENV = "PRIVCODE_API_KEY"
KEYS_DIR_ENV = "PRIVCODE_API_KEYS_DIR"
ANONYMOUS = "anonymous"
#: Shortest key accepted: 128 bits as hex.
MIN_KEY_CHARS = 32
INSECURE_WARNING = "unauthenticated endpoint (insecure_no_auth): any local client may query it"
_PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


class GuardError(PrivcodeError, ValueError):
    """The keys cannot be loaded, or none exist and insecure mode was not asked for."""


def error_body(
    message: str,
    param: str | None = None,
    *,
    type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """Principal -> API key; :meth:`principal` finds who a bearer token belongs to."""

    def __init__(self, keys: Mapping[str, str], *, insecure: bool = False):
        if insecure and keys:
            raise GuardError("insecure_no_auth is for an app without keys; keys were given")
        seen: dict[bytes, str] = {}
        for name, key in keys.items():
            if not _PRINCIPAL.match(name):
                raise GuardError(
                    f"API key name {name[:40]!r}: use letters, digits, '.', '_' or '-' "
                    "(at most 128), starting with a letter or digit"
                )
            if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
                raise GuardError(
                    f"API key of {name!r} must be at least {MIN_KEY_CHARS} characters without "
                    "spaces (e.g. `openssl rand -hex 32`)"
                )
            d = _digest(key)
            if d in seen:
                raise GuardError(f"API keys of {seen[d]!r} and {name!r} are the same key")
            seen[d] = name
        self._keys = [(d, name) for d, name in seen.items()]
        self.insecure = insecure

    @property
    def principals(self) -> tuple[str, ...]:
        return tuple(sorted(name for _, name in self._keys)) or (ANONYMOUS,)

    @classmethod
    def load(
        cls,
        keys_dir: str | None = None,
        *,
        insecure: bool = False,
        key_env: str = KEY_ENV,
        env: Mapping[str, str] | None = None,
    ) -> KeyRing:
        """Keys of ``keys_dir`` (``$PRIVCODE_API_KEYS_DIR`` overrides) and ``$PRIVCODE_API_KEY``.

        :class:`GuardError` when there are none and ``insecure`` is false, naming how to add
        one; keys and ``insecure`` together are an error too (which one was meant?).
        """
        env = os.environ if env is None else env
        keys: dict[str, str] = {}
        folder = env.get(KEYS_DIR_ENV) or keys_dir or ""
        if folder:
            root = Path(folder).expanduser()
            if not root.is_dir():
                raise GuardError(f"API keys directory {root} does not exist")
            for path in sorted(root.iterdir()):
                # A mounted Secret also holds ..data and dated dirs (symlinks): skip dot names.
                if path.name.startswith(".") or not path.is_file():
                    continue
                keys[path.name] = path.read_text(encoding="utf-8").strip()
        single = env.get(key_env, "").strip()
        if single:
            if keys.get("default", single) != single:
                raise GuardError(f"${key_env} and the keys directory both name 'default'")
            keys["default"] = single
        if not keys and not insecure:
            raise GuardError(
                f"no API key: set ${key_env}, or point ${KEYS_DIR_ENV} (serve.api_keys_dir) "
                "at a directory with one key file per client (a Kubernetes Secret); to serve "
                "without authentication on 127.0.0.1 only, pass --insecure-no-auth"
            )
        return cls(keys, insecure=insecure and not keys)

    def principal(self, authorization: str | None) -> str | None:
        """Whose key the ``Authorization: Bearer`` header carries; None if nobody's.

        Every key's hash is compared, whatever matched first (constant time in the key)."""
        if self.insecure:
            return ANONYMOUS
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        found = None
        for digest, name in self._keys:
            if hmac.compare_digest(presented, digest) and found is None:
                found = name
        return found


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per principal: ``burst`` at once, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if not (math.isfinite(rate) and rate > 0) or burst < 1:
            raise GuardError(f"rate limit must be > 0 per second with a burst >= 1, got {rate}")
        self.rate, self.burst, self.clock = float(rate), int(burst), clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, principal: str) -> float:
        """0.0 when ``principal`` may send a request now (one token spent), else the wait (s)."""
        now = self.clock()
        with self._lock:
            b = self._buckets.get(principal)
            if b is None:
                b = self._buckets[principal] = _Bucket(float(self.burst), now)
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
            if b.tokens >= 1.0:
                b.tokens -= 1.0
                return 0.0
            return (1.0 - b.tokens) / self.rate


def _path(scope: Mapping[str, Any]) -> str:
    """The request path below the app's route prefix (``root_path``), without a trailing slash."""
    path = scope.get("path") or "/"
    root = (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return path.rstrip("/") or "/"


class GuardMiddleware:
    """ASGI middleware: body cap (413), API key (401), rate limit (429); see the module doc."""

    def __init__(
        self,
        app: Any,
        *,
        keys: KeyRing,
        limiter: RateLimiter,
        max_body_bytes: int,
        open_paths: Iterable[str] = ("/healthz",),
    ):
        self.app, self.keys, self.limiter = app, keys, limiter
        self.max_body_bytes = int(max_body_bytes)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.keys.insecure:
            send = _with_header(send, b"x-privcode-warning", INSECURE_WARNING.encode())
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if _path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        principal = self.keys.principal(headers.get("authorization"))
        if principal is None:
            await _answer(
                send,
                401,
                error_body(
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                ),
                {"WWW-Authenticate": "Bearer"},
            )
            return
        wait = self.limiter.take(principal)
        if inspect.isawaitable(wait):  # the replicas' shared buckets
            wait = await wait
        if wait > 0:
            await _answer(
                send,
                429,
                error_body(
                    f"rate limit of this API key reached ({self.limiter.rate:g} requests/s, "
                    f"burst {self.limiter.burst}); retry after {math.ceil(wait)} s",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                ),
                {"Retry-After": str(max(1, math.ceil(wait)))},
            )
            return
        scope.setdefault("state", {})["principal"] = principal
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(send, 413, self._too_large(int(length)))
            return
        if scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):
            body, more = [], True
            size = 0
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await _answer(send, 413, self._too_large(None))
                    return
                body.append(chunk)
                more = message.get("more_body", False)
            receive = _replay(b"".join(body), receive)
        await self.app(scope, receive, send)

    def _too_large(self, size: int | None) -> dict[str, Any]:
        what = f"request body is {size} bytes" if size is not None else "request body is"
        return error_body(
            f"{what} over the limit of {self.max_body_bytes} bytes",
            type="invalid_request_error",
            code="request_too_large",
        )


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, when it comes

    return replay


def _with_header(send: Any, name: bytes, value: bytes) -> Any:
    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return wrapped


async def _answer(
    send: Any, status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
