"""The PAC side of the store's ledger: records, allowances and leases of PAC worlds.

A mixin of :class:`~privcode.privacy.ledger.StoreLedger` (its one writer, its
log and its record groups); the state and the rules are
:class:`~privcode.privacy.pac_budgets.PacBudgets`'s, which documents them.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from privcode.errors import AccountingError, LedgerConflictError, LedgerUnavailableError
from privcode.privacy.identities import SCHEME, pack_identities, unpack_identities

if TYPE_CHECKING:
    from privcode.privacy.groups import RecordGroups
    from privcode.privacy.pac_budgets import PacBudgets
    from privcode.privacy.store import PrivacyStore

__all__ = ["PacLedger"]


class PacLedger:
    """PAC calls of the ledger; the host provides ``_fenced``, ``_append``, ``_granted``,
    ``_write_snapshot``, ``_store``, ``_groups`` and ``_pac``."""

    _pac: PacBudgets
    _groups: RecordGroups | None
    _store: PrivacyStore

    def _fenced(self) -> str | None:
        raise NotImplementedError

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _granted(self, grant: Any, **expected: Any) -> dict:
        raise NotImplementedError

    def _write_snapshot(self, groups: RecordGroups) -> None:
        raise NotImplementedError

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
