"""The ``train`` section (Stage I, DP-SGD) and the local-mode check it shares."""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.config.fields import opt


@dataclass(frozen=True)
class TrainConfig:
    """Stage I: DP-SGD fine-tuning of the junior model (LoRA) on the private corpus."""

    method: str = opt(
        "privcode++",
        "Training method (registry: privcode.registry.METHODS): "
        "privcode++ (latent-conditioned, prompts private), privcode "
        "(prompts public), dpft, pc-uncond, pc-promptemb, pc-preemb, "
        "privcode++-noalign, privcode-nonast, privcode-stableast, "
        "nondpft (NOT private: audits only).",
        choices=tuple(registry.METHODS),
    )
    allow_non_private: bool = opt(
        False,
        "UNSAFE: allow method nondpft, which trains WITHOUT "
        "differential privacy (no clipping, no noise, no "
        "ledger). Only for audits and comparisons; its release "
        "is marked NOT PRIVATE everywhere.",
    )
    epsilon: float = opt(
        4.0,
        "Privacy budget epsilon of the whole run (the ledger refuses "
        "any step that would exceed it).",
        min=0.01,
        max=1000.0,
    )
    delta: float = opt(1e-5, "Privacy parameter delta; should be below 1/N.", min=1e-12, max=0.1)
    noise_multiplier: float = opt(
        0.0,
        "Gaussian noise std / max_grad_norm. 0 = calibrate the "
        "smallest sigma that spends `epsilon` in `steps` steps.",
        min=0.0,
        max=100.0,
    )
    max_grad_norm: float = opt(1.0, "Per-record clipping norm C.", min=1e-6)
    expected_batch_size: int = opt(
        16, "Expected Poisson batch size B; sample rate q = B / N.", min=1
    )
    steps: int = opt(40, "Number of DP-SGD steps (optimizer updates).", min=1, max=10_000_000)
    lr: float = opt(5e-4, "Learning rate of the DP optimiser.", min=0.0, max=10.0)
    optimizer: str = opt(
        "adamw",
        "Optimiser applied to the privatized gradient (post-"
        "processing: any choice keeps the guarantee): adamw (the "
        "papers' choice) or sgd (plain, no momentum).",
        choices=("adamw", "sgd"),
    )
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw).", min=0.0)
    lora_r: int = opt(8, "LoRA rank of the junior adapter.", min=1)
    lora_alpha: int = opt(16, "LoRA alpha (scaling = alpha / r).", min=1)
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch.", min=0.0, max=0.9)
    max_length: int = opt(256, "Records are truncated to this many tokens.", min=8)
    num_workers: int = opt(
        1,
        "Ray Train workers (data-parallel DP-SGD); 0 = Ray Train's local "
        "mode: the loop runs in the train stage's own task on "
        "cpus_per_worker CPUs (no worker group to start; no restarts).",
        min=0,
        max=4096,
    )
    use_gpu: bool = opt(False, "One GPU per worker (NCCL); CPU workers use gloo.")
    micro_batch_size: int = opt(
        0,
        "Virtual batches: records per forward/backward pass. The Poisson sample of a step is "
        "cut into micro-batches of this size whose clipped per-record gradients are summed "
        "before the one noise draw (the privacy maths is unchanged; memory is that of one "
        "micro-batch). 0 = the whole sample in one pass.",
        min=0,
    )
    dtype: str = opt(
        "float32",
        "Dtype of the frozen base weights and of the forward pass (autocast): float32, "
        "bfloat16, or auto (bfloat16 on a CUDA GPU with bf16, float32 on CPU). The trainable "
        "weights (LoRA, PrivLC), per-record gradients' norms and their clipped sum, the noise "
        "and the optimiser stay float32.",
        choices=registry.DTYPES,
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute the base model's activations in the backward pass (HF gradient "
        "checkpointing): less memory per micro-batch for about a third more compute.",
    )
    accountant: str = opt("rdp", "Accountant of the budget ledger.", choices=registry.ACCOUNTANTS)
    grad_sample_mode: str = opt(
        "hooks", "Opacus per-sample-gradient mode.", choices=registry.GRAD_SAMPLE_MODES
    )
    cpus_per_worker: int = opt(1, "CPUs (and torch threads) per Ray Train worker.", min=1)
    seed: int = opt(
        0,
        "Seed of the LoRA initialisation. Poisson sampling, noise, dropout masks "
        "and the PrivLC latent noise never use it: they come from a secret seed "
        "drawn from OS entropy at every (re)start, since a known seed would let "
        "anyone replay the batches and the noise.",
    )
    secure_rng: bool = opt(
        False,
        "Secure mode (as Opacus' secure_mode): the Poisson sample of "
        "every step is drawn from os.urandom and the Gaussian noise "
        "from a generator reseeded from os.urandom at every step "
        "(summed as 4 draws / 2 against floating-point attacks). "
        "Off: one secret seed per (re)start drives fast PRNGs (not "
        "cryptographically secure). The release records the mode.",
    )
    eval_tokens: int = opt(
        4096,
        "Tokens of PUBLIC held-out code (the base model's held-out "
        "files) scored at every checkpoint for the loss curve; 0 = "
        "no curve. Never private data.",
        min=0,
    )
    checkpoint_every: int = opt(10, "Save a Ray Train checkpoint every this many steps.", min=1)
    max_failures: int = opt(
        2, "Worker-group restarts Ray Train may attempt (FailureConfig).", min=0
    )
    data: str = opt(
        "",
        "Private training set (Parquet/JSONL of id, prompt, code). '' = the "
        "data stage's train.parquet.",
    )
    # PrivSA: the syntax-aware KL term (PrivCode, PrivCode++ and their ablations).
    ast_lambda_max: float = opt(
        1000.0,
        "lambda(t) = lambda_min + (lambda_max - lambda_min) * "
        "exp(-alpha * floor(t / dt)): weight of the structural-"
        "token KL at step 0.",
        min=0.0,
    )
    ast_lambda_min: float = opt(0.1, "Asymptotic weight of the structural-token KL.", min=0.0)
    ast_alpha: float = opt(0.01, "Decay rate alpha of lambda(t).", min=0.0)
    ast_dt: int = opt(1, "lambda(t) decays every dt optimizer steps.", min=1)
    stable_ast_lambda: float = opt(
        1.0, "Constant KL weight of the privcode-stableast ablation.", min=0.0
    )
    # PrivLC: latent conditioning (PrivCode++ family).
    latent_dim: int = opt(
        768,
        "Latent size dz of the PrivLC module (paper best: 768; scale down for tiny models).",
        min=1,
    )
    num_virtual_tokens: int = opt(
        8, "Prefix length K: virtual tokens the decoder D makes from z.", min=1, max=256
    )
    encoder_hidden: int = opt(
        0, "Hidden width of the E_c / E_p MLPs; 0 = the model's hidden size.", min=0
    )
    vae_weight: float = opt(1.0, "Weight of L_VAE = KL(N(mu, sigma^2) || N(0, I)).", min=0.0)
    align_weight: float = opt(1.0, "Weight lambda_align of the latent alignment loss.", min=0.0)
    align_temperature: float = opt(
        0.1, "Temperature tau of the alignment loss (cosine similarities / tau).", min=1e-4
    )
    align_negatives: str = opt(
        "public",
        "Negatives of the alignment loss: 'public' = z_p of a "
        "bank of PUBLIC prompts (never other private records: "
        "in-batch negatives break per-record sensitivity); "
        "'none' = no negatives (1 - cos(z_c, z_p)).",
        choices=("public", "none"),
    )
    align_bank_size: int = opt(64, "Public prompts in the negative bank.", min=1)
    align_bank_refresh: int = opt(
        25,
        "Re-encode the bank's hidden states with the current "
        "junior every this many steps (E_p is applied at every "
        "step).",
        min=1,
    )
    preemb_steps: int = opt(
        100,
        "pc-preemb: non-private steps of PrivLC pretraining on PUBLIC "
        "(docstring, function) pairs before DP fine-tuning.",
        min=1,
    )
    preemb_lr: float = opt(1e-3, "pc-preemb: learning rate of the public pretraining.", min=0.0)

    def cross_check(self) -> tuple[str, str] | None:
        """(key, problem) for a combination of fields that is invalid, else None."""
        if self.method == "nondpft" and not self.allow_non_private:
            return (
                "method",
                "'nondpft' trains WITHOUT differential privacy (NOT PRIVATE); it is "
                "refused unless train.allow_non_private is true (audits only)",
            )
        if self.ast_lambda_min > self.ast_lambda_max:
            return (
                "ast_lambda_min",
                f"{self.ast_lambda_min} is above ast_lambda_max {self.ast_lambda_max}",
            )
        return _local_mode_check(self.num_workers, self.use_gpu)


def _local_mode_check(num_workers: int, use_gpu: bool) -> tuple[str, str] | None:
    if num_workers == 0 and use_gpu:
        return (
            "use_gpu",
            "needs num_workers >= 1 (num_workers 0, Ray Train's local mode, "
            "runs on the stage task's CPUs)",
        )
    return None
