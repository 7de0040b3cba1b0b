"""Build a private corpus from a company's repositories and instruction data.
Design notes: docs/methods.md, "data/ingest/corpus.py".

``build_ingested_corpus(spec, out_dir, split_key=...)`` writes the demo corpus' files
(``train.parquet``, ``heldout.parquet``, ``canaries.json``, ``manifest.json``) plus
``scan.json`` (the private scan report), so later stages read it as the demo one. Steps:
sources (:mod:`~privcode.data.ingest.repo`, :mod:`~privcode.data.ingest.instruct`); stable ids,
exact and near-duplicate removal, the held-out split by whole file (keyed by ``split_key``, a
secret of the privacy store), the scan report (counts, never values); canaries planted in
place into members (at most 5%) with the run's secret randomness. Every file goes to a
temporary sibling first, is validated, then renamed into place, ``manifest.json`` last.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privcode.data.canaries import CanarySpec, draw_canaries, plant_in_place
from privcode.data.ingest.errors import IngestError
from privcode.data.ingest.hygiene import ScanReport, dedup, record_id, scan, split_by_file
from privcode.data.ingest.instruct import read_instructions
from privcode.data.ingest.repo import RepoOptions, SkipCounts, is_git_tree, iter_source_files
from privcode.data.ingest.units import extract_units
from privcode.data.records import Record, validate_record, write_records
from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_json, canonical_json, sha256_file

FORMAT = "privcode-ingested-corpus/1"
FILES = ("train.parquet", "heldout.parquet", "canaries.json", "scan.json", "manifest.json")
INSTRUCTION_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class IngestSpec:
    """What to ingest and how (the CLI's flags, the data stage's ``data.*``)."""

    inputs: tuple[str, ...]
    rev: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    prompt_column: str | None = None
    code_column: str | None = None
    id_column: str | None = None
    language_column: str | None = None
    heldout_fraction: float = 0.1
    dedup_threshold: float = 0.85
    max_record_bytes: int = 65_536
    max_file_bytes: int = 1_000_000
    min_lines: int = 3
    canaries: bool = False
    canary_kinds: tuple[str, ...] = ("email", "name", "ip_address", "password", "username")
    canary_placements: tuple[str, ...] = ("prompt", "code", "joint")
    canary_repetitions: tuple[int, ...] = (1, 2)
    locale: str = "en_US"

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> IngestSpec:
        """The spec a manifest recorded (lists back to tuples)."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items()}
        return cls(**fields)

    def __post_init__(self) -> None:
        if not self.inputs:
            raise IngestError("nothing to ingest: give at least one source (a path)")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise IngestError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclass
class _Candidate:
    record: Record
    file_key: str  # the held-out split keeps these whole


def _label(k: int, kind: str) -> str:
    return f"source-{k + 1}-{kind}"


#: Below these sizes everything runs in this process (a pool's start-up costs ~1 s).
PARALLEL_FILES, PARALLEL_RECORDS, CHUNK_FILES = 200, 4000, 32


def _workers() -> int:
    return min(len(os.sched_getaffinity(0)), 8)


@contextlib.contextmanager
def _pool(enabled: bool):
    """A process pool (spawned: safe inside a Ray worker) when worth it, else None."""
    if not enabled or _workers() < 2:
        yield None
        return

    with ProcessPoolExecutor(_workers(), mp_context=multiprocessing.get_context("spawn")) as ex:
        yield ex


def _extract_files(batch: list[tuple[Any, int, int]]) -> list[list[Any]]:
    """Units of each (file, min_lines, max_bytes): a pool worker's share."""
    return [
        extract_units(f.text, f.path, f.language, min_lines=m, max_bytes=b) for f, m, b in batch
    ]


def _scan_chunk(items: list[tuple[str, str]]):
    return scan(items)


def scan_parallel(items: list[tuple[str, str]]):
    """:func:`~privcode.data.ingest.hygiene.scan` over chunks in a process pool, merged."""

    with _pool(len(items) >= PARALLEL_RECORDS) as ex:
        if ex is None:
            return scan(items)
        n = _workers() * 4
        chunks = [items[i::n] for i in range(n)]
        return ScanReport.merge(list(ex.map(_scan_chunk, chunks)))


