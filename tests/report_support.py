"""Test helpers for the report tests (test_report_*.py): the demo run's config under tmp_path."""

from __future__ import annotations

from pathlib import Path

from privcode.config import PipelineConfig, load_config


def report_config(tmp_path: Path, *overrides: str) -> PipelineConfig:
    """The default config as run ``demo``, its runs and reports under ``tmp_path``, plus
    ``overrides`` (``--set`` strings, e.g. ``"run.stages=[data, base, report]"``)."""
    return load_config(
        None,
        [
            f"run.out_dir={tmp_path / 'runs'}",
            f"run.reports_dir={tmp_path / 'reports'}",
            "run.name=demo",
            *overrides,
        ],
    )
