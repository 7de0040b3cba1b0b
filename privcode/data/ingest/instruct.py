"""Instruction datasets (JSONL, JSON, Parquet, CSV) as prompt/code rows for the private corpus.

A row's prompt and code come from the caller's columns (``--prompt-column``/``--code-column``),
else a known layout's (:data:`LAYOUTS`, found by :func:`detect_layout`). Each row is checked
and returned as an :class:`InstructionRow`; a bad row stops the read with an
:class:`~privcode.data.ingest.errors.IngestError` naming the file, the row (from 1) and the
column, never a value (the rows are private). Prompt and code are strings, code not empty once
one markdown fence is removed, ``prompt + code`` at most ``max_record_bytes`` UTF-8 bytes; an
id column is kept as ``original_id`` (private metadata, never in a message).
Formats, numbering and languages: docs/methods.md, "data/ingest/instruct.py".
"""

from __future__ import annotations

import csv
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from privcode.data.ingest.errors import IngestError
from privcode.data.records import _json_type, _utf8_ok  # the schema's own checks

__all__ = [
    "DEFAULT_LANGUAGE",
    "LAYOUTS",
    "SUFFIXES",
    "ColumnMap",
    "InstructionRow",
    "detect_layout",
    "read_instructions",
    "strip_fence",
]

DEFAULT_LANGUAGE = "python"
SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")
_MAX_LANGUAGE_CHARS = 40
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class ColumnMap:
    """Which columns hold a row's prompt, code and (optionally) id, language and extra input.

    ``input`` (Alpaca's) is appended to the prompt after a blank line when not empty.
    """

    prompt: str
    code: str
    id: str | None = None
    language: str | None = None
    input: str | None = None

    def columns(self) -> tuple[str, ...]:
        named = (self.prompt, self.code, self.id, self.language, self.input)
        return tuple(dict.fromkeys(c for c in named if c is not None))


#: Known layouts, tried in this order by :func:`detect_layout`.
LAYOUTS: dict[str, ColumnMap] = {
    "privcode": ColumnMap(prompt="prompt", code="code", id="id"),
    # ise-uiuc/Magicoder-OSS-Instruct-75K: problem, solution, lang, seed, index, ...
    "magicoder-oss-instruct": ColumnMap(
        prompt="problem", code="solution", id="index", language="lang"
    ),
    # ise-uiuc/Magicoder-Evol-Instruct-110K: instruction, response.
    "magicoder-evol-instruct": ColumnMap(prompt="instruction", code="response"),
    # Code Alpaca and its kin: instruction, input, output.
    "alpaca": ColumnMap(prompt="instruction", code="output", input="input"),
}

_ALIASES: dict[str, str] = {
    "py": "python",
    "python3": "python",
    "py3": "python",
    "js": "javascript",
    "node": "javascript",
    "jsx": "javascript",
    "ts": "typescript",
    "tsx": "typescript",
    "c++": "cpp",
    "cc": "cpp",
    "cxx": "cpp",
    "h": "c",
    "c#": "csharp",
    "cs": "csharp",
    "golang": "go",
    "rs": "rust",
    "rb": "ruby",
    "kt": "kotlin",
    "sh": "shell",
    "bash": "shell",
    "zsh": "shell",
    "console": "shell",
    "ps1": "powershell",
    "yml": "yaml",
}

# One fence around the whole value: ```tag\n ... \n``` (a body with another fence line is
# not "one surrounding fence" and is left alone).
_FENCE = re.compile(r"\A\s*```[ \t]*([^\s`]*)[^\n]*\n(.*?)\n?[ \t]*```\s*\Z", re.DOTALL)
_FENCE_LINE = re.compile(r"^[ \t]*```", re.MULTILINE)


@dataclass(frozen=True, repr=False)
class InstructionRow:
    """One checked row: where it came from, its prompt, code and language (prompt and code
    are private: not shown by ``repr``)."""

    source: str
    row: int
    prompt: str
    code: str
    language: str
    original_id: str | None

    def __repr__(self) -> str:
        return (
            f"InstructionRow(source={self.source!r}, row={self.row}, "
            f"prompt=<{len(self.prompt)} chars>, code=<{len(self.code)} chars>, "
            f"language={self.language!r})"
        )


