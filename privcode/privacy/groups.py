"""Per-record privacy accounting: records grouped by the jobs that trained on them.
Design notes: docs/privacy.md, "privcode/privacy/groups.py".

A record's loss composes the DP events of every job that trained on any record of its component
(:mod:`privcode.privacy.components`: records sharing a keyed identity, transitively). Records of
components touched by exactly the same jobs have the same loss, so the state is

    index:  identity -> component            (every identity ever trained on)
    comps:  component -> group id, records   (records: distinct exact identities)
    groups: group id  -> frozenset of jobs   (the distinct sets of jobs)
    jobs:   job id    -> its committed DP events

and a question costs one composition per distinct group met, never one per record. A job with
plan P on records R fits when ``epsilon(events(G) + P) <= budget`` for every group G of the
components-to-be C(r) of R; admitting merges each C(r) into group ``jobs(C(r)) | {job}``; a step
is allowed only if every group holding the job stays within the budget
(:meth:`RecordGroups.check_step`). Committed events: planned while the job runs, granted once it
finished. Pure state, no I/O: the ledger persists it (snapshot :data:`SNAPSHOT_FORMAT`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privcode.dp.accounting import make_accountant
from privcode.dp.events import DPEvent
from privcode.errors import AccountingError
from privcode.privacy.components import IdentityIndex, Linked
from privcode.privacy.identities import EXACT, as_identities, keys_of
from privcode.privacy.store import FINGERPRINT_BYTES

__all__ = ["SNAPSHOT_FORMAT", "Admission", "GroupCharge", "RecordGroups", "merge_events"]

#: The record-group snapshot: 2 = identities and components (1: one fingerprint per record).
SNAPSHOT_FORMAT = 2
_EPS_CACHE = 4096  # (group, events) -> epsilon evaluations kept
_LEGACY_ENTRY = FINGERPRINT_BYTES + 4  # format 1: fingerprint, group id (big-endian)


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
        self._index = IdentityIndex()
        self._groups: list[frozenset[str]] = [frozenset()]  # id 0: never trained on
        self._ids: dict[frozenset[str], int] = {frozenset(): 0}
        self._jobs: dict[str, tuple[DPEvent, ...]] = {}
        self._sizes: np.ndarray | None = None  # group id -> records (cached)
        self._of_job: dict[str, set[int]] = {}  # job -> ids of the groups holding it
        self._eps: dict[tuple[frozenset[str], tuple[DPEvent, ...]], float] = {}

    # -- reading ----------------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, tuple[DPEvent, ...]]:
        return dict(self._jobs)

    @property
    def records(self) -> int:
        """Distinct records trained on (by exact identity)."""
        return self._index.records

    def _sizes_now(self) -> np.ndarray:
        if self._sizes is None:
            self._sizes = self._index.sizes(len(self._groups))
        return self._sizes

    def _resolve(self, records: Any) -> tuple[Linked, np.ndarray, list[frozenset[str]]]:
        """(the records linked to the index, each label's group id, the groups by id).

        One record per exact identity. A label touching components of several
        groups gets the union of their jobs; a union no group holds yet gets a
        temporary id past the stored ones.
        """
        keys = keys_of(as_identities(records))
        if len(keys):
            keys = keys[np.sort(np.unique(keys[:, EXACT], return_index=True)[1])]
        linked = self._index.link(keys)
        width = len(self._groups) + 1
        pair = np.unique(linked.touched_label * width + self._index.cgid[linked.touched])
        lab, gid = pair // width, pair % width  # sorted by label
        label_gid = np.zeros(linked.n_labels, np.int64)
        label_gid[lab] = gid
        sets, extra = list(self._groups), {}
        several = np.flatnonzero(np.bincount(lab, minlength=linked.n_labels) > 1)
        starts = np.searchsorted(lab, several).tolist()
        ends = np.searchsorted(lab, several, side="right").tolist()
        for label, a, b in zip(several.tolist(), starts, ends, strict=True):
            jobs = frozenset().union(*(sets[g] for g in gid[a:b].tolist()))
            g = self._ids.get(jobs, extra.get(jobs))
            if g is None:
                g = extra[jobs] = len(sets)
                sets.append(jobs)
            label_gid[label] = g
        return linked, label_gid, sets

    def group_counts(self, records: Any) -> Counter[frozenset[str]]:
        """How many of ``records`` (distinct) are in each group (their components' jobs)."""
        linked, label_gid, sets = self._resolve(records)
        per = np.bincount(label_gid[linked.labels], minlength=len(sets))
        return Counter({sets[g]: int(n) for g, n in enumerate(per.tolist()) if n})

    def groups(self) -> Counter[frozenset[str]]:
        """Every group that holds records, with their number."""
        sizes = self._sizes_now().tolist()
        return Counter({self._groups[g]: n for g, n in enumerate(sizes) if n})

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

    def admission(self, records: Any, planned: Sequence[DPEvent], budget: float) -> Admission:
        """Whether a job with ``planned`` events fits on these records (records x 0 cost)."""
        counts = self.group_counts(records)
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
        sizes = self._sizes_now()
        return Counter(
            {self._groups[g]: int(sizes[g]) for g in self._of_job.get(job, ()) if sizes[g]}
        )

    def check_step(self, job: str, events: Sequence[DPEvent], budget: float) -> GroupCharge | None:
        """The worst group of ``job`` over ``budget`` if its committed events became ``events``.

        ``events`` replaces the job's committed events (a running job's grants
        so far plus the step it asks for, or its plan, whichever dominates):
        every record in a component it trained on must stay within ``budget``.
        None: within.
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

    def _gid(self, members: frozenset[str]) -> int:
        """The id of a set of jobs, made when new."""
        gid = self._ids.get(members)
        if gid is None:
            gid = self._ids[members] = len(self._groups)
            self._groups.append(members)
            for member in members:
                self._of_job.setdefault(member, set()).add(gid)
        return gid

    def add_job(self, job: str, records: Any, events: Sequence[DPEvent]) -> None:
        """Record that ``job`` trains on these records, committing ``events`` (its plan).

        Each component-to-be C(r) of its records becomes one component in group
        ``jobs(C(r)) | {job}`` (module docstring).
        """
        if job in self._jobs:
            raise AccountingError(f"job {job!r} is already recorded")
        ids = as_identities(records)  # AccountingError before anything changes
        self._jobs[job] = merge_events(events)
        if not len(ids):
            return
        linked, label_gid, sets = self._resolve(ids)
        distinct = np.unique(label_gid)
        joined = np.array([self._gid(sets[g] | {job}) for g in distinct.tolist()], np.int64)
        self._index.merge(linked, joined[np.searchsorted(distinct, label_gid)])
        self._sizes = None

    def set_events(self, job: str, events: Sequence[DPEvent]) -> None:
        """Replace ``job``'s committed events (a grant, or its grants once it has finished)."""
        if job not in self._jobs:
            raise AccountingError(f"unknown job {job!r}")
        self._jobs[job] = merge_events(events)

    # -- persistence --------------------------------------------------------------

    def index_bytes(self) -> bytes:
        """The index (:meth:`IdentityIndex.to_bytes`: identities, components, groups)."""
        return self._index.to_bytes()[0]

    def state(self) -> dict[str, Any]:
        """Everything but the index, as JSON (groups by id, jobs' committed events, the
        index's shape)."""
        _, keys, comps = self._index.to_bytes()
        return {
            "format": SNAPSHOT_FORMAT,
            "accountant": self.accountant,
            "delta": self.delta,
            "groups": [sorted(g) for g in self._groups],
            "jobs": {j: [e.to_dict() for e in ev] for j, ev in self._jobs.items()},
            "index_keys": keys,
            "components": comps,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], index: bytes) -> RecordGroups:
        """The inverse of :meth:`state` and :meth:`index_bytes` (ValueError when damaged);
        a format 1 snapshot (one fingerprint per record) is read too."""
        out = cls(state["accountant"], state["delta"])
        out._groups = [frozenset(g) for g in state["groups"]]
        if not out._groups or out._groups[0]:
            raise ValueError("group 0 must be the empty group")
        out._ids = {g: i for i, g in enumerate(out._groups)}
        if len(out._ids) != len(out._groups):
            raise ValueError("duplicate groups")
        out._jobs = {j: tuple(DPEvent.from_dict(e) for e in ev) for j, ev in state["jobs"].items()}
        for gid, members in enumerate(out._groups):
            for member in members:
                out._of_job.setdefault(member, set()).add(gid)
        if any(job not in out._jobs for g in out._groups for job in g):
            raise ValueError("a group names a job that does not exist")
        fmt = state.get("format", 1)
        if fmt == 1:
            out._index = out._legacy_index(index)
        elif fmt == SNAPSHOT_FORMAT:
            out._index = IdentityIndex.from_bytes(
                index, int(state["index_keys"]), int(state["components"]), len(out._groups)
            )
        else:
            raise ValueError(f"unknown snapshot format {fmt!r}")
        return out

    def _legacy_index(self, index: bytes) -> IdentityIndex:
        """A format 1 index (fingerprint, group id): each fingerprint one record; two equal
        in their first 64 bits are one record in the union of their groups."""
        if len(index) % _LEGACY_ENTRY:
            raise ValueError("index length is not a whole number of entries")
        rows = np.frombuffer(index, np.uint8).reshape(-1, _LEGACY_ENTRY)
        keys = keys_of(rows[:, None, :FINGERPRINT_BYTES])[:, 0]
        gids = np.ascontiguousarray(rows[:, FINGERPRINT_BYTES:]).view(">u4")[:, 0].astype(np.int64)
        if len(gids) and gids.max() >= len(self._groups):
            raise ValueError("index names a group that does not exist")
        uniq, inv = np.unique(keys, return_inverse=True)
        joined = np.zeros(len(uniq), np.int64)
        joined[inv] = gids
        for u in np.flatnonzero(np.bincount(inv) > 1).tolist():
            jobs = frozenset().union(*(self._groups[g] for g in gids[inv == u].tolist()))
            joined[u] = self._gid(jobs)
        return IdentityIndex.from_fingerprints(uniq, joined)
