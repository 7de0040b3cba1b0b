"""A run's progress as its artifacts show it: finished stages, its release's digest, its report.

The operator mounts the artifacts volume read-only at the path the Ray pods
use (``--artifacts-root``: the chart's ``run.out_dir`` is ``<root>/runs`` and
``run.reports_dir`` ``<root>/reports``) and reads each stage's manifest
(:class:`~privcode.artifacts.manifest.StageManifest`). What it copies into
the run's status is public: stage names, the DP release's digest (a hash of
the released, differentially private artifact, never of private data) and
the shareable report's path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from privcode.artifacts.manifest import StageManifest
from privcode.layout import MANIFEST, RELEASE, RunLayout

__all__ = ["RunProgress", "run_progress"]


@dataclass(frozen=True)
class RunProgress:
    stages: dict[str, str] = field(default_factory=dict)  #: stage -> "Succeeded"
    release_digest: str = ""  #: sha256 over the release's files (name and digest, sorted)
    report: str = ""  #: the shareable report, once written


def run_progress(artifacts_root: str, run: str, stages: tuple[str, ...]) -> RunProgress:
    """What the artifacts under ``artifacts_root`` show of run ``run``'s ``stages``."""
    root = Path(artifacts_root)
    layout = RunLayout(root / "runs", run, root / "reports")
    done = {s: "Succeeded" for s in stages if (layout.stage(s) / MANIFEST).is_file()}
    digest = ""
    train = StageManifest.find(layout.stage("train")) if "train" in done else None
    if train is not None:
        files = sorted((k, v) for k, v in train.outputs.items() if k.startswith(RELEASE + "/"))
        if files:
            digest = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in files).encode()).hexdigest()
    report = layout.public_reports / "report.md"
    return RunProgress(done, digest, str(report) if report.is_file() else "")