def detect_layout(columns: Sequence[str] | set[str]) -> ColumnMap | None:
    """The first of :data:`LAYOUTS` whose prompt and code columns are all in ``columns``.

    Its optional columns (id, language, input) are kept only when present.
    """
    present = set(columns)
    for layout in LAYOUTS.values():
        if layout.prompt in present and layout.code in present:
            return replace(
                layout,
                id=layout.id if layout.id in present else None,
                language=layout.language if layout.language in present else None,
                input=layout.input if layout.input in present else None,
            )
    return None


def normalize_language(name: str) -> str:
    """Lower-cased, stripped, common aliases mapped (``py`` -> ``python``)."""
    key = name.strip().lower()
    return _ALIASES.get(key, key)


def strip_fence(code: str) -> tuple[str, str | None]:
    """(code without one markdown fence around all of it, the fence's tag or None).

    Code not wholly inside one fence (prose around it, two blocks) is returned unchanged.
    """
    m = _FENCE.match(code)
    if m is None or _FENCE_LINE.search(m.group(2)):
        return code, None
    return m.group(2), (m.group(1) or None)


# --------------------------------------------------------------------------- checks


class _BadUtf8:
    """Stands for a value whose bytes are not UTF-8 (reported with its row and column)."""


def _text(value: Any, where: str, column: str, *, required: bool) -> str | None:
    if value is None:
        if required:
            raise IngestError(f"{where}: field {column!r} is missing")
        return None
    if isinstance(value, _BadUtf8):
        raise IngestError(f"{where}: field {column!r} is not valid UTF-8")
    if not isinstance(value, str):
        raise IngestError(f"{where}: field {column!r} must be a string, got {_json_type(value)}")
    if not _utf8_ok(value):
        raise IngestError(f"{where}: field {column!r} is not valid UTF-8 (lone surrogate)")
    return value


def _make_row(
    raw: Mapping[str, Any],
    cols: ColumnMap,
    source: str,
    row: int,
    max_record_bytes: int,
) -> InstructionRow:
    where = f"{source}: row {row}"
    for column in (cols.prompt, cols.code):
        if column not in raw:
            raise IngestError(f"{where}: field {column!r} is missing")
    prompt = _text(raw.get(cols.prompt), where, cols.prompt, required=True) or ""
    code = _text(raw.get(cols.code), where, cols.code, required=True) or ""
    if cols.input is not None:
        extra = _text(raw.get(cols.input), where, cols.input, required=False)
        if extra and extra.strip():
            prompt = f"{prompt}\n\n{extra}" if prompt.strip() else extra
    code, tag = strip_fence(code)
    if not code.strip():
        raise IngestError(f"{where}: field {cols.code!r} is empty")
    size = len(prompt.encode("utf-8")) + len(code.encode("utf-8"))
    if size > max_record_bytes:
        raise IngestError(
            f"{where}: fields {cols.prompt!r} + {cols.code!r} are {size} bytes, above "
            f"max_record_bytes={max_record_bytes}"
        )
    language = None
    if cols.language is not None:
        language = _text(raw.get(cols.language), where, cols.language, required=False)
        if language is not None and (
            len(language) > _MAX_LANGUAGE_CHARS or not language.strip().isprintable()
        ):
            raise IngestError(
                f"{where}: field {cols.language!r} is not a language name "
                f"(at most {_MAX_LANGUAGE_CHARS} printable characters)"
            )
    if not (language and language.strip()):
        language = tag if tag and len(tag) <= _MAX_LANGUAGE_CHARS else DEFAULT_LANGUAGE
    original_id = None
    if cols.id is not None:
        value = raw.get(cols.id)
        if isinstance(value, bool) or not (value is None or isinstance(value, str | int)):
            raise IngestError(
                f"{where}: field {cols.id!r} must be a string or an integer, "
                f"got {_json_type(value)}"
            )
        if isinstance(value, str):
            value = _text(value, where, cols.id, required=False)
        original_id = None if value is None else str(value)
    return InstructionRow(source, row, prompt, code, normalize_language(language), original_id)


# --------------------------------------------------------------------------- columns


