"""Distributed DP-SGD on Ray Train: the launcher and the per-worker training loop.

:func:`run_training` (the driver, e.g. the ``train`` pipeline stage) counts
the records, fixes the sample rate ``q = B / N`` and the noise multiplier
(``cfg.noise_multiplier``, or :func:`privcode.dp.accounting.calibrate` for
``cfg.epsilon`` over ``cfg.steps`` steps when it is 0), opens the run's
privacy ledger and starts a ``TorchTrainer`` of ``cfg.num_workers`` workers
(gloo on CPU, NCCL on GPU) running :func:`train_loop_per_worker`; with
``num_workers`` 0 Ray Train's local mode runs that loop in the calling process
(one rank, no worker group to start, no restarts:
:mod:`privcode.train.checkpoints`).

Every worker builds the method's objective (:mod:`privcode.train.methods`:
the LoRA junior plus, for PrivCode++-style methods, the PrivLC encoders and
prefix decoder; seeded init, then broadcast from rank 0) and tokenises only
its shard ``{i : i mod W = rank}``. Every trainable parameter of the
objective is clipped jointly per record and updated by one optimiser. One
step ``t``:

1. rank 0 asks the ledger to reserve one step ``(sigma, q)``; the ledger
   fsyncs its log BEFORE granting, and rank 0 broadcasts the decision. A
   denied step is never taken: all ranks leave the loop together. An
   unreachable ledger stops training (fail-closed: an error, never a step);
2. each rank takes its Poisson sample ``S_t ∩ shard`` (:mod:`privcode.dp.sampler`;
   the schedule's seed is drawn from OS entropy by rank 0 at every (re)start
   and broadcast, never stored; in secure mode rank 0 draws the mask from
   ``os.urandom`` and broadcasts it) and computes the clipped sum of
   per-record gradients of the method's per-record loss
   (:mod:`privcode.dp.dpsgd`), with dropout masks and per-record latent
   noise from the same secret (:mod:`privcode.dp.randomness`), never from
   ``train.seed`` or a record's position. A record whose gradient is not
   finite contributes zero (counted in the private audit log);
3. rank 0 adds N(0, sigma^2 C^2) once, the sums are all-reduced and divided
   by ``q N``; every rank applies the same AdamW update to the LoRA weights.
   An empty sample still takes the (noise-only) step.

Checkpoints (``ray.train.report`` with a ``ray.train.Checkpoint`` from rank
0 every ``cfg.checkpoint_every`` steps and at the end) hold the adapter, the
optimizer state, the next step, the ledger position and the public
held-out loss curve. ``FailureConfig(max_failures)`` restarts the worker
group from the last checkpoint; steps re-run after a failure are reserved
(charged) again, because the ledger never rolls back: a crash can only
over-count epsilon. Rank 0 appends each applied step to a PRIVATE audit log
(``applied_steps.jsonl`` in the training storage, never released): step,
ledger position, attempt, time, and the number of records whose gradient
was not finite.

What leaves a worker: the noised gradient (through the weights), the step
counter, the ledger decisions, and the loss on PUBLIC held-out code (the
base model's held-out standard-library files) computed from the weights,
which is post-processing of the DP release. Per-record or per-batch
training losses, norms, clip counts and batch sizes are never logged or
reported: they are computed from private records without noise. Step
times grow with the sampled batch and its longest record (an un-noised
membership signal): they, restart counts and grant ids stay in the private
audit log and the ledger's WAL; the release's history holds the DP events
(sigma, q, steps) only (:func:`privcode.train.artifact.released_history`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from privcode.config import TrainConfig
from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_json, sha256_file

log = logging.getLogger("privcode.train")

__all__ = ["TrainingError", "TrainJob", "UnsafeTestOptions", "run_training",
           "train_loop_per_worker"]

# Ledger decisions broadcast by rank 0 (int64 tensor [code, position]).
_GRANTED, _DENIED, _LEDGER_ERROR = 1, 0, -1


class TrainingError(PrivcodeError):
    """Training could not produce a DP release (budget spent, ledger down, workers failed)."""


@dataclass(frozen=True)
class UnsafeTestOptions:
    """TEST ONLY switches that void the privacy guarantee. Never set by a config file.

    ``noise_off``: sigma = 0 and no ledger (epsilon is infinite); the release
    is marked ``dp: false``. ``fixed_seed``: sampling and noise from this
    seed instead of OS entropy (anyone knowing it can replay batches and
    noise). Both exist so tests can compare runs step for step.
    """

    noise_off: bool = False
    fixed_seed: int | None = None

    @property
    def active(self) -> bool:
        return self.noise_off or self.fixed_seed is not None


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; built by :func:`run_training`, identical on every rank."""

    cfg: TrainConfig
    data_path: str
    corpus_sha256: str     # checked by rank 0 before reading; private (never released)
    base_path: str
    num_records: int
    sample_rate: float
    noise_multiplier: float
    run_id: str            # ledger name ('' = no ledger: unsafe noise-off only)
    audit_log: str
    unsafe: UnsafeTestOptions = UnsafeTestOptions()
    local_checkpoints: str = ""  # Ray Train local mode: where checkpoints are written


