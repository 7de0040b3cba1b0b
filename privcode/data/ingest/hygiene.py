"""What a data owner expects before training on their code: stable ids, no duplicates,
a held-out split by file, and a count of the secrets and PII the corpus holds.

:func:`record_id`: a record's id from its origin and content, keyed (an HMAC under a key
derived from the privacy store's): private metadata, unconfirmable without the key.
:func:`dedup`: exact (whitespace-normalised sha256), then near duplicates (MinHash + LSH over
token shingles), the first of each group kept. :func:`split_by_file`: whole files held out,
chosen by a keyed hash. :func:`scan`: counts of secrets and PII formats per source, never a
value, a line or a record id. Design notes: docs/methods.md, "data/ingest/hygiene.py".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from privcode.data.ingest.errors import IngestError
from privcode.data.pii_formats import scan_formats

__all__ = [
    "MAX_SCAN_LINE_CHARS",
    "SCAN_FORMAT",
    "DedupResult",
    "ScanReport",
    "SourceScan",
    "dedup",
    "record_id",
    "scan",
    "shingle_hashes",
    "split_by_file",
]

_ID_TAG = "privcode-record-id/1"
SCAN_FORMAT = "privcode-scan/1"
#: Lines longer than this are not given to detect-secrets (minified or data lines: slow).
MAX_SCAN_LINE_CHARS = 1_000
_TOKEN = re.compile(r"\w+|[^\w\s]")
_MEMO_LINES = 1 << 18  # bound on the per-scan memo of lines already gated


# --------------------------------------------------------------------------- ids


def record_id(key: bytes, source: str, path: str, start: int, end: int, content: str) -> str:
    """``"r-"`` + 20 hex digits of HMAC-SHA256(``key``, a canonical encoding of the fields).

    The encoding is the compact JSON array ``[tag, source, path, start, end, content]``
    (unambiguous: no two field tuples share it). Keyed (module doc): without ``key`` an
    id says nothing of the path or the code; ``key`` is :func:`privcode.data.ingest.corpus.
    id_key` of the privacy store's ingest secret.
    """
    if len(key) < 16:
        raise ValueError("record_id: the key must hold at least 16 bytes")
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"record_id: {name} must be an integer, got {type(value).__name__}")
    payload = json.dumps(
        [_ID_TAG, str(source), str(path), start, end, str(content)],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return "r-" + hmac.new(key, payload.encode("utf-8", "surrogatepass"), "sha256").hexdigest()[:20]


# --------------------------------------------------------------------------- dedup


@dataclass(frozen=True)
class DedupResult:
    """Kept keys (input order) and, per dropped key, the kept key it duplicates."""

    kept: list[str]
    exact: dict[str, str]
    near: dict[str, str]
    seconds_exact: float = 0.0
    seconds_near: float = 0.0

    def counts(self) -> dict[str, int]:
        return {"kept": len(self.kept), "exact": len(self.exact), "near": len(self.near)}


def _exact_key(code: str) -> bytes:
    return hashlib.sha256(" ".join(code.split()).encode("utf-8", "surrogatepass")).digest()


def shingle_hashes(code: str, shingle: int = 5) -> set[int]:
    """CRC-32 of each run of ``shingle`` tokens (the whole token list if it is shorter).

    Tokens are ``re.findall(r"\\w+|[^\\w\\s]", code)``, joined by one space. CRC-32 is
    stable across processes and fast; datasketch mixes it before permuting.
    """
    tokens = _TOKEN.findall(code)
    if not tokens:
        return set()
    if len(tokens) <= shingle:
        return {zlib.crc32(" ".join(tokens).encode("utf-8", "surrogatepass"))}
    runs = zip(*(tokens[j:] for j in range(shingle)), strict=False)
    return {zlib.crc32(s.encode("utf-8", "surrogatepass")) for s in map(" ".join, runs)}


def _identity(value: int) -> int:
    return value


def dedup(
    items: Sequence[tuple[str, str]],
    *,
    threshold: float = 0.85,
    num_perm: int = 128,
    shingle: int = 5,
) -> DedupResult:
    """Drop exact, then near duplicates of ``(key, code)`` items; keep the first of each.

    Exact: equal sha256 of the code with whitespace runs collapsed. Near: MinHash
    (``num_perm`` permutations, seed 1) of the token shingles (:func:`shingle_hashes`),
    candidates from ``MinHashLSH(threshold, num_perm)`` banded for recall, confirmed by the
    estimated Jaccard >= ``threshold`` (the most similar, then earliest, kept item is named).
    Only kept items are indexed. Banding and timings: docs/methods.md,
    "data/ingest/hygiene.py".
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if num_perm < 2 or shingle < 1:
        raise ValueError(f"num_perm must be >= 2 and shingle >= 1, got {num_perm}, {shingle}")
    t0 = time.perf_counter()
    seen: dict[str, int] = {}
    first_by_hash: dict[bytes, str] = {}
    exact: dict[str, str] = {}
    unique: list[tuple[str, str]] = []
    for i, (key, code) in enumerate(items):
        if key in seen:
            raise ValueError(f"dedup: item {i} has the key of item {seen[key]} (keys must differ)")
        seen[key] = i
        first = first_by_hash.setdefault(_exact_key(code), key)
        if first != key:
            exact[key] = first
        else:
            unique.append((key, code))
    t1 = time.perf_counter()
    kept, near = _near_dedup(unique, threshold, num_perm, shingle)
    t2 = time.perf_counter()
    return DedupResult(kept, exact, near, seconds_exact=t1 - t0, seconds_near=t2 - t1)


