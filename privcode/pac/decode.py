"""One PAC-private completion between its steps: :class:`PacDecode`.

The per-token loop of :meth:`privcode.pac.ensemble.PacEnsemble.generate`, cut at the forward:
a decode holds the request (validated once), the released tokens and the next forward's input
(:attr:`PacDecode.feed`); whoever runs the forward hands its log-probs to
:meth:`PacDecode.advance`, which makes ONE release: the worlds' votes
(:func:`privcode.pac.mechanism.world_votes`; coupled Gumbel draws are public randomness, never
the curator's), then the curator's candidate (free at unanimity, ``b`` nats otherwise) or, with
a budget spent, the PUBLIC row's choice (free). EOS, a stop string or ``max_tokens`` end it.
So one forward may serve many decodes (:class:`privcode.models.kv_batch.KvBatch`) while each
session's curator sees its own steps in order. Steps: docs/serving.md, "privcode/pac/decode.py".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from privcode.pac.ensemble import PacCompletion, PacEnsembleError
from privcode.pac.mechanism import world_votes

log = logging.getLogger("privcode.pac")

__all__ = ["DECODERS", "PacDecode"]

DECODERS = ("greedy", "gumbel")


def _check(max_tokens: Any, decoder: str, temperature: Any, on_exhausted: str, stop: Any):
    if on_exhausted not in ("fallback", "stop"):
        raise PacEnsembleError(f"on_exhausted must be fallback or stop, got {on_exhausted!r}")
    if decoder not in DECODERS:
        raise PacEnsembleError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise PacEnsembleError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise PacEnsembleError(f"temperature must be a finite number > 0, got {temperature!r}")
    stop = tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise PacEnsembleError("stop must be a sequence of non-empty strings")
    return stop


class PacDecode:
    """One completion of ``prompt`` in session ``session_id`` of ``curator`` (see the module
    docstring); the arguments are :meth:`PacEnsemble.generate`'s, validated here, before any
    compute (an unknown session, a prompt past the context: :class:`PacEnsembleError`)."""

    def __init__(
        self,
        ensemble: Any,
        curator: Any,
        session_id: str,
        prompt: str,
        max_tokens: int,
        *,
        decoder: str = "greedy",
        temperature: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        on_exhausted: str = "fallback",
        sink: Any = None,
    ):
        if getattr(curator, "m", None) != ensemble.m:
            raise PacEnsembleError(
                f"the curator has m={getattr(curator, 'm', None)!r} worlds, this ensemble "
                f"{ensemble.m}"
            )
        self.stop = _check(max_tokens, decoder, temperature, on_exhausted, stop)
        curator.session_info(session_id)  # an unknown session fails before any compute
        self.ids = ensemble.encode(prompt)
        context = ensemble.context
        if context is not None and len(self.ids) + max_tokens > context:
            raise PacEnsembleError(
                f"the prompt ({len(self.ids)} tokens) plus max_tokens ({max_tokens}) exceed "
                f"the model's context of {context} tokens"
            )
        self.ensemble, self.curator, self.session_id = ensemble, curator, session_id
        self.max_tokens, self.on_exhausted, self.sink = max_tokens, on_exhausted, sink
        self.gumbel, self.temperature = decoder == "gumbel", float(temperature)
        self._rng = np.random.default_rng(seed)  # public randomness: never the curator's
        self._window = 4 * max((len(s) for s in self.stop), default=0) + 8
        self.tokens: list[int] = []
        self.feed: list[int] = self.ids  #: the next forward's input tokens
        self.counts = {"free": 0, "private": 0, "fallback": 0}
        self.charged, self.finish, self.exhausted = 0.0, "length", False
        self.done = False
        self._gumbel: np.ndarray | None = None  #: this step's public Gumbel draw (decoder gumbel)
        self.started = time.perf_counter()

    def live(self) -> bool:
        """Whether another step is due (False once done, or once the client went away:
        nothing more is computed or charged)."""
        if not self.done and self.sink is not None and self.sink.cancelled:
            self.done = True
        return not self.done

    def ready(self) -> bool:
        """Whether :meth:`advance` can release now without waiting on the client (a
        lockstep sink: its last token went out)."""
        return self.sink is None or self.sink.ready()

    def advance(self, lp: Any) -> None:
        """One release from the step log-probs ``lp`` (a :class:`StepLogprobs` after
        :attr:`feed`); sets :attr:`feed` to the token, or :attr:`done`."""
        if self.live():
            self.take(lp, self.curator.step(self.session_id, self.votes(lp)))

    def votes(self, lp: Any) -> np.ndarray:
        """The worlds' votes on ``lp`` for the curator (draws this step's public Gumbel)."""
        self._gumbel = self._rng.gumbel(size=lp.candidates.size) if self.gumbel else None
        scores = lp.worlds / self.temperature if self.gumbel else lp.worlds
        return world_votes(scores, gumbel=self._gumbel)

    def take(self, lp: Any, outcome: Any) -> None:
        """The curator's ``outcome`` on :meth:`votes` ``(lp)``: the next token, or the end."""
        if outcome.kind == "fallback" and self.on_exhausted == "stop":
            self.exhausted = self.done = True
            return
        self.counts[outcome.kind] += 1
        self.charged += outcome.charged
        index, g = outcome.index, self._gumbel
        if index is None:  # budget spent: the public model's own choice, free
            public = lp.public / self.temperature + g if g is not None else lp.public
            index = int(np.argmax(public))
        token = int(lp.candidates[index])
        self.tokens.append(token)
        if self.sink is not None:
            self.sink.put(token)
        self.feed = [token]
        if token in self.ensemble.eos_ids or self._stopped():
            self.finish, self.done = "stop", True
        elif len(self.tokens) >= self.max_tokens:
            self.done = True

    def _stopped(self) -> bool:
        if not self.stop:
            return False
        tail = self.ensemble.tokenizer.decode(
            self.tokens[-self._window :], skip_special_tokens=True
        )
        return any(s in tail for s in self.stop)

    def result(self) -> Any:
        """The :class:`~privcode.pac.ensemble.PacCompletion` of what was released."""
        tokens, eos = self.tokens, self.ensemble.eos_ids
        shown = tokens[:-1] if self.finish == "stop" and tokens and tokens[-1] in eos else tokens
        text = self.ensemble.tokenizer.decode(shown, skip_special_tokens=True)
        finish = self.finish
        hits = [pos for pos in (text.find(s) for s in self.stop) if pos >= 0]
        if hits:
            text, finish = text[: min(hits)], "stop"
        counts = self.counts
        log.info(
            "PAC completion: %d prompt tokens, %d new (%d private, %d free, %d fallback), "
            "%.3g nats, %.2f s",
            len(self.ids),
            len(tokens),
            counts["private"],
            counts["free"],
            counts["fallback"],
            self.charged,
            time.perf_counter() - self.started,
        )
        return PacCompletion(
            text=text,
            token_ids=tuple(tokens),
            finish_reason=finish,
            prompt_tokens=len(self.ids),
            private_tokens=counts["private"],
            free_tokens=counts["free"],
            fallback_tokens=counts["fallback"],
            charged_nats=self.charged,
            exhausted=self.exhausted,
        )
