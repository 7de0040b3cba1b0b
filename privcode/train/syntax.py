"""Syntax-aware pieces of PrivCode's loss: structural tokens and the KL weight.

PrivCode adds, on top of the language-model loss, a KL term restricted to the
*structural* tokens of the code, weighted by a decaying schedule.

**Structural source tokens** (:func:`structural_spans`). The code is split
with Python's :mod:`tokenize`; a token is structural iff it is

* an ``OP`` token: operators and delimiters (``( ) [ ] { } : , . = + -> ...``);
  on Python 3.12+ this includes the braces and operators inside f-string
  replacement fields (the literal ``FSTRING_MIDDLE`` text is not structural);
* a ``NAME`` that is a keyword or soft keyword (``def``, ``in``, ``None``,
  ``match``, ...), except ``_``, which is an ordinary identifier in practice;
* a ``NAME`` that is a public builtin (``dir(builtins)`` without a leading
  ``_``: ``len``, ``range``, ``int``, ``ValueError``, ...; ``type`` is one).

Everything else is not: other identifiers, strings, numbers, comments and the
layout tokens (NEWLINE, NL, INDENT, DEDENT, ENDMARKER).

Other languages (a record's ``metadata.language``, from ``privcode data ingest``): the
leaves of anonymous kinds of the language's tree-sitter grammar (its keywords, operators
and punctuation: :func:`privcode.data.ingest.syntax.structural_spans_ts`); a language
without a grammar gets no structural tokens.

**Model tokens** (:func:`structural_flags`). A model token with character span
``[s, e)`` is structural iff the span with whitespace stripped from both ends
is non-empty and lies entirely inside the union of the structural source
spans: ``" for"`` and ``"):"`` are structural, ``"(x"``, ``"foo"``, ``"  "``
and zero-length (special-token) spans are not.

**Weight schedule** (:func:`ast_lambda`)::

    lambda(t) = lambda_min + (lambda_max - lambda_min) * exp(-alpha * floor(t / dt))

**KL term** (:func:`kl_at_positions`): for each record ``b``,
``sum_{t : mask[b, t]} KL(p_junior[b, t] || p_ref[b, t])`` over the whole
vocabulary, with ``p = softmax(logits)`` in float32 and ``ref`` a constant.
"""

from __future__ import annotations

import builtins
import io
import itertools
import keyword
import math
import tokenize
from collections.abc import Sequence

import torch

__all__ = [
    "STRUCTURAL_NAMES",
    "ast_lambda",
    "kl_at_positions",
    "structural_flags",
    "structural_spans",
]

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


def ast_lambda(
    step: int, lambda_max: float = 1000.0, lambda_min: float = 0.1, alpha: float = 0.01, dt: int = 1
) -> float:
    """Weight of the syntax KL term at training step ``step``:
    ``lambda_min + (lambda_max - lambda_min) * exp(-alpha * floor(step / dt))``.

    Starts at ``lambda_max`` and decays towards ``lambda_min`` in a staircase
    of width ``dt`` steps. Raises ``ValueError`` naming the bad argument
    unless ``step >= 0``, ``dt >= 1``, ``alpha >= 0`` and
    ``lambda_max >= lambda_min >= 0``.
    """
    # "not (x >= y)" also rejects NaN.
    if not step >= 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not dt >= 1:
        raise ValueError(f"dt must be >= 1, got {dt}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not lambda_min >= 0:
        raise ValueError(f"lambda_min must be >= 0, got {lambda_min}")
    if not lambda_max >= lambda_min:
        raise ValueError(f"lambda_max must be >= lambda_min ({lambda_min}), got {lambda_max}")
    k = math.floor(step / dt)
    return lambda_min + (lambda_max - lambda_min) * math.exp(-alpha * k)


def kl_at_positions(
    junior_logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-record sum of ``KL(p_junior || p_ref)`` over the masked positions.

    ``junior_logits`` and ``ref_logits`` are ``[B, T, V]``, ``mask`` is
    ``[B, T]`` (bool or 0/1); returns float32 ``[B]`` (zeros where a record
    has no masked position). ``p = softmax(logits)`` in float32; logits must
    be finite. Differentiable w.r.t. ``junior_logits`` only (``ref_logits``
    is detached); row ``b``'s result depends only on row ``b``.
    """
    if junior_logits.dim() != 3 or junior_logits.shape != ref_logits.shape:
        raise ValueError(
            f"logits must both be [B, T, V], got {tuple(junior_logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
        )
    if mask.shape != junior_logits.shape[:2]:
        raise ValueError(
            f"mask must be [B, T] = {tuple(junior_logits.shape[:2])}, got {tuple(mask.shape)}"
        )
    rows, cols = mask.to(device=junior_logits.device, dtype=torch.bool).nonzero(as_tuple=True)
    # Only the selected [N, V] rows are upcast and softmaxed: a full [B, T, V]
    # float32 copy would dominate memory for a large vocabulary.
    log_pj = torch.log_softmax(junior_logits[rows, cols].float(), dim=-1)
    log_pr = torch.log_softmax(ref_logits.detach()[rows, cols].float(), dim=-1)
    kl = (log_pj.exp() * (log_pj - log_pr)).sum(dim=-1)
    out = torch.zeros(junior_logits.shape[0], dtype=torch.float32, device=junior_logits.device)
    # Out-of-place index_add keeps the graph; with an empty mask it is zeros
    # that are still connected to junior_logits (backward works, grads are 0).
    return out.index_add(0, rows, kl)
