"""The Stage I release written at the end of training, and its description of the objective.

:func:`write_junior_release` turns the final checkpoint into the DP artifact
(format: :mod:`privcode.artifacts.junior`; writer: :mod:`privcode.train.release`): the
LoRA adapter, the prefix decoder D for latent methods, and the privacy record. The
checkpoint's E_c and E_p are left behind: they touched private code and prompts and
Stage II does not need them (it samples ``z ~ N(0, I)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.privacy import PrivacyRecord, released_history
from privcode.config import TrainConfig
from privcode.train.release import write_release

__all__ = ["objective_record", "privacy_record", "write_junior_release"]


def privacy_record(
    cfg: TrainConfig,
    method: Any,
    *,
    spent: dict[str, Any],
    grants: list[dict[str, Any]],
    sigma: float,
    calibrated: bool,
    sample_rate: float,
    num_records: int,
    state: dict[str, Any],
    dataset_id: str,
    base_path: Path,
    mode: dict[str, Any],
    dp: bool,
    store_id: str = "",
) -> PrivacyRecord:
    """The release's :class:`~privcode.artifacts.PrivacyRecord`: DP outputs and public settings.

    ``spent`` and ``grants`` are the ledger's (empty without one: non-private
    training has no epsilon); ``mode`` the DP engine's
    :meth:`privcode.dp.engine.Privacy.record` (dp-sgd, or non-private with its reason).
    """
    by_acc = spent.get("epsilon_by_accountant", {})
    return PrivacyRecord(
        dp=dp,
        training_mode=mode,
        method=cfg.method,
        epsilon=spent.get("epsilon"),  # null, not a number, without a guarantee
        epsilon_rdp=by_acc.get("rdp"),
        epsilon_prv=by_acc.get("prv"),
        epsilon_budget=cfg.epsilon,
        delta=cfg.delta,
        accountant=cfg.accountant,
        history=released_history(grants),
        noise_multiplier=sigma,
        noise_calibrated=calibrated,
        max_grad_norm=cfg.max_grad_norm,
        sample_rate=sample_rate,
        expected_batch_size=cfg.expected_batch_size,
        num_records=num_records,
        steps_requested=cfg.steps,
        steps_taken=state["step"],
        num_workers=cfg.num_workers,
        grad_sample_mode=cfg.grad_sample_mode,
        lora={"r": cfg.lora_r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout},
        # An opaque id (keyed HMAC, key in the private store), never a digest of the data.
        dataset_id=dataset_id,
        rng="secure" if cfg.secure_rng else "standard",
        base_model=str(base_path),
        objective=objective_record(cfg, method),
        public_heldout_loss_curve=tuple(tuple(p) for p in state["curve"]),
        store_id=store_id,
    )


def objective_record(cfg: TrainConfig, method: Any) -> dict[str, Any]:
    """What the released model was trained to do: method, loss terms and their settings."""
    rec: dict[str, Any] = {
        "method": method.name,
        "description": method.description,
        "conditioning": method.conditioning,
        "dp": method.dp,
    }
    if method.ast:
        rec["syntax_kl"] = (
            {
                "schedule": "decay",
                "lambda_max": cfg.ast_lambda_max,
                "lambda_min": cfg.ast_lambda_min,
                "alpha": cfg.ast_alpha,
                "dt": cfg.ast_dt,
            }
            if method.ast == "decay"
            else {"schedule": "constant", "lambda": cfg.stable_ast_lambda}
        )
    if method.latent:
        rec["privlc"] = {
            "latent": method.latent,
            "latent_dim": cfg.latent_dim,
            "num_virtual_tokens": cfg.num_virtual_tokens,
            "vae_weight": cfg.vae_weight if method.latent == "code" else None,
            "pretrained_on_public": method.pretrain_public,
            "released_modules": ["prefix_decoder"],
            "never_released": ["code_encoder", "prompt_encoder"],
        }
    if method.align:
        rec["alignment"] = _alignment_variant(cfg)
    return rec


def _alignment_variant(cfg: TrainConfig) -> str:
    if cfg.align_negatives == "public":
        return (
            f"InfoNCE on cosine/tau (tau={cfg.align_temperature}) with negatives from "
            f"{cfg.align_bank_size} PUBLIC stdlib prompts re-encoded by the current E_p; "
            "no in-batch private negatives (per-record sensitivity holds)"
        )
    return "1 - cos(z_c, z_p), no negatives (per-record sensitivity holds)"


def write_junior_release(
    out_dir: Path,
    ckpt: Path,
    cfg: TrainConfig,
    method: Any,
    privacy: dict[str, Any],
    base_path: Path,
) -> None:
    """The DP artifact: adapter, prefix decoder D (latent methods), privacy record. Never E_c/E_p."""
    decoder = None
    prefix = None
    if method.latent:
        state = torch.load(ckpt / "privlc.pt", map_location="cpu", weights_only=True)
        decoder = {
            "weight": state["decoder.weight"].contiguous(),
            "bias": state["decoder.bias"].contiguous(),
        }
        prefix = {
            "dz": cfg.latent_dim,
            "num_virtual_tokens": cfg.num_virtual_tokens,
            "hidden_size": int(decoder["weight"].shape[0]) // cfg.num_virtual_tokens,
        }
    meta = {
        "method": method.name,
        "conditioning": method.conditioning,
        "dp": privacy.dp,
        "base_model": str(base_path),
        "prefix": prefix,
        "alignment": _alignment_variant(cfg) if method.align else None,
    }
    write_release(
        out_dir, adapter_dir=ckpt / "adapter", meta=meta, privacy=privacy, prefix_decoder=decoder
    )
