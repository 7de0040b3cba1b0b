"""ONE batched generate: every privcode path that decodes with a Hugging Face causal LM calls it.
Design notes: docs/architecture.md, "models/generate.py".

One call is one HF ``generate`` over a batch of rows given as token ids (left-padded here), as
text or as prefix embeddings (``inputs_embeds``: the latent junior's ``D(z)``). Per row:
``max_new_tokens``, ``temperature`` (0 = greedy), ``top_p``, a seed, stop strings, optional
``logprobs`` (``log_softmax`` of the raw logits, before temperature and nucleus) and a listener
that sees the row's tokens as drawn and may cancel it. Sampling is
:class:`privcode.models.sampling.RowSampler` inside HF's greedy loop (``do_sample`` always off):
``seed=<int>`` draws what ``torch.manual_seed(seed)`` + ``do_sample=True`` drew, per-row seeds
keep a row reproducible whatever shares its batch; the global RNG is never used. A row ends at
its first EOS, its ``max_new_tokens`` or its first stop string (:class:`StopCriteria`), decoded
without special tokens and cut before the stop string.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from privcode.models.sampling import RowSampler

__all__ = ["Generation", "StopCriteria", "TokenLogprob", "generate"]

#: A batch's seed: one int or generator for every sampled row, or one (int | None) per row;
#: None draws from fresh random seeds.
Seed = int | torch.Generator | Sequence[int | None] | None


#: ``listener(row, token) -> keep``: called with each row's new token as it is drawn (its EOS
#: included, nothing after its end); False cancels the row (it ends there, "length").
Listener = Callable[[int, int], bool]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the ``k`` most likely tokens' (best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Generation:
    """One row's result: ``tokens`` up to (excluding) its EOS, ``text`` cut before its first
    stop string, ``finish_reason`` "stop" (EOS or a stop string) or "length", and
    ``completion_tokens``: the tokens generated, its EOS included. ``logprobs`` (when asked
    for): one per token of ``tokens`` that ``text`` holds (up to its stop string)."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None


