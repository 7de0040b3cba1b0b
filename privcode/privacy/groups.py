"""Per-record privacy accounting: records grouped by the jobs that trained on them.

A record's privacy loss is the composition of the DP events of every job
whose training set contained it, whatever run, directory or file copy the
job read it from (records are named by keyed fingerprints,
:meth:`privcode.privacy.store.PrivacyStore.record_fingerprints`). Records touched
by exactly the same jobs have the same loss, so the state is

    index:  fingerprint -> group id          (one entry per record ever trained on)
    groups: group id    -> frozenset of jobs (the distinct sets of jobs)
    jobs:   job id      -> its committed DP events

and a question about a training set costs one composition per distinct
group among its records, never one per record (nor records x jobs).

Admission of a job with planned events P on records R: for every group G
met in R (records never trained on form the empty group),
``epsilon(events(G) + P) <= budget`` under the store's accountant; the
worst group is the worst record. Admitting adds the job to the group of each
of its records (group G becomes G | {job}). A step of an admitted job is
allowed only if every group holding the job stays within the budget with it
(:meth:`RecordGroups.check_step`).

A job's committed events are its planned ones while it runs (admission
reserves them, so concurrent jobs on overlapping records cannot together be
admitted past the budget) and its granted ones once it has finished.

Pure state, no I/O, no Ray: the store's ledger (:mod:`privcode.privacy.ledger`)
persists it (:meth:`RecordGroups.index_bytes`, :meth:`RecordGroups.from_state`)
and serialises every change.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from privcode.dp.accounting import make_accountant
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError
from privcode.privacy.store import FINGERPRINT_BYTES

__all__ = ["Admission", "GroupCharge", "RecordGroups", "merge_events"]

_EPS_CACHE = 4096  # (group, events) -> epsilon evaluations kept
_ENTRY = struct.Struct(f">{FINGERPRINT_BYTES}sI")  # fingerprint, group id


def merge_events(events: Iterable[DPEvent]) -> tuple[DPEvent, ...]:
    """``events`` with equal (sigma, q) summed: the same composition, fewer terms."""
    steps: dict[tuple[float, float], int] = {}
    for e in events:
        key = (e.noise_multiplier, e.sample_rate)
        steps[key] = steps.get(key, 0) + e.steps
    return tuple(DPEvent(sigma, q, n) for (sigma, q), n in steps.items())


@dataclass(frozen=True)
class GroupCharge:
    """One distinct group met in a set of records: its jobs, size, and epsilon."""

    jobs: frozenset[str]
    records: int
    epsilon: float  # spent by the group's jobs (0 for never-trained records)
    epsilon_after: float  # with the planned (or requested) events added


@dataclass(frozen=True)
class Admission:
    """The answer to "may a job with these events train on these records?"."""

    fits: bool
    budget: float
    delta: float
    accountant: str
    records: int
    new_records: int  # records no job has trained on yet
    planned: tuple[DPEvent, ...]
    groups: tuple[GroupCharge, ...] = field(default=())  # worst first

    @property
    def worst(self) -> GroupCharge:
        return self.groups[0]

    def message(self) -> str:
        """What a refused (or admitted) job is told: aggregates over records, never a record."""
        w = self.worst
        adds = w.epsilon_after - w.epsilon
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"the worst of the {self.records} training records has spent epsilon "
            f"{w.epsilon:.4g} of the budget {self.budget:g} (delta {self.delta:g}, "
            f"{self.accountant}; {len(w.jobs)} earlier job(s) trained on it); this job would "
            f"add {adds:.4g} (to {w.epsilon_after:.4g}), which {verdict}; "
            f"{max(0.0, self.budget - w.epsilon):.4g} is left for it"
        )


class RecordGroups:
    """The per-record accounting state (module docstring). Not thread-safe: one writer."""

    def __init__(self, accountant: str = "rdp", delta: float = 1e-5) -> None:
        make_accountant(accountant)  # validates the name
        self.accountant, self.delta = accountant, float(delta)
        self._index: dict[bytes, int] = {}
        self._groups: list[frozenset[str]] = [frozenset()]  # id 0: never trained on
        self._ids: dict[frozenset[str], int] = {frozenset(): 0}
        self._jobs: dict[str, tuple[DPEvent, ...]] = {}
        self._sizes: Counter[int] = Counter()  # group id -> records in it
        self._of_job: dict[str, set[int]] = {}  # job -> ids of the groups holding it
        self._eps: dict[tuple[frozenset[str], tuple[DPEvent, ...]], float] = {}

    # -- reading ----------------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, tuple[DPEvent, ...]]:
        return dict(self._jobs)

    @property
    def records(self) -> int:
        return len(self._index)

    def group_counts(self, fingerprints: Iterable[bytes]) -> Counter[frozenset[str]]:
        """How many of ``fingerprints`` (distinct) are in each group."""
        get, counts = self._index.get, Counter()
        for gid in map(get, set(fingerprints)):
            counts[0 if gid is None else gid] += 1
        return Counter({self._groups[g]: n for g, n in counts.items()})

    def groups(self) -> Counter[frozenset[str]]:
        """Every group that holds records, with their number."""
        return Counter({self._groups[g]: n for g, n in self._sizes.items() if n})

    def events_of(self, jobs: Iterable[str]) -> tuple[DPEvent, ...]:
        """The committed events of ``jobs`` (merged), in job order."""
        return merge_events(e for job in sorted(jobs) for e in self._jobs[job])

    def epsilon(self, jobs: frozenset[str], extra: Sequence[DPEvent] = ()) -> float:
        """Epsilon of a record trained on by ``jobs``, with ``extra`` events added."""
        events = merge_events((*self.events_of(jobs), *extra))
        if not events:
            return 0.0
        key = (jobs, events)
        if key not in self._eps:
            if len(self._eps) > _EPS_CACHE:
                self._eps.clear()
            acc = make_accountant(self.accountant)
            for e in events:
                acc.compose(e)
            self._eps[key] = float(acc.epsilon(self.delta))
        return self._eps[key]

    def charges(
        self, counts: Mapping[frozenset[str], int], extra: Sequence[DPEvent] = ()
    ) -> tuple[GroupCharge, ...]:
        """Each group's epsilon now and with ``extra``, worst (after) first."""
        out = [
            GroupCharge(jobs, n, self.epsilon(jobs), self.epsilon(jobs, extra))
            for jobs, n in counts.items()
        ]
        return tuple(sorted(out, key=lambda c: (-c.epsilon_after, -c.records, sorted(c.jobs))))

    def admission(
        self, fingerprints: Iterable[bytes], planned: Sequence[DPEvent], budget: float
    ) -> Admission:
        """Whether a job with ``planned`` events fits on these records (records x 0 cost)."""
        counts = self.group_counts(fingerprints)
        if not counts:
            raise AccountingError("admission of an empty training set")
        groups = self.charges(counts, planned)
        return Admission(
            fits=groups[0].epsilon_after <= budget,
            budget=float(budget),
            delta=self.delta,
            accountant=self.accountant,
            records=sum(counts.values()),
            new_records=counts.get(frozenset(), 0),
            planned=merge_events(planned),
            groups=groups,
        )

    def groups_of_job(self, job: str) -> Counter[frozenset[str]]:
        """The groups holding ``job`` (and records), with their sizes; no scan of the others."""
        sizes = self._sizes
        return Counter({self._groups[g]: sizes[g] for g in self._of_job.get(job, ()) if sizes[g]})

    def check_step(self, job: str, events: Sequence[DPEvent], budget: float) -> GroupCharge | None:
        """The worst group of ``job`` over ``budget`` if its committed events became ``events``.

        ``events`` replaces the job's committed events (a running job's grants
        so far plus the step it asks for, or its plan, whichever dominates):
        every record it trained on must stay within ``budget``. None: within.
        """
        groups = self.groups_of_job(job)
        before = {g: self.epsilon(g) for g in groups}
        saved, self._jobs[job] = self._jobs[job], merge_events(events)
        try:
            after = {g: self.epsilon(g) for g in groups}
        finally:
            self._jobs[job] = saved
        over = [
            GroupCharge(g, n, before[g], after[g]) for g, n in groups.items() if after[g] > budget
        ]
        return max(over, key=lambda c: c.epsilon_after) if over else None

    # -- writing ----------------------------------------------------------------

    def add_job(self, job: str, fingerprints: Iterable[bytes], events: Sequence[DPEvent]) -> None:
        """Record that ``job`` trains on these records, committing ``events`` (its plan)."""
        if job in self._jobs:
            raise AccountingError(f"job {job!r} is already recorded")
        fps = set(fingerprints)
        if any(len(fp) != FINGERPRINT_BYTES for fp in fps):
            raise AccountingError(f"a fingerprint must be {FINGERPRINT_BYTES} bytes")
        self._jobs[job] = merge_events(events)
        moved: dict[int, int] = {}
        index, ids, groups, sizes = self._index, self._ids, self._groups, self._sizes
        for fp in fps:
            old = index.get(fp)
            if old is None:
                old = 0
            else:
                sizes[old] -= 1
            new = moved.get(old)
            if new is None:
                members = groups[old] | {job}
                new = ids.get(members)
                if new is None:
                    new = ids[members] = len(groups)
                    groups.append(members)
                    for member in members:
                        self._of_job.setdefault(member, set()).add(new)
                moved[old] = new
            index[fp] = new
            sizes[new] += 1

    def set_events(self, job: str, events: Sequence[DPEvent]) -> None:
        """Replace ``job``'s committed events (a grant, or its grants once it has finished)."""
        if job not in self._jobs:
            raise AccountingError(f"unknown job {job!r}")
        self._jobs[job] = merge_events(events)

    # -- persistence --------------------------------------------------------------

    def index_bytes(self) -> bytes:
        """The index as sorted fixed-size entries (fingerprint, group id)."""
        return b"".join(_ENTRY.pack(fp, g) for fp, g in sorted(self._index.items()))

    def state(self) -> dict[str, Any]:
        """Everything but the index, as JSON (groups by id, jobs' committed events)."""
        return {
            "accountant": self.accountant,
            "delta": self.delta,
            "groups": [sorted(g) for g in self._groups],
            "jobs": {j: [e.to_dict() for e in ev] for j, ev in self._jobs.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], index: bytes) -> RecordGroups:
        """The inverse of :meth:`state` and :meth:`index_bytes` (ValueError when damaged)."""
        out = cls(state["accountant"], state["delta"])
        out._groups = [frozenset(g) for g in state["groups"]]
        if not out._groups or out._groups[0]:
            raise ValueError("group 0 must be the empty group")
        out._ids = {g: i for i, g in enumerate(out._groups)}
        if len(out._ids) != len(out._groups):
            raise ValueError("duplicate groups")
        out._jobs = {j: tuple(DPEvent.from_dict(e) for e in ev) for j, ev in state["jobs"].items()}
        if len(index) % _ENTRY.size:
            raise ValueError("index length is not a whole number of entries")
        out._index = dict(_ENTRY.iter_unpack(index))
        out._sizes = Counter(out._index.values())
        for gid, members in enumerate(out._groups):
            for member in members:
                out._of_job.setdefault(member, set()).add(gid)
        n = len(out._groups)
        if any(g >= n for g in out._index.values()):
            raise ValueError("index names a group that does not exist")
        if any(job not in out._jobs for g in out._groups for job in g):
            raise ValueError("a group names a job that does not exist")
        return out
