"""The private record schema and its JSONL / Parquet readers and writers.
Design notes: docs/methods.md, "data/records.py".

A record is ``{"id", "prompt", "code", "metadata"}``. Prompt and code are both private: no error
message, log line or ``repr`` holds them; errors name the file, the 0-based row index, the id
when known, the field and the kind of problem. Enforced on read and before write: ``id`` a
non-empty printable string of at most :data:`MAX_ID_CHARS`, unique in the file; ``prompt`` a
string (may be empty); ``code`` not empty or whitespace-only; ``metadata`` absent/null or a
JSON object; valid UTF-8; ``prompt + code`` at most ``max_record_bytes`` UTF-8 bytes; no other
fields. Parquet columns: :data:`RECORD_SCHEMA`. Writes validate every record first and go
through :func:`privcode.utils.atomic_path`: no partial file, an existing file untouched.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from privcode.errors import RecordError
from privcode.utils import atomic_path

__all__ = [
    "FIELDS",
    "MAX_ID_CHARS",
    "PARQUET_ROW_GROUP_SIZE",
    "RECORD_SCHEMA",
    "Record",
    "iter_records",
    "read_records",
    "read_snapshot",
    "validate_record",
    "write_records",
]

#: The fields of a record, in file order; ``metadata`` is optional.
FIELDS: tuple[str, ...] = ("id", "prompt", "code", "metadata")
_REQUIRED: tuple[str, ...] = ("id", "prompt", "code")

#: Ids are echoed in error messages, so they are kept short and printable.
MAX_ID_CHARS = 256

#: The Parquet schema of a record file. ``metadata`` is canonical JSON text.
RECORD_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("code", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=True),
    ]
)

#: Fixed so that the same records always give the same Parquet bytes.
PARQUET_ROW_GROUP_SIZE = 4096
_PARQUET_OPTIONS: dict[str, Any] = dict(
    row_group_size=PARQUET_ROW_GROUP_SIZE,
    compression="zstd",
    compression_level=3,
    use_dictionary=False,
    write_statistics=False,
    version="2.6",
)
_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True, repr=False)
class Record:
    """One private instruction-code pair. ``metadata`` must be JSON-serialisable."""

    id: str
    prompt: str
    code: str
    metadata: dict | None = None

    def __repr__(self) -> str:  # prompt and code are private: never shown in logs or diffs
        return (
            f"Record(id={self.id!r}, prompt=<{len(self.prompt)} chars>, "
            f"code=<{len(self.code)} chars>, metadata_keys={sorted(self.metadata or {})})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "prompt": self.prompt, "code": self.code, "metadata": self.metadata}

    @property
    def nbytes(self) -> int:
        """UTF-8 size of prompt + code: what ``max_record_bytes`` limits."""
        return len(self.prompt.encode("utf-8")) + len(self.code.encode("utf-8"))


# --------------------------------------------------------------------------- validation


def _where(source: str, row: int, rid: Any = None) -> str:
    if isinstance(rid, str) and _id_problem(rid) is None:
        return f"{source}: row {row} (id {rid!r})"
    return f"{source}: row {row}"


def _id_problem(rid: str) -> str | None:
    if not rid.strip():
        return "is empty"
    if len(rid) > MAX_ID_CHARS:
        return f"is {len(rid)} characters long, above the limit of {MAX_ID_CHARS}"
    if not rid.isprintable():
        return "contains non-printable characters"
    if not _utf8_ok(rid):
        return "is not valid UTF-8 (lone surrogate)"
    return None


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_type(value: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _check_metadata(meta: Any, where: str) -> dict | None:
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise RecordError(
            f"{where}: field 'metadata' must be a mapping (JSON object) or null, "
            f"got {_json_type(meta)}"
        )
    meta = dict(meta)
    stack: list[Any] = [meta]
    while stack:  # iterative walk: JSON objects can nest deeper than the recursion limit
        item = stack.pop()
        if isinstance(item, dict):  # nested: only what json.dumps can write
            for key, value in item.items():
                if not isinstance(key, str):
                    raise RecordError(
                        f"{where}: field 'metadata' has a non-string key "
                        f"of type {type(key).__name__}"
                    )
                if not _utf8_ok(key):
                    raise RecordError(
                        f"{where}: field 'metadata' is not valid UTF-8 (lone surrogate)"
                    )
                stack.append(value)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, str):
            if not _utf8_ok(item):
                raise RecordError(f"{where}: field 'metadata' is not valid UTF-8 (lone surrogate)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise RecordError(f"{where}: field 'metadata' holds a non-finite number")
        elif not (item is None or isinstance(item, bool | int)):  # also a nested non-dict mapping
            raise RecordError(
                f"{where}: field 'metadata' holds a value of type "
                f"{type(item).__name__}, which is not JSON-serialisable"
            )
    return meta


def validate_record(
    raw: Mapping[str, Any] | Record,
    *,
    source: str = "<records>",
    row: int = 0,
    max_record_bytes: int = 65_536,
) -> Record:
    """Check one row against the schema; return it as a :class:`Record`.

    Raises :class:`RecordError` naming ``source``, ``row``, the id (when it
    is a valid id) and the offending field; never the prompt or code text.
    """
    if isinstance(raw, Record):
        raw = raw.to_dict()
    if not isinstance(raw, Mapping):
        raise RecordError(f"{source}: row {row}: expected a JSON object, got {_json_type(raw)}")
    rid = raw.get("id")
    where = _where(source, row, rid)
    unknown = sorted(str(k) for k in raw if k not in FIELDS)
    if unknown:
        raise RecordError(
            f"{where}: unknown field {unknown[0]!r} (known fields: {', '.join(FIELDS)})"
        )
    for name in _REQUIRED:
        if name not in raw or raw[name] is None:
            raise RecordError(f"{where}: field {name!r} is missing")
        if not isinstance(raw[name], str):
            raise RecordError(
                f"{where}: field {name!r} must be a string, got {_json_type(raw[name])}"
            )
        if not _utf8_ok(raw[name]):
            raise RecordError(f"{where}: field {name!r} is not valid UTF-8 (lone surrogate)")
    problem = _id_problem(rid)
    if problem:
        raise RecordError(f"{where}: field 'id' {problem}")
    if not raw["code"].strip():
        raise RecordError(f"{where}: field 'code' is empty")
    metadata = _check_metadata(raw.get("metadata"), where)
    record = Record(id=rid, prompt=raw["prompt"], code=raw["code"], metadata=metadata)
    size = record.nbytes
    if size > max_record_bytes:
        raise RecordError(
            f"{where}: fields 'prompt' + 'code' are {size} bytes, above "
            f"max_record_bytes={max_record_bytes}"
        )
    return record


class _IdTracker:
    """Rejects a repeated id, naming the row where it was first seen."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.seen: dict[str, int] = {}

    def add(self, record: Record, row: int) -> None:
        first = self.seen.setdefault(record.id, row)
        if first != row:
            raise RecordError(
                f"{_where(self.source, row, record.id)}: field 'id' is a duplicate "
                f"(first seen at row {first})"
            )


