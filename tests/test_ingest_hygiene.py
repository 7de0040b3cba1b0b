"""Stable ids, exact and near-duplicate removal, the held-out split by file, and the
counts-only secret / PII scan of an ingested corpus."""

from __future__ import annotations

import hashlib
import json
import random
import re
import time

import pytest

from privcode.data.ingest.errors import IngestError
from privcode.data.ingest.hygiene import (
    MAX_SCAN_LINE_CHARS,
    DedupResult,
    _SecretScanner,
    dedup,
    record_id,
    scan,
    shingle_hashes,
    split_by_file,
)

# --------------------------------------------------------------------------- ids


K = b"k" * 32


def test_record_ids_are_stable_and_follow_every_field():
    rid = record_id(K, "source-1-repository", "billing/invoice.py", 3, 9, "def f(): pass")
    assert re.fullmatch(r"r-[0-9a-f]{20}", rid)
    assert rid == record_id(K, "source-1-repository", "billing/invoice.py", 3, 9, "def f(): pass")
    changed = [
        record_id(K, "source-1-repository", "billing/invoice.py", 3, 9, "def f(): return 1"),
        record_id(K, "source-2-repository", "billing/invoice.py", 3, 9, "def f(): pass"),
        record_id(K, "source-1-repository", "billing/other.py", 3, 9, "def f(): pass"),
        record_id(K, "source-1-repository", "billing/invoice.py", 4, 9, "def f(): pass"),
        record_id(K, "source-1-repository", "billing/invoice.py", 3, 10, "def f(): pass"),
    ]
    assert len({rid, *changed}) == 6
    # the encoding is unambiguous: moving text between fields changes the id
    assert record_id(K, "ab", "c", 1, 1, "x") != record_id(K, "a", "bc", 1, 1, "x")
    assert record_id(K, "s", "p", 1, 1, "lone \ud800 surrogate").startswith("r-")
    with pytest.raises(TypeError):
        record_id(K, "s", "p", "1", 2, "x")  # type: ignore[arg-type]
    # Keyed (issue 41, point 10): another key, another id; no unkeyed hash of the fields.
    other = record_id(b"o" * 32, "source-1-repository", "billing/invoice.py", 3, 9, "def f(): pass")
    assert other != rid
    payload = (
        '["privcode-record-id/1","source-1-repository","billing/invoice.py",3,9,"def f(): pass"]'
    )
    assert rid[2:] not in hashlib.sha256(payload.encode()).hexdigest()


# --------------------------------------------------------------------------- dedup

LONG = '''def reconcile_invoices(invoices, payments, tolerance=0.01):
    """Match each payment to the invoice it settles and report what is left open."""
    open_items = {}
    for invoice in invoices:
        open_items[invoice["number"]] = {
            "customer": invoice["customer"],
            "amount": round(invoice["amount"], 2),
            "paid": 0.0,
            "due": invoice["due_date"],
        }
    unmatched = []
    for payment in payments:
        ref = payment.get("reference")
        if ref in open_items:
            entry = open_items[ref]
            entry["paid"] = round(entry["paid"] + payment["amount"], 2)
        else:
            unmatched.append(payment)
    settled, partial, overdue = [], [], []
    for number, entry in sorted(open_items.items()):
        remaining = entry["amount"] - entry["paid"]
        if abs(remaining) <= tolerance:
            settled.append(number)
        elif entry["paid"] > 0:
            partial.append((number, round(remaining, 2)))
        else:
            overdue.append((number, entry["customer"], entry["due"]))
    return {"settled": settled, "partial": partial, "overdue": overdue, "unmatched": unmatched}
'''
RENAMED = LONG.replace("unmatched", "unknown_payments")  # a variable renamed (4 uses)
UNRELATED = """def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        elif ch in units and number:
            total += int(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"bad duration near {ch!r}")
    return total
"""


