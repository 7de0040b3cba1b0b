"""The one place privcode speaks HTTP as a client: sessions with retries, bounded answers.

Two callers share it: the OpenAI-compatible endpoint client
(:mod:`privcode.models.endpoint`: Stage II's LLM operators, the leak probe) and
the privacy store's ledger client (:mod:`privcode.privacy.ledger_client`). The
ledger client sits below ``models/`` in the layering, so what both need lives
here, in the bottom layer, and ``requests`` is imported nowhere else.

Why requests + urllib3's :class:`~urllib3.util.retry.Retry` and not a loop of
our own: Retry already does exponential backoff, honours ``Retry-After``
(capped), tells "never sent" (connect) from "sent, maybe applied" (read)
failures, and counts all of them against one total. Two things it cannot do
are added here, small:

* a status whose body names a *final* error code (the PAC server's 429
  ``privacy_budget_exhausted``: no wait mends a spent budget) is never retried
  but raised as :class:`FinalStatus`; the body is peeked (at most
  :data:`ERROR_PEEK_BYTES`) inside :meth:`_Retry.increment`, the one hook that
  sees a response before urllib3 retries it;
* an answer is read with ``stream=True`` up to ``max_bytes`` (a larger
  ``Content-Length`` is refused before a byte is read) and within a wall-clock
  deadline, so an untrusted server cannot make the client hold gigabytes or
  hang on a slow drip.

Errors name the URL and what went wrong, never a request or an answer body.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import requests
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from privcode.errors import PrivcodeError

__all__ = [
    "CONNECT_TIMEOUT_S",
    "ERROR_PEEK_BYTES",
    "RETRY_AFTER_MAX_S",
    "Answer",
    "FinalStatus",
    "HttpError",
    "error_fields",
    "send",
    "session",
]

#: Seconds to open a connection (the read timeout is the caller's).
CONNECT_TIMEOUT_S = 10.0
#: The most of a retryable error body read to look for a final error code.
ERROR_PEEK_BYTES = 64 << 10
#: The longest ``Retry-After`` honoured, in seconds (a longer one waits this long).
RETRY_AFTER_MAX_S = 60
#: The longest exponential backoff between two tries, in seconds.
BACKOFF_MAX_S = 30.0


class HttpError(PrivcodeError):
    """A request failed before an answer could be read (``kind``: ``unreachable``,
    ``timeout``, ``too_large``, ``broken``); the message names the URL only."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class FinalStatus(HttpError):
    """A status whose error code says that retrying cannot help (never retried)."""

    def __init__(self, url: str, status: int, code: str, message: str) -> None:
        super().__init__(f"{url} answered HTTP {status}: {message or code}", "final")
        self.status, self.code, self.server_message = status, code, message


@dataclass(frozen=True)
class Answer:
    """A bounded answer: status, reason, body bytes and how many tries it took."""

    status: int
    reason: str
    body: bytes
    attempts: int

    def json(self) -> Any:
        """The body as JSON (``ValueError`` if it is not)."""
        return json.loads(self.body)


def error_fields(body: bytes) -> tuple[str, str]:
    """``(code, message)`` of an OpenAI-style error body (``{"error": {"code",
    "message"}}``; ``type`` stands in for a missing code); empty strings if none."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return "", ""
    if isinstance(err, str):
        return "", err[:300]
    if not isinstance(err, dict):
        return "", ""
    code = err.get("code") or err.get("type") or ""
    message = err.get("message") or ""
    return (code if isinstance(code, str) else ""), str(message)[:300]


class _Retry(Retry):
    """urllib3's Retry that raises :class:`FinalStatus` for a body naming a final code.

    The body of every status urllib3 is about to retry is peeked (bounded) and the
    response closed, so urllib3's own drain of it cannot read an unbounded body."""

    final_codes: frozenset[str] = frozenset()

    def new(self, **kw: Any) -> _Retry:
        retry = super().new(**kw)
        retry.final_codes = self.final_codes
        return retry

    def increment(self, method=None, url=None, response=None, error=None, *args, **kwargs):  # type: ignore[override]
        if response is not None and error is None and response.status in self.status_forcelist:
            code, message = "", ""
            if self.final_codes:
                try:
                    code, message = error_fields(
                        response.read(ERROR_PEEK_BYTES, decode_content=True)
                    )
                except (urllib3.exceptions.HTTPError, OSError):
                    pass
            response.close()
            if code in self.final_codes:
                response.release_conn()
                raise FinalStatus(str(url), response.status, code, message)
        return super().increment(method, url, response, error, *args, **kwargs)


