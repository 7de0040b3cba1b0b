"""The ``privacy`` (private state kept across runs) and ``report`` sections."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class PrivacyConfig:
    """Where the private state that outlives runs lives (keys; never released)."""

    store: str = opt(
        "",
        "Privacy store directory (0700; PRIVCODE_PRIVACY_STORE overrides): the "
        "per-record privacy ledger of every DP job and the secret key of record "
        "fingerprints and opaque ids. '' = ${XDG_DATA_HOME:-~/.local/share}/privcode/"
        "privacy-store. Made only by `privcode budget init`; never beside run.out_dir, "
        "never mounted where generated code runs; no make target deletes it.",
    )
    epsilon_budget: float = opt(
        0.0,
        "Per-record epsilon budget of the privacy store: every record's epsilon, "
        "composed over every DP job that trained on it (any run, directory or copy of "
        "the file), stays within it. Set once, by the store's first job; 0 = that job's "
        "train.epsilon. A higher value later is refused: only `privcode budget raise` "
        "raises it (logged with who and why); a lower one holds this run to it. The demo "
        "config sets 10: the demo and `make sweep` (1, 8) compose to 8.04 per record.",
        min=0,
    )
    delta: float = opt(
        0.0,
        "Delta of the per-record budget (set once with it); 0 = the first job's train.delta.",
        min=0,
        max=0.5,
    )
    store_id: str = opt(
        "",
        "The privacy store's keyed id (`privcode budget show`). Pinned by `privcode run`'s "
        "driver with the store's absolute path, so every task charges the store the run was "
        "admitted against; set it to refuse any other store. '' = whichever store resolves.",
    )
    run_key: str = opt(
        "",
        "The key of the reservation this run's train stage takes over (set by the privcode "
        "operator, which reserves the plan before any pod exists): the stage's admission "
        "replaces that reservation in one ledger call. '' = the run directory's key.",
    )


@dataclass(frozen=True)
class ReportConfig:
    """The run report."""

    title: str = opt("privcode run report", "Title of the report.")
    plots: bool = opt(True, "Write PNG plots next to report.md.")