def test_exact_and_near_duplicates():
    reformatted = LONG.replace("    ", "\t").replace("\n", "\n\n")  # only whitespace differs
    items = [
        ("a", LONG),
        ("b", UNRELATED),
        ("c", reformatted),
        ("d", RENAMED),
        ("e", UNRELATED + "\n\n"),
        ("f", "x = 1"),
        ("g", "y = 2"),
    ]
    result = dedup(items)
    assert isinstance(result, DedupResult)
    assert result.kept == ["a", "b", "f", "g"]
    assert result.exact == {"c": "a", "e": "b"}
    assert result.near == {"d": "a"}
    assert result.seconds_exact >= 0 and result.seconds_near >= 0
    assert result.counts() == {"kept": 4, "exact": 2, "near": 1}
    # the first of each group is kept, in input order
    again = dedup([("d", RENAMED), ("b", UNRELATED), ("a", LONG)])
    assert again.kept == ["d", "b"] and again.near == {"a": "d"}
    # a stricter threshold keeps the renamed copy
    assert dedup([("a", LONG), ("d", RENAMED)], threshold=0.99).kept == ["a", "d"]


def test_dedup_inputs_and_shingles():
    assert dedup([]).kept == []
    with pytest.raises(ValueError, match="key of item 0"):
        dedup([("a", "x = 1"), ("a", "y = 2")])
    with pytest.raises(ValueError, match="threshold"):
        dedup([("a", "x")], threshold=0.0)
    assert shingle_hashes("") == set()
    assert len(shingle_hashes("a b")) == 1  # fewer tokens than a shingle: one of all tokens
    assert len(shingle_hashes("a ( b ) c d")) == 2
    assert shingle_hashes("f(x)+1") == shingle_hashes("f ( x ) + 1")
    # code without tokens (only whitespace differences) is matched exactly, never as near
    assert dedup([("a", " "), ("b", "\n")]).exact == {"b": "a"}


