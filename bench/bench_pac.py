"""PAC ensemble decoding: one batched pass of m+1 rows vs m+1 separate passes per token.

Run::

    .venv/bin/python bench/bench_pac.py [--worlds 8 32] [--tokens 32] [--preset demo]
                                         [--cache-dir DIR] [--threads N]

For each m, builds a worlds artifact of m random LoRA adapters (r=8) over
the preset's public base model (built, or found, in ``--cache-dir``:
default ``base.cache_dir``), then decodes ``--tokens`` tokens after a
fixed prompt two ways, in the same process, each with a KV cache:

* batched: :meth:`privcode.pac.ensemble.PacEnsemble.step_logprobs`, one
  forward of m+1 rows (every world's adapter and the public base, peft's
  mixed-adapter batch), as the server does;
* separate: the m+1 models one after another (``set_adapter`` per world and
  the base with adapters disabled), each with its own cache: what a server
  without mixed batches would do.

Prints milliseconds per token for both and the ratio (goal: batched faster
than separate, increasingly so with m on a GPU). Numbers from random
adapters equal those of trained ones: the cost does not depend on weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
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


def batched(ens, ids: list[int], tokens: int) -> list[float]:
    times, past, feed = [], None, ids
    for _ in range(tokens):
        t0 = time.perf_counter()
        lp, past = ens.step_logprobs(feed, past)
        times.append(time.perf_counter() - t0)
        feed = [int(lp.candidates[0])]
    return times


def separate(ens, ids: list[int], tokens: int) -> list[float]:
    model = ens.model
    rows = [*ens.worlds, None]
    pasts = {r: None for r in rows}
    feed = ids
    times = []
    with torch.inference_mode():
        for _ in range(tokens):
            t0 = time.perf_counter()
            x = torch.tensor([feed], dtype=torch.long)
            for r in rows:
                if r is None:
                    with model.disable_adapter():
                        out = model(input_ids=x, past_key_values=pasts[r], use_cache=True)
                else:
                    model.set_adapter(r)
                    out = model(input_ids=x, past_key_values=pasts[r], use_cache=True)
                pasts[r] = out.past_key_values
                torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            times.append(time.perf_counter() - t0)
            feed = [int(out.logits[0, -1].argmax())]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 32], help="Values of m (>= 2).")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--cache-dir", help="Base-model cache (default: base.cache_dir's default).")
    ap.add_argument("--threads", type=int, help="Torch threads (default: torch's default).")
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
    print(f"{'m':>4} {'batched ms/token':>17} {'separate ms/token':>18} {'separate/batched':>17}")
    for m in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            ens = PacEnsemble(make_worlds(base, m, Path(tmp)), device="cpu")
            ids = ens.encode('def parse_config(path):\n    """Read a config file."""\n')
            batched(ens, ids, 2)  # warm-up: allocations, kernel selection
            b = statistics.median(batched(ens, ids, args.tokens)) * 1e3
            s = statistics.median(separate(ens, ids, args.tokens)) * 1e3
            print(f"{m:>4} {b:>17.1f} {s:>18.1f} {s / b:>16.2f}x")


if __name__ == "__main__":
    main()
