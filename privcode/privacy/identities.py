"""A record's identities: what makes two training rows "the same record" to the privacy store.
Design notes: docs/privacy.md, "privcode/privacy/identities.py".

Each record has :data:`PER_RECORD` keyed identities of 16 bytes, one row of an
``(n, PER_RECORD, 16)`` uint8 array: ``exact`` (:data:`EXACT`: the canonical-text fingerprint,
:func:`~privcode.privacy.store.record_fingerprint`), ``code`` (:data:`CODE`: the code's
``\\w+|[^\\w\\s]`` tokens, ``'`` read as ``"``, no comma before a closing bracket; no prompt),
``row`` (:data:`ROW`: ``(tokens(p) ++ tokens(c) ++ [EOS])[:max_length]`` and segment ids under
:func:`tokenizer_id`; ``exact`` again without rows) and :data:`BANDS` MinHash bands
(:data:`FIRST_BAND` + i) of the code's 5-token shingles: keyed bijections
``g = ((x xor b_k) * a_k) mod 2^32``, ``h_k(x) = g xor (g >> 15)``, ``s_k = min_x h_k(x)``, so
``Pr[s_k(A) = s_k(B)] = J(A, B)``; ``r`` rows a band, ``b`` bands: some band shared with
probability ``1 - (1 - J^r)^b`` (0.994 at J = 0.85 for r = 8, b = 16). Keyed: ``code``, ``row``
are ``AES_k(SHA-256(label || message)[:16])``, band i the CBC-MAC
``AES_k(AES_k(AES_k(tweak_i) ^ v_1) ^ v_2)``, one key per kind from the store's record key.
A collision only joins records (over-counts), never splits one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from privcode.errors import AccountingError
from privcode.privacy.store import FINGERPRINT_BYTES, canonical_text, record_fingerprint

__all__ = [
    "BANDS",
    "CODE",
    "EXACT",
    "FIRST_BAND",
    "KINDS",
    "PER_RECORD",
    "ROW",
    "ROWS_PER_BAND",
    "SCHEME",
    "IdentityKeys",
    "as_identities",
    "duplicated_kinds",
    "keys_of",
    "normal_code",
    "pack_identities",
    "record_identities",
    "signatures",
    "tokenizer_id",
    "unpack_identities",
]

#: The identity scheme (kinds, normalisation, shingles, bands); logged with every job.
SCHEME = "privcode-identities/1"
SHINGLE = 5
ROWS_PER_BAND, BANDS = 8, 16
NUM_PERM = ROWS_PER_BAND * BANDS
EXACT, CODE, ROW, FIRST_BAND = 0, 1, 2, 3
PER_RECORD = FIRST_BAND + BANDS
KINDS = ("exact", "code", "row", *(f"band{i}" for i in range(BANDS)))

_TOKEN = re.compile(r"\w+|[^\w\s]")
_TRAILING_COMMA = re.compile(r" ,(?= [)\]}])")
_QUOTES = str.maketrans({"'": '"'})
_MIX = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.uint32(0xFFFFFFFF)
_CHUNK_SHINGLES = 1 << 14  # bounds the (shingles, NUM_PERM) work matrix (16 MB)


def _aes(key: bytes, blocks: np.ndarray) -> np.ndarray:
    """AES-256 of every 16-byte row of ``blocks`` (ECB: the block cipher on each alone)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    data = np.ascontiguousarray(blocks, dtype=np.uint8).tobytes()
    return np.frombuffer(enc.update(data) + enc.finalize(), np.uint8).reshape(-1, 16)


def _keystream(key: bytes, nbytes: int) -> bytes:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    return enc.update(bytes(nbytes)) + enc.finalize()


@dataclass(frozen=True)
class IdentityKeys:
    """The keys of one store's identities, derived from its record key (one per kind)."""

    record: bytes  #: the record key of the ``exact`` fingerprint
    code: bytes
    row: bytes
    band: bytes
    a: np.ndarray  #: the permutations' odd multipliers (NUM_PERM uint32)
    b: np.ndarray  #: and their xor masks

    @classmethod
    def derive(cls, record_key: bytes) -> IdentityKeys:
        def sub(kind: str) -> bytes:
            return hmac.digest(record_key, f"privcode-identity/{kind}/1".encode(), "sha256")

        ab = np.frombuffer(_keystream(sub("minhash"), 8 * NUM_PERM), "<u4").astype(np.uint32)
        a, b = ab[:NUM_PERM] | np.uint32(1), ab[NUM_PERM:]
        return cls(record_key, sub("code"), sub("row"), sub("band"), a, b)


