"""Distributed DP-SGD on Ray Train: the per-worker training loop (the driver: train/run.py).
Design notes: docs/methods.md, "train/loop.py".

Each of ``W`` workers builds the method's objective (:mod:`privcode.train.methods`; seeded init,
broadcast from rank 0) and tokenises only its shard ``{i : i mod W = rank}``; every trainable
parameter is clipped jointly per record and updated by one optimiser. One step ``t``:

1. rank 0 asks the ledger to reserve ``(sigma, q)``; the ledger fsyncs BEFORE granting and rank
   0 broadcasts the decision. A denied step is never taken (all ranks leave together); an
   unreachable ledger stops training (fail-closed);
2. each rank takes its Poisson sample ``S_t ∩ shard`` (schedule seed from OS entropy at every
   (re)start, broadcast, never stored) and sums the clipped per-record gradients; dropout and
   latent noise come from the same secret, never ``train.seed`` or a record's position; a
   record whose gradient is not finite contributes zero;
3. rank 0 adds ``N(0, sigma^2 C^2)`` once, the sums are all-reduced and divided by ``q N``, and
   every rank applies the same AdamW update (an empty sample still takes the noise-only step).

Steps re-run after a restart are charged again: the ledger never rolls back. Only the weights,
the step counter, ledger decisions and the loss on PUBLIC held-out code leave a worker; losses,
norms, clip counts, batch sizes and step times of private batches are never logged or reported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from privcode.config import TrainConfig
from privcode.data.records import read_snapshot
from privcode.data.stdlib import stdlib_dir
from privcode.dp.dpsgd import trainable_parameters
from privcode.dp.engine import BudgetUnavailable, Privacy, Reserve, make_private
from privcode.dp.randomness import record_key
from privcode.dp.sampler import shard_of
from privcode.errors import BudgetRefused, PrivcodeError, RecordError
from privcode.models import corpus as C
from privcode.models.base_training import HELDOUT_FRACTION
from privcode.models.encoding import collate, encode_records
from privcode.models.loading import resolve_dtype
from privcode.models.ray_train import report_checkpoint
from privcode.privacy.ledger_actor import get_ledger
from privcode.train.build import build_objective, load_checkpoint, save_checkpoint_files
from privcode.train.methods import get_method
from privcode.utils import atomic_write_json

log = logging.getLogger("privcode.train")

__all__ = [
    "BudgetRefused",
    "TrainJob",
    "TrainingError",
    "train_loop_per_worker",
]


class TrainingError(PrivcodeError):
    """Training could not produce a DP release (budget spent, ledger down, workers failed)."""


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; built by :func:`privcode.train.run.run_training`, identical on every rank."""

    cfg: TrainConfig
    data_path: str
    corpus_sha256: str  # checked by every rank on the bytes it parses; private (never released)
    base_path: str
    num_records: int
    sample_rate: float
    privacy: Privacy  # the engine's mode: DP-SGD, or the named non-private one
    ledger: str  # the store ledger actor's name ('' = no ledger: non-private only)
    job_id: str  # this job in the store's ledger
    audit_log: str
    local_checkpoints: str = ""  # Ray Train local mode: where checkpoints are written


def _ledger_reserve(job: TrainJob, ledger: Any) -> Reserve:
    """The engine's budget: one step ``(sigma, q)`` from the ledger actor, fsynced before granted.

    ``request_id`` names this release (``"<incarnation>:<step>"``): a call Ray
    re-sends after a ledger actor restart is answered from the WAL instead of
    being charged twice, while a step recomputed by a new worker-group
    incarnation (fresh noise: a second release) carries a new id and is charged.
    Each request presents the admitted data's digest, which every rank checked on the
    bytes it parsed: a job id alone draws no grant.
    """

    def reserve(request_id: str) -> tuple[bool, int, str | None]:
        d = ray.get(
            ledger.reserve.remote(
                job.job_id,
                job.privacy.noise_multiplier,
                job.sample_rate,
                1,
                request_id=request_id,
                dataset=job.corpus_sha256,  # the grant is bound to the admitted bytes
            ),
            timeout=120,
        )
        return bool(d.get("granted")), int(d.get("position", -1)), d.get("reason")

    return reserve


