"""A PrivCodeRun admitted against its records' budget before any of its pods exists.

:func:`admit_run` reads the run's training file (from the data claim the
operator mounts read-only), plans its DP job as the train stage will
(:func:`~privcode.train.noise.planned_event`) and reserves the plan in the
privacy store's ledger (:func:`privcode.privacy.admission.admit`, the one
admission), under a run key derived from the run's uid. The child RayJob's
train stage takes that reservation over (``privacy.run_key``: its own
admission, with the records' training rows, replaces it in one ledger call),
so two runs racing for the last budget cannot both be admitted, and a
restarted operator that admits again replaces its own reservation instead of
holding two. :func:`release_run` finishes the job: what was granted stays
spent, the unused rest of the reservation is released.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from privcode.config import PipelineConfig, load_config
from privcode.data.records import read_snapshot
from privcode.dp.accounting import epsilon
from privcode.errors import BudgetRefused
from privcode.operator.spec import RunSpec
from privcode.privacy.admission import admit, requested_budget
from privcode.privacy.ledger_actor import ledger_call, open_ledger
from privcode.privacy.store import PrivacyStore
from privcode.train.noise import planned_event

__all__ = [
    "RunAdmission",
    "admit_run",
    "release_run",
    "run_config",
    "run_key_of",
    "run_overrides",
    "run_spent",
]


@dataclass(frozen=True)
class RunAdmission:
    """The ledger's answer for one run (aggregates only)."""

    admitted: bool
    message: str
    job: str  #: the ledger's job id ("" when refused)
    run_key: str
    epsilon_planned: float  #: the run's own planned epsilon (its plan alone)
    records: int


def run_key(store: PrivacyStore, namespace: str, name: str, uid: str) -> str:
    """The run's reservation key: keyed, so it names no namespace in the store's log."""
    return store.opaque("run", f"k8s/{namespace}/{name}/{uid}")


def run_key_of(store_root: str, namespace: str, name: str, uid: str) -> str:
    """:func:`run_key` of the store at ``store_root``."""
    return run_key(PrivacyStore(store_root), namespace, name, uid)


def run_overrides(run: RunSpec, name: str, key: str, data_file: str) -> list[str]:
    """The ``--set`` overrides the child job runs with (and admission plans with)."""
    out = [
        f"run.name={name}",
        f"train.data={data_file}",
        f"train.epsilon={run.epsilon!r}",
        f"privacy.run_key={key}",
    ]
    if run.delta is not None:
        out.append(f"train.delta={run.delta!r}")
    if run.stages:
        out.append(f"run.stages=[{', '.join(run.stages)}]")
    return [*out, *run.overrides]


def run_config(run: RunSpec, overrides: list[str]) -> PipelineConfig:
    """The run's pipeline config with ``overrides`` (ConfigError naming the key)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(run.config, encoding="utf-8")
        return load_config(path, overrides)


def admit_run(
    run: RunSpec, *, name: str, namespace: str, uid: str, store_root: str, data_root: str
) -> RunAdmission:
    """Reserve ``run``'s plan for its records, or say why not (module docstring)."""
    store = PrivacyStore(store_root)
    key = run_key(store, namespace, name, uid)
    data_file = run.data_file(data_root)
    cfg = run_config(run, run_overrides(run, name, key, data_file))
    records, digest = read_snapshot(data_file)
    plan = planned_event(cfg.train, len(records))
    budget, explicit = requested_budget(cfg.privacy, cfg.train)
    own = _alone(plan, cfg)
    held = run_spent(store_root, key)
    if held["running"]:  # reserved before (a retried or resumed handler): never twice
        return RunAdmission(True, "reserved before", "", key, own, len(records))
    try:
        _, reply = admit(
            store,
            records,
            plan,
            budget,
            explicit=explicit,
            reserve=True,
            cap=cfg.train.epsilon,
            run=f"{namespace}/{name}",
            run_key=key,
            dataset=digest,
        )
    except BudgetRefused as exc:
        return RunAdmission(False, str(exc), "", key, own, len(records))
    return RunAdmission(True, str(reply["message"]), str(reply["job"]), key, own, len(records))


def _alone(plan, cfg: PipelineConfig) -> float:

    return float(epsilon([plan], cfg.train.delta, cfg.train.accountant))


def release_run(store_root: str, key: str, reason: str) -> dict:
    """Finish the run's ledger jobs: their grants stay spent, the rest of the plan is
    released (never a refund of a granted step)."""
    return ledger_call(open_ledger(store_root), "finish_run", key, reason)


def run_spent(store_root: str, key: str) -> dict:
    """The run's grants so far, all its jobs (the operator's and its train stage's)."""
    return ledger_call(open_ledger(store_root), "run_spent", key)
