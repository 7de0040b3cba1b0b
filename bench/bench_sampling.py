"""Nucleus (top-p) filtering per generated token: Hugging Face's warper vs privcode's, side by side.

Run: ``.venv/bin/python bench/bench_sampling.py [--batch 16] [--vocab 6144] [--calls 200]``

Prints milliseconds per call of ``TopPLogitsWarper`` (torch sort) and of
:class:`privcode.models.sampling.NucleusFilter` (NumPy sort of the values) on
one torch thread, the ratio, and the share of rows whose kept set differs
(ties only; 0 on continuous logits). The logits are random, not a model's.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.generation.logits_process import TopPLogitsWarper

from privcode.models.sampling import NucleusFilter


def per_call_ms(fn, scores: torch.Tensor, calls: int) -> float:
    fn(None, scores.clone())  # warm-up
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(None, scores.clone())
    return (time.perf_counter() - t0) / calls * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=6144, help="6144: the demo preset's vocabulary")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as one Stage II generator runs
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(args.batch, args.vocab, generator=gen) / 0.3  # temperature 0.3
    hf, ours = TopPLogitsWarper(args.top_p), NucleusFilter(args.top_p)
    differ = torch.isinf(hf(None, scores.clone())) != torch.isinf(ours(None, scores.clone()))
    t_hf = per_call_ms(hf, scores, args.calls)
    t_ours = per_call_ms(ours, scores, args.calls)
    print(f"{'filter':24} {'ms/call':>8}")
    print(f"{'TopPLogitsWarper':24} {t_hf:8.2f}")
    print(f"{'NucleusFilter':24} {t_ours:8.2f}")
    print(f"rows that differ: {differ.any(dim=-1).float().mean().item():.3f}")
    print(f"NucleusFilter/TopPLogitsWarper speed: x{t_hf / t_ours:.2f}")


if __name__ == "__main__":
    main()