# --------------------------------------------------------------------------- worker helpers


def _public_eval_stream(base_path: str, tokenizer: Any, max_tokens: int):
    """Tokens of the base model's held-out PUBLIC files (never seen in pretraining)."""

    files = None
    info = Path(base_path) / "build_info.json"
    with contextlib.suppress(OSError, ValueError):
        names = json.loads(info.read_text(encoding="utf-8")).get("heldout_files")
        if names:
            root = stdlib_dir()
            files = [
                C.SourceFile(
                    n, n.split("/")[0].removesuffix(".py"), (root / n).read_text(encoding="utf-8")
                )
                for n in names
            ]
    if not files:
        files = C.split_heldout(C.public_corpus(), HELDOUT_FRACTION)[1]
    stream, _ = C.token_stream(tokenizer, files, max_tokens=max_tokens)
    return stream


def _evaluate(model: Any, tokenizer: Any, stream: Any, cfg: TrainConfig) -> float | None:

    if stream is None or stream.numel() < 2:
        return None
    with torch.no_grad():
        out = C.evaluate_loss(
            model, tokenizer, stream, seq_len=min(cfg.max_length, 256), max_tokens=cfg.eval_tokens
        )
    return round(float(out["loss"]), 5)


def _report(
    job: TrainJob, objective: Any, optimizer: Any, state: dict[str, Any], rank: int
) -> None:
    """Every rank calls this (a barrier); rank 0 attaches the checkpoint."""

    # What Ray Train logs and shows: public values only. The ledger position (a grant
    # id) and the attempt (a restart count) stay in the checkpoint's private state.
    metrics = {k: state[k] for k in ("step", "stop_reason")}
    metrics["public_heldout_loss"] = state["curve"][-1][1] if state["curve"] else None

    def write(d: Path) -> None:
        save_checkpoint_files(d, objective, optimizer)
        atomic_write_json(d / "state.json", state)

    report_checkpoint(
        metrics, write if rank == 0 else None, job.local_checkpoints or None, state["step"]
    )


def _write_private_stats(
    job: TrainJob, rank: int, world: int, stats: dict[str, int], device: Any
) -> None:
    """Counts over the private shards (e.g. code Python cannot tokenize), summed over ranks.

    Written next to the private audit log (training storage, never released
    nor reported: they are exact, un-noised statistics of the private data).
    """
    counts = [int(stats.get("untokenizable", 0))]
    if world > 1:
        t = torch.tensor(counts, dtype=torch.int64, device=device)
        dist.all_reduce(t)
        counts = [int(v) for v in t.tolist()]
    if rank == 0:
        path = Path(job.audit_log).with_name(
            Path(job.audit_log).name.replace(".applied_steps.jsonl", ".private_stats.json")
        )
        atomic_write_json(path, {"untokenizable_records": counts[0]})