def _near_dedup(
    unique: list[tuple[str, str]], threshold: float, num_perm: int, shingle: int
) -> tuple[list[str], dict[str, str]]:
    import datasketch as ds

    lsh = ds.MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.05, 0.95))
    sets = [shingle_hashes(code, shingle) for _, code in unique]
    sketches = ds.MinHash.generator(sets, num_perm=num_perm, seed=1, hashfunc=_identity)
    kept: list[str] = []
    near: dict[str, str] = {}
    kept_sketch: dict[str, Any] = {}
    order: dict[str, int] = {}
    for (key, _), hashes, sketch in zip(unique, sets, sketches, strict=True):
        if hashes:  # code without tokens is matched by its exact hash only
            scored = [
                (float(sketch.jaccard(kept_sketch[str(c)])), -order[str(c)], str(c))
                for c in lsh.query(sketch)
            ]
            if scored:
                sim, _, best = max(scored)  # the most similar, then the earliest
                if sim >= threshold:
                    near[key] = best
                    continue
            lsh.insert(key, sketch)
            kept_sketch[key] = sketch
        order[key] = len(kept)
        kept.append(key)
    return kept, near


# --------------------------------------------------------------------------- split


def split_by_file(
    groups: Mapping[str, Sequence[str]], heldout_fraction: float, seed_key: bytes
) -> tuple[set[str], set[str]]:
    """(train ids, held-out ids): whole files held out until the fraction of records is met.

    ``groups`` maps a file key to its record ids. Files are ordered by
    HMAC-SHA256(``seed_key``, file key) and taken in that order until the held-out
    records reach ``heldout_fraction`` of all (so it may overshoot by up to one
    file's records); with two or more files at least one is held out and at least
    one kept. Deterministic for a given key; another key gives another split.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise IngestError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not isinstance(seed_key, bytes | bytearray) or not seed_key:
        raise IngestError("split_by_file: seed_key must be non-empty bytes (a secret)")
    key = bytes(seed_key)
    files = [(k, list(ids)) for k, ids in groups.items() if ids]
    total = sum(len(ids) for _, ids in files)

    def rank(item: tuple[str, list[str]]) -> tuple[bytes, str]:
        return hmac.new(key, item[0].encode("utf-8", "surrogatepass"), "sha256").digest(), item[0]

    ranked = sorted(files, key=rank)
    heldout: set[str] = set()
    for _, ids in ranked[:-1]:  # the last file always trains; the first is always held out
        heldout.update(ids)
        if len(heldout) >= heldout_fraction * total:
            break
    train = {i for _, ids in files for i in ids} - heldout
    return train, heldout


# --------------------------------------------------------------------------- scan


@dataclass(frozen=True)
class SourceScan:
    """Counts for one source (or all): records, records with findings, findings by kind."""

    records: int = 0
    records_with_secrets: int = 0
    records_with_pii: int = 0
    secrets: dict[str, int] = field(default_factory=dict)
    pii: dict[str, int] = field(default_factory=dict)
    long_lines_skipped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "records_with_secrets": self.records_with_secrets,
            "records_with_pii": self.records_with_pii,
            "secrets": dict(sorted(self.secrets.items())),
            "pii": dict(sorted(self.pii.items())),
            "long_lines_skipped": self.long_lines_skipped,
        }


@dataclass(frozen=True)
class ScanReport:
    """What :func:`scan` found: counts per source and in total (never values)."""

    sources: dict[str, SourceScan]
    totals: SourceScan
    secrets_detector: str
    pii_detector: str
    seconds: float = 0.0

    @staticmethod
    def merge(reports: Sequence[ScanReport]) -> ScanReport:
        """One report of several (the scans of disjoint chunks, in any order)."""

        def add(a: SourceScan, b: SourceScan) -> SourceScan:
            return SourceScan(
                a.records + b.records,
                a.records_with_secrets + b.records_with_secrets,
                a.records_with_pii + b.records_with_pii,
                dict(sorted((Counter(a.secrets) + Counter(b.secrets)).items())),
                dict(sorted((Counter(a.pii) + Counter(b.pii)).items())),
                a.long_lines_skipped + b.long_lines_skipped,
            )

        sources: dict[str, SourceScan] = {}
        totals = SourceScan()
        for r in reports:
            for k, v in r.sources.items():
                sources[k] = add(sources.get(k, SourceScan()), v)
            totals = add(totals, r.totals)
        first = reports[0]
        return ScanReport(
            dict(sorted(sources.items())),
            totals,
            first.secrets_detector,
            first.pii_detector,
            max(r.seconds for r in reports),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable and deterministic (no timings)."""
        return {
            "format": SCAN_FORMAT,
            "counts_only": True,
            "detectors": {"secrets": self.secrets_detector, "pii": self.pii_detector},
            "totals": self.totals.to_dict(),
            "sources": {k: self.sources[k].to_dict() for k in sorted(self.sources)},
        }


