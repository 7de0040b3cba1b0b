"""The privacy record of a junior release (``privacy.json``): :class:`PrivacyRecord`.

What a Stage I release says about its guarantee, DP outputs and public settings
only: epsilon from the run's ledger (under the enforcing accountant and both
RDP and PRV), delta, the released DP events (``history``: (sigma, q, steps)
and nothing else), C, q, the expected batch size qN, N (public under the
accounting), the step counts, the training mode of the DP engine, an opaque
dataset id, the objective, and the loss curve on PUBLIC held-out code. Step
times, per-step batch sizes, private losses, gradient norms and any digest of
the data are never in it (:data:`NOT_RELEASED`).

A record with ``dp`` false (the DP engine's non-private mode) has null epsilons
and says ``NOT_PRIVATE``; ``dp`` true needs a finite epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privcode.artifacts.record import ArtifactError, JsonRecord, nested
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError

__all__ = ["ADJACENCY", "NOT_RELEASED", "DPOutcome", "PrivacyRecord", "released_history"]

#: What privacy.json says about the neighbouring relation the guarantee is for.
ADJACENCY = {
    "relation": "add/remove one record",
    "record": "one (prompt, code) training record, truncated to train.max_length tokens",
    "public": "the number of records N, hence the sample rate q = B/N and the expected batch "
    "size qN, is treated as public and released; each step's realised batch size is "
    "private (the noisy sum is divided by qN, not by it)",
    # TF Privacy's max_examples_per_user: admission refuses a record in several rows.
    "max_rows_per_record": 1,
}
#: How the privacy store admitted the job (the per-record composition across jobs).
ADMISSION = {
    "accountant": "the job's accountant (RDP unless train.accountant says prv), at delta",
    "composition": "each record's epsilon composes the DP events of every job that trained on "
    "it or on a record sharing one of its keyed identities (the exact text, the code up to "
    "layout, the training row after truncation, a MinHash band at ingest's Jaccard 0.85), "
    "transitively; a job is admitted when the worst record stays within the store's budget. The "
    "composition treats the sequence of jobs as fixed in advance (non-adaptive): jobs chosen "
    "after seeing earlier releases would need an RDP privacy filter at a fixed order, which "
    "the store does not implement",
    "cap": "the job's own epsilon is held to min(train.epsilon, what the store has left)",
}
#: What privacy.json says is deliberately left out.
NOT_RELEASED = (
    "step times, per-step batch sizes, losses, gradient norms, clip and non-finite "
    "counts, restart counts, steps the ledger granted beyond those released, why training "
    "stopped, ledger grant ids, other jobs on the same records and any digest of the "
    "training data stay in private storage"
)
ASSUMPTIONS = (
    "add/remove-one-record DP with Poisson sampling; N (hence q) is "
    "treated as public; the curve is the loss on PUBLIC held-out code."
)
NOT_PRIVATE_NOTE = "trained WITHOUT differential privacy (audits only)"


def released_history(grants: list[dict[str, Any]]) -> tuple[DPEvent, ...]:
    """The DP events of the ledger's grants, consecutive equal (sigma, q) merged.

    Exactly (sigma, q, steps) per event: no time (a step's duration depends on
    its private batch), no sequence number, request id or restart count.
    Merging ``k`` grants of one step into one event of ``k`` steps composes to
    the same epsilon.
    """
    out: list[DPEvent] = []
    for g in grants:
        sigma, q, steps = float(g["noise_multiplier"]), float(g["sample_rate"]), int(g["steps"])
        if out and out[-1].noise_multiplier == sigma and out[-1].sample_rate == q:
            out[-1] = DPEvent(sigma, q, out[-1].steps + steps)
        else:
            out.append(DPEvent(sigma, q, steps))
    return tuple(out)


def _decode_history(value: Any, where: str) -> tuple[DPEvent, ...]:
    if not isinstance(value, list):
        raise ArtifactError(f"{where}: not a list of DP events")
    try:
        return tuple(DPEvent.from_dict(e) for e in value)
    except AccountingError as exc:
        raise ArtifactError(f"{where}: {exc}") from None


def _decode_curve(value: Any, where: str) -> tuple[tuple[int, float | None], ...]:
    """``[[step, loss or null], ...]``: the loss on public held-out code per checkpoint."""
    ok = isinstance(value, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], int)
        and (p[1] is None or isinstance(p[1], int | float))
        for p in value
    )
    if not ok:
        raise ArtifactError(f"{where}: not a list of [step, loss] pairs")
    return tuple((int(s), None if v is None else float(v)) for s, v in value)


@dataclass(frozen=True)
class DPOutcome(JsonRecord):
    """The public numbers of one Stage I training: epsilon, the DP-SGD settings, the counts.

    Shared by the release's :class:`PrivacyRecord` and the train stage's
    summary (:class:`privcode.artifacts.TrainSummary`).
    """

    dp: bool
    method: str
    epsilon: float | None
    epsilon_rdp: float | None
    epsilon_prv: float | None
    epsilon_budget: float
    delta: float
    accountant: str
    noise_multiplier: float
    noise_calibrated: bool
    max_grad_norm: float
    sample_rate: float
    expected_batch_size: int
    num_records: int
    steps_requested: int
    steps_taken: int
    num_workers: int
    dataset_id: str
    rng: str
    base_model: str

    @property
    def epsilon_by_accountant(self) -> dict[str, float | None]:
        return {"rdp": self.epsilon_rdp, "prv": self.epsilon_prv}


@dataclass(frozen=True)
class PrivacyRecord(DPOutcome):
    """``privacy.json`` (module docstring). Keys are the field names, but ``NOT_PRIVATE``."""

    FILE = "privacy.json"
    #: Keys of releases written before they left privacy.json (they said how many steps
    #: the ledger granted and why training stopped, which reveals restarts): read, dropped.
    LEGACY_KEYS = ("ledger_steps", "stop_reason")

    @classmethod
    def from_json(cls, obj: Any, where: str = "") -> PrivacyRecord:
        if isinstance(obj, dict) and any(k in obj for k in cls.LEGACY_KEYS):
            obj = {k: v for k, v in obj.items() if k not in cls.LEGACY_KEYS}
        return super().from_json(obj, where)

    training_mode: dict[str, Any]
    grad_sample_mode: str
    lora: dict[str, Any]
    objective: dict[str, Any]
    history: tuple[DPEvent, ...] = field(
        default=(), metadata=nested(_decode_history, lambda h: [e.to_dict() for e in h])
    )
    public_heldout_loss_curve: tuple[tuple[int, float | None], ...] = field(
        default=(), metadata=nested(_decode_curve, lambda c: [list(p) for p in c])
    )
    not_private: str | None = field(default=None, metadata={"key": "NOT_PRIVATE"})
    #: The keyed id of the privacy store that admitted and charged the job ('' before ids).
    store_id: str = ""
    adjacency: dict[str, Any] = field(default_factory=lambda: dict(ADJACENCY))
    admission: dict[str, Any] = field(default_factory=lambda: dict(ADMISSION))
    assumptions: str = ASSUMPTIONS
    not_released: str = NOT_RELEASED

    def __post_init__(self) -> None:
        if self.dp and self.epsilon is None:
            raise ValueError("dp is true but epsilon is null: a DP record needs its epsilon")
        if self.dp and self.not_private is not None:
            raise ValueError("dp is true but the record says NOT_PRIVATE")
        if not self.dp and self.not_private is None:
            object.__setattr__(self, "not_private", NOT_PRIVATE_NOTE)
        if not self.dp and self.epsilon is not None:
            raise ValueError("dp is false but epsilon is set: no guarantee has an epsilon")

    @property
    def reason_not_private(self) -> str | None:
        """Why the DP engine trained without privacy (None for a DP record)."""
        if self.dp:
            return None
        return str(self.training_mode.get("reason") or self.not_private)
