"""ONE client of OpenAI-compatible servers: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``.

Stage II's LLM operators (:mod:`privcode.synth.llm_endpoint`) and the leak probe's HTTP
backend (:class:`privcode.audit.probe.backends.OpenAIBackend`) are thin adapters over
:class:`EndpointClient`; the transport is :mod:`privcode.http`. It retries
:data:`RETRY_STATUS` and connections that could not be opened (``Retry-After``, at most 60 s,
or a backoff of 0, 2b, 4b... s), never a read error or timeout once the request went out (the
PAC server may have charged budget), nor 500; a 429 ``privacy_budget_exhausted`` raises
:class:`BudgetExhaustedError`, never retried. At most ``max_answer_bytes`` (default
:data:`MAX_ANSWER_BYTES`) are read within ``timeout_s``; a larger answer is refused, not cut.
The bearer token (from an environment variable) is never in an error, a ``repr`` or a log;
errors name the URL and the status, never a prompt or an answer.
Design notes: docs/architecture.md, "models/endpoint.py".
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any
from urllib.parse import urlsplit

from privcode import http
from privcode.errors import PrivcodeError

__all__ = [
    "BUDGET_EXHAUSTED",
    "MAX_ANSWER_BYTES",
    "RETRY_STATUS",
    "BudgetExhaustedError",
    "EndpointClient",
    "EndpointError",
    "EndpointStatusError",
    "check_endpoint_url",
    "completion_text",
]

#: Statuses retried: rate limited, bad gateway, unavailable, gateway timeout.
RETRY_STATUS = (429, 502, 503, 504)
#: The PAC server's error code for a spent privacy budget (never retried).
BUDGET_EXHAUSTED = "privacy_budget_exhausted"
#: The largest answer read by default (a completion of a few thousand tokens is ~100 KB).
MAX_ANSWER_BYTES = 1 << 20


class EndpointError(PrivcodeError):
    """The endpoint is misconfigured, unreachable, or its answer is unusable."""


class EndpointStatusError(EndpointError):
    """The endpoint answered an error status (``status``; ``code``: its error code, if
    any; ``attempts``: how many tries were made)."""

    def __init__(self, message: str, status: int, code: str = "", attempts: int = 1) -> None:
        super().__init__(message)
        self.status, self.code, self.attempts = status, code, attempts


class BudgetExhaustedError(EndpointStatusError):
    """HTTP 429 ``privacy_budget_exhausted``: the PAC server's budget is spent (never retried)."""


def check_endpoint_url(
    url: str, key: str = "endpoint", *, plain_http_anywhere: bool = False
) -> str:
    """``url`` without a trailing slash and without ``/v1``; refuses what is not http(s),
    and plain http to anything but a loopback host (the token and the prompts would
    travel in the clear) unless ``plain_http_anywhere``. ``key`` names the setting."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise EndpointError(f"{key}: need an http(s) URL such as https://llm.internal:8000")
    if parts.scheme == "http" and not plain_http_anywhere:
        host = parts.hostname
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise EndpointError(
                f"{key}: plain http to {host} would send the API token and the samples in the "
                "clear; use https (or a loopback address)"
            )
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def completion_text(data: Any, url: str, *, chat: bool = False) -> str:
    """``choices[0].text`` (or ``.message.content`` with ``chat``) of an answer."""
    field = "message.content" if chat else "text"
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (KeyError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise EndpointError(f"{url}: not an OpenAI completions answer (no choices[0].{field})")
    return text


class EndpointClient:
    """An OpenAI-compatible server at ``url`` (module docstring); thread-safe, one
    connection pool of ``concurrency`` connections."""

    def __init__(
        self,
        url: str,
        *,
        api_key_env: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        key: str = "endpoint",
        plain_http_anywhere: bool = False,
    ) -> None:
        if retries < 0 or timeout_s <= 0 or max_answer_bytes < 1 or backoff_s < 0:
            raise ValueError("retries >= 0, backoff_s >= 0, timeout_s > 0, max_answer_bytes >= 1")
        self.api = check_endpoint_url(url, key, plain_http_anywhere=plain_http_anywhere) + "/v1"
        self.api_key_env, self.retries = api_key_env, int(retries)
        self.timeout_s, self.max_answer_bytes = float(timeout_s), int(max_answer_bytes)
        token = os.environ.get(api_key_env, "").strip() if api_key_env else ""
        self.has_key = bool(token)
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._http = http.session(
            retries=self.retries,
            backoff_s=backoff_s,
            retry_status=RETRY_STATUS,
            final_codes=(BUDGET_EXHAUSTED,),
            pool_size=concurrency,
        )

    def __repr__(self) -> str:  # never the token
        return f"EndpointClient({self.api!r})"

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of ``method /v1/<route>``; :class:`EndpointError` otherwise."""
        url = f"{self.api}/{route}"
        data = None if body is None else json.dumps(body).encode()
        try:
            answer = http.send(
                self._http,
                method,
                url,
                body=data,
                headers=self._headers,
                timeout_s=self.timeout_s,
                max_bytes=self.max_answer_bytes,
            )
        except http.FinalStatus as exc:
            raise BudgetExhaustedError(str(exc), exc.status, exc.code) from None
        except http.HttpError as exc:
            raise EndpointError(str(exc)) from None
        if answer.status != 200:
            raise self._status_error(url, answer)
        try:
            return answer.json()
        except (ValueError, UnicodeDecodeError):
            raise EndpointError(f"{url}: not an OpenAI completions answer (not JSON)") from None

    def _status_error(self, url: str, answer: http.Answer) -> EndpointStatusError:
        code, message = http.error_fields(answer.body)
        status, tries = answer.status, answer.attempts
        if code == BUDGET_EXHAUSTED:
            return BudgetExhaustedError(f"{url} answered HTTP {status}: {message}", status, code)
        if status in RETRY_STATUS and self.retries:
            text = f"{url}: failed {tries} times (last: HTTP {status})"
        else:
            text = f"{url} answered HTTP {status}: {message or answer.reason or 'error'}"
        if status in (401, 403):
            env = self.api_key_env
            text += f" (check the API key in ${env})" if env else " (the endpoint wants a key)"
        return EndpointStatusError(text, status, code, tries)

    def models(self) -> list[str]:
        """The model ids ``GET /v1/models`` lists."""
        data = self.request("GET", "models")
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError):
            raise EndpointError(f"{self.api}/models: not an OpenAI model list") from None

    def complete(self, body: dict[str, Any], *, chat: bool = False) -> str:
        """The first choice's text of ``POST /v1/completions`` (``/v1/chat/completions``
        with ``chat``; ``body`` then has ``messages`` instead of ``prompt``)."""
        route = "chat/completions" if chat else "completions"
        return completion_text(self.request("POST", route, body), f"{self.api}/{route}", chat=chat)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()