# --------------------------------------------------------------------------- worker helpers


def _secret_seed(job: TrainJob) -> int:
    """The schedule/noise seed: fresh OS entropy (secret), unless the unsafe fixed seed is set.

    Fresh at every (re)start: a step re-run after a failure gets a new,
    independent batch and noise draw, as its new ledger charge assumes.
    """
    if job.unsafe.fixed_seed is not None:
        return int(job.unsafe.fixed_seed) % (1 << 126)
    return secrets.randbits(126)


def _broadcast_ints(values: list[int], device: Any) -> list[int]:
    """Rank 0's ``values`` on every rank (int64; no-op with one process)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


def _sample_indices(schedule: Any, randomness: Any, step: int, rank: int, world: int,
                    device: Any) -> list[int]:
    """Global indices of ``S_step`` in this rank's shard.

    Standard mode: the seeded schedule (every rank draws the same mask).
    Secure mode: rank 0 draws the mask from ``os.urandom`` and broadcasts it.
    """
    if not randomness.secure:
        return [int(i) for i in schedule.indices(step, rank, world)]
    import numpy as np
    import torch
    import torch.distributed as dist

    from privcode.dp.randomness import secure_poisson_mask
    from privcode.dp.sampler import shard_of

    n = schedule.num_records
    mask = secure_poisson_mask(n, schedule.sample_rate) if rank == 0 else np.zeros(n, bool)
    if world > 1:
        t = torch.from_numpy(mask.astype(np.uint8)).to(device)
        dist.broadcast(t, src=0)
        mask = t.cpu().numpy().astype(bool)
    shard = shard_of(n, rank, world)
    return [int(i) for i in shard[mask[shard]]]


def _all_reduce_count(value: int, world: int, device: Any) -> int:
    if world == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


def _reserve(job: TrainJob, ledger: Any, rank: int, device: Any,
             request_id: str) -> tuple[int, int, str | None]:
    """Rank 0 reserves one step from the ledger; every rank gets (code, position, reason).

    ``request_id`` names this release (``"<incarnation>:<step>"``): a call Ray
    re-sends after a ledger actor restart is answered from the WAL instead of
    being charged twice, while a step recomputed by a new worker-group
    incarnation (fresh noise: a second release) carries a new id and is charged.
    """
    code, position, reason = _GRANTED, -1, None
    if rank == 0 and job.run_id:
        import ray

        try:
            d = ray.get(ledger.reserve.remote(job.noise_multiplier, job.sample_rate, 1,
                                              request_id=request_id), timeout=120)
            code = _GRANTED if d.get("granted") else _DENIED
            position, reason = int(d.get("position", -1)), d.get("reason")
        except Exception as exc:  # noqa: BLE001 - any ledger failure must stop training
            code, reason = _LEDGER_ERROR, f"{type(exc).__name__}: {exc}"
    code, position = _broadcast_ints([code, position], device)
    return code, position, reason


def _public_eval_stream(base_path: str, tokenizer: Any, max_tokens: int):
    """Tokens of the base model's held-out PUBLIC files (never seen in pretraining)."""
    from privcode.models import corpus as C

    files = None
    info = Path(base_path) / "build_info.json"
    with contextlib.suppress(OSError, ValueError):
        names = json.loads(info.read_text(encoding="utf-8")).get("heldout_files")
        if names:
            from privcode.data.stdlib import stdlib_dir

            root = stdlib_dir()
            files = [C.SourceFile(n, n.split("/")[0].removesuffix(".py"),
                                  (root / n).read_text(encoding="utf-8")) for n in names]
    if not files:
        from privcode.models.base import HELDOUT_FRACTION

        files = C.split_heldout(C.public_corpus(), HELDOUT_FRACTION)[1]
    stream, _ = C.token_stream(tokenizer, files, max_tokens=max_tokens)
    return stream


