"""Admission: may a DP job with a planned ``(sigma, q, steps)`` train on these records?
Design notes: docs/privacy.md, "privcode/privacy/admission.py".

The records get the store's keyed identities
(:meth:`~privcode.privacy.store.PrivacyStore.record_identities`) and the store's one writer
(:mod:`privcode.privacy.ledger`) answers: the job fits when, for the worst record,
``epsilon(every earlier job on its component + plan) <= budget`` (:mod:`privcode.privacy.groups`).
:func:`admit` asks (``reserve=False``: the preflight) or reserves (``reserve=True``: the train
stage before any worker starts, the binding check; pre-store run ledgers are imported first);
:func:`plan_alone` asks before the data exists (a record never trained on);
:func:`register_pac_data` logs a PAC worlds' records with the same identities before they train
(:mod:`privcode.privacy.pac_budgets`). A refusal is a :class:`~privcode.errors.BudgetRefused`
naming the worst record's epsilon spent, what the job would add and what is left.

"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from privcode.config import PrivacyConfig, TrainConfig
from privcode.dp.events import DPEvent
from privcode.errors import BudgetRefused
from privcode.privacy.identities import duplicated_kinds, pack_identities
from privcode.privacy.ledger import Budget
from privcode.privacy.ledger_actor import ledger_call, open_ledger
from privcode.privacy.pac_budgets import records_dataset_id
from privcode.privacy.store import PrivacyStore
from privcode.privacy.wal import legacy_events

log = logging.getLogger("privcode.privacy")

__all__ = [
    "MAX_ROWS_PER_RECORD",
    "BudgetRefused",
    "admit",
    "check_corpus_store",
    "plan_alone",
    "register_pac_data",
    "requested_budget",
]

#: The most rows of one job's training set one record may occupy (TF Privacy's
#: max_examples_per_user); ``privacy.json`` states it.
MAX_ROWS_PER_RECORD = 1

#: What two rows of one job share, by identity kind (the refusal names no record).
_SAME = {
    "exact": "prompt and code up to line ends and Unicode form",
    "code": "code up to layout, whatever the prompt",
    "row": "training row after tokenisation and truncation",
}

_ADVICE = (
    "The budget belongs to these records, whatever run, directory or copy of the file "
    "trains on them; lower train.epsilon or train.steps, or the data owner raises it with "
    "`privcode budget raise`"
)


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


def _import_legacy(
    store: PrivacyStore,
    ledger: Any,
    fps: bytes,
    per_record: int,
    paths: Sequence[Path],
    budget: Budget,
    run: str,
) -> None:
    """Import the grants of pre-store run ledgers of this corpus once (their charges count)."""
    for wal in paths:
        header, events = legacy_events(wal)
        if not events:
            continue
        source = f"{wal.resolve()}:{header.get('created')}"
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
            per_record=per_record,
        )
        if done["imported"]:
            log.warning(
                "imported %d DP steps of a run ledger from before the privacy store: "
                "they count against these records' budget",
                done["imported"],
            )


def admit(
    store: PrivacyStore,
    records: Sequence[Any],
    plan: DPEvent,
    budget: Budget,
    *,
    explicit: bool,
    reserve: bool,
    cap: float | None = None,
    run: str = "",
    run_key: str = "",
    legacy: Sequence[Path] = (),
    rows: Sequence[Any] | None = None,
    tokenizer: str = "",
    dataset: str = "",
) -> tuple[Any, dict[str, Any]]:
    """Ask (``reserve=False``) or reserve (``True``) ``plan`` on ``records``: (ledger, reply).

    ``records`` have ``.prompt`` and ``.code``; ``cap`` (``train.epsilon``) holds the job to
    min(cap, what the store has left); a reservation's reply names the ``job``.
    :class:`BudgetRefused` with the worst record's numbers when the plan does not fit (nothing is
    reserved then). ``rows``: each record's encoded training row (``.input_ids``, ``.segments``:
    ``privcode.models.encoding.encode_records``), ``tokenizer`` its
    :func:`~privcode.privacy.identities.tokenizer_id`; without them (the preflight) the ``row``
    identity is not checked. ``dataset``: the file's SHA-256 (hex); a reserved job's steps are
    granted only to a caller presenting it (the training ranks, which read the file). Rows of one
    job sharing the exact, code or row identity are one record and refused
    (:data:`MAX_ROWS_PER_RECORD`); rows sharing only a MinHash band are admitted.
    Why: docs/privacy.md, "privcode/privacy/admission.py".
    """
    ids = store.record_identities(
        ((r.prompt, r.code) for r in records), rows=rows, tokenizer=tokenizer
    )
    if kinds := duplicated_kinds(ids):
        raise BudgetRefused(
            "privacy budget: the training set holds the same record in several rows (the same "
            f"{' / '.join(_SAME[k] for k in kinds)}); a record may occupy at most "
            f"{MAX_ROWS_PER_RECORD} row of a job, since every row is sampled and charged on its "
            "own. Deduplicate train.data (`privcode data ingest` does)"
        )
    fps, per_record = pack_identities(ids), ids.shape[1]
    ledger = open_ledger(store.root)
    asked: dict[str, Any] = {"explicit": explicit, "cap": cap, "per_record": per_record}
    if reserve:
        _import_legacy(store, ledger, fps, per_record, legacy, budget, run)
        asked |= {"run": run, "run_key": run_key, "dataset": dataset}
    elif run_key:  # the run's own reservation (an operator's) is what its admit replaces
        asked["run_key"] = run_key
    method = "admit" if reserve else "admission"  # reserve, or only ask
    reply = ledger_call(ledger, method, fps, plan.to_dict(), budget.to_dict(), **asked)
    if not reply["admitted"]:
        stage = "" if reserve else ", checked before any stage"
        raise BudgetRefused(f"privacy budget{stage}: {reply['message']}. {_ADVICE}")
    return ledger, reply


def check_corpus_store(data: str | Path, store: PrivacyStore) -> None:
    """Refuse a corpus whose ``manifest.json`` (beside ``data``; ``privcode data ingest``
    writes it) names another privacy store: its held-out split and canaries are keyed by
    that store, and its records' budget is kept there. A file without a manifest passes."""
    manifest = Path(data).parent / "manifest.json"
    try:
        named = json.loads(manifest.read_text(encoding="utf-8")).get("store_id", "")
    except (OSError, ValueError, AttributeError):
        return
    if named and named != store.store_id:
        raise BudgetRefused(
            f"this corpus was ingested under privacy store {named}, and this job would be "
            f"charged to store {store.store_id} ({store.root}): its records' budget is kept in "
            "the store that ingested it. Train with that store (privacy.store), or ingest the "
            "sources again under this one"
        )


