"""The private demo corpus: determinism, canary planting, splits, PII, atomic output, CLI.

Canaries are planted in place: a few member records carry one each, no record is copied
(a copy would train its function twice), and they take at most 5% of the training records.
"""

from __future__ import annotations

import ast
import json
import random
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from privcode.config import DataConfig
from privcode.data import pii
from privcode.data.canaries import CANARY_FORMATS, MAX_CANARY_FRACTION, sample_canary_value
from privcode.data.demo import FILES, build_demo_corpus
from privcode.data.records import read_records
from privcode.errors import PrivcodeError
from privcode.utils import sha256_file

#: 1000 records, 900 members: the 5 x 3 x (1 + 2) = 45 canary rows are 5% of them.
CFG = DataConfig(seed=7, size=1000, include_humaneval=True, canary_repetitions=(1, 2))
N_KINDS, N_PLACEMENTS = len(CFG.canary_kinds), len(CFG.canary_placements)
N_HELDOUT = 100
N_MEMBERS = CFG.size - N_HELDOUT


def _load(d: Path) -> dict:
    return {
        "dir": d,
        "manifest": json.loads((d / "manifest.json").read_text()),
        "canaries": json.loads((d / "canaries.json").read_text())["canaries"],
        "train": read_records(d / "train.parquet", max_record_bytes=CFG.max_record_bytes),
        "heldout": read_records(d / "heldout.parquet", max_record_bytes=CFG.max_record_bytes),
    }


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = {}
    for name, cfg in (("a", CFG), ("b", CFG), ("other", replace(CFG, seed=8))):
        returned = build_demo_corpus(root / name, cfg, progress=False)
        out[name] = _load(root / name)
        out[name]["returned"] = returned
    return out


@pytest.fixture(scope="module")
def corpus(builds):
    return builds["a"]


def test_same_seed_same_bytes(builds):
    a, b = builds["a"], builds["b"]
    for name in FILES:
        assert (a["dir"] / name).read_bytes() == (b["dir"] / name).read_bytes(), name
    assert a["returned"] == a["manifest"]
    for name, info in a["manifest"]["files"].items():
        assert info["sha256"] == sha256_file(a["dir"] / name)
        assert info["bytes"] == (a["dir"] / name).stat().st_size
    text = (a["dir"] / "manifest.json").read_text()
    assert str(a["dir"]) not in text and str(Path.home()) not in text


def test_different_seed_differs(builds):
    a, o = builds["a"], builds["other"]
    for name in ("train.parquet", "heldout.parquet", "canaries.json"):
        assert a["manifest"]["files"][name]["sha256"] != o["manifest"]["files"][name]["sha256"]
    assert {c["value"] for c in a["canaries"]}.isdisjoint(c["value"] for c in o["canaries"])
    assert {r.id for r in a["heldout"]} != {r.id for r in o["heldout"]}


def test_counts(corpus):
    counts = corpus["manifest"]["counts"]
    n_canaries = N_KINDS * N_PLACEMENTS * len(CFG.canary_repetitions)
    n_canary_records = N_KINDS * N_PLACEMENTS * sum(CFG.canary_repetitions)
    assert n_canaries == 30 and n_canary_records == 45
    assert counts["canaries"] == len(corpus["canaries"]) == n_canaries
    assert counts["canary_records"] == n_canary_records
    assert counts["heldout"] == len(corpus["heldout"]) == N_HELDOUT
    assert counts["ordinary_members"] == N_MEMBERS
    # in place: the canaries add no row, the training set is the members
    assert counts["train_records"] == len(corpus["train"]) == N_MEMBERS
    kinds = Counter(r.metadata["kind"] for r in corpus["train"])
    assert kinds == {"ordinary": N_MEMBERS - n_canary_records, "canary": n_canary_records}
    assert n_canary_records <= MAX_CANARY_FRACTION * len(corpus["train"])
    assert {r.metadata["kind"] for r in corpus["heldout"]} == {"ordinary"}
    assert corpus["manifest"]["data_config"]["canary_repetitions"] == [1, 2]
    assert counts["pool_available"] >= 1000


