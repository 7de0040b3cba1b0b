"""The privacy store's ledger: one writer per store, per-record budgets, fail-closed.
Design notes: docs/privacy.md, "privcode/privacy/ledger.py".

Every private update asks the store's ledger (one named Ray actor per store,
:mod:`privcode.privacy.ledger_actor`); it keeps :class:`~privcode.privacy.groups.RecordGroups`.
A job is

1. admitted (:meth:`StoreLedger.admit`) only if ``epsilon(events(G) + plan) <= budget`` for the
   worst group G met; the plan is then reserved for its records;
2. granted steps one by one (:meth:`StoreLedger.reserve`): within the plan covered by the
   admission, past it (a recomputed step: a second release) only if it fits every group of the job;
3. finished (:meth:`StoreLedger.finish`): committed events become what was granted; no more steps.

Files and log checks: :mod:`privcode.privacy.ledger_log`. Metrics (tag ``store``):
``privcode_epsilon_spent``, ``privcode_epsilon_budget``, ``privcode_dp_steps``. The ledger sees
fingerprints and numbers only, and logs aggregates only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from privcode.dp.events import DPEvent
from privcode.errors import AccountingError, LedgerConflictError, LedgerUnavailableError
from privcode.privacy.authority import verify_grant
from privcode.privacy.groups import RecordGroups, merge_events
from privcode.privacy.identities import SCHEME, pack_identities, unpack_identities
from privcode.privacy.ledger_log import (
    RECORD_ENTRIES,
    WAL_FORMAT,
    WAL_NAME,
    Budget,
    JobEntry,
    LoadedLog,
    admission_reply,
    load_log,
    over_cap,
    pack_fingerprints,
    read_snapshot,
)
from privcode.privacy.ledger_pac import PacLedger
from privcode.privacy.ledger_reading import LedgerReading
from privcode.privacy.pac_budgets import PacBudgets
from privcode.privacy.store import (
    FINGERPRINT_BYTES,
    PrivacyStore,
)
from privcode.privacy.wal import (
    append_line,
    genesis_hash,
    legacy_digest,
    repair,
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


class StoreLedger(PacLedger, LedgerReading):
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
        self._jobs: dict[str, JobEntry] = {}
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
            self._jobs[e["job"]] = JobEntry(
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
        snap = read_snapshot(self._store, records)
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
        run_key: str = "",
    ) -> dict:
        """Would a job with ``plan`` fit on these records? Nothing is written.

        ``fingerprints``: the records' identities, ``per_record`` of 16 bytes each
        (:func:`~privcode.privacy.identities.pack_identities`; 1: fingerprints).
        ``run_key``: the question :meth:`admit` of that run would answer, which first
        finishes the run's unfinished job (its reservation counts only its grants).
        """
        b = self._settle_budget(Budget(**budget), explicit, "", write=False)
        event = DPEvent.from_dict(plan)
        if over := over_cap([event], b, cap):
            return over
        groups = self._groups if self._budget is not None else RecordGroups(b.accountant, b.delta)
        assert groups is not None
        held = {
            k: j
            for k, j in self._jobs.items()
            if run_key and j.run_key == run_key and not j.finished
        }
        try:  # as admit() would see them once it finished the run's earlier job
            for k, j in held.items():
                groups.set_events(k, JobEntry(**{**vars(j), "finished": True}).committed())
            ids = unpack_identities(fingerprints, per_record)
            adm = groups.admission(ids, [event], b.epsilon)
        finally:
            for k, j in held.items():
                groups.set_events(k, j.committed())
        return admission_reply(adm, b)

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
        if over := over_cap([event], b, cap):
            return over
        for job_id, job in list(self._jobs.items()):
            if run_key and job.run_key == run_key and not job.finished:
                self.finish(job_id, "superseded by a new job of the same run")
        fps = unpack_identities(fingerprints, per_record)
        assert self._groups is not None
        adm = self._groups.admission(fps, [event], b.epsilon)
        reply = admission_reply(adm, b)
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
            if (capped := over_cap([new], self._budget, j.cap)) is not None:
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

    def _deny(self, job: JobEntry | None, reason: str) -> dict:
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

    def finish_run(self, run_key: str, reason: str = "") -> dict:
        """Finish every unfinished job of ``run_key`` (its grants stay spent); :meth:`run_spent`."""
        for job_id, j in list(self._jobs.items()):
            if run_key and j.run_key == run_key and not j.finished:
                self.finish(job_id, reason)
        return self.run_spent(run_key)

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
