"""Streaming for both apps: tokens from a generating thread to the client as server-sent events.

:class:`TokenSink` hands one completion's tokens from the generating thread (``put``) to the
request's event loop (``get``); ``cancel`` (the client went away) makes the next ``put`` answer
False, which stops that row; a ``lockstep`` sink (the PAC app's: every token is charged) lets
``put`` return only once the previous token went out, so a client that leaves was sent every
token it was charged for but the one in flight. :class:`TextStream` sends a text delta only
once it cannot change (no incomplete UTF-8 sequence, no possible stop-string start), so the
deltas joined equal the non-streamed text. :func:`sse`, :data:`DONE`: OpenAI's event framing.
Streams carry what the non-streamed answer carries, no more. Details: docs/serving.md,
"privcode/serve/streaming.py".
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from privcode.serve.formats import Answer, AnswerFormat
from privcode.serve.guard import error_body

__all__ = ["DONE", "TextStream", "TokenSink", "answer_events", "sse"]

log = logging.getLogger("privcode.serve")

DONE = b"data: [DONE]\n\n"
_END = object()


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class TokenSink:
    """Tokens of one completion from a worker thread to an event loop; see the module doc."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, *, lockstep=False):
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._credit = threading.Semaphore(1) if lockstep else None
        self._held = False  # a credit taken by ready(), for the next put

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """The client is gone: the next :meth:`put` answers False (decoding stops there)."""
        self._cancelled.set()

    def put(self, token: int | str) -> bool:
        """Hand ``token`` over (from any thread; lockstep: once the last one was sent); False
        once cancelled."""
        if self._held:
            self._held = False
        elif self._credit is not None:
            while not self._credit.acquire(timeout=0.05):
                if self._cancelled.is_set():
                    return False
        if self._cancelled.is_set():
            return False
        self.loop.call_soon_threadsafe(self.queue.put_nowait, token)
        return True

    def ready(self) -> bool:
        """Whether :meth:`put` would go on at once (lockstep: the last token went out); a
        decode loop serving many sinks asks before it charges the next token, and the
        credit is held for that ``put``. Call it from the thread that puts."""
        if self._credit is None or self._held:
            return True
        self._held = self._credit.acquire(blocking=False)
        return self._held

    def sent(self) -> None:
        """The last token's chunk went out (lockstep: the next ``put`` may go on)."""
        if self._credit is not None:
            self._credit.release()

    def close(self) -> None:
        """No more tokens (from any thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _END)

    def put_now(self, token: int | str) -> bool:
        """:meth:`put` from the sink's own event loop (an engine streaming in it)."""
        if self._cancelled.is_set():
            return False
        self.queue.put_nowait(token)
        return True

    async def get(self) -> int | str | None:
        """The next token (or final text), or None once closed."""
        item = await self.queue.get()
        return None if item is _END else item


class TextStream:
    """Text deltas of a completion's tokens: see the module doc.

    ``eos``: token ids that end the text (never decoded); ``stops``: the request's stop
    strings (the text ends before the first one). Decoding re-reads the whole completion each
    token (bounded by the app's ``max_tokens_limit``), so byte-level merges across tokens
    come out as the final decode has them."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), eos: Sequence[int] = ()):
        self.tokenizer, self.stops, self.eos = tokenizer, tuple(stops), frozenset(eos)
        self.tokens: list[int] = []
        self.sent = ""
        self.ended = False

    def _held(self, text: str) -> int:
        """How many trailing characters of ``text`` could still begin a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def push(self, token: int | str) -> str:
        """The new text that ``token`` makes final ('' when none, or after the end); a string
        is text an engine already made final (vLLM's deltas: its stops applied)."""
        if self.ended:
            return ""
        if isinstance(token, str):
            return self._advance(self.sent + token)
        if token in self.eos:
            self.ended = True
            return ""
        self.tokens.append(int(token))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [pos for pos in (text.find(s) for s in self.stops) if pos >= 0]
        if hits:
            self.ended = True
            safe = text[: min(hits)]
        else:
            safe = text.rstrip("\ufffd")
            safe = safe[: len(safe) - self._held(safe)]
        return self._advance(safe)

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, text: str) -> str:
        """The rest of the final ``text`` (what the non-streamed answer holds)."""
        self.ended = True
        return self._advance(text)


async def _pump(index: int, sink: TokenSink, merged: asyncio.Queue[Any]) -> None:
    while (token := await sink.get()) is not None:
        merged.put_nowait((index, token))
    merged.put_nowait((index, None))


def _failure(exc: BaseException) -> bytes:
    body = getattr(exc, "body", None)
    if callable(body):  # a RequestError: its OpenAI error body names no input
        return sse(body())
    log.error("stream failed: %s", type(exc).__name__)
    return sse(error_body("internal error while generating", type="server_error"))


async def answer_events(
    fmt: AnswerFormat,
    choices: Sequence[tuple[TokenSink, Awaitable[Answer], TextStream]],
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """The server-sent events of one request: ``choices`` are (sink, its answer, its text
    stream) per choice; see the module doc. Each sink is closed when its answer is done."""
    tasks = []
    for sink, answer, _ in choices:
        task = asyncio.ensure_future(answer)
        task.add_done_callback(lambda _t, s=sink: s.close())
        tasks.append(task)
    merged: asyncio.Queue[Any] = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, c[0], merged)) for i, c in enumerate(choices)]
    try:
        for i in range(len(choices)):
            if (first := fmt.start(i)) is not None:
                yield sse(first)
        left, used = len(choices), 0
        while left:
            i, token = await merged.get()
            text = choices[i][2]
            if token is not None:
                if delta := text.push(token):
                    yield sse(fmt.delta(i, delta))
                choices[i][0].sent()
                continue
            left -= 1
            done = await tasks[i]
            used += done.completion_tokens
            last = fmt.delta(i, text.finish(done.text), done.finish_reason)
            if done.logprobs is not None:  # the choice's log-probs, all on its last chunk
                last["choices"][0]["logprobs"] = fmt.logprobs(done.logprobs)
            yield sse({**last, **(done.extra or {})})
        if fmt.include_usage:
            yield sse(fmt.usage(prompt_tokens, used))
        yield DONE
    except Exception as exc:  # noqa: BLE001 - the status is sent: an error event instead
        yield _failure(exc)
    finally:
        for sink, _, _ in choices:
            sink.cancel()
        for pump in pumps:
            pump.cancel()
        for task in tasks:  # a choice still decoding ends at its next token: nobody awaits it
            task.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failure after the client left is not logged as lost
