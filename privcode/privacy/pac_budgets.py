"""PAC deployment budgets in the privacy store: per set of worlds, within one per dataset.

A PAC curator (:mod:`privcode.pac.curator`) charges ``b`` nats per private
token against its deployment budget, and its state (the secret world, the
posterior, the charges) lives in the store under ``pac/<worlds id>/``. The
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
  ``privcode budget raise --pac WORLDS``, with who and why.

PAC leakage composes additively in mutual information over deployments on
the same data, which is why the allowances of one dataset add up. Pure
state: :class:`~privcode.privacy.ledger.StoreLedger` logs and persists it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from privcode.errors import LedgerConflictError

__all__ = ["PacBudgets"]

_RTOL = 1e-9


@dataclass
class _Worlds:
    dataset: str
    m: int
    b: float
    scope: str
    allowance: float


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
                "dataset_budget_nats": self.datasets[w.dataset],
            }
            for k, w in self.worlds.items()
        ]
