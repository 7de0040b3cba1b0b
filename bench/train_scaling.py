"""DP-SGD throughput on Ray Train: samples/s with 2 workers vs 1, same run otherwise.

    .venv/bin/python bench/train_scaling.py [--model demo] [--steps 24] [--batch 32]
                                             [--length 96] [--rounds 2] [--size 400]
                                             [--configs 1x1 1x2 2x1]

Starts an in-process local Ray cluster (127.0.0.1, stopped at the end), or
joins the one ``RAY_ADDRESS`` names (2 CPUs free needed), builds a small
demo corpus in a temporary directory (without canaries: they change no step's
cost, and at most 5% of the training records may carry one, so any ``--size``
builds), and trains the same DP-SGD run (real ledger, fixed sigma, large
budget) with

* 1 worker x 1 CPU (``1x1``),
* 1 worker x 2 CPUs (``1x2``: 2 torch threads), and
* 2 workers x 1 CPU (``2x1``: gloo all-reduce),

``--rounds`` times each, interleaved (``--configs`` runs a subset of the
three). Throughput is measured from the audit log of applied steps (rank 0's
time stamps): (steps - 1) * expected batch size / (time of the last step -
time of the first), so worker start-up and model loading are excluded.
Ratios are against 1 worker x 1 CPU (against the first configuration run
when ``--configs`` leaves that one out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

CONFIGS = (("1 worker x 1 CPU", 1, 1), ("1 worker x 2 CPUs", 1, 2), ("2 workers x 1 CPU", 2, 1))
SHORT = [f"{workers}x{threads}" for _, workers, threads in CONFIGS]  # --configs names


def _samples_per_second(audit_log: Path, expected_batch: float) -> float:
    times = [json.loads(x)["time"] for x in audit_log.read_text().splitlines() if x.strip()]
    if len(times) < 3:
        raise RuntimeError("too few steps to measure")
    # Skip the first step (allocator warm-up) and time the rest.
    return (len(times) - 2) * expected_batch / (times[-1] - times[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="HF model dir or preset (ci, demo, small)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=32, help="expected Poisson batch size")
    p.add_argument("--length", type=int, default=96, help="max tokens per record")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--size", type=int, default=400, help="ordinary records of the corpus")
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(SHORT),
        choices=list(SHORT),
        help="workers x CPUs each to run (default: all three)",
    )
    args = p.parse_args()
    configs = tuple(c for c, short in zip(CONFIGS, SHORT, strict=True) if short in args.configs)

    import ray

    from privcode.cluster.local import connect
    from privcode.config import DataConfig, TrainConfig
    from privcode.data.demo import build_demo_corpus
    from privcode.models.loading import resolve_model_path
    from privcode.privacy.budget import init_store
    from privcode.train.run import run_training

    model = str(resolve_model_path(args.model))
    cpus = os.cpu_count() or 2
    # A new local cluster gets max(2, CPUs); joining RAY_ADDRESS's, Ray refuses num_cpus.
    connect(None, **({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(2, cpus)}))
    results: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory(prefix="privcode-scaling-") as tmp:
        work = Path(tmp)
        build_demo_corpus(
            work / "data", DataConfig(size=args.size, canary_kinds=()), progress=False
        )
        base = TrainConfig(
            steps=args.steps,
            expected_batch_size=args.batch,
            max_length=args.length,
            noise_multiplier=1.0,
            epsilon=1000.0,
            eval_tokens=0,
            checkpoint_every=10**6,
        )
        n = None
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else tuple(reversed(configs))
            for name, workers, threads in order:
                cfg = dataclasses.replace(base, num_workers=workers, cpus_per_worker=threads)
                run = work / f"{workers}x{threads}-{r}"
                trained = run_training(
                    cfg,
                    data_path=work / "data" / "train.parquet",
                    base_path=model,
                    out_dir=run / "release",
                    run_name="scaling",
                    storage_dir=run / "storage",
                    keep_storage=True,
                    # A store per timed run: the rounds measure speed, not one budget.
                    privacy_store=init_store(run / "privacy-store")[0].root,
                )
                n = trained.summary.num_records
                results[name].append(
                    _samples_per_second(trained.audit_log, trained.summary.sample_rate * n)
                )
                print(f"  round {r + 1}: {name}: {results[name][-1]:.1f} samples/s", flush=True)
    ray.shutdown()
    ref_name, ref_workers, ref_threads = configs[0]
    ref = statistics.median(results[ref_name])
    print(
        f"model {model}; {n} records; expected batch {args.batch}; max {args.length} tokens; "
        f"{args.steps} steps; {cpus} CPUs on this machine; median of {args.rounds} rounds"
    )
    print(f"{'configuration':20} {'samples/s':>10} {f'x {ref_workers}x{ref_threads}':>7}")
    for name, _, _ in configs:
        v = statistics.median(results[name])
        print(f"{name:20} {v:10.1f} {v / ref:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