class LogprobRecorder(LogitsProcessor):
    """Records, for the rows that ask (``rows[row] = k``), each step's ``log_softmax`` of the raw
    scores: the chosen token's value (known at the next call, or from the output at the end)
    and the top ``k``. Runs first in the processor list, so it sees the model's logits."""

    def __init__(self, rows: dict[int, int]):
        self.rows = rows
        self.index = sorted(rows)
        self.out: dict[int, list[TokenLogprob]] = {r: [] for r in rows}
        self._pending: tuple[torch.Tensor, list[tuple[tuple[int, float], ...]]] | None = None

    def _resolve(self, chosen: torch.Tensor) -> None:
        if self._pending is None:
            return
        lsm, tops = self._pending
        values = lsm.gather(-1, chosen.view(-1, 1).to(lsm.device))[:, 0].tolist()
        for i, row in enumerate(self.index):
            self.out[row].append(TokenLogprob(int(chosen[i]), float(values[i]), tops[i]))
        self._pending = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = torch.tensor(self.index, device=scores.device)
        self._resolve(input_ids[rows, -1])
        lsm = torch.log_softmax(scores[rows].float(), dim=-1)
        most = max(self.rows.values())
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(self.index)
        if most:
            values, ids = torch.topk(lsm, min(most, lsm.shape[-1]), dim=-1)
            tops = [
                tuple(zip(ids[i, :k].tolist(), values[i, :k].tolist(), strict=True))
                for i, k in enumerate(self.rows[r] for r in self.index)
            ]
        self._pending = (lsm, tops)
        return scores

    def finish(self, last: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """Every row's records, the last step's resolved with ``last`` ``[B]`` (its tokens)."""
        self._resolve(last[torch.tensor(self.index, device=last.device)])
        return self.out


class StopCriteria(StoppingCriteria):
    """Per-row stopping: a row is done at its own ``max_new_tokens`` or once its new text
    holds one of its stop strings; ``stopped[row]`` is the number of new tokens then.

    Only a row's last new tokens are decoded each step: a stop string of ``c`` characters
    that has just completed lies in the last ``4c`` byte-level tokens (at least 24).
    """

    def __init__(
        self,
        tokenizer: Any,
        stops: Sequence[tuple[str, ...]],
        max_new: Sequence[int],
        start: int,
        *,
        listener: Listener | None = None,
        eos: Sequence[int] = (),
    ):
        self.tokenizer, self.stops, self.max_new, self.start = tokenizer, stops, max_new, start
        self.stopped: dict[int, int] = {}
        self.window = [max(24, 4 * max((len(s) for s in row), default=0) + 8) for row in stops]
        self.listener, self.eos = listener, frozenset(eos)
        self._ended: set[int] = set()  # rows past their EOS (HF pads them from then on)

    def _listen(self, input_ids: torch.LongTensor, n: int) -> None:
        """Hand each live row's newest token to the listener; a row it refuses is stopped."""
        assert self.listener is not None
        for row, token in enumerate(input_ids[:, -1].tolist()):
            if row in self._ended or row in self.stopped:
                continue
            if token in self.eos:
                self._ended.add(row)
            if not self.listener(row, int(token)):
                self.stopped[row] = n

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        n = input_ids.shape[1] - self.start
        if self.listener is not None:
            self._listen(input_ids, n)
        for row, stops in enumerate(self.stops):
            if row in self.stopped or row in self._ended:
                continue
            hit = n >= self.max_new[row]
            if not hit and stops:
                tail = input_ids[row, max(self.start, input_ids.shape[1] - self.window[row]) :]
                text = self.tokenizer.decode(tail.tolist(), skip_special_tokens=True)
                hit = any(s in text for s in stops)
            if hit:
                self.stopped[row] = n
        done = [row in self.stopped or row in self._ended for row in range(len(self.stops))]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _per_row(value: Any, n: int, name: str) -> list[Any]:
    """``value`` for each of ``n`` rows: a scalar repeated, or a sequence of ``n``."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} values for {n} rows")
    return list(value)


def _stops(stop: Sequence[str] | Sequence[Sequence[str]], n: int) -> list[tuple[str, ...]]:
    """Stop strings per row: one list for every row, or one list per row."""
    if isinstance(stop, str):
        raise ValueError("stop must be a list of strings (or one list per row), not a string")
    if all(isinstance(s, str) for s in stop):
        return [tuple(s for s in stop if s)] * n
    return [tuple(s for s in row if s) for row in _per_row(stop, n, "stop")]


def _generators(seed: Seed, sampled: list[bool], device: torch.device) -> list[Any]:
    """Each row's generator (None for a greedy row); see :data:`Seed`."""

    def fresh(value: int | None) -> torch.Generator:
        value = secrets.randbits(63) if value is None else int(value)
        return torch.Generator(device=device).manual_seed(value)

    if isinstance(seed, torch.Generator):
        shared = seed
    elif seed is None or isinstance(seed, int):
        shared = None if seed is None else fresh(seed)
    else:
        seeds = _per_row(seed, len(sampled), "seed")
        return [fresh(s) if on else None for s, on in zip(seeds, sampled, strict=True)]
    return [(shared or fresh(None)) if on else None for on in sampled]


def _check(max_new: list[int], temps: list[float], top_ps: list[float]) -> None:
    if any(type(m) is not int or m < 1 for m in max_new):
        raise ValueError("max_new_tokens must be a positive int (per row)")
    if any(not isinstance(t, int | float) or t < 0 for t in temps):
        raise ValueError("temperature must be >= 0 (0 = greedy)")
    if any(not isinstance(p, int | float) or not 0 < p <= 1 for p in top_ps):
        raise ValueError("top_p must be in (0, 1]")


def _inputs(
    rows: list[list[int]] | None, embeds: torch.Tensor | None, mask: Any, pad: int, device: Any
) -> tuple[dict[str, torch.Tensor], int]:
    """HF inputs and the width of the context in its output (0 for embeddings)."""
    if embeds is not None:
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"inputs_embeds": embeds, "attention_mask": mask}, 0
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):  # left padding: every context ends at column width - 1
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}, width


