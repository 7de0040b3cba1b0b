"""The Acme company corpus and its benchmark (privcode.data.company): splits, tests, disjointness."""

from __future__ import annotations

import collections
import random
from dataclasses import replace

import pytest
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.config import DataConfig
from privcode.data import company as C
from privcode.data.records import read_records
from privcode.errors import PrivcodeError
from privcode.eval import canonical_samples, load_benchmark, score_samples
from privcode.sandbox import SandboxError, SandboxPool

CFG = DataConfig(
    source="company",
    size=700,
    pii_fraction=0.2,
    canary_kinds=("email", "password"),
    canary_placements=("code", "joint"),
    canary_repetitions=(2, 5),
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("company")
    manifest = C.build_company_corpus(out, CFG, progress=False)
    return {
        "manifest": manifest,
        "train": read_records(out / "train.parquet"),
        "heldout": read_records(out / "heldout.parquet"),
        "dir": out,
    }


def _program(p: dict, body: str) -> str:
    return p["prompt"] + body + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n"


def test_splits_are_fixed_and_every_held_out_task_is_a_new_composition():
    triples = C.task_triples()
    split = {t: C.split_of(t) for t in triples}
    counts = collections.Counter(split.values())
    assert counts["test"] * len(C.CONVENTIONS) >= 150 and counts["dev"] >= 10
    train = {t for t, s in split.items() if s == "train"}
    for (entity, field, op), s in split.items():
        if s == "train":
            continue
        # the pair is taught with other helpers, and the helper with other pairs
        assert any(t[:2] == (entity, field) for t in train)
        assert any(t[2] == op and t[:2] != (entity, field) for t in train)
    assert len(C.benchmark_problems("test")) == counts["test"] * len(C.CONVENTIONS)


def test_canonical_solutions_pass_and_wrong_helpers_fail():
    for p in C.benchmark_problems("dev") + C.benchmark_problems("test")[:30]:
        exec(_program(p, p["canonical_solution"]), {})  # raises on a failing test
    p = C.benchmark_problems("test")[0]
    right = next(o for o in C.OPS if o.call + "(" in p["canonical_solution"])
    other = next(o.call for o in C.OPS if o.kind == right.kind and o != right)
    wrong = p["canonical_solution"].replace(right.call, other)
    with pytest.raises(AssertionError):
        exec(_program(p, wrong), {})


def test_the_base_cannot_know_the_library():
    from privcode.data.stdlib import public_source_files

    public = "\n".join(p.read_text(errors="replace") for p in public_source_files())
    assert "acme." not in public and "acme.Missing" not in public


def test_training_functions_are_distinct_and_from_train_triples_only():
    fns = C.training_functions(3000, random.Random(1))
    codes = [p + b for p, b, _ in fns]
    assert len(set(codes)) == 3000
    for _, _, task in fns:
        assert task is None or C.split_of(task.triple) == "train"
    held = [t for t in C.task_triples() if C.split_of(t) != "train"]
    for entity, field, op in held:  # no held-out call on its field anywhere
        assert not any(f'{op}({entity}["{field}"])' in c for c in codes)


def test_disjointness_check_finds_a_planted_solution_exactly_and_nearly():
    fns = C.training_functions(800, random.Random(2))
    codes = [p + b for p, b, _ in fns]
    problems = C.benchmark_problems("test")
    assert C.check_disjoint(codes, problems) == []
    a, b = problems[4], problems[10]
    exact = "def helper(x):\n" + a["canonical_solution"]
    near = (b["prompt"] + b["canonical_solution"]).replace('"""', '"""Note: ', 1)
    assert C.check_disjoint(codes + [exact, near], problems) == [a["task_id"], b["task_id"]]


def test_corpus_is_disjoint_deterministic_and_plants_canaries_in_place(corpus, tmp_path):
    m, train, heldout = corpus["manifest"], corpus["train"], corpus["heldout"]
    assert m["format"] == C.FORMAT
    assert len(train) + len(heldout) == CFG.size == m["counts"]["ordinary"]
    assert m["counts"]["train_records"] == len(train)  # canaries add no rows
    codes = [r.code for r in train + heldout]
    problems = C.benchmark_problems("test") + C.benchmark_problems("dev")
    assert C.check_disjoint(codes, problems) == []
    canaries = [r for r in train if r.metadata["kind"] == "canary"]
    assert len(canaries) == m["counts"]["canary_records"] == 2 * 2 * 7
    assert len(canaries) <= 0.05 * len(train)
    for r in canaries:  # the host is an ordinary function with the canary added, no copy
        assert r.metadata["task"] is not None or r.code.startswith("def ")
    bodies = collections.Counter(r.code.split("\n\n\n# Example usage")[0] for r in train)
    assert max(bodies.values()) == 1
    again = C.build_company_corpus(tmp_path / "again", CFG, progress=False)
    assert again["files"] == m["files"]


def test_too_many_canaries_is_refused_naming_the_setting(tmp_path):
    cfg = replace(CFG, size=200, canary_repetitions=(20,))
    with pytest.raises(PrivcodeError, match="data.canary_repetitions"):
        C.build_company_corpus(tmp_path / "c", cfg, progress=False)
    assert not (tmp_path / "c" / "manifest.json").exists()


@pytest.mark.heavy
def test_benchmark_runs_in_the_sandbox_through_pass_at_k():
    try:
        SandboxPool(workers=1).close()
    except SandboxError as exc:
        require_or_skip(REQUIRE_SANDBOX, f"the sandbox refuses to run here: {exc}")
    bench = load_benchmark("acme")
    assert len(bench.problems) >= 150 and bench.source == "bundled acme"
    result = score_samples(canonical_samples(bench, limit=12), bench, workers=2)
    assert result["pass_at_k"] == {"pass@1": 1.0}
    wrong = [{"task_id": t, "completion": "    return None\n"} for t in list(bench.problems)[:4]]
    assert score_samples(wrong, bench, workers=2)["pass_at_k"] == {"pass@1": 0.0}
