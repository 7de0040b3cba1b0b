"""The public pretraining corpus of the base model, its held-out split, token streams.

Only :func:`privcode.data.stdlib.public_source_files` is read here: the
private demo corpus is built from the other stdlib modules, and the base
model must never see them (the audits attribute any reproduction of private
code to DP fine-tuning). :func:`public_corpus` re-checks the split so that a
change in ``stdlib.py`` can never leak a private module silently.

Determinism:

* The held-out slice (:func:`split_heldout`) depends only on the file paths,
  not on the seed or the preset, so every build is evaluated on the same
  files and the bits-per-byte numbers of different presets are comparable.
* The training order of files depends only on the seed.
"""

from __future__ import annotations

import ast
import io
import math
import random
import textwrap
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from privcode.data.stdlib import PRIVATE_MODULES, public_source_files, stdlib_dir
from privcode.utils import sha256_bytes, stable_hash

__all__ = [
    "SourceFile",
    "function_units",
    "public_corpus",
    "split_heldout",
    "corpus_fingerprint",
    "shuffled",
    "token_stream",
    "batches",
    "evaluate_loss",
    "texts_of",
    "relpaths",
    "modules",
]


@dataclass(frozen=True)
class SourceFile:
    """One public stdlib file: path relative to the stdlib root, top-level module, text."""

    relpath: str
    module: str
    text: str


def public_corpus() -> list[SourceFile]:
    """Every public source file, read as UTF-8, in a deterministic (sorted) order.

    Raises ``RuntimeError`` if a file of a private module shows up: that
    would be a bug in the split, and training on it would invalidate audits.
    """
    root = stdlib_dir()
    private = set(PRIVATE_MODULES)
    files = []
    for path in public_source_files():
        rel = path.relative_to(root)
        head = rel.parts[0]
        module = head[:-3] if head.endswith(".py") else head
        if module in private:
            raise RuntimeError(f"public corpus contains private module {module!r} ({rel})")
        # Stdlib sources are UTF-8 (PEP 3120); "replace" only guards against a
        # patched installation and keeps the build going.
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            files.append(SourceFile(rel.as_posix(), module, text))
    if not files:
        raise RuntimeError(f"no public source files found under {root}")
    return files


def split_heldout(
    files: Sequence[SourceFile], fraction: float = 0.03
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, heldout): the ``fraction`` of files with the smallest path hashes is held out.

    At least one file is held out. Both lists keep the input order.
    """
    n_heldout = max(1, round(fraction * len(files)))
    ranked = sorted(files, key=lambda f: stable_hash(["heldout", f.relpath]))
    held = {f.relpath for f in ranked[:n_heldout]}
    return ([f for f in files if f.relpath not in held], [f for f in files if f.relpath in held])


#: Function units: lines of one unit (signature to last line, decorators excluded).
UNIT_LINES = (2, 60)
#: Function units whose tokens are more than this share of string and number
#: literals (lookup tables, test vectors) are left out: they teach a small model
#: to write literal soup instead of code.
MAX_LITERAL_SHARE = 0.25


def _literal_share(code: str) -> float:
    """Share of code tokens that are number or (non-docstring) string literals; 1.0 if untokenizable."""
    skip = {
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.COMMENT,
        tokenize.ENDMARKER,
    }
    n = lit = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in skip:
                continue
            n += 1
            if tok.type == tokenize.NUMBER or (
                tok.type == tokenize.STRING
                and not tok.string.lstrip("rRbBuUfF").startswith(('"""', "'''"))
            ):
                lit += 1
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return 1.0
    return lit / max(n, 1)


def function_units(files: Sequence[SourceFile]) -> list[SourceFile]:
    """Every function and method of ``files``, dedented, as its own unit, in file order.

    The base model is pretrained on these rather than on whole files: the
    junior and Stage II generate one function after an end-of-text token,
    which is exactly the shape of a unit in the packed stream (unit, EOS,
    unit, ...). Measured on the demo preset at the same step count: 47 of 64
    samples after "def" compile into a function, against 0 of 64 for the
    whole-file stream (held-out whole-file loss 5.32 vs 5.44 nats/token).
    Units of fewer or more lines than :data:`UNIT_LINES`, and literal-heavy
    ones (:data:`MAX_LITERAL_SHARE`), are left out. ``relpath`` is
    ``<file>::<line>``. Public files only, like every input of the base.
    """
    out = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except (SyntaxError, ValueError):
            continue
        lines = f.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            text = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
            if not UNIT_LINES[0] <= text.count("\n") <= UNIT_LINES[1]:
                continue
            if _literal_share(text) > MAX_LITERAL_SHARE:
                continue
            out.append(SourceFile(f"{f.relpath}::{node.lineno}", f.module, text))
    return out


