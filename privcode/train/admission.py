"""Admission of a DP job to the privacy store, and the numbers a release takes from it.

:func:`admit_job` is the binding check of :func:`privcode.train.loop.run_training`,
before any worker starts: the job's records are fingerprinted with the store's
key, pre-store run ledgers of the corpus are imported once, and the store's
ledger admits the planned ``(sigma, q, steps)`` only if the worst record, every
earlier job on it composed, stays within the budget
(:mod:`privcode.dp.groups`, :mod:`privcode.dp.ledger`). :func:`requested_budget`
is what a config asks of the store; :func:`noise_for` the job's sigma.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from privcode.config import PrivacyConfig, TrainConfig
from privcode.dp.accounting import ACCOUNTANTS, DPEvent, calibrate, epsilon
from privcode.dp.ledger import Budget, pack_fingerprints
from privcode.dp.ledger_actor import ledger_call, open_ledger
from privcode.dp.store import PrivacyStore
from privcode.dp.wal import legacy_events
from privcode.errors import BudgetRefused

log = logging.getLogger("privcode.train")

__all__ = ["admit_job", "noise_for", "release_spent", "requested_budget"]


def requested_budget(privacy: PrivacyConfig, train: TrainConfig) -> tuple[Budget, bool]:
    """(the budget a run asks the store for, whether the config names it explicitly).

    ``privacy.epsilon_budget`` 0: the store's (its first job sets it to ``train.epsilon``).
    """
    explicit = bool(privacy.epsilon_budget)
    return (
        Budget(
            privacy.epsilon_budget or train.epsilon,
            privacy.delta or train.delta,
            train.accountant,
        ),
        explicit,
    )


def noise_for(cfg: TrainConfig, sample_rate: float) -> tuple[float, bool]:
    """(sigma, calibrated): the configured multiplier, or the calibrated one when it is 0."""
    if cfg.noise_multiplier > 0:
        return float(cfg.noise_multiplier), False
    return float(calibrate(cfg.epsilon, cfg.delta, sample_rate, cfg.steps, cfg.accountant)), True


def _legacy_ledgers(paths: list[Path]) -> list[tuple[str, dict, list[dict]]]:
    """(source, header, grants) of each pre-store run ledger to import (migration)."""
    out = []
    for wal in paths:
        header, events = legacy_events(wal)
        if events:
            out.append((f"{wal.resolve()}:{header.get('created')}", header, events))
    return out


def admit_job(
    store: PrivacyStore,
    records: list[Any],
    plan: DPEvent,
    budget: Budget,
    *,
    explicit: bool,
    run: str,
    run_key: str,
    legacy: list[Path] = (),  # type: ignore[assignment]
) -> tuple[Any, str, dict[str, Any]]:
    """Admit a DP job on ``records`` to the store's ledger: (handle, job id, reply).

    Fingerprints the records (keyed, :meth:`PrivacyStore.record_fingerprints`),
    imports the grants of pre-store run ledgers of this corpus once (their
    charges count), and asks for ``plan``; :class:`BudgetRefused` with the
    worst record's numbers when it does not fit.
    """
    fps = pack_fingerprints(store.record_fingerprints((r.prompt, r.code) for r in records))
    ledger = open_ledger(store.root)
    for source, header, events in _legacy_ledgers(list(legacy)):
        old = Budget(
            header.get("budget", budget.epsilon),
            header.get("delta", budget.delta),
            header.get("accountant", budget.accountant),
        )
        done = ledger_call(
            ledger,
            "import_legacy",
            fps,
            events,
            store.opaque("legacy", source),
            old.to_dict(),
            run=run,
        )
        if done["imported"]:
            log.warning(
                "imported %d DP steps of a run ledger from before the privacy store: "
                "they count against these records' budget",
                done["imported"],
            )
    reply = ledger_call(
        ledger,
        "admit",
        fps,
        plan.to_dict(),
        budget.to_dict(),
        explicit=explicit,
        run=run,
        run_key=run_key,
    )
    if not reply["admitted"]:
        raise BudgetRefused(
            f"privacy budget: {reply['message']}. The budget belongs to these records, "
            "whatever run, directory or copy of the file trains on them; lower "
            "train.epsilon or train.steps, or the data owner raises it with `privcode "
            "budget raise`"
        )
    return ledger, reply["job"], reply


def release_spent(history: list[dict], cfg: TrainConfig) -> dict[str, Any]:
    """The release's own epsilon (its job's grants) under every accountant."""
    events = [DPEvent.from_dict(e) for e in history]
    by: dict[str, float | None] = {}
    for name in ACCOUNTANTS:
        try:
            by[name] = epsilon(events, cfg.delta, name) if events else 0.0
        except Exception:  # noqa: BLE001 - informative only
            by[name] = None
    return {
        "epsilon": by[cfg.accountant],
        "epsilon_by_accountant": by,
        "steps": sum(e.steps for e in events),
    }
