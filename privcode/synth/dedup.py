"""Stage II exact and near-duplicate removal, streaming (one stateful object per Ray actor).

:func:`normalize_code` re-renders code from its :mod:`tokenize` tokens (comments, blank lines
and docstrings dropped, tokens one space apart, four spaces per indent level; code that does
not tokenize: whitespace collapsed). Exact duplicates: equal sha256 of that text. Near: MinHash
over 5-shingles of normalised tokens (blake2b token hashes; permutation ``h_i(x) = ((a_i x +
b_i) mod 2^64) >> 32``, odd seeded ``a_i``), LSH candidates (``bands x rows <= num_perm``,
weighted towards recall) confirmed by the estimated Jaccard >= ``threshold`` (the most
similar, then earliest, is reported). Only kept items are remembered and matched against: A
kept, B ~ A dropped, C ~ B but not ~ A gives C kept. ``state_dict`` / ``load_state_dict``
restore the state in a resumed run. Design notes: docs/methods.md, "synth/dedup.py".
"""

from __future__ import annotations

import hashlib
import io
import tokenize
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["Deduplicator", "lsh_params", "normalize_code"]

FORMAT = "privcode-dedup/1"
_DROP = frozenset({tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER})
_STMT_START = frozenset({tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT})
_SHINGLE_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: the combination is invertible per step
_CHUNK_SHINGLES = 1 << 15  # bounds the (num_perm, shingles) work matrix
_EMPTY = np.uint32(0xFFFFFFFF)


def _tokens(code: str) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO(code).readline))
    except Exception:  # TokenError, IndentationError, SyntaxError...: not tokenizable
        return None


def normalize_code(code: str) -> str:
    """Comments, docstrings and layout removed (see the module docstring); never raises."""
    code = code if isinstance(code, str) else str(code)
    toks = _tokens(code)
    if toks is None:
        return " ".join(code.split())
    sig = [t for t in toks if t.type not in _DROP]
    lines: list[str] = []
    line: list[str] = []
    depth, i = 0, 0
    while i < len(sig):
        t = sig[i]
        if t.type == tokenize.STRING and (i == 0 or sig[i - 1].type in _STMT_START):
            j = i
            while j < len(sig) and sig[j].type == tokenize.STRING:
                j += 1  # implicit concatenation: "a" "b"
            if j == len(sig) or sig[j].type == tokenize.NEWLINE:
                i = j + 1  # a bare string statement (docstring): drop it and its NEWLINE
                continue
        if t.type == tokenize.INDENT:
            depth += 1
        elif t.type == tokenize.DEDENT:
            depth = max(depth - 1, 0)
        elif t.type == tokenize.NEWLINE:
            if line:
                lines.append("    " * depth + " ".join(line))
            line = []
        else:
            line.append(t.string)
        i += 1
    if line:
        lines.append("    " * depth + " ".join(line))
    return "\n".join(lines)


