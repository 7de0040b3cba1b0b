"""Record IO throughput: Parquet vs JSONL, validated write and read, side by side.

Run: ``.venv/bin/python bench/bench_records.py [--records 20000]``

Prints records/s for each format and the Parquet/JSONL ratio. The records are
synthetic (random identifiers and code-shaped text), never private data.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from privcode.data.records import Record, read_records, write_records


def make_records(n: int, seed: int = 0) -> list[Record]:
    rng = random.Random(seed)
    words = ["value", "items", "result", "path", "count", "name", "data", "key"]
    out = []
    for i in range(n):
        body = "\n".join(
            f"    {rng.choice(words)}_{j} = {rng.randint(0, 999)}"
            for j in range(rng.randint(3, 30))
        )
        out.append(
            Record(
                id=f"bench-{i}",
                prompt=f"Write function f{i} using {rng.choice(words)}.",
                code=f"def f{i}(x):\n{body}\n    return x\n",
                metadata={"i": i},
            )
        )
    return out


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000)
    args = ap.parse_args()
    records = make_records(args.records)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for fmt in ("jsonl", "parquet"):
            path = Path(tmp) / f"bench.{fmt}"
            w = timed(lambda p=path: write_records(records, p))
            r = timed(lambda p=path: read_records(p))
            rows[fmt] = (args.records / w, args.records / r, path.stat().st_size)
    print(f"{'format':8} {'write rec/s':>12} {'read rec/s':>12} {'bytes':>12}")
    for fmt, (w, r, size) in rows.items():
        print(f"{fmt:8} {w:12.0f} {r:12.0f} {size:12d}")
    (jw, jr, js), (pw, pr, ps) = rows["jsonl"], rows["parquet"]
    print(f"parquet/jsonl: write x{pw / jw:.2f}, read x{pr / jr:.2f}, size x{ps / js:.2f}")


if __name__ == "__main__":
    main()