# --------------------------------------------------------------------------- reading


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise RecordError(
            f"{path.name}: unsupported file type {suffix or '(none)'!r} "
            f"(expected {' or '.join(_SUFFIXES)})"
        )
    return suffix


def iter_records(path: str | os.PathLike, *, max_record_bytes: int = 65_536) -> Iterator[Record]:
    """Yield the validated records of a ``.jsonl`` or ``.parquet`` file, in file order.

    Raises :class:`RecordError` at the first invalid row (see module docstring).
    Rows before it have already been yielded: use :func:`read_records` to get
    all-or-nothing behaviour.
    """
    path = Path(path)
    kind = _kind(path)
    if not path.is_file():
        raise RecordError(f"{path}: file not found")
    with open(path, "rb") as fh:
        yield from _validated(fh, path.name, kind, max_record_bytes)


def _validated(fh: Any, source: str, kind: str, max_record_bytes: int) -> Iterator[Record]:
    """The validated records of a ``.jsonl`` or ``.parquet`` binary file object."""
    ids = _IdTracker(source)
    rows = _iter_jsonl(fh, source) if kind == ".jsonl" else _iter_parquet(fh, source)
    for row, raw in rows:
        record = validate_record(raw, source=source, row=row, max_record_bytes=max_record_bytes)
        ids.add(record, row)
        yield record


