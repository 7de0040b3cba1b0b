"""OpenAI's answer shapes for both apps: ``text_completion`` and ``chat.completion``, whole or
as stream chunks, with their log-probabilities.

One :class:`AnswerFormat` per request (one id and ``created`` for the answer or all its
chunks), in the shapes of OpenAI's API reference: completions, chat, and their stream chunks
(a final usage chunk with ``include_usage``). Token strings are each token decoded alone (a
token inside a multi-byte character decodes to U+FFFD; ``bytes`` is then that string's UTF-8,
not the token's raw bytes). The shapes field by field: docs/serving.md,
"privcode/serve/formats.py".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "AnswerFormat"]

_KINDS = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}


@dataclass(frozen=True)
class Answer:
    """One choice: its text, why it ended, its token count (EOS included) and, when asked for,
    its tokens' log-probabilities (objects with ``token``, ``logprob``, ``top``: (id, lp)s)."""

    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: Sequence[Any] | None = None
    #: Fields the app adds to the choice's last stream chunk (the PAC app's accounting).
    extra: Mapping[str, Any] | None = None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class AnswerFormat:
    """The body, chunks and log-probs of one request's answer (``kind``: see the module doc)."""

    def __init__(self, kind: str, model: str, tokenizer: Any = None, *, include_usage=False):
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {', '.join(_KINDS)}, got {kind!r}")
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.chat = kind == "chat.completion"
        self.id = f"{_KINDS[kind]}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- whole answers

    def body(self, answers: Sequence[Answer], prompt_tokens: int) -> dict[str, Any]:
        """The answer: one choice per item of ``answers``, usage summed over them."""
        choices = []
        for i, a in enumerate(answers):
            lp = None if a.logprobs is None else self.logprobs(a.logprobs)
            if self.chat:
                message = {"role": "assistant", "content": a.text}
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": a.finish_reason,
                    }
                )
            else:
                choices.append(
                    {"index": i, "text": a.text, "logprobs": lp, "finish_reason": a.finish_reason}
                )
        used = sum(a.completion_tokens for a in answers)
        return {**self._head(self.kind), "choices": choices, "usage": _usage(prompt_tokens, used)}

    def _token(self, token: int | str) -> str:
        """A token id decoded alone; a string is already a token's text (an engine's)."""
        if isinstance(token, str):
            return token
        return self.tokenizer.decode([int(token)], skip_special_tokens=False)

    def logprobs(self, records: Sequence[Any]) -> dict[str, Any]:
        """``records`` (one per generated token) in this kind's log-probs shape."""
        if self.chat:
            content = []
            for r in records:
                text = self._token(r.token)
                tops = [
                    {"token": (t := self._token(i)), "logprob": lp, "bytes": list(t.encode())}
                    for i, lp in r.top
                ]
                content.append(
                    {
                        "token": text,
                        "logprob": r.logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": tops,
                    }
                )
            return {"content": content, "refusal": None}
        tokens = [self._token(r.token) for r in records]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self._token(i): lp for i, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    # -- chunks

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head("chat.completion.chunk" if self.chat else "text_completion")}
        chunk["choices"] = choices
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self, index: int) -> dict[str, Any] | None:
        """A choice's first chunk (chat: the assistant role), or None (completions)."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def delta(self, index: int, text: str, finish: str | None = None) -> dict[str, Any]:
        """A chunk of choice ``index``: new ``text``; ``finish`` on its last one."""
        if self.chat:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return self._chunk([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk with ``include_usage``: no choices, the usage."""
        return {**self._chunk([]), "usage": _usage(prompt_tokens, completion_tokens)}
