"""The premium model: LoRA fine-tuning on the synthetic Stage II data, without DP.

The premium model never sees private data: its training set is
``synthetic.parquet``, a function of the released DP artifact only, so by
post-processing it inherits that release's (epsilon, delta) guarantee and
needs no DP of its own (no clipping, no noise, no ledger). :func:`run_premium`
refuses a training file that is not a synthetic Stage II dataset (its rows
carry the Stage II provenance) and, before training, one whose provenance
does not establish a DP source (:func:`source_privacy`: missing, unparsable
or mixed provenance, or a release with ``dp`` false or missing), unless
``premium.allow_non_dp_source`` is set; then ``premium.json`` says plainly
that NO DP guarantee holds.

Training: instruction tuning on ``prompt + "\\n" + code + EOS`` with the
loss on the code tokens (mean token cross-entropy), LoRA on every linear
layer of the premium base, AdamW, data parallel over Ray Train workers:
plain DDP (gloo on CPU, NCCL on GPU), or DeepSpeed ZeRO-1/2/3
(``jobs/configs/deepspeed/zero{1,2,3}.json``) for large models on GPUs; with
``num_workers`` 0, Ray Train's local mode (one rank in the calling process,
:mod:`privcode.models.ray_train`). A held-out fraction of the synthetic data
gives an eval loss per epoch.

Release (``out_dir``): ``adapter/`` (peft) and ``premium.json`` (base model,
data hash, settings, loss curves, and the privacy block: ``dp``, the
inherited ``epsilon``/``delta``, ``guarantee``, ``post_processing_of`` (the
Stage II provenance) and ``statement``; for a non-DP source ``dp`` false,
``no_dp_guarantee`` true, ``guarantee`` "NONE: ..." and ``privacy_warning``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import ray
import ray.train
import torch

from privcode.artifacts.premium import PremiumPrivacy, PremiumRecord
from privcode.cluster.local import connect
from privcode.config import PremiumConfig, section_to_dict
from privcode.errors import PrivcodeError, import_extra
from privcode.models.chat import CHAT_TEMPLATE
from privcode.models.encoding import CODE, collate, encode_records, token_ce
from privcode.models.loading import attach_lora, load_causal_lm, load_tokenizer, resolve_dtype
from privcode.models.ray_train import fit, report_checkpoint, torch_trainer
from privcode.utils import atomic_write_json, sha256_file

log = logging.getLogger("privcode.premium")

__all__ = ["PremiumError", "deepspeed_config", "run_premium", "source_privacy"]

DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "deepspeed"
#: The keys of the Stage II provenance JSON (privcode.synth.pipeline) that must be present.
PROVENANCE_KEYS = ("release_sha256", "method", "conditioning", "dp")


class PremiumError(PrivcodeError):
    """The premium fine-tune cannot run or failed."""


@dataclass(frozen=True)
class PremiumJob:
    cfg: PremiumConfig
    data_path: str
    model_path: str
    num_records: int
    local_checkpoints: str = ""  # Ray Train local mode: where checkpoints are written


def deepspeed_config(cfg: PremiumConfig, use_bf16: bool) -> dict[str, Any]:
    """The ZeRO config of ``cfg.deepspeed`` with its "auto" values filled in.

    ``use_bf16``: whether the resolved ``premium.dtype`` is bfloat16 (DeepSpeed then casts
    the module's parameters to bf16 and keeps fp32 master weights in the optimizer).
    """
    path = DEEPSPEED_DIR / f"{cfg.deepspeed}.json"
    ds = json.loads(path.read_text(encoding="utf-8"))
    ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
    ds["optimizer"]["params"].update({"lr": cfg.lr, "weight_decay": cfg.weight_decay})
    ds["bf16"]["enabled"] = bool(use_bf16)
    return ds


def _read_synthetic(path: Path) -> list[tuple[str, str]]:
    table = pq.read_table(path)
    missing = {"prompt", "code", "provenance"} - set(table.column_names)
    if missing:
        raise PremiumError(
            f"{path}: not a Stage II synthetic dataset (missing columns "
            f"{sorted(missing)}); the premium model trains on synthetic data only"
        )
    rows = table.select(["prompt", "code"]).to_pylist()
    return [(r["prompt"] or "", r["code"] or "") for r in rows]


def _split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = int(round(n * fraction)) if n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


class _Pair:
    __slots__ = ("code", "prompt")

    def __init__(self, prompt: str, code: str):
        self.prompt, self.code = prompt, code


def _code_loss(model: Any, batch: dict[str, Any]) -> Any:
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    mask = (batch["segments"][:, 1:] == CODE).float()
    ce = token_ce(logits, ids[:, 1:])
    return (ce * mask).sum() / mask.sum().clamp(min=1.0)


def _heldout_loss(
    net: Any, held: list, batch_size: int, pad: int, device: Any, rank: int, world: int
) -> float:
    """Mean held-out batch loss, every rank taking every ``world``-th batch.

    Every rank makes the same number of forward passes: under ZeRO-3 the parameters are
    partitioned and each forward gathers them collectively, so a rank that skipped the
    evaluation (as rank 0 alone once did) would hang the others.  A rank short of a batch
    in the last round runs a stand-in batch with weight 0.  The sums are all-reduced.
    """
    rounds = math.ceil(len(held) / (batch_size * world))
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    net.eval()
    with torch.no_grad():
        for r in range(rounds):
            start = (r * world + rank) * batch_size
            rows = held[start : start + batch_size]
            loss = _code_loss(net, collate(rows or held[:batch_size], pad, device=device))
            if rows:
                sums += torch.stack([loss.detach().double(), sums.new_tensor(1.0)])
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    return float(sums[0] / sums[1])


def _premium_model(model_path: str, cfg: PremiumConfig, dtype: torch.dtype) -> Any:
    """The premium base in ``dtype`` (frozen) with fp32 LoRA adapters (peft keeps adapter
    weights in fp32 over a half-precision base); HF gradient checkpointing if configured
    (non-reentrant; the input embeddings' output requires grad so every checkpointed
    segment has a grad-carrying input, as peft's own recipe does)."""
    base = load_causal_lm(model_path, dtype=dtype)
    if cfg.gradient_checkpointing:
        enable = getattr(base, "activation_checkpointing_enable", None)  # transformers >= 5.x
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        base.enable_input_require_grads()
        base.config.use_cache = False
    model = attach_lora(base, r=cfg.lora_r, alpha=cfg.lora_alpha)
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise PremiumError(f"premium: LoRA weight {name} is {p.dtype}, expected float32")
    return model


def _adapter_state(model: Any, *, deepspeed: bool) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) weights by name, full and in fp32, on the CPU.

    Under DeepSpeed, every rank must call this, in the same parameter order:
    ``safe_get_full_fp32_param`` assembles each weight from the optimizer's fp32 master
    partitions with a collective (ZeRO-1/2: an all-reduce of the fragments; ZeRO-3: the
    partitions, the module's own copy being an empty placeholder and, with bf16, only a
    bf16 copy besides). A rank skipping it, as a rank-0-only save would, hangs the others.
    """
    state: dict[str, torch.Tensor] = {}
    get_full = None
    if deepspeed:
        from deepspeed.utils import safe_get_full_fp32_param as get_full
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = get_full(p) if get_full is not None else None
        state[name] = (p.detach() if full is None else full).float().cpu().clone()
    return state


def premium_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: data-parallel LoRA fine-tuning (DDP or DeepSpeed)."""

    job: PremiumJob = config["job"]
    cfg = job.cfg
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    device = ray.train.torch.get_device() if cfg.use_gpu else torch.device("cpu")
    tokenizer = load_tokenizer(job.model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, device)
    model = _premium_model(job.model_path, cfg, dtype)
    pairs = _read_synthetic(Path(job.data_path))
    train_idx, eval_idx = _split(len(pairs), cfg.eval_fraction, cfg.seed)
    shard = train_idx[rank::world]
    encoded = encode_records([_Pair(*pairs[i]) for i in shard], tokenizer, cfg.max_length)
    held = encode_records([_Pair(*pairs[i]) for i in eval_idx], tokenizer, cfg.max_length)
    # A small synthetic set (a weak junior keeps few samples) shrinks the batch rather
    # than fail; steps are equal on every rank (DDP synchronises each one).
    batch_size = min(cfg.batch_size, len(train_idx) // world)
    if batch_size == 0:
        raise PremiumError(f"{len(train_idx)} training records are fewer than the {world} workers")
    steps = len(train_idx) // (world * batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.deepspeed:
        deepspeed = import_extra("deepspeed", "train", f"premium.deepspeed: {cfg.deepspeed}")
        ds = deepspeed_config(cfg, use_bf16=dtype == torch.bfloat16)
        net, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    else:
        model = model.to(device)
        net = ray.train.torch.prepare_model(model, move_to_device=False)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    curve: list[dict[str, Any]] = []
    for epoch in range(cfg.epochs):
        order = list(range(len(encoded)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        net.train()
        total = 0.0
        for s in range(steps):
            rows = [encoded[order[(s * batch_size + j) % len(order)]] for j in range(batch_size)]
            batch = collate(rows, pad, device=device)
            loss = _code_loss(net, batch)
            if cfg.deepspeed:
                net.backward(loss)
                net.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            total += float(loss.detach())
        point = {"epoch": epoch + 1, "train_loss": round(total / steps, 5), "eval_loss": None}
        if held:
            point["eval_loss"] = round(
                _heldout_loss(net, held, batch_size, pad, device, rank, world), 5
            )
        curve.append(point)
        if epoch + 1 < cfg.epochs:
            ray.train.report(point, checkpoint=None)
            continue
        # Every rank assembles the fp32 adapter (collective under DeepSpeed); rank 0 writes it.
        state = _adapter_state(model, deepspeed=bool(cfg.deepspeed))

        def write(d: Path, state: dict[str, torch.Tensor] = state) -> None:
            model.save_pretrained(str(d / "adapter"), state_dict=state)
            atomic_write_json(d / "curve.json", curve)

        report_checkpoint(
            point, write if rank == 0 else None, job.local_checkpoints or None, epoch + 1
        )


def run_premium(
    cfg: PremiumConfig,
    *,
    data_path: str | Path,
    model_path: str | Path,
    out_dir: str | Path,
    storage_dir: str | Path,
) -> dict[str, Any]:
    """Fine-tune the premium adapter on the synthetic data; write the release; return a summary.

    Refuses (PremiumError, before any training) data that is not Stage II
    synthetic data from a DP release unless ``cfg.allow_non_dp_source``
    (see :func:`source_privacy`).
    """
    data_path, model_path = Path(data_path).resolve(), Path(model_path).resolve()
    pairs = _read_synthetic(data_path)
    if len(pairs) < cfg.min_records:
        raise PremiumError(
            f"premium: {data_path} holds {len(pairs)} synthetic record(s), fewer than "
            f"premium.min_records={cfg.min_records}: Stage II (the synth stage) kept too little. "
            "Its funnel (stats.json beside that file) says which filter removed the samples: "
            "execution = the junior writes no runnable code (look at the base and train "
            "stages), round-trip = its code does not match its prompts, duplicates = it "
            "repeats itself (raise synth.temperature). More samples: synth.num_samples."
        )
    privacy = source_privacy(data_path, allow_non_dp=cfg.allow_non_dp_source)
    if cfg.deepspeed:  # here, before Ray Train starts its workers
        import_extra("deepspeed", "train", f"premium.deepspeed: {cfg.deepspeed}")
    job = PremiumJob(
        cfg=cfg, data_path=str(data_path), model_path=str(model_path), num_records=len(pairs)
    )
    out_dir = Path(out_dir)
    curve, seconds = _fit(job, out_dir, Path(storage_dir).resolve())
    record = PremiumRecord(
        model=str(model_path),
        data=str(data_path),
        data_sha256=sha256_file(data_path),
        records=len(pairs),
        curve=tuple(curve),
        config=section_to_dict(cfg),
        train_seconds=seconds,
        privacy=PremiumPrivacy.from_json(privacy, "premium privacy"),
        chat_template=CHAT_TEMPLATE,
    )
    record.write(out_dir / PremiumRecord.FILE)
    if not record.privacy.dp:
        log.error("premium release %s: %s", out_dir, record.privacy.privacy_warning)
    return record.summary().to_json()


def _fit(job: PremiumJob, out_dir: Path, storage: Path) -> tuple[list[dict[str, Any]], float]:
    """Run :func:`premium_loop` on Ray Train, copy the adapter to ``out_dir``; (curve, seconds)."""

    cfg = job.cfg
    if not ray.is_initialized():
        connect()
    storage.mkdir(parents=True, exist_ok=True)
    name = f"premium-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.num_workers == 0:  # Ray Train local mode: premium_loop runs in this process
        job = dataclasses.replace(job, local_checkpoints=str(storage / name))
    trainer = torch_trainer(
        premium_loop,
        {"job": job},
        name=name,
        storage=storage,
        num_workers=cfg.num_workers,
        cpus_per_worker=cfg.cpus_per_worker,
        use_gpu=cfg.use_gpu,
        max_failures=1,
    )
    started = time.time()
    try:
        result = fit(trainer, cfg.num_workers, cfg.cpus_per_worker)
    except Exception as exc:
        raise PremiumError(f"premium fine-tune failed: {type(exc).__name__}: {exc}") from exc
    if result.checkpoint is None:
        raise PremiumError("premium fine-tune ended without a checkpoint")
    with result.checkpoint.as_directory() as d:
        shutil.copytree(Path(d) / "adapter", out_dir / "adapter", dirs_exist_ok=True)
        curve = json.loads((Path(d) / "curve.json").read_text(encoding="utf-8"))
    shutil.rmtree(storage / name, ignore_errors=True)
    return curve, round(time.time() - started, 2)


def _provenance(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the one Stage II provenance of every row, None) or (None or it, what is wrong)."""

    col = pq.read_table(path, columns=["provenance"]).column("provenance")
    if col.null_count:
        return None, f"{col.null_count} of {len(col)} rows have no provenance"
    values = col.unique().to_pylist()
    if len(values) != 1:
        return None, (
            f"its rows carry {len(values)} different provenances (mixed sources); "
            "Stage II data from one release has exactly one"
        )
    try:
        prov = json.loads(values[0]) if isinstance(values[0], str) else None
    except ValueError:
        prov = None
    if not isinstance(prov, dict) or not set(PROVENANCE_KEYS) <= set(prov):
        return None, (
            f"its provenance {str(values[0])[:120]!r} is not Stage II provenance "
            f"JSON (an object with the keys {list(PROVENANCE_KEYS)})"
        )
    if prov.get("dp") is not True:
        return prov, (
            f"its source release (sha256 {str(prov['release_sha256'])[:16]}..., "
            f"method {prov['method']!r}) is NOT differentially private "
            f"(provenance dp: {json.dumps(prov['dp'])})"
        )
    if prov.get("no_dp_guarantee"):
        return prov, "its provenance says no_dp_guarantee"
    return prov, None


def source_privacy(path: str | Path, *, allow_non_dp: bool = False) -> dict[str, Any]:
    """The ``privacy`` block of ``premium.json`` for training on ``path``; refuses a non-DP source.

    The source is DP only if every row carries the same Stage II provenance
    and it says ``dp: true``; then the block names the inherited (epsilon,
    delta) (None if the provenance predates them). Anything else (missing,
    unparsable or mixed provenance, dp false or missing) raises PremiumError
    naming the file and ``premium.allow_non_dp_source``, unless
    ``allow_non_dp``: then the block says plainly that no DP guarantee holds.
    """
    path = Path(path)
    prov, problem = _provenance(path)
    if problem is None:
        eps, delta = prov.get("epsilon"), prov.get("delta")
        guarantee = (
            f"({eps}, {delta})-DP, inherited by post-processing from the Stage I "
            f"release {prov['release_sha256']}"
            if eps is not None
            else f"inherited by post-processing from the Stage I release "
            f"{prov['release_sha256']} (its epsilon/delta are in that release's "
            "privacy.json; this synthetic data predates their copy in provenance)"
        )
        return {
            "dp": True,
            "dp_training": False,
            "epsilon": eps,
            "delta": delta,
            "guarantee": guarantee,
            "no_dp_guarantee": False,
            "privacy_warning": None,
            "post_processing_of": prov,
            "statement": "trained only on Stage II synthetic data, a function of the "
            "released DP artifact: it inherits that release's (epsilon, "
            "delta) guarantee by post-processing",
        }
    if not allow_non_dp:
        raise PremiumError(
            f"{path}: {problem}. The premium model inherits a DP guarantee only "
            "from Stage II data synthesised from a DP release; refusing to "
            "train. Set premium.allow_non_dp_source=true to train anyway "
            "(UNSAFE: premium.json then says that no DP guarantee holds)"
        )
    warning = (
        f"NO differential-privacy guarantee: the premium model was fine-tuned on {path}, "
        f"which is not synthetic data from a DP release ({problem}); "
        "premium.allow_non_dp_source is set. This model is NOT PRIVATE"
    )
    log.error(warning)
    warnings.warn(warning, RuntimeWarning, stacklevel=3)
    return {
        "dp": False,
        "dp_training": False,
        "epsilon": None,
        "delta": None,
        "guarantee": f"NONE: {problem}; no (epsilon, delta) holds for this model",
        "no_dp_guarantee": True,
        "privacy_warning": warning,
        "post_processing_of": prov,
        "source_problem": problem,
        "statement": warning,
    }
