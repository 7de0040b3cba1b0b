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

__all__ = ["objective_record", "write_junior_release"]


def objective_record(cfg: TrainConfig, method: Any) -> dict[str, Any]:
    """What the released model was trained to do: method, loss terms and their settings."""
    rec: dict[str, Any] = {"method": method.name, "description": method.description,
                           "conditioning": method.conditioning, "dp": method.dp}
    if method.ast:
        rec["syntax_kl"] = ({"schedule": "decay", "lambda_max": cfg.ast_lambda_max,
                             "lambda_min": cfg.ast_lambda_min, "alpha": cfg.ast_alpha,
                             "dt": cfg.ast_dt} if method.ast == "decay"
                            else {"schedule": "constant", "lambda": cfg.stable_ast_lambda})
    if method.latent:
        rec["privlc"] = {"latent": method.latent, "latent_dim": cfg.latent_dim,
                         "num_virtual_tokens": cfg.num_virtual_tokens,
                         "vae_weight": cfg.vae_weight if method.latent == "code" else None,
                         "pretrained_on_public": method.pretrain_public,
                         "released_modules": ["prefix_decoder"],
                         "never_released": ["code_encoder", "prompt_encoder"]}
    if method.align:
        rec["alignment"] = _alignment_variant(cfg)
    return rec


def _alignment_variant(cfg: TrainConfig) -> str:
    if cfg.align_negatives == "public":
        return (f"InfoNCE on cosine/tau (tau={cfg.align_temperature}) with negatives from "
                f"{cfg.align_bank_size} PUBLIC stdlib prompts re-encoded by the current E_p; "
                "no in-batch private negatives (per-record sensitivity holds)")
    return "1 - cos(z_c, z_p), no negatives (per-record sensitivity holds)"


def write_junior_release(out_dir: Path, ckpt: Path, cfg: TrainConfig, method: Any,
                          privacy: dict[str, Any], base_path: Path) -> None:
    """The DP artifact: adapter, prefix decoder D (latent methods), privacy record. Never E_c/E_p."""
    import torch

    from privcode.release import write_release

    decoder = None
    prefix = None
    if method.latent:
        state = torch.load(ckpt / "privlc.pt", map_location="cpu", weights_only=True)
        decoder = {"weight": state["decoder.weight"].contiguous(),
                   "bias": state["decoder.bias"].contiguous()}
        prefix = {"dz": cfg.latent_dim, "num_virtual_tokens": cfg.num_virtual_tokens,
                  "hidden_size": int(decoder["weight"].shape[0]) // cfg.num_virtual_tokens}
    meta = {"method": method.name, "conditioning": method.conditioning, "dp": privacy["dp"],
            "base_model": str(base_path), "prefix": prefix,
            "alignment": _alignment_variant(cfg) if method.align else None}
    write_release(out_dir, adapter_dir=ckpt / "adapter", meta=meta, privacy=privacy,
                  prefix_decoder=decoder)
