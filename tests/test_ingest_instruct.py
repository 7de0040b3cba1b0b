"""Instruction files (JSONL, JSON, Parquet, CSV) read as checked prompt/code rows.

Real files in tmp_path, each known layout and custom columns; every kind of bad row
stops the read with an error naming the file, the row and the field, never the value.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from privcode.data.ingest.errors import IngestError
from privcode.data.ingest.instruct import (
    LAYOUTS,
    ColumnMap,
    InstructionRow,
    detect_layout,
    read_instructions,
    strip_fence,
)
from privcode.errors import PrivcodeError

SECRET = "s3cr3t-Value-7731"  # a private value: must never appear in an error message
CODE = "def add(a, b):\n    return a + b\n"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def read(path: Path, **kw) -> list[InstructionRow]:
    return list(read_instructions(path, **kw))


def bad(path: Path, *fragments: str, **kw) -> str:
    with pytest.raises(IngestError) as info:
        read(path, **kw)
    msg = str(info.value)
    assert path.name in msg
    for fragment in fragments:
        assert fragment in msg, msg
    assert SECRET not in msg
    return msg


# --------------------------------------------------------------------------- layouts


def test_layouts_and_detection():
    assert set(LAYOUTS) == {
        "privcode",
        "magicoder-oss-instruct",
        "magicoder-evol-instruct",
        "alpaca",
    }
    assert detect_layout(["id", "prompt", "code", "metadata"]) == ColumnMap("prompt", "code", "id")
    oss = detect_layout(["lang", "raw_index", "index", "seed", "problem", "solution"])
    assert oss == ColumnMap("problem", "solution", id="index", language="lang")
    assert detect_layout(["problem", "solution"]) == ColumnMap("problem", "solution")
    assert detect_layout(["instruction", "response"]) == ColumnMap("instruction", "response")
    assert detect_layout(["instruction", "input", "output"]) == ColumnMap(
        "instruction", "output", input="input"
    )
    assert detect_layout(["question", "answer"]) is None
    assert issubclass(IngestError, PrivcodeError)


def test_each_layout_as_jsonl(tmp_path):
    priv = write_jsonl(
        tmp_path / "priv.jsonl",
        [{"id": "a1", "prompt": "Add two numbers.", "code": CODE, "metadata": {"x": 1}}],
    )
    (row,) = read(priv)
    assert (row.source, row.row, row.prompt, row.code) == (
        "priv.jsonl",
        1,
        "Add two numbers.",
        CODE,
    )
    assert (row.language, row.original_id) == ("python", "a1")

    oss = write_jsonl(
        tmp_path / "oss.jsonl",
        [
            {
                "lang": "rust",
                "seed": "fn x() {}",
                "index": 7,
                "problem": "Sum.",
                "solution": "fn s() {}",
            },
            {"lang": "Python3", "seed": "", "index": 8, "problem": "Add.", "solution": CODE},
        ],
    )
    rows = read(oss)
    assert [(r.language, r.original_id, r.code) for r in rows] == [
        ("rust", "7", "fn s() {}"),
        ("python", "8", CODE),
    ]
    assert all("seed" not in r.prompt for r in rows)

    evol = write_jsonl(tmp_path / "evol.jsonl", [{"instruction": "Add.", "response": CODE}])
    (row,) = read(evol)
    assert (row.prompt, row.code, row.language, row.original_id) == ("Add.", CODE, "python", None)

    alpaca = write_jsonl(
        tmp_path / "alpaca.jsonl",
        [
            {"instruction": "Reverse the string.", "input": "'hello'", "output": "s[::-1]"},
            {"instruction": "Add.", "input": "", "output": CODE},
        ],
    )
    first, second = read(alpaca)
    assert first.prompt == "Reverse the string.\n\n'hello'" and first.code == "s[::-1]"
    assert second.prompt == "Add."


def test_blank_lines_bom_and_row_numbers_are_lines(tmp_path):
    path = tmp_path / "gaps.jsonl"
    lines = [json.dumps({"instruction": f"Q{i}", "response": f"x = {i}"}) for i in range(3)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(lines).encode() + b"\n")
    assert [r.row for r in read(path)] == [1, 3, 5]


def test_json_array_and_json_lines(tmp_path):
    arr = tmp_path / "evol.json"
    arr.write_text(json.dumps([{"instruction": f"Q{i}", "response": f"y = {i}"} for i in range(4)]))
    rows = read(arr)
    assert [r.row for r in rows] == [1, 2, 3, 4] and rows[3].code == "y = 3"
    lines = write_jsonl(tmp_path / "lines.json", [{"prompt": "P", "code": "z = 1"}])
    assert read(lines)[0].code == "z = 1"
    notarr = tmp_path / "obj.json"
    notarr.write_text("[1, 2")
    bad(notarr, "not JSON")


def test_custom_columns_win_over_the_layout(tmp_path):
    path = write_jsonl(
        tmp_path / "custom.jsonl",
        [
            {
                "question": "Add.",
                "answer": CODE,
                "uid": 42,
                "language": "Go",
                "instruction": "x",
                "response": "ignored",
            }
        ],
    )
    (row,) = read(
        path,
        prompt_column="question",
        code_column="answer",
        id_column="uid",
        language_column="language",
    )
    assert (row.prompt, row.code, row.original_id, row.language) == ("Add.", CODE, "42", "go")
    (row,) = read(path)  # no flags: the Evol-Instruct layout is detected
    assert row.code == "ignored"
    (row,) = read(path, code_column="answer")  # one flag: the other column from the layout
    assert (row.prompt, row.code) == ("x", CODE)


def test_undetectable_columns_name_the_columns_and_the_flags(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": SECRET, "answer": CODE}])
    msg = bad(path, "'question'", "'answer'", "--prompt-column", "--code-column")
    assert "row" not in msg
    bad(path, "--code-column", "'nope'", prompt_column="question", code_column="nope")
    msg = bad(path, "--code-column", prompt_column="question")
    assert "--prompt-column" not in msg.split("pass")[-1]


def test_unsupported_and_missing_files(tmp_path):
    with pytest.raises(IngestError, match="unsupported instruction file type '.txt'"):
        read(tmp_path / "x.txt")
    with pytest.raises(IngestError, match="file not found"):
        read(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- Parquet / CSV


def test_parquet_layout_custom_columns_and_types(tmp_path):
    path = tmp_path / "oss.parquet"
    table = pa.table(
        {
            "problem": ["Add.", "Sub."],
            "solution": [CODE, "```go\nfunc Sub() {}\n```"],
            "lang": pa.array(["python", None]).dictionary_encode(),
            "index": pa.array([1, 2], pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=1)
    rows = read(path)
    assert [(r.row, r.language, r.original_id) for r in rows] == [
        (1, "python", "1"),
        (2, "go", "2"),
    ]
    assert rows[1].code == "func Sub() {}"

    custom = tmp_path / "custom.parquet"
    pq.write_table(pa.table({"q": ["Add."], "a": pa.array([CODE.encode()], pa.binary())}), custom)
    (row,) = read(custom, prompt_column="q", code_column="a")
    assert (row.prompt, row.code, row.source) == ("Add.", CODE, "custom.parquet")

    typed = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"prompt": ["P", "Q"], "code": pa.array([1, 2], pa.int64())}), typed)
    bad(typed, "row 1", "field 'code'", "must be a string, got integer")
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"prompt": ["P"], "code": pa.array([1.5], pa.float64())}), floats)
    bad(floats, "row 1", "field 'code'", "type double")

    utf = tmp_path / "utf.parquet"
    values = pa.array([CODE.encode(), b"x = '\xff" + SECRET.encode() + b"'"], pa.binary())
    pq.write_table(pa.table({"prompt": ["P", "Q"], "code": values}), utf)
    bad(utf, "row 2", "field 'code'", "UTF-8")

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    bad(broken, "not a valid Parquet file")


def test_csv_custom_columns_big_fields_bom_and_quoting(tmp_path):
    big = "x = 1\n" * 40_000  # 240 kB: above the csv module's default field limit
    path = tmp_path / "data.csv"
    with open(path, "w", newline="", encoding="utf-8-sig") as fh:  # Excel's BOM
        w = csv.writer(fh)
        w.writerow(["task", "snippet", "lang"])
        w.writerow(["Add, then return.", CODE, "python"])
        w.writerow(["Big.", big, ""])
        w.writerow([])
        w.writerow(['Quote "me".', "print('a,b')", "JS"])
    rows = read(
        path,
        prompt_column="task",
        code_column="snippet",
        language_column="lang",
        max_record_bytes=1 << 20,
    )
    assert [r.row for r in rows] == [1, 2, 4]
    assert rows[0].prompt == "Add, then return." and rows[0].code == CODE
    assert rows[1].code == big and rows[1].language == "python"
    assert rows[2].prompt == 'Quote "me".' and rows[2].language == "javascript"

    alpaca = write_csv(
        tmp_path / "alpaca.csv", ["instruction", "input", "output"], [["Add.", "", CODE]]
    )
    assert read(alpaca)[0].code == CODE


def test_csv_bad_rows(tmp_path):
    short = write_csv(tmp_path / "short.csv", ["instruction", "output"], [["Add.", CODE], [SECRET]])
    bad(short, "row 2", "field 'output'", "missing")
    empty = write_csv(tmp_path / "empty.csv", ["instruction", "output"], [[SECRET, "   "]])
    bad(empty, "row 1", "field 'output'", "empty")
    utf = tmp_path / "utf.csv"
    utf.write_bytes(b"instruction,output\nAdd.," + SECRET.encode() + b"\xfe\xff\n")
    bad(utf, "row 1", "field 'output'", "UTF-8")
    quoting = tmp_path / "quoting.csv"
    quoting.write_bytes(b'instruction,output\nAdd.,x = 1\nSub.,"x = 2"' + SECRET.encode() + b"\n")
    bad(quoting, "row 2", "malformed CSV")
    dup = write_csv(tmp_path / "dup.csv", ["output", "output"], [["a", "b"]])
    bad(dup, "header", "'output'", "twice")
    blank = tmp_path / "blank.csv"
    blank.write_text("")
    bad(blank, "no header")


# --------------------------------------------------------------------------- bad JSON rows


@pytest.mark.parametrize(
    ("row", "fragments"),
    [
        ({"instruction": "Add."}, ("row 2", "field 'response'", "missing")),
        ({"instruction": SECRET, "response": None}, ("row 2", "field 'response'", "missing")),
        ({"instruction": SECRET, "response": 12345}, ("row 2", "field 'response'", "integer")),
        (
            {"instruction": ["a", SECRET], "response": CODE},
            ("row 2", "field 'instruction'", "array"),
        ),
        ({"instruction": SECRET, "response": " \n\t"}, ("row 2", "field 'response'", "empty")),
        (
            {"instruction": SECRET, "response": "```python\n```"},
            ("row 2", "field 'response'", "empty"),
        ),
        (
            {"instruction": "x", "response": "y = '\ud800" + SECRET + "'"},
            ("row 2", "field 'response'", "UTF-8"),
        ),
        (
            {"instruction": "x", "response": "y = '" + SECRET * 20 + "'"},
            ("row 2", "'instruction' + 'response'", "max_record_bytes=200"),
        ),
    ],
)
def test_bad_json_rows_name_file_row_field_not_value(tmp_path, row, fragments):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "Add.", "response": CODE}, row])
    bad(path, *fragments, max_record_bytes=200)


def test_bad_json_lines(tmp_path):
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_text(
        json.dumps({"prompt": "P", "code": "x = 1"}) + "\n{'code': '" + SECRET + "'\n"
    )
    bad(notjson, "row 2", "not JSON")
    notobj = tmp_path / "notobj.jsonl"
    notobj.write_text(
        json.dumps({"prompt": "P", "code": "x = 1"}) + "\n" + json.dumps([SECRET]) + "\n"
    )
    bad(notobj, "row 2", "expected a JSON object, got array")
    rawutf = tmp_path / "rawutf.jsonl"
    rawutf.write_bytes(b'{"prompt": "P", "code": "x = \'\xc3\x28' + SECRET.encode() + b"'\"}\n")
    bad(rawutf, "row 1", "field 'code'", "UTF-8")
    badid = write_jsonl(
        tmp_path / "badid.jsonl", [{"id": {"k": SECRET}, "prompt": "P", "code": "x"}]
    )
    bad(badid, "row 1", "field 'id'", "string or an integer")
    badlang = write_jsonl(
        tmp_path / "badlang.jsonl", [{"problem": "P", "solution": "x", "lang": SECRET * 5}]
    )
    bad(badlang, "row 1", "field 'lang'", "language name")


def test_rows_hide_their_text():
    row = InstructionRow("f.jsonl", 3, SECRET, SECRET, "python", SECRET)
    assert SECRET not in repr(row) and "row=3" in repr(row)


# --------------------------------------------------------------------------- fences


def test_markdown_fences(tmp_path):
    assert strip_fence("```python\ndef f():\n    pass\n```") == ("def f():\n    pass", "python")
    assert strip_fence("\n  ```\nx = 1\n```  \n") == ("x = 1", None)
    assert strip_fence('``` js title="a.js"\nlet a = 1;\n```') == ("let a = 1;", "js")
    prose = "Here you go:\n```python\nx = 1\n```\nDone."
    assert strip_fence(prose) == (prose, None)
    two = "```python\nx = 1\n```\ntext\n```python\ny = 2\n```"
    assert strip_fence(two) == (two, None)
    assert strip_fence("print('```')") == ("print('```')", None)

    path = write_jsonl(
        tmp_path / "fenced.jsonl",
        [
            {"problem": "A", "solution": "```typescript\nlet a: number = 1;\n```"},
            {"problem": "B", "solution": "```ts\nlet b = 2;\n```", "lang": "rust"},
            {"problem": "C", "solution": "```\nc = 3\n```"},
            {"problem": "D", "solution": "```py\nd = 4\n```"},
        ],
    )
    rows = read(path)
    assert [(r.code, r.language) for r in rows] == [
        ("let a: number = 1;", "typescript"),
        ("let b = 2;", "rust"),  # a language column wins over the fence's tag
        ("c = 3", "python"),  # no tag: the default
        ("d = 4", "python"),  # aliases mapped
    ]
