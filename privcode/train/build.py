"""Per-worker setup of a Stage I method: the junior, its objective, checkpoints, plain gradients.

:func:`build_objective` loads the base model, attaches the LoRA adapter
(seeded init) and wraps it in the method's :class:`~privcode.train.methods.Objective`
with the PUBLIC prompt bank its alignment loss needs. For ``pc-preemb`` it
pretrains the PrivLC modules on PUBLIC pairs (no DP needed: nothing private
is read) unless a checkpoint will overwrite them, then freezes them.

Checkpoints hold the adapter (peft format), the PrivLC modules
(``privlc.pt``: E_c, E_p and D: all trained under the same DP-SGD; the
checkpoint storage is private, the release keeps only D), the optimiser
state and the loop state.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from privcode.data.public import public_pairs, public_prompts
from privcode.dp.dpsgd import forward_context
from privcode.models.encoding import collate, encode_records, token_ids
from privcode.models.loading import attach_lora, load_causal_lm, load_tokenizer, resolve_dtype
from privcode.train.methods import Method, MethodContext, Objective, pretrain_public

__all__ = ["build_objective", "load_checkpoint", "save_checkpoint_files"]

PRIVLC_FILE = "privlc.pt"


def _public_bank(tokenizer: Any, cfg: Any) -> list[list[int]]:
    prompts = [p.rstrip() + "\n" for p in public_prompts(cfg.align_bank_size, seed=cfg.seed)]
    return [ids[: cfg.max_length] for ids in token_ids(tokenizer, prompts)]


class _PublicRecord:
    __slots__ = ("code", "prompt")

    def __init__(self, prompt: str, code: str):
        self.prompt, self.code = prompt, code


def _pretrain(objective: Objective, tokenizer: Any, cfg: Any, device: Any) -> list[float]:
    pairs = public_pairs(max(cfg.expected_batch_size * 8, 64), seed=cfg.seed + 1)
    encoded = encode_records([_PublicRecord(p, c) for p, c in pairs], tokenizer, cfg.max_length)
    rng = random.Random(cfg.seed)
    size = min(len(encoded), max(cfg.expected_batch_size, 4))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def batch(i: int) -> dict[str, Any]:
        return collate(rng.sample(encoded, size), pad, device=device, step=i)

    with forward_context(torch.device(device), resolve_dtype(cfg.dtype, device)):
        return pretrain_public(objective, batch, cfg.preemb_steps, cfg.preemb_lr)


def build_objective(
    method: Method, cfg: Any, base_path: str, device: Any, will_restore: bool, lora: bool = True
) -> tuple[Objective, Any, list[float]]:
    """(objective on ``device``, tokenizer, public pretraining losses) for ``method``.

    ``lora=False`` (the non-DP comparison's full fine-tune only) leaves the
    base model bare: every weight is then the caller's to train.
    """
    tokenizer = load_tokenizer(base_path)
    torch.manual_seed(cfg.seed)  # same LoRA and PrivLC init on every rank (then broadcast)
    # Frozen base weights in the configured dtype; peft keeps the adapter in fp32
    # (autocast_adapter_dtype), and the PrivLC modules are built in fp32.
    lm = load_causal_lm(base_path, dtype=resolve_dtype(getattr(cfg, "dtype", "float32"), device))
    if lora:
        lm = attach_lora(lm, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    bank = _public_bank(tokenizer, cfg) if method.align and cfg.align_negatives == "public" else []
    objective = Objective(
        method, lm, MethodContext(cfg=cfg, eos_id=eos, pad_id=pad, public_bank=bank)
    ).to(device)
    losses: list[float] = []
    if method.pretrain_public:
        if not will_restore:
            losses = _pretrain(objective, tokenizer, cfg, device)
        for p in objective.privlc_parameters():
            p.requires_grad_(False)
    return objective, tokenizer, losses


def _privlc_state(objective: Objective) -> dict[str, torch.Tensor]:
    return {k: v for k, v in objective.state_dict().items() if not k.startswith("lm.")}


def save_checkpoint_files(d: Path, objective: Objective, optimizer: Any) -> None:
    objective.lm.save_pretrained(str(d / "adapter"))
    privlc = _privlc_state(objective)
    if privlc:
        torch.save(privlc, d / PRIVLC_FILE)
    torch.save(optimizer.state_dict(), d / "optimizer.pt")


def load_checkpoint(d: Path, objective: Objective, optimizer: Any) -> dict[str, Any]:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(
        objective.lm, load_file(str(d / "adapter" / "adapter_model.safetensors"))
    )
    if (d / PRIVLC_FILE).exists():
        state = torch.load(d / PRIVLC_FILE, map_location="cpu", weights_only=True)
        missing, unexpected = objective.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if not k.startswith("lm.")]:
            raise RuntimeError(f"checkpoint {PRIVLC_FILE} does not match the method's modules")
    optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))
    return json.loads((d / "state.json").read_text(encoding="utf-8"))