@lru_cache(maxsize=1 << 16)
def _token_hash(token: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(token.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


def _shingle_hashes(normalized: str, k: int) -> np.ndarray:
    """64-bit hashes of the token k-shingles (one shingle of all tokens if fewer than k)."""
    words = normalized.split()
    if not words:
        return np.empty(0, dtype=np.uint64)
    t = np.fromiter((_token_hash(w) for w in words), dtype=np.uint64, count=len(words))
    k = min(k, len(t))
    n = len(t) - k + 1
    with np.errstate(over="ignore"):  # uint64 arithmetic is meant to wrap (mod 2^64)
        h = t[:n].copy()
        for j in range(1, k):
            h = h * _SHINGLE_MUL + t[j : j + n]
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return np.unique(h)


@lru_cache(maxsize=32)
def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.05) -> tuple[int, int]:
    """(bands, rows) minimising ``fp_weight`` * false-positive + (1 - it) * false-negative area."""
    s_lo = np.linspace(0.0, threshold, 201)
    s_hi = np.linspace(threshold, 1.0, 201)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = np.trapezoid(1 - (1 - s_lo**r) ** b, s_lo)
            fn = np.trapezoid((1 - s_hi**r) ** b, s_hi)
            err = fp_weight * fp + (1.0 - fp_weight) * fn
            if err < best_err - 1e-12:
                best, best_err = (b, r), err
    return best


class Deduplicator:
    """Streaming exact + MinHash-LSH near-duplicate detector (see the module docstring)."""

    def __init__(
        self, threshold: float = 0.85, num_perm: int = 64, shingle: int = 5, seed: int = 0
    ) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if num_perm < 2 or shingle < 1:
            raise ValueError("num_perm must be >= 2 and shingle >= 1")
        self.threshold, self.num_perm = float(threshold), int(num_perm)
        self.shingle, self.seed = int(shingle), int(seed)
        self.bands, self.rows = lsh_params(self.threshold, self.num_perm)
        rng = np.random.default_rng(self.seed)
        self._a = rng.integers(0, 2**63, self.num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(
            1
        )
        self._b = rng.integers(0, 2**63, self.num_perm, dtype=np.uint64)
        self._reset()

    def _reset(self) -> None:
        self._ids: list[str] = []
        self._sha: dict[str, int] = {}  # sha256 -> index of the kept item
        self._sha_list: list[str] = []
        self._sigs = np.empty((64, self.num_perm), dtype=np.uint32)
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(self.bands)]

    def __len__(self) -> int:
        """Number of kept items."""
        return len(self._ids)

    @property
    def config(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "num_perm": self.num_perm,
            "shingle": self.shingle,
            "seed": self.seed,
            "bands": self.bands,
            "rows": self.rows,
        }

    # ------------------------------------------------------------------ signatures

    def signatures(self, normalized: Sequence[str]) -> np.ndarray:
        """MinHash signatures (n, num_perm) uint32; an item without tokens gets all 0xFFFFFFFF."""
        out = np.full((len(normalized), self.num_perm), _EMPTY, dtype=np.uint32)
        hashes = [_shingle_hashes(text, self.shingle) for text in normalized]
        items = [i for i, h in enumerate(hashes) if len(h)]
        start = 0
        while start < len(items):
            # Take items until the chunk holds ~_CHUNK_SHINGLES shingles (at least one item).
            end, total = start, 0
            while end < len(items) and (
                end == start or total + len(hashes[items[end]]) <= _CHUNK_SHINGLES
            ):
                total += len(hashes[items[end]])
                end += 1
            chunk = items[start:end]
            flat = np.concatenate([hashes[i] for i in chunk])
            offsets = np.cumsum([0] + [len(hashes[i]) for i in chunk[:-1]])
            with np.errstate(over="ignore"):
                perm = (self._a[:, None] * flat[None, :] + self._b[:, None]) >> np.uint64(32)
            out[chunk] = np.minimum.reduceat(perm, offsets, axis=1).T.astype(np.uint32)
            start = end
        return out

    def _band_keys(self, sig: np.ndarray) -> list[bytes]:
        r = self.rows
        return [sig[i * r : (i + 1) * r].tobytes() for i in range(self.bands)]

    # ------------------------------------------------------------------ streaming

    def _near(self, sig: np.ndarray) -> int | None:
        cands: set[int] = set()
        for band, key in zip(self._buckets, self._band_keys(sig), strict=True):
            cands.update(band.get(key, ()))
        if not cands:
            return None
        idx = np.fromiter(sorted(cands), dtype=np.int64, count=len(cands))
        est = (self._sigs[idx] == sig).mean(axis=1)
        best = int(np.argmax(est))  # first maximum: the earliest among equally similar items
        return int(idx[best]) if est[best] >= self.threshold else None

    def _keep(self, item_id: str, sha: str, sig: np.ndarray) -> None:
        n = len(self._ids)
        if n == len(self._sigs):
            self._sigs = np.concatenate([self._sigs, np.empty_like(self._sigs)])
        self._sigs[n] = sig
        self._ids.append(item_id)
        self._sha[sha] = n
        self._sha_list.append(sha)
        if (sig != _EMPTY).any():  # an item without tokens is matched by sha256 only
            for band, key in zip(self._buckets, self._band_keys(sig), strict=True):
                band.setdefault(key, []).append(n)

    def add(self, ids: Sequence[str], codes: Sequence[str]) -> list[str | None]:
        """Per item: None when kept (new), else the id of the kept item it duplicates."""
        if len(ids) != len(codes):
            raise ValueError(f"got {len(ids)} ids for {len(codes)} codes")
        normalized = [normalize_code(c) for c in codes]
        shas = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).hexdigest() for t in normalized]
        sigs = self.signatures(normalized)
        out: list[str | None] = []
        for item_id, sha, sig in zip(ids, shas, sigs, strict=True):
            hit = self._sha.get(sha)
            if hit is None and (sig != _EMPTY).any():
                hit = self._near(sig)
            if hit is None:
                self._keep(str(item_id), sha, sig)
            out.append(None if hit is None else self._ids[hit])
        return out

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Config, kept ids and sha256 (JSON-serialisable) and signatures (numpy uint32)."""
        n = len(self._ids)
        return {
            "format": FORMAT,
            "config": self.config,
            "ids": list(self._ids),
            "sha256": list(self._sha_list),
            "signatures": self._sigs[:n].copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state with one from :meth:`state_dict` (same config required)."""
        if state.get("format") != FORMAT:
            raise ValueError(f"not a deduplicator state (format {state.get('format')!r})")
        if dict(state["config"]) != self.config:
            raise ValueError(
                f"state was saved with {state['config']}, this deduplicator has {self.config}"
            )
        sigs = np.asarray(state["signatures"], dtype=np.uint32).reshape(-1, self.num_perm)
        ids, shas = list(state["ids"]), list(state["sha256"])
        if not len(ids) == len(shas) == len(sigs):
            raise ValueError("inconsistent state: ids, sha256 and signatures differ in length")
        self._reset()
        for item_id, sha, sig in zip(ids, shas, sigs, strict=True):
            self._keep(str(item_id), str(sha), sig)