def _append_audit(path: str, step: int, position: int, attempt: int, nonfinite: int) -> None:
    line = (
        json.dumps(
            {
                "step": step,
                "ledger_position": position,
                "attempt": attempt,
                "time": round(time.time(), 3),
                "nonfinite_records": nonfinite,
            }
        )
        + "\n"
    )
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- the loop


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker function: DP-SGD over this rank's shard (see the module docstring)."""
    job: TrainJob = config["job"]
    cfg = job.cfg
    method = get_method(cfg.method)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")

    checkpoint = ray.train.get_checkpoint()
    objective, tokenizer, _ = build_objective(
        method, cfg, job.base_path, device, will_restore=checkpoint is not None
    )
    model = objective.lm
    params = trainable_parameters(objective)
    optimizer = (
        torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if cfg.optimizer == "sgd"
        else torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    )
    state = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_checkpoint(Path(d), objective, optimizer)
    state = state or {
        "step": 0,
        "ledger_position": None,
        "stop_reason": None,
        "attempt": 0,
        "curve": [],
    }
    state["attempt"] += 1
    if world > 1:
        for name, p in objective.named_parameters():
            if p.requires_grad or not name.startswith("lm."):  # LoRA and PrivLC
                dist.broadcast(p.data, src=0)

    # The private data: every rank reads the admitted bytes (one read: hashed and parsed
    # from the same buffer) and tokenises its own shard only.
    try:
        records, _ = read_snapshot(job.data_path, expected_sha256=job.corpus_sha256)
    except RecordError as exc:
        raise TrainingError(f"rank {rank}: {exc}") from None
    if len(records) != job.num_records:
        raise TrainingError(
            f"{job.data_path}: expected {job.num_records} records, got {len(records)}"
        )
    shard = shard_of(job.num_records, rank, world)
    private_stats: dict[str, int] = {}
    encoded = encode_records(
        [records[i] for i in shard], tokenizer, cfg.max_length, stats=private_stats
    )
    del records
    # Per-record randomness is keyed by the record's content, never its position.
    keys = [record_key(e.input_ids, e.segments) for e in encoded]
    _write_private_stats(job, rank, world, private_stats, device)

    ledger = get_ledger(job.ledger) if rank == 0 and job.privacy.private else None
    engine = make_private(
        objective,
        optimizer,
        job.privacy,
        num_records=job.num_records,
        sample_rate=job.sample_rate,
        rank=rank,
        world=world,
        device=device,
        secure_rng=cfg.secure_rng,
        reserve=_ledger_reserve(job, ledger) if ledger is not None else None,
        micro_batch_size=cfg.micro_batch_size,
        autocast_dtype=resolve_dtype(cfg.dtype, device),
        gradient_checkpointing=cfg.gradient_checkpointing,
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def batch_fn(local: list[int], step: int) -> Any:
        # Per-record randomness (the VAE's eps) is keyed by the record's content
        # and a per-step secret, so it neither depends on other records nor on
        # how records fall on workers; dropout masks come from the secret too.
        return collate(
            [encoded[j] for j in local],
            pad_id,
            device=device,
            step=step,
            record_keys=torch.tensor([keys[j] for j in local], dtype=torch.long),
            record_secret=engine.randomness.record_secret(step),
        )

    def loss_fn(module: Any, batch: Any) -> Any:
        return module(batch)

    stream = (
        _public_eval_stream(job.base_path, tokenizer, cfg.eval_tokens)
        if rank == 0 and cfg.eval_tokens > 0
        else None
    )
    if rank == 0 and not state["curve"] and stream is not None:
        state["curve"].append([0, _evaluate(model, tokenizer, stream, cfg)])

    state["stop_reason"] = None
    # Unique per worker-group incarnation, never restored from a checkpoint:
    # a counter could repeat if two restarts resume from the same checkpoint.
    incarnation = uuid.uuid4().hex
    for step in range(state["step"], cfg.steps):
        try:
            outcome = engine.step(step, batch_fn, loss_fn, request_id=f"{incarnation}:{step}")
        except BudgetUnavailable as exc:
            raise TrainingError(
                f"privacy ledger unavailable, step {step} not taken: {exc}"
            ) from exc
        if not outcome.taken:
            state["stop_reason"] = "budget"
            if rank == 0:
                log.warning("ledger denied step %d: %s", step, outcome.reason)
            break
        state["step"], state["ledger_position"] = step + 1, outcome.position
        if rank == 0:
            _append_audit(
                job.audit_log, step, outcome.position, state["attempt"], outcome.nonfinite
            )
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            if rank == 0 and stream is not None:
                state["curve"].append([step + 1, _evaluate(model, tokenizer, stream, cfg)])
            _report(job, objective, optimizer, state, rank)
    else:
        state["stop_reason"] = "steps"
    if (
        rank == 0
        and stream is not None
        and (not state["curve"] or state["curve"][-1][0] != state["step"])
    ):
        state["curve"].append([state["step"], _evaluate(model, tokenizer, stream, cfg)])
    _report(job, objective, optimizer, state, rank)


# --------------------------------------------------------------------------- the launcher
