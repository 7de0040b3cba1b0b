"""What the store's ledger answers about its state: a job's, a run's, the whole store's.

A mixin of :class:`~privcode.privacy.ledger.StoreLedger` (which holds the
state: ``_jobs``, ``_groups``, ``_budget``, ``_pac``). Aggregates only: numbers,
job ids and the opaque ids the store keys, never a record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from privcode.dp.accounting import ACCOUNTANTS, make_accountant
from privcode.dp.events import DPEvent

if TYPE_CHECKING:
    from privcode.privacy.groups import RecordGroups
    from privcode.privacy.ledger_log import Budget, JobEntry
    from privcode.privacy.pac_budgets import PacBudgets

__all__ = ["LedgerReading"]


class LedgerReading:
    """Reading calls of the ledger (module docstring)."""

    _jobs: dict[str, JobEntry]
    _groups: RecordGroups | None
    _budget: Budget | None
    _pac: PacBudgets
    _worst: float
    root: Any

    @property
    def store_id(self) -> str:
        raise NotImplementedError

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

    def run_spent(self, run_key: str) -> dict:
        """What the run of ``run_key`` spent, all its jobs together (an operator's view of
        one run, whose train stage replaces the job the operator reserved): steps granted,
        the run's events, whether a job of it is still running."""
        mine = [j for j in self._jobs.values() if run_key and j.run_key == run_key]
        events = [
            DPEvent(j.plan.noise_multiplier, j.plan.sample_rate, j.granted).to_dict()
            for j in mine
            if j.granted
        ]
        running = [j for j in mine if not j.finished]
        return {
            "jobs": len(mine),
            "steps": sum(j.granted for j in mine),
            "history": events,
            "running": bool(running),
            "plan": running[-1].plan.to_dict() if running else None,
        }

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
