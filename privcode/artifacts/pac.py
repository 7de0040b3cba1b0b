"""The PAC worlds artifact's ``pac.json``: :class:`PacWorldsRecord`.

NOT PRIVATE on their own: ``m`` LoRA worlds, each fine-tuned WITHOUT DP on
its share of the private records (:mod:`privcode.pac.worlds`); only the PAC
server (:mod:`privcode.pac.ensemble`) may read them, and what it emits is
PAC-private by the noise it adds. The directory::

    pac.json                  this record
    adapters/<world>/         one PEFT adapter per name in ``worlds``

``base_model`` may be absent when the server is given the base model
(``model``); the training settings are absent for worlds trained elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts.record import ArtifactError, JsonRecord, nested

__all__ = ["BASE_ROW", "WORLDS_FORMAT", "PacWorldsRecord"]

WORLDS_FORMAT = "privcode-pac-worlds/1"
#: The name of the public base model's row in the ensemble (never a world's name).
BASE_ROW = "__base__"
_WORLD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ArtifactError(f"{where}: not a list of world names")
    for name in value:
        if not isinstance(name, str) or not _WORLD_NAME.match(name) or name == BASE_ROW:
            raise ArtifactError(
                f"{where}: invalid world name {name!r} "
                "(letters, digits, '_', '.', '-'; not starting with '.')"
            )
    return tuple(value)


@dataclass(frozen=True)
class PacWorldsRecord(JsonRecord):
    """``pac.json``: the worlds in vote order, their base model and how they were trained."""

    FILE = "pac.json"

    format: str
    m: int
    worlds: tuple[str, ...] = field(metadata=nested(_names, list))
    base_model: str | None = None
    lora: dict[str, Any] | None = None
    not_private: str = field(default="", metadata={"key": "NOT_PRIVATE"})
    training_mode: dict[str, Any] = field(default_factory=dict)
    dp: bool = False
    seed: int | None = None
    records: int | None = None
    steps: int | None = None
    #: The worlds' chat template (privcode.models.chat; None: worlds from before it was
    #: recorded, trained on the same format).
    chat_template: str | None = None
    batch_size_per_world: int | None = None
    lr: float | None = None
    max_length: int | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    seconds: float | None = None
    #: The training data's opaque id in the privacy store (keyed; None: written before it).
    dataset_id: str | None = None

    def __post_init__(self) -> None:
        if self.format != WORLDS_FORMAT:
            raise ValueError(f"'format' must be {WORLDS_FORMAT!r}, got {self.format!r}")
        if self.m < 2:
            raise ValueError(f"'m' must be an integer >= 2, got {self.m!r}")
        if len(self.worlds) != self.m:
            raise ValueError(f"'worlds' must list m={self.m} world names, got {len(self.worlds)}")
        if len(set(self.worlds)) != self.m:
            raise ValueError("'worlds' names must be distinct")
        if self.dp:
            raise ValueError("'dp' must be false: PAC worlds are trained without DP")

    def verify(self, root: str | Path) -> None:
        """Every world's adapter is in ``root/adapters/<name>/`` (loads nothing)."""
        for name in self.worlds:
            adapter = Path(root) / "adapters" / name
            if not (adapter / "adapter_config.json").is_file():
                raise ArtifactError(
                    f"{adapter}: missing adapter of world {name!r} (expected "
                    "adapter_config.json from PeftModel.save_pretrained)"
                )
