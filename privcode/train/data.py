"""Tokenisation and collation of private records for per-record losses.

A record ``(prompt p, code c)`` becomes one token row::

    tokens(p + "\\n") ++ tokens(c) ++ [EOS]        (no prompt: tokens(c) ++ [EOS])

cut to ``max_length`` tokens from the left end (the prompt comes first, so a
very long prompt can crowd the code out: the record then trains on what is
left). Each token carries a segment id, ``PROMPT`` or ``CODE`` (EOS counts
as code), so a method can put its loss on code tokens only (PrivCode) or on
both (DPFT) without re-tokenising. Each code token also carries a
*structural* flag (:func:`privcode.train.syntax.structural_flags`: the
token is syntax of the record's language, ``metadata.language``: for
Python a keyword, operator, delimiter or builtin name, for the others a
keyword, operator or punctuation of its tree-sitter grammar), which
PrivCode's syntax-aware KL term uses; code that does not tokenize (or
parse) in its language gets no structural tokens and is counted in
``stats["untokenizable"]``.

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

__all__ = ["CODE", "PAD", "PROMPT", "Encoded", "collate", "encode_records", "segment_rows"]

PAD, PROMPT, CODE = 0, 1, 2


@dataclass(frozen=True)
class Encoded:
    """One tokenised record: token ids, segment ids and structural flags (same length, >= 1)."""

    input_ids: tuple[int, ...]
    segments: tuple[int, ...]
    structural: tuple[int, ...] = ()  #: 1 = structural code token; () = none at all

    def __repr__(self) -> str:  # token ids are private content: never in logs
        return f"Encoded(<{len(self.input_ids)} tokens>)"


def _ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [ids for ids, _ in _ids_offsets(tokenizer, texts)]


def _ids_offsets(tokenizer: Any, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [
            (list(e.ids), [tuple(o) for o in e.offsets])
            for e in backend.encode_batch(texts, add_special_tokens=False)
        ]
    out = []
    for t in texts:
        enc = tokenizer(t, add_special_tokens=False, return_offsets_mapping=True)
        out.append((list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]))
    return out


def encode_records(
    records: Sequence[Any], tokenizer: Any, max_length: int, stats: dict[str, int] | None = None
) -> list[Encoded]:
    """Tokenise records (objects with ``prompt`` and ``code``) in order; see the module docstring.

    ``stats`` (optional) gets ``"untokenizable"`` incremented for every
    record whose kept code (the part within ``max_length``) Python's
    tokenizer rejects (it still trains, with no structural positions).
    That count describes private data: keep it out of anything released.
    """
    from privcode.train.syntax import structural_flags

    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    eos = tokenizer.eos_token_id
    prompts = [r.prompt.rstrip() + "\n" if r.prompt.strip() else "" for r in records]
    prompt_ids = _ids(tokenizer, prompts)
    codes = [r.code for r in records]
    languages = [(getattr(r, "metadata", None) or {}).get("language") for r in records]
    out = []
    bad = 0
    for code, lang, p, (c, offsets) in zip(
        codes, languages, prompt_ids, _ids_offsets(tokenizer, codes), strict=True
    ):
        kept = max(0, max_length - len(p))  # code tokens that survive the cut
        flags = structural_flags(code, offsets[:kept], lang)
        if flags is None:
            bad += 1
            flags = [False] * len(c)
        c = c + ([eos] if eos is not None else [])
        ids = (p + c)[:max_length]
        segs = ([PROMPT] * len(p) + [CODE] * len(c))[:max_length]
        struct = ([0] * len(p) + [int(f) for f in flags] + [0] * (len(c) - len(flags)))[:max_length]
        out.append(Encoded(tuple(ids), tuple(segs), tuple(struct)))
    if stats is not None:
        stats["untokenizable"] = stats.get("untokenizable", 0) + bad
    return out


def collate(
    rows: Sequence[Encoded], pad_id: int, device: torch.device | str | None = None, **extra: Any
) -> dict[str, Any]:
    """Right-padded batch: ``input_ids``, ``attention_mask``, ``segments``, ``structural`` ``[B, T]``.

    ``extra`` entries (public values such as the step number) are passed
    through unchanged.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    segs = torch.full((len(rows), width), PAD, dtype=torch.long)
    struct = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long)
        segs[i, : len(r.segments)] = torch.tensor(r.segments, dtype=torch.long)
        if r.structural:
            struct[i, : len(r.structural)] = torch.tensor(r.structural, dtype=torch.long)
    batch = {
        "input_ids": ids,
        "attention_mask": (segs != PAD).long(),
        "segments": segs,
        "structural": struct,
    }
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return {**batch, **extra}


def segment_rows(
    batch: dict[str, Any], segment: int, *, bos_id: int | None = None
) -> dict[str, torch.Tensor]:
    """The tokens of one segment of every row, left-aligned and right-padded.

    Returns ``input_ids``, ``attention_mask`` and ``structural`` ``[B, T']``
    holding, for row ``i``, only the tokens whose segment id is ``segment``
    (e.g. :data:`CODE`: the code without its prompt), with ``bos_id``
    prepended when given (mask 1, structural 0). A row without such tokens
    is all padding (mask 0). Row ``i`` of the result depends on row ``i``
    of the batch only.
    """
    ids, segs = batch["input_ids"], batch["segments"]
    struct = batch.get("structural", torch.zeros_like(ids))
    keep = segs == segment
    lead = 0 if bos_id is None else 1
    counts = keep.sum(dim=1)
    width = max(int(counts.max().item()) if counts.numel() else 0, 0) + lead
    width = max(width, 1)
    out_ids = torch.zeros((ids.shape[0], width), dtype=ids.dtype, device=ids.device)
    out_mask = torch.zeros_like(out_ids)
    out_struct = torch.zeros_like(out_ids)
    if bos_id is not None:
        out_ids[:, 0] = bos_id
        out_mask[:, 0] = 1
    # Stable left-alignment: the k-th kept token of row i goes to column lead + k.
    pos = (torch.cumsum(keep.long(), dim=1) - 1 + lead)[keep]
    rows = torch.nonzero(keep, as_tuple=True)[0]
    out_ids[rows, pos] = ids[keep]
    out_mask[rows, pos] = 1
    out_struct[rows, pos] = struct[keep]
    return {"input_ids": out_ids, "attention_mask": out_mask, "structural": out_struct}
