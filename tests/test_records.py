"""Record schema, JSONL/Parquet IO: round trips, row-level errors, atomic and deterministic writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from privcode.data import records as rec_mod
from privcode.data.records import RECORD_SCHEMA, Record, iter_records, read_records, write_records
from privcode.errors import RecordError

SECRET = "SECRET-CONTENT-7f3a"  # planted in bad rows: must never show up in an error message


def sample_records(n: int = 5) -> list[Record]:
    out = [
        Record(
            id=f"r{i}",
            prompt=f"Write f{i} — ünïcode ✓",
            code=f"def f{i}():\n    return {i}\n",
            metadata={"source": "test", "n": i, "nested": {"b": [1, 2.5, None], "a": True}},
        )
        for i in range(n)
    ]
    out.append(Record(id="no-meta", prompt="", code="x = 1\n", metadata=None))
    return out


def write_jsonl_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def good_lines(n: int = 3) -> list[bytes]:
    return [json.dumps({"id": f"ok{i}", "prompt": "p", "code": "pass"}).encode() for i in range(n)]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    recs = sample_records()
    path = tmp_path / f"data{suffix}"
    assert write_records(recs, path) == len(recs)
    back = read_records(path)
    assert back == recs
    assert [r.id for r in iter_records(path)] == [r.id for r in recs]
    assert back[-1].metadata is None and back[-1].prompt == ""


def test_parquet_schema_and_canonical_metadata(tmp_path):
    path = tmp_path / "d.parquet"
    write_records(sample_records(2), path)
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == RECORD_SCHEMA
    meta = table.column("metadata").to_pylist()
    assert meta[0] == '{"n":0,"nested":{"a":true,"b":[1,2.5,null]},"source":"test"}'
    assert meta[-1] is None


def test_parquet_bytes_are_deterministic(tmp_path):
    recs = sample_records(50)
    write_records(recs, tmp_path / "a.parquet")
    write_records(list(recs), tmp_path / "b.parquet")
    a, b = (tmp_path / "a.parquet").read_bytes(), (tmp_path / "b.parquet").read_bytes()
    assert a == b and len(a) > 0
    write_records(recs, tmp_path / "a.jsonl")
    write_records(recs, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_repr_hides_content():
    r = Record(id="x1", prompt=SECRET, code=SECRET)
    assert SECRET not in repr(r) and "x1" in repr(r)


# --------------------------------------------------------------------------- bad JSONL rows

BAD_JSONL = {
    "missing_field": ({"id": "bad-id", "prompt": SECRET}, "bad-id", "code", "is missing"),
    "id_not_str": ({"id": 17, "prompt": SECRET, "code": SECRET}, None, "id", "must be a string"),
    "code_not_str": (
        {"id": "bad-id", "prompt": SECRET, "code": [SECRET]},
        "bad-id",
        "code",
        "must be a string, got array",
    ),
    "metadata_not_mapping": (
        {"id": "bad-id", "prompt": "p", "code": SECRET, "metadata": [SECRET]},
        "bad-id",
        "metadata",
        "must be a mapping",
    ),
    "empty_code": (
        {"id": "bad-id", "prompt": SECRET, "code": "  \n\t"},
        "bad-id",
        "code",
        "is empty",
    ),
    "empty_id": ({"id": " ", "prompt": SECRET, "code": SECRET}, None, "id", "is empty"),
    "lone_surrogate": (
        {"id": "bad-id", "prompt": SECRET + "\ud800", "code": SECRET},
        "bad-id",
        "prompt",
        "not valid UTF-8",
    ),
    "oversized": (
        {"id": "bad-id", "prompt": SECRET, "code": SECRET * 5000},
        "bad-id",
        "code",
        "above max_record_bytes=65536",
    ),
    "unknown_field": (
        {"id": "bad-id", "instruction": SECRET, "prompt": "p", "code": SECRET},
        "bad-id",
        "instruction",
        "unknown field",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_jsonl_row(tmp_path, case):
    obj, rid, field, problem = BAD_JSONL[case]
    path = write_jsonl_lines(tmp_path / "data.jsonl", good_lines() + [json.dumps(obj).encode()])
    with pytest.raises(RecordError) as info:
        read_records(path)
    msg = str(info.value)
    assert msg.startswith("data.jsonl: row 3")
    assert f"'{field}'" in msg and problem in msg
    if rid is not None:
        assert f"(id '{rid}')" in msg
    assert SECRET not in msg


def test_invalid_utf8_jsonl_names_row_id_and_field(tmp_path):
    bad = b'{"id": "bad-id", "prompt": "' + SECRET.encode() + b'", "code": "x = \xff\xfe"}'
    path = write_jsonl_lines(tmp_path / "data.jsonl", good_lines() + [bad])
    with pytest.raises(
        RecordError, match=r"^data\.jsonl: row 3 \(id 'bad-id'\): field 'code' is not valid UTF-8"
    ) as info:
        read_records(path)
    assert SECRET not in str(info.value)


def test_duplicate_id_names_both_rows(tmp_path):
    lines = good_lines() + [json.dumps({"id": "ok1", "prompt": SECRET, "code": SECRET}).encode()]
    path = write_jsonl_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(RecordError) as info:
        read_records(path)
    msg = str(info.value)
    assert msg == "data.jsonl: row 3 (id 'ok1'): field 'id' is a duplicate (first seen at row 1)"


@pytest.mark.parametrize(
    "line, detail",
    [
        (b'{"id": "bad-id", "prompt": "' + SECRET.encode() + b'", "code": ', "malformed JSON"),
        (b'["' + SECRET.encode() + b'"]', "expected a JSON object, got array"),
        (
            b'{"id": "x", "code": "' + SECRET.encode() + b'"' + b"\xff",
            "malformed JSON (invalid UTF-8)",
        ),
    ],
)
def test_malformed_json_row(tmp_path, line, detail):
    path = write_jsonl_lines(tmp_path / "data.jsonl", good_lines() + [line])
    with pytest.raises(RecordError) as info:
        read_records(path)
    msg = str(info.value)
    assert msg.startswith("data.jsonl: row 3: ") and detail in msg and SECRET not in msg


def test_blank_lines_skipped_and_row_is_line_index(tmp_path):
    lines = (
        good_lines(2) + [b"   "] + [json.dumps({"id": "bad-id", "prompt": "", "code": ""}).encode()]
    )
    path = write_jsonl_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(
        RecordError, match=r"^data\.jsonl: row 3 \(id 'bad-id'\): field 'code' is empty$"
    ):
        read_records(path)
    write_jsonl_lines(path, good_lines(2) + [b""])
    assert [r.id for r in read_records(path)] == ["ok0", "ok1"]


def test_max_record_bytes_is_configurable(tmp_path):
    path = (
        write_records(
            [Record(id="a", prompt="x" * 100, code="y" * 100)],
            tmp_path / "d.jsonl",
            max_record_bytes=200,
        )
        and tmp_path / "d.jsonl"
    )
    assert len(read_records(path, max_record_bytes=200)) == 1
    with pytest.raises(
        RecordError, match=r"row 0 \(id 'a'\): fields 'prompt' \+ 'code' are 200 bytes"
    ):
        read_records(path, max_record_bytes=199)


def test_unsupported_suffix_and_missing_file(tmp_path):
    with pytest.raises(RecordError, match="unsupported file type '.csv'"):
        read_records(tmp_path / "d.csv")
    with pytest.raises(RecordError, match="file not found"):
        read_records(tmp_path / "nope.parquet")


# --------------------------------------------------------------------------- bad Parquet rows


def _parquet(path: Path, columns: dict[str, pa.Array]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _strs(values):
    return pa.array(values, pa.string())


@pytest.mark.parametrize(
    "case",
    [
        "null_code",
        "empty_code",
        "bad_utf8",
        "dup",
        "oversized",
        "metadata_not_json",
        "metadata_not_mapping",
    ],
)
def test_bad_parquet_row(tmp_path, case):
    ids = ["a", "b", "c", "bad-id"]
    prompts = ["p", "p", "p", SECRET]
    codes: list = ["x=1", "x=2", "x=3", SECRET]
    meta: list = [None, '{"k": 1}', None, None]
    code_type = pa.string()
    field, problem = "field 'code'", ""
    if case == "null_code":
        codes[3], problem = None, "is missing"
    elif case == "empty_code":
        codes[3], problem = " ", "is empty"
    elif case == "bad_utf8":
        codes = [c.encode() for c in codes]
        codes[3] = SECRET.encode() + b"\xc3\x28"
        code_type, problem = pa.binary(), "not valid UTF-8"
    elif case == "dup":
        ids[3], field, problem = "b", "field 'id'", "duplicate (first seen at row 1)"
    elif case == "oversized":
        codes[3], field, problem = (
            SECRET * 5000,
            "fields 'prompt' + 'code'",
            "above max_record_bytes",
        )
    elif case == "metadata_not_json":
        meta[3], field, problem = "{" + SECRET, "field 'metadata'", "not valid JSON"
    elif case == "metadata_not_mapping":
        meta[3], field, problem = json.dumps([SECRET]), "field 'metadata'", "must be a mapping"
    path = _parquet(
        tmp_path / "data.parquet",
        {
            "id": _strs(ids),
            "prompt": _strs(prompts),
            "code": pa.array(codes, code_type),
            "metadata": _strs(meta),
        },
    )
    with pytest.raises(RecordError) as info:
        read_records(path)
    msg = str(info.value)
    rid = ids[3]
    assert msg.startswith(f"data.parquet: row 3 (id '{rid}'): {field}"), msg
    assert problem in msg and SECRET not in msg


def test_parquet_wrong_column_type_and_missing_column(tmp_path):
    path = _parquet(
        tmp_path / "data.parquet",
        {"id": pa.array([1, 2]), "prompt": _strs(["p", "q"]), "code": _strs([SECRET, SECRET])},
    )
    with pytest.raises(RecordError, match=r"^data\.parquet: row 0: field 'id' has type int64"):
        read_records(path)
    path = _parquet(tmp_path / "data.parquet", {"id": _strs(["a"]), "prompt": _strs([SECRET])})
    with pytest.raises(RecordError, match=r"field 'code' is missing \(no such column\)"):
        read_records(path)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 10)
    with pytest.raises(RecordError, match="not a valid Parquet file"):
        read_records(tmp_path / "junk.parquet")


def test_parquet_binary_columns_are_decoded(tmp_path):
    path = _parquet(
        tmp_path / "data.parquet",
        {
            "id": pa.array([b"a"], pa.binary()),
            "prompt": pa.array(["é".encode()], pa.binary()),
            "code": pa.array([b"x = 1"], pa.large_binary()),
        },
    )
    assert read_records(path) == [Record(id="a", prompt="é", code="x = 1", metadata=None)]


# --------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_invalid_record_writes_nothing(tmp_path, suffix):
    recs = sample_records(3) + [Record(id="bad-id", prompt=SECRET, code="   ")]
    path = tmp_path / f"out{suffix}"
    with pytest.raises(
        RecordError, match=rf"out{suffix}: row 4 \(id 'bad-id'\): field 'code' is empty"
    ):
        write_records(recs, path)
    assert list(tmp_path.iterdir()) == []
    write_records(sample_records(2), path)
    old = path.read_bytes()
    with pytest.raises(RecordError):
        write_records(recs, path)
    with pytest.raises(RecordError, match="duplicate"):
        write_records(sample_records(2) + sample_records(1), path)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_crash_during_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.parquet"
    write_records(sample_records(2), path)
    old = path.read_bytes()

    def exploding_write(table, where, **kwargs):
        Path(where).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(rec_mod.pq, "write_table", exploding_write)
    with pytest.raises(OSError, match="disk full"):
        write_records(sample_records(4), path)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


# --------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "privcode.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_validate(tmp_path):
    good = tmp_path / "good.parquet"
    write_records(sample_records(3), good)
    res = _cli("data", "validate", str(good))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"file": str(good), "records": 4, "valid": True}

    bad = write_jsonl_lines(
        tmp_path / "bad.jsonl",
        good_lines() + [json.dumps({"id": "bad-id", "prompt": SECRET, "code": ""}).encode()],
    )
    res = _cli("data", "validate", str(bad))
    assert res.returncode == 2
    assert res.stdout == ""
    assert "privcode: error: bad.jsonl: row 3 (id 'bad-id'): field 'code' is empty" in res.stderr
    assert SECRET not in res.stderr


@pytest.mark.parametrize(
    "meta, problem",
    [
        ({"tags": {SECRET}}, "of type set"),
        ({"score": float("nan")}, "non-finite number"),
        ({1: "x"}, "non-string key"),
    ],
)
def test_metadata_must_be_json(tmp_path, meta, problem):
    with pytest.raises(
        RecordError, match=rf"^m\.parquet: row 0 \(id 'a'\): field 'metadata' .*{problem}"
    ) as info:
        write_records(
            [Record(id="a", prompt="p", code="x = 1", metadata=meta)], tmp_path / "m.parquet"
        )
    assert SECRET not in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_read_snapshot_hashes_and_parses_one_buffer(tmp_path, suffix, monkeypatch):
    """Issue 41, point 7: the admitted digest and the trained records come from one read."""
    import hashlib

    from privcode.data.records import read_snapshot

    path = tmp_path / f"d{suffix}"
    recs = sample_records()
    write_records(recs, path)
    records, digest = read_snapshot(path)
    assert records == read_records(path) and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert read_snapshot(path, expected_sha256=digest)[0] == records
    # The file is opened exactly once.
    opened = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: opened.append(p) or real(p))
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("read twice"))
    read_snapshot(path, expected_sha256=digest)
    assert opened == [path]
    monkeypatch.undo()
    # Another file under the admitted path: refused before any record is parsed.
    write_records(recs[:1], path)
    with pytest.raises(RecordError, match="changed since the job was admitted"):
        read_snapshot(path, expected_sha256=digest)


def test_deep_json_and_duplicate_keys_are_clear_errors(tmp_path):
    """issue 43 point 10: a row nested past the parser's recursion limit is a RecordError
    (not a RecursionError that kills the reader), and a key twice in one object is refused
    (which value would train depended on the reader); neither message holds the row's text."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"id": "a", "prompt": "p", "code": "c", "metadata": ' + "[" * 100_000 + "\n")
    with pytest.raises(RecordError, match="row 0: malformed JSON") as caught:
        read_records(deep)
    assert len(str(caught.value)) < 300
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"id": "a", "prompt": "p", "code": "secret-1", "code": "secret-2"}\n')
    with pytest.raises(RecordError, match="'code' appears twice") as caught:
        read_records(twice)
    assert "secret" not in str(caught.value)
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"id": "a", "prompt": "p", "code": "c", "metadata": {"k": 1, "k": 2}}\n')
    with pytest.raises(RecordError, match="appears twice"):
        read_records(nested)
    deeper = tmp_path / "deeper.jsonl"
    deeper.write_text(
        '{"id": "a", "prompt": "p", "code": "c", "metadata": '
        + "[" * 100_000
        + "]" * 100_000
        + "}\n"
    )
    with pytest.raises(RecordError, match="nested too deeply"):
        read_records(deeper)
