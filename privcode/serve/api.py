"""The typed HTTP API both serving apps share: pydantic models, error bodies, the FastAPI app.

:func:`completion_model` builds an app's request model for ``POST /v1/completions`` (OpenAI
legacy completions) with that app's limits, so its ``/openapi.json`` states them
(``temperature``: 0 for greedy, else in [:data:`MIN_TEMPERATURE`, :data:`MAX_TEMPERATURE`]: a
smaller one overflows the softmax); standard fields sent at their neutral value are accepted
only at that value, any other field is refused, and types are strict.
:mod:`privcode.serve.chat` builds ``POST /v1/chat/completions``' body the same way.
:func:`new_api` makes an app's FastAPI object (``/healthz``, ``/v1/models[/{id}]``) whose
handlers turn every refusal into an OpenAI error body naming the field and the limit, never the
value sent (a prompt can be private); an unexpected exception is a 500 logged by its type only.
The routes run behind :class:`privcode.serve.guard.GuardMiddleware` (keys, rate limit, body
cap). Fields and limits: docs/serving.md, "privcode/serve/api.py".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
    field_validator,
)

from privcode.errors import PrivcodeError
from privcode.serve.guard import GuardMiddleware, KeyRing, RateLimiter, error_body

__all__ = [
    "post_generation_routes",
    "DEFAULT_MAX_TOKENS",
    "ERRORS",
    "MAX_LOGPROBS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "Choice",
    "CompletionBody",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "Limits",
    "ModelCard",
    "ModelList",
    "RequestError",
    "SamplingBody",
    "StreamOptions",
    "Usage",
    "completion_model",
    "fit_context",
    "new_api",
    "sampling_request",
    "to_request",
]

DEFAULT_MAX_TOKENS = 128
#: Most alternatives per token a legacy completion may ask for (``logprobs``), as OpenAI's.
MAX_LOGPROBS = 5
MAX_STOP = 16
MAX_STOP_CHARS = 256
#: Sampling temperatures: 0 (greedy) or in [MIN, MAX]. Logits / 1e-300 are inf: NaN softmax.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.manual_seed accepts


class RequestError(PrivcodeError, ValueError):
    """A request the API refuses: HTTP ``status`` with an OpenAI-style error naming ``param``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code, self.headers = type, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, type=self.type, code=self.code)


# --------------------------------------------------------------------------- models


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number here")
    return value


#: Fields accepted only at OpenAI's neutral value (``true`` is not 1 here).
NeutralOne = Annotated[Literal[1] | None, BeforeValidator(_not_bool)]
NeutralZero = Annotated[Literal[0] | None, BeforeValidator(_not_bool)]


