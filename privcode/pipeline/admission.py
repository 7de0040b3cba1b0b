"""Admission before any stage starts: will the run's DP training fit its records' budget?
Design notes: docs/development.md, "privcode/pipeline/admission.py".

:func:`preflight` runs in ``run_pipeline`` before the first stage when the train stage is
selected and has no result on disk (or ``run.force``). It asks the privacy store's ledger,
reserving nothing, what the train stage's admission will ask: once the training file exists,
its worst record (every earlier job on it included) plus the planned ``(sigma, q, steps)``
must fit the budget; before that, the plan alone must fit and the config must not ask for
another budget than the store's. Both go through :func:`privcode.privacy.admission.admit`
(``reserve=False``) or :func:`~privcode.privacy.admission.plan_alone`; a refusal is a
:class:`~privcode.errors.BudgetRefused`. The train stage's own admission, which reserves,
stays the binding check.

"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from privcode.config import PipelineConfig
from privcode.errors import BudgetRefused
from privcode.layout import RunLayout
from privcode.pipeline.runner import fingerprint, read_manifest
from privcode.pipeline.stages import STAGES
from privcode.privacy.store import open_pinned
from privcode.registry import get_method

log = logging.getLogger("privcode.pipeline")

__all__ = ["BudgetRefused", "preflight"]


def _training_file(cfg: PipelineConfig, layout: RunLayout) -> Path | None:
    """The records the train stage will read, if they exist yet.

    ``train.data``; else this run's built corpus; else the corpus of another run whose
    data stage has the same fingerprint (the data stage builds the same records from the
    same data section: a renamed run of the demo corpus is checked before it starts too).
    """
    if cfg.train.data:
        return Path(cfg.train.data) if Path(cfg.train.data).is_file() else None
    if layout.train_data.is_file():
        return layout.train_data

    fp = fingerprint(cfg, STAGES["data"], {})
    for path in layout.manifests_of_every_run("data").values():
        manifest = read_manifest(path.parent)
        built = path.parent / layout.train_data.name
        if manifest is not None and manifest.fingerprint == fp and built.is_file():
            return built
    return None


def _training_rows(cfg: PipelineConfig, layout: RunLayout, records: list) -> tuple[Any, str]:
    """(each record's training row, its tokenizer's id) when this run's base model is built
    (its stage's manifest), so the preflight knows records by their rows as the train stage
    does; (None, "") before that (a first run: the train stage's admission checks them)."""

    manifest = read_manifest(layout.stage("base"))
    if manifest is None:
        return None, ""
    try:
        from privcode.models.base import check_complete
        from privcode.models.encoding import encode_records
        from privcode.models.loading import load_tokenizer
        from privcode.privacy.identities import tokenizer_id

        tokenizer = load_tokenizer(check_complete(manifest.summary).path)
        return encode_records(records, tokenizer, cfg.train.max_length), tokenizer_id(tokenizer)
    except Exception as exc:  # noqa: BLE001 - the train stage's admission still checks rows
        log.info("preflight without training rows (%s)", type(exc).__name__)
        return None, ""


def preflight(cfg: PipelineConfig, order: list[str]) -> str | None:
    """Check the train stage's budget before anything runs (module docstring); None: no check."""

    train = cfg.train
    layout = RunLayout.of(cfg)
    if "train" not in order or not get_method(train.method).dp:
        return None
    if read_manifest(layout.stage("train")) is not None and not cfg.run.force:
        return None  # probably current (then skipped); if not, the stage's admission decides
    from privcode.privacy.admission import admit, plan_alone, requested_budget
    from privcode.train.noise import planned_event

    store = open_pinned(cfg.privacy.store, cfg.privacy.store_id)
    budget, explicit = requested_budget(cfg.privacy, train)
    data = _training_file(cfg, layout)
    if data is None:  # the data stage builds it: only the plan alone can be checked
        return plan_alone(store, budget, explicit=explicit, epsilon=train.epsilon)

    from privcode.data.records import read_records

    records = read_records(data)
    plan = planned_event(train, len(records))
    rows, tokenizer = _training_rows(cfg, layout, records)
    _, reply = admit(
        store,
        records,
        plan,
        budget,
        explicit=explicit,
        reserve=False,
        cap=train.epsilon,
        rows=rows,
        tokenizer=tokenizer,
        run_key=cfg.privacy.run_key,  # an operator's reservation for this run is not counted twice
    )
    log.info("privacy budget before the run: %s", reply["message"])
    return reply["message"]
