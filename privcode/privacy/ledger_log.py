"""The privacy store ledger's log: its entries, its formats, and loading it with every check.
Design notes: docs/privacy.md, "privcode/privacy/ledger_log.py".

Files in the store: ``ledger.wal`` (:mod:`privcode.privacy.wal`; entries ``header``, ``budget``,
``admit``, ``grant``, ``finish``, ``import``, ``chain``, ``move``, each with ``seq``, the writer's
``epoch`` and ``prev_hash``), ``ledger.head`` (its length and last hash), ``jobs/<job>.fps`` (a
job's ``per_record`` identities, written before its ``admit``), ``groups/`` (a snapshot of the
record groups at a WAL position), ``lock`` (the one writer's ``flock``, held for its life) and
``epoch`` (bumped by each writer on start). Invariants: an entry is fsynced before its call
returns (a crash only over-counts); a truncated, replaced or deleted log is a refusal, never a
fresh budget; a writer re-reads the epoch before and after every append and fails closed once
another took over. :func:`load_log` reads and checks a log, its chain and head and writes
nothing; :class:`~privcode.privacy.ledger.StoreLedger` replays it.

"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from privcode.dp.accounting import make_accountant
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError, LedgerUnavailableError
from privcode.privacy.groups import RecordGroups
from privcode.privacy.store import (
    FINGERPRINT_BYTES,
    JOBS_DIR,
    PAC_DIR,
    SNAPSHOT_DIR,
    PrivacyStore,
)
from privcode.privacy.wal import (
    LogContents,
    check_head,
    genesis_hash,
    read_head,
    read_log,
    verify_chain,
)

log = logging.getLogger("privcode.ledger")

__all__ = [
    "RECORD_ENTRIES",
    "WAL_FORMAT",
    "WAL_NAME",
    "Budget",
    "JobEntry",
    "LoadedLog",
    "admission_reply",
    "load_log",
    "over_cap",
    "pack_fingerprints",
    "read_snapshot",
]

WAL_NAME = "ledger.wal"
#: The log's header format: 3 since jobs carry several identities per record
#: (``per_record`` in ``admit`` and ``import`` entries); a format 2 log (one
#: fingerprint per record) is still read and appended to.
WAL_FORMAT = 3
_READ_FORMATS = (2, 3)
#: Entries naming a ``jobs/<job>.fps`` file of records that joins the record groups.
RECORD_ENTRIES = ("admit", "import", "pac-records")
_ENTRY_TYPES = {
    "header",
    "budget",
    "admit",
    "grant",
    "finish",
    "import",
    "pac-records",
    "pac-open",
    "pac-raise",
    "pac-lease",
    "chain",
    "move",
}


def pack_fingerprints(fingerprints: list[bytes]) -> bytes:
    """Distinct fingerprints, sorted and concatenated (what :meth:`StoreLedger.admit` takes)."""
    fps = sorted(set(fingerprints))
    if any(len(fp) != FINGERPRINT_BYTES for fp in fps):
        raise AccountingError(f"a record fingerprint must be {FINGERPRINT_BYTES} bytes")
    return b"".join(fps)


@dataclass(frozen=True)
class Budget:
    """A store's budget: every record's epsilon at ``delta`` under ``accountant`` stays <= it."""

    epsilon: float
    delta: float
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        e, d = self.epsilon, self.delta
        if isinstance(e, bool) or not isinstance(e, int | float) or not math.isfinite(e) or e <= 0:
            raise AccountingError(f"epsilon budget must be a finite number > 0, got {e!r}")
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 < d < 1:
            raise AccountingError(f"delta must be a number in (0, 1), got {d!r}")
        make_accountant(self.accountant)
        object.__setattr__(self, "epsilon", float(e))
        object.__setattr__(self, "delta", float(d))

    def to_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "accountant": self.accountant}


@dataclass
class JobEntry:
    """A job as the log knows it: its admission, its grants, whether it finished."""

    run: str
    run_key: str
    plan: DPEvent
    records: int
    budget: float
    cap: float | None = None  #: the job's own epsilon cap (train.epsilon), None: the budget's
    #: The admitted data's keyed digest (``PrivacyStore.dataset_id_of``); '': not bound.
    dataset: str = ""
    granted: int = 0
    finished: bool = False
    requests: set[str] = field(default_factory=set)

    def committed(self) -> tuple[DPEvent, ...]:
        """What the job may have released: its plan while running, its grants once done."""
        steps = self.granted if self.finished else max(self.granted, self.plan.steps)
        return (DPEvent(self.plan.noise_multiplier, self.plan.sample_rate, steps),) if steps else ()


def _check_entry(record: dict[str, Any], index: int) -> None:
    kind = record.get("type")
    if index == 0:
        if kind != "header" or record.get("format") not in _READ_FORMATS:
            raise ValueError(f"not a privacy store ledger (format {_READ_FORMATS}) header")
        return
    if kind not in _ENTRY_TYPES - {"header"}:
        raise ValueError(f"unexpected entry type {kind!r}")
    if not isinstance(record.get("seq"), int) or not isinstance(record.get("epoch"), int):
        raise ValueError("entry without an integer seq and epoch")
    if kind in ("admit", "grant", "finish", "pac-records") and not isinstance(
        record.get("job"), str
    ):
        raise ValueError("entry without a job")


@dataclass
class LoadedLog:
    """A store's log as :func:`load_log` checked it."""

    contents: LogContents | None
    legacy_entries: int = 0  # its first entries, written before the hash chain
    lag: int = 0  # entries its head is behind (a crash between an append and the head)
    head: dict[str, Any] | None = None
    create: bool = False  # a store from before identity files that never logged

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.contents.records if self.contents else []


