"""PAC deployment budgets in the privacy store: per set of worlds, within one per record.
Design notes: docs/privacy.md, "privcode/privacy/pac_budgets.py".

A PAC curator (:mod:`privcode.pac.curator`) charges ``b`` nats per private token against its
worlds' allowance ``A``. The store's ledger logs, through the same one writer: ``pac-open``
(first start, before serving, fixing the allowance; later starts get it back and are told the
worlds were served, so a lost curator state fails closed), ``pac-records`` (the worlds' records,
the identities DP uses, joining the record groups with no DP event), ``pac-raise`` (on record
only) and ``pac-lease`` (nats handed to one curator BEFORE it spends them,
:mod:`privcode.pac.leases`). With ``record_budget`` the first allowance asked for on the store
and ``L`` every lease of the worlds:

    held(G) + A <= record_budget   for every record group G their data meets
    b * (private steps, all curators, all time) <= L <= A

A starting curator counts all of ``L`` as spent; a new holder's first lease fences every earlier
one; a lease reporting fewer steps than an earlier one (a restored state) is refused. PAC leakage
adds up over deployments on the same data. Pure state: :class:`~privcode.privacy.ledger.StoreLedger`
logs it. Datasets are named by their records (:func:`records_dataset_id`).
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
