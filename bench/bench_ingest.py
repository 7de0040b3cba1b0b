"""Ingest throughput: this machine's CPython standard library tree as a repository.

Run: ``.venv/bin/python bench/bench_ingest.py [--limit-files N]``

Ingests ``sysconfig.get_paths()["stdlib"]`` (a public tree: nothing private) with
``privcode data ingest``'s code path (walk and filter, one record per function, method
and class, stable ids, exact + MinHash near-duplicate removal, split by file, the
secret/PII scan, the Parquet files) and prints records/s with each step's share of the
time, the dedup share among them.  Goal: the whole tree in under 60 s on 2 cores.
``--limit-files`` copies only the first N files (the test suite's smallest setting).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

from privcode.data.ingest.corpus import IngestSpec, build_ingested_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-files", type=int, default=0, help="Only the first N .py files.")
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with tempfile.TemporaryDirectory() as tmp:
        root = stdlib
        if args.limit_files:
            root = Path(tmp) / "stdlib"
            for i, src in enumerate(sorted(stdlib.rglob("*.py"))):
                if i >= args.limit_files:
                    break
                dst = root / src.relative_to(stdlib)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        print(
            f"tree: {root} ({'every' if not args.limit_files else args.limit_files} .py file(s))"
            f"; CPUs: {len(os.sched_getaffinity(0))}; load average: {os.getloadavg()[0]:.2f}"
        )
        t0 = time.perf_counter()
        m = build_ingested_corpus(
            IngestSpec(inputs=(str(root),)), Path(tmp) / "corpus", split_key=b"bench"
        )
        total = time.perf_counter() - t0
    src = next(iter(m["sources"].values()))
    t, c = m["counts"], m["timings"]
    records = t["records_found"]
    print(f"files ingested         : {src['files']} ({sum(src['files_skipped'].values())} skipped)")
    print(
        f"records (units)        : {records} found, {t['removed_exact_duplicates']} exact and "
        f"{t['removed_near_duplicates']} near duplicates removed"
    )
    print(f"total                  : {total:7.1f} s  ({records / total:7.1f} records/s)")
    for name in ("collect", "dedup", "scan"):
        s = c[f"{name}_seconds"]
        print(f"  {name:<21}: {s:7.1f} s  ({100 * s / total:5.1f}% of the time)")
    rest = total - sum(c[f"{n}_seconds"] for n in ("collect", "dedup", "scan"))
    print(f"  split, checks, write : {rest:7.1f} s  ({100 * rest / total:5.1f}% of the time)")


if __name__ == "__main__":
    main()
