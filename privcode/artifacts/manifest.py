"""A stage directory's ``manifest.json``: :class:`StageManifest`.

Written by the runner (:mod:`privcode.pipeline.runner`) last, into the
stage's temporary directory, before the directory is renamed into place::

    {"stage", "fingerprint", "private", "config": {section: values}, "inputs":
     {stage: fingerprint}, "outputs": {relative path: sha256}, "summary": {...},
     "timings": {"started", "seconds"}, "privcode_version", "config_source"}

``summary`` is what the stage's ``run`` returned: aggregates and public
settings only, which the report and ``privcode status`` read. A manifest is
*intact* when every listed output still has its recorded sha256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts.record import ArtifactError, JsonRecord
from privcode.utils import sha256_file

__all__ = ["StageManifest", "hash_outputs"]


def hash_outputs(directory: str | os.PathLike) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` but the manifest."""
    root = Path(directory)
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != StageManifest.FILE
    }


@dataclass(frozen=True)
class StageManifest(JsonRecord):
    """One stage's record of what it read, wrote and found (module docstring)."""

    FILE = "manifest.json"

    stage: str
    fingerprint: str
    summary: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    private: bool = False
    privcode_version: str | None = None
    config_source: str | None = None

    @property
    def seconds(self) -> float | None:
        value = self.timings.get("seconds")
        return float(value) if isinstance(value, int | float) else None

    @classmethod
    def find(cls, directory: str | os.PathLike) -> StageManifest | None:
        """The manifest of stage directory ``directory``; None when absent or unreadable.

        For deciding whether to (re)run a stage; an unreadable manifest means "run".
        """
        try:
            return cls.read(Path(directory) / cls.FILE)
        except ArtifactError:
            return None

    def intact(self, directory: str | os.PathLike) -> bool:
        """Every listed output of ``directory`` is present with its recorded sha256."""
        root = Path(directory)
        for rel, digest in self.outputs.items():
            path = root / rel
            if not path.is_file() or sha256_file(path) != digest:
                return False
        return True
