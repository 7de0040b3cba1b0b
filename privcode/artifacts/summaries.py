"""Typed stage summaries: what a stage's ``run`` returns and its manifest keeps.

A stage that declares ``summary_type`` (:attr:`privcode.pipeline.stage.Stage.
summary_type`) has its summary checked by the runner before the manifest is
written (a renamed or missing key fails the stage, not a later report) and
again before the stage is skipped as current (a manifest of another shape
makes it run). Its report section reads the record's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privcode.artifacts.nondp import NondpSummary
from privcode.artifacts.privacy import DPOutcome, _decode_curve
from privcode.artifacts.record import ArtifactError, JsonRecord, nested

__all__ = [
    "AuditSummary",
    "DPBound",
    "DataSummary",
    "EvalSummary",
    "PacSummary",
    "SynthSummary",
    "TrainSummary",
]


@dataclass(frozen=True)
class TrainSummary(DPOutcome):
    """The train stage's summary: the release's public privacy numbers, and where things are.

    The privacy fields are the release's (:class:`~privcode.artifacts.privacy.
    DPOutcome`); ``data_path`` and ``privacy_store`` are paths in private
    storage (the run summary and the report never print them),
    ``train_seconds`` the stage's wall clock (one number per run, not per step).
    """

    conditioning: str
    adjacency: str
    adapter: str
    train_seconds: float
    data_path: str
    privacy_store: str
    public_heldout_loss_curve: tuple[tuple[int, float | None], ...] = field(
        default=(), metadata=nested(_decode_curve, lambda c: [list(p) for p in c])
    )
    #: The DP engine's mode record (absent from summaries written before it was kept).
    training_mode: dict[str, Any] = field(default_factory=dict)
    #: The worst epsilon among the job's records, composed over every DP job of the
    #: privacy store that trained on them (None: non-private, or written before the store).
    record_epsilon: float | None = None
    #: The privacy store's per-record epsilon budget that admitted the job.
    record_budget: float | None = None
    #: Steps the ledger granted the job (above steps_taken after a restart) and why
    #: training stopped: private (they reveal restarts), never in privacy.json.
    ledger_steps: int | None = None
    stop_reason: str = ""
    #: The keyed id of the privacy store that charged the job (privacy.store_id).
    store_id: str = ""

    @property
    def reason_not_private(self) -> str | None:
        """Why the DP engine trained without privacy (None for a DP run)."""
        return None if self.dp else str(self.training_mode.get("reason") or self.method)


@dataclass(frozen=True)
class SynthSummary(JsonRecord):
    """The synth stage's summary: the Stage II funnel, verdict counts and the source release.

    ``generated = removed_execution + removed_roundtrip + removed_duplicate +
    kept`` (checked when the stage finishes). ``release`` and ``work_dir`` are
    paths in private storage; ``epsilon``/``delta`` the release's, inherited by
    post-processing (null for a non-DP release, which ``privacy_warning`` names).
    """

    generated: int
    removed_execution: int
    removed_roundtrip: int
    removed_duplicate: int
    kept: int
    shards: int
    shards_resumed: int
    shards_written: int
    generated_this_run: int
    rates: dict[str, Any]
    execution_statuses: dict[str, Any]
    seconds: float
    samples_per_second: float | None
    release: str
    release_sha256: str
    synthetic_sha256: str
    work_dir: str
    conditioning: str
    method: str
    dp: bool
    epsilon: float | None
    delta: float | None
    privacy_warning: str | None
    #: The isolation levels the verdicts ran under ({"isolation": {level: snippets},
    #: "notes": [...]}: notes name a weaker sandbox than the full one).
    sandbox: dict[str, Any] = field(default_factory=dict)
    #: Per operator pool of this run (generate, extract, execution, roundtrip): rows,
    #: busy_s, rows_per_actor_s, rows_per_cpu_s, rows_per_s, peak_actors, cpus_per_actor
    #: (:mod:`privcode.synth.telemetry`; empty when every shard was resumed).
    operators: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        removed = self.removed_execution + self.removed_roundtrip + self.removed_duplicate
        if removed + self.kept != self.generated:
            raise ValueError(
                f"the funnel does not add up: {removed} removed + {self.kept} "
                f"kept != {self.generated} generated"
            )
        if not self.dp and not self.privacy_warning:
            raise ValueError("synthetic data from a non-DP release needs its privacy_warning")


@dataclass(frozen=True)
class DataSummary(JsonRecord):
    """The data stage's summary: un-noised counts of the private corpus (owner-only report)
    and the sha256 of each file it wrote (private storage)."""

    counts: dict[str, Any]
    files: dict[str, Any]
    #: An ingested corpus: where its inputs stood (re-ingest when it changes) and the spec.
    inputs_state: str | None = None
    ingest: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSummary(JsonRecord):
    """The eval stage's summary: the benchmark and, per model, pass@k or why it was skipped."""

    benchmark: str
    benchmark_file: str
    limit: int
    models: dict[str, Any]


@dataclass(frozen=True)
class PacSummary(JsonRecord):
    """The pac stage's summary: settings and aggregates of the m worlds (never a record)."""

    m: int
    top_k: int
    utility: dict[str, Any]
    leakage: dict[str, Any]
    canary_emission: dict[str, Any] | None
    budget: dict[str, Any]
    seconds: float
    worlds: dict[str, Any]
    worlds_dir: str


@dataclass(frozen=True)
class DPBound(JsonRecord):
    """The junior release's (epsilon, delta) and the membership-inference TPR it allows.

    ``tpr_at_1pct_fpr = min(e^eps 0.01 + delta, 1 - e^-eps (0.99 - delta))``
    (the hypothesis-testing bound of (epsilon, delta)-DP).
    """

    epsilon: float
    delta: float
    tpr_at_1pct_fpr: float


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ArtifactError(f"{where}: not a list of names")
    return tuple(value)


def _optional(record: type[JsonRecord]) -> dict[str, Any]:
    """Metadata of an optional nested record (null when absent)."""
    return nested(
        lambda v, where: None if v is None else record.from_json(v, where),
        lambda r: None if r is None else r.to_json(),
    )


@dataclass(frozen=True)
class AuditSummary(JsonRecord):
    """The audit stage's summary (``audit.json``): aggregates only, per model and audit.

    ``models[name]`` holds that model's audits (``canaries``, ``exposure``,
    ``mia``, ``probe``: rates, counts, AUCs, bits); ``fidelity`` the synthetic
    data's aggregates when it was audited; ``dp_bound`` the junior's ceiling;
    ``nondpft_training`` the public settings of the non-DP comparison when
    one was audited (its ``models`` entry is marked ``non_private``).
    """

    models: dict[str, Any]
    audits: tuple[str, ...] = field(metadata=nested(_names, list))
    seconds: float
    fidelity: dict[str, Any] | None = None
    dp_bound: DPBound | None = field(default=None, metadata=_optional(DPBound))
    nondpft_training: NondpSummary | None = field(default=None, metadata=_optional(NondpSummary))

    def __post_init__(self) -> None:
        if self.nondpft_training is not None and "nondpft" not in self.models:
            raise ValueError("nondpft_training without a nondpft model audited")