def corpus_fingerprint(files: Sequence[SourceFile]) -> str:
    """Hash of every file's path and content: a different stdlib is a different build."""
    return stable_hash([[f.relpath, sha256_bytes(f.text.encode("utf-8"))] for f in files])


def shuffled(files: Sequence[SourceFile], seed: int) -> list[SourceFile]:
    """The files in a seed-determined order (independent of Python's hash seed)."""
    out = list(files)
    random.Random(seed).shuffle(out)
    return out


def token_stream(
    tokenizer, files: Sequence[SourceFile], max_tokens: int | None = None, batch_files: int = 16
) -> tuple[torch.Tensor, int]:
    """Concatenate the files' tokens, each file followed by EOS, as one int64 tensor.

    Stops after the first batch of files that reaches ``max_tokens`` (the
    tensor is then cut to exactly ``max_tokens``), so a short build only pays
    for the text it uses. Returns (tokens, number of files tokenized).
    """
    backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else None
    eos = tokenizer.eos_token_id
    parts: list[torch.Tensor] = []
    total = used = 0
    for start in range(0, len(files), batch_files):
        texts = [f.text for f in files[start : start + batch_files]]
        if backend is not None:
            # The Rust batch encoder is parallel and skips Python-side overhead.
            ids_list = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids_list = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        for ids in ids_list:
            ids = list(ids) + ([eos] if eos is not None else [])
            parts.append(torch.tensor(ids, dtype=torch.long))
            total += len(ids)
            used += 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    return stream, used


def batches(
    stream: torch.Tensor, seq_len: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless (batch_size, seq_len) batches of packed, non-overlapping windows.

    Window order is reshuffled every epoch by a generator seeded with
    ``seed``; the tail shorter than ``seq_len`` is dropped.
    """
    n_windows = stream.numel() // seq_len
    if n_windows < 1:
        raise ValueError(
            f"token stream of {stream.numel()} tokens is shorter than one sequence of {seq_len}"
        )
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    pos = 0
    while True:
        if pos + batch_size > order.numel():
            # Carry the unused remainder over so no window is skipped.
            order = torch.cat([order[pos:], torch.randperm(n_windows, generator=gen)])
            pos = 0
            continue
        yield windows[order[pos : pos + batch_size]]
        pos += batch_size


@torch.no_grad()
def evaluate_loss(
    model, tokenizer, stream: torch.Tensor, seq_len: int, max_tokens: int, batch_size: int = 8
) -> dict:
    """Mean next-token cross-entropy (nats) of ``model`` on packed windows of ``stream``.

    Uses up to ``max_tokens`` tokens in non-overlapping windows of
    ``seq_len``; the first token of each window is context only. Also
    returns bits per UTF-8 byte of the predicted text (comparable across
    tokenizers). The model's train/eval mode is restored afterwards.
    """
    usable = min(stream.numel(), max_tokens)
    seq_len = min(seq_len, usable)
    n_windows = usable // seq_len if seq_len > 1 else 0
    if n_windows < 1:
        raise ValueError("held-out stream too short to evaluate")
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats = 0.0
    n_tokens = n_bytes = 0
    try:
        for start in range(0, n_windows, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)),
                batch[:, 1:].reshape(-1),
                reduction="sum",
            )
            nats += float(loss)
            n_tokens += batch[:, 1:].numel()
            for row in batch[:, 1:].tolist():
                n_bytes += len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8"))
    finally:
        model.train(was_training)
    loss = nats / n_tokens
    return {
        "loss": loss,
        "bits_per_byte": nats / math.log(2) / max(n_bytes, 1),
        "tokens": n_tokens,
    }


def texts_of(files: Sequence[SourceFile]) -> Iterator[str]:
    """The files' texts (an iterator, for tokenizer training)."""
    return (f.text for f in files)


def relpaths(files: Sequence[SourceFile]) -> list[str]:
    return [f.relpath for f in files]


def modules(files: Sequence[SourceFile]) -> list[str]:
    """Sorted distinct top-level modules of ``files``."""
    return sorted({f.module for f in files})
