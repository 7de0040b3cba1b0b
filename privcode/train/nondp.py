"""The ``nondpft`` comparison: the junior fine-tuned on the private corpus WITHOUT DP.

NOT PRIVATE: it exists only so the audits can show what they detect when nothing protects the
data (no clipping, no noise, no ledger). It is written inside the audit stage's directory,
marked by :data:`MARKER` (``nondp.json``, ``"NOT_PRIVATE"``), and never released.

Objective: the ``nondpft`` method of :mod:`privcode.train.methods` on the same base, records
encoded as Stage I does; ``audit.nondp_steps`` AdamW steps on Poisson samples of rate
``q = B / N``, loss ``sum_i loss_i / (qN)``: the DP engine's non-private mode
(:mod:`privcode.dp.engine`). ``audit.nondp_finetune``: ``lora`` (the DP run's trainable
parameters) or ``full`` (every weight of the bare base). The output, a plain HF model directory
(LoRA merged) with the tokenizer and :data:`MARKER`, is read by
:func:`privcode.audit.scoring.load_scored_model`. The returned summary holds settings and
timings only, and nothing is logged about records. Design notes: docs/methods.md,
"train/nondp.py".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from privcode.artifacts.nondp import NondpRecord
from privcode.config import PipelineConfig
from privcode.data.records import read_records
from privcode.dp.dpsgd import trainable_parameters
from privcode.dp.engine import Privacy, make_private
from privcode.models.encoding import collate, encode_records
from privcode.models.loading import resolve_dtype
from privcode.models.placement import task_device
from privcode.train.build import build_objective
from privcode.train.methods import get_method

log = logging.getLogger("privcode.train")

__all__ = ["MARKER", "NOT_PRIVATE_NOTE", "train_nondp_comparison"]

MARKER = NondpRecord.FILE
NOT_PRIVATE_NOTE = (
    "trained WITHOUT differential privacy on the private corpus (audits only): "
    "it may reproduce private records verbatim; never copy it out of the audit "
    "directory"
)
#: Why this training is non-private, as the DP engine records it.
REASON = "audit.compare_nondp: the audits' NonDP-FT comparison (what leaks without DP)"


def train_nondp_comparison(
    cfg: PipelineConfig, *, data: str | Path, base: str, out_dir: str | Path
) -> dict[str, Any]:
    """Fine-tune the comparison (NOT PRIVATE) into ``out_dir``; its public summary."""
    a = cfg.audit
    msg = (
        "audit.compare_nondp: fine-tuning a comparison model WITHOUT differential privacy "
        "(NOT PRIVATE, audits only; it stays in the audit directory)"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    log.error(msg)
    steps = a.nondp_steps or cfg.train.steps
    lr = a.nondp_lr or cfg.train.lr
    batch = a.nondp_batch_size or cfg.train.expected_batch_size
    tcfg = dataclasses.replace(
        cfg.train, method="nondpft", allow_non_private=True, lr=lr, seed=a.seed
    )
    # The GPU of this stage's task with train.use_gpu (an error naming the key when none is
    # visible, never a silent CPU run); the forward in train.dtype as the junior's.
    device = task_device(cfg.train.use_gpu, "train.use_gpu")
    started = time.time()
    full = a.nondp_finetune == "full"
    objective, tokenizer, _ = build_objective(
        get_method("nondpft"), tcfg, base, device, will_restore=False, lora=not full
    )
    if full:  # the bare base, no LoRA wrappers: about 1.5x faster per step than through them
        for p in objective.lm.parameters():
            p.requires_grad_(True)
    params = trainable_parameters(objective)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.train.weight_decay)
    records = read_records(data)
    encoded = encode_records(records, tokenizer, cfg.train.max_length)
    del records
    n = len(encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # The DP engine's one off switch: Poisson batches of rate B/N, sum / (qN), no clip, no noise.
    mode = Privacy.non_private(REASON, seed=a.seed)
    engine = make_private(
        objective,
        optimizer,
        mode,
        num_records=n,
        sample_rate=min(1.0, batch / n),
        device=device,
        autocast_dtype=resolve_dtype(tcfg.dtype, device),
    )

    def rows(local: list[int], step: int) -> Any:
        return collate([encoded[i] for i in local], pad, device=device, step=step)

    for step in tqdm(range(steps), desc="nondpft (NOT PRIVATE)", mininterval=10.0):
        engine.step(step, rows, lambda module, batch: module(batch))
    objective.eval()
    model = objective.lm if full else objective.lm.merge_and_unload()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    record = NondpRecord(
        finetune=a.nondp_finetune,
        steps=steps,
        lr=lr,
        expected_batch_size=batch,
        max_length=cfg.train.max_length,
        lora_r=cfg.train.lora_r if a.nondp_finetune == "lora" else None,
        trainable_parameters=sum(p.numel() for p in params),
        seconds=round(time.time() - started, 1),
        not_private=NOT_PRIVATE_NOTE,
        training_mode=mode.record(),
        base_model=str(base),
    )
    record.write(out / MARKER)
    return record.summary().to_json()
