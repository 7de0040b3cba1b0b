"""The OpenAI-compatible HTTP API, independent of the server: pure Python, no Ray, no torch.

:func:`parse_completion` turns the raw body of ``POST /v1/completions`` into
a :class:`CompletionRequest` or raises :class:`RequestError` naming the bad
field (``param``) in an OpenAI-style error body. Messages never contain the
prompt text or any other request value that could be private: only field
names, types, limits and sizes.

Fields (OpenAI legacy completions): ``prompt`` (str, or a list of one str),
``max_tokens`` (int, 1..limit, default 128), ``temperature`` (number >= 0,
default 0: greedy), ``top_p`` (0 < p <= 1, default 1), ``stop`` (str or
list of up to :data:`MAX_STOP` non-empty str), ``seed`` (int), ``model``
(str). ``null`` means "not given". Fields standard clients send with their
neutral value (``n: 1``, ``stream: false``, ``echo: false``, ``logprobs:
null``, penalties 0, ``best_of: 1``, ``user``, ...) are accepted at that
value and refused otherwise; any other field is refused.

:class:`CompletionsAPI` routes a request (method, path, headers, body) to a
``(status, JSON body, headers)`` answer: the API key check (``Authorization:
Bearer``, constant-time, every route but ``/healthz``), 404 / 405, and the
completion response. The Ray Serve deployment in :mod:`privcode.serve.premium`
is a thin wrapper around it.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from privcode.errors import PrivcodeError

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_BODY_BYTES",
    "MAX_STOP",
    "ROUTES",
    "CompletionRequest",
    "CompletionsAPI",
    "RequestError",
    "api_key_from_env",
    "bearer_ok",
    "error_body",
    "load_json_body",
    "parse_completion",
    "read_body_capped",
    "route_path",
]

#: Largest request body accepted (bytes).
MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 128
#: Most stop strings per request, and the longest one (characters).
MAX_STOP = 16
MAX_STOP_CHARS = 256
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.manual_seed accepts

#: Fields standard OpenAI clients may send, accepted only at their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "stream": (False,),
    "echo": (False,),
    "logprobs": (None,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "stream_options": (None,),
}
_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "user")


class RequestError(PrivcodeError, ValueError):
    """A request the API refuses: HTTP ``status`` with an OpenAI-style error naming ``param``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, type=self.type, code=self.code)