class _Tally:
    def __init__(self) -> None:
        self.records = self.with_secrets = self.with_pii = self.long_lines = 0
        self.secrets: Counter[str] = Counter()
        self.pii: Counter[str] = Counter()

    def add(self, secrets: Counter[str], pii: Counter[str], long_lines: int) -> None:
        self.records += 1
        self.with_secrets += bool(secrets)
        self.with_pii += bool(pii)
        self.long_lines += long_lines
        self.secrets.update(secrets)
        self.pii.update(pii)

    def freeze(self) -> SourceScan:
        return SourceScan(
            self.records,
            self.with_secrets,
            self.with_pii,
            dict(sorted(self.secrets.items())),
            dict(sorted(self.pii.items())),
            self.long_lines,
        )


class _SecretScanner:
    """detect-secrets' line scanner (file-scan semantics) with an exact cheap pre-check.

    A record's lines go to detect-secrets' own line-based scan (all default plugins and
    filters, no network verification) only when some line *may* give a finding. The
    pre-check is a superset of the plugins' raw findings, so the counts are those of the
    full scan: a plain regex plugin (the base ``analyze_line``/``analyze_string``: its
    findings are its patterns' matches) is asked by searching its own patterns, the
    keyword plugin is run only on lines holding one of its keywords (each of its
    patterns requires one; checked at start), the others (entropy, JWT) are run as they
    are. The answer is memoised per line (code repeats many lines).
    """

    FILENAME = "record.py"  # the keyword plugin reads the type from the name: quotes required

    def __init__(self) -> None:
        import detect_secrets.core.scan as ds_scan

        self._process = getattr(ds_scan, "_process_line_based_plugins", None)
        if self._process is None:
            raise IngestError(
                "the installed detect-secrets has no line-based scanner "
                "(detect_secrets.core.scan._process_line_based_plugins): use detect-secrets 1.x"
            )
        from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector
        from detect_secrets.plugins.keyword import KeywordDetector
        from detect_secrets.settings import get_plugins

        self._patterns: list[re.Pattern[str]] = []
        self._keyword: list[Any] = []
        self._direct: list[Any] = []
        for plugin in get_plugins():
            cls = type(plugin)
            if (
                isinstance(plugin, RegexBasedDetector)
                and cls.analyze_line is BasePlugin.analyze_line
                and cls.analyze_string is RegexBasedDetector.analyze_string
            ):
                self._patterns.extend(plugin.denylist)
            elif cls is KeywordDetector and self._keyword_gate_ok():
                self._keyword.append(plugin)
            else:
                self._direct.append(plugin)
        self._keyword_gate: re.Pattern[str] | None = None
        if self._keyword:
            from detect_secrets.plugins import keyword as kw

            self._keyword_gate = re.compile("|".join(kw.DENYLIST), re.IGNORECASE)
        self._memo: dict[str, bool] = {}

    @staticmethod
    def _keyword_gate_ok() -> bool:
        from detect_secrets.plugins import keyword as kw

        tables = [*getattr(kw, "REGEX_BY_FILETYPE", {}).values()]
        tables.append(getattr(kw, "QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP", {}))
        words = getattr(kw, "DENYLIST_REGEX", None)
        return bool(words) and all(words in rx.pattern for table in tables for rx in table)

    def _may_find(self, line: str) -> bool:
        hit = self._memo.get(line)
        if hit is not None:
            return hit
        hit = False
        for rx in self._patterns:
            if rx.search(line):
                hit = True
                break
        if not hit and self._keyword_gate is not None and self._keyword_gate.search(line):
            hit = any(self._analyze(p, line) for p in self._keyword)
        if not hit:
            hit = any(self._analyze(p, line) for p in self._direct)
        if len(self._memo) >= _MEMO_LINES:
            self._memo.clear()
        self._memo[line] = hit
        return hit

    def _analyze(self, plugin: Any, line: str) -> bool:
        return bool(plugin.analyze_line(filename=self.FILENAME, line=line, line_number=1))

    def scan(self, text: str) -> tuple[Counter[str], int]:
        """(findings by secret type, number of lines skipped as too long) of one text."""
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        numbered: list[tuple[int, str]] = []
        long_lines = 0
        flagged = False
        for number, line in enumerate(lines, start=1):
            line = line.rstrip()
            if len(line) > MAX_SCAN_LINE_CHARS:
                long_lines += 1
                line = ""  # keeps the other lines' numbers and context
            elif line and not flagged:
                flagged = self._may_find(line)
            numbered.append((number, line))
        found: Counter[str] = Counter()
        if flagged:
            assert self._process is not None
            for secret in self._process(numbered, self.FILENAME):
                found[str(secret.type)] += 1
        return found, long_lines