def _resolve_columns(
    source: str,
    columns: Sequence[str],
    prompt_column: str | None,
    code_column: str | None,
    id_column: str | None,
    language_column: str | None,
    *,
    sparse: bool = False,
) -> ColumnMap:
    """The columns to read. ``sparse`` (JSON: a row may leave out a key): the optional
    columns (id, language, input) need not be among ``columns`` (the first row's keys)."""
    layout = detect_layout(columns)
    if sparse and layout is not None:
        layout = next(
            v for v in LAYOUTS.values() if (v.prompt, v.code) == (layout.prompt, layout.code)
        )
    prompt = prompt_column or (layout.prompt if layout else None)
    code = code_column or (layout.code if layout else None)
    if prompt is None or code is None:
        shown = ", ".join(repr(c) for c in list(columns)[:30])
        more = f" and {len(columns) - 30} more" if len(columns) > 30 else ""
        missing = " and ".join(
            flag
            for flag, given in (("--prompt-column", prompt), ("--code-column", code))
            if given is None
        )
        raise IngestError(
            f"{source}: cannot tell which columns hold the prompt and the code "
            f"(columns: {shown or 'none'}{more}; known layouts: {', '.join(LAYOUTS)}): "
            f"pass {missing}"
        )
    present = set(columns)
    for flag, column, optional in (
        ("--prompt-column", prompt_column, False),
        ("--code-column", code_column, False),
        ("--id-column", id_column, True),
        ("--language-column", language_column, True),
    ):
        if column is not None and column not in present and not (sparse and optional):
            shown = ", ".join(repr(c) for c in list(columns)[:30])
            raise IngestError(f"{source}: no column {column!r} ({flag}); columns: {shown}")
    if prompt == code:
        raise IngestError(f"{source}: the prompt and the code cannot both be column {prompt!r}")
    # Optional columns of the layout apply only when its prompt and code columns are used.
    same = layout is not None and (prompt, code) == (layout.prompt, layout.code)
    return ColumnMap(
        prompt=prompt,
        code=code,
        id=id_column or (layout.id if same and layout else None),
        language=language_column or (layout.language if same and layout else None),
        input=layout.input if same and layout else None,
    )


# --------------------------------------------------------------------------- readers


def _decode_line(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        # Undecodable bytes become lone surrogates, so the JSON can still be parsed to tell
        # which field holds them; _text then reports that field.
        return line.decode("utf-8", errors="surrogateescape")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    source = path.name
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        fh.seek(0)
        if path.suffix.lower() == ".json" and head.startswith(b"["):
            yield from _json_array(path, fh.read())
            return
        for number, line in enumerate(fh, start=1):
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                obj = json.loads(_decode_line(line))
            except json.JSONDecodeError as exc:  # exc.msg describes the problem, not the text
                raise IngestError(
                    f"{source}: row {number}: not JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except RecursionError:
                raise IngestError(f"{source}: row {number}: not JSON (nested too deeply)") from None
            yield number, obj


def _json_array(path: Path, data: bytes) -> Iterator[tuple[int, Any]]:
    try:
        items = json.loads(_decode_line(data.removeprefix(b"\xef\xbb\xbf")))
    except json.JSONDecodeError as exc:
        raise IngestError(
            f"{path.name}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise IngestError(f"{path.name}: not JSON (nested too deeply)") from None
    if not isinstance(items, list):
        raise IngestError(f"{path.name}: expected a JSON array of objects, got {_json_type(items)}")
    yield from enumerate(items, start=1)


def _raise_csv_limit() -> None:
    limit = sys.maxsize
    while True:  # the C long of some platforms is 32 bits: halve until it fits
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:
            limit //= 2


def _csv_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, Any]]]]:
    source = path.name
    _raise_csv_limit()
    fh = open(path, encoding="utf-8-sig", errors="surrogateescape", newline="")
    reader = csv.reader(fh, strict=True)  # bad quoting is an error, not mangled cells
    try:
        header = next(reader, None)
    except csv.Error as exc:
        fh.close()
        raise IngestError(f"{source}: header: malformed CSV ({exc})") from None
    if header is None:
        fh.close()
        raise IngestError(f"{source}: empty CSV file (no header row)")
    for i, name in enumerate(header):
        if not _utf8_ok(name):
            fh.close()
            raise IngestError(f"{source}: header: column {i + 1} is not valid UTF-8")
    seen: set[str] = set()
    for name in header:
        if name in seen:
            fh.close()
            raise IngestError(f"{source}: header: column {name!r} appears twice")
        seen.add(name)

    def rows() -> Iterator[tuple[int, dict[str, Any]]]:
        with fh:
            number = 0
            while True:
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:  # e.g. "',' expected after '\"'": no cell text
                    raise IngestError(
                        f"{source}: row {number + 1}: malformed CSV ({exc})"
                    ) from None
                number += 1
                if not any(c.strip() for c in cells):
                    continue  # a blank line
                raw: dict[str, Any] = {}
                for name, cell in zip(header, cells, strict=False):
                    raw[name] = cell if _utf8_ok(cell) else _BadUtf8()
                yield number, raw

    return header, rows()


