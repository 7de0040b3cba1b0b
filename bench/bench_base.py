"""Training throughput of each base-model preset, and the training time it predicts.

Run: ``.venv/bin/python bench/bench_base.py [--presets ci demo small] [--steps 20] [--threads N]``

For each preset, builds the preset's Qwen2 shape with random weights, times
``--steps`` optimizer steps (forward, backward, clip, AdamW) on random token
batches of the preset's batch size and sequence length, and prints the
median and best tokens/s plus the training time the preset's fixed step
count would take at the median rate (every build trains all its steps).
Uses random tokens, so it needs neither a tokenizer nor the corpus; the
numbers match real training because step cost does not depend on the data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from privcode.models.presets import PRESETS, Preset


def bench_preset(name: str, preset: Preset, steps: int, warmup: int = 3) -> dict:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        use_cache=False,
    )
    model = Qwen2ForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95))
    batch = torch.randint(0, preset.vocab_size, (preset.batch_size, preset.seq_len))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:  # the first steps pay for allocations and kernel selection
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tokens = preset.tokens_per_step
    predicted = preset.steps * median
    return {
        "preset": name,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": tokens,
        "tokens_per_second_median": round(tokens / median),
        "tokens_per_second_best": round(tokens / min(times)),
        "predicted_train_seconds": round(predicted, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["ci", "demo"], choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=20, help="Timed steps per preset.")
    parser.add_argument(
        "--threads", type=int, default=None, help="Torch threads (default: the CPUs available)."
    )
    args = parser.parse_args()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    threads = args.threads or cores
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads")
    for name in args.presets:
        print(json.dumps(bench_preset(name, PRESETS[name], args.steps)), flush=True)


if __name__ == "__main__":
    main()