_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
#: One stop string: non-empty, at most MAX_STOP_CHARS characters.
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (no choices)."""

    model_config = _STRICT

    include_usage: bool | None = Field(None, description="End the stream with the usage.")


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 8.0 (and clients send it); 8.5, "8" and true are not."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**64:
        return int(value)
    return _not_bool(value)


class SamplingBody(BaseModel):
    """What both generation routes accept besides their input (the prompt, or the messages)."""

    model_config = _STRICT

    model: str | None = Field(None, max_length=256, description="The served model's id.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: Annotated[
        float | None,
        WithJsonSchema(  # {0} or [MIN, MAX]: what the validator below enforces
            {
                "anyOf": [
                    {"type": "number", "minimum": 0, "maximum": 0},
                    {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": MAX_TEMPERATURE},
                    {"type": "null"},
                ],
                "description": f"0 (greedy, the default) or in [{MIN_TEMPERATURE}, "
                f"{MAX_TEMPERATURE}].",
            }
        ),
    ] = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus mass, (0, 1].")
    stop: _Stop | list[_Stop] | None = Field(
        None,
        max_length=MAX_STOP,
        description=f"Up to {MAX_STOP} strings that end the completion.",
    )
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX, description="Sampling seed.")
    user: str | None = Field(None, max_length=256, description="Accepted, not used.")
    n: int | None = Field(None, ge=1, le=1, description="Completions to return.")
    stream: bool | None = Field(None, description="Server-sent events, OpenAI's chunks.")
    stream_options: StreamOptions | None = Field(None, description="Ignored unless streaming.")
    presence_penalty: NeutralZero = None
    frequency_penalty: NeutralZero = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0)

    @field_validator("max_tokens", "seed", "n", mode="before")
    @classmethod
    def _ints(cls, value: Any) -> Any:
        return _integral(value)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return _not_bool(value)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller ones overflow)"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"may hold at most {MAX_STOP} strings, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"strings must be at most {MAX_STOP_CHARS} characters")
        return value


class CompletionBody(SamplingBody):
    """``POST /v1/completions`` (OpenAI legacy completions); :func:`completion_model` sets limits."""

    prompt: str | list[str] = Field(description="The prompt (or a list of exactly one).")
    best_of: NeutralOne = None
    echo: Literal[False] | None = None
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"Log-probabilities of the chosen and the 0..{MAX_LOGPROBS} likeliest tokens.",
    )
    suffix: Literal[""] | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, value: Any) -> Any:
        return _integral(value)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(
                f"as a list must hold exactly one string (batched prompts are not supported), "
                f"got {len(value)} items"
            )
        return value


def limit_fields(max_tokens_limit: int, max_n: int) -> dict[str, Any]:
    """The ``max_tokens`` and ``n`` fields at an app's limits (for :func:`create_model`)."""
    return {
        "max_tokens": (
            int | None,
            Field(
                None,
                ge=1,
                le=max_tokens_limit,
                description=f"Most tokens to generate (1..{max_tokens_limit}; "
                f"default {min(DEFAULT_MAX_TOKENS, max_tokens_limit)}).",
            ),
        ),
        "n": (
            int | None,
            Field(None, ge=1, le=max_n, description=f"Completions to return (1..{max_n})."),
        ),
    }


def completion_model(
    max_tokens_limit: int,
    max_prompt_chars: int,
    *,
    name: str = "CompletionRequest",
    base: type[CompletionBody] = CompletionBody,
    max_n: int = 1,
) -> type[CompletionBody]:
    """``base`` with this app's limits on ``max_tokens``, ``n`` and the prompt's length."""
    prompt: Any = Annotated[str, Field(max_length=max_prompt_chars)]
    one: Any = Annotated[list[prompt], Field(min_length=1, max_length=1)]
    return create_model(
        name,
        __base__=base,
        prompt=(
            prompt | one,
            Field(description=f"The prompt (at most {max_prompt_chars} characters)."),
        ),
        **limit_fields(max_tokens_limit, max_n),
    )


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
    n: int = 1
    #: Alternatives per token to report (0: the chosen token's only); None: no log-probs.
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False  #: a streamed answer ends with a usage chunk

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def choice_seed(self, index: int) -> int | None:
        """Choice ``index``'s seed: the request's plus ``index`` (each choice its own draw)."""
        return None if self.seed is None else self.seed + index


