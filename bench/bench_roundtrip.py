"""Round-trip filter throughput per CPU core: the scorer as it was, and each speed-up, side by side.

Run (on an idle machine; the test suite runs it only at its smallest setting):

    .venv/bin/python bench/bench_roundtrip.py [--pairs 2000] [--threads 1] [--repeat 2]

The pairs are Stage II's own shape: public stdlib functions (``public_pairs``) as the code and
the offline extractor's instruction as the prompt; ``--duplicates`` of them repeat earlier codes
(a junior repeats itself; the dedup step removes those later, the round trip sees them first).
Every variant scores the same pairs through :class:`~privcode.synth.roundtrip.RoundTripFilter`
(offline summariser + MiniLM cosine, the Stage II default) in this process with
``torch.set_num_threads(--threads)``; the rate is samples per second per thread (per core).
Printed per variant: samples/s/core, the speed-up over ``before``, verdicts that differ from
``before``'s at the default threshold, the largest score difference, and the filter's quality
on held-out public pairs (``public_pairs(400)[200:]``, as the threshold's calibration): the
share of matching (instruction, code) pairs kept, of the 39,800 mismatched ones rejected, and
Youden's J = kept + rejected - 1.

``before`` is the scorer as Stage II ran it until now (one encode of all texts, 64 per batch,
MiniLM's 256 word-piece window, no cache, float32); each next line adds one change to
``+ cache`` (the two precisions are alternatives); ``synth.scorer_precision: auto`` (the
default) takes bfloat16 where oneDNN runs it (AVX-512, AMX), else int8 rows.
"""

from __future__ import annotations

import argparse
import time

_FP32 = {"precision": "float32"}
VARIANTS = {
    # name: EmbeddingScorer options (on top of the summariser and threshold defaults)
    "before": {"max_seq_length": 256, "cache_size": 0, "token_budget": 0, **_FP32},
    "window 128": {"max_seq_length": 128, "cache_size": 0, "token_budget": 0, **_FP32},
    "+ token batches": {"cache_size": 0, **_FP32},
    "+ cache": {**_FP32},
    "+ int8 rows": {"precision": "int8"},
    "+ bfloat16": {"precision": "bfloat16"},
}


def pairs(n: int, duplicates: float) -> tuple[list[str], list[str]]:
    """(prompts, codes): public functions and their offline instructions, some repeated."""
    import random

    from privcode.data.public import public_pairs
    from privcode.synth.extract import make_extractor

    unique = max(1, round(n * (1 - duplicates)))
    codes = [c for _, c in public_pairs(unique, seed=7)]
    rng = random.Random(0)
    codes = codes + [rng.choice(codes) for _ in range(n - len(codes))]
    rng.shuffle(codes)
    return make_extractor("offline").extract(codes), codes


def run(options: dict, prompts: list[str], codes: list[str], repeat: int) -> tuple[float, list]:
    """(seconds of the fastest of ``repeat`` passes, scores); a fresh filter (empty cache) each
    pass, its model loaded before the clock starts."""
    from privcode.synth.roundtrip import RoundTripFilter

    best, scores = float("inf"), []
    for _ in range(repeat):
        rt = RoundTripFilter(**{f"scorer_{k}": v for k, v in options.items()})
        rt.score(prompts[:2], codes[:2])  # load MiniLM
        rt.scorer.clear_cache()
        start = time.perf_counter()
        scores = rt.score(prompts, codes)
        best = min(best, time.perf_counter() - start)
    return best, scores


def quality(options: dict, tau: float) -> tuple[float, float, float]:
    """(kept matching, rejected mismatched, J) on held-out public pairs at threshold ``tau``."""
    import numpy as np

    from privcode.data.public import public_pairs
    from privcode.synth.extract import make_extractor
    from privcode.synth.roundtrip import RoundTripFilter

    codes = [c for _, c in public_pairs(400)[200:]]
    prompts = make_extractor("offline").extract(codes)
    rt = RoundTripFilter(**{f"scorer_{k}": v for k, v in options.items()})
    summaries = rt.summaries(codes)
    emb = rt.scorer.embed([*summaries, *prompts])
    sims = emb[: len(codes)] @ emb[len(codes) :].T
    match = np.diag(sims)
    other = sims[~np.eye(len(codes), dtype=bool)]
    kept, rejected = float((match >= tau).mean()), float((other < tau).mean())
    return kept, rejected, kept + rejected - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (cores) per scorer")
    ap.add_argument("--repeat", type=int, default=2, help="passes per variant (fastest counts)")
    ap.add_argument("--duplicates", type=float, default=0.2, help="share of repeated codes")
    args = ap.parse_args()

    import torch

    from privcode.synth.roundtrip import DEFAULT_THRESHOLDS

    torch.set_num_threads(args.threads)
    prompts, codes = pairs(args.pairs, args.duplicates)
    tau = DEFAULT_THRESHOLDS["embedding"]
    base_rate, base = None, []
    print(
        f"{args.pairs} pairs ({args.duplicates:.0%} repeated codes), {args.threads} torch "
        f"thread(s), threshold {tau}:",
        flush=True,
    )
    for name, options in VARIANTS.items():
        seconds, scores = run(options, prompts, codes, args.repeat)
        rate = len(codes) / seconds / args.threads
        if base_rate is None:
            base_rate, base = rate, scores
        flips = sum((s >= tau) != (b >= tau) for s, b in zip(scores, base, strict=True))
        drift = max(abs(s - b) for s, b in zip(scores, base, strict=True))
        kept, rejected, j = quality(options, tau)
        print(
            f"  {name:16s} {rate:8.1f} samples/s/core  {rate / base_rate:5.2f}x  "
            f"verdicts changed {flips}/{len(codes)}  max |score diff| {drift:.3f}  "
            f"held-out: kept {kept:.1%} rejected {rejected:.1%} J {j:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
