"""``ProbeOptions`` and the named steps of ``run_probe`` (issue 44 point 4).

The options are typed, frozen, documented field by field and checked before any
model is asked; ``run_probe`` takes them whole (``options=``) or as keywords, with
the same exact counts; its steps each fit on a screen.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

import pytest
from test_probe import CODE_ANSWER, LEAK_EMAIL, TEST_ANSWER, _corpus

from privcode.audit.probe import ProbeError, ProbeOptions, ScriptedBackend, run_probe
from privcode.audit.probe.taxonomy import ATTRIBUTES, TaxonomyError
from privcode.audit.probe.verify import VerifyError
from privcode.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _backend() -> ScriptedBackend:
    return ScriptedBackend([("unit test cases", TEST_ANSWER), ("code generation", CODE_ANSWER)])


def test_every_field_has_help_and_the_defaults_are_the_old_ones():
    fields = dataclasses.fields(ProbeOptions)
    assert all(f.metadata.get("help") for f in fields)
    o = ProbeOptions()
    assert (o.n_questions, o.rounds, o.n_tests, o.cases, o.max_functions, o.seed) == (
        2, 1, 2, 5, 1, 0,
    )  # fmt: skip
    assert (o.code_max_tokens, o.test_max_tokens, o.temperature) == (256, 384, 0.7)
    assert (o.update, o.eps, o.min_samples, o.hit_range, o.device) == (
        True, 0.5, 3, (1, 100), "cpu",
    )  # fmt: skip
    assert len(o.scenarios) == 6 and o.attributes == tuple(ATTRIBUTES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.rounds = 3  # type: ignore[misc]


def test_names_are_resolved_once():
    o = ProbeOptions(scenarios=["web"], attributes=["Secret", "email", "email"])
    secret = [a for a, spec in ATTRIBUTES.items() if spec.category == "Secret"]
    assert o.scenarios == ("web",) and o.attributes == (*secret, "email")
    assert dataclasses.replace(o, rounds=2).attributes == o.attributes
    with pytest.raises(TaxonomyError, match="unknown scenario 'moon'"):
        ProbeOptions(scenarios=["moon"])


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("n_questions", 0, "n_questions: 0 is below the minimum 1"),
        ("rounds", True, "rounds: True is not an integer"),
        ("n_tests", 1.5, "n_tests: 1.5 is not an integer"),
        ("seed", "3", "seed: '3' is not an integer"),
        ("temperature", -0.1, "temperature: -0.1 is below the minimum 0"),
        ("eps", 0, "eps: 0 is not above 0"),
        ("eps", 1.5, "eps: 1.5 is above the maximum 1"),
        ("test_max_tokens", 0, "test_max_tokens: 0 is below the minimum 1"),
    ],
)
def test_a_bad_setting_is_refused_by_name(setting, value, message):
    with pytest.raises(ProbeError, match=message):
        ProbeOptions(**{setting: value})
    backend = _backend()
    with pytest.raises(ProbeError, match=message):  # before the model is asked anything
        run_probe(backend, _corpus(), out_dir="/nonexistent/never", **{setting: value})
    assert backend.prompts == []


def test_an_unknown_setting_names_itself():
    with pytest.raises(ProbeError, match=r"unknown leak-probe setting\(s\) n_question \(known:"):
        ProbeOptions.of(n_question=3)


def _run(tmp_path: Path, name: str, **kw) -> dict:
    s = run_probe(_backend(), _corpus(), out_dir=tmp_path / name, **kw)
    s.pop("seconds")
    s.pop("files")
    return s


def test_options_and_keywords_give_the_same_exact_counts(tmp_path):
    settings = dict(scenarios=["web"], attributes=["email"], n_questions=1, n_tests=2, seed=3)
    by_keywords = _run(tmp_path, "kw", **settings)
    by_options = _run(tmp_path, "opts", options=ProbeOptions(**settings))
    assert by_options == by_keywords
    assert by_options["confirmed"]["instances"] == 4 and by_options["responses"] == 2
    assert by_options["settings"]["attributes"] == ["email"]
    # keywords apply over options: three rounds, the other settings kept
    more = _run(tmp_path, "more", options=ProbeOptions(**settings), rounds=3)
    assert more["settings"]["rounds"] == 3 and more["responses"] == 6
    assert len(more["library"]["updates"]) == 3
    assert LEAK_EMAIL not in json.dumps(more)  # counts only: the values stay in the details


def test_the_hit_range_reaches_verification(tmp_path):
    s = _run(tmp_path, "narrow", scenarios=["web"], attributes=["email"], n_questions=1,
             n_tests=2, seed=3, hit_range=(1, 1))  # fmt: skip
    # the leaked e-mail occurs in 2 records: too common for (1, 1)
    assert s["settings"]["hit_range"] == [1, 1] and s["verification"]["too_common"] == 4
    with pytest.raises(VerifyError):
        _run(tmp_path, "bad", hit_range=(5, 2))


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


@pytest.mark.parametrize(
    "module",
    [
        "privcode/cli.py",
        "privcode/audit/probe/run.py",
        "privcode/audit/probe/options.py",
        "privcode/audit/probe/cli.py",
    ],
)
def test_steps_fit_on_a_screen_and_stdlib_imports_are_at_the_top(module):
    for fn in _functions(ROOT / module):
        assert fn.end_lineno - fn.lineno + 1 <= 60, f"{module}:{fn.name} is too long"
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            stdlib = {m.split(".")[0] for m in modules} & sys.stdlib_module_names
            assert not stdlib, f"{module}:{fn.name} imports {stdlib} inside"


def test_the_cli_refuses_a_bad_setting_before_reading_data_or_loading_a_model(capsys, tmp_path):
    missing = tmp_path / "no-such.jsonl"  # never read: the options are checked first
    argv = ["audit", "probe", "--model", "no-such-model", "--data", str(missing)]
    assert main([*argv, "--questions", "0"]) == 2
    assert "privcode: error: n_questions: 0 is below the minimum 1" in capsys.readouterr().err
    assert main([*argv, "--attributes", "shoe_size"]) == 2
    assert "unknown attribute 'shoe_size'" in capsys.readouterr().err