def sampling_request(
    body: SamplingBody, max_tokens_limit: int, prompt: str, logprobs: int | None
) -> CompletionRequest:
    """A validated body's request for ``prompt`` (a completion's, or a chat's rendered
    messages), defaults filled in; ``logprobs``: alternatives per token, None for none."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    options = body.stream_options
    return CompletionRequest(
        prompt=prompt,
        max_tokens=body.max_tokens or min(DEFAULT_MAX_TOKENS, max_tokens_limit),
        temperature=body.temperature or 0.0,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=tuple(dict.fromkeys(stop)),
        seed=body.seed,
        model=body.model,
        n=body.n or 1,
        logprobs=logprobs,
        stream=bool(body.stream),
        include_usage=bool(options and options.include_usage),
    )


def to_request(body: CompletionBody, max_tokens_limit: int) -> CompletionRequest:
    """The validated completion body with defaults filled in."""
    prompt = body.prompt[0] if isinstance(body.prompt, list) else body.prompt
    return sampling_request(body, max_tokens_limit, prompt, body.logprobs)


class Choice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "privcode"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"


#: The error answers every route may give (for the OpenAPI schema).
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in (
        (400, "a field is invalid (named in error.param)"),
        (401, "missing or invalid API key"),
        (404, "no such route, model or session"),
        (413, "request body over the limit"),
        (429, "rate limit, session cap or privacy budget exhausted (error.code)"),
    )
}


# --------------------------------------------------------------------------- the app


@dataclass(frozen=True)
class Limits:
    """What an app's guard enforces (the ``serve`` config section's values)."""

    keys: KeyRing
    rate_limit_rps: float
    rate_limit_burst: int
    max_body_bytes: int
    #: The buckets (``rate``, ``burst``, ``take``): the app's shared ones in a Serve replica
    #: (:mod:`privcode.serve.rate_limit`); None: a :class:`RateLimiter` of this process.
    limiter: Any = None


def _param(loc: tuple[Any, ...]) -> str | None:
    """The top-level field of a validation error's location (``("body", "stop", 2)``)."""
    rest = [p for p in loc if p != "body"]
    return str(rest[0])[:64] if rest else None


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """A pydantic/FastAPI validation failure as a 400 naming the field (never its value)."""
    first = errors[0] if errors else {"loc": (), "type": "", "msg": "invalid"}
    # A union (a string, or a list of them) reports one error per member: the deepest one
    # says what is wrong (an empty string in the list, not "not a string").
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == _param(tuple(first["loc"]))]
    first = max(same or [first], key=lambda e: len(tuple(e.get("loc", ()))))
    kind, param = first.get("type", ""), _param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return RequestError("request body is not valid JSON")
    if param is None:
        if kind == "missing":
            return RequestError("request body is required (a JSON object)")
        return RequestError("request body must be a JSON object")
    if kind == "extra_forbidden":
        return RequestError(f"unknown field '{param}'", param)
    if kind == "missing":
        return RequestError(f"'{param}' is required", param)
    msg = str(first.get("msg", "is invalid")).removeprefix("Value error, ")
    if kind.startswith("literal_") and param != "messages":
        msg = "is not supported (only its neutral default is accepted)"
    return RequestError(f"'{param}': {msg}", param)