def read_records(path: str | os.PathLike, *, max_record_bytes: int = 65_536) -> list[Record]:
    """All records of a ``.jsonl`` or ``.parquet`` file, every row validated."""
    return list(iter_records(path, max_record_bytes=max_record_bytes))


def read_snapshot(
    path: str | os.PathLike,
    *,
    expected_sha256: str | None = None,
    max_record_bytes: int = 65_536,
) -> tuple[list[Record], str]:
    """The records of a training file and the SHA-256 of the bytes they were parsed from.

    The file is read once: its digest and its records come from the same buffer, so
    the records are exactly the bytes that were hashed (a file rewritten between a
    hash and a parse cannot slip in). ``expected_sha256`` (the admitted data's digest):
    another digest is a :class:`RecordError`, raised before any record is parsed.
    """
    path = Path(path)
    kind = _kind(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecordError(f"{path}: file not found") from None
    digest = hashlib.sha256(data).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise RecordError(f"{path}: changed since the job was admitted (another SHA-256)")
    return list(_validated(io.BytesIO(data), path.name, kind, max_record_bytes)), digest


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def loads_record(text: str) -> Any:
    """``json.loads`` for a record: a key twice in one object is an error (which value trains
    would depend on the reader), and so is nesting too deep for the parser (RecursionError),
    each a ValueError naming what is wrong and never the text."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise ValueError(f"the key {str(exc)[:64]!r} appears twice in one object") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _iter_jsonl(fh: Any, source: str) -> Iterator[tuple[int, Any]]:
    # bytes: decode ourselves to report invalid UTF-8 by row
    for row, line in enumerate(fh):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
            strict = True
        except UnicodeDecodeError:
            # Undecodable bytes become lone surrogates, so the JSON can still be parsed to
            # find the id and the field that holds them; validate_record then rejects it.
            text = line.decode("utf-8", errors="surrogateescape")
            strict = False
        try:
            obj = loads_record(text)
        except json.JSONDecodeError as exc:
            # exc.msg is the parser's description ("Expecting ',' delimiter"), never the text.
            detail = "invalid UTF-8" if not strict else f"{exc.msg} at column {exc.colno}"
            raise RecordError(f"{source}: row {row}: malformed JSON ({detail})") from None
        except ValueError as exc:
            raise RecordError(f"{source}: row {row}: malformed JSON ({exc})") from None
        yield row, obj


def _parquet_column(table: pa.Table, name: str, source: str) -> list[Any]:
    """A column as Python values; text columns as ``str`` (strictly decoded) or None."""
    col = table.column(name)
    if name == "metadata" and pa.types.is_null(col.type):
        return [None] * len(col)
    if not (
        pa.types.is_string(col.type)
        or pa.types.is_large_string(col.type)
        or pa.types.is_binary(col.type)
        or pa.types.is_large_binary(col.type)
    ):
        raise RecordError(
            f"{source}: row 0: field {name!r} has type {col.type} (whole column), expected string"
        )
    # Cast to binary (no copy) and decode here: a file written by another tool may hold
    # invalid UTF-8 even in a "string" column.
    values = col.cast(pa.large_binary()).to_pylist()
    out: list[Any] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        try:
            out.append(value.decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.append(_BadUtf8(exc.start))
    return out


class _BadUtf8:
    """Placeholder for an undecodable Parquet value; reported once the row's id is known."""

    def __init__(self, offset: int) -> None:
        self.offset = offset


def _iter_parquet(fh: Any, source: str) -> Iterator[tuple[int, Any]]:
    try:
        pf = pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as exc:
        raise RecordError(f"{source}: not a valid Parquet file ({type(exc).__name__})") from None
    names = pf.schema_arrow.names
    unknown = [n for n in names if n not in FIELDS]
    if unknown:
        raise RecordError(
            f"{source}: unknown column {unknown[0]!r} (known fields: {', '.join(FIELDS)})"
        )
    for name in _REQUIRED:
        if name not in names:
            raise RecordError(f"{source}: field {name!r} is missing (no such column)")
    base = 0
    for group in range(pf.num_row_groups):  # one row group at a time bounds memory
        try:
            table = pf.read_row_group(group)
        except (pa.ArrowException, OSError) as exc:
            raise RecordError(
                f"{source}: row {base}: unreadable row group {group} ({type(exc).__name__})"
            ) from None
        columns = {n: _parquet_column(table, n, source) for n in names}
        for i in range(table.num_rows):
            row = base + i
            raw = {n: columns[n][i] for n in names}
            rid = raw.get("id")
            bad = [n for n in FIELDS if isinstance(raw.get(n), _BadUtf8)]
            if bad:
                where = _where(source, row, rid if isinstance(rid, str) else None)
                raise RecordError(
                    f"{where}: field {bad[0]!r} is not valid UTF-8 (at byte {raw[bad[0]].offset})"
                )
            if isinstance(raw.get("metadata"), str):
                try:
                    raw["metadata"] = loads_record(raw["metadata"])
                except json.JSONDecodeError as exc:
                    raise RecordError(
                        f"{_where(source, row, rid)}: field 'metadata' is not valid "
                        f"JSON ({exc.msg})"
                    ) from None
                except ValueError as exc:
                    raise RecordError(
                        f"{_where(source, row, rid)}: field 'metadata' is not valid JSON ({exc})"
                    ) from None
            yield row, raw
        base += table.num_rows


# --------------------------------------------------------------------------- writing


def _canonical_metadata(meta: dict | None) -> str | None:
    if meta is None:
        return None
    return json.dumps(
        meta, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    )


def write_records(
    records: Iterable[Record | Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    max_record_bytes: int = 65_536,
) -> int:
    """Validate every record, then write them atomically as ``.jsonl`` or ``.parquet``.

    Returns the number of records written. Same records in the same order
    give the same bytes (canonical JSON; fixed Parquet options, no
    timestamps). On any error nothing is left under ``path`` and an
    existing file keeps its old content.
    """
    path = Path(path)
    kind = _kind(path)
    source = path.name
    ids = _IdTracker(source)
    checked: list[Record] = []
    for row, rec in enumerate(records):
        record = validate_record(rec, source=source, row=row, max_record_bytes=max_record_bytes)
        ids.add(record, row)
        checked.append(record)
    with atomic_path(path) as tmp:
        if kind == ".jsonl":
            with open(tmp, "wb") as fh:
                for r in checked:
                    line = json.dumps(
                        {"id": r.id, "prompt": r.prompt, "code": r.code, "metadata": r.metadata},
                        sort_keys=True,
                        ensure_ascii=False,
                        allow_nan=False,
                    )
                    fh.write(line.encode("utf-8") + b"\n")
        else:
            table = pa.table(
                {
                    "id": pa.array([r.id for r in checked], pa.string()),
                    "prompt": pa.array([r.prompt for r in checked], pa.string()),
                    "code": pa.array([r.code for r in checked], pa.string()),
                    "metadata": pa.array(
                        [_canonical_metadata(r.metadata) for r in checked], pa.string()
                    ),
                },
                schema=RECORD_SCHEMA,
            )
            pq.write_table(table, tmp, **_PARQUET_OPTIONS)
    return len(checked)
