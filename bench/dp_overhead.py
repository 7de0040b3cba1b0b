"""DP-SGD step vs a plain step: time and peak memory, same LoRA model and batch, each Opacus mode.

    .venv/bin/python bench/dp_overhead.py [--model demo] [--batch 16] [--length 128]
                                           [--steps 8] [--rounds 3] [--threads 2]
                                           [--records 100000]

    # memory per worker at real size: virtual batches of a Qwen2.5-Coder-1.5B shape
    .venv/bin/python bench/dp_overhead.py --shape qwen2.5-coder-1.5b --micro 1 4 16 \
                                           --batch 16 --length 32 [--checkpointing]

With ``--shape`` (a :data:`privcode.models.shapes.SHAPES` name: random
weights, the real config's shapes, nothing downloaded) the script prints
the memory table of virtual batches instead: for each ``--micro`` size one
process takes one real DP-SGD step (:func:`privcode.dp.engine.make_private`
with ``train.micro_batch_size`` = that size, ``q = 1`` over ``--batch``
records so the step's sample is the whole batch, noise drawn once) of the
LoRA junior (r=8, the dpft objective) and prints its peak RSS growth over
the loaded model: the activations, logits and per-record gradients of one
micro-batch, which is what virtual batches bound. ``--checkpointing`` adds
the same rows with gradient checkpointing on.

Each configuration (``nondp``, then DP with ``hooks``, ``functorch``,
``ghost``, and ``secure``: hooks with ``train.secure_rng``) runs in its own subprocess so that its peak memory is its own:
peak RSS growth over the loaded model on CPU (``ru_maxrss``), or
``torch.cuda.max_memory_allocated`` on GPU, over the process with the
model, optimizer and batch loaded (the whole process peak is printed too).
Rounds interleave the
configurations, so machine noise hits them alike; the time is the median
step over all rounds after one warm-up step per process. Printed ratios are
DP / non-DP, and secure / hooks (the cost of the secure mode).

A step is what training does: the plain step is forward, mean loss,
backward, AdamW; the DP step is per-record gradients, clipping, the sum,
Gaussian noise, division by the expected batch size, AdamW
(:mod:`privcode.dp.dpsgd`), plus drawing the step's Poisson mask over
``--records`` records and seeding the step's dropout stream
(:mod:`privcode.dp.randomness`): a seeded Philox schedule in the standard
modes; ``os.urandom`` for the mask and noise from a ChaCha20 keystream
under a fresh ``os.urandom`` key (4 draws, Box-Muller in float64,
:class:`privcode.dp.randomness.SecureNoise`) in ``secure``. Batches are random token ids of full length:
timing does not depend on the text, and no private data is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ("nondp", "hooks", "functorch", "ghost", "secure")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def worker(args: argparse.Namespace) -> dict:
    import torch

    from privcode.config import TrainConfig
    from privcode.dp.dpsgd import PerSampleClipper, apply_flat_gradient, privatize
    from privcode.dp.randomness import SecretRandomness, secure_poisson_mask
    from privcode.dp.sampler import PoissonSchedule
    from privcode.models.encoding import CODE, PAD
    from privcode.models.loading import attach_lora, load_causal_lm
    from privcode.train.methods import MethodContext, Objective, get_method

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = attach_lora(load_causal_lm(args.model), r=8, alpha=16).to(device).train()
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (args.batch, args.length), device=device)
    segments = torch.full_like(ids, CODE)
    batch = {
        "input_ids": ids,
        "attention_mask": (segments != PAD).long(),
        "segments": segments,
        "structural": torch.zeros_like(ids),
    }
    objective = Objective(
        get_method("dpft"), model, MethodContext(cfg=TrainConfig(), eos_id=0, pad_id=0)
    )
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    secure = args.mode == "secure"
    randomness = SecretRandomness(seed=int.from_bytes(os.urandom(15), "little"), secure=secure)
    schedule = PoissonSchedule(args.records, min(1.0, args.batch / args.records), randomness.seed)
    counter = iter(range(1 << 62))

    def loss_fn(module, b):
        return module(b)

    if args.mode == "nondp":

        def step() -> None:
            objective(batch).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        clipper = PerSampleClipper(
            objective, mode="hooks" if secure else args.mode, max_grad_norm=1.0
        )

        def step() -> None:
            t = next(counter)
            mask = (
                secure_poisson_mask(args.records, schedule.sample_rate)
                if secure
                else schedule.global_mask(t)
            )
            assert mask.shape == (args.records,)
            randomness.seed_step(t)
            s = clipper.clipped_sum(loss_fn, batch, args.batch)
            g = privatize(
                s,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=float(args.batch),
                add_noise=True,
                generator=randomness.noise_source(device, t),
                secure=secure,
                all_reduce=None,
            )
            apply_flat_gradient(params, g)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    # Baseline: model, optimizer and batch loaded, no step taken yet. The peak
    # below is the high-water mark of the steps (warm-up included) above it.
    sync()
    base_rss = _peak_rss_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated() / 2**20
    step()  # warm-up (kernels, allocator, Opacus hook setup): not timed
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 - base_cuda
        if device == "cuda"
        else _peak_rss_mb() - base_rss
    )
    return {
        "mode": args.mode,
        "times": times,
        "peak_mb": peak,
        "peak_total_mb": _peak_rss_mb(),
        "device": device,
        "trainable": sum(p.numel() for p in params),
        "params": sum(p.numel() for p in model.parameters()),
    }


def micro_worker(args: argparse.Namespace) -> dict:
    """One real DP-SGD step of the ``--shape`` junior at micro-batch ``--micro-one``."""
    import torch

    from privcode.config import TrainConfig
    from privcode.dp.engine import Privacy, make_private
    from privcode.models.encoding import CODE, PAD
    from privcode.models.loading import attach_lora
    from privcode.models.shapes import random_causal_lm
    from privcode.train.methods import MethodContext, Objective, get_method

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lm = attach_lora(
        random_causal_lm(args.shape, num_layers=args.layers, dtype=dtype), r=8, alpha=16
    )
    objective = Objective(
        get_method("dpft"), lm, MethodContext(cfg=TrainConfig(), eos_id=0, pad_id=0)
    )
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    engine = make_private(
        objective,
        optimizer,
        Privacy.dp_sgd(1.0, 1.0),
        num_records=args.batch,
        sample_rate=1.0,
        reserve=lambda request_id: (True, 0, None),
        micro_batch_size=args.micro_one,
        autocast_dtype=dtype,
        gradient_checkpointing=args.checkpointing_one,
    )
    vocab = lm.config.vocab_size
    ids = torch.randint(2, vocab, (args.batch, args.length))

    def batch_fn(local: list[int], step: int) -> dict:
        rows = ids[torch.tensor(local)]
        segments = torch.full_like(rows, CODE)
        return {
            "input_ids": rows,
            "attention_mask": (segments != PAD).long(),
            "segments": segments,
            "structural": torch.zeros_like(rows),
        }

    base = _peak_rss_mb()
    t0 = time.perf_counter()
    outcome = engine.step(0, batch_fn, lambda module, b: module(b))
    seconds = time.perf_counter() - t0
    assert outcome.taken
    return {
        "micro": args.micro_one,
        "checkpointing": args.checkpointing_one,
        "peak_mb": _peak_rss_mb() - base,
        "model_mb": base,
        "seconds": seconds,
        "params": sum(p.numel() for p in lm.parameters()),
        "trainable": sum(p.numel() for p in params),
    }


def micro_table(args: argparse.Namespace) -> int:
    rows = []
    settings = [(m, False) for m in args.micro]
    if args.checkpointing:
        settings += [(m, True) for m in args.micro]
    for micro, ckpt in settings:
        cmd = [
            sys.executable,
            __file__,
            "--shape",
            args.shape,
            "--micro-one",
            str(micro),
            "--batch",
            str(args.batch),
            "--length",
            str(args.length),
            "--threads",
            str(args.threads),
            "--dtype",
            args.dtype,
        ]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        if ckpt:
            cmd.append("--checkpointing-one")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.stderr.write(out.stderr[-4000:])
            raise SystemExit(f"dp_overhead: the micro-batch {micro} worker failed")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"  micro-batch {micro:3d}{' +ckpt' if ckpt else ''}: peak +{r['peak_mb']:.0f} MB, "
            f"step {r['seconds']:.1f} s",
            flush=True,
        )
    first = rows[0]
    print(
        f"shape {args.shape}{f' ({args.layers} layers)' if args.layers else ''}: "
        f"{first['params']:,} params ({args.dtype}), {first['trainable']:,} trainable (LoRA r=8); "
        f"one DP-SGD step over {args.batch} records x {args.length} tokens; loaded model "
        f"{first['model_mb']:.0f} MB RSS; {args.threads} threads"
    )
    ref = rows[0]["peak_mb"]
    print(f"{'micro-batch':>11} {'ckpt':>5} {'peak MB':>9} {'x first':>8} {'step s':>8}")
    for r in rows:
        ratio = f"{r['peak_mb'] / ref:.2f}" if ref > 0 else "-"
        print(
            f"{r['micro']:>11} {'on' if r['checkpointing'] else 'off':>5} "
            f"{r['peak_mb']:9.0f} {ratio:>8} {r['seconds']:8.2f}"
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help="HF model dir or preset (ci, demo, small)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--records",
        type=int,
        default=100_000,
        help="records N of the Poisson mask drawn at every DP step",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument(
        "--shape", help="memory table of virtual batches for this SHAPES name (see the docstring)"
    )
    p.add_argument("--micro", type=int, nargs="+", default=[1, 4, 16], help="micro-batch sizes")
    p.add_argument("--layers", type=int, default=0, help="cut the shape to this many layers")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--checkpointing", action="store_true", help="also with checkpointing on")
    p.add_argument("--micro-one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing-one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shape:
        args.layers = args.layers or None
        if args.micro_one is not None:
            print(json.dumps(micro_worker(args)))
            return 0
        return micro_table(args)
    if args.mode:
        print(json.dumps(worker(args)))
        return 0

    from privcode.models.loading import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        order = args.modes if r % 2 == 0 else list(reversed(args.modes))
        for mode in order:
            cmd = [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--length",
                str(args.length),
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "--records",
                str(args.records),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"dp_overhead: the {mode} worker failed (exit {out.returncode})")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"  round {r + 1}: {mode:9} median step "
                f"{statistics.median(runs[mode][-1]['times']):.3f} s",
                flush=True,
            )
    first = runs[args.modes[0]][0]
    print(
        f"model {args.model}: {first['params']:,} params, {first['trainable']:,} trainable "
        f"(LoRA r=8); batch {args.batch} x {args.length} tokens; device {first['device']}; "
        f"{args.threads} threads; {args.rounds} rounds x {args.steps} steps"
    )
    summary = {
        m: (
            statistics.median(t for run in runs[m] for t in run["times"]),
            max(run["peak_mb"] for run in runs[m]),
            max(run["peak_total_mb"] for run in runs[m]),
        )
        for m in args.modes
    }
    ref_t, ref_m, ref_total = summary.get("nondp", (None, None, None))
    print(
        f"{'mode':10} {'step s':>8} {'x nondp':>8} {'peak MB':>9} {'x nondp':>8} "
        f"{'process MB':>11} {'x nondp':>8}"
    )
    for m, (t, mem, total) in summary.items():
        rt = f"{t / ref_t:.2f}" if ref_t else "-"
        rm = f"{mem / ref_m:.2f}" if ref_m and ref_m > 0 else "-"
        rtot = f"{total / ref_total:.2f}" if ref_total else "-"
        print(f"{m:10} {t:8.3f} {rt:>8} {mem:9.1f} {rm:>8} {total:11.1f} {rtot:>8}")
    if "secure" in summary and "hooks" in summary:
        print(
            f"secure mode (os.urandom mask over {args.records:,} records, ChaCha20 "
            f"noise, 4 draws) / standard hooks: step time "
            f"{summary['secure'][0] / summary['hooks'][0]:.3f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