def post_generation_routes(
    api: Any,
    completions: Callable[..., Any],
    chat: Callable[..., Any],
    *,
    bodies: tuple[type, type],
    responses: tuple[type, type],
) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions`` on ``api``: ``completions`` and
    ``chat`` take ``bodies`` (their request models) and answer ``responses`` as JSON, or
    server-sent events when streamed."""
    # The bodies' models are built at run time, so the annotations cannot be strings (PEP 563).
    completions.__annotations__["body"], chat.__annotations__["body"] = bodies
    streamed = {200: {"content": {"text/event-stream": {}}}}
    routes = (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"))
    for (path, tag), handler, response in zip(routes, (completions, chat), responses, strict=True):
        api.post(path, response_model=response, responses={**ERRORS, **streamed}, tags=[tag])(
            handler
        )


def new_api(
    title: str,
    description: str,
    limits: Limits,
    model_card: Callable[[], dict[str, Any]],
    logger: logging.Logger,
) -> Any:
    """A FastAPI app with the shared routes, error handlers and the guard in front."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.routing import APIRoute
    from starlette.exceptions import HTTPException

    class SafeRoute(APIRoute):
        """A route whose unexpected exception is a 500 logged by type only (no request data)."""

        def get_route_handler(self) -> Callable[..., Any]:
            handler = super().get_route_handler()

            async def safe(request: Request) -> Any:
                try:
                    return await handler(request)
                except Exception as exc:  # noqa: BLE001 - its message may hold request data
                    handled = [c for c in request.app.exception_handlers if isinstance(c, type)]
                    if any(isinstance(exc, c) for c in handled if c is not Exception):
                        raise  # an app's own refusal (RequestError, a 404, ...): its handler

                    logger.error("request failed: %s", type(exc).__name__)
                    return JSONResponse(
                        error_body("internal error while generating", type="server_error"),
                        status_code=500,
                    )

            return safe

    api = FastAPI(
        title=title,
        description=description,
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    api.router.route_class = SafeRoute

    @api.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        return JSONResponse(exc.body(), status_code=exc.status, headers={**headers, **exc.headers})

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @api.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {
            404: "no such route (see /openapi.json)",
            405: f"method {request.method} not allowed here",
        }.get(exc.status_code, "request refused")
        return JSONResponse(
            error_body(message, code=code), status_code=exc.status_code, headers=exc.headers
        )

    @api.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models", response_model=ModelList, responses=ERRORS, tags=["models"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id}", response_model=ModelCard, responses=ERRORS, tags=["models"])
    async def model(model_id: str) -> dict[str, Any]:
        card = model_card()
        if model_id != card["id"]:
            raise RequestError(
                f"model not found (this endpoint serves {card['id']!r})",
                "model",
                status=404,
                code="model_not_found",
            )
        return card

    api.add_middleware(
        GuardMiddleware,
        keys=limits.keys,
        limiter=limits.limiter or RateLimiter(limits.rate_limit_rps, limits.rate_limit_burst),
        max_body_bytes=limits.max_body_bytes,
    )
    return api


def fit_context(
    request: CompletionRequest,
    max_prompt_chars: int,
    encode: Callable[[str], Sequence[int]],
    context: int,
) -> tuple[int, ...]:
    """The prompt's token ids, once it is known to fit: at most ``max_prompt_chars`` characters
    (checked before tokenising: bounded work), then prompt + ``max_tokens`` within ``context``
    tokens. :class:`RequestError` names the field to change."""
    if len(request.prompt) > max_prompt_chars:
        raise RequestError(
            f"'prompt' is {len(request.prompt)} characters, over the limit of {max_prompt_chars}",
            "prompt",
        )
    ids = tuple(encode(request.prompt))
    if len(ids) >= context:
        raise RequestError(
            f"'prompt' is {len(ids)} tokens; this model's context is {context} tokens", "prompt"
        )
    if len(ids) + request.max_tokens > context:
        raise RequestError(
            f"this model's context is {context} tokens, but {len(ids) + request.max_tokens} "
            f"were requested ({len(ids)} in the prompt, {request.max_tokens} for the "
            "completion): lower 'max_tokens'",
            "max_tokens",
        )
    return ids


def check_model(request: CompletionRequest, name: str) -> None:
    """404 when the request names another model than the one served."""
    if request.model is not None and request.model != name:
        raise RequestError(
            f"model not found (this endpoint serves {name!r})",
            "model",
            status=404,
            code="model_not_found",
        )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_completion(
    body: bytes | dict[str, Any],
    max_tokens_limit: int,
    max_prompt_chars: int = 1 << 20,
    *,
    base: type[CompletionBody] = CompletionBody,
) -> CompletionRequest:
    """A completion body (raw JSON bytes or parsed) validated as the HTTP route validates it;
    :class:`RequestError` names the field. For callers without HTTP (tests, scripts)."""

    from pydantic import ValidationError

    data: Any = body
    if isinstance(body, bytes | bytearray):
        try:
            data = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise RequestError("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        parsed = completion_model(max_tokens_limit, max_prompt_chars, base=base).model_validate(
            data
        )
    except ValidationError as exc:
        raise _validation_error(list(exc.errors())) from None
    return to_request(parsed, max_tokens_limit)
