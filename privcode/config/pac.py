"""The ``pac`` section: PAC-private generation by m LoRA worlds and a curator."""

from __future__ import annotations

from dataclasses import dataclass

from privcode import registry
from privcode.config.fields import opt


@dataclass(frozen=True)
class PacConfig:
    """PAC-private generation: m LoRA worlds (no DP) served by a private curator (seed 004)."""

    worlds: int = opt(
        128,
        "m: worlds (LoRA adapters over the frozen base); every private "
        "record is in exactly m/2 of them. Even, >= 2 (seed: 128).",
        min=2,
        max=4096,
    )
    lora_r: int = opt(8, "LoRA rank of each world (seed: 8).", min=1)
    lora_alpha: int = opt(16, "LoRA alpha of each world (seed: 16).", min=1)
    steps: int = opt(200, "AdamW steps; every step trains all worlds at once.", min=1)
    batch_size: int = opt(4, "Records per world per step (sampled among its members).", min=1)
    lr: float = opt(2e-3, "AdamW learning rate of the worlds.", min=0.0, max=10.0)
    max_length: int = opt(128, "Records are cut to this many tokens.", min=8)
    num_cpus: float = opt(
        0.0,
        "CPUs Ray reserves for the pac stage's task (0 = every CPU of "
        "the cluster, up to this node's); its torch threads are the "
        "whole CPUs, at least one. Fewer lets the worlds train beside "
        "Stage I and II.",
        min=0.0,
    )
    world_groups: int = opt(
        1,
        "Parallel Ray tasks training disjoint groups of worlds "
        "(1 = one process trains every world in batched passes).",
        min=1,
        max=4096,
    )
    use_gpu: bool = opt(False, "Train each group of worlds on one GPU.")
    dtype: str = opt(
        "auto",
        "Dtype of the frozen base under the worlds and of their passes: auto (bfloat16 on a "
        "CUDA GPU with bf16, float32 on CPU), float32 or bfloat16. The worlds' LoRA weights "
        "stay float32.",
        choices=registry.DTYPES,
    )
    top_k: int = opt(
        50, "Candidate set V_t: the public base's top-k tokens (seed: 50-1000).", min=2
    )
    b: float = opt(
        2.0**-16,
        "Per-token mutual-information budget b in nats, charged only "
        "when the worlds disagree (seed: 2^-16 .. 2^-32).",
        min=1e-300,
        max=1.0,
    )
    decoder: str = opt(
        "greedy",
        "How worlds vote: greedy, or gumbel (coupled sampling: one "
        "public Gumbel draw shared by every world).",
        choices=("greedy", "gumbel"),
    )
    session_budget: float = opt(
        2.0**-10,
        "Nats one API session may be charged; then it falls back to the public model (free).",
        min=0.0,
    )
    deployment_budget: float = opt(
        2.0**-4,
        "Nats all sessions of a deployment may be "
        "charged together (the bound on what the "
        "server releases about the private corpus).",
        min=0.0,
    )
    eval_sessions: int = opt(
        32,
        "Simulated sessions (fresh secret each) that measure the "
        "leakage log m - E[H(P_T)] and the MIA success.",
        min=1,
    )
    eval_tokens: int = opt(64, "Tokens generated per simulated session (T).", min=1)
    eval_positions: int = opt(
        256,
        "Held-out positions of the teacher-forced next-token accuracy (public, one world, PAC).",
        min=1,
    )
    eval_canaries: int = opt(
        15,
        "Most repeated canaries decoded after their own context "
        "by the public base, one world and PAC: how often each "
        "emits the value (0 = skip).",
        min=0,
    )
    eval_canary_tokens: int = opt(24, "Tokens decoded per canary context.", min=1)
    seed: int = opt(0, "Seed of the world assignment, adapter init and batch sampling.")

    def cross_check(self) -> tuple[str, str] | None:
        if self.worlds % 2:
            return (
                "worlds",
                f"must be even (each record in exactly m/2 worlds), got {self.worlds}",
            )
        if self.world_groups > self.worlds:
            return ("world_groups", f"{self.world_groups} groups for {self.worlds} worlds")
        return None
