"""``POST /v1/chat/completions``' body for both apps: pydantic models, limits, the request.

:class:`ChatBody` is OpenAI's chat request as far as a code model can honour it:
``messages`` (1..:data:`MAX_MESSAGES` of ``system`` / ``developer`` (a system turn) / ``user``
/ ``assistant``, text content: a string or text parts), ``max_tokens`` and/or
``max_completion_tokens`` (the smaller counts), ``temperature``, ``top_p``, ``stop``, ``seed``, ``n``, ``stream``
with ``stream_options``, ``logprobs`` with ``top_logprobs`` (0..:data:`MAX_TOP_LOGPROBS`; ignored without it),
``user``; penalties and ``logit_bias`` only at their neutral value; anything else (tools,
images, response formats) is refused by name. :func:`chat_model` sets an app's limits, as
:func:`privcode.serve.api.completion_model` does. :func:`to_chat_request` renders the messages
with the served artifact's chat template (:mod:`privcode.models.chat`, through the app's
``render``) into the one :class:`~privcode.serve.api.CompletionRequest` both routes share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator

from privcode.serve.api import (
    _STRICT,
    CompletionRequest,
    RequestError,
    SamplingBody,
    Usage,
    _integral,
    limit_fields,
    sampling_request,
)

__all__ = [
    "MAX_MESSAGES",
    "MAX_TOP_LOGPROBS",
    "ChatBody",
    "ChatResponse",
    "chat_model",
    "to_chat_request",
]

MAX_MESSAGES = 64
#: Most alternatives per token (``top_logprobs``), as OpenAI's chat API.
MAX_TOP_LOGPROBS = 20


class TextPart(BaseModel):
    """A content part: text only (no images, audio or files)."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn; ``developer`` is OpenAI's newer name of ``system``."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or a list of text parts.")
    name: str | None = Field(None, max_length=64, description="Accepted, not used.")

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class ChatBody(SamplingBody):
    """``POST /v1/chat/completions``; :func:`chat_model` sets the limits (see the module doc)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (OpenAI's newer name)."
    )
    logprobs: bool | None = Field(None, description="Return the chosen tokens' log-probs.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Likeliest alternatives per token."
    )

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _more_ints(cls, value: Any) -> Any:
        return _integral(value)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"]


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def chat_model(
    max_tokens_limit: int,
    max_prompt_chars: int,
    *,
    name: str = "ChatRequest",
    base: type[ChatBody] = ChatBody,
    max_n: int = 1,
) -> type[ChatBody]:
    """``base`` with this app's limits: ``max_tokens`` (and ``max_completion_tokens``), ``n``,
    and each message's length (the rendered prompt is checked again, whole)."""
    content: Any = Annotated[str, Field(max_length=max_prompt_chars)]
    part: Any = create_model(
        f"{name}TextPart", __base__=TextPart, text=(content, Field(description="Text."))
    )
    message: Any = create_model(
        f"{name}Message",
        __base__=ChatMessage,
        content=(content | list[part], Field(description="Text, or a list of text parts.")),
    )
    fields = limit_fields(max_tokens_limit, max_n)
    return create_model(
        name,
        __base__=base,
        messages=(list[message], Field(min_length=1, max_length=MAX_MESSAGES)),
        max_completion_tokens=fields["max_tokens"],
        **fields,
    )


def to_chat_request(
    body: ChatBody,
    max_tokens_limit: int,
    render: Callable[[Sequence[Mapping[str, str]]], str],
) -> CompletionRequest:
    """The request ``body`` asks for: its messages rendered by ``render`` (the artifact's chat
    template); :class:`RequestError` names a field that cannot be honoured."""
    given = [t for t in (body.max_tokens, body.max_completion_tokens) if t is not None]
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        prompt = render(messages)
    except ValueError as exc:
        raise RequestError(f"'messages': {exc}", "messages") from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request = sampling_request(body, max_tokens_limit, prompt, logprobs)
    return dataclasses.replace(request, max_tokens=min(given, default=request.max_tokens))
