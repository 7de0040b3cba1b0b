"""The audits' non-DP comparison marker, ``nondp.json``: :class:`NondpRecord`.

NOT PRIVATE: a model fine-tuned WITHOUT differential privacy on the private
records, so the audits can show what their attacks find when nothing protects
the data; it never leaves private storage. The marker names that
(``NOT_PRIVATE``, ``dp`` false, the DP engine's ``training_mode``) and the
public settings of the fine-tune (:class:`NondpSummary`, the nondp stage's
summary and the audit's ``nondpft_training``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privcode.artifacts.record import JsonRecord

__all__ = ["NondpRecord", "NondpSummary"]


@dataclass(frozen=True)
class NondpSummary(JsonRecord):
    """The public settings of the non-DP fine-tune (no loss, no record)."""

    finetune: str
    steps: int
    lr: float
    expected_batch_size: int
    max_length: int
    lora_r: int | None
    trainable_parameters: int
    seconds: float


@dataclass(frozen=True)
class NondpRecord(NondpSummary):
    """``nondp.json`` beside the comparison's weights; ``dp`` is always false."""

    FILE = "nondp.json"

    not_private: str = field(default="", metadata={"key": "NOT_PRIVATE"})
    training_mode: dict[str, Any] = field(default_factory=dict)
    base_model: str = ""
    method: str = "nondpft"
    dp: bool = False
    conditioning: str = "prompt"
    loss_on_prompt: bool = True

    def __post_init__(self) -> None:
        if self.dp or not self.not_private or self.training_mode.get("mode") == "dp-sgd":
            raise ValueError("nondp.json must say dp false, NOT_PRIVATE and its non-DP mode")
        if not self.base_model:
            raise ValueError("nondp.json needs the base_model it was fine-tuned from")

    def summary(self) -> NondpSummary:
        return NondpSummary(**{k: getattr(self, k) for k in NondpSummary.__dataclass_fields__})