def _repo_candidates(
    k: int, root: Path, spec: IngestSpec, stats: dict[str, Any], key: bytes
) -> list[_Candidate]:
    label = _label(k, "repository")
    skipped = SkipCounts()
    opts = RepoOptions(
        include=spec.include, exclude=spec.exclude, max_file_bytes=spec.max_file_bytes
    )
    out, languages, licences, units_seen = [], Counter(), Counter(), 0
    source_files = list(iter_source_files(root, rev=spec.rev, options=opts, skipped=skipped))
    files = len(source_files)
    jobs = [(f, spec.min_lines, spec.max_record_bytes) for f in source_files]
    batches = [jobs[i : i + CHUNK_FILES] for i in range(0, len(jobs), CHUNK_FILES)]
    with _pool(files >= PARALLEL_FILES) as ex:
        per_file = [
            u
            for b in (ex.map(_extract_files, batches) if ex else map(_extract_files, batches))
            for u in b
        ]
    for f, units in zip(source_files, per_file, strict=True):
        licences[f.licence or "none"] += 1
        for u in units:
            units_seen += 1
            languages[u.language] += 1
            rid = record_id(key, label, u.path, u.start_line, u.end_line, u.prompt + "\0" + u.code)
            meta = {
                "source": label,
                "kind": "ingested",
                "language": u.language,
                "path": u.path,
                "lines": [u.start_line, u.end_line],
                "unit": u.kind,
                "name": u.name,
                "prompt_source": u.prompt_source,
                "licence": f.licence,
                "pii": None,
            }
            out.append(_Candidate(Record(rid, u.prompt, u.code, meta), f"{label}:{u.path}"))
    stats[label] = {
        "kind": "repository",
        "rev": spec.rev,
        "files": files,
        "files_skipped": skipped.to_dict(),
        "units": units_seen,
        "languages": dict(sorted(languages.items())),
        "licences": dict(sorted(licences.items())),
    }
    return out


def _instruction_candidates(
    k: int, path: Path, spec: IngestSpec, stats: dict[str, Any], key: bytes
) -> list[_Candidate]:
    label = _label(k, "instructions")
    out, languages = [], Counter()
    for row in read_instructions(
        path,
        prompt_column=spec.prompt_column,
        code_column=spec.code_column,
        id_column=spec.id_column,
        language_column=spec.language_column,
        max_record_bytes=spec.max_record_bytes,
    ):
        languages[row.language] += 1
        rid = record_id(key, label, path.name, row.row, row.row, row.prompt + "\0" + row.code)
        meta = {
            "source": label,
            "kind": "ingested",
            "language": row.language,
            "row": row.row,
            "original_id": row.original_id,
            "pii": None,
        }
        # Rows of one file are independent examples: each is its own split unit.
        out.append(_Candidate(Record(rid, row.prompt, row.code, meta), f"{label}:{row.row}"))
    stats[label] = {
        "kind": "instructions",
        "rows": len(out),
        "languages": dict(sorted(languages.items())),
    }
    return out


def id_key(split_key: bytes) -> bytes:
    """The key of :func:`~privcode.data.ingest.hygiene.record_id`, derived from the store's
    ingest secret (``split_key``) so that one secret keys the split, the planting and ids."""
    return hmac.new(split_key, b"ingest-record-id/1", hashlib.sha256).digest()


def _collect(spec: IngestSpec, key: bytes) -> tuple[list[_Candidate], dict[str, Any]]:
    cands: list[_Candidate] = []
    stats: dict[str, Any] = {}
    for k, raw in enumerate(spec.inputs):
        path = Path(raw).expanduser()
        if path.is_dir():
            cands += _repo_candidates(k, path, spec, stats, key)
        elif path.is_file() and path.suffix.lower() in INSTRUCTION_SUFFIXES:
            cands += _instruction_candidates(k, path, spec, stats, key)
        elif path.is_file():
            raise IngestError(
                f"{raw}: not a directory and not an instruction file "
                f"({', '.join(INSTRUCTION_SUFFIXES)})"
            )
        else:
            raise IngestError(f"{raw}: no such file or directory")
    return cands, stats


