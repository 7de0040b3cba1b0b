"""Serve PAC-private generation (the m-world ensemble) as an OpenAI-compatible Ray Serve app.

``import_path: privcode.serve.ensemble:app`` with ``args`` (:class:`EnsembleArgs`; defaults:
the ``serve`` and ``pac`` config sections; ``worlds``, the pac stage's artifact, required).
Routes (a FastAPI ingress, an API key on all but ``/healthz``: :mod:`privcode.serve.guard`):
``/v1/sessions[/{id}]``, ``POST /v1/completions`` and ``/v1/chat/completions`` (answers add a
``privacy`` object; ``logprobs`` are refused), ``GET /v1/privacy``, ``/v1/models[/{id}]``,
``/healthz``. Private tokens are paid from ledger leases (:mod:`privcode.pac.leases`); a spent
session, key-share or deployment budget answers 429 or, with ``on_exhausted: fallback``, the
public base model's tokens (free, flagged).

Privacy assumptions (docs/methods.md, PAC-private generation): ONE replica (the curator's
secret and posterior live in it; :func:`build_app` refuses more, and a lock on the worlds'
state makes a second process wait and fail); the secret and posteriors never leave the server;
prompts, completions and session ids are never logged; budgets fail closed (a charge is
persisted before its token is released). Generation runs on one decode thread
(:mod:`privcode.serve.pac_scheduler`): requests of different sessions share each forward, and
the curator sees their steps one at a time, each session's in order.
Arguments and routes: docs/serving.md, "privcode/serve/ensemble.py".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve

from privcode.serve.api import (
    ERRORS,
    CompletionBody,
    CompletionResponse,
    Limits,
    RequestError,
    completion_model,
    new_api,
    post_generation_routes,
    to_request,
)
from privcode.serve.args import REPLICA_OPTIONS, as_args, guard_limits
from privcode.serve.chat import ChatBody, ChatResponse, chat_model, to_chat_request
from privcode.serve.pac_args import (
    DEFAULT_MODEL_NAME,
    EnsembleArgs,
    EnsembleError,
    new_curator,
    parse_args,
)
from privcode.serve.pac_service import PacService, _not_found_session

log = logging.getLogger("privcode.serve")

__all__ = [
    "DEFAULT_MODEL_NAME",
    "Ensemble",
    "EnsembleArgs",
    "EnsembleError",
    "PacService",
    "app",
    "build_api",
    "build_app",
    "new_curator",
    "parse_args",
]


# --------------------------------------------------------------------------- HTTP


_NO_LOGPROBS = (
    "is not supported by the PAC ensemble: it releases tokens only, and log-probabilities "
    "are not what its curator releases (they would reveal the worlds' votes)"
)


class _PacFields(BaseModel):
    """What both PAC bodies add or restrict: a session, top_p 1, no log-probabilities."""

    session: str | None = Field(
        None, min_length=1, max_length=128, description="A session id (POST /v1/sessions)."
    )
    top_p: float | None = Field(
        None,
        ge=1.0,
        le=1.0,
        description="Only 1: the candidates are the public model's top_k tokens.",
    )

    logprobs: None = Field(None, description="Not offered: the curator releases tokens only.")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value is not None and value is not False:
            raise ValueError(_NO_LOGPROBS)
        return None


class PacCompletionBody(_PacFields, CompletionBody):
    """``POST /v1/completions`` of the PAC ensemble: the OpenAI body plus a session."""


class PacChatBody(_PacFields, ChatBody):
    """``POST /v1/chat/completions`` of the PAC ensemble: the chat body plus a session."""


class SessionCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    budget_nats: float | None = Field(
        None, gt=0.0, description="This session's budget (capped at the session budget)."
    )


class PacSession(BaseModel):
    id: str
    object: Literal["pac.session"] = "pac.session"
    scope: str
    budget_nats: float
    charged_nats: float
    remaining_nats: float
    private_tokens: int
    free_tokens: int
    fallback_tokens: int
    per_token_budget_nats: float
    key_charged_nats: float
    key_remaining_nats: float
    idle_ttl_s: float
    deleted: bool | None = None


class PacUsage(BaseModel):
    session: str | None
    one_shot: bool
    decoder: Literal["greedy", "gumbel"]
    charged_nats: float
    private_tokens: int
    free_tokens: int
    fallback_tokens: int
    public_fallback: bool
    budget_exhausted: bool
    session_charged_nats: float
    remaining_nats: float
    key_remaining_nats: float
    per_token_budget_nats: float


class PacCompletionResponse(CompletionResponse):
    privacy: PacUsage


class PacChatResponse(ChatResponse):
    privacy: PacUsage


def build_api(service: PacService, limits: Limits, logger: logging.Logger | None = None) -> Any:
    """The PAC app's FastAPI object over ``service`` (no Ray needed: tests drive it)."""
    from privcode.pac.curator import UnknownSessionError
    from privcode.pac.ensemble import PacEnsembleError

    logger = logger or log
    cfg = service.cfg
    body_model = completion_model(
        cfg.max_tokens_limit,
        cfg.max_prompt_chars,
        name="PacCompletionRequest",
        base=PacCompletionBody,
    )
    chat_body = chat_model(
        cfg.max_tokens_limit, cfg.max_prompt_chars, name="PacChatRequest", base=PacChatBody
    )
    api = new_api(
        "privcode PAC ensemble",
        "PAC-private completions: m LoRA worlds vote per token; a curator charges b nats per "
        "non-unanimous token against per-session, per-key and deployment budgets.",
        limits,
        service.model_card,
        logger,
    )

    @api.exception_handler(PacEnsembleError)
    async def _ensemble_error(request: Request, exc: PacEnsembleError) -> Any:
        from fastapi.responses import JSONResponse

        err = RequestError(str(exc))  # request-shaped values only: no prompt text
        return JSONResponse(err.body(), status_code=err.status)

    @api.exception_handler(UnknownSessionError)
    async def _unknown_session(request: Request, exc: UnknownSessionError) -> Any:
        from fastapi.responses import JSONResponse

        # A session that expired (or was closed) while its request waited in the queue.
        err = _not_found_session()
        return JSONResponse(err.body(), status_code=err.status)

    def principal(request: Request) -> str:
        return request.state.principal

    @api.post("/v1/sessions", response_model=PacSession, responses=ERRORS, tags=["sessions"])
    async def open_session(request: Request, body: SessionCreate | None = None) -> dict[str, Any]:
        return await service.open_session(principal(request), body.budget_nats if body else None)

    @api.get("/v1/sessions/{sid}", response_model=PacSession, responses=ERRORS, tags=["sessions"])
    async def get_session(request: Request, sid: str) -> dict[str, Any]:
        return await service.session(principal(request), sid)

    @api.delete(
        "/v1/sessions/{sid}", response_model=PacSession, responses=ERRORS, tags=["sessions"]
    )
    async def delete_session(request: Request, sid: str) -> dict[str, Any]:
        return await service.close_session(principal(request), sid)

    @api.get("/v1/privacy", responses=ERRORS, tags=["privacy"])
    async def privacy(request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(service.privacy, principal(request))

    async def completions(request: Request, body: body_model) -> Any:  # type: ignore[valid-type]
        req = to_request(body, cfg.max_tokens_limit)
        return _respond(await service.complete(principal(request), req, body.session))

    async def chat(request: Request, body: chat_body) -> Any:  # type: ignore[valid-type]
        req = to_chat_request(body, cfg.max_tokens_limit, service.chat_prompt)
        kind = "chat.completion"
        return _respond(await service.complete(principal(request), req, body.session, kind))

    post_generation_routes(
        api,
        completions,
        chat,
        bodies=(body_model, chat_body),
        responses=(PacCompletionResponse, PacChatResponse),
    )

    return api


def _respond(answer: Any) -> Any:
    """A body as it is, or a stream of server-sent events as a streaming response."""
    if isinstance(answer, dict):
        return answer
    from fastapi.responses import StreamingResponse

    return StreamingResponse(answer, media_type="text/event-stream")


# --------------------------------------------------------------------------- Ray Serve

_serve_log = logging.getLogger("ray.serve")


# num_replicas is 1 by design (see the module docstring): build_app refuses more.
@serve.deployment(name="Ensemble", max_ongoing_requests=64, **REPLICA_OPTIONS)
@serve.ingress()
class Ensemble:
    """Ray Serve deployment: :func:`build_api` over :class:`PacService`, in ONE replica."""

    def __init__(self, args: dict[str, Any]):
        cfg = parse_args(args)
        self.limits = guard_limits(cfg, EnsembleError)
        self.service = PacService.load(cfg, logger=_serve_log)
        try:
            from privcode.serve.metrics import PacMetrics

            self.service.metrics = PacMetrics(cfg.served_model_name)
            self.service.metrics.update(None, self.service.curator.deployment_info())
        except Exception as exc:  # noqa: BLE001 - metrics are optional; the curator is not
            _serve_log.warning("PAC ensemble: metrics unavailable (%s)", type(exc).__name__)

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.service, self.limits, _serve_log)

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


def build_app(args: Mapping[str, Any], **deployment_options: Any) -> serve.Application:
    """The app for ``args``; ``deployment_options`` go to ``Ensemble.options`` (one replica only)."""
    cfg = parse_args(args)
    if (
        deployment_options.get("num_replicas", 1) != 1
        or deployment_options.get("autoscaling_config") is not None
    ):
        raise EnsembleError(
            "the PAC ensemble runs as exactly one replica (num_replicas=1, no "
            "autoscaling): the curator's secret and posterior live in it"
        )
    return Ensemble.options(**deployment_options).bind(as_args(cfg))


def app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / serveConfigV2: ``import_path: privcode.serve.ensemble:app``."""
    return build_app(args)
