"""The run report: Markdown plus PNG plots, built from stage manifests only.
Design notes: docs/development.md, "privcode/pipeline/report.py".

The report never opens a dataset: each input stage renders its section from the aggregates in
its manifest summary (:mod:`privcode.pipeline.sections`), and this module composes them,
reading only the manifests it is given (the runner's current ones:
:func:`privcode.pipeline.runner.current_optional_inputs`). Two reports, split at the privacy
boundary:

* SHAREABLE, ``<reports_dir>/<run>/`` (also the report stage's artifact): aggregates only; of
  the private corpus N and the opaque dataset id, never a digest; no number that moves with
  one record outside the release's DP path (no store composition, no wall clock).
* OWNER-ONLY, ``<run.out_dir>/<run>/private_report/`` (directory 0700, files 0600): the
  corpus's exact composition, plots of single records, the store's composition, the seconds.
  Nothing shareable links to it or names its path; :func:`write_report` returns it for the
  command line only.

"""

from __future__ import annotations

import base64
import html
import os
import re
import shutil
from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest
from privcode.config import PipelineConfig
from privcode.layout import RunLayout
from privcode.pipeline.report_audit import OWNER_ONLY_PLOTS as AUDIT_OWNER_ONLY_PLOTS
from privcode.pipeline.sections import ReportContext, Section, fmt, private_dir
from privcode.pipeline.stages import STAGES
from privcode.utils import PUBLIC_FILE_MODE, atomic_path, atomic_write_json, atomic_write_text

#: report.json's entries that sections fill (null when their stage is not an input).
REPORT_KEYS = (
    "base_heldout_loss",
    "training_records",
    "train_epsilon",
    "synth_funnel",
    "privacy_utility",
)


_CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}table{border-collapse:collapse;margin:.5rem 0 1rem}
th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:left}th{background:#f2f4f7}
img{max-width:100%;border:1px solid #eee;margin:.5rem 0}code{background:#f5f5f5;padding:0 .2rem}
h1,h2{border-bottom:1px solid #ddd;padding-bottom:.2rem}"""


def render_html(markdown_text: str, image_dir: Path, title: str) -> str:
    """report.md as one self-contained HTML page (python-markdown; PNGs inlined as data URIs)."""

    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"])

    def inline(match: re.Match) -> str:
        path = image_dir / match.group(2)
        if not path.is_file() or path.parent.resolve() != image_dir.resolve():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'{match.group(1)}"data:image/png;base64,{data}"'

    body = re.sub(r'(<img[^>]*?src=)"([^"/]+\.png)"', inline, body)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_CSS}</style></head><body>{body}</body></html>"
    )


#: Plots that show private data: written to the owner-only report only, and
#: withdrawn from the published directory when an older version put them there.
OWNER_ONLY_PLOTS = ("corpus.png", *AUDIT_OWNER_ONLY_PLOTS)

_OWNER_HEADER = (
    "> **PRIVATE: owner-only report.** It holds un-noised statistics of the private "
    "corpus and plots with one point per private record. It lives in the run's "
    "private storage, for the data owner, inside the privacy boundary: do not "
    "share, publish, or attach it to a release or to the shareable report."
)


def private_report_dir(cfg: PipelineConfig) -> Path:
    """``<run.out_dir>/<run>/private_report``: the owner-only report, in private storage."""
    return RunLayout.of(cfg).private_report


def _stage_lines(inputs: dict[str, StageManifest]) -> list[str]:
    """SHAREABLE: each input stage and its fingerprint (a hash of config and inputs' hashes)."""
    lines = ["## Stages", "", "| stage | fingerprint |", "|---|---|"]
    lines += [f"| {name} | `{manifest.fingerprint}` |" for name, manifest in inputs.items()]
    return [*lines, ""]


def _owner_timing_lines(inputs: dict[str, StageManifest]) -> list[str]:
    """OWNER-ONLY: each input stage's wall clock (it grows with the private data, un-noised)."""
    lines = ["## Stage timings", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {fmt(manifest.seconds, 1)} |" for name, manifest in inputs.items()]
    return [*lines, ""]


def _write_owner_report(
    cfg: PipelineConfig,
    directory: Path,
    inputs: dict[str, StageManifest],
    sections: list[Section],
) -> Path:
    """Write the owner-only report (module docstring) from the sections' owner parts."""
    title = f"{cfg.report.title}: owner-only report"
    lines = [f"# {title}", "", _OWNER_HEADER, "", f"Run `{cfg.run.name}`.", ""]
    lines += _owner_timing_lines(inputs)
    plots: list[str] = []
    for section in sections:
        lines += section.owner_lines
        plots += section.owner_plots
    text = "\n".join(lines)
    atomic_write_text(directory / "report.md", text)
    atomic_write_text(directory / "report.html", render_html(text, directory, title))
    keep = {"report.md", "report.html", *plots}
    for path in directory.iterdir():
        if path.is_file() and path.name not in keep and path.suffix == ".png":
            path.unlink()  # a plot of an earlier render that this one no longer shows
    for name in keep:
        os.chmod(directory / name, 0o600)
    return directory / "report.md"


def write_report(
    cfg: PipelineConfig, out_dir: Path, inputs: dict[str, StageManifest]
) -> dict[str, Any]:
    """Write the shareable report into ``out_dir``, publish it, and write the owner-only one.

    Each input stage renders its own :class:`~privcode.pipeline.sections.Section`
    (:meth:`Stage.report_section`); this composes them in stage order.
    ``out_dir`` (the report stage's artifact directory) and the published
    ``<reports_dir>/<run>/`` receive the shareable files only; the owner-only
    report goes to :func:`private_report_dir`. The returned summary is
    ``report.json`` plus ``private_report`` (the owner report's path, for the
    command line; it is not written to ``report.json``).
    """
    inputs = {name: inputs[name] for name in STAGES if name in inputs}
    ctx = ReportContext(cfg, Path(out_dir), private_dir(cfg), inputs)
    sections = [
        section
        for name, manifest in inputs.items()
        if (section := STAGES[name]().report_section(manifest, ctx)) is not None
    ]
    lines = [f"# {cfg.report.title}", "", f"Run `{cfg.run.name}` (config `{cfg.source}`).", ""]
    lines += _stage_lines(inputs)
    plots: list[str] = []
    summary: dict[str, Any] = {
        "report": str(RunLayout.of(cfg).public_reports / "report.md"),
        "plots": plots,
        **dict.fromkeys(REPORT_KEYS),
    }
    for section in sections:
        lines += section.lines
        plots += section.plots
        summary.update(section.summary)
    leaked = [name for name in plots if name in OWNER_ONLY_PLOTS]
    if leaked:  # a section must never put a per-record plot in the shareable report
        raise AssertionError(f"owner-only plots in the shareable report: {leaked}")
    text = "\n".join(lines)
    atomic_write_text(out_dir / "report.md", text)
    atomic_write_text(out_dir / "report.html", render_html(text, out_dir, cfg.report.title))
    atomic_write_json(out_dir / "report.json", summary)
    publish = RunLayout.of(cfg).public_reports
    publish.mkdir(parents=True, exist_ok=True)
    for name in ["report.md", "report.html", "report.json", *plots]:
        with atomic_path(publish / name, PUBLIC_FILE_MODE) as tmp:
            shutil.copyfile(out_dir / name, tmp)
    for name in OWNER_ONLY_PLOTS:  # published by an older version: withdrawn
        (publish / name).unlink(missing_ok=True)
    owner = _write_owner_report(cfg, ctx.private_dir, inputs, sections)
    return {**summary, "private_report": str(owner)}
