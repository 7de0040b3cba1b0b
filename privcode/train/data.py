"""Tokenisation and collation of private records for per-record losses.

A record ``(prompt p, code c)`` becomes one token row::

    tokens(p + "\\n") ++ tokens(c) ++ [EOS]        (no prompt: tokens(c) ++ [EOS])

cut to ``max_length`` tokens from the left end (the prompt comes first, so a
very long prompt can crowd the code out: the record then trains on what is
left). Each token carries a segment id, ``PROMPT`` or ``CODE`` (EOS counts
as code), so a method can put its loss on code tokens only (PrivCode) or on
both (DPFT) without re-tokenising.

Batches are right-padded with the tokenizer's pad token (segment ``PAD``,
attention mask 0). With causal attention a padded row is the same
computation as the unpadded row, and padded positions carry no loss, so a
record's loss and gradient do not depend on the other rows of its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CODE", "PAD", "PROMPT", "Encoded", "collate", "encode_records"]

PAD, PROMPT, CODE = 0, 1, 2


@dataclass(frozen=True)
class Encoded:
    """One tokenised record: token ids and their segment ids (same length, >= 1)."""

    input_ids: tuple[int, ...]
    segments: tuple[int, ...]

    def __repr__(self) -> str:  # token ids are private content: never in logs
        return f"Encoded(<{len(self.input_ids)} tokens>)"


def _ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def encode_records(records: Sequence[Any], tokenizer: Any, max_length: int) -> list[Encoded]:
    """Tokenise records (objects with ``prompt`` and ``code``) in order; see the module docstring."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    eos = tokenizer.eos_token_id
    prompts = [r.prompt.rstrip() + "\n" if r.prompt.strip() else "" for r in records]
    prompt_ids = _ids(tokenizer, prompts)
    code_ids = _ids(tokenizer, [r.code for r in records])
    out = []
    for p, c in zip(prompt_ids, code_ids, strict=True):
        c = c + ([eos] if eos is not None else [])
        ids = (p + c)[:max_length]
        segs = ([PROMPT] * len(p) + [CODE] * len(c))[:max_length]
        out.append(Encoded(tuple(ids), tuple(segs)))
    return out


def collate(rows: Sequence[Encoded], pad_id: int, device: torch.device | str | None = None,
            **extra: Any) -> dict[str, Any]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``segments`` as ``[B, T]`` tensors.

    ``extra`` entries (public values such as the step number) are passed
    through unchanged.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    segs = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long)
        segs[i, :len(r.segments)] = torch.tensor(r.segments, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": (segs != PAD).long(), "segments": segs}
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return {**batch, **extra}