def _evaluate(model: Any, tokenizer: Any, stream: Any, cfg: TrainConfig) -> float | None:
    import torch

    from privcode.models import corpus as C

    if stream is None or stream.numel() < 2:
        return None
    with torch.no_grad():
        out = C.evaluate_loss(model, tokenizer, stream, seq_len=min(cfg.max_length, 256),
                              max_tokens=cfg.eval_tokens)
    return round(float(out["loss"]), 5)


def _report(job: TrainJob, objective: Any, optimizer: Any, state: dict[str, Any],
            rank: int) -> None:
    """Every rank calls this (a barrier); rank 0 attaches the checkpoint."""
    from privcode.train.build import save_checkpoint_files
    from privcode.train.checkpoints import report_checkpoint

    # What Ray Train logs and shows: public values only. The ledger position (a grant
    # id) and the attempt (a restart count) stay in the checkpoint's private state.
    metrics = {k: state[k] for k in ("step", "stop_reason")}
    metrics["public_heldout_loss"] = state["curve"][-1][1] if state["curve"] else None

    def write(d: Path) -> None:
        save_checkpoint_files(d, objective, optimizer)
        atomic_write_json(d / "state.json", state)

    report_checkpoint(metrics, write if rank == 0 else None, job.local_checkpoints or None,
                      state["step"])


def _write_private_stats(job: TrainJob, rank: int, world: int, stats: dict[str, int],
                         device: Any) -> None:
    """Counts over the private shards (e.g. code Python cannot tokenize), summed over ranks.

    Written next to the private audit log (training storage, never released
    nor reported: they are exact, un-noised statistics of the private data).
    """
    counts = [int(stats.get("untokenizable", 0))]
    if world > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor(counts, dtype=torch.int64, device=device)
        dist.all_reduce(t)
        counts = [int(v) for v in t.tolist()]
    if rank == 0:
        path = Path(job.audit_log).with_name(Path(job.audit_log).name.replace(
            ".applied_steps.jsonl", ".private_stats.json"))
        atomic_write_json(path, {"untokenizable_records": counts[0]})


def _append_audit(path: str, step: int, position: int, attempt: int, nonfinite: int) -> None:
    line = json.dumps({"step": step, "ledger_position": position, "attempt": attempt,
                       "time": round(time.time(), 3), "nonfinite_records": nonfinite}) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


