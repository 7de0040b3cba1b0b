"""PAC ensemble decoding: one batched pass of m+1 rows vs m+1 separate passes vs one world.

Run::

    .venv/bin/python bench/bench_pac.py [--worlds 8 32 128] [--tokens 32] [--preset demo]
                                         [--cache-dir DIR] [--threads N] [--peft]

For each m, builds a worlds artifact of m random LoRA adapters (r=8) over
the preset's public base model (built, or found, in ``--cache-dir``:
default ``base.cache_dir``), then decodes ``--tokens`` tokens after a
fixed prompt three ways, in the same process, each with a KV cache:

* batched: :meth:`privcode.pac.ensemble.PacEnsemble.step_logprobs`, one
  forward of m+1 rows (every world's adapter and the public base, the
  stacked multi-LoRA forward of :mod:`privcode.models.multi_lora`), as the
  server does;
* separate: the m+1 models one after another (``set_adapter`` per world and
  the base with adapters disabled), each with its own cache: what a server
  without mixed batches would do;
* one world: the base with one adapter (set once), 1 row: the unit the ratio
  is in.
* ``--requests k ...`` (first m only): k requests of different prompts decoded
  together (:meth:`~privcode.pac.ensemble.PacEnsemble.step_batch`, the PAC server's
  scheduler), interleaved with one request alone: ms per step and per request-token,
  and how many times one request's token rate k of them reach. It takes turns with the batched run, 6 tokens each, so that a load
  which comes and goes slows both alike (:func:`median_ms`).

Prints milliseconds per token of each, ``batched / one world`` (goal on a
2-core CPU: m = 32 at most 3x, m = 128 at most 8x) and ``separate / batched``.
``--peft`` adds the same ensemble through peft's mixed-adapter batch (the path
before the stacked one), interleaved with a one-world run of its own.
Numbers from random adapters equal those of trained ones: the cost does not
depend on weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch


def make_worlds(base: str, m: int, root: Path) -> Path:
    from privcode.models.loading import attach_lora, load_causal_lm
    from privcode.pac.worlds import FORMAT, MANIFEST, world_names

    names = world_names(m)
    gen = torch.Generator().manual_seed(0)
    model = attach_lora(load_causal_lm(base), r=8, alpha=16)
    for name in names:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(str(root / "adapters" / name))
    (root / MANIFEST).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "m": m,
                "base_model": base,
                "worlds": names,
                "lora": {"r": 8, "alpha": 16},
                "NOT_PRIVATE": "benchmark",
            }
        )
    )
    return root


def batched(ens, ids: list[int]) -> Iterator[float]:
    """Seconds of each step of :meth:`PacEnsemble.step_logprobs` (one forward of m+1 rows)."""
    past, feed = None, ids
    while True:
        t0 = time.perf_counter()
        lp, past = ens.step_logprobs(feed, past)
        yield time.perf_counter() - t0
        feed = [int(lp.candidates[0])]


def together(ens, prompts: list[list[int]]) -> Iterator[float]:
    """Seconds of each step of :meth:`PacEnsemble.step_batch`: the k requests ``prompts``
    decoded together (one forward of k (m+1) rows over a left-padded KV cache), as the PAC
    server's scheduler runs concurrent requests."""
    from privcode.models.kv_batch import KvBatch

    batch = KvBatch()
    for g, ids in enumerate(prompts):
        lp, cache = ens.step_logprobs(ids)
        batch.join(g, cache, ens.m + 1, len(ids))
    feeds = [int(lp.candidates[0])] * len(prompts)
    while True:
        t0 = time.perf_counter()
        steps = ens.step_batch(batch, feeds)
        yield time.perf_counter() - t0
        feeds = [int(lp.candidates[0]) for lp in steps]