def _synthetic(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = [
        f"{a}{b}"
        for a in ("get", "set", "load", "save", "parse", "check")
        for b in ("user", "order", "row", "item", "total", "config", "file", "token")
    ]
    out = []
    for i in range(n):
        names = rng.sample(words, 6)
        body = "\n".join(
            f"    {names[j % 6]}_{rng.randrange(1000)} = {names[(j + 1) % 6]}(x, {rng.randrange(100)})"
            for j in range(rng.randint(6, 20))
        )
        out.append((f"k{i}", f"def {names[0]}_{i}(x):\n{body}\n    return x\n"))
    for i in range(0, n, 10):  # every tenth gets an exact copy
        out.append((f"copy{i}", out[i][1]))
    return out


@pytest.mark.heavy
def test_dedup_30k_items_is_fast():
    items = _synthetic(30_000)
    cpu, wall = time.process_time(), time.perf_counter()
    result = dedup(items)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert len(result.exact) >= 3_000
    assert cpu < 30, f"dedup of {len(items)} items took {cpu:.1f} s of CPU ({wall:.1f} s wall)"


# --------------------------------------------------------------------------- split


def _groups(sizes: list[int]) -> dict[str, list[str]]:
    return {f"src:file{f}.py": [f"r{f}-{i}" for i in range(n)] for f, n in enumerate(sizes)}


def test_split_keeps_files_whole_and_hits_the_fraction():
    rng = random.Random(1)
    groups = _groups([rng.randint(1, 12) for _ in range(80)])
    total = sum(len(v) for v in groups.values())
    train, heldout = split_by_file(groups, 0.2, b"key-1")
    assert not train & heldout and len(train | heldout) == total
    for ids in groups.values():  # whole files on one side
        assert set(ids) <= train or set(ids) <= heldout
    assert 0.2 * total <= len(heldout) < 0.2 * total + 12
    # deterministic for a key, another key gives another split
    assert split_by_file(groups, 0.2, b"key-1") == (train, heldout)
    assert split_by_file(dict(reversed(list(groups.items()))), 0.2, b"key-1") == (train, heldout)
    assert split_by_file(groups, 0.2, b"key-2")[1] != heldout


def test_split_edge_cases():
    two = _groups([5, 5])
    train, heldout = split_by_file(two, 0.01, b"k")
    assert len(heldout) == 5 and len(train) == 5  # at least one file held out
    train, heldout = split_by_file(two, 0.99, b"k")
    assert len(heldout) == 5 and len(train) == 5  # and at least one kept
    assert split_by_file(_groups([7]), 0.5, b"k") == ({f"r0-{i}" for i in range(7)}, set())
    assert split_by_file({"empty": [], **_groups([1, 1, 1])}, 0.3, b"k")[1]
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(IngestError, match="heldout_fraction"):
            split_by_file(two, fraction, b"k")
    with pytest.raises(IngestError, match="seed_key"):
        split_by_file(two, 0.5, b"")


# --------------------------------------------------------------------------- scan

AWS = "AKIAIOSFODNN7EXAMPLE"
PEM = "-----BEGIN RSA PRIVATE KEY-----"
HEX = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
B64 = "Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1Njc4OTBhYmNkZWZnaGlqa2xtbm9w"
EMAIL = "jane.roe@corp-internal.example"
IP = "203.0.113.77"
LEAKY = f'''def connect():
    aws_access_key_id = "{AWS}"
    signing_digest = "{HEX}"
    blob = "{B64}"
    key = """{PEM}
MIIEpAIBAAKCAQEA
-----END RSA PRIVATE KEY-----"""
    return client(host="{IP}", owner="{EMAIL}")
'''


def test_scan_counts_secrets_and_pii_never_values():
    records = [
        ("source-1-repository", LEAKY),
        ("source-2-instructions", f"Write to {EMAIL}.\ndef f(x):\n    return x + 1\n"),
        ("source-2-instructions", "def g(y):\n    return y * 2\n"),
        ("source-1-repository", "x = 1\n" + "z" * (MAX_SCAN_LINE_CHARS + 1) + "\n"),
    ]
    report = scan(records)
    doc = report.to_dict()
    text = json.dumps(doc)
    for value in (AWS, PEM, HEX, B64, EMAIL, IP, "MIIEpAIBAAKCAQEA"):
        assert value not in text
    repo, instr = doc["sources"]["source-1-repository"], doc["sources"]["source-2-instructions"]
    assert repo["secrets"] == {
        "AWS Access Key": 1,
        "Base64 High Entropy String": 1,
        "Hex High Entropy String": 1,
        "Private Key": 1,
    }
    assert repo["pii"]["email"] == 1 and repo["pii"]["ip_address"] == 1
    assert (repo["records"], repo["records_with_secrets"], repo["long_lines_skipped"]) == (2, 1, 1)
    assert instr == {
        "records": 2,
        "records_with_secrets": 0,
        "records_with_pii": 1,
        "secrets": {},
        "pii": {"email": 1},
        "long_lines_skipped": 0,
    }
    assert doc["totals"]["records"] == 4 and doc["totals"]["pii"]["email"] == 2
    assert doc["counts_only"] is True and "detect-secrets" in doc["detectors"]["secrets"]
    assert report.seconds >= 0 and "seconds" not in text  # deterministic: no timings
    assert scan(records).to_dict() == doc
    assert scan([]).to_dict()["totals"]["records"] == 0


def test_the_scan_pre_check_misses_nothing():
    """The cheap per-line pre-check gives exactly detect-secrets' own line scan."""
    from collections import Counter

    from detect_secrets.core.scan import _process_line_based_plugins
    from detect_secrets.settings import default_settings

    lines = [
        f'key = "{AWS}"',
        PEM,
        f'digest = "{HEX}"',
        f"token: '{B64}'",
        'url = "https://admin:hunter2pass@db.internal/x"',
        'db_password = "correct-horse-battery-staple"',
        'if "s3cr3t-pa55" == password:',
        'jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"',
        'slack = "xoxb-123456789012-abcdefghij"',
        "host = '8.8.4.4'",
        "password = get_password()  # pragma: allowlist secret",
        "    return total",
        "",
    ]
    rng = random.Random(3)
    texts = ["\n".join(rng.sample(lines, rng.randint(1, 6))) for _ in range(60)]
    with default_settings():
        scanner = _SecretScanner()
        for text in texts:
            numbered = list(enumerate(text.split("\n"), start=1))
            full = Counter(str(s.type) for s in _process_line_based_plugins(numbered, "record.py"))
            assert scanner.scan(text) == (full, 0)