def session(
    *,
    retries: int = 0,
    backoff_s: float = 0.5,
    retry_status: Collection[int] = (),
    final_codes: Collection[str] = (),
    pool_size: int = 10,
) -> requests.Session:
    """A session that retries up to ``retries`` times (module docstring).

    Retried: a connection that could not be opened (the request was never
    sent), and an answer with a status in ``retry_status`` unless its body names
    one of ``final_codes``; GET and POST alike (the caller says which of its
    calls are safe to repeat by what it puts in ``retry_status``). Never
    retried: a read error or timeout after the request went out (the server may
    have applied it). Waits: ``Retry-After`` (at most :data:`RETRY_AFTER_MAX_S`)
    or urllib3's backoff 0, 2b, 4b, ... (``b = backoff_s``, at most
    :data:`BACKOFF_MAX_S`). The last answer of a status still failing after
    ``retries`` tries is returned, not raised. Redirects are not followed.
    """
    retry = _Retry(
        total=retries,
        connect=retries,
        read=False,
        other=0,
        redirect=0,
        status=retries,
        status_forcelist=frozenset(retry_status),
        allowed_methods=frozenset({"GET", "POST"}),
        backoff_factor=backoff_s,
        backoff_max=BACKOFF_MAX_S,
        respect_retry_after_header=True,
        retry_after_max=RETRY_AFTER_MAX_S,
        raise_on_status=False,
        raise_on_redirect=False,
    )
    retry.final_codes = frozenset(final_codes)
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=max(1, pool_size), max_retries=retry)
    http = requests.Session()
    http.mount("http://", adapter)
    http.mount("https://", adapter)
    return http


def send(
    http: requests.Session,
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float,
    max_bytes: int,
) -> Answer:
    """``method url`` on ``http``; the answer of any status, its body read within
    ``timeout_s`` and refused over ``max_bytes`` (:class:`HttpError`)."""
    deadline = time.monotonic() + timeout_s
    try:
        resp = http.request(
            method,
            url,
            data=body,
            headers=dict(headers or {}),
            timeout=(min(CONNECT_TIMEOUT_S, timeout_s), timeout_s),
            stream=True,
            allow_redirects=False,
        )
    except requests.Timeout:
        raise HttpError(f"{url}: no answer within {timeout_s:g} s", "timeout") from None
    except requests.RequestException as exc:
        raise HttpError(f"cannot reach {url}: {type(exc).__name__}", "unreachable") from None
    with resp:
        data = _read(resp, url, max_bytes, deadline, timeout_s)
        attempts = len(getattr(resp.raw.retries, "history", ())) + 1
        return Answer(resp.status_code, str(resp.reason or ""), data, attempts)


def _read(resp: requests.Response, url: str, cap: int, deadline: float, timeout_s: float) -> bytes:
    """At most ``cap`` bytes of ``resp``'s body, read before ``deadline``."""
    size = resp.headers.get("Content-Length", "")
    if size.isdigit() and int(size) > cap:
        raise HttpError(f"{url}: answer larger than {cap} bytes (refused)", "too_large")
    chunks, got = [], 0
    try:  # read1: what one socket read brings, so a slow drip meets the deadline
        while chunk := resp.raw.read1(64 << 10, decode_content=True):
            got += len(chunk)
            if got > cap:
                raise HttpError(f"{url}: answer larger than {cap} bytes (refused)", "too_large")
            if time.monotonic() > deadline:
                raise HttpError(f"{url}: answer not read within {timeout_s:g} s", "timeout")
            chunks.append(chunk)
    except urllib3.exceptions.ReadTimeoutError:
        raise HttpError(f"{url}: no answer within {timeout_s:g} s", "timeout") from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise HttpError(f"{url}: the answer broke off ({type(exc).__name__})", "broken") from None
    return b"".join(chunks)
