"""The Stage I release written at the end of training, and its description of the objective.

:func:`write_junior_release` turns the final checkpoint into the DP artifact
(:mod:`privcode.release`): the LoRA adapter, the prefix decoder D for latent
methods, and the privacy record. The checkpoint's E_c and E_p are left
behind: they touched private code and prompts and Stage II does not need
them (it samples ``z ~ N(0, I)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privcode.config import TrainConfig

__all__ = [
    "ADJACENCY",
    "HISTORY_KEYS",
    "objective_record",
    "privacy_record",
    "released_history",
    "write_junior_release",
]

#: What privacy.json says about the neighbouring relation the guarantee is for.
ADJACENCY = {
    "relation": "add/remove one record",
    "record": "one (prompt, code) training record, truncated to train.max_length tokens",
    "public": "the number of records N, hence the sample rate q = B/N and the expected batch "
    "size qN, is treated as public and released; each step's realised batch size is "
    "private (the noisy sum is divided by qN, not by it)",
}
#: The keys of one released history entry: a DP event and nothing else.
HISTORY_KEYS = ("noise_multiplier", "sample_rate", "steps")
#: What privacy.json says is deliberately left out.
NOT_RELEASED = (
    "step times, per-step batch sizes, losses, gradient norms, clip and non-finite "
    "counts, restart counts, ledger grant ids and any digest of the training data "
    "stay in private storage"
)


def released_history(grants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The DP events of the ledger's grants, consecutive equal (sigma, q) merged.

    Exactly :data:`HISTORY_KEYS` per entry: no time (a step's duration depends
    on its private batch), no sequence number, request id or restart count.
    Merging ``k`` grants of one step into one event of ``k`` steps composes
    to the same epsilon.
    """
    out: list[dict[str, Any]] = []
    for g in grants:
        sigma, q, steps = float(g["noise_multiplier"]), float(g["sample_rate"]), int(g["steps"])
        if out and out[-1]["noise_multiplier"] == sigma and out[-1]["sample_rate"] == q:
            out[-1]["steps"] += steps
        else:
            out.append({"noise_multiplier": sigma, "sample_rate": q, "steps": steps})
    return out


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
) -> dict[str, Any]:
    """``privacy.json``: DP outputs and public settings only (see :data:`NOT_RELEASED`).

    ``mode``: the DP engine's :meth:`privcode.dp.engine.Privacy.record` (dp-sgd,
    or non-private with its reason).
    """
    by_acc = spent.get("epsilon_by_accountant", {})
    return {
        "dp": dp,
        "NOT_PRIVATE": None if dp else "trained WITHOUT differential privacy (audits only)",
        "training_mode": mode,
        "method": cfg.method,
        # null, not a number, when there is no guarantee (non-private training).
        "epsilon": spent.get("epsilon"),
        "epsilon_rdp": by_acc.get("rdp"),
        "epsilon_prv": by_acc.get("prv"),
        "epsilon_budget": cfg.epsilon,
        "delta": cfg.delta,
        "accountant": cfg.accountant,
        "ledger_steps": spent.get("steps"),
        "history": released_history(grants),
        "noise_multiplier": sigma,
        "noise_calibrated": calibrated,
        "max_grad_norm": cfg.max_grad_norm,
        "sample_rate": sample_rate,
        "expected_batch_size": cfg.expected_batch_size,
        "num_records": num_records,
        "steps_requested": cfg.steps,
        "steps_taken": state["step"],
        "stop_reason": state["stop_reason"],
        "num_workers": cfg.num_workers,
        "grad_sample_mode": cfg.grad_sample_mode,
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout},
        # An opaque id (keyed HMAC, key in the private store), never a digest of the data.
        "dataset_id": dataset_id,
        "rng": "secure" if cfg.secure_rng else "standard",
        "adjacency": ADJACENCY,
        "base_model": str(base_path),
        "objective": objective_record(cfg, method),
        "public_heldout_loss_curve": state["curve"],
        "assumptions": "add/remove-one-record DP with Poisson sampling; N (hence q) is "
        "treated as public; the curve is the loss on PUBLIC held-out code.",
        "not_released": NOT_RELEASED,
    }


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
    import torch

    from privcode.release import write_release

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
        "dp": privacy["dp"],
        "base_model": str(base_path),
        "prefix": prefix,
        "alignment": _alignment_variant(cfg) if method.align else None,
    }
    write_release(
        out_dir, adapter_dir=ckpt / "adapter", meta=meta, privacy=privacy, prefix_decoder=decoder
    )
