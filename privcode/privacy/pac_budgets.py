"""PAC deployment budgets in the privacy store: per set of worlds, within one per dataset.

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
* the dataset's PAC budget: the first allowance asked for on it. Worlds
  trained again on the same data (another secret, another posterior) share
  it: an allowance is granted only if it fits next to every earlier one, so
  retraining the worlds never resets what the data has paid;
* ``pac-raise``: a higher dataset budget or allowance, only through
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
the same data, which is why the allowances of one dataset add up. Pure
state: :class:`~privcode.privacy.ledger.StoreLedger` logs and persists it.

The dataset is named by its records, not by a file's bytes
(:func:`records_dataset_id`): ``pd-`` + a keyed HMAC over the SORTED,
DISTINCT record fingerprints the store already computes
(:meth:`~privcode.privacy.store.PrivacyStore.record_fingerprints`, canonical
texts). The same records in another order, file format, encoding or with
duplicates get the same id, hence the same PAC budget. A set hash is exact,
not a similarity: a corpus with one record more or less is another set
(another budget); sharing a budget across overlapping corpora needs
per-record PAC accounts (as the DP record groups do), not done here.
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
    """Allowances per worlds id and budgets per dataset (module docstring)."""

    def __init__(self) -> None:
        self.worlds: dict[str, _Worlds] = {}
        self.datasets: dict[str, float] = {}

    def apply(self, e: dict[str, Any]) -> None:
        """Replay one ``pac-*`` log entry."""
        if e["type"] == "pac-open":
            self.worlds[e["worlds"]] = _Worlds(
                e["dataset"], int(e["m"]), float(e["b"]), e["scope"], float(e["allowance"])
            )
            self.datasets.setdefault(e["dataset"], float(e["dataset_budget"]))
        elif e["type"] == "pac-raise":
            w = self.worlds[e["worlds"]]
            w.allowance = float(e["allowance"])
            self.datasets[w.dataset] = float(e["dataset_budget"])
        elif e["type"] == "pac-lease":
            w = self.worlds[e["worlds"]]
            w.leased += float(e["nats"])
            w.holder = e["holder"]
            w.holders.add(e["holder"])
            w.steps = max(w.steps, int(e["steps"]))

    def reserved(self, dataset: str, but: str = "") -> float:
        return sum(w.allowance for k, w in self.worlds.items() if w.dataset == dataset and k != but)

    def open(
        self, worlds: str, dataset: str, m: int, b: float, scope: str, budget: float
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
        dataset_budget = self.datasets.get(dataset, budget)
        left = dataset_budget - self.reserved(dataset)
        if budget > left * (1 + _RTOL):
            raise LedgerConflictError(
                f"the PAC budget of these worlds' training data is {dataset_budget:g} nats, "
                f"{dataset_budget - left:g} of them held by earlier worlds trained on it; these "
                f"worlds ask for {budget:g}. Retraining the worlds does not reset what the data "
                "has paid: lower pac.deployment_budget, or raise the data's PAC budget on record "
                f"(`privcode budget raise --pac {worlds} --nats N --who NAME --why REASON`)"
            )
        entry = {
            "type": "pac-open",
            "worlds": worlds,
            "dataset": dataset,
            "m": m,
            "b": b,
            "scope": scope,
            "allowance": budget,
            "dataset_budget": dataset_budget,
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

    def raise_entry(self, worlds: str, nats: float, who: str, why: str) -> dict[str, Any]:
        """The ``pac-raise`` entry making ``worlds``' allowance ``nats`` (never lower)."""
        w = self.worlds.get(worlds)
        if w is None:
            raise LedgerConflictError(f"no PAC worlds {worlds!r} were ever served from this store")
        if not nats > w.allowance:
            raise LedgerConflictError(f"{nats:g} nats does not raise the allowance {w.allowance:g}")
        if not who.strip() or not why.strip():
            raise LedgerConflictError("a budget raise must say who raises it and why")
        need = self.reserved(w.dataset, but=worlds) + nats
        return {
            "type": "pac-raise",
            "worlds": worlds,
            "allowance": nats,
            "dataset_budget": max(self.datasets[w.dataset], need),
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
                "dataset_budget_nats": self.datasets[w.dataset],
            }
            for k, w in self.worlds.items()
        ]
