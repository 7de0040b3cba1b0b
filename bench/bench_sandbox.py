"""Sandbox throughput: trivial snippets per second, sequential run_code vs SandboxPool.

Run: ``.venv/bin/python bench/bench_sandbox.py [--snippets 400] [--workers N]``

Prints snippets/s for ``run_code`` one after another and for ``SandboxPool.map``
with N workers (default: the CPUs available), and the pool/sequential ratio.
Each snippet runs with full isolation when root (fresh pid/mount/IPC
namespaces, minimal read-only root, private /tmp, unprivileged uid, rlimits);
the zygotes' one-off start-up (~0.1 s per slot) is excluded by a warm-up.
Also prints the CPU time per snippet (all processes), the number that bounds
throughput on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from privcode import sandbox
from privcode.sandbox import SandboxPool, isolation_level, run_code

SNIPPET = (
    "def f(n):\n    return sum(i * i for i in range(n))\n\nassert f(10) == 285\nprint(f(100))\n"
)


def cpu_seconds() -> float:
    """CPU of this process plus its reaped children (zygotes roll up when they are closed)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_sequential(n: int) -> tuple[float, float]:
    run_code(SNIPPET)  # warm-up: start the slot's zygote
    c0, t0 = cpu_seconds(), time.perf_counter()
    verdicts = [run_code(SNIPPET) for _ in range(n)]
    wall = time.perf_counter() - t0
    sandbox.pool._close_slots()  # reap the zygote so its CPU is counted
    assert all(v.passed for v in verdicts), verdicts[0]
    return n / wall, (cpu_seconds() - c0) / n


def bench_pool(n: int, workers: int) -> tuple[float, float]:
    with SandboxPool(workers=workers) as pool:
        pool.map([SNIPPET] * (2 * workers))  # warm-up: start every slot's zygote
        c0, t0 = cpu_seconds(), time.perf_counter()
        verdicts = pool.map([SNIPPET] * n)
        wall = time.perf_counter() - t0
    assert all(v.passed for v in verdicts), verdicts[0]
    return n / wall, (cpu_seconds() - c0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snippets", type=int, default=400, help="Snippets per measurement.")
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="Pool workers (default: the CPUs available).",
    )
    args = parser.parse_args()
    print(
        f"isolation: {isolation_level()}; CPUs: {len(os.sched_getaffinity(0))}; "
        f"load average: {os.getloadavg()[0]:.2f}"
    )
    seq, seq_cpu = bench_sequential(args.snippets)
    print(f"run_code, sequential   : {seq:7.1f} snippets/s  ({seq_cpu * 1000:.1f} ms CPU each)")
    pool, pool_cpu = bench_pool(args.snippets, args.workers)
    print(
        f"SandboxPool({args.workers} workers) : {pool:7.1f} snippets/s  "
        f"({pool_cpu * 1000:.1f} ms CPU each)"
    )
    print(f"pool / sequential      : {pool / seq:7.2f}x")


if __name__ == "__main__":
    main()