def plan_alone(
    store: PrivacyStore, budget: Budget, *, explicit: bool, epsilon: float
) -> str | None:
    """Before the data exists: refuse a plan over the store's budget by itself.

    Returns a warning when the store's worst record has spent enough that an
    overlap with earlier jobs would be refused once the data exists; else None.
    """
    ledger = open_ledger(store.root)
    held = ledger_call(ledger, "budget_for", budget.to_dict(), explicit)  # conflicts raise
    if epsilon > held["epsilon"]:
        raise BudgetRefused(
            f"privacy budget, checked before any stage: train.epsilon {epsilon:g} alone is "
            f"over the per-record budget {held['epsilon']:g} of the privacy store. {_ADVICE}"
        )
    spent = ledger_call(ledger, "describe")["epsilon_spent"]
    if spent + epsilon > held["epsilon"]:
        return (
            f"the store's worst record has spent epsilon {spent:.4g} of {held['epsilon']:g}: "
            "if this run's data holds records earlier jobs trained on, the train stage will "
            "refuse it (checked once the data exists)"
        )
    return None


def register_pac_data(
    store: PrivacyStore, records: Sequence[Any], rows: Sequence[Any], tokenizer: str
) -> str:
    """Log the records PAC worlds train on (objects with ``prompt`` and ``code``; ``rows``
    their encoded rows, ``tokenizer`` its :func:`~privcode.privacy.identities.tokenizer_id`)
    in ``store``'s ledger, once per record set; their PAC dataset id."""
    from privcode.privacy.budget import call

    pairs = [(r.prompt, r.code) for r in records]
    dataset = records_dataset_id(store, pairs)
    ids = store.record_identities(pairs, rows=rows, tokenizer=tokenizer)
    call(store.root, "pac_records", dataset, pack_identities(ids), ids.shape[1])
    return dataset