def tokenizer_id(tokenizer: Any) -> str:
    """A digest of a tokenizer's whole definition (vocabulary, merges, normaliser, EOS).

    Two tokenizers with the same id encode every text alike, so equal rows under
    equal ids are the same training content.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    head = f"{type(tokenizer).__name__}|eos={getattr(tokenizer, 'eos_token_id', None)}|"
    return hashlib.sha256((head + text).encode("utf-8", "surrogatepass")).hexdigest()


def normal_code(tokens: Sequence[str]) -> str:
    """The code identity's text: tokens joined by one space, ``'`` read as ``"``, no
    comma before a closing bracket (``f(a, b,)`` and ``f(a, b)`` are one code)."""
    return _TRAILING_COMMA.sub("", " ".join(tokens).translate(_QUOTES))


def _digests(label: bytes, messages: Iterable[bytes], n: int) -> np.ndarray:
    """``SHA-256(label || m)[:16]`` of each message, as an ``(n, 16)`` array."""
    blob = b"".join(hashlib.sha256(label + m).digest()[:16] for m in messages)
    return np.frombuffer(blob, np.uint8).reshape(n, 16)


def _row_bytes(row: Any) -> bytes:
    """A training row (``.input_ids`` and ``.segments``, or a pair) as bytes."""
    ids, segments = (row.input_ids, row.segments) if hasattr(row, "input_ids") else row
    return struct.pack(f"<I{len(ids)}I", len(ids), *ids) + bytes(segments)


# --------------------------------------------------------------------------- MinHash


def _fmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64 that spreads every bit)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _shingles(tokens: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """(hash of every shingle, the record it belongs to), records in order.

    A shingle is a run of :data:`SHINGLE` tokens (the whole list when shorter:
    ingest's rule); its hash mixes the tokens' CRC-32 (+1: 0 pads records
    apart) polynomially, then :func:`_fmix`. Equal shingles hash equally in
    every record and process.
    """
    n, pad = len(tokens), SHINGLE - 1
    lengths = np.fromiter(map(len, tokens), np.int64, count=n)
    flat = list(chain.from_iterable(tokens))
    vocab: dict[str, int] = dict.fromkeys(flat, 0)
    for t in vocab:
        vocab[t] = zlib.crc32(t.encode("utf-8", "surrogatepass")) + 1
    hashed = np.fromiter(map(vocab.__getitem__, flat), np.uint64, count=len(flat))
    buf = np.zeros(len(flat) + pad * (n + 1), np.uint64)  # each record, then `pad` zeros
    buf[np.arange(len(flat)) + np.repeat(pad * np.arange(n), lengths)] = hashed
    with np.errstate(over="ignore"):
        h = buf[: len(buf) - pad].copy()
        for d in range(1, SHINGLE):
            h = h * _MIX + buf[d : len(buf) - pad + d]
        h = _fmix(h)
    counts = np.where(lengths > 0, np.maximum(lengths - pad, 1), 0)
    starts = np.cumsum(lengths + pad) - (lengths + pad)
    first = np.cumsum(counts) - counts
    where = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))
    return h[where], np.repeat(np.arange(n), counts)


def signatures(tokens: Sequence[Sequence[str]], keys: IdentityKeys) -> np.ndarray:
    """MinHash signatures ``(n, NUM_PERM)`` uint32 of the records' shingle sets under the
    keyed permutations; a record without tokens gets all ``0xFFFFFFFF``."""
    n = len(tokens)
    sig = np.full((n, NUM_PERM), _EMPTY, np.uint32)
    h64, owner = _shingles(tokens)
    h = (h64 >> np.uint64(32)).astype(np.uint32)
    if not len(h):
        return sig
    bounds = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # each record's first
    lo = 0
    while lo < len(bounds):
        hi = int(np.searchsorted(bounds, bounds[lo] + _CHUNK_SHINGLES, side="right"))
        hi = max(hi - 1, lo + 1) if hi < len(bounds) else len(bounds)
        s0 = bounds[lo]
        s1 = bounds[hi] if hi < len(bounds) else len(h)
        with np.errstate(over="ignore"):
            perm = (h[s0:s1, None] ^ keys.b[None, :]) * keys.a[None, :]
            perm ^= perm >> np.uint32(15)
        sig[owner[bounds[lo:hi]]] = np.minimum.reduceat(perm, bounds[lo:hi] - s0, axis=0)
        lo = hi
    return sig


def _bands(sig: np.ndarray, keys: IdentityKeys) -> np.ndarray:
    """Band identities ``(n, BANDS, 16)``: CBC-MAC under ``keys.band`` of each band's
    values, its first block a per-band tweak (module docstring)."""
    n = len(sig)
    values = np.ascontiguousarray(sig.reshape(n * BANDS, ROWS_PER_BAND).astype("<u4"))
    raw = values.view(np.uint8).reshape(n * BANDS, -1)
    width = -(-raw.shape[1] // 16) * 16
    if width != raw.shape[1]:
        raw = np.pad(raw, ((0, 0), (0, width - raw.shape[1])))
    tweaks = np.zeros((BANDS, 16), np.uint8)
    tweaks[:, :8] = np.frombuffer(b"prvcband", np.uint8)
    tweaks[:, 8:] = np.arange(BANDS, dtype=">u8").view(np.uint8).reshape(BANDS, 8)
    state = np.tile(_aes(keys.band, tweaks), (n, 1))
    for j in range(0, width, 16):
        state = _aes(keys.band, state ^ raw[:, j : j + 16])
    return state.reshape(n, BANDS, 16)


# --------------------------------------------------------------------------- identities


def record_identities(
    keys: IdentityKeys,
    records: Iterable[tuple[str, str]],
    rows: Sequence[Any] | None = None,
    tokenizer: str = "",
) -> np.ndarray:
    """The identities ``(n, PER_RECORD, 16)`` uint8 of ``(prompt, code)`` records.

    ``rows``: each record's encoded training row (``.input_ids``, ``.segments``), in
    the same order, with ``tokenizer`` its tokenizer's :func:`tokenizer_id`; None:
    the ``row`` column repeats ``exact``.
    """
    pairs = list(records)
    n = len(pairs)
    out = np.empty((n, PER_RECORD, 16), np.uint8)
    if not n:
        return out
    exact = b"".join(record_fingerprint(keys.record, p, c) for p, c in pairs)
    out[:, EXACT] = np.frombuffer(exact, np.uint8).reshape(n, 16)
    tokens = [_TOKEN.findall(canonical_text(c)) for _, c in pairs]
    normal = (normal_code(t).encode("utf-8", "surrogatepass") for t in tokens)
    out[:, CODE] = _aes(keys.code, _digests(b"privcode-code/1\0", normal, n))
    if rows is None:
        out[:, ROW] = out[:, EXACT]
    else:
        if len(rows) != n:
            raise AccountingError(f"{len(rows)} training rows for {n} records")
        label = b"privcode-row/1\0" + tokenizer.encode() + b"\0"
        out[:, ROW] = _aes(keys.row, _digests(label, map(_row_bytes, rows), n))
    out[:, FIRST_BAND:] = _bands(signatures(tokens, keys), keys)
    empty = np.fromiter((not t for t in tokens), bool, count=n)
    out[empty, FIRST_BAND:] = out[empty, CODE][:, None, :]
    return out


def as_identities(records: Any) -> np.ndarray:
    """``(n, m, 16)`` identities from an identity array or 16-byte fingerprints (m = 1)."""
    if isinstance(records, np.ndarray):
        if records.ndim != 3 or records.shape[2] != FINGERPRINT_BYTES:
            raise AccountingError(f"identities must be (n, m, {FINGERPRINT_BYTES}) bytes")
        return records
    fps = list(records)
    if any(not isinstance(fp, bytes) or len(fp) != FINGERPRINT_BYTES for fp in fps):
        raise AccountingError(f"a fingerprint must be {FINGERPRINT_BYTES} bytes")
    return np.frombuffer(b"".join(fps), np.uint8).reshape(len(fps), 1, FINGERPRINT_BYTES)


def keys_of(ids: np.ndarray) -> np.ndarray:
    """The first 64 bits of every identity, ``(n, m)`` uint64 (big-endian: byte order).

    In memory an identity is its first 64 bits: two identities equal there are
    one (over-counts with probability ~ k^2 / 2^65 for k identities, never
    under-counts).
    """
    head = np.ascontiguousarray(ids[..., :8])
    return head.view(">u8")[..., 0].astype(np.uint64)


def pack_identities(ids: np.ndarray) -> bytes:
    """Records sorted by ``exact`` identity, one of each (a job's records, order-free)."""
    ids = as_identities(ids)
    if not len(ids):
        return b""
    words = np.ascontiguousarray(ids[:, EXACT]).view(">u8").astype(np.uint64)
    order = np.lexsort((words[:, 1], words[:, 0]))
    words, ids = words[order], ids[order]
    keep = np.r_[True, (words[1:] != words[:-1]).any(axis=1)]
    return np.ascontiguousarray(ids[keep]).tobytes()


def unpack_identities(blob: bytes, per_record: int = 1) -> np.ndarray:
    """The inverse of :func:`pack_identities` (``per_record`` identities a record)."""
    width = per_record * FINGERPRINT_BYTES
    if per_record < 1 or len(blob) % width:
        raise AccountingError(
            f"identities must be a whole number of {per_record} x {FINGERPRINT_BYTES}-byte entries"
        )
    return np.frombuffer(blob, np.uint8).reshape(-1, per_record, FINGERPRINT_BYTES)


def duplicated_kinds(ids: np.ndarray) -> list[str]:
    """The exact kinds (``exact``, ``code``, ``row``) some two records of ``ids`` share."""
    out = []
    for col in (EXACT, CODE, ROW):
        if col < ids.shape[1]:
            keys = keys_of(ids[:, col : col + 1])[:, 0]
            if len(np.unique(keys)) < len(keys):
                out.append(KINDS[col])
    return out