def load_log(store: PrivacyStore) -> LoadedLog:
    """Read and check a store's log, chain and head; writes nothing.

    :class:`LedgerUnavailableError` naming what is missing or damaged: the log
    gone, a line corrupt, a broken link (an entry removed or changed, the log
    of another store), a head missing or disagreeing with the log (a
    truncated or replaced log). A store from before the chain (no identity,
    no head, no ``prev_hash``) is accepted for migration (``store.legacy``).
    """
    wal, head_path = store.wal_path, store.head_path
    fix = (
        f"Nothing may train on this store: restore the file from a backup (`privcode budget "
        f"verify --store {store.root}` lists every problem); deleting or truncating it grants "
        "no budget"
    )
    if not wal.exists():
        if store.legacy and not store.present() & {JOBS_DIR, SNAPSHOT_DIR, PAC_DIR}:
            return LoadedLog(None, create=True)
        raise LedgerUnavailableError(f"the ledger's log {wal} is missing. {fix}")
    contents = read_log(wal, _check_entry)
    if not contents.records:
        if store.legacy and not store.present() & {JOBS_DIR, SNAPSHOT_DIR, PAC_DIR}:
            return LoadedLog(contents, create=True)  # only a torn header: nothing was logged
        raise LedgerUnavailableError(f"the ledger's log {wal} holds no complete entry. {fix}")
    try:
        legacy = verify_chain(contents, genesis_hash(store.store_id))
    except ValueError as why:
        raise LedgerUnavailableError(
            f"the hash chain of the ledger {wal} is broken: {why}. {fix}"
        ) from None
    chained = legacy < len(contents.records)
    try:
        head = read_head(head_path)
    except ValueError as why:
        raise LedgerUnavailableError(
            f"the ledger's head {head_path} is damaged ({why}). {fix}"
        ) from None
    if head is None:
        if store.legacy and not chained:
            return LoadedLog(contents, legacy_entries=legacy)
        raise LedgerUnavailableError(
            f"the ledger's head {head_path} is missing: the length of its log {wal} cannot be "
            f"checked. {fix}"
        )
    if not chained and not store.legacy:
        raise LedgerUnavailableError(
            f"the ledger's log {wal} carries no hash chain, but the store has been chained: "
            f"an older copy of the log was put back. {fix}"
        )
    try:
        lag = check_head(head, contents)
    except ValueError as why:
        raise LedgerUnavailableError(
            f"the ledger's log {wal} disagrees with its head {head_path}: {why}. {fix}"
        ) from None
    return LoadedLog(contents, legacy_entries=legacy, lag=lag, head=head)


def read_snapshot(
    store: PrivacyStore, records: list[dict[str, Any]]
) -> tuple[RecordGroups, int] | None:
    """The snapshot and the log lines it covers, if it is of a prefix of this log."""
    try:
        found = store.read_groups()
        if found is None:
            return None
        state, index = found
        n = int(state["wal_records"])
        jobs = {e["job"] for e in records[1:n] if e["type"] in RECORD_ENTRIES}
        if not 0 < n <= len(records) or set(state["jobs"]) != jobs:
            raise ValueError("it is not of this log")
        if state.get("format", 1) == 1 and any(e.get("per_record", 1) > 1 for e in records[1:n]):
            raise ValueError("single fingerprints for jobs with identities (an older writer)")
        return RecordGroups.from_state(state, index), n
    except (ValueError, KeyError, TypeError, AccountingError) as exc:
        log.warning("record-group snapshot unusable (%s); rebuilding from the jobs", exc)
        return None


def over_cap(events: list[DPEvent], budget: Budget, cap: float | None) -> dict | None:
    """A refusal when the job's own events alone exceed its cap (``train.epsilon``)."""
    if cap is None:
        return None
    acc = make_accountant(budget.accountant)
    for e in events:
        acc.compose(e)
    own = acc.epsilon(budget.delta)
    if own <= float(cap) * (1 + 1e-9):
        return None
    return {
        "admitted": False,
        "message": (
            f"this job alone is epsilon {own:.4g} (delta {budget.delta:g}, {budget.accountant}), "
            f"over its train.epsilon {float(cap):g}: a job is held to min(train.epsilon, what "
            "the store has left); set train.noise_multiplier 0 to calibrate, or fewer steps"
        ),
        "budget": budget.to_dict(),
    }


def admission_reply(adm: Any, budget: Budget) -> dict:
    w = adm.worst
    return {
        "admitted": bool(adm.fits),
        "message": adm.message(),
        "records": adm.records,
        "new_records": adm.new_records,
        "epsilon_spent": w.epsilon,
        "epsilon_after": w.epsilon_after,
        "epsilon_left": max(0.0, budget.epsilon - w.epsilon),
        "budget": budget.to_dict(),
    }