# --------------------------------------------------------------------------- the loop


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker function: DP-SGD over this rank's shard (see the module docstring)."""
    import ray.train
    import torch

    from privcode.data.records import read_records
    from privcode.dp.dpsgd import PerSampleClipper, apply_flat_gradient, privatize
    from privcode.dp.randomness import SecretRandomness, record_key
    from privcode.dp.sampler import PoissonSchedule, shard_of
    from privcode.train.build import NonPrivateSum, build_objective, load_checkpoint
    from privcode.train.data import collate, encode_records
    from privcode.train.methods import get_method

    job: TrainJob = config["job"]
    cfg = job.cfg
    method = get_method(cfg.method)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")

    checkpoint = ray.train.get_checkpoint()
    objective, tokenizer, _ = build_objective(method, cfg, job.base_path, device,
                                              will_restore=checkpoint is not None)
    model = objective.lm
    clipper = (PerSampleClipper(objective, mode=cfg.grad_sample_mode,
                                max_grad_norm=cfg.max_grad_norm)
               if method.dp else NonPrivateSum(objective))
    params = clipper.params  # the flat gradient's order
    optimizer = (torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
                 if cfg.optimizer == "sgd"
                 else torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay))
    state = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = load_checkpoint(Path(d), objective, optimizer)
    state = state or {
        "step": 0, "ledger_position": None, "stop_reason": None, "attempt": 0, "curve": []}
    state["attempt"] += 1
    if world > 1:
        import torch.distributed as dist

        for name, p in objective.named_parameters():
            if p.requires_grad or not name.startswith("lm."):  # LoRA and PrivLC
                dist.broadcast(p.data, src=0)

    # The private data: this rank tokenises its own shard only.
    if rank == 0 and sha256_file(job.data_path) != job.corpus_sha256:
        raise TrainingError(f"{job.data_path} changed since the run started")
    records = read_records(job.data_path)
    if len(records) != job.num_records:
        raise TrainingError(f"{job.data_path}: expected {job.num_records} records, got {len(records)}")
    shard = shard_of(job.num_records, rank, world)
    private_stats: dict[str, int] = {}
    encoded = encode_records([records[i] for i in shard], tokenizer, cfg.max_length,
                             stats=private_stats)
    del records
    # Per-record randomness is keyed by the record's content, never its position.
    keys = [record_key(e.input_ids, e.segments) for e in encoded]
    _write_private_stats(job, rank, world, private_stats, device)

    seed = _broadcast_ints(_split(_secret_seed(job)), device)
    schedule = PoissonSchedule(job.num_records, job.sample_rate, seed[0] << 63 | seed[1])
    randomness = SecretRandomness(schedule.seed, secure=cfg.secure_rng, rank=rank)

    def loss_fn(module: Any, batch: Any) -> Any:
        return module(batch)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    ledger = None
    if rank == 0 and job.run_id:
        from privcode.dp.ledger import get_ledger

        ledger = get_ledger(job.run_id)
    stream = (_public_eval_stream(job.base_path, tokenizer, cfg.eval_tokens)
              if rank == 0 and cfg.eval_tokens > 0 else None)
    if rank == 0 and not state["curve"] and stream is not None:
        state["curve"].append([0, _evaluate(model, tokenizer, stream, cfg)])

    state["stop_reason"] = None
    expected_batch = job.sample_rate * job.num_records
    # Unique per worker-group incarnation, never restored from a checkpoint:
    # a counter could repeat if two restarts resume from the same checkpoint.
    incarnation = uuid.uuid4().hex
    for step in range(state["step"], cfg.steps):
        code, position, reason = _reserve(job, ledger, rank, device, f"{incarnation}:{step}")
        if code == _LEDGER_ERROR:
            raise TrainingError(f"privacy ledger unavailable, step {step} not taken"
                                + (f": {reason}" if reason else ""))
        if code == _DENIED:
            state["stop_reason"] = "budget"
            if rank == 0:
                log.warning("ledger denied step %d: %s", step, reason)
            break
        chosen = _sample_indices(schedule, randomness, step, rank, world, device)
        local = [(i - rank) // world for i in chosen]
        # Per-record randomness (the VAE's eps) is keyed by the record's content
        # and a per-step secret, so it neither depends on other records nor on
        # how records fall on workers; dropout masks come from the secret too.
        batch = (collate([encoded[j] for j in local], pad_id, device=device, step=step,
                         record_keys=torch.tensor([keys[j] for j in local], dtype=torch.long),
                         record_secret=randomness.record_secret(step))
                 if local else None)
        randomness.seed_step(step)
        local_sum = clipper.clipped_sum(loss_fn, batch, len(local))
        nonfinite = _all_reduce_count(getattr(clipper, "last_nonfinite", 0), world, device)
        grad = privatize(local_sum, noise_multiplier=job.noise_multiplier,
                         max_grad_norm=cfg.max_grad_norm, expected_batch_size=expected_batch,
                         add_noise=rank == 0, secure=randomness.secure,
                         generator=randomness.noise_generator(device) if rank == 0 else None)
        apply_flat_gradient(params, grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del batch, local_sum, grad
        state["step"], state["ledger_position"] = step + 1, position
        if rank == 0:
            _append_audit(job.audit_log, step, position, state["attempt"], nonfinite)
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            if rank == 0 and stream is not None:
                state["curve"].append([step + 1, _evaluate(model, tokenizer, stream, cfg)])
            _report(job, objective, optimizer, state, rank)
    else:
        state["stop_reason"] = "steps"
    if rank == 0 and stream is not None and (not state["curve"] or state["curve"][-1][0] != state["step"]):
        state["curve"].append([state["step"], _evaluate(model, tokenizer, stream, cfg)])
    _report(job, objective, optimizer, state, rank)


def _split(seed: int) -> list[int]:
    """A 126-bit seed as two non-negative int64 words (for a broadcast)."""
    return [seed >> 63, seed & ((1 << 63) - 1)]


# --------------------------------------------------------------------------- the launcher


def _ledger_id(run_name: str, ledger_dir: Path, store: Any) -> str:
    """The ledger actor's cluster-wide name (also the metrics' ``run`` tag).

    Tied to the WAL's directory, so two runs of the same name elsewhere (other
    out_dir, other data) never share it; the directory's path holds a corpus
    digest, so the name is a keyed HMAC of it (:meth:`PrivacyStore.opaque`),
    never a plain hash. A WAL written before this rule keeps the id in its
    header (changing it would lock the ledger with a conflict).
    """
    from privcode.dp.ledger import WAL_NAME, read_wal

    wal = ledger_dir / WAL_NAME
    if wal.is_file():
        with contextlib.suppress(Exception):
            legacy = (read_wal(wal).header or {}).get("run_id")
            if isinstance(legacy, str) and legacy.startswith(f"{run_name}-"):
                return legacy
    return f"{run_name}-{store.opaque('ledger', str(ledger_dir.resolve()), 16)}"


def _check_room(ledger: Any, cfg: TrainConfig, sigma: float, q: float, ledger_dir: Path) -> None:
    """Refuse early (before starting workers) when not even one step fits in the budget.

    Only a courtesy: the ledger's reservation inside the loop is what
    enforces the budget.
    """
    import ray

    from privcode.dp.accounting import DPEvent, epsilon

    spent = ray.get(ledger.spent.remote())
    history = [DPEvent.from_dict(e) for e in spent.get("history", [])]
    if epsilon([*history, DPEvent(sigma, q, 1)], cfg.delta, cfg.accountant) > cfg.epsilon:
        raise TrainingError(
            f"no DP-SGD step can be taken: the privacy budget of this run's ledger ({ledger_dir}) "
            f"is already spent (epsilon {spent.get('epsilon', 0.0):.4g} of {cfg.epsilon:g}). "
            "Training again on the same data needs a new budget: use another run.name (and "
            "account for both releases).")


def noise_for(cfg: TrainConfig, sample_rate: float) -> tuple[float, bool]:
    """(sigma, calibrated): the configured multiplier, or the calibrated one when it is 0."""
    if cfg.noise_multiplier > 0:
        return float(cfg.noise_multiplier), False
    from privcode.dp.accounting import calibrate

    return float(calibrate(cfg.epsilon, cfg.delta, sample_rate, cfg.steps, cfg.accountant)), True


def run_training(cfg: TrainConfig, *, data_path: str | Path, base_path: str | Path,
                 out_dir: str | Path, ledger_dir: str | Path, run_name: str,
                 storage_dir: str | Path, unsafe: UnsafeTestOptions | None = None,
                 keep_storage: bool = False, privacy_store: str | Path | None = None
                 ) -> dict[str, Any]:
    """Train with DP-SGD on Ray Train; write the release into ``out_dir``; return its summary.

    Release (``out_dir``): ``adapter/`` (peft ``save_pretrained``) and
    ``privacy.json`` (method, epsilon under RDP and PRV from the ledger's
    history, delta, the history's DP events, C, q, N, sigma, steps taken, the
    RNG mode, the adjacency, an opaque dataset id, the base model path). The
    ledger's WAL lives in
    ``ledger_dir`` (outside the release, kept across runs: a second run on
    the same data spends from the same budget). Ray Train checkpoints and the
    audit log go to ``storage_dir/<unique name>``, removed after success
    unless ``keep_storage``. ``privacy_store`` (default: beside
    ``ledger_dir`` (``privacy-store/``), or ``PRIVCODE_PRIVACY_STORE``) holds the key of
    the opaque dataset id (:mod:`privcode.dp.store`). Raises
    :class:`TrainingError` when no step could be taken.
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from privcode.cluster.local import connect
    from privcode.data.records import read_records
    from privcode.train.artifact import privacy_record, write_junior_release
    from privcode.train.checkpoints import fit
    from privcode.train.methods import get_method

    unsafe = unsafe or UnsafeTestOptions()
    method = get_method(cfg.method)
    if not method.dp:
        if not cfg.allow_non_private:
            raise TrainingError(f"train.method={cfg.method!r} trains WITHOUT differential privacy "
                                "(NOT PRIVATE); it is refused unless train.allow_non_private "
                                "is true (audits and comparisons only)")
        msg = (f"train.method={cfg.method!r}: this run is NOT PRIVATE (no clipping, no noise, "
               "no privacy ledger). Its release must never be treated as a DP artifact.")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.error(msg)
    non_private = unsafe.noise_off or not method.dp
    data_path, base_path = Path(data_path).resolve(), Path(base_path).resolve()
    out_dir, ledger_dir = Path(out_dir), Path(ledger_dir).resolve()
    from privcode.dp.store import PrivacyStore, resolve_store

    store = PrivacyStore(privacy_store if privacy_store is not None
                         else resolve_store("", ledger_dir))
    n = len(read_records(data_path))
    corpus_sha = sha256_file(data_path)
    dataset_id = store.dataset_id(data_path)
    q = cfg.expected_batch_size / n
    if q > 1:
        raise TrainingError(f"train.expected_batch_size={cfg.expected_batch_size} exceeds the "
                            f"{n} training records (sample rate must be <= 1)")
    if cfg.delta >= 1.0 / n:
        warnings.warn(f"train.delta={cfg.delta} is not below 1/N = {1 / n:.3g}: the guarantee "
                      "is weak", stacklevel=2)
    if unsafe.active:
        msg = ("UNSAFE TEST OPTIONS ACTIVE (" + ", ".join(
            k for k, v in dataclasses.asdict(unsafe).items() if v not in (False, None))
            + "): this training run is NOT differentially private")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.error(msg)
    if not cfg.secure_rng and not non_private:
        log.warning("train.secure_rng is off: sampling and noise come from a secret-seeded "
                    "fast PRNG, not a CSPRNG (set train.secure_rng for production releases)")
    sigma, calibrated = (0.0, False) if non_private else noise_for(cfg, q)

    if not ray.is_initialized():
        connect()
    run_id = ""
    ledger = None
    if not non_private:
        from privcode.dp.ledger import open_ledger

        run_id = _ledger_id(run_name, ledger_dir, store)
        ledger = open_ledger(run_id, ledger_dir, cfg.epsilon, cfg.delta, cfg.accountant)
        try:
            _check_room(ledger, cfg, sigma, q, ledger_dir)
        except BaseException:
            from privcode.dp.ledger import close_ledger

            close_ledger(run_id)
            raise

    storage_root = Path(storage_dir).resolve()
    storage_root.mkdir(parents=True, exist_ok=True)
    name = f"train-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    audit_log = storage_root / f"{name}.applied_steps.jsonl"
    local = cfg.num_workers == 0  # Ray Train local mode: the loop runs in this process
    job = TrainJob(cfg=cfg, data_path=str(data_path), corpus_sha256=corpus_sha,
                   base_path=str(base_path), num_records=n, sample_rate=q, noise_multiplier=sigma,
                   run_id=run_id, audit_log=str(audit_log), unsafe=unsafe,
                   local_checkpoints=str(storage_root / name) if local else "")
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})}
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config={"job": job},
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(name=name, storage_path=str(storage_root),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    started = time.time()
    spent: dict[str, Any] = {}
    history: list[dict] = []
    try:
        try:
            result = fit(trainer, cfg.num_workers, cfg.cpus_per_worker)
        except Exception as exc:
            restarts = ("Ray Train local mode: no restarts" if local
                        else f"after up to {cfg.max_failures} restarts")
            raise TrainingError(f"DP training failed ({restarts}): "
                                f"{type(exc).__name__}: {exc}") from exc
        if result.checkpoint is None:
            raise TrainingError("DP training ended without a checkpoint")
        ckpt_dir = Path(tempfile.mkdtemp(prefix="privcode-final-"))
        with result.checkpoint.as_directory() as d:
            state = json.loads((Path(d) / "state.json").read_text(encoding="utf-8"))
            if state["step"] == 0:
                raise TrainingError(
                    "no DP-SGD step was taken: the privacy budget of this run's ledger "
                    f"({ledger_dir}) is already spent. Training again on the same data needs a "
                    "new budget: use another run.name (and account for both releases).")
            shutil.copytree(Path(d), ckpt_dir, dirs_exist_ok=True)
        if ledger is not None:
            spent = ray.get(ledger.spent.remote())
            history = ray.get(ledger.history.remote())
    finally:
        if ledger is not None:
            from privcode.dp.ledger import close_ledger

            # The actor is detached: stop it; its WAL keeps the state for the next open.
            close_ledger(run_id)
    seconds = time.time() - started
    privacy = privacy_record(
        cfg, method, spent=spent, grants=history, sigma=sigma, calibrated=calibrated,
        sample_rate=q, num_records=n, state=state, dataset_id=dataset_id, base_path=base_path,
        unsafe=dataclasses.asdict(unsafe) if unsafe.active else None,
        dp=not (unsafe.active or non_private))
    try:
        write_junior_release(out_dir, ckpt_dir, cfg, method, privacy, base_path)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if not keep_storage:
        shutil.rmtree(storage_root / name, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            audit_log.unlink()
        with contextlib.suppress(OSError):
            storage_root.rmdir()  # only when no other run's files are left in it
    return {**{k: privacy[k] for k in (
        "dp", "method", "epsilon", "epsilon_rdp", "epsilon_prv", "epsilon_budget", "delta",
        "accountant", "ledger_steps", "noise_multiplier", "noise_calibrated", "max_grad_norm", "sample_rate",
        "expected_batch_size", "num_records", "steps_requested", "steps_taken", "stop_reason",
        "num_workers", "public_heldout_loss_curve", "dataset_id", "rng", "base_model")},
        "adjacency": "add/remove one record (N public)",
        "train_seconds": round(seconds, 2), "adapter": "adapter", "conditioning": method.conditioning,
        "audit_log": str(audit_log), "privacy_store": str(store.root)}
