"""The prepared GPU check: DP-SGD, release generation, PAC decoding and ZeRO-3 at real shapes.

    make gpu-check                                  # .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py [--budget-s 480] [--parts dp generate pac zero3]
                                        [--batch 8] [--full-batch 4] [--length 128] [--steps 3]
                                        [--worlds 8 32 128] [--gen-batch 16] [--zero3-layers N]
    .venv/bin/python bench/gpu_check.py --device cpu --tiny    # the CPU smoke run (tests)

At most ``--budget-s`` (8 minutes) on one H100/H200-class GPU, nothing
downloaded: the models are random-init models of real architectures
(:mod:`privcode.models.shapes`: Qwen2.5-Coder-1.5B; Qwen2.5-Coder-7B with
its layer count cut to what fits in half the free GPU memory in bf16), the
batches random token ids (time and memory depend on shapes, not weights; no
private data anywhere). Each part runs in its own subprocess (its CUDA peak
memory is its own; past its share of the budget it is killed, and unused
time passes to the next part) and prints its table as it goes; a summary
table gathers every row. What each part measures: the parts' module,
``bench/_gpu_check_parts.py``, and docs/benchmarks.md, "GPU check".

``--device cpu --tiny`` runs every part on the ``tiny`` shape (2 steps,
m = 2, 4: what tests/test_bench.py runs); on CPU, ZeRO-3 runs only when
DeepSpeed's CPU ops are already built (their JIT build takes minutes, once;
``--zero3-build`` allows it). Without CUDA and without ``--device cpu`` the
check exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _gpu_check_parts import GIB, JUNIOR, PREMIUM, RUNS, Part

PARTS = ("dp", "generate", "pac", "zero3")
#: Each part's share of the budget (a guess until a GPU run measures them).
SHARES = {"dp": 0.36, "generate": 0.12, "pac": 0.24, "zero3": 0.28}
TINY = {
    "batch": 2,
    "full_batch": 2,
    "length": 16,
    "steps": 2,
    "prompt_tokens": 8,
    "new_tokens": 4,
    "gen_batch": 2,
    "pac_tokens": 2,
    "worlds": [2, 4],
}


def _options(tiny: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda")
    add("--tiny", action="store_true", help=f"tiny shape and {TINY}")
    add("--budget-s", type=float, default=480.0, help="wall-clock limit of the whole check")
    add("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    add("--batch", type=int, default=8, help="LoRA and ZeRO-3 batch (rows)")
    add("--full-batch", type=int, default=4, help="full fine-tune batch (rows)")
    add("--length", type=int, default=128, help="training sequence length")
    add("--steps", type=int, default=3, help="timed steps after one warm-up")
    add("--grad-sample-mode", default="hooks", help="Opacus mode of the DP step")
    add("--prompt-tokens", type=int, default=32)
    add("--new-tokens", type=int, default=128, help="generated tokens per row")
    add("--gen-batch", type=int, default=16)
    add("--worlds", type=int, nargs="+", default=[8, 32, 128], help="PAC m values")
    add("--pac-tokens", type=int, default=16, help="timed PAC decoding steps")
    add("--zero3-layers", type=int, help="7B layers (default: as many as fit)")
    add("--zero3-build", action="store_true", help="on CPU: allow DeepSpeed's JIT op builds")
    add("--threads", type=int, help="torch CPU threads (default: torch's)")
    add("--part", choices=PARTS, help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    add("--deadline", type=float, help=argparse.SUPPRESS)
    if tiny:
        p.set_defaults(**TINY)  # flags given on the command line still win
    return p


def _header(args: argparse.Namespace) -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        where = f"{props.name}, {props.total_memory / GIB:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        where = f"CPU {platform.machine()}, {torch.get_num_threads()} threads"
    libs = ", ".join(f"{n} {v(n)}" for n in ("transformers", "peft", "opacus", "deepspeed"))
    shapes = "tiny" if args.tiny else f"{JUNIOR} / {PREMIUM}"
    return (
        f"gpu_check {time.strftime('%Y-%m-%d %H:%M')}: {where}; torch {torch.__version__}, "
        f"{libs}; shapes {shapes}; budget {args.budget_s:.0f} s"
    )


def _run_parts(args: argparse.Namespace) -> list[dict]:
    """Each part in a subprocess, killed at its share of the budget (plus earlier parts' rest)."""
    end, carry, rows = time.time() + args.budget_s, 0.0, []
    total = sum(SHARES[p] for p in args.parts)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in args.parts:
            began = time.time()
            share = args.budget_s * SHARES[name] / total + carry
            limit = min(share, end - began)
            if limit < 5:
                rows.append({"part": name, "config": "-", "result": "skipped: budget spent"})
                continue
            result = Path(tmp) / f"{name}.json"
            extra = [
                "--part",
                name,
                "--result",
                str(result),
                "--deadline",
                str(began + 0.9 * limit),
            ]
            print(f"\n[{name}] up to {limit:.0f} s", flush=True)
            try:
                code = subprocess.run(
                    [sys.executable, __file__, *sys.argv[1:], *extra], timeout=limit
                ).returncode
                status = f"failed (exit {code})" if code else None
            except subprocess.TimeoutExpired:
                status = f"killed at its time budget ({limit:.0f} s)"
            rows += json.loads(result.read_text()) if result.is_file() else []
            print(f"[{name}] {status or 'done'} in {time.time() - began:.0f} s", flush=True)
            if status:
                rows.append({"part": name, "config": "(the rest)", "result": status})
            carry = max(0.0, share - (time.time() - began))
    return rows


def main() -> int:
    args = _options("--tiny" in sys.argv).parse_args()
    if args.part:  # a child: one part
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        RUNS[args.part](Part(args))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); this check needs one H100/H200-class GPU and a CUDA build "
            "of torch. The CPU smoke run: bench/gpu_check.py --device cpu --tiny\n"
        )
        return 2
    print(_header(args), flush=True)
    start = time.time()
    rows = _run_parts(args)
    print(f"\nsummary ({time.time() - start:.0f} s of {args.budget_s:.0f} s)")
    width = max([len(r["config"]) for r in rows] + [13])
    print(f"{'part':9} {'configuration':{width}}  {'result':44}  vs")
    for r in rows:
        print(f"{r['part']:9} {r['config']:{width}}  {r['result']:44}  {r.get('vs', '-')}")
    return 1 if any(r["result"].startswith(("failed", "killed")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
