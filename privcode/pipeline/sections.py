"""What a stage hands the report: a :class:`Section`, rendered from its own manifest.

Each stage renders its part of the report (:meth:`privcode.pipeline.stage.Stage.
report_section`) from the summary in its :class:`~privcode.artifacts.StageManifest`
and the :class:`ReportContext`; :mod:`privcode.pipeline.report` composes the
sections in stage order and writes the two reports. A section puts aggregates
only in ``lines``/``plots`` (the SHAREABLE report) and anything that shows one
private record, or un-noised counts of the private corpus, in
``owner_lines``/``owner_plots`` (the owner-only report in private storage).

Also the small Markdown and plotting helpers every section uses.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest
from privcode.config import PipelineConfig
from privcode.layout import RunLayout
from privcode.utils import atomic_path

__all__ = ["ReportContext", "Section", "fmt", "grid", "number", "plt", "save_fig", "table"]


@dataclass
class Section:
    """A stage's part of the report: Markdown lines and the PNGs it wrote, per report.

    ``plots`` are file names written into :attr:`ReportContext.out_dir`,
    ``owner_plots`` into :attr:`ReportContext.private_dir`; ``summary`` holds
    the entries this stage adds to ``report.json`` (aggregates only).
    """

    lines: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    owner_lines: list[str] = field(default_factory=list)
    owner_plots: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def add_plot(self, made: bool, name: str, caption: str, owner: bool = False) -> None:
        """Reference plot ``name`` when ``made`` (its writer returned True)."""
        if made:
            (self.owner_lines if owner else self.lines).extend([f"![{caption}]({name})", ""])
            (self.owner_plots if owner else self.plots).append(name)


@dataclass(frozen=True)
class ReportContext:
    """What every section may read: the config, every manifest the report got, its directories.

    ``out_dir`` receives the shareable files, ``private_dir`` (created 0700 by
    the report) the owner-only ones.
    """

    cfg: PipelineConfig
    out_dir: Path
    private_dir: Path
    inputs: Mapping[str, StageManifest]

    @property
    def plots(self) -> bool:
        return bool(self.cfg.report.plots)

    def stage_dir(self, name: str) -> Path:
        return RunLayout.of(self.cfg).stage(name)


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` places, booleans yes/no, None as n/a."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "n/a" if value is None else str(value)


def number(value: Any) -> Any:
    """4 significant digits; small values (delta, q) in scientific notation."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def table(rows: list[tuple[str, Any]], header: tuple[str, str] = ("quantity", "value")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in rows]
    return "\n".join(lines)


def grid(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def plt():
    """matplotlib.pyplot on the Agg backend (imported when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_fig(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def copy_plot(src: Path, out_dir: Path, name: str) -> str | None:
    """Copy a PNG a stage wrote into a report directory; its name, or None if absent."""
    if not src.is_file():
        return None
    with atomic_path(out_dir / name) as tmp:
        shutil.copyfile(src, tmp)
    return name


def private_dir(cfg: PipelineConfig) -> Path:
    """``<run.out_dir>/<run>/private_report``, created 0700 (tightened when it exists)."""
    directory = RunLayout.of(cfg).private_report
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory
