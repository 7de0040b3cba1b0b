"""Sampling settings for ``generate``: temperature + nucleus (top-p), with a fast CPU nucleus.
Design notes: docs/architecture.md, "models/sampling.py".

Nucleus filtering keeps the smallest set of tokens whose probability mass reaches ``p``. As
HF's ``TopPLogitsWarper``: with ``s`` the probabilities ``pi`` sorted ascending, ``c`` their
cumulative sums and ``k`` the number of positions where ``c <= 1 - p``, every token with
``pi < s[k]`` is removed (never the most likely one). Only the sorted values are needed
(NumPy's sort on the CPU, torch's for CUDA tensors); the result equals HF's except for ties at
the boundary (tokens scored exactly ``s[k]`` are all kept here).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

__all__ = ["NucleusFilter", "RowSampler", "sampling_kwargs"]


class NucleusFilter(LogitsProcessor):
    """Top-p filtering of ``scores`` ``[B, V]`` at ``temperature``: removed tokens get ``-inf``.

    Hugging Face runs custom logits processors *before* its temperature
    warper, so the nucleus is chosen here on ``scores / temperature`` (the
    same division as ``TemperatureLogitsWarper``) and the scores are returned
    untempered, for ``generate`` to divide afterwards.
    """

    def __init__(self, top_p: float, temperature: float = 1.0, filter_value: float = -float("inf")):
        if not 0 < float(top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not float(temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.top_p, self.temperature = float(top_p), float(temperature)
        self.filter_value = filter_value

    def keep_threshold(self, scores: torch.Tensor) -> torch.Tensor:
        """Per row, the smallest kept score ``s[k]`` (``[B, 1]``, on ``scores``' device).

        As Hugging Face does, the softmax and its cumulative sum are taken over
        the *sorted* scores, so the sums are the same floats as theirs.
        """
        if scores.device.type == "cpu":
            s = torch.from_numpy(np.sort(scores.detach().float().numpy(), axis=-1))
        else:
            s = torch.sort(scores.float(), dim=-1).values
        removed = (s.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p).sum(dim=-1, keepdim=True)
        removed = removed.clamp(max=s.shape[-1] - 1)  # the most likely token always stays
        return s.gather(-1, removed).to(scores.device)

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        if self.top_p >= 1.0:
            return scores
        tempered = scores / self.temperature if self.temperature != 1.0 else scores
        return scores.masked_fill(tempered < self.keep_threshold(tempered), self.filter_value)


def sampling_kwargs(temperature: float, top_p: float = 1.0) -> dict[str, Any]:
    """``generate`` keyword arguments: greedy for temperature 0, else temperature + nucleus.

    The nucleus runs as :class:`NucleusFilter` on the tempered scores, as
    Hugging Face's own ``top_p`` does; ``top_k`` is off.
    """
    if float(temperature) == 0.0:
        return {"do_sample": False}
    kwargs: dict[str, Any] = {
        "do_sample": True,
        "temperature": float(temperature),
        "top_p": 1.0,
        "top_k": 0,
    }
    if float(top_p) < 1.0:
        kwargs["logits_processor"] = LogitsProcessorList([NucleusFilter(top_p, temperature)])
    return kwargs


class RowSampler(LogitsProcessor):
    """Each row of one greedy ``generate`` sampled at its own settings, from its generator.

    ``rows[i] = (temperature, top_p, generator)``: temperature 0 keeps the scores (greedy);
    any other draws the next token from ``softmax(scores / temperature)`` within the nucleus
    (:meth:`NucleusFilter.keep_threshold`) and leaves only that token finite. Rows that share
    a generator (None: the global one) are drawn by ONE ``torch.multinomial``, as HF's
    ``do_sample`` draws a batch; a row with its own generator draws from its own stream
    whatever shares its batch. Generators must live on the scores' device.
    Design notes: docs/architecture.md, "models/sampling.py".
    """

    def __init__(self, rows: list[tuple[float, float, torch.Generator | None]]):
        self.rows = rows
        groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
        for r, (temperature, _, generator) in enumerate(rows):
            if temperature != 0.0:
                groups.setdefault(id(generator), (generator, []))[1].append(r)
        self.groups = list(groups.values())

    def _filtered(self, scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``rows``' float scores divided by their temperature, outside their nucleus -inf."""
        out = scores[rows].float()
        settings = [self.rows[r][:2] for r in rows]
        for temperature, top_p in dict.fromkeys(settings):
            at = [i for i, s in enumerate(settings) if s == (temperature, top_p)]
            part = out[at] / temperature
            if top_p < 1.0:
                part = part.masked_fill(
                    part < NucleusFilter(top_p).keep_threshold(part), -float("inf")
                )
            out[at] = part
        return out

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for generator, rows in self.groups:
            probs = self._filtered(scores, rows).softmax(dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
            index = torch.tensor(rows, device=scores.device)
            out[index] = -float("inf")
            out[index, tokens] = 0.0
        return out  # type: ignore[return-value]