def separate(ens, ids: list[int], rows: list | None = None) -> Iterator[float]:
    """Seconds per token of each of ``rows`` (world names; None: the base) alone, with its
    own cache; one row: its adapter is set once, not per token (the one-world baseline)."""
    model = ens.model
    rows = [*ens.worlds, None] if rows is None else rows
    pasts = {r: None for r in rows}
    feed = ids
    while True:
        t0 = time.perf_counter()
        for r in rows:
            kwargs = {"input_ids": torch.tensor([feed]), ens._cache_arg: pasts[r]}
            with torch.inference_mode():
                if r is None:
                    with model.disable_adapter():
                        out = model(**kwargs, use_cache=True, **ens._forward_kwargs)
                else:
                    if len(rows) > 1 or model.active_adapter != r:
                        model.set_adapter(r)
                    out = model(**kwargs, use_cache=True, **ens._forward_kwargs)
                torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            cache = getattr(out, "cache", None)
            pasts[r] = cache if cache is not None else out.past_key_values
        yield time.perf_counter() - t0
        feed = [int(out.logits[0, -1].argmax())]


def median_ms(tokens: int, *runs: Iterator[float], block: int = 6) -> list[float]:
    """Median ms/token of each decoding run after 2 warm-up tokens each (allocations, kernel
    selection), the runs taking turns ``block`` tokens at a time: a load that comes and goes
    slows them alike, and the token after a turn (whose weights the other run evicted from
    the CPU's caches) is one in ``block``, which the median ignores."""
    times: list[list[float]] = [[] for _ in runs]
    for run in runs:
        next(run), next(run)
    while len(times[0]) < tokens:
        n = min(block, tokens - len(times[0]))
        for run, kept in zip(runs, times, strict=True):
            kept.extend(next(run) for _ in range(n))
    return [statistics.median(kept) * 1e3 for kept in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 32], help="Values of m (>= 2).")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--cache-dir", help="Base-model cache (default: base.cache_dir's default).")
    ap.add_argument("--threads", type=int, help="Torch threads (default: torch's default).")
    ap.add_argument(
        "--requests",
        type=int,
        nargs="+",
        default=[],
        help="Also decode k requests together (first m only), for each k given.",
    )
    ap.add_argument(
        "--peft", action="store_true", help="Also time peft's mixed-adapter batch (the old path)."
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from privcode.config import BaseConfig
    from privcode.models.base import build_base
    from privcode.pac.ensemble import PacEnsemble

    cfg = (
        BaseConfig(preset=args.preset)
        if args.cache_dir is None
        else BaseConfig(preset=args.preset, cache_dir=args.cache_dir)
    )
    base = build_base(cfg, progress=False)["path"]
    print(f"base {args.preset}; {args.tokens} tokens; torch threads {torch.get_num_threads()}")
    head = ("m", "batched ms/token", "separate ms/token", "one world ms/token", "batched/one")
    print(f"{head[0]:>4} {head[1]:>17} {head[2]:>18} {head[3]:>19} {head[4]:>12} separate/batched")
    for m in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            ens = PacEnsemble(make_worlds(base, m, Path(tmp)), device="cpu")
            ids = ens.encode('def parse_config(path):\n    """Read a config file."""\n')
            b, one = median_ms(args.tokens, batched(ens, ids), separate(ens, ids, ens.worlds[:1]))
            (s,) = median_ms(args.tokens, separate(ens, ids))
            print(f"{m:>4} {b:>17.1f} {s:>18.1f} {one:>19.2f} {b / one:>11.2f}x {s / b:>15.2f}x")
            if args.peft:
                ens._stacked = None  # the same ensemble through peft's mixed batch
                p, one = median_ms(
                    args.tokens, batched(ens, ids), separate(ens, ids, ens.worlds[:1])
                )
                print(f"{m:>4} peft mixed batch {p:.1f} ms/token, {p / one:.2f}x one world")
                ens._stacked = ens._stack()
            if m == args.worlds[0]:
                for k in args.requests:
                    prompts = [ids[: max(1, len(ids) - 3 * g)] for g in range(k)]
                    t, solo = median_ms(args.tokens, together(ens, prompts), batched(ens, ids))
                    print(
                        f"{m:>4} {k} requests together: {t:.1f} ms/step, {t / k:.2f} ms per "
                        f"request-token; {solo * k / t:.2f}x one request's token rate"
                    )


if __name__ == "__main__":
    main()
