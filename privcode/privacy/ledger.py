"""The privacy store's ledger: one writer per store, per-record budgets, fail-closed.

Every private update asks the store's ledger, one named Ray actor per store
(:mod:`privcode.privacy.ledger_actor`: ``privcode-store:<store id>``, detached,
restarted without limit and rebuilt from the store on every start). It keeps the per-record state of
:class:`~privcode.privacy.groups.RecordGroups`: a record's epsilon is the
composition of the DP events of every job that trained on it, whatever run,
directory or copy of the file it came from. A job is

1. admitted (:meth:`StoreLedger.admit`) on the keyed fingerprints of its
   training records with its planned event ``(sigma, q, steps)``: only if
   ``epsilon(events(G) + plan) <= budget`` for the worst group G met; the
   plan is then reserved for those records, so concurrent jobs on
   overlapping data can never be admitted past the budget together;
2. granted steps one by one (:meth:`StoreLedger.reserve`); a step within the
   plan is covered by the admission, one past it (a recomputed step after a
   restart: a second release) must fit for every group of the job;
3. finished (:meth:`StoreLedger.finish`): its committed events become what
   was granted; no step is granted to a finished job again.

Files in the store (0700 directory, 0600 files, never in a run directory):

* ``ledger.wal``: the write-ahead log (:mod:`privcode.privacy.wal`), entries
  ``header``, ``budget`` (epsilon, delta, accountant: set by ``privcode
  budget init --epsilon`` or the first job, changed only by
  :meth:`StoreLedger.raise_budget`, which logs who and why), ``admit``,
  ``grant``, ``finish``, ``import``, ``chain`` (a log from before the hash
  chain, chained from here), ``move`` (the store moved on record); every
  entry carries ``seq``, the writer's ``epoch`` and ``prev_hash`` (the hash
  chain). An entry is fsynced before the call that made it returns: a crash
  can only over-count.
* ``ledger.head``: the log's length and last hash, rewritten (atomically)
  after every append; with the chain it turns a truncated, replaced or
  deleted log into a refusal (:func:`load_log`), never a fresh budget.
* ``jobs/<job>.fps``: a job's records, written (temporary name, fsync,
  rename, directory fsync) before its ``admit``: ``per_record`` identities of
  16 bytes each (:mod:`privcode.privacy.identities`; the entry names it, 1
  for a job logged before identities: its sorted fingerprints), records
  sorted by their exact identity.
* ``groups/``: a snapshot of the record groups at a WAL position, so a
  restart reads one index instead of every job's fingerprints.
* ``lock``: held with ``flock(LOCK_EX)`` by the one writer for its life;
  ``epoch``: bumped by each writer on start, with the lock held. A writer
  re-reads the epoch before and after every append and fails closed when
  another writer took over (a second cluster on the same volume, a stale
  actor after a network split): it never grants again, and its last line,
  if any, only over-counts. Replay applies every verified line in order.

Metrics (``ray.util.metrics``, tag ``store``): Gauges
``privcode_epsilon_spent`` (the worst record's epsilon) and
``privcode_epsilon_budget``, Counter ``privcode_dp_steps``. The ledger sees
fingerprints and numbers only, and logs aggregates only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from privcode.dp.accounting import ACCOUNTANTS, make_accountant
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError, LedgerConflictError, LedgerUnavailableError
from privcode.privacy.groups import RecordGroups, merge_events
from privcode.privacy.identities import SCHEME, pack_identities, unpack_identities
from privcode.privacy.pac_budgets import PacBudgets
from privcode.privacy.store import (
    FINGERPRINT_BYTES,
    JOBS_DIR,
    PAC_DIR,
    SNAPSHOT_DIR,
    PrivacyStore,
)
from privcode.privacy.wal import (
    LogContents,
    append_line,
    check_head,
    genesis_hash,
    legacy_digest,
    read_head,
    read_log,
    repair,
    verify_chain,
    write_chained,
    write_head,
)

__all__ = [
    "RECORD_ENTRIES",
    "WAL_NAME",
    "Budget",
    "LoadedLog",
    "StoreLedger",
    "load_log",
    "pack_fingerprints",
]

log = logging.getLogger("privcode.ledger")

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
class _Job:
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


class StoreLedger:
    """The ledger of one store (module docstring); :func:`open_ledger` runs it as an actor.

    Usable as a plain object in one process (tests, offline tools). Not
    thread-safe: Ray runs an actor's calls one at a time.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self._wal = self.root / WAL_NAME
        self._lock_fd = -1
        self._last_hash = ""  # the hash of the log's last entry (the next one's prev_hash)
        self._failed: str | None = None
        self._budget: Budget | None = None
        self._jobs: dict[str, _Job] = {}
        self._pac = PacBudgets()
        self._groups: RecordGroups | None = None
        self._seq = self._lines = 0
        self._worst = 0.0
        try:
            self._store = PrivacyStore(self.root)
            self._lock_fd = self._store.lock_writer()
            self._epoch = self._store.next_epoch()
            self._restore()
        except OSError as exc:
            self.close()
            raise LedgerUnavailableError(
                f"the privacy store {self.root} cannot be opened for writing: {exc}"
            ) from exc
        except BaseException:
            self.close()
            raise
        self._metrics = self._make_metrics()
        self._refresh()  # the gauges start at the restored state

    # -- the one writer ------------------------------------------------------------

    def _fenced(self) -> str | None:
        """Why this writer must stop (another took over), or None."""
        if self._failed:
            return self._failed
        try:
            now = self._store.read_epoch()
        except (OSError, LedgerUnavailableError) as exc:
            now, why = -1, str(exc)
        else:
            why = f"epoch {now}, this writer's is {self._epoch}"
        if now != self._epoch:
            self._failed = (
                f"another writer took over the privacy store {self.root} ({why}); this ledger "
                "grants nothing more"
            )
            log.error("%s", self._failed)
        return self._failed

    def close(self) -> None:
        """Release the store's lock (the actor's process exit does the same)."""
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Log one entry durably, fenced before and after; LedgerUnavailableError if refused."""
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        entry = {**record, "seq": self._seq + 1, "epoch": self._epoch, "time": time.time()}
        entry["prev_hash"] = self._last_hash
        try:
            digest = append_line(self._wal, entry)
        except OSError as exc:
            self._failed = f"the ledger {self._wal} could not be written ({exc})"
            raise LedgerUnavailableError(self._failed) from exc
        self._seq += 1
        self._lines += 1
        self._last_hash = digest
        try:  # after the entry: a crash between the two leaves the head one entry behind
            write_head(self._store.head_path, self._lines, digest)
        except OSError as exc:  # the entry is logged (over-counts); no further one may be
            self._failed = f"the ledger's head {self._store.head_path} could not be written ({exc})"
            raise LedgerUnavailableError(self._failed) from exc
        if why := self._fenced():  # taken over while writing: the line only over-counts
            raise LedgerUnavailableError(why)
        return entry

    # -- restore -------------------------------------------------------------------

    def _restore(self) -> None:
        """Rebuild from the store's log (:func:`load_log`: every check before any write)."""
        store = self._store
        loaded = load_log(store)
        if loaded.create:  # a store from before identity files that never logged
            store.write_identity(migration="pending")
            header = {"type": "header", "format": WAL_FORMAT, "created": time.time()}
            genesis = genesis_hash(store.store_id)
            write_chained(self._wal, [header], genesis, head=store.head_path)
            loaded = load_log(store)
        contents = loaded.contents
        assert contents is not None and contents.records  # load_log refused anything else
        records = contents.records
        for entry in records[1:]:
            self._apply(entry)
            self._seq = max(self._seq, entry["seq"])
        self._lines = len(records)
        self._last_hash = contents.hashes[-1]
        if self._budget is None and self._jobs:
            raise LedgerUnavailableError(f"the ledger {self._wal} records jobs but no budget")
        self._groups = self._load_groups(records)
        repair(contents)
        if loaded.lag:  # a crash between an append and its head: the entry is in the log
            write_head(store.head_path, self._lines, self._last_hash)
        if store.legacy:  # accepted once: its identity, and its log chained from here on
            if store.identity is None:
                store.write_identity(migration="pending")
            if loaded.legacy_entries == len(records):
                if loaded.head is None:
                    write_head(store.head_path, self._lines, self._last_hash)
                hashes = contents.hashes
                self._append(
                    {
                        "type": "chain",
                        "legacy_entries": len(records),
                        "legacy_sha256": legacy_digest(hashes),
                        "who": "the ledger, on its first open since the hash chain",
                    }
                )
                log.warning(
                    "privacy store %s: its log (%d entries) is from before the hash chain; "
                    "accepted once and chained from here on",
                    self.root,
                    len(records),
                )
            store.write_identity(migration=None, migrated=time.time())
            store.legacy = False
        self._refresh()

    def _apply(self, e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind == "budget":
            self._budget = Budget(e["epsilon"], e["delta"], e["accountant"])
        elif kind in ("admit", "import"):
            assert self._budget is not None
            self._jobs[e["job"]] = _Job(
                e.get("run", ""),
                e.get("run_key", ""),
                DPEvent.from_dict(e["plan"]),
                e["records"],
                float(e.get("budget", self._budget.epsilon)),
                None if e.get("cap") is None else float(e["cap"]),
                str(e.get("dataset", "")),
            )
            if kind == "import":  # a legacy run ledger: its grants, already finished
                job = self._jobs[e["job"]]
                job.granted, job.finished = e["plan"]["steps"], True
        elif kind == "grant":
            job = self._jobs[e["job"]]
            job.granted += e["steps"]
            job.requests.add(e["request_id"])
        elif kind == "finish":
            self._jobs[e["job"]].finished = True
        elif kind.startswith("pac-"):
            self._pac.apply(e)

    def _load_groups(self, records: list[dict[str, Any]]) -> RecordGroups:
        """The record groups: the snapshot, then every job admitted after it (their files)."""
        budget = self._budget or Budget(1.0, 1e-5)  # no budget yet: no job either
        snap = self._read_snapshot(records)
        groups, done = snap if snap else (RecordGroups(budget.accountant, budget.delta), 1)
        later = [e for e in records[done:] if e["type"] in RECORD_ENTRIES]
        for entry in later:
            blob = self._store.read_job_records(entry["job"], entry["fps_sha256"])
            groups.add_job(entry["job"], unpack_identities(blob, entry.get("per_record", 1)), ())
        for job_id, job in self._jobs.items():
            groups.set_events(job_id, job.committed())
        if later:
            self._write_snapshot(groups)
        return groups

    def _read_snapshot(self, records: list[dict[str, Any]]) -> tuple[RecordGroups, int] | None:
        """The snapshot and the log lines it covers, if it is of a prefix of this log."""
        try:
            found = self._store.read_groups()
            if found is None:
                return None
            state, index = found
            n = int(state["wal_records"])
            jobs = {e["job"] for e in records[1:n] if e["type"] in RECORD_ENTRIES}
            if not 0 < n <= len(records) or set(state["jobs"]) != jobs:
                raise ValueError("it is not of this log")
            if state.get("format", 1) == 1 and any(
                e.get("per_record", 1) > 1 for e in records[1:n]
            ):
                raise ValueError("single fingerprints for jobs with identities (an older writer)")
            return RecordGroups.from_state(state, index), n
        except (ValueError, KeyError, TypeError, AccountingError) as exc:
            log.warning("record-group snapshot unusable (%s); rebuilding from the jobs", exc)
            return None

    def _write_snapshot(self, groups: RecordGroups) -> None:
        self._store.write_groups(
            {**groups.state(), "wal_records": self._lines}, groups.index_bytes()
        )

    # -- metrics -------------------------------------------------------------------

    def _make_metrics(self) -> dict[str, Any] | None:
        """Gauges ``spent``/``budget`` and Counter ``steps`` (the actor's); none here."""
        return None

    @property
    def store_id(self) -> str:
        return self._store.ledger_id

    def _refresh(self, steps: int = 0, recompute: bool = True) -> None:
        """Recompute the worst record's epsilon (after admits and finishes; not for a step
        within its plan, which changes no commitment) and update the metrics."""
        g = self._groups
        if recompute and g is not None and self._budget is not None:
            self._worst = max((g.epsilon(jobs) for jobs in g.groups()), default=0.0)
        with contextlib.suppress(Exception):  # metrics must never block a grant
            m = getattr(self, "_metrics", None)
            if m is not None:
                m["spent"].set(self._worst)
                if self._budget is not None:
                    m["budget"].set(self._budget.epsilon)
                if steps:
                    m["steps"].inc(steps)

    # -- budget --------------------------------------------------------------------

    def _settle_budget(self, requested: Budget, explicit: bool, who: str, write: bool) -> Budget:
        """The budget a job is held to: the store's (set by the first job), or a stricter one.

        A job may ask for a lower epsilon than the store's (it is held to it); a
        higher one, another delta or another accountant is refused: only
        :meth:`raise_budget` changes the store's budget, and it logs who and why.
        """
        b = self._budget
        if b is None:
            if write:
                self._append(
                    {
                        "type": "budget",
                        **requested.to_dict(),
                        "who": who,
                        "why": "set by the first job on this store",
                    }
                )
                self._budget = requested
                self._groups = RecordGroups(requested.accountant, requested.delta)
            return requested
        if not explicit:
            return b
        if (requested.delta, requested.accountant) != (b.delta, b.accountant) or (
            requested.epsilon > b.epsilon
        ):
            raise LedgerConflictError(
                f"the privacy store's budget is epsilon {b.epsilon:g} at delta {b.delta:g} "
                f"({b.accountant}); this run asks for epsilon {requested.epsilon:g} at delta "
                f"{requested.delta:g} ({requested.accountant}). A budget is never raised by a "
                "config change: the data owner runs `privcode budget raise --epsilon E --who "
                "NAME --why REASON`"
            )
        return requested

    def budget_for(self, budget: dict, explicit: bool = False) -> dict:
        """The budget a job asking for ``budget`` is held to (a conflict raises); no write."""
        return self._settle_budget(Budget(**budget), explicit, "", write=False).to_dict()

    def _granted(self, grant: Any, **expected: Any) -> dict:
        """The message of ``grant``, signed by the store's authority for this store
        (:func:`privcode.privacy.authority.verify_grant`); the caller checks ``from``."""
        from privcode.privacy.authority import verify_grant

        public = self._store.read_identity().get("authority")  # fresh: `budget authority`
        return verify_grant(public, grant, store_id=self._store.store_id, **expected)

    def raise_budget(self, grant: dict) -> dict:
        """Raise the store's epsilon budget to the grant's ``to`` (logged with its ``who`` and
        ``why`` and signature); never lowers it. Only the store's authority signs a grant
        (:mod:`privcode.privacy.authority`): a job that reaches this ledger cannot raise."""
        if self._budget is None:
            raise LedgerConflictError("the store has no budget yet: the first job sets it")
        message = self._granted(grant, kind="records", **{"from": self._budget.epsilon})
        epsilon, who, why = float(message["to"]), str(message["who"]), str(message["why"])
        new = Budget(epsilon, self._budget.delta, self._budget.accountant)
        if new.epsilon <= self._budget.epsilon:
            raise LedgerConflictError(
                f"epsilon {new.epsilon:g} does not raise the budget {self._budget.epsilon:g}"
            )
        entry = {"type": "budget", **new.to_dict(), "who": who[:200], "why": why[:500]}
        self._append({**entry, "grant": grant["signature"]})
        self._budget = new
        self._refresh()
        return self.describe()

    # -- admission -----------------------------------------------------------------

    def admission(
        self,
        fingerprints: bytes,
        plan: dict,
        budget: dict,
        explicit: bool = False,
        cap: float | None = None,
        per_record: int = 1,
    ) -> dict:
        """Would a job with ``plan`` fit on these records? Nothing is written.

        ``fingerprints``: the records' identities, ``per_record`` of 16 bytes each
        (:func:`~privcode.privacy.identities.pack_identities`; 1: fingerprints).
        """
        b = self._settle_budget(Budget(**budget), explicit, "", write=False)
        event = DPEvent.from_dict(plan)
        if over := _over_cap([event], b, cap):
            return over
        groups = self._groups if self._budget is not None else RecordGroups(b.accountant, b.delta)
        assert groups is not None
        adm = groups.admission(unpack_identities(fingerprints, per_record), [event], b.epsilon)
        return _admission_reply(adm, b)

    def admit(
        self,
        fingerprints: bytes,
        plan: dict,
        budget: dict,
        *,
        explicit: bool = False,
        run: str = "",
        run_key: str = "",
        cap: float | None = None,
        per_record: int = 1,
        dataset: str = "",
    ) -> dict:
        """Admit a job on these records with its planned event, reserving it; or refuse.

        ``fingerprints`` and ``per_record``: as :meth:`admission`. ``dataset``: the SHA-256
        (hex) of the admitted file's bytes; the job's steps are granted only to a caller
        presenting it (:meth:`reserve`), and the log keeps its keyed id, not the digest.
        ``cap``: the job's own epsilon (``train.epsilon``): its plan, and every step
        it is granted, stays within min(cap, what the store has left for its records).
        A job of the same ``run_key`` (the same run directory) that never
        finished is finished first, at what it was granted: its driver is gone
        (or it is stopped now: a finished job gets no further step).
        """
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        event = DPEvent.from_dict(plan)
        b = self._settle_budget(Budget(**budget), explicit, f"first job ({run})", write=True)
        if over := _over_cap([event], b, cap):
            return over
        for job_id, job in list(self._jobs.items()):
            if run_key and job.run_key == run_key and not job.finished:
                self.finish(job_id, "superseded by a new job of the same run")
        fps = unpack_identities(fingerprints, per_record)
        assert self._groups is not None
        adm = self._groups.admission(fps, [event], b.epsilon)
        reply = _admission_reply(adm, b)
        if not adm.fits:
            return reply
        extra: dict[str, Any] = {"budget": b.epsilon}
        extra |= {} if cap is None else {"cap": float(cap)}
        if dataset:
            extra["dataset"] = self._store.dataset_id_of(dataset)
        job_id = self._add_job("admit", fps, event, run, run_key, **extra)
        self._write_snapshot(self._groups)
        self._refresh()
        return {**reply, "job": job_id}

    def _add_job(
        self, kind: str, fps: np.ndarray, event: DPEvent, run: str, run_key: str, **extra: Any
    ) -> str:
        """Keep a new job's records (their identities), log it, add it to the groups; its id."""
        job_id = uuid.uuid4().hex[:16]
        packed = pack_identities(fps)
        per_record = fps.shape[1]
        digest = self._store.write_job_records(job_id, packed)
        if per_record > 1:
            extra = {"per_record": per_record, "identities": SCHEME, **extra}
        entry = {
            "type": kind,
            "job": job_id,
            "run": run[:200],
            "run_key": run_key,
            "plan": event.to_dict(),
            "records": len(packed) // (per_record * FINGERPRINT_BYTES),
            "fps_sha256": digest,
            **extra,
        }
        self._append(entry)
        self._apply(entry)
        assert self._groups is not None
        self._groups.add_job(job_id, fps, self._jobs[job_id].committed())
        return job_id

    def import_legacy(
        self,
        fingerprints: bytes,
        events: list[dict],
        source: str,
        budget: dict,
        run: str = "",
        per_record: int = 1,
    ) -> dict:
        """Count a pre-store run ledger's grants on these records, once per ``source``."""
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        if any(j.run_key == f"import:{source}" for j in self._jobs.values()):
            return {"imported": 0}
        self._settle_budget(Budget(**budget), False, f"import ({run})", write=True)

        fps, count = unpack_identities(fingerprints, per_record), 0
        for event in merge_events(DPEvent.from_dict(e) for e in events):
            self._add_job("import", fps, event, run, f"import:{source}")
            count += event.steps
        if count and self._groups is not None:
            self._write_snapshot(self._groups)
            self._refresh(count)
        return {"imported": count}

    # -- steps ---------------------------------------------------------------------

    def reserve(
        self,
        job: str,
        noise_multiplier: float,
        sample_rate: float,
        steps: int = 1,
        request_id: str | None = None,
        dataset: str = "",
    ) -> dict:
        """Grant ``steps`` steps of an admitted job at its planned (sigma, q); all or nothing.

        A job admitted with its data's digest is granted steps only for that digest
        (``dataset``, hex SHA-256): a job id alone draws nothing.

        Returns ``{"granted", "position" (the job's steps granted so far),
        "reason"}``; a grant is in the fsynced log when this returns.
        ``request_id`` names one release (``"<incarnation>:<step>"``): a call Ray
        re-sends after an actor restart is answered from the log
        (``"duplicate": True``), never charged twice.
        """
        j = self._jobs.get(job)
        if j is None:
            return self._deny(None, f"job {job!r} was never admitted to this store")
        if request_id is not None and str(request_id) in j.requests:
            return {"granted": True, "position": j.granted, "reason": None, "duplicate": True}
        if why := self._fenced():
            return self._deny(j, why)
        if j.finished:
            return self._deny(j, "the job has finished: it is granted no further step")
        if j.dataset and not (dataset and self._store.dataset_id_of(dataset) == j.dataset):
            return self._deny(j, "the request does not present the admitted data's digest")
        try:
            event = DPEvent(noise_multiplier, sample_rate, steps)
        except AccountingError as exc:
            return self._deny(j, f"invalid request: {exc}")
        if (event.noise_multiplier, event.sample_rate) != (
            j.plan.noise_multiplier,
            j.plan.sample_rate,
        ):
            return self._deny(j, "the request's (sigma, q) is not the admitted plan's")
        total = j.granted + event.steps
        assert self._groups is not None
        if total > j.plan.steps:  # past the plan: every record of the job must still fit
            new = DPEvent(event.noise_multiplier, event.sample_rate, total)
            assert self._budget is not None
            if (capped := _over_cap([new], self._budget, j.cap)) is not None:
                return self._deny(j, capped["message"])
            try:
                over = self._groups.check_step(job, [new], j.budget)
            except Exception as exc:  # noqa: BLE001 - an accountant failure denies
                return self._deny(j, f"the accountant failed: {exc}")
            if over is not None:
                return self._deny(
                    j,
                    f"budget exhausted: a record this job trains on would reach epsilon "
                    f"{over.epsilon_after:.6g} > budget {j.budget:g}",
                )
        entry = {"type": "grant", "job": job, **event.to_dict()}
        entry["request_id"] = "" if request_id is None else str(request_id)
        try:
            self._append(entry)
        except LedgerUnavailableError as exc:
            return self._deny(j, str(exc))
        self._apply(entry)
        if total > j.plan.steps:
            self._groups.set_events(job, j.committed())
            self._refresh(event.steps)
        else:
            self._refresh(event.steps, recompute=False)
        return {"granted": True, "position": j.granted, "reason": None}

    def _deny(self, job: _Job | None, reason: str) -> dict:
        return {"granted": False, "position": job.granted if job else 0, "reason": reason}

    def finish(self, job: str, reason: str = "") -> dict:
        """End a job: its committed events become its grants. Returns :meth:`job_spent`."""
        j = self._jobs.get(job)
        if j is None:
            raise LedgerConflictError(f"job {job!r} was never admitted to this store")
        if not j.finished:
            self._append({"type": "finish", "job": job, "reason": reason[:200]})
            j.finished = True
            assert self._groups is not None
            self._groups.set_events(job, j.committed())
            self._refresh()
        return self.job_spent(job)

    def job_spent(self, job: str) -> dict:
        """A job's grants (its release's history) and the worst epsilon of its records."""
        j = self._jobs[job]
        assert self._groups is not None and self._budget is not None
        worst = max((self._groups.epsilon(g) for g in self._groups.groups_of_job(job)), default=0.0)
        granted = (
            DPEvent(j.plan.noise_multiplier, j.plan.sample_rate, j.granted) if j.granted else None
        )
        history = [granted.to_dict()] if granted else []
        return {
            "job": job,
            "run": j.run,
            "steps": j.granted,
            "finished": j.finished,
            "history": history,
            "record_epsilon": worst,
            "budget": self._budget.to_dict(),
        }

    # -- PAC deployments (privcode.privacy.pac_budgets) ---------------------------------

    def pac_records(self, dataset: str, fingerprints: bytes, per_record: int = 1) -> dict:
        """Register the records of PAC ``dataset`` (their identities, as :meth:`admit`'s),
        once, before worlds trained on them are served: they join the record groups with
        no DP event, and PAC allowances are then checked per record (pac_budgets)."""
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        if not dataset.startswith("pd-"):
            raise LedgerConflictError(f"{dataset!r} is not a PAC dataset id (pd-...)")
        if dataset in self._pac.members:
            return {"registered": False}
        fps = unpack_identities(fingerprints, per_record)
        if not len(fps):
            raise AccountingError("a PAC dataset of no records")
        member = "pac-" + uuid.uuid4().hex[:12]
        packed = pack_identities(fps)
        entry = {
            "type": "pac-records",
            "job": member,
            "dataset": dataset,
            "records": len(fps),
            "fps_sha256": self._store.write_job_records(member, packed),
            "per_record": fps.shape[1],
            "identities": SCHEME,
        }
        self._pac.apply(self._append(entry))
        assert self._groups is not None
        self._groups.add_job(member, fps, ())
        self._write_snapshot(self._groups)
        return {"registered": True}

    def _pac_overlaps(self, dataset: str) -> list[frozenset[str]]:
        """The datasets of every record group ``dataset``'s records are in (itself alone
        when its records were never registered)."""
        member = self._pac.members.get(dataset)
        if member is None or self._groups is None:
            return [frozenset({dataset})]
        names = self._pac.datasets
        return [
            frozenset(names[m] for m in group if m in names)
            for group in self._groups.groups_of_job(member)
        ]

    def pac_open(
        self, worlds: str, dataset: str, m: int, b: float, scope: str, budget: float
    ) -> dict:
        """A curator of ``worlds`` starts: its allowance, and whether they were served before."""
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        entry, reply = self._pac.open(
            worlds, dataset, int(m), float(b), scope, float(budget), self._pac_overlaps(dataset)
        )
        if entry is not None:  # logged before the curator serves anything
            self._pac.apply(self._append(entry))
        return reply

    def pac_served(self, worlds: str) -> bool:
        """Whether a curator of ``worlds`` ever started from this store."""
        return worlds in self._pac.worlds

    def pac_lease(self, worlds: str, nats: float, holder: str, steps: int = 0) -> dict:
        """Lease up to ``nats`` of ``worlds``' allowance to the curator ``holder`` (which has
        spent ``steps`` private steps), logged before it spends them (pac_budgets: leases)."""
        if why := self._fenced():
            raise LedgerUnavailableError(why)
        entry, reply = self._pac.lease(worlds, float(nats), str(holder), int(steps))
        if entry is not None:
            self._pac.apply(self._append(entry))
        return reply

    def pac_worlds_id(self, digest: bytes) -> str:
        """The keyed id of the worlds whose files hash to ``digest`` (for a PAC server that
        holds no store key: :func:`privcode.pac.ensemble.worlds_digest`)."""
        return "pw-" + self._store.opaque("pac-worlds", bytes(digest), 16)

    def pac_raise(self, grant: dict) -> dict:
        """Raise a set of worlds' deployment allowance (and its data's PAC budget) to the
        grant's ``to`` nats, on record; the grant as :meth:`raise_budget`'s."""
        worlds = (
            str((grant.get("message") or {}).get("worlds", "")) if isinstance(grant, dict) else ""
        )
        w = self._pac.worlds.get(worlds)
        current = w.allowance if w is not None else None
        message = self._granted(grant, kind="pac", worlds=worlds, **{"from": current})
        overlaps = self._pac_overlaps(w.dataset) if w is not None else []
        entry = self._pac.raise_entry(
            worlds, float(message["to"]), message["who"], message["why"], overlaps
        )
        self._pac.apply(self._append({**entry, "grant": grant["signature"]}))
        return {"worlds": worlds, "allowance_nats": entry["allowance"]}

    # -- reading -------------------------------------------------------------------

    def show(self) -> dict:
        """Budget, record groups (epsilon under every accountant), jobs: aggregates only."""
        b, g = self._budget, self._groups
        groups = []
        if b is not None and g is not None:
            for jobs, n in g.groups().items():
                by: dict[str, float | None] = {}
                for name in ACCOUNTANTS:
                    acc = make_accountant(name)
                    for e in g.events_of(jobs):
                        acc.compose(e)
                    try:
                        by[name] = float(acc.epsilon(b.delta)) if acc.steps else 0.0
                    except Exception:  # noqa: BLE001 - informative only
                        by[name] = None
                groups.append({"jobs": sorted(jobs), "records": n, "epsilon": by})
        groups.sort(key=lambda r: -(r["epsilon"].get(b.accountant if b else "rdp") or 0.0))
        jobs = [
            {
                "job": job_id,
                "run": j.run,
                "status": "finished" if j.finished else "running",
                "imported": j.run_key.startswith("import:"),
                "records": j.records,
                "plan": j.plan.to_dict(),
                "steps_granted": j.granted,
            }
            for job_id, j in self._jobs.items()
        ]
        return {
            "store": str(self.root),
            "store_id": self.store_id,
            "budget": b.to_dict() if b else None,
            "epsilon_spent": self._worst,
            "epsilon_left": max(0.0, b.epsilon - self._worst) if b else None,
            "records": g.records if g else 0,
            "groups": groups,
            "jobs": jobs,
            "pac": self._pac.show(),
        }

    def describe(self) -> dict:
        return {
            "root": str(self.root),
            "store_id": self.store_id,
            "epoch": self._epoch,
            "failed": self._failed,
            "budget": self._budget.to_dict() if self._budget else None,
            "jobs": len(self._jobs),
            "epsilon_spent": self._worst,
            "pid": os.getpid(),
            "metrics": self._metrics is not None,
        }

    def ping(self) -> str:
        return "ok"


def _over_cap(events: list[DPEvent], budget: Budget, cap: float | None) -> dict | None:
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


def _admission_reply(adm: Any, budget: Budget) -> dict:
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
