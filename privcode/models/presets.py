"""Sizes and schedules of the self-trained base model (:mod:`privcode.models.base`).

Each preset trains its *fixed* number of steps whatever the machine's speed
(a busy machine takes longer; it never gets a weaker model), sized for a
2-core CPU: ``ci`` well under a minute, ``demo`` about 3 minutes, ``small``
about half an hour. Imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from privcode.checks import check_number

__all__ = ["PRESETS", "Preset"]


@dataclass(frozen=True)
class Preset:
    """Size and schedule of one self-trained base model.

    ``hidden_size`` must be divisible by ``num_heads``, and ``num_heads`` by
    ``num_kv_heads`` (grouped-query attention as in real Qwen2).
    ``tokenizer_train_bytes`` caps the text the tokenizer is trained on
    (``None``: all training files). ``eval_tokens`` caps the held-out tokens.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_tokens: int
    tokenizer_train_bytes: int | None = None
    #: Steps of public helper tuning after pretraining
    #: (:func:`privcode.models.base_training._tune_helpers`); 0 = none.
    tune_steps: int = 0
    tune_batch_size: int = 16
    tune_lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "seq_len",
            "batch_size",
            "steps",
            "max_position_embeddings",
        ):
            check_number(name, getattr(self, name), min=1, integer=True)
        for name in ("warmup_steps", "eval_tokens", "tune_steps", "tune_batch_size"):
            check_number(name, getattr(self, name), min=0, integer=True)
        if self.tokenizer_train_bytes is not None:
            check_number("tokenizer_train_bytes", self.tokenizer_train_bytes, min=1, integer=True)
        for name in ("lr", "grad_clip", "rope_theta"):
            check_number(name, getattr(self, name), min=0, min_exclusive=True)
        check_number("min_lr_ratio", self.min_lr_ratio, min=0, max=1)
        check_number("weight_decay", self.weight_decay, min=0)
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


#: Preset name -> size and schedule. Step counts were sized from throughput
#: measured on an idle 2-core CPU (ci ~10.5k tokens/s, demo ~3.9k, small ~1k);
#: small batches of many steps learn more per second than large batches here.
PRESETS: dict[str, Preset] = {
    # ~0.9M parameters, 560 x 512 = 287k tokens: ~27 s of training, ~40 s in all.
    "ci": Preset(
        vocab_size=4096,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        seq_len=128,
        batch_size=4,
        steps=560,
        lr=2e-3,
        warmup_steps=20,
        eval_tokens=16_384,
        tokenizer_train_bytes=2_000_000,
        tune_steps=0,  # none: 40 steps left the tests' DP junior unable to beat it (5.42 vs 5.40 nats)
    ),
    # ~3.9M parameters, 520 x 1024 = 532k tokens: ~2.3 minutes of training, ~2.6 in all.
    "demo": Preset(
        vocab_size=6144,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        seq_len=256,
        batch_size=4,
        steps=520,
        lr=2e-3,
        warmup_steps=30,
        eval_tokens=32_768,
        tune_steps=300,
    ),
    # ~19M parameters, 800 x 2048 = 1.6M tokens (about one pass over the corpus): ~27 minutes.
    "small": Preset(
        vocab_size=16384,
        hidden_size=384,
        num_layers=8,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=1024,
        seq_len=512,
        batch_size=4,
        steps=800,
        lr=1e-3,
        warmup_steps=40,
        eval_tokens=65_536,
        tune_steps=300,
    ),
}
