"""The base stage's ``base.json``: :class:`BaseRecord`, where the public base model is.

The model itself lives in the content-addressed cache
(``<base.cache_dir>/<preset>-<config hash>/``, whose ``build_info.json`` is
the full build record of :mod:`privcode.models.base`) or is the external HF
model ``base.model``. ``base.json`` in the stage directory, and the base
stage's summary, hold what later stages and the report read: the path, the
preset (None for an external model), the held-out scores and the build's
size and speed. Everything in it is public (the base model never sees
private data).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self

from privcode.artifacts.record import ArtifactError, JsonRecord, nested

__all__ = ["BaseRecord"]


def _history(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    """``[[step, train loss], ...]``: the build's training curve (about 100 points)."""
    if not isinstance(value, list):
        raise ArtifactError(f"{where}: not a list of [step, loss] points")
    points = []
    for point in value:
        if (
            not isinstance(point, list | tuple)
            or len(point) != 2
            or not isinstance(point[0], int)
            or not isinstance(point[1], int | float)
        ):
            raise ArtifactError(f"{where}: {point!r} is not a [step, loss] point")
        points.append((point[0], float(point[1])))
    return tuple(points)


_HISTORY = nested(_history, lambda h: [list(p) for p in h])


@dataclass(frozen=True)
class BaseRecord(JsonRecord):
    """``base.json`` (and the base stage's summary): one public base model.

    A trained preset has ``preset``, ``preset_spec`` (its ``steps`` the
    number it must train), ``steps`` and ``loss_history``; an external model
    (``external`` true) has ``model_type`` and no untrained score.
    """

    FILE = "base.json"

    version: int
    path: str
    preset: str | None
    seed: int
    config_hash: str
    external: bool
    heldout_loss: float
    untrained_heldout_loss: float | None
    heldout_bits_per_byte: float
    untrained_heldout_bits_per_byte: float | None
    heldout_tokens: int
    params: int
    vocab_size: int
    tokens_seen: int
    train_seconds: float
    tokens_per_second: float | None
    build_seconds: float
    num_threads: int
    cached: bool
    preset_spec: dict[str, Any] | None = None
    steps: int | None = None
    stopped_early: bool = False
    loss_history: tuple[tuple[int, float], ...] = field(default=(), metadata=_HISTORY)
    model_type: str | None = None

    def __post_init__(self) -> None:
        if self.external == (self.preset is not None):
            raise ValueError("a base model is either a trained preset or external, not both")

    @classmethod
    def of_build(cls, info: Mapping[str, Any], where: str = "the base build") -> Self:
        """The record of a build's info (``build_info.json`` plus ``path``/``cached``);
        the build's other keys (tokenizer, model config, versions) stay in its
        ``build_info.json``."""
        names = {f.name for f in fields(cls)}
        return cls.from_json({k: v for k, v in info.items() if k in names}, where)

    @property
    def complete_steps(self) -> int | None:
        """The steps a complete build of this preset trains (None for an external model)."""
        steps = (self.preset_spec or {}).get("steps")
        return steps if isinstance(steps, int) else None