def test_each_canary_is_in_exactly_its_records(corpus):
    train, heldout = corpus["train"], corpus["heldout"]
    combos = set()
    for c in corpus["canaries"]:
        combos.add((c["kind"], c["placement"], c["repetitions"]))
        v = c["value"]
        in_prompt = {r.id for r in train if v in r.prompt}
        in_code = {r.id for r in train if v in r.code}
        ids = set(c["record_ids"])
        assert len(ids) == c["repetitions"] == len(c["record_ids"])
        assert in_prompt == (ids if c["placement"] in ("prompt", "joint") else set())
        assert in_code == (ids if c["placement"] in ("code", "joint") else set())
        assert not any(v in r.prompt or v in r.code or v in json.dumps(r.metadata) for r in heldout)
        if c["placement"] != "prompt":
            assert all(c["code_prefix"] + v + '"' in r.code for r in train if r.id in ids)
        if c["placement"] != "code":
            assert all(c["prompt_prefix"] + v in r.prompt for r in train if r.id in ids)
        for r in train:
            if r.id in ids:
                assert r.metadata["kind"] == "canary" and r.metadata["canary_id"] == c["id"]
    assert combos == {
        (k, p, r)
        for k in CFG.canary_kinds
        for p in CFG.canary_placements
        for r in CFG.canary_repetitions
    }


def _unplanted(rec, canary: dict | None) -> tuple[str, str]:
    """``rec``'s (prompt, code) with its canary, if any, cut off again."""
    prompt, code = rec.prompt, rec.code
    if canary and canary["in_prompt"]:
        cut = prompt.rfind("\n\n" + canary["prompt_prefix"] + canary["value"])
        assert cut > 0
        prompt = prompt[:cut]
    if canary and canary["in_code"]:
        cut = code.rfind("\n\n\n# Example usage\n" + canary["code_prefix"] + canary["value"])
        assert cut > 0
        code = code[:cut]
    return prompt.rstrip(), code.rstrip()


def test_canaries_are_planted_in_place_never_in_copies(corpus):
    """No training record, its canary removed, repeats another's code or prompt: no copy."""
    by_id = {c["id"]: c for c in corpus["canaries"]}
    train = corpus["train"]
    stripped = [_unplanted(r, by_id.get(r.metadata.get("canary_id"))) for r in train]
    prompts = Counter(p for p, _ in stripped)
    codes = Counter(c for _, c in stripped)
    for r, (p, c) in zip(train, stripped, strict=True):
        assert prompts[p] == 1 and codes[c] == 1, r.id
    # the hosts look like every other member: the same kind of id and metadata
    hosts = [r for r in train if r.metadata["kind"] == "canary"]
    plain = [r for r in train if r.metadata["kind"] == "ordinary"]
    assert all(re.fullmatch(r"rec-[0-9a-f]{12}", r.id) for r in train)
    assert {k for r in hosts for k in r.metadata} == {k for r in plain for k in r.metadata} | {
        "canary_id"
    }
    assert "base_id" not in json.dumps([r.metadata for r in train])
    assert all(r.metadata["pii"] is None for r in hosts)  # PII-free members, there are enough


def test_default_config_builds_without_humaneval(tmp_path):
    """The default data config fits the 5% (45 of 900) and keeps HumanEval out of training."""
    cfg = DataConfig()
    assert cfg.include_humaneval is False
    m = build_demo_corpus(tmp_path / "d", cfg, progress=False)
    counts = m["counts"]
    assert counts["train_records"] == counts["ordinary_members"] == 900
    assert counts["canary_records"] == 45 <= MAX_CANARY_FRACTION * counts["train_records"]
    assert m["sources"]["humaneval_problems"] == 0
    recs = read_records(tmp_path / "d" / "train.parquet") + read_records(
        tmp_path / "d" / "heldout.parquet"
    )
    assert not any(r.metadata["source"].startswith("humaneval:") for r in recs)