def _parquet_values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    if pa.types.is_dictionary(col.type):  # e.g. a pandas category column
        col = col.cast(col.type.value_type)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = col.cast(pa.large_binary())  # decode ourselves: a writer may store bad UTF-8
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        out: list[Any] = []
        for value in col.to_pylist():
            if value is None:
                out.append(None)
                continue
            try:
                out.append(value.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(_BadUtf8())
        return out
    if pa.types.is_integer(col.type) or pa.types.is_null(col.type):
        return col.to_pylist()
    return [_Typed(str(col.type))] * len(col)


class _Typed:
    """Stands for a value of a non-text Parquet column (reported with its row and column)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise IngestError(f"{path.name}: not a valid Parquet file ({type(exc).__name__})") from None


def _parquet_rows(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    pf = _parquet_file(path)
    number = 0
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(columns))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise IngestError(
                f"{path.name}: row {number + 1}: unreadable ({type(exc).__name__})"
            ) from None
        values = {name: _parquet_values(batch.column(name)) for name in columns}
        for i in range(batch.num_rows):
            number += 1
            yield number, {name: values[name][i] for name in columns}


# --------------------------------------------------------------------------- entry point


def read_instructions(
    path: str | Path,
    *,
    prompt_column: str | None = None,
    code_column: str | None = None,
    id_column: str | None = None,
    language_column: str | None = None,
    max_record_bytes: int = 65_536,
) -> Iterator[InstructionRow]:
    """Yield the checked rows of an instruction file, in file order (module docstring).

    Raises :class:`IngestError` for an unknown file type, columns that cannot be told,
    or the first bad row (naming the file, the row and the field). Rows before a bad
    one have already been yielded.
    """
    path = Path(path)
    source = path.name
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise IngestError(
            f"{source}: unsupported instruction file type {suffix or '(none)'!r} "
            f"(expected {', '.join(SUFFIXES)})"
        )
    if not path.is_file():
        raise IngestError(f"{path}: file not found")
    names = (prompt_column, code_column, id_column, language_column)
    if suffix == ".parquet":
        columns = list(_parquet_file(path).schema_arrow.names)
        cols = _resolve_columns(source, columns, *names)
        for number, raw in _parquet_rows(path, cols.columns()):
            for name, value in raw.items():
                if isinstance(value, _Typed):
                    raise IngestError(
                        f"{source}: row {number}: field {name!r} has type {value.type_name}, "
                        "expected string"
                    )
            yield _make_row(raw, cols, source, number, max_record_bytes)
    elif suffix == ".csv":
        header, rows = _csv_rows(path)
        cols = _resolve_columns(source, header, *names)
        for number, raw in rows:
            yield _make_row(raw, cols, source, number, max_record_bytes)
    else:
        cols = None
        for number, obj in _json_rows(path):
            if not isinstance(obj, dict):
                raise IngestError(
                    f"{source}: row {number}: expected a JSON object, got {_json_type(obj)}"
                )
            if cols is None:  # the first row's keys name the columns
                keys = [k for k in obj if _utf8_ok(k)]
                cols = _resolve_columns(source, keys, *names, sparse=True)
            yield _make_row(obj, cols, source, number, max_record_bytes)
