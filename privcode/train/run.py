"""Stage I's driver: :func:`run_training` admits a DP job, runs it on Ray Train, writes its release.

Four named steps, in the order the guarantee needs them:

1. :func:`prepare`: the training mode, the one read of the corpus, ``q = B / N`` (refused above
   1) and ``sigma`` (given, or calibrated to ``train.epsilon`` over ``train.steps``);
2. :func:`admit_job`: the plan ``(sigma, q, steps)`` reserved in the store's ledger BEFORE any
   worker starts; a record over its budget refuses the whole job (:class:`BudgetRefused`);
3. :func:`fit_job`: :func:`privcode.train.loop.train_loop_per_worker` (every step reserved,
   fsynced, then taken); the job is finished in the ledger whatever happens; no grant
   confirmation, no release;
4. :func:`release_job`: ``privacy.json`` from the ledger's grants, and the adapter.

Returns a :class:`TrainResult`. Design notes: docs/methods.md, "train/run.py".
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import ray

from privcode.artifacts.summaries import TrainSummary
from privcode.cluster.local import connect
from privcode.config import TrainConfig
from privcode.data.records import read_snapshot
from privcode.dp.accounting import DPEvent
from privcode.dp.engine import Privacy
from privcode.errors import PrivcodeError
from privcode.models.encoding import encode_records
from privcode.models.loading import load_tokenizer
from privcode.models.ray_train import fit, torch_trainer
from privcode.privacy.admission import admit, check_corpus_store
from privcode.privacy.identities import tokenizer_id
from privcode.privacy.ledger import Budget
from privcode.privacy.ledger_actor import ledger_call, ledger_name, store_id
from privcode.privacy.store import PrivacyStore, resolve_store
from privcode.train.artifact import privacy_record, write_junior_release
from privcode.train.loop import TrainingError, TrainJob, train_loop_per_worker
from privcode.train.methods import Method, get_method
from privcode.train.noise import noise_for, release_spent

log = logging.getLogger("privcode.train")

__all__ = ["TrainResult", "admit_job", "fit_job", "prepare", "release_job", "run_training"]


@dataclass(frozen=True)
class TrainResult:
    """What :func:`run_training` returns: the stage's summary and, in private storage, the
    applied-steps audit log (removed with the training storage unless ``keep_storage``)."""

    summary: TrainSummary
    audit_log: Path


@dataclass
class Prepared:
    """The prologue's outcome: the mode, the corpus read once, ``q`` and ``sigma``."""

    cfg: TrainConfig
    method: Method
    privacy: Privacy
    data_path: Path
    base_path: Path
    out_dir: Path
    store: PrivacyStore
    records: list[dict[str, Any]]  # emptied once admitted: the workers read their shards
    corpus_sha: str
    num_records: int
    sample_rate: float
    sigma: float
    calibrated: bool
    ledger: Any = None
    job_id: str = ""
    #: The ledger's answer to ``finish``: the job's grants (history) and its records' epsilon.
    finished: dict[str, Any] = field(default_factory=dict)