def test_too_many_canaries_is_a_clear_error(tmp_path):
    """45 canary rows in 180 members (25%) would not be a few canaries but the data."""
    with pytest.raises(PrivcodeError, match=r"^data\.canary_repetitions: .*45 records.*5%.* 180 "):
        build_demo_corpus(tmp_path / "out", replace(CFG, size=200), progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_canaries_go_into_pii_members_when_no_member_is_pii_free(tmp_path):
    cfg = replace(
        CFG, size=200, pii_fraction=1.0, canary_kinds=("email",), canary_repetitions=(1, 2)
    )
    m = build_demo_corpus(tmp_path / "d", cfg, progress=False)
    assert m["counts"]["canary_records"] == 9 and m["counts"]["train_records"] == 180
    train = read_records(tmp_path / "d" / "train.parquet")
    hosts = [r for r in train if r.metadata["kind"] == "canary"]
    assert len(hosts) == 9 and all(r.metadata["pii"] for r in hosts)


def test_canary_values_unique_and_formatted(corpus):
    values = [c["value"] for c in corpus["canaries"]]
    assert len(set(values)) == len(values)
    assert not any(a != b and a in b for a in values for b in values)
    for c in corpus["canaries"]:
        assert re.fullmatch(c["format"]["regex"], c["value"]), c["id"]
        assert c["format"]["description"]
    rng = random.Random(0)
    for kind, fmt in CANARY_FORMATS.items():  # the exposure audit's candidates share the format
        draws = [sample_canary_value(kind, rng) for _ in range(50)]
        assert all(re.fullmatch(str(fmt["regex"]), d) for d in draws)
        assert len(set(draws)) == 50


def test_splits_disjoint(corpus):
    train_ids = {r.id for r in corpus["train"]}
    held_ids = {r.id for r in corpus["heldout"]}
    assert len(train_ids) == len(corpus["train"]) and len(held_ids) == len(corpus["heldout"])
    assert train_ids.isdisjoint(held_ids)
    hosts = [rid for c in corpus["canaries"] for rid in c["record_ids"]]
    assert len(set(hosts)) == len(hosts)  # one canary per record
    assert set(hosts) <= train_ids and set(hosts).isdisjoint(held_ids)
    held_fns = {
        (r.metadata["source"], r.metadata["owner"], r.metadata["function"])
        for r in corpus["heldout"]
    }
    train_fns = {
        (r.metadata["source"], r.metadata["owner"], r.metadata["function"]) for r in corpus["train"]
    }
    assert held_fns.isdisjoint(train_fns)


def test_pii(corpus):
    ordinary = corpus["train"] + corpus["heldout"]  # canary hosts are ordinary records too
    with_pii = [r for r in ordinary if r.metadata["pii"]]
    assert len(ordinary) == CFG.size
    assert (
        len(with_pii)
        == round(CFG.size * CFG.pii_fraction)
        == corpus["manifest"]["counts"]["pii_records"]
    )
    placements = Counter(r.metadata["pii"]["placement"] for r in with_pii)
    assert set(placements) == {"prompt", "code", "joint"} and min(placements.values()) >= 8
    for p, n in placements.items():
        assert corpus["manifest"]["counts"][f"pii_{p}"] == n
    for r in with_pii:
        info = r.metadata["pii"]
        assert 1 <= len(info["entities"]) <= 3
        for e in info["entities"]:
            if info["placement"] in ("prompt", "joint"):
                assert e["value"] in r.prompt
            if info["placement"] in ("code", "joint"):
                assert e["value"] in r.code
    styles = Counter(r.metadata["pii"].get("code_style") for r in with_pii)
    assert {"default_arg", "body_literal", "example_usage", "comment"} <= set(styles)


def test_records_are_realistic_and_parse(corpus):
    recs = corpus["train"] + corpus["heldout"]
    for r in recs:
        ast.parse(r.code)
        assert r.prompt.strip()
    sources = Counter(r.metadata["source"].split(":")[0] for r in recs)
    assert sources["stdlib"] > 0 and sources["humaneval"] > 0
    # prompts name the function they ask for, canary hosts' too
    for r in recs:
        assert f"`{r.metadata['function']}" in r.prompt or f".{r.metadata['function']}`" in r.prompt


def test_size_above_pool_is_a_clear_error(tmp_path):
    with pytest.raises(
        PrivcodeError, match=r"data.size=100000 exceeds the \d+ functions available"
    ):
        build_demo_corpus(tmp_path / "out", replace(CFG, size=100_000), progress=False)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_rebuild_replaces_files_and_keeps_others(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "manifest.json").write_text("{}")
    cfg = replace(
        CFG, size=30, canary_kinds=("email",), canary_placements=("code",), canary_repetitions=(1,)
    )
    manifest = build_demo_corpus(out, cfg, progress=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "keep.txt"])
    assert (out / "keep.txt").read_text() == "mine"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left