def _secrets_version() -> str:
    try:
        return f"detect-secrets {version('detect-secrets')} (default plugins and filters, no verification)"
    except Exception:  # metadata missing: still say which library
        return "detect-secrets (default plugins and filters, no verification)"


def scan(records: Iterable[tuple[str, str]]) -> ScanReport:
    """Count secrets (detect-secrets) and PII formats (privcode's) in ``(source, text)`` items.

    Secrets: detect-secrets' default plugins and filters on each line, the text scanned as a
    Python file (lines over :data:`MAX_SCAN_LINE_CHARS` characters skipped and counted; no
    value verified over the network). PII: :func:`privcode.data.pii_formats.scan_formats` over
    the whole text. Counts per source and in total, never a value, a line number or a record
    id. Not thread-safe (detect-secrets' settings are global). Timings: docs/methods.md,
    "data/ingest/hygiene.py".
    """
    from detect_secrets.settings import default_settings

    t0 = time.perf_counter()
    tallies: dict[str, _Tally] = {}
    total = _Tally()
    with default_settings() as settings:
        # Never send a value anywhere: verification (a network call) stays off.
        settings.disable_filters(
            "detect_secrets.filters.common.is_ignored_due_to_verification_policies"
        )
        scanner = _SecretScanner()
        for source, text in records:
            source, text = str(source), str(text)
            secrets, long_lines = scanner.scan(text)
            pii = Counter(kind for kind, _ in scan_formats(text))
            tallies.setdefault(source, _Tally()).add(secrets, pii, long_lines)
            total.add(secrets, pii, long_lines)
    return ScanReport(
        sources={k: t.freeze() for k, t in sorted(tallies.items())},
        totals=total.freeze(),
        secrets_detector=_secrets_version(),
        pii_detector="privcode.data.pii_formats.scan_formats",
        seconds=time.perf_counter() - t0,
    )
