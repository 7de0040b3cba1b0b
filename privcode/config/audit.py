"""The ``audit`` section: the privacy audits of the trained models."""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.config.fields import opt


@dataclass(frozen=True)
class AuditConfig:
    """Privacy audits of the trained junior: canaries, exposure, membership, fidelity, probing."""

    audits: tuple[str, ...] = opt(
        ("canaries", "exposure", "mia", "fidelity", "probe"),
        "Audits to run.",
        min_len=1,
        choices=("canaries", "exposure", "mia", "fidelity", "probe"),
    )
    canary_samples: int = opt(
        16, "Generations per inducing prompt (temperature 1, as in the seeds).", min=1
    )
    canary_max_new_tokens: int = opt(24, "Tokens per canary-inducing generation.", min=1)
    exposure_candidates: int = opt(
        1000,
        "Random same-format candidates a canary is ranked among (exposure <= log2(K+1) bits).",
        min=1,
    )
    mia_records: int = opt(500, "Members and non-members scored, each (0 = all).", min=0)
    fidelity_max_samples: int = opt(2000, "Synthetic and private samples compared, each.", min=2)
    probe_questions: int = opt(
        12, "Leak-probing questions per (scenario, attribute) pair and round.", min=1
    )
    probe_scenarios: tuple[str, ...] = opt(
        (),
        "Scenarios the leak probe asks about, each "
        "with its attributes (empty = all six: 32 "
        "pairs).",
        choices=tuple(registry.SCENARIOS),
    )
    probe_rounds: int = opt(2, "Leak-probing rounds (the feature library updates between).", min=1)
    probe_max_tokens: int = opt(
        256, "Tokens of each probe answer (code; its tests get 1.5x).", min=8
    )
    compare_nondp: bool = opt(
        False,
        "UNSAFE comparison: also fine-tune the junior WITHOUT DP "
        "(nondpft) on the same data and audit it side by side. "
        "That model is NOT PRIVATE and never leaves the audit "
        "directory.",
    )
    nondp_finetune: str = opt(
        "lora",
        "What the non-DP comparison trains: 'lora' (the junior's "
        "adapter, rank train.lora_r: the DP run's parameters) or "
        "'full' (every weight; memorises far faster: a tiny base "
        "with LoRA barely memorises a canary in minutes).",
        choices=("lora", "full"),
    )
    nondp_steps: int = opt(0, "Steps of the non-DP comparison (0 = train.steps).", min=0)
    nondp_lr: float = opt(0.0, "Learning rate of the non-DP comparison (0 = train.lr).", min=0.0)
    nondp_batch_size: int = opt(
        0,
        "Expected (Poisson) batch size of the non-DP comparison (0 = train.expected_batch_size).",
        min=0,
    )
    nondp_cpus: float = opt(
        0.0,
        "CPUs Ray reserves for the nondp stage's task (0 = every CPU "
        "of the cluster, up to this node's); its torch threads are "
        "the whole CPUs, at least one. Fewer lets it train beside "
        "Stage I and II.",
        min=0.0,
    )
    cpus_per_model: float = opt(
        0.0,
        "CPUs of each audited model's own Ray task: the models "
        "(and their leak probing) are audited side by side, "
        "each on that many torch threads (whole CPUs, at least "
        "one). 0 = one after another in the audit stage's task, "
        "on every CPU.",
        min=0.0,
    )
    probe_models: tuple[str, ...] = opt(
        ("premium",),
        "Audited models that leak probing examines (the slowest audit); absent ones are skipped.",
        choices=("premium", "junior", "nondpft"),
    )
    seed: int = opt(0, "Seed of the audits' sampling.")
    use_gpu: bool = opt(
        False,
        "Reserve one GPU for the audit stage (each audited model's task, with cpus_per_model).",
    )
    dtype: str = opt(
        "auto",
        "Dtype of the model weights and of the forward passes: auto (bfloat16 on a CUDA GPU with bf16, float32 on CPU), float32 or bfloat16.",
        choices=registry.DTYPES,
    )
