"""The ``premium`` section: the non-DP fine-tune on the synthetic data."""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.config.fields import opt
from privcode.config.train import _local_mode_check


@dataclass(frozen=True)
class PremiumConfig:
    """Premium model: LoRA fine-tuning on the synthetic data, WITHOUT DP (post-processing)."""

    model: str = opt(
        "",
        "Premium base model: a local HF model directory or a preset (ci, demo, "
        "small). '' = the base stage's model (paper: Qwen2.5-Coder-7B).",
    )
    data: str = opt(
        "",
        "Synthetic training set (Parquet with prompt, code). '' = the synth "
        "stage's synthetic.parquet. Never the private corpus.",
    )
    epochs: int = opt(2, "Passes over the synthetic data.", min=1, max=1000)
    batch_size: int = opt(8, "Records per optimizer step per worker.", min=1)
    lr: float = opt(1e-3, "AdamW learning rate.", min=0.0, max=10.0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", min=0.0)
    lora_r: int = opt(16, "LoRA rank of the premium adapter.", min=1)
    lora_alpha: int = opt(32, "LoRA alpha.", min=1)
    max_length: int = opt(256, "Records are truncated to this many tokens.", min=8)
    eval_fraction: float = opt(
        0.05, "Synthetic records held out for the eval loss.", min=0.0, max=0.5
    )
    num_workers: int = opt(
        1,
        "Ray Train workers (data parallel); 0 = Ray Train's local mode: "
        "the loop runs in the premium stage's own task on "
        "cpus_per_worker CPUs (no worker group to start; no restarts).",
        min=0,
        max=4096,
    )
    cpus_per_worker: int = opt(1, "CPUs (and torch threads) per worker.", min=1)
    use_gpu: bool = opt(False, "One GPU per worker (NCCL); CPU workers use gloo.")
    deepspeed: str = opt(
        "",
        "DeepSpeed ZeRO stage for GPU clusters: '' (plain DDP), zero1, "
        "zero2, zero3 (configs in jobs/configs/deepspeed/).",
        choices=("", "zero1", "zero2", "zero3"),
    )
    dtype: str = opt(
        "auto",
        "Dtype of the premium base's weights and forward: float32, bfloat16, or auto "
        "(bfloat16 on a CUDA GPU with bf16, float32 on CPU). Under DeepSpeed it sets the bf16 "
        "section (enabled only for bfloat16: bf16 weights and compute, fp32 master weights "
        "and optimizer state); the LoRA weights are trained and saved in float32.",
        choices=registry.DTYPES,
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute the base model's activations in the backward pass (HF gradient "
        "checkpointing, non-reentrant): less activation memory for about a third more compute.",
    )
    seed: int = opt(0, "Seed of the LoRA init, the eval split and the data order.")
    min_records: int = opt(
        1,
        "Refuse (before training) synthetic data with fewer records: "
        "Stage II kept too little to fine-tune on.",
        min=1,
    )
    allow_non_dp_source: bool = opt(
        False,
        "UNSAFE: fine-tune on synthetic data whose source "
        "release is NOT differentially private. Refused "
        "otherwise; when set, the premium artifact says "
        "that no DP guarantee holds.",
    )

    def cross_check(self) -> tuple[str, str] | None:
        if self.num_workers == 0 and self.deepspeed:
            return (
                "deepspeed",
                "needs num_workers >= 1 (Ray Train's local mode, num_workers "
                "0, trains without a process group)",
            )
        return _local_mode_check(self.num_workers, self.use_gpu)
