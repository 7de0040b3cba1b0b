"""Stage II benchmarks: Ray Data vs an in-process loop, and peak memory vs run size.

Run (on an idle machine; the test suite runs it only at its smallest setting):

    .venv/bin/python bench/bench_synth.py [--release runs/demo/train/release] [--samples 512]
        [--big 50000] [--small 5000]
        [--skip-throughput | --skip-memory]

1. Throughput: the same release, batch size, filters and sample count through
   (a) ``run_synthesis`` on a local Ray cluster (Ray Data, actor pools) and
   (b) a plain loop in this process calling the same operators one batch at
   a time; both timings include building the operators (model loads, sandbox
   zygotes), each operator at the same batch size. Prints samples/s of each and the
   ratio (goal >= 1.2x).
2. Memory: a cheap generator (public stdlib functions by index, renamed per sample; no model)
   through the full pipeline (sandbox, round trip, dedup) at ``--big`` and
   ``--small`` samples; prints the peak total RSS of every process of the
   Ray session plus this driver, and the ratio (goal <= 1.1x), and per operator pool its
   rows, samples/s per actor and per CPU, wall samples/s and largest pool
   (:mod:`privcode.synth.telemetry`). Equal sizes run once (ratio 1.00x): the test suite's
   smallest setting.

Starts a local Ray cluster in this process with every CPU, or joins the one
``RAY_ADDRESS`` names (then the memory numbers cover this driver's process
tree only, not the cluster's workers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from privcode.config import SynthConfig


class CannedGenerate:
    """Stand-in generator: public stdlib functions by sample index (no model), each renamed
    after its sample (``def name_<i>``), so no two samples share a text: the round trip's
    embedding cache gets no free hits, as with a junior that does not repeat itself."""

    def __init__(self, release_path, options, public_prompts):
        from privcode.data.public import public_pairs

        self.codes = [c for _, c in public_pairs(500, seed=11)]

    def __call__(self, batch):
        import re

        def renamed(i: int) -> str:
            code = self.codes[i % len(self.codes)]
            return re.sub(r"\b(def|class) (\w+)", rf"\1 \2_{i}", code, count=1)

        codes = [renamed(int(i)) for i in batch["index"]]
        return {
            **batch,
            "code": np.array(codes, dtype=object),
            "cond_prompt": np.array([""] * len(codes), dtype=object),
        }


class PeakRSS:
    """Samples the memory of this driver and all its descendants every 0.25 s.

    ``ray.init`` starts the GCS and raylet as children of the driver and every
    Ray worker (and each sandbox zygote) descends from them, so the process
    tree is exactly this benchmark's Ray session: other Ray clusters or
    Python processes on the machine are not counted. ``peak`` sums RSS (as
    before; a page of Ray's shared-memory object store counts once in every
    process that touched it), ``peak_pss`` sums PSS (each shared page split
    among the processes that map it: the memory the session really holds).
    ``top`` keeps the five largest processes at the RSS peak (name, MiB).
    """

    def __init__(self):
        self.peak = self.peak_pss = 0
        self.top: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _sample() -> list[tuple[str, int, int]]:
        me = psutil.Process()
        rows = []
        for p in [me, *me.children(recursive=True)]:
            try:
                name = " ".join(p.cmdline()[:1]) or p.name()
                full = p.memory_full_info()
                rows.append((name[:60], full.rss, getattr(full, "pss", full.rss)))
            except psutil.Error:
                continue
        return rows

    def _run(self):
        while not self._stop.is_set():
            rows = self._sample()
            total = sum(r for _, r, _ in rows)
            if total > self.peak:
                self.peak = total
                self.top = [(n, r) for n, r, _ in sorted(rows, key=lambda r: -r[1])[:5]]
            self.peak_pss = max(self.peak_pss, sum(p for _, _, p in rows))
            time.sleep(0.25)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def in_process(cfg: SynthConfig, release: Path) -> float:
    from privcode.synth.dataflow import generator_options, sandbox_limits
    from privcode.synth.operators import ExecutionFilter, Extract, Generate, RoundTripScore
    from privcode.synth.resources import filter_batch_sizes

    start = time.time()  # construction included, as in the Ray run (model loads etc.)
    gen = Generate(str(release), generator_options(cfg), [])
    ext = Extract(cfg.extractor, {})
    exe = ExecutionFilter(sandbox_limits(cfg), cfg.sandbox_workers)
    rt = RoundTripScore(cfg.summarizer, cfg.scorer, cfg.roundtrip_threshold, {})
    # The same batch sizes as the Ray Data run: generation in cfg.batch_size, each filter
    # on chunks of the round trip's (the largest) batch.
    chunk = max(filter_batch_sizes(cfg).values())
    for lo in range(0, cfg.num_samples, chunk):
        parts = []
        for g in range(lo, min(lo + chunk, cfg.num_samples), cfg.batch_size):
            idx = np.arange(g, min(g + cfg.batch_size, lo + chunk, cfg.num_samples))
            parts.append(gen({"index": idx, "z_seed": np.array([f"0:{i}" for i in idx])}))
        batch = {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
        rt(exe(ext(batch)))
    return cfg.num_samples / (time.time() - start)


def print_operators(ops: dict) -> None:
    """One line per operator pool: rows, the rate of one actor and per CPU, the wall rate."""
    for name, op in ops.items():
        print(
            f"  operator {name}: {op['rows']} rows, {op['rows_per_actor_s']} samples/s per "
            f"actor ({op['cpus_per_actor']} CPU: {op['rows_per_cpu_s']} per CPU), "
            f"{op['rows_per_s']} samples/s wall, pool up to {op['peak_actors']} actors",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", default="runs/demo/train/release")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--skip-memory", action="store_true", help="Throughput only.")
    ap.add_argument("--skip-throughput", action="store_true", help="Memory only.")
    ap.add_argument("--big", type=int, default=50_000)
    ap.add_argument("--small", type=int, default=5_000)
    args = ap.parse_args()

    from privcode.cluster.local import connect, free_port
    from privcode.synth.pipeline import run_synthesis

    # A new local cluster with every CPU; joining RAY_ADDRESS's, Ray refuses num_cpus.
    connect(
        None,
        log_to_driver=False,
        **(
            {}
            if os.environ.get("RAY_ADDRESS")
            else {"num_cpus": psutil.cpu_count(), "dashboard_port": free_port()}
        ),
    )
    release = Path(args.release).resolve()
    cfg = SynthConfig(
        num_samples=args.samples,
        shard_size=64,
        batch_size=16,
        max_new_tokens=128,
        temperature=0.3,
        start_text="def",
        generators_max=2,
        cpus_per_generator=0.7,
    )
    if not args.skip_throughput:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            ray_run = run_synthesis(
                cfg,
                release=release,
                out_dir=Path(tmp) / "o",
                work_root=Path(tmp) / "w",
                progress=False,
            )
            ray_rate = args.samples / (time.time() - t0)
        loop_rate = in_process(cfg, release)
        print(
            f"throughput: ray data {ray_rate:.2f} samples/s, in-process loop {loop_rate:.2f} "
            f"samples/s, ratio {ray_rate / loop_rate:.2f}x (goal >= 1.2x)",
            flush=True,
        )
        print_operators(ray_run["operators"])

    if args.skip_memory:
        return
    peaks, pss = {}, {}
    for n in dict.fromkeys((args.small, args.big)):  # one run when they are equal
        big = dataclasses.replace(
            cfg,
            num_samples=n,
            shard_size=1000,
            batch_size=64,
            sandbox_workers=4,
            # The canned generator costs nothing: one small actor; the filters' pools
            # grow to two actors each where the round trip (the bottleneck) and the
            # sandboxes need the CPU.
            generators_max=1,
            cpus_per_generator=0.2,
            executors_max=2,
            scorers_max=2,
            roundtrip_cpus=0.5,
        )
        with tempfile.TemporaryDirectory() as tmp, PeakRSS() as rss:
            t0 = time.time()
            out = run_synthesis(
                big,
                release=release,
                out_dir=Path(tmp) / "o",
                work_root=Path(tmp) / "w",
                progress=False,
                generator=CannedGenerate,
            )
            secs = time.time() - t0
        peaks[n] = rss.peak
        pss[n] = rss.peak_pss
        print(
            f"{n} samples (canned generator): {secs:.0f} s, {n / secs:.1f} samples/s, kept "
            f"{out['kept']}, peak RSS {rss.peak / 2**20:.0f} MiB (PSS "
            f"{rss.peak_pss / 2**20:.0f} MiB); largest at the peak: "
            + ", ".join(f"{name} {rss_ / 2**20:.0f}" for name, rss_ in rss.top),
            flush=True,
        )
        print_operators(out["operators"])
    print(
        f"peak RSS {args.big} vs {args.small}: {peaks[args.big] / peaks[args.small]:.2f}x "
        f"(goal <= 1.1x); peak PSS {pss[args.big] / pss[args.small]:.2f}x"
    )


if __name__ == "__main__":
    main()
