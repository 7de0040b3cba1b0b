"""The ``privacy`` (private state kept across runs) and ``report`` sections."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class PrivacyConfig:
    """Where the private state that outlives runs lives (keys; never released)."""

    store: str = opt(
        "",
        "Privacy store directory (0700; PRIVCODE_PRIVACY_STORE overrides): "
        "the secret key of opaque dataset ids. '' = 'privacy-store' beside "
        "run.out_dir. Never mounted where generated code runs; no make "
        "target deletes it.",
    )


@dataclass(frozen=True)
class ReportConfig:
    """The run report."""

    title: str = opt("privcode run report", "Title of the report.")
    plots: bool = opt(True, "Write PNG plots next to report.md.")