def error_body(
    message: str,
    param: str | None = None,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI returns it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionRequest:
    """One validated completion request (the prompt is kept only in memory)."""

    prompt: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _load_json(body: bytes) -> Any:
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(
            f"request body is {len(body)} bytes, over the limit of {MAX_BODY_BYTES} bytes"
        )
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError("request body is not UTF-8 encoded JSON") from None
    except (ValueError, RecursionError) as exc:
        # json's messages carry a position, never the document text.
        detail = f": {exc}" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(f"request body is not valid JSON{detail}") from None


def load_json_body(body: bytes) -> Any:
    """A request body parsed as JSON; :class:`RequestError` (400, no body text echoed) if it is not.

    For routes with their own fields (the PAC ensemble's ``session``), before
    :func:`parse_completion` sees the rest.
    """
    return _load_json(body)


def _type_name(value: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {_type_name(value)}", key)
    if not lo <= value <= hi:
        raise RequestError(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return value


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number, got {_type_name(value)}", key)
    value = float(value)
    if not math.isfinite(value):
        raise RequestError(f"'{key}' must be a finite number", key)
    return value


def _prompt(body: dict[str, Any]) -> str:
    if "prompt" not in body or body["prompt"] is None:
        raise RequestError("'prompt' is required", "prompt")
    value = body["prompt"]
    if isinstance(value, list):
        if len(value) != 1:
            raise RequestError(
                f"'prompt' as a list must hold exactly one string (batched "
                f"prompts are not supported), got {len(value)} items",
                "prompt",
            )
        value = value[0]
    if not isinstance(value, str):
        raise RequestError(
            f"'prompt' must be a string (token-id prompts are not supported), "
            f"got {_type_name(value)}",
            "prompt",
        )
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise RequestError(f"'stop' may hold at most {MAX_STOP} strings, got {len(items)}", "stop")
    if any(not s for s in items):
        raise RequestError("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise RequestError(f"'stop' strings must be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(dict.fromkeys(items))


def parse_completion(body: bytes | dict[str, Any], max_tokens_limit: int) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (raw bytes or already-parsed JSON)."""
    data = _load_json(body) if isinstance(body, bytes | bytearray) else body
    if not isinstance(data, dict):
        raise RequestError(f"request body must be a JSON object, got {_type_name(data)}")
    for key, value in data.items():
        if key in _FIELDS:
            continue
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key] or isinstance(value, bool) != isinstance(
                _NEUTRAL[key][0], bool
            ):
                raise RequestError(
                    f"'{key}' is not supported (only its default "
                    f"{json.dumps(_NEUTRAL[key][0])} is accepted)",
                    key,
                )
            continue
        name = key if len(key) <= 64 else key[:64] + "..."
        raise RequestError(f"unknown field {name!r} (supported: {', '.join(_FIELDS)})", name)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_type_name(model)}", "model")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"'user' must be a string, got {_type_name(user)}", "user")
    prompt = _prompt(data)
    max_tokens = _int(
        data, "max_tokens", min(DEFAULT_MAX_TOKENS, max_tokens_limit), 1, max_tokens_limit
    )
    temperature = _number(data, "temperature", 0.0)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _number(data, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    seed = _int(data, "seed", None, _SEED_MIN, _SEED_MAX)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=_stop(data),
        seed=seed,
        model=model,
    )


def bearer_ok(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (constant-time compare)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8"), key.encode("utf-8"))


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def app_args(args: Any, shape: type, label: str, error: type[Exception]) -> dict[str, Any]:
    """A Serve app's ``args`` as a dict: a mapping whose keys are fields of ``shape``.

    ``error`` (naming ``label``) reports anything else; the app checks the values."""
    if not isinstance(args, Mapping):
        raise error(f"{label} must be a mapping, got {type(args).__name__}")
    known = [f.name for f in fields(shape)]
    unknown = sorted(set(args) - set(known), key=str)
    if unknown:
        raise error(f"{label}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    return dict(args)


def check_common_args(
    out: Mapping[str, Any],
    ints: tuple[tuple[str, int, int], ...],
    bad: Callable[[str, str, Any], Exception],
) -> None:
    """The checks every app shares: integer ranges and ``api_key_env`` (``bad(key, why, value)``
    builds the app's error)."""
    for key, lo, hi in ints:
        value = out.get(key)
        if key in out and (
            isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi
        ):
            raise bad(key, f"must be an integer in [{lo}, {hi}]", value)
    if "api_key_env" in out and not _ENV_NAME.match(out["api_key_env"]):
        raise bad("api_key_env", "must be an environment variable name", out["api_key_env"])


def api_key_from_env(
    name: str, logger: logging.Logger | None = None, *, endpoint: str = "premium"
) -> str | None:
    """The API key in ``$name``, or None with one loud WARNING that the endpoint is open.

    ``endpoint`` names the app in that warning (``premium``, ``PAC ensemble``).
    """
    key = os.environ.get(name, "").strip()
    if key:
        return key
    (logger or logging.getLogger("privcode.serve")).warning(
        "privcode %s endpoint is UNAUTHENTICATED: $%s is not set, so anyone who can "
        "reach this endpoint can query the model. Set it (e.g. from a Kubernetes Secret) to "
        "require 'Authorization: Bearer <key>'.",
        endpoint,
        name,
    )
    return None


async def read_body_capped(request: Any) -> bytes:
    """The body of a Starlette request; :class:`RequestError` once it passes :data:`MAX_BODY_BYTES`."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(
            f"request body is {length} bytes, over the limit of {MAX_BODY_BYTES} bytes"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(f"request body is over the limit of {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- routing

#: route -> allowed methods.
ROUTES: dict[str, frozenset[str]] = {
    "/v1/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/healthz": frozenset({"GET"}),
}
_MODEL_ROUTE = "/v1/models/"


def route_path(scope: Mapping[str, Any]) -> str:
    """The request path below the app's route prefix (``root_path``), without a trailing slash."""
    path = scope.get("path") or "/"
    root = (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :] or "/"
    return path.rstrip("/") or "/"


Response = tuple[int, dict[str, Any], dict[str, str]]


def _error(exc: RequestError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    return exc.status, exc.body(), headers


class CompletionsAPI:
    """The OpenAI-compatible API over a model, independent of the HTTP server.

    ``model`` has ``name``, ``created``, ``max_tokens_limit`` and
    ``prepare(request)`` (validates against the model, e.g. the context
    length; raises :class:`RequestError`); ``generate(prepared)`` is an
    awaitable returning an object with ``text``, ``finish_reason``,
    ``prompt_tokens`` and ``completion_tokens`` (the Serve deployment passes
    its batched method). ``api_key``: required as ``Bearer`` on every route
    but ``/healthz`` when set.
    """

    def __init__(
        self,
        model: Any,
        generate: Callable[[Any], Awaitable[Any]],
        api_key: str | None,
        logger: logging.Logger | None = None,
    ):
        self.model, self.generate, self.api_key = model, generate, api_key or None
        self.log = logger or logging.getLogger("privcode.serve")

    async def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> Response:
        """(status, JSON body, extra headers) for one request; never raises for bad input."""
        try:
            return await self._handle(method.upper(), path, headers, read_body)
        except RequestError as exc:
            return _error(exc)

    async def _handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> Response:
        if (
            path != "/healthz"
            and self.api_key is not None
            and not bearer_ok(headers.get("authorization"), self.api_key)
        ):
            raise RequestError(
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                status=401,
                code="invalid_api_key",
            )
        allowed = ROUTES.get(path)
        if allowed is None and path.startswith(_MODEL_ROUTE):
            allowed = frozenset({"GET"})
        if allowed is None:
            raise RequestError(
                f"no route {path[:200]!r} (routes: {', '.join(ROUTES)})",
                status=404,
                code="not_found",
            )
        if method not in allowed:
            status, body, _ = _error(
                RequestError(
                    f"method {method} not allowed on {path} (use {', '.join(sorted(allowed))})",
                    status=405,
                    code="method_not_allowed",
                )
            )
            return status, body, {"Allow": ", ".join(sorted(allowed))}
        if path == "/healthz":
            return 200, {"status": "ok"}, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [self._model_card()]}, {}
        if path.startswith(_MODEL_ROUTE):
            if path[len(_MODEL_ROUTE) :] != self.model.name:
                raise RequestError(
                    f"model not found (this endpoint serves {self.model.name!r})",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            return 200, self._model_card(), {}
        return await self._complete(await read_body())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "privcode",
        }

    async def _complete(self, body: bytes) -> Response:
        start = time.perf_counter()
        request = parse_completion(body, self.model.max_tokens_limit)
        if request.model is not None and request.model != self.model.name:
            raise RequestError(
                f"model not found (this endpoint serves {self.model.name!r})",
                "model",
                status=404,
                code="model_not_found",
            )
        prepared = self.model.prepare(request)
        result = await self.generate(prepared)
        # Sizes and latency only: prompts and completions can be private.
        self.log.info(
            "completion: prompt_tokens=%d completion_tokens=%d finish=%s "
            "sampled=%s latency_ms=%.1f",
            result.prompt_tokens,
            result.completion_tokens,
            result.finish_reason,
            not request.greedy,
            1000 * (time.perf_counter() - start),
        )
        return (
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model.name,
                "choices": [
                    {
                        "index": 0,
                        "text": result.text,
                        "logprobs": None,
                        "finish_reason": result.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "total_tokens": result.prompt_tokens + result.completion_tokens,
                },
            },
            {},
        )