def _plant(
    spec: IngestSpec, members: list[Record], heldout: list[Record], rng: random.Random
) -> tuple[list[CanarySpec], list[Record]]:
    """CanaryLeaks canaries planted in place into member records (the demo corpus's procedure).

    Returns the canaries and the members, some of them now carrying a canary (same ids, same
    rows): no record is copied, so none trains twice. Raises :class:`IngestError` naming
    ``data.canary_repetitions`` when the canaries need more than 5% of the members.
    """
    if not (spec.canaries and spec.canary_kinds and spec.canary_placements and members):
        return [], members
    text = "\n".join(f"{r.prompt}\n{r.code}" for r in members + heldout)
    canaries = draw_canaries(
        spec.canary_kinds,
        spec.canary_placements,
        spec.canary_repetitions,
        rng,
        is_taken=lambda v: v in text,
        locale=spec.locale,
    )
    try:
        planted, canaries = plant_in_place(
            members, range(len(members)), canaries, rng, setting="data.canary_repetitions"
        )
    except PrivcodeError as e:
        raise IngestError(str(e)) from None
    return canaries, planted


def secret_rng(key: bytes) -> random.Random:
    """Canary planting and shuffling: keyed by the store's secret (not guessable from the
    public config), yet the same bytes for the same inputs and store, so that re-running the
    data stage does not make the train stage see a new corpus."""
    return random.Random(hmac.new(key, b"ingest-rng", hashlib.sha256).digest())