def _default_eos(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The model's generation EOS ids (a checkpoint may have several), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return tuple(eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos]))


def _covering(tokenizer: Any, tokens: list[int], chars: int) -> int:
    """The fewest leading ``tokens`` whose text holds ``chars`` characters (bisection)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _finish(
    tokenizer: Any,
    tokens: list[int],
    end: int,
    eos: tuple[int, ...],
    stops: tuple[str, ...],
    logprobs: list[TokenLogprob] | None = None,
) -> Generation:
    """A row's tokens cut at ``end``, then at its first EOS; its text cut at its first stop
    (its log-probs, if any, to the tokens that text holds)."""
    used, reason = tokens[:end], "length"
    for i, tok in enumerate(used):
        if tok in eos:
            used, reason, end = used[:i], "stop", i + 1
            break
    text = tokenizer.decode(used, skip_special_tokens=True)
    hits = [pos for pos in (text.find(s) for s in stops) if pos >= 0]
    kept = len(used)
    if hits:
        text, reason = text[: min(hits)], "stop"
        kept = _covering(tokenizer, used, len(text)) if logprobs is not None else kept
    lp = None if logprobs is None else tuple(logprobs[:kept])
    return Generation(tuple(used), text, reason, end, lp)


def generate(
    model: Any,
    tokenizer: Any,
    *,
    input_ids: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[str] | None = None,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_p: float | Sequence[float] = 1.0,
    seed: Seed = None,
    stop: Sequence[str] | Sequence[Sequence[str]] = (),
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    add_special_tokens: bool = True,
    logprobs: int | Sequence[int | None] | None = None,
    listener: Listener | None = None,
) -> list[Generation]:
    """One batch of rows, in order: from ``input_ids`` (one list per row), ``prompts`` (text,
    tokenised with ``add_special_tokens``) or ``inputs_embeds`` ``[B, L, H]`` (with an
    optional ``attention_mask``). ``eos_ids`` default to the model's generation EOS ids,
    ``pad_id`` to the tokenizer's pad, else the first EOS, else 0. ``logprobs``: None, or
    per row (or for all) the number of top alternatives to record (0: the chosen token's
    only). ``listener``: see :data:`Listener`. See the module doc."""
    given = [x is not None for x in (input_ids, prompts, inputs_embeds)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of input_ids, prompts and inputs_embeds")
    if prompts is not None:
        input_ids = [
            tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts
        ]
    rows = None if input_ids is None else [list(r) for r in input_ids]
    n = len(rows) if rows is not None else int(inputs_embeds.shape[0])
    if n == 0 or (rows is not None and not all(rows)):
        raise ValueError("generate needs at least one row, and no empty row")
    max_new = _per_row(max_new_tokens, n, "max_new_tokens")
    temps = [float(t) for t in _per_row(temperature, n, "temperature")]
    top_ps = [float(p) for p in _per_row(top_p, n, "top_p")]
    _check(max_new, temps, top_ps)
    stops = _stops(stop, n)
    eos = tuple(eos_ids) if eos_ids is not None else _default_eos(model, tokenizer)
    pad = next(i for i in (pad_id, tokenizer.pad_token_id, *eos, 0) if i is not None)
    device = model.get_input_embeddings().weight.device
    inputs, width = _inputs(rows, inputs_embeds, attention_mask, pad, device)
    options: dict[str, Any] = {}
    processors: list[Any] = []
    asked = {i: k for i, k in enumerate(_per_row(logprobs, n, "logprobs")) if k is not None}
    recorder = LogprobRecorder(asked) if asked else None
    if recorder is not None:
        processors.append(recorder)  # first: the model's own scores
    sampled = [t > 0 for t in temps]
    if any(sampled):
        gens = _generators(seed, sampled, device)
        processors.append(RowSampler(list(zip(temps, top_ps, gens, strict=True))))
    if processors:
        options["logits_processor"] = LogitsProcessorList(processors)
    stopper = StopCriteria(tokenizer, stops, max_new, width, listener=listener, eos=eos)
    if any(stops) or len(set(max_new)) > 1 or listener is not None:
        options["stopping_criteria"] = StoppingCriteriaList([stopper])
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max(max_new),
            do_sample=False,
            eos_token_id=list(eos) or None,
            pad_token_id=pad,
            **options,
        )
    recorded = recorder.finish(out[:, -1]) if recorder is not None else {}
    return [
        _finish(
            tokenizer,
            new,
            min(max_new[i], stopper.stopped.get(i, max_new[i])),
            eos,
            stops[i],
            recorded.get(i),
        )
        for i, new in enumerate(out[:, width:].tolist())
    ]