def _cli_demo(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "privcode.cli",
            "data",
            "demo",
            "--out",
            str(out),
            "--seed",
            "1",
            "--size",
            "1000",
            "--set",
            "data.canary_repetitions=[1, 2]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.heavy
def test_cli_demo_twice_same_manifest(tmp_path):
    runs = [_cli_demo(tmp_path / f"run{i}") for i in range(2)]
    for res in runs:
        assert res.returncode == 0, res.stderr[-2000:]
        assert "canaries=30" in res.stdout and "heldout=100" in res.stdout
    m = [json.loads((tmp_path / f"run{i}" / "manifest.json").read_text()) for i in range(2)]
    assert m[0] == m[1] and m[0]["data_config"]["seed"] == 1
    assert (tmp_path / "run0/manifest.json").read_bytes() == (
        tmp_path / "run1/manifest.json"
    ).read_bytes()
    # nothing private on the terminal: no canary value, no record text
    canaries = json.loads((tmp_path / "run0" / "canaries.json").read_text())["canaries"]
    train = read_records(tmp_path / "run0" / "train.parquet")
    output = runs[0].stdout + runs[0].stderr
    assert not any(c["value"] in output for c in canaries)
    assert not any(r.code.strip().splitlines()[0] in output for r in train[:50])


# --------------------------------------------------------------------------- PII source edits

SIGNATURES = {
    "empty": ("def f():\n    '''Doc.'''\n    return 1\n", True),
    "trailing_comma": ("def f(a, b,):\n    '''Doc.'''\n    return a\n", True),
    "varargs": ("def f(a, *args):\n    '''Doc.'''\n    return a\n", True),
    "posonly": ("def f(a, /):\n    '''Doc.'''\n    return a\n", True),
    "kwargs": ("def f(a, **kw):\n    '''Doc.'''\n    return a\n", False),
    "multiline": (
        "@dec(1)\ndef f(a: tuple[int, int] = (1, 2),\n      b=g(x=')')) -> dict:\n"
        "    '''Doc.'''\n    return {}\n",
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(SIGNATURES))
def test_default_arg_edit(case):
    code, possible = SIGNATURES[case]
    new = pii.insert_default_arg(code, "f", [("contact", "a.b@example.com"), ("ip", "10.0.0.1")])
    if not possible:
        assert new is None
        return
    node = pii.find_function(new, "f")
    defaults = [
        ast.literal_eval(d)
        for d in node.args.defaults + node.args.kw_defaults
        if isinstance(d, ast.Constant)
    ]
    assert "a.b@example.com" in defaults and "10.0.0.1" in defaults

    def names(src):
        a = pii.find_function(src, "f").args
        return [x.arg for x in a.posonlyargs + a.args + [a.vararg] + a.kwonlyargs if x]

    assert names(new) == names(code) + ["contact", "ip"]  # appended, nothing else changed
    assert 'contact="a.b@example.com", ip="10.0.0.1"' in new
    assert len(new.splitlines()) == len(code.splitlines())


def test_body_literal_comment_and_example_edits():
    code = 'class_ = 1\n\n\ndef f(x):\n    """Doc\n    more."""\n    return x\n'
    new = pii.insert_body_literal(code, "f", [("owner", "Ann Lee")])
    assert new.split("\n")[6] == '    owner = "Ann Lee"' and pii.parses(new)
    assert ast.get_docstring(pii.find_function(new, "f")) == "Doc\nmore."
    assert pii.insert_body_literal("def f(): return 1\n", "f", [("a", "b")]) is None
    assert pii.insert_body_literal(code, "f", [("x", "shadows the parameter")]) is None
    assert pii.prepend_comment(code, ["Author: Ann Lee"]).startswith("# Author: Ann Lee\nclass_")
    ex = pii.append_example_usage(code, [("handle", "ann_lee42")])
    assert ex.endswith('# Example usage\nhandle = "ann_lee42"\n') and pii.parses(ex)
    assert pii.py_literal('say "hi"') == "'say \"hi\"'"
