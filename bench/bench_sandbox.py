"""Sandbox throughput: trivial snippets per second, sequential run_code vs SandboxPool,
the cost of each layer of the full sandbox, and the executor service over HTTP.

Run: ``.venv/bin/python bench/bench_sandbox.py [--snippets 400] [--workers N]``

Prints snippets/s for ``run_code`` one after another and for ``SandboxPool.map``
with N workers (default: the CPUs available), and the pool/sequential ratio.
Each snippet runs with full isolation when root (fresh pid/mount/IPC
namespaces, minimal read-only root, private /tmp, unprivileged uid, rlimits,
seccomp, a cgroup per slot); the zygotes' one-off start-up (~0.1 s per slot) is
excluded by a warm-up.  Also prints the CPU time per snippet (all processes), the
number that bounds throughput on a busy machine.

Then, as root, the layers side by side (rounds interleaved so that load drifts hit all
alike): the pool without seccomp and cgroups, with each, with both (the default), each
as a ratio to the bare namespaces; and the same pool behind the executor service
(``privcode sandbox serve`` on 127.0.0.1 with a bearer token, batches of 64 over HTTP).
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import tempfile
import threading
import time

from privcode import sandbox
from privcode.sandbox import SandboxLayers, SandboxPool, is_full, isolation_level, run_code
from privcode.sandbox.executor import ExecutorClient, ExecutorServer
from privcode.sandbox.executor_protocol import CLIENT_TOKEN_ENV

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


LAYERS = {
    "namespaces+uid only": SandboxLayers(seccomp=False, cgroup=False),
    "+ seccomp": SandboxLayers(seccomp=True, cgroup=False),
    "+ cgroup": SandboxLayers(seccomp=False, cgroup=True),
    "+ seccomp + cgroup": SandboxLayers(),
}


def bench_layers(n: int, workers: int, rounds: int = 3) -> dict[str, float]:
    """snippets/s of each layer set (median of ``rounds`` interleaved measurements)."""
    pools = {
        name: SandboxPool(workers=workers, isolation="rlimits-only", layers=layers)
        for name, layers in LAYERS.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in pools}
    try:
        for pool in pools.values():
            pool.map([SNIPPET] * (2 * workers))
        for _ in range(rounds):
            for name, pool in pools.items():
                t0 = time.perf_counter()
                verdicts = pool.map([SNIPPET] * n)
                rates[name].append(n / (time.perf_counter() - t0))
                assert all(v.passed for v in verdicts), verdicts[0]
    finally:
        for pool in pools.values():
            pool.close()
    return {name: sorted(r)[len(r) // 2] for name, r in rates.items()}


def bench_executor(n: int, workers: int) -> float:
    """snippets/s through the executor service: a bearer token, batches of 64 over HTTP."""
    token = secrets.token_urlsafe(32)
    server = ExecutorServer(("127.0.0.1", 0), workers=workers, max_batch=64, token=token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w", encoding="utf-8") as f:
            f.write(token)
        os.environ[CLIENT_TOKEN_ENV] = token_file
        try:
            client = ExecutorClient(f"http://127.0.0.1:{server.server_address[1]}")
            client.map([SNIPPET] * (2 * workers))
            t0 = time.perf_counter()
            verdicts = client.map([SNIPPET] * n)
            rate = n / (time.perf_counter() - t0)
        finally:
            del os.environ[CLIENT_TOKEN_ENV]
            server.shutdown()
            server.server_close()
    assert all(v.passed for v in verdicts), verdicts[0]
    return rate


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
    if not is_full(isolation_level()):
        print("layers: skipped (the full sandbox needs root)")
        return
    rates = bench_layers(args.snippets, args.workers)
    bare = rates["namespaces+uid only"]
    for name, rate in rates.items():
        print(f"layers {name:<22}: {rate:7.1f} snippets/s  ({rate / bare:5.2f}x)")
    rate = bench_executor(args.snippets, args.workers)
    print(f"executor over HTTP     : {rate:7.1f} snippets/s  ({rate / pool:5.2f}x the pool)")


if __name__ == "__main__":
    main()