def _training_mode(cfg: TrainConfig, non_private: Privacy | None) -> tuple[Method, Privacy | None]:
    """The method, and the engine's non-private mode where the method or the caller asks for
    it by name (``train.allow_non_private``); said loudly, never silently weaker."""
    method = get_method(cfg.method)
    if not method.dp:
        if not cfg.allow_non_private:
            raise TrainingError(
                f"train.method={cfg.method!r} trains WITHOUT differential privacy "
                "(NOT PRIVATE); it is refused unless train.allow_non_private "
                "is true (audits and comparisons only)"
            )
        non_private = non_private or Privacy.non_private(
            f"train.method={cfg.method} with train.allow_non_private"
        )
    if non_private is not None:
        if non_private.private:
            raise ValueError("non_private must be Privacy.non_private(...)")
        msg = (
            f"train.method={cfg.method!r}: this run is NOT PRIVATE (NOT differentially private: "
            f"{non_private.reason}; no noise, no privacy ledger). Its release must never be "
            "treated as a DP artifact."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.error(msg)
    return method, non_private


def prepare(
    cfg: TrainConfig,
    data_path: str | Path,
    base_path: str | Path,
    out_dir: str | Path,
    privacy_store: str | Path | None,
    non_private: Privacy | None,
) -> Prepared:
    """Step 1: the mode, the corpus (one read), ``q = B / N`` and ``sigma``."""
    method, non_private = _training_mode(cfg, non_private)
    data_path, base_path, out_dir = (
        Path(data_path).resolve(),
        Path(base_path).resolve(),
        Path(out_dir),
    )
    store = PrivacyStore(privacy_store if privacy_store is not None else resolve_store("", out_dir))
    check_corpus_store(data_path, store)
    records, corpus_sha = read_snapshot(data_path)  # one read: admitted = hashed = parsed
    n = len(records)
    q = cfg.expected_batch_size / n
    if q > 1:
        raise TrainingError(
            f"train.expected_batch_size={cfg.expected_batch_size} exceeds the "
            f"{n} training records (sample rate must be <= 1)"
        )
    if cfg.delta >= 1.0 / n:
        warnings.warn(
            f"train.delta={cfg.delta} is not below 1/N = {1 / n:.3g}: the guarantee is weak",
            stacklevel=3,
        )
    if not cfg.secure_rng and non_private is None:
        log.warning(
            "train.secure_rng is off: sampling and noise come from a secret-seeded "
            "fast PRNG, not a CSPRNG (set train.secure_rng for production releases)"
        )
    sigma, calibrated = (0.0, False) if non_private is not None else noise_for(cfg, q)
    privacy = non_private or Privacy.dp_sgd(sigma, cfg.max_grad_norm, cfg.grad_sample_mode)
    return Prepared(
        cfg, method, privacy, data_path, base_path, out_dir, store, records, corpus_sha,
        n, q, sigma, calibrated,
    )  # fmt: skip


def admit_job(
    p: Prepared, *, run_name: str, run_key: str, budget: Budget | None, legacy: tuple[Path, ...]
) -> None:
    """Step 2: reserve the job's plan in the store's ledger before any worker exists; the
    records are then dropped from the driver (the workers read their shards themselves)."""
    if p.privacy.private:
        tokenizer = load_tokenizer(p.base_path)  # a record is also known by its training row
        p.ledger, admitted = admit(
            p.store,
            p.records,
            DPEvent(p.sigma, p.sample_rate, p.cfg.steps),
            budget or Budget(p.cfg.epsilon, p.cfg.delta, p.cfg.accountant),
            explicit=budget is not None,
            reserve=True,
            cap=p.cfg.epsilon,
            run=run_name,
            run_key=run_key or p.store.opaque("run", str(p.out_dir.resolve())),
            legacy=list(legacy),
            rows=encode_records(p.records, tokenizer, p.cfg.max_length),
            tokenizer=tokenizer_id(tokenizer),
            dataset=p.corpus_sha,
        )
        p.job_id = admitted["job"]
        log.info("privacy budget: %s", admitted["message"])
    p.records = []


def _fit_checkpoint(trainer: Any, cfg: TrainConfig, local: bool) -> tuple[dict[str, Any], Path]:
    """Run the trainer; the final checkpoint's state and a private copy of its files."""
    try:
        result = fit(trainer, cfg.num_workers, cfg.cpus_per_worker)
    except Exception as exc:
        restarts = (
            "Ray Train local mode: no restarts"
            if local
            else f"after up to {cfg.max_failures} restarts"
        )
        raise TrainingError(
            f"DP training failed ({restarts}): {type(exc).__name__}: {exc}"
        ) from exc
    if result.checkpoint is None:
        raise TrainingError("DP training ended without a checkpoint")
    ckpt_dir = Path(tempfile.mkdtemp(prefix="privcode-final-"))
    with result.checkpoint.as_directory() as d:
        state = json.loads((Path(d) / "state.json").read_text(encoding="utf-8"))
        if state["step"] == 0:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            raise TrainingError(
                "no DP-SGD step was taken: the privacy budget of these records is "
                "spent. Training again on the same data needs a new budget decision "
                "by the data owner: it composes with every release made from them."
            )
        shutil.copytree(Path(d), ckpt_dir, dirs_exist_ok=True)
    return state, ckpt_dir


def fit_job(p: Prepared, storage: Path, name: str) -> tuple[dict[str, Any], Path]:
    """Step 3: the workers' DP-SGD under Ray Train; the job is finished in the ledger in
    every case (an unconfirmed finish is no release). Returns the final state and its files."""
    local = p.cfg.num_workers == 0  # Ray Train local mode: the loop runs in this process
    job = TrainJob(
        cfg=p.cfg,
        data_path=str(p.data_path),
        corpus_sha256=p.corpus_sha,
        base_path=str(p.base_path),
        num_records=p.num_records,
        sample_rate=p.sample_rate,
        privacy=p.privacy,
        ledger=ledger_name(store_id(p.store.root)) if p.ledger is not None else "",
        job_id=p.job_id,
        audit_log=str(storage / f"{name}.applied_steps.jsonl"),
        local_checkpoints=str(storage / name) if local else "",
    )
    trainer = torch_trainer(
        train_loop_per_worker,
        {"job": job},
        name=name,
        storage=storage,
        num_workers=p.cfg.num_workers,
        cpus_per_worker=p.cfg.cpus_per_worker,
        use_gpu=p.cfg.use_gpu,
        max_failures=p.cfg.max_failures,
        keep=2,
    )
    try:
        state, ckpt_dir = _fit_checkpoint(trainer, p.cfg, local)
    finally:
        if p.ledger is not None:
            # Always: a finished job's committed events become what it was granted.
            try:
                p.finished = ledger_call(p.ledger, "finish", p.job_id, "training ended")
            except PrivcodeError as exc:  # its plan stays reserved: an over-count only
                log.error("the job could not be finished in the privacy ledger: %s", exc)
    if p.ledger is not None and not p.finished:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        raise TrainingError("the privacy ledger did not confirm the job's grants; no release")
    return state, ckpt_dir


def release_job(p: Prepared, state: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    """Step 4: ``privacy.json`` from the ledger's grants, and the adapter; returns the record."""
    history = p.finished.get("history", [])
    spent = release_spent(history, p.cfg) if p.finished else {}
    record = privacy_record(
        p.cfg,
        p.method,
        spent=spent,
        grants=history,
        sigma=p.sigma,
        calibrated=p.calibrated,
        sample_rate=p.sample_rate,
        num_records=p.num_records,
        state=state,
        dataset_id=p.store.dataset_id_of(p.corpus_sha),
        base_path=p.base_path,
        mode=p.privacy.record(),
        dp=p.privacy.private,
        store_id=p.store.store_id,
    )
    try:
        write_junior_release(p.out_dir, ckpt_dir, p.cfg, p.method, record, p.base_path)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {**record.to_json(), "ledger_steps": spent.get("steps")}


def _remove_storage(storage: Path, name: str) -> None:
    shutil.rmtree(storage / name, ignore_errors=True)
    for leftover in (f"{name}.applied_steps.jsonl", f"{name}.private_stats.json"):
        with contextlib.suppress(FileNotFoundError):
            (storage / leftover).unlink()
    with contextlib.suppress(OSError):
        storage.rmdir()  # only when no other run's files are left in it


#: The release's fields the summary repeats (the rest is said by the stage, not privacy.json).
_SUMMARY_FIELDS = frozenset(f.name for f in fields(TrainSummary)) - {"adjacency"}


def run_training(
    cfg: TrainConfig,
    *,
    data_path: str | Path,
    base_path: str | Path,
    out_dir: str | Path,
    run_name: str,
    storage_dir: str | Path,
    non_private: Privacy | None = None,
    keep_storage: bool = False,
    privacy_store: str | Path | None = None,
    budget: Budget | None = None,
    run_key: str = "",
    legacy_ledgers: tuple[Path, ...] = (),
) -> TrainResult:
    """Train with DP-SGD on Ray Train; write the release into ``out_dir``; return its summary.

    The release is ``adapter/`` and ``privacy.json``. The job is admitted to the ledger of
    ``privacy_store`` (else :func:`privcode.privacy.store.resolve_store`'s; never created here):
    the worst of its records, counting every earlier job on it, must stay within ``budget``
    (None: the store's) with the planned steps added, else :class:`BudgetRefused`;
    :class:`TrainingError` when no step could be taken. ``non_private`` (tests and
    comparisons, never from a config file), or the method ``nondpft`` with
    ``train.allow_non_private``: the engine's non-private mode, its reason written into
    ``privacy.json``. The other arguments: docs/methods.md, "train/run.py".
    """
    p = prepare(cfg, data_path, base_path, out_dir, privacy_store, non_private)
    if not ray.is_initialized():
        connect()
    admit_job(p, run_name=run_name, run_key=run_key, budget=budget, legacy=legacy_ledgers)
    storage = Path(storage_dir).resolve()
    storage.mkdir(parents=True, exist_ok=True)
    name = f"train-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    started = time.time()
    state, ckpt_dir = fit_job(p, storage, name)
    released = release_job(p, state, ckpt_dir)
    if not keep_storage:
        _remove_storage(storage, name)
    summary = TrainSummary.from_json(
        {
            **{k: released[k] for k in _SUMMARY_FIELDS if k in released},
            "stop_reason": state["stop_reason"] or "",
            "adjacency": "add/remove one record (N public)",
            "train_seconds": round(time.time() - started, 2),
            "adapter": "adapter",
            "conditioning": p.method.conditioning,
            "data_path": str(p.data_path),
            "privacy_store": str(p.store.root),
            # The worst epsilon of this job's records, every job that trained on them composed.
            "record_epsilon": p.finished.get("record_epsilon"),
            "record_budget": p.finished.get("budget", {}).get("epsilon"),
        },
        "the train stage's summary",
    )
    return TrainResult(summary, storage / f"{name}.applied_steps.jsonl")
