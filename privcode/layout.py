"""Every path of a run, computed in one place: :class:`RunLayout`.

A run named ``name`` keeps its artifacts under ``<run.out_dir>/<name>/`` (private
storage: a PVC on Kubernetes) and publishes its shareable report under
``<run.reports_dir>/<name>/``::

    <out_dir>/<name>/<stage>/          one directory per stage (+ manifest.json)
    <out_dir>/<name>/train/release/    the DP release (the only thing Stage II reads)
    <out_dir>/<name>/synth/synthetic.parquet
    <out_dir>/<name>/premium/          the premium release (premium.json + adapter/)
    <out_dir>/<name>/nondp/nondpft/    the non-DP comparison (NOT PRIVATE)
    <out_dir>/<name>/pac/worlds/       the PAC worlds (NOT PRIVATE on their own)
    <out_dir>/<name>/private_report/   the owner-only report
    <out_dir>/<name>/.train|.synth|.premium/   work directories (checkpoints, shards)
    <reports_dir>/<name>/              the shareable report

A stage writes into a temporary sibling of its directory that the runner renames
into place (:mod:`privcode.pipeline.runner`): the ``*_in`` helpers name a file
inside such a directory, the others the final paths. Torch- and Ray-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunLayout"]

#: File and directory names inside a stage directory.
TRAIN_DATA, HELDOUT_DATA, CANARIES = "train.parquet", "heldout.parquet", "canaries.json"
RELEASE, SYNTHETIC, NONDP_MODEL, PAC_WORLDS = "release", "synthetic.parquet", "nondpft", "worlds"
MANIFEST, PRIVATE_REPORT = "manifest.json", "private_report"


@dataclass(frozen=True)
class RunLayout:
    """The paths of run ``name``: artifacts under ``out_dir``, the shareable report under
    ``reports_dir`` (both made absolute)."""

    out_dir: Path
    name: str
    reports_dir: Path = Path("reports")

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"run name {self.name!r} is not a plain directory name")
        object.__setattr__(self, "out_dir", Path(self.out_dir).expanduser().resolve())
        object.__setattr__(self, "reports_dir", Path(self.reports_dir).expanduser().resolve())

    @classmethod
    def of(cls, cfg: Any) -> RunLayout:
        """The layout of a :class:`~privcode.config.PipelineConfig` (or its ``run`` section)."""
        run = getattr(cfg, "run", cfg)
        return cls(Path(run.out_dir), run.name, Path(run.reports_dir))

    @property
    def root(self) -> Path:
        """``<out_dir>/<name>``: every private artifact of the run."""
        return self.out_dir / self.name

    def stage(self, stage: str) -> Path:
        return self.root / stage

    def manifest(self, stage: str) -> Path:
        return self.stage(stage) / MANIFEST

    def manifests_of_every_run(self, stage: str) -> dict[str, Path]:
        """Run name -> ``<out_dir>/<run>/<stage>/manifest.json`` of every run under ``out_dir``
        that has one (this run's included; hidden directories skipped), sorted by name."""
        return {
            p.parent.parent.name: p
            for p in sorted(self.out_dir.glob(f"*/{stage}/{MANIFEST}"))
            if not p.parent.parent.name.startswith(".")
        }

    def work(self, stage: str) -> Path:
        """``.<stage>``: a stage's work directory (checkpoints, resumable shards)."""
        return self.root / f".{stage}"

    # -- the artifacts stages read from each other

    @property
    def train_data(self) -> Path:
        return self.stage("data") / TRAIN_DATA

    @property
    def heldout_data(self) -> Path:
        return self.stage("data") / HELDOUT_DATA

    @property
    def canaries(self) -> Path:
        return self.stage("data") / CANARIES

    @property
    def release(self) -> Path:
        return self.stage("train") / RELEASE

    @property
    def synthetic(self) -> Path:
        return self.stage("synth") / SYNTHETIC

    @property
    def premium(self) -> Path:
        return self.stage("premium")

    @property
    def nondp_model(self) -> Path:
        return self.stage("nondp") / NONDP_MODEL

    @property
    def pac_worlds(self) -> Path:
        return self.stage("pac") / PAC_WORLDS

    @property
    def private_report(self) -> Path:
        return self.root / PRIVATE_REPORT

    @property
    def public_reports(self) -> Path:
        """``<reports_dir>/<name>``: the shareable report (aggregates only)."""
        return self.reports_dir / self.name

    # -- names inside a stage's (temporary) directory

    @staticmethod
    def release_in(stage_dir: Path) -> Path:
        return Path(stage_dir) / RELEASE

    @staticmethod
    def nondp_model_in(stage_dir: Path) -> Path:
        return Path(stage_dir) / NONDP_MODEL

    @staticmethod
    def pac_worlds_in(stage_dir: Path) -> Path:
        return Path(stage_dir) / PAC_WORLDS
