"""Token rows of (prompt, code) records, their batches and per-token losses: every stage's encoding.

A record ``(prompt p, code c)`` becomes one token row, cut to ``max_length`` from the left end::

    tokens(p + "\\n") ++ tokens(c) ++ [EOS]        (no prompt: tokens(c) ++ [EOS])

Each token carries a segment id, ``PROMPT`` or ``CODE`` (EOS counts as code), and each code
token a *structural* flag (:func:`structural_flags`). Batches are right-padded (segment ``PAD``,
attention mask 0, no loss): a record's loss and gradient do not depend on the other rows.
Structural source tokens (:func:`structural_spans`), Python: ``OP`` tokens, keywords and soft
keywords except ``_``, public builtins; other languages: the anonymous leaves of the
tree-sitter grammar; code that does not tokenize gets none (``stats["untokenizable"]``). A
model token ``[s, e)`` is structural iff its span stripped of whitespace is non-empty and
inside the union of the structural source spans. Stage I, the premium fine-tune, the PAC
worlds and the audits all read records here. Design notes: docs/architecture.md,
"models/encoding.py".
"""

from __future__ import annotations

import builtins
import io
import itertools
import keyword
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from privcode.models.chat import prompt_text

__all__ = [
    "CODE",
    "PAD",
    "PROMPT",
    "STRUCTURAL_NAMES",
    "Encoded",
    "collate",
    "encode_records",
    "segment_rows",
    "structural_flags",
    "structural_spans",
    "token_ce",
    "token_ids",
    "token_ids_offsets",
]

PAD, PROMPT, CODE = 0, 1, 2

#: NAME tokens that count as structural: keywords, soft keywords (but ``_``)
#: and public builtins.
STRUCTURAL_NAMES: frozenset[str] = frozenset(
    set(keyword.kwlist)
    | (set(keyword.softkwlist) - {"_"})
    | {name for name in dir(builtins) if not name.startswith("_")}
)


def _is_bad_token(tok: tokenize.TokenInfo) -> bool:
    # Python < 3.12 reports stray characters (``$``, ``?``, an unterminated
    # ``'``) as ERRORTOKEN instead of raising; 3.12+ raises for some and
    # emits others as an OP with no specific operator type. Treating all of
    # them as a tokenize failure makes the result independent of the version.
    return tok.type == tokenize.ERRORTOKEN or (
        tok.type == tokenize.OP and tok.exact_type == tokenize.OP
    )


def structural_spans(
    code: str, limit: int | None = None, language: str | None = "python"
) -> list[tuple[int, int]] | None:
    """Sorted, non-overlapping ``[start, end)`` character spans of the
    structural source tokens of ``code`` (rules in the module docstring).

    Returns ``None`` when ``code`` does not tokenize (unterminated string or
    bracket, inconsistent dedent, a character Python does not know).
    ``limit``: only source tokens starting before character ``limit`` are
    read (tokenize stops there: a training record cut to its first tokens
    costs its prefix, not its whole text), so only that part must tokenize.
    """
    if language not in (None, "", "python"):
        # tree-sitter and its grammars load only for a non-Python record.
        from privcode.data.ingest.syntax import GRAMMARS, structural_spans_ts

        if language not in GRAMMARS:
            return None
        return structural_spans_ts(code, language)
    # Line starts must follow the same line splitting as the readline that
    # tokenize consumes (only "\n" ends a line here), not str.splitlines,
    # which also splits on "\r", "\x0c", "\x1c", ... and would shift offsets.
    starts = [0]
    for line in io.StringIO(code):
        starts.append(starts[-1] + len(line))

    spans: list[tuple[int, int]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            # Rows are 1-based; columns are character (not byte) offsets
            # because tokenize reads str lines.
            start = starts[tok.start[0] - 1] + tok.start[1]
            if limit is not None and start >= limit:
                break
            if _is_bad_token(tok):
                return None
            if tok.type == tokenize.OP or (
                tok.type == tokenize.NAME and tok.string in STRUCTURAL_NAMES
            ):
                spans.append((start, starts[tok.end[0] - 1] + tok.end[1]))
    except (tokenize.TokenError, IndentationError, SyntaxError, ValueError):
        return None
    spans.sort()
    return spans


def structural_flags(
    code: str, offsets: Sequence[tuple[int, int]], language: str | None = "python"
) -> list[bool] | None:
    """One flag per model token: is the token structural?

    ``offsets[i]`` is token ``i``'s character span ``(start, end)`` in
    ``code`` (a fast tokenizer's ``return_offsets_mapping``). A token is
    structural iff its span, stripped of whitespace at both ends, is
    non-empty and every character of it lies in a structural source span.
    Returns ``None`` when :func:`structural_spans` does for the part of
    ``code`` the offsets cover (up to the end of the last one).

    Raises ``ValueError`` for a span outside ``code`` or with ``start > end``.
    """
    limit = max((int(end) for _, end in offsets), default=0)
    spans = structural_spans(code, limit, language)
    if spans is None:
        return None
    n = len(code)
    marks = [0] * n
    for start, end in spans:
        marks[start:end] = [1] * (end - start)
    # prefix[i] = number of structural characters in code[:i]; a span is all
    # structural iff its count equals its length: O(1) per token.
    prefix = [0, *itertools.accumulate(marks)]

    flags: list[bool] = []
    for start, end in offsets:
        start, end = int(start), int(end)
        if not 0 <= start <= end <= n:
            raise ValueError(f"token span ({start}, {end}) is not inside code of length {n}")
        while start < end and code[start].isspace():
            start += 1
        while end > start and code[end - 1].isspace():
            end -= 1
        flags.append(end > start and prefix[end] - prefix[start] == end - start)
    return flags


@dataclass(frozen=True)
class Encoded:
    """One tokenised record: token ids, segment ids and structural flags (same length, >= 1)."""

    input_ids: tuple[int, ...]
    segments: tuple[int, ...]
    structural: tuple[int, ...] = ()  #: 1 = structural code token; () = none at all

    def __repr__(self) -> str:  # token ids are private content: never in logs
        return f"Encoded(<{len(self.input_ids)} tokens>)"


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added."""
    return [ids for ids, _ in token_ids_offsets(tokenizer, texts)]


def token_ids_offsets(
    tokenizer: Any, texts: list[str]
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(token ids, character spans) of each text, no special tokens; the fast backend's batch
    encoder when the tokenizer has one."""
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
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    eos = tokenizer.eos_token_id
    prompts = [prompt_text(r.prompt) for r in records]
    prompt_ids = token_ids(tokenizer, prompts)
    codes = [r.code for r in records]
    languages = [(getattr(r, "metadata", None) or {}).get("language") for r in records]
    out = []
    bad = 0
    for code, lang, p, (c, offsets) in zip(
        codes, languages, prompt_ids, token_ids_offsets(tokenizer, codes), strict=True
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


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token cross-entropies of ``[B, T, V]`` logits (fp32).

    Computed on the flat ``[B*T, V]`` layout: cross_entropy over the
    transposed ``[B, V, T]`` view (the class dim strided) is about 2x slower
    on CPU (forward + backward, V = 6144).
    """
    flat = logits.float().reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="none").view(
        targets.shape
    )
