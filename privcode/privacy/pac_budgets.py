"""PAC deployment budgets in the privacy store: per set of worlds, within one per record.

A PAC curator (:mod:`privcode.pac.curator`) charges ``b`` nats per private
token against its deployment budget, and its state (the secret world, the
posterior, the charges) lives under ``pac/<worlds id>/`` in the store or in a
directory of its own (:mod:`privcode.serve.pac_ledger`). The
store's ledger records, in the same log and through the same one writer:

* ``pac-open`` the first time a curator of a set of worlds starts, before it
  serves: the worlds' keyed id, their training dataset's opaque id, m, b,
  the scope and the deployment budget it may spend (its allowance). Every
  later start of those worlds (a restart, a new replica, a re-run of the pac
  stage that reproduces them) gets the same allowance back and is told the
  worlds were served, so a missing curator state fails closed instead of
  drawing a fresh secret with a full budget;
* ``pac-records``: the records a set of worlds is trained on (their keyed
  identities, :mod:`privcode.privacy.identities`), logged once per dataset
  before the worlds train. They join the store's record groups
  (:mod:`privcode.privacy.groups`) as a member with no DP event, so a record
  is known to PAC as it is to DP-SGD: by its exact text, its code up to
  layout, its training row and its MinHash bands, across corpora;
* every record's PAC budget, ``record_budget`` nats: the first allowance asked
  for on the store. A record's PAC spend is the sum of the allowances of
  every set of worlds trained on data holding it (through any identity), and
  worlds are opened only if, for every record group their data meets,
  ``held(G) + allowance <= record_budget``; so retraining the worlds, or
  training new ones on a re-ingested, reformatted or overlapping corpus,
  never resets what the records have paid;
* ``pac-raise``: a higher allowance (and record budget), only through
  ``privcode budget raise --pac WORLDS``, with who and why;
* ``pac-lease``: ``nats`` of the allowance handed to one running curator
  (its ``holder`` id), logged BEFORE the curator spends them
  (:mod:`privcode.pac.leases`). The ledger is the high-water mark of what
  was spent: with ``L = sum of every lease of the worlds`` and ``A`` their
  allowance, a lease is granted only up to ``A - L``, and a curator that
  starts counts all of ``L`` as spent (its own ``curator.json`` cannot
  lower it: restoring an older one rolls nothing back). Since every private
  step is paid from a lease, ``b * (private steps, all curators, all time)
  <= L <= A``. Leases are also the fencing between replicas (the ledger
  has one writer; ``flock`` on a shared volume does not hold across
  nodes): the first lease of a new holder makes it the worlds' holder and
  every earlier holder is refused from then on, so two curators overlap by
  at most the one block the older one still holds. A lease also carries
  the holder's private steps so far; fewer steps than an earlier lease
  reported means a curator state older than one the ledger saw (a
  restored copy: its posterior misses releases), which is refused. A
  lease re-sent after the ledger actor restarted may be logged twice: that
  only over-counts (fail closed).

PAC leakage composes additively in mutual information over deployments on
the same data, which is why the allowances of the worlds a record trained add up. Pure
state: :class:`~privcode.privacy.ledger.StoreLedger` logs and persists it.

The dataset is named by its records, not by a file's bytes
(:func:`records_dataset_id`): ``pd-`` + a keyed HMAC over the SORTED,
DISTINCT record fingerprints the store already computes
(:meth:`~privcode.privacy.store.PrivacyStore.record_fingerprints`, canonical
texts). The id names the deployment's data; the accounting is per record
(``pac-records``). Worlds of data never registered (a store from before
per-record accounts, a curator started on worlds without their records)
are held to their own dataset id alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from privcode.errors import LedgerConflictError

__all__ = ["PacBudgets", "records_dataset_id"]

_RTOL = 1e-9


@dataclass
class _Worlds:
    dataset: str
    m: int
    b: float
    scope: str
    allowance: float
    leased: float = 0.0  #: nats of every lease, all holders (what counts as spent)
    holder: str = ""  #: the curator holding the worlds now ("" before the first lease)
    steps: int = 0  #: the most private steps a holder reported
    holders: set[str] = field(default_factory=set)  #: every holder ever


def records_dataset_id(store: Any, records: Iterable[tuple[str, str]]) -> str:
    """The PAC dataset id of ``(prompt, code)`` records (module docstring): same set, same id."""
    fps = sorted(set(store.record_fingerprints(records)))
    return "pd-" + store.opaque("pac-dataset", len(fps).to_bytes(8, "big") + b"".join(fps))


class PacBudgets:
    """Allowances per worlds id, one budget per record (module docstring).

    ``overlaps``, where asked: for each record group the worlds' data meets, the
    datasets trained on records of that group (the ledger reads them off its
    record groups; :meth:`StoreLedger._pac_overlaps`); None: the dataset alone.
    """

    def __init__(self) -> None:
        self.worlds: dict[str, _Worlds] = {}
        self.record_budget: float | None = None
        self.members: dict[str, str] = {}  #: dataset -> its member in the record groups
        self.datasets: dict[str, str] = {}  #: member -> dataset

    def apply(self, e: dict[str, Any]) -> None:
        """Replay one ``pac-*`` log entry."""
        if e["type"] == "pac-records":
            self.members[e["dataset"]], self.datasets[e["job"]] = e["job"], e["dataset"]
        elif e["type"] == "pac-open":
            self.worlds[e["worlds"]] = _Worlds(
                e["dataset"], int(e["m"]), float(e["b"]), e["scope"], float(e["allowance"])
            )
            self._at_least(e.get("record_budget", e.get("dataset_budget")))
        elif e["type"] == "pac-raise":
            self.worlds[e["worlds"]].allowance = float(e["allowance"])
            self._at_least(e.get("record_budget", e.get("dataset_budget")))
        elif e["type"] == "pac-lease":
            w = self.worlds[e["worlds"]]
            w.leased += float(e["nats"])
            w.holder = e["holder"]
            w.holders.add(e["holder"])
            w.steps = max(w.steps, int(e["steps"]))

    def _at_least(self, nats: Any) -> None:
        # A log from before per-record accounts kept one budget per dataset: the largest
        # becomes every record's (each was the first allowance asked, or raised on record).
        if nats is not None:
            self.record_budget = max(self.record_budget or 0.0, float(nats))

    def held(self, datasets: frozenset[str], but: str = "") -> float:
        """Nats allowed to every set of worlds (``but`` one) trained on one of ``datasets``."""
        return sum(
            w.allowance for k, w in self.worlds.items() if w.dataset in datasets and k != but
        )

    def worst_held(self, overlaps: list[frozenset[str]], but: str = "") -> float:
        return max((self.held(d, but) for d in overlaps), default=0.0)

    def open(
        self,
        worlds: str,
        dataset: str,
        m: int,
        b: float,
        scope: str,
        budget: float,
        overlaps: list[frozenset[str]] | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(entry to log or None, reply) for a curator of ``worlds`` asking for ``budget`` nats."""
        known = self.worlds.get(worlds)
        if known is not None:
            if (known.m, known.b, known.scope) != (m, b, scope):
                raise LedgerConflictError(
                    f"PAC worlds {worlds} were served with m={known.m}, b={known.b:g}, scope "
                    f"{known.scope}; this curator asks for m={m}, b={b:g}, scope {scope}"
                )
            if budget > known.allowance * (1 + _RTOL):
                raise LedgerConflictError(
                    f"PAC worlds {worlds} may spend {known.allowance:g} nats; this curator asks "
                    f"for {budget:g}. A deployment budget is raised only on record: `privcode "
                    f"budget raise --pac {worlds} --nats N --who NAME --why REASON`"
                )
            return None, {"served_before": True, "allowance": min(budget, known.allowance)}
        limit = budget if self.record_budget is None else self.record_budget
        held = self.worst_held(overlaps or [frozenset({dataset})])
        if budget > (limit - held) * (1 + _RTOL):
            raise LedgerConflictError(
                f"every record's PAC budget is {limit:g} nats; {held:g} of them are held, for "
                "some records of these worlds' training data, by earlier worlds trained on "
                f"them (this data, or a copy, a reformat or an overlap of it); these worlds ask "
                f"for {budget:g}. Retraining the worlds does not reset what the records have "
                "paid: lower pac.deployment_budget, or raise it on record (`privcode budget "
                f"raise --pac {worlds} --nats N --who NAME --why REASON`)"
            )
        entry = {
            "type": "pac-open",
            "worlds": worlds,
            "dataset": dataset,
            "m": m,
            "b": b,
            "scope": scope,
            "allowance": budget,
            "record_budget": limit,
        }
        return entry, {"served_before": False, "allowance": budget}

    def lease(
        self, worlds: str, nats: float, holder: str, steps: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(entry to log or None, reply): up to ``nats`` more for curator ``holder``.

        Granted ``min(nats, A - L)`` (0 when spent). An entry is logged when
        something is granted or the holder changes (the new one fences the
        old). Refused: unknown worlds, a fenced holder, a rolled-back state.
        """
        w = self.worlds.get(worlds)
        if w is None:
            raise LedgerConflictError(f"no PAC worlds {worlds!r} were opened on this store")
        if not (0 < len(holder) <= 64 and nats >= 0 and steps >= 0):
            raise LedgerConflictError("a PAC lease needs a holder id (1-64 chars), nats >= 0")
        if holder != w.holder and holder in w.holders:
            raise LedgerConflictError(
                f"another curator took PAC worlds {worlds} over: this one may spend nothing more"
            )
        if steps < w.steps:
            raise LedgerConflictError(
                f"this curator of PAC worlds {worlds} reports {steps} private steps, a state of "
                f"them already reported {w.steps}: its state is an older copy (restored or "
                "shared); refusing it (its posterior misses released tokens)"
            )
        grant = max(0.0, min(nats, w.allowance - w.leased))
        reply = {"granted": grant, "leased": w.leased + grant, "allowance": w.allowance}
        if grant <= 0 and holder == w.holder:
            return None, reply
        entry = {
            "type": "pac-lease",
            "worlds": worlds,
            "nats": grant,
            "holder": holder,
            "steps": int(steps),
        }
        return entry, reply

    def raise_entry(
        self, worlds: str, nats: float, who: str, why: str, overlaps: list[frozenset[str]]
    ) -> dict[str, Any]:
        """The ``pac-raise`` entry making ``worlds``' allowance ``nats`` (never lower), and
        every record's budget at least what the records of its data then hold."""
        w = self.worlds.get(worlds)
        if w is None:
            raise LedgerConflictError(f"no PAC worlds {worlds!r} were ever served from this store")
        if not nats > w.allowance:
            raise LedgerConflictError(f"{nats:g} nats does not raise the allowance {w.allowance:g}")
        if not who.strip() or not why.strip():
            raise LedgerConflictError("a budget raise must say who raises it and why")
        need = self.worst_held(overlaps, but=worlds) + nats
        return {
            "type": "pac-raise",
            "worlds": worlds,
            "allowance": nats,
            "record_budget": max(self.record_budget or 0.0, need),
            "who": who[:200],
            "why": why[:500],
        }

    def show(self) -> list[dict[str, Any]]:
        return [
            {
                "worlds": k,
                "m": w.m,
                "b": w.b,
                "scope": w.scope,
                "allowance_nats": w.allowance,
                "leased_nats": w.leased,
                "record_budget_nats": self.record_budget,
                "records_registered": w.dataset in self.members,
            }
            for k, w in self.worlds.items()
        ]