def _stat_key(path: str | os.PathLike) -> str:
    """``size:mtime_ns`` of a file (not following a link), ``gone`` if there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    return f"{st.st_size}:{st.st_mtime_ns}"


def inputs_state(spec: IngestSpec) -> str:
    """A cheap digest of where the inputs stand (git HEAD and status, else paths, sizes and
    mtimes): the data stage re-ingests when it changes.  Private metadata (the manifest)."""

    h = hashlib.sha256()
    for raw in spec.inputs:
        path = Path(raw).expanduser()
        h.update(os.fsencode(str(path.resolve())) + b"\0")
        if path.is_dir() and is_git_tree(path):
            for args in (["rev-parse", spec.rev or "HEAD"], ["status", "--porcelain", "-z"]):
                proc = subprocess.run(["git", "-C", str(path), *args], capture_output=True)
                h.update(proc.stdout + b"\0")
            if not spec.rev:  # the working tree: modified files' sizes and mtimes too
                out = subprocess.run(
                    ["git", "-C", str(path), "ls-files", "-z", "-m", "-o", "--exclude-standard"],
                    capture_output=True,
                ).stdout
                for rel in sorted(filter(None, out.split(b"\0"))):
                    h.update(rel + _stat_key(path / os.fsdecode(rel)).encode() + b"\0")
        elif path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                for name in sorted(filenames):
                    file = os.path.join(dirpath, name)
                    h.update(f"{file}:{_stat_key(file)}\0".encode())
        elif path.exists():
            h.update(_stat_key(path).encode())
    return h.hexdigest()


def build_ingested_corpus(
    spec: IngestSpec,
    out_dir: str | os.PathLike,
    *,
    split_key: bytes,
    rng: random.Random | None = None,
    store_id: str = "",
) -> dict[str, Any]:
    """Ingest ``spec.inputs`` into ``out_dir`` (module doc); returns the manifest.

    ``split_key``: the secret keying the held-out split (the privacy store's); ``rng``: the
    secret randomness of canary planting (default: the OS's); ``store_id``: that store's
    keyed id, written into the manifest (training refuses the corpus under another store).
    """
    t0 = time.monotonic()
    cands, stats = _collect(spec, id_key(split_key))
    if not cands:
        raise IngestError("no records found in " + ", ".join(spec.inputs))
    by_id: dict[str, _Candidate] = {}
    for c in cands:  # the same unit twice (two inputs naming one tree): once
        by_id.setdefault(c.record.id, c)
    cands = list(by_id.values())
    t1 = time.monotonic()
    result = dedup([(c.record.id, c.record.code) for c in cands], threshold=spec.dedup_threshold)
    kept = set(result.kept)
    cands = [c for c in cands if c.record.id in kept]
    groups: dict[str, list[str]] = defaultdict(list)
    for c in cands:
        groups[c.file_key].append(c.record.id)
    train_ids, heldout_ids = split_by_file(groups, spec.heldout_fraction, split_key)
    members = [c.record for c in cands if c.record.id in train_ids]
    heldout = [c.record for c in cands if c.record.id in heldout_ids]
    if not members or not heldout:
        raise IngestError(
            f"{len(cands)} records after deduplication are too few to split into members and "
            "held-out non-members: ingest more code (or lower data.min_lines)"
        )
    rng = rng or random.SystemRandom()
    canaries, train = _plant(spec, members, heldout, rng)
    rng.shuffle(train)
    t2 = time.monotonic()
    report = scan_parallel(
        [(str((c.metadata or {}).get("source")), f"{c.prompt}\n{c.code}") for c in train + heldout]
    )
    for i, rec in enumerate(train + heldout):  # the schema, before anything is written
        validate_record(
            rec, source="ingested corpus", row=i + 1, max_record_bytes=spec.max_record_bytes
        )
    counts = {
        "records_found": len(by_id),
        "removed_exact_duplicates": len(result.exact),
        "removed_near_duplicates": len(result.near),
        "ordinary_members": len(members),
        "heldout": len(heldout),
        "train_records": len(train),
        "canaries": len(canaries),
        "canary_records": sum(c.repetitions for c in canaries),
    }
    timings = {
        "collect_seconds": round(t1 - t0, 3),
        "scan_seconds": round(time.monotonic() - t2, 3),
        "dedup_seconds": round(result.seconds_exact + result.seconds_near, 3),
        "total_seconds": round(time.monotonic() - t0, 3),
    }
    out, scan = Path(out_dir), report.to_dict()
    return _write(out, spec, train, heldout, canaries, scan, counts, stats, timings, store_id)


def _write(
    out_dir: Path,
    spec: IngestSpec,
    train: list[Record],
    heldout: list[Record],
    canaries: list[CanarySpec],
    report: dict[str, Any],
    counts: dict[str, Any],
    stats: dict[str, Any],
    timings: dict[str, Any],
    store_id: str,
) -> dict[str, Any]:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        write_records(train, tmp / "train.parquet", max_record_bytes=spec.max_record_bytes)
        write_records(heldout, tmp / "heldout.parquet", max_record_bytes=spec.max_record_bytes)
        atomic_write_json(
            tmp / "canaries.json",
            {
                "format": FORMAT,
                "count": len(canaries),
                "canaries": [c.to_dict(spec.locale) for c in canaries],
            },
        )
        atomic_write_json(tmp / "scan.json", report)
        files = {}
        for name, n in (
            ("train.parquet", len(train)),
            ("heldout.parquet", len(heldout)),
            ("canaries.json", len(canaries)),
            ("scan.json", len(report.get("sources", {}))),
        ):
            path = tmp / name
            files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size, "items": n}
        manifest = {
            "format": FORMAT,
            "counts": counts,
            "files": files,
            "sources": stats,
            "scan": report,
            "timings": timings,
            "spec": json.loads(canonical_json(spec.__dict__)),
            "inputs_state": inputs_state(spec),
            "store_id": store_id,
        }
        atomic_write_json(tmp / "manifest.json", manifest)
        for name in FILES:  # private data: the owner's only
            os.chmod(tmp / name, 0o600)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (out_dir / "manifest.json").unlink(missing_ok=True)  # no manifest = incomplete
        for name in FILES:  # manifest.json last
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads(canonical_json(manifest))


__all__ = ["FILES", "FORMAT", "IngestSpec", "build_ingested_corpus"]
