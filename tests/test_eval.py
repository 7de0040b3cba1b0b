"""pass@k evaluation (privcode.eval): estimator, benchmarks, sandboxed scoring, generation, CLI."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from fractions import Fraction
from pathlib import Path

import pytest
from conftest import premium_json, privacy_record
from gates import REQUIRE_SANDBOX, require_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st

from privcode.eval import (
    EvalError,
    canonical_samples,
    evaluate,
    load_benchmark,
    mean_pass_at_k,
    pass_at_k,
    pass_at_k_table,
    read_samples,
    score_samples,
    truncate_at_stop,
    write_samples,
)
from privcode.eval.cli import add_eval_parser
from privcode.sandbox import SandboxError, SandboxLimits, SandboxPool, isolation_level
from privcode.sandbox import pool as sandbox_pool

WORKERS = 2
FAST = SandboxLimits(cpu_seconds=1, wall_seconds=2, memory_mb=1024)


@pytest.fixture(scope="module")
def sandbox_ok() -> None:
    """Skip the scoring tests only if the sandbox refuses to run code at all here."""
    try:
        SandboxPool(workers=1).close()
    except SandboxError as exc:
        require_or_skip(REQUIRE_SANDBOX, f"the sandbox refuses to run here: {exc}")


@pytest.fixture(scope="module")
def humaneval():
    return load_benchmark("humaneval")


# --------------------------------------------------------------------------- pass@k


def _brute_force(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_hand_computed_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-15)
    assert pass_at_k(2, 1, 1) == 0.5
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 10) == 1.0
    assert pass_at_k(3, 1, 3) == 1.0  # n - c < k: every 3-subset holds the correct one
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200, abs=1e-15)
    assert 0.0 < pass_at_k(1000, 3, 100) < 1.0  # C(1000, 100) overflows floats: no overflow here
    assert mean_pass_at_k([(5, 2), (2, 1)], 1) == pytest.approx(0.45)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))
)
def test_pass_at_k_matches_brute_force(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(_brute_force(n, c, k)), abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(EvalError, match="needs at least k = 5 samples.*n = 3"):
        pass_at_k(3, 1, 5)
    with pytest.raises(EvalError, match="c .* exceeds n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(EvalError, match="k must be an int >= 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(EvalError, match="n must be an int"):
        pass_at_k(2.0, 1, 1)
    with pytest.raises(EvalError, match="nothing to average"):
        mean_pass_at_k([], 1)
    table, skipped = pass_at_k_table([(10, 3), (4, 0)], ks=(1, 5, 4))
    assert set(table) == {"pass@1", "pass@4"} and skipped == [5]
    assert table["pass@1"] == pytest.approx((0.3 + 0.0) / 2)


# --------------------------------------------------------------------------- benchmarks


def test_humaneval_bundled_programs(humaneval):
    assert len(humaneval.problems) == 164 and humaneval.stop[0] == "\ndef "
    p = humaneval.problems["HumanEval/0"]
    program = p.test_program("    return True\n")
    assert program == (
        p.prompt + "    return True\n" + "\n" + p.test + "\n" + "check(has_close_elements)\n"
    )
    assert len(canonical_samples(humaneval, limit=3)) == 3


def test_truncate_at_stop():
    stops = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
    assert truncate_at_stop("    return 1\n\ndef g():\n    pass\n", stops) == "    return 1\n"
    assert truncate_at_stop("    x = 1\n# c\nprint(x)", stops) == "    x = 1"
    assert truncate_at_stop("    # indented comment stays\n    return 1", stops).endswith("1")
    assert truncate_at_stop("def f(): pass", stops) == "def f(): pass"  # at 0: no newline


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def test_benchmark_file_errors_name_line_and_field(tmp_path):
    with pytest.raises(EvalError, match="nope.jsonl: no such file"):
        load_benchmark("mbpp", tmp_path / "nope.jsonl")
    with pytest.raises(EvalError, match="not bundled.*--benchmark-file"):
        load_benchmark("bigcodebench")
    with pytest.raises(EvalError, match="unknown benchmark 'apps'"):
        load_benchmark("apps")
    good = {"task_id": 1, "text": "t", "code": "x", "test_list": ["assert True"]}
    secret = "SECRET-CONTENT-42"
    cases = [
        (
            [good, {"task_id": 2, "text": secret, "code": secret}],
            r":2: field 'test_list' is missing",
        ),
        (
            [good, {**good, "task_id": 2, "test_list": "assert 1"}],
            r":2: field 'test_list' must be a list, got str",
        ),
        (
            [good, {**good, "task_id": 2, "test_list": [secret, 3]}],
            r":2: field 'test_list'\[1\] must be a str, got int",
        ),
        ([good, good], r":2: duplicate task_id '1' \(first on line 1\)"),
        ([good, "{not json " + secret], r":2: not valid JSON"),
        (["[1, 2]"], r":1: expected a JSON object, got list"),
    ]
    for rows, pattern in cases:
        with pytest.raises(EvalError, match=pattern) as info:
            load_benchmark("mbpp", _jsonl(tmp_path / "bad.jsonl", rows))
        assert secret not in str(info.value)
    with pytest.raises(EvalError, match=r":1: field 'complete_prompt' is missing"):
        load_benchmark("bigcodebench", _jsonl(tmp_path / "b.jsonl", [{"task_id": "B/0"}]))


def test_local_humaneval_format_gz_and_script_tests(tmp_path, sandbox_ok):
    rows = [
        {
            "task_id": "X/0",
            "prompt": "def inc(x):\n",
            "entry_point": "inc",
            "canonical_solution": "    return x + 1\n",
            "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        },
        # EvalPlus-style: a plain script test (no check function), extra fields ignored
        {
            "task_id": "X/1",
            "prompt": "def dbl(x):\n",
            "entry_point": "dbl",
            "canonical_solution": "    return 2 * x\n",
            "plus_input": [[3]],
            "test": "assert dbl(3) == 6\nassert dbl(0) == 0\n",
        },
    ]
    path = tmp_path / "he.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    bench = load_benchmark("humaneval", path)
    assert "check(" not in bench.problems["X/1"].test_program("    return 0\n")
    samples = canonical_samples(bench) + [
        {"task_id": "X/0", "completion": "    return x\n"},
        {"task_id": "X/1", "completion": "    return x\n"},
    ]
    result = score_samples(samples, bench, workers=WORKERS, limits=FAST)
    assert result["pass_at_k"] == {"pass@1": 0.5}
    assert [t["passed"] for t in result["per_task"]] == [1, 1]


# --------------------------------------------------------------------------- sandboxed scoring


@pytest.mark.heavy
def test_all_canonical_humaneval_solutions_pass_in_the_sandbox(humaneval, sandbox_ok):
    result = score_samples(canonical_samples(humaneval), humaneval, workers=WORKERS)
    failed = [t for t in result["per_task"] if t["passed"] != 1]
    assert not failed, failed
    assert result["pass_at_k"] == {"pass@1": 1.0}
    assert result["n_tasks"] == 164 and result["status_counts"] == {"ok": 164}
    assert result["sandbox"] == isolation_level() and result["sandbox_note"] is None
    assert result["missing_tasks"] == [] and result["notes"] == []


@pytest.mark.heavy
def test_known_wrong_completions_fail_with_the_right_status(humaneval, sandbox_ok):
    wrong = [
        "    return None\n",  # error: AssertionError
        "    return undefined_name\n",  # error: NameError
        "    return (\n",  # syntax: never runs
        "    import time\n    while True:\n        time.sleep(0.05)\n",  # timeout
        "    while True:\n        pass\n",  # cpu (or timeout)
        "    raise SystemExit(0)\n",
    ]  # exits 0 before the end
    samples = [{"task_id": "HumanEval/0", "completion": c} for c in wrong]
    result = score_samples(samples, humaneval, workers=WORKERS, limits=FAST)
    task = result["per_task"][0]
    assert task["n"] == 6 and task["passed"] == 0 and result["pass_at_k"] == {"pass@1": 0.0}
    statuses = dict(task["statuses"])
    busy = statuses.pop("cpu", 0)
    assert statuses == {"error": 2, "syntax": 1, "timeout": 2 - busy, "early_exit": 1}
    assert task["errors"] == {"AssertionError": 1, "NameError": 1, "SyntaxError": 1}


def _mixed_samples(humaneval, tasks: int = 5) -> list[dict]:
    """Per task: the canonical solution and a wrong one (n = 2, c = 1)."""
    out = []
    for s in canonical_samples(humaneval, limit=tasks):
        out += [s, {"task_id": s["task_id"], "completion": "    return None\n"}]
    return out


def test_samples_file_mode(humaneval, tmp_path, sandbox_ok):
    path = write_samples(tmp_path / "samples.jsonl", _mixed_samples(humaneval))
    assert len(read_samples(path)) == 10
    result = evaluate(
        samples_file=path, limit=5, ks=[1, 2], workers=WORKERS, limits=FAST, progress=False
    )
    assert result["pass_at_k"] == {"pass@1": 0.5, "pass@2": 1.0}
    assert result["n_tasks"] == 5 and result["n_samples_per_task"] == 2
    assert all(t["n"] == 2 and t["passed"] == 1 for t in result["per_task"])
    assert result["samples_file"] == str(path)

    # Without --limit the other 159 tasks are missing: noted loudly, or counted as failures.
    result = evaluate(samples_file=path, ks=[1], workers=WORKERS, limits=FAST, progress=False)
    assert result["pass_at_k"] == {"pass@1": 0.5} and len(result["missing_tasks"]) == 159
    assert any(n.startswith("INCOMPLETE: 159 of 164") for n in result["notes"])
    result = evaluate(
        samples_file=path,
        ks=[1],
        workers=WORKERS,
        limits=FAST,
        progress=False,
        missing_as_failures=True,
    )
    assert result["pass_at_k"]["pass@1"] == pytest.approx(0.5 * 5 / 164)
    assert result["per_task"][0]["statuses"] == {"error": 1, "ok": 1}


def test_samples_file_errors_name_the_line(tmp_path, humaneval):
    lines = [
        {"task_id": "HumanEval/0", "completion": "    return True\n"},
        {"task_id": "HumanEval/1", "completion": ""},
        {"task_id": "HumanEval/9999", "completion": "secret code"},
    ]
    path = _jsonl(tmp_path / "s.jsonl", lines)
    with pytest.raises(EvalError, match=r"s.jsonl:3: task_id 'HumanEval/9999' is not a task"):
        evaluate(samples_file=path, progress=False)
    with pytest.raises(EvalError, match=r"s.jsonl:2: field 'completion' must be a str, got int"):
        read_samples(_jsonl(tmp_path / "s.jsonl", [lines[0], {"task_id": "x", "completion": 1}]))
    with pytest.raises(
        EvalError,
        match=r"s.jsonl:1: field 'task_id' must be a str \(or int\), "
        r"got nothing",
    ):
        read_samples(_jsonl(tmp_path / "s.jsonl", [{"completion": "x"}]))
    with pytest.raises(EvalError, match="not both and not neither"):
        evaluate(progress=False)


def test_cli_samples_json(humaneval, tmp_path, capsys, sandbox_ok):
    path = write_samples(tmp_path / "samples.jsonl.gz", _mixed_samples(humaneval, tasks=3))
    parser = argparse.ArgumentParser(prog="privcode")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "result.json"
    args = parser.parse_args(
        [
            "eval",
            "--samples",
            str(path),
            "--benchmark",
            "humaneval",
            "--limit",
            "3",
            "--k",
            "1",
            "--k",
            "2",
            "--workers",
            "2",
            "--timeout",
            "5",
            "--no-progress",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["pass_at_k"] == {"pass@1": 0.5, "pass@2": 1.0}
    assert json.loads(out.read_text())["pass_at_k"] == printed["pass_at_k"]
    assert printed["sandbox_limits"]["wall_seconds"] == 5


# --------------------------------------------------------------------------- MBPP, BigCodeBench


def test_mbpp_local_file(tmp_path, sandbox_ok):
    rows = [
        {
            "task_id": 11,
            "text": "Write a function to add two numbers.",
            "code": "def add(a, b):\n    return a + b",
            "test_setup_code": "import math",
            "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == math.floor(0.5)"],
        },
        {
            "task_id": 12,
            "prompt": "Write a function to reverse a string.",  # sanitized
            "code": "def rev(s):\n    return s[::-1]",
            "test_imports": [],
            "test_list": ["assert rev('ab') == 'ba'"],
        },
    ]
    bench = load_benchmark("mbpp", _jsonl(tmp_path / "mbpp.jsonl", rows))
    assert bench.problems["11"].prompt == (
        '"""\nWrite a function to add two numbers.\nassert add(1, 2) == 3\n"""\n'
    )
    wrong = [
        {"task_id": "11", "completion": "def add(a, b):\n    return a - b"},
        {"task_id": 12, "completion": "def rev(s):\n    return s"},
    ]
    result = score_samples(canonical_samples(bench) + wrong, bench, workers=WORKERS, limits=FAST)
    assert result["pass_at_k"] == {"pass@1": 0.5}
    assert [(t["task_id"], t["passed"]) for t in result["per_task"]] == [("11", 1), ("12", 1)]


def test_bigcodebench_local_file(tmp_path, sandbox_ok):
    test = (
        "import unittest\n\nclass TestCases(unittest.TestCase):\n"
        "    def test_small(self):\n        self.assertEqual(task_func([3, 1, 2]), [1, 2, 3])\n"
        "    def test_empty(self):\n        self.assertEqual(task_func([]), [])\n"
    )
    rows = [
        {
            "task_id": "BigCodeBench/0",
            "entry_point": "task_func",
            "test": test,
            "complete_prompt": 'import heapq\n\ndef task_func(xs):\n    """Sort xs."""\n',
            "canonical_solution": "    return sorted(xs)\n",
        },
        {
            "task_id": "BigCodeBench/1",
            "entry_point": "task_func",
            "test": "import unittest\n",
            "complete_prompt": "def task_func():\n",
            "canonical_solution": "    return 1\n",
        },
    ]  # no test ran: fails
    bench = load_benchmark("bigcodebench", _jsonl(tmp_path / "bcb.jsonl", rows))
    samples = canonical_samples(bench) + [
        {"task_id": "BigCodeBench/0", "completion": "    return xs\n"},
        {"task_id": "BigCodeBench/1", "completion": "    import numpy\n"},
    ]
    result = score_samples(samples, bench, workers=WORKERS, limits=FAST)
    per = {t["task_id"]: t for t in result["per_task"]}
    assert per["BigCodeBench/0"]["passed"] == 1 and per["BigCodeBench/0"]["n"] == 2
    assert per["BigCodeBench/1"]["passed"] == 0
    assert result["pass_at_k"] == {"pass@1": 0.25}


# --------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def ci_base(ci_base_cache) -> str:
    from privcode.models.loading import resolve_model_path

    return str(resolve_model_path("ci", cache_dir=ci_base_cache, progress=False))


def test_generation_with_the_tiny_model_end_to_end(ci_base, tmp_path, sandbox_ok):
    samples_out = tmp_path / "gen.samples.jsonl"
    result = evaluate(
        model=ci_base,
        benchmark="humaneval",
        limit=3,
        max_new_tokens=48,
        batch_size=2,
        workers=WORKERS,
        limits=FAST,
        samples_out=samples_out,
        progress=False,
    )
    samples = read_samples(samples_out)
    assert [s.task_id for s in samples] == [f"HumanEval/{i}" for i in range(3)]
    for s in samples:
        assert isinstance(s.completion, str)
        assert not any(stop in s.completion for stop in ("\ndef ", "\nclass ", "\n#"))
    assert result["n_tasks"] == 3 and 0.0 <= result["pass_at_k"]["pass@1"] <= 1.0
    assert result["generation"]["model"] == ci_base and result["generation"]["n"] == 1
    assert "pass@10" not in result["pass_at_k"]  # default ks: only what n = 1 allows


def test_sampling_is_seeded_and_adapters_load(ci_base, tmp_path, humaneval):
    import torch

    from privcode.eval.completions import generate_completions, load_generator
    from privcode.models.loading import attach_lora, load_causal_lm
    from privcode.train.release import write_release

    problems = humaneval.select(2)
    gen = load_generator(ci_base)
    kwargs = {
        "n": 2,
        "temperature": 0.8,
        "max_new_tokens": 16,
        "seed": 3,
        "progress": False,
        "stop": humaneval.stop,
    }
    first = generate_completions(gen, problems, **kwargs)
    assert [s.completion for s in first] == [
        s.completion for s in generate_completions(gen, problems, **kwargs)
    ]
    assert [s.task_id for s in first] == ["HumanEval/0"] * 2 + ["HumanEval/1"] * 2

    torch.manual_seed(0)
    lora = attach_lora(load_causal_lm(ci_base), r=2, alpha=4)
    lora.save_pretrained(str(tmp_path / "adapter"))
    (tmp_path / "premium").mkdir()
    lora.save_pretrained(str(tmp_path / "premium" / "adapter"))
    (tmp_path / "premium" / "premium.json").write_text(premium_json(ci_base))
    junior = write_release(
        tmp_path / "junior",
        adapter_dir=tmp_path / "adapter",
        privacy=privacy_record(epsilon=4.0),
        meta={"method": "privcode", "conditioning": "prompt", "dp": True, "base_model": ci_base},
    )
    for model, adapter, kind in (
        (ci_base, tmp_path / "adapter", "adapter"),
        (tmp_path / "premium", None, "premium"),
        (ci_base, tmp_path / "premium", "premium"),
        (junior, None, "junior"),
    ):
        g = load_generator(model, adapter)
        assert g.info["adapter_kind"] == kind
        out = generate_completions(g, problems[:1], max_new_tokens=8, progress=False)
        assert len(out) == 1 and isinstance(out[0].completion, str)
    with pytest.raises(EvalError, match="is a peft adapter: pass --model BASE"):
        load_generator(tmp_path / "adapter")
    with pytest.raises(EvalError, match="not a peft adapter"):
        load_generator(ci_base, tmp_path)


def test_eval_stops_before_generating_when_full_isolation_is_missing(
    humaneval, tmp_path, monkeypatch
):
    """sandbox.isolation full that cannot be had: an EvalError saying what and how, first."""
    monkeypatch.setattr(sandbox_pool, "_LEVEL", "rlimits-only")
    monkeypatch.setattr(sandbox_pool, "_MISSING", "not running as root (uid 1000)")
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"task_id": "HumanEval/0", "completion": "pass"}) + "\n")
    with pytest.raises(EvalError, match=r"'full' but .*uid 1000\)\. To get it: run as root"):
        evaluate(samples_file=samples, limit=1, progress=False)
    with pytest.raises(EvalError, match="sandbox.isolation: rlimits-only"):
        evaluate(model="/nonexistent-model", limit=1, progress=False)  # before any loading


@pytest.mark.parametrize(("c", "n"), [(0, 150), (3, 150), (20, 150), (75, 150), (150, 150), (1, 1)])
def test_wilson_interval_matches_scipy(c, n):
    from scipy.stats import binomtest

    from privcode.eval.passk import wilson_interval

    ref = binomtest(c, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(c, n)
    assert lo == pytest.approx(ref.low, abs=1e-9) and hi == pytest.approx(ref.high, abs=1e-9)
    with pytest.raises(EvalError):
        wilson_interval(n + 1, n)
