"""The premium release's ``premium.json``: :class:`PremiumRecord`, and the stage's summary.

The premium model is LoRA fine-tuned WITHOUT DP on Stage II synthetic data
only; its guarantee is the source release's, by post-processing, and
:class:`PremiumPrivacy` says which (or, for a source that is not DP data,
that none holds). ``premium.json`` sits beside ``adapter/``; the loader
(:func:`privcode.models.artifacts.load_model`) reads the base model from
``model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privcode.artifacts.record import ArtifactError, JsonRecord, nested

__all__ = ["PremiumPrivacy", "PremiumRecord", "PremiumSummary"]


@dataclass(frozen=True)
class PremiumPrivacy(JsonRecord):
    """What the premium model inherits: the source release's (epsilon, delta), or nothing."""

    dp: bool
    dp_training: bool
    epsilon: float | None
    delta: float | None
    guarantee: str
    no_dp_guarantee: bool
    privacy_warning: str | None
    post_processing_of: dict[str, Any] | None
    statement: str
    source_problem: str | None = None

    def __post_init__(self) -> None:
        if self.dp == self.no_dp_guarantee:
            raise ValueError("dp and no_dp_guarantee must disagree")
        if not self.dp and not self.privacy_warning:
            raise ValueError("a premium model without a DP guarantee needs its privacy_warning")


def _privacy(value: Any, where: str) -> PremiumPrivacy:
    return PremiumPrivacy.from_json(value, where)


def _curve(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Per epoch ``{"epoch", "train_loss", "eval_loss"}`` (losses on synthetic data)."""
    if not isinstance(value, list) or not all(
        isinstance(p, dict) and isinstance(p.get("epoch"), int) for p in value
    ):
        raise ArtifactError(f"{where}: not a list of {{epoch, train_loss, eval_loss}} points")
    return tuple(value)


_PRIVACY = nested(_privacy, lambda p: p.to_json())
_CURVE = nested(_curve, list)


@dataclass(frozen=True)
class PremiumSummary(JsonRecord):
    """The premium stage's summary (its manifest); the report's premium section reads it."""

    model: str
    data_sha256: str
    records: int
    train_seconds: float
    privacy: PremiumPrivacy = field(metadata=_PRIVACY)
    curve: tuple[dict[str, Any], ...] = field(default=(), metadata=_CURVE)


@dataclass(frozen=True)
class PremiumRecord(JsonRecord):
    """``premium.json``: the base model, the synthetic data it was tuned on, how, and privacy."""

    FILE = "premium.json"

    model: str
    data: str
    data_sha256: str
    records: int
    config: dict[str, Any]
    train_seconds: float
    privacy: PremiumPrivacy = field(metadata=_PRIVACY)
    curve: tuple[dict[str, Any], ...] = field(default=(), metadata=_CURVE)
    #: The Jinja chat template of the training format (privcode.models.chat); None: a
    #: release from before templates were recorded, which trained on that same format.
    chat_template: str | None = None

    def summary(self) -> PremiumSummary:
        return PremiumSummary(
            model=self.model,
            data_sha256=self.data_sha256,
            records=self.records,
            train_seconds=self.train_seconds,
            privacy=self.privacy,
            curve=self.curve,
        )
