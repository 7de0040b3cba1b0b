"""The junior loader: a verified junior release as a model that samples code.

:func:`load_release` verifies a ``privcode-junior/1`` directory (the format:
:mod:`privcode.artifacts.junior`), loads the public base model it names, applies the
LoRA adapter (merged by default) and, for latent methods, the prefix decoder D, and
returns a :class:`JuniorRelease`. Stage II, eval, the audits and serving load juniors
through it (:func:`privcode.models.artifacts.load_model`).

Generation contexts match Stage I training: latent releases prepend the K
virtual tokens ``D(z)`` (the last one predicts the first code token); prompt
releases start from ``prompt.rstrip() + "\\n"``; unconditional releases (and
an empty prompt) start from a single EOS token, the BOS stand-in the junior
was trained with.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.junior import (
    ADAPTER,
    PREFIX_FILE,
    RELEASE_JSON,
    ReleaseError,
    need,
    read_privacy,
    verify_release,
)
from privcode.artifacts.privacy import PrivacyRecord
from privcode.models.loading import load_causal_lm, load_tokenizer

log = logging.getLogger("privcode.release")

__all__ = ["JuniorRelease", "load_release"]


@dataclass
class JuniorRelease:
    """A loaded release: tokenizer, LoRA junior (eval mode, on ``device``) and, if latent, D.

    ``dz`` and ``num_virtual_tokens`` (K) are None for a non-latent release.
    """

    path: Path
    meta: dict
    privacy: PrivacyRecord
    tokenizer: Any
    model: Any
    prefix_decoder: torch.nn.Linear | None
    device: str

    @property
    def conditioning(self) -> str:
        return self.meta["conditioning"]

    @property
    def dp(self) -> bool:
        return bool(self.meta["dp"])

    @property
    def dz(self) -> int | None:
        return (self.meta.get("prefix") or {}).get("dz")

    @property
    def num_virtual_tokens(self) -> int | None:
        return (self.meta.get("prefix") or {}).get("num_virtual_tokens")

    def _require_latent(self) -> None:
        need(
            self.prefix_decoder is not None,
            f"{self.path}: a {self.conditioning!r} release has no latent prefix decoder",
            ReleaseError,
        )

    def prefix(self, z: torch.Tensor) -> torch.Tensor:
        """Virtual-token embeddings ``D(z)``: ``[B, dz] -> [B, K, hidden]``."""
        self._require_latent()
        shape = list(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        need(
            isinstance(z, torch.Tensor) and z.dim() == 2 and z.shape[1] == self.dz,
            f"z must be a [B, {self.dz}] tensor, got {shape}",
        )
        weight = self.prefix_decoder.weight
        out = self.prefix_decoder(z.to(device=weight.device, dtype=weight.dtype))
        return out.view(z.shape[0], self.num_virtual_tokens, self.meta["prefix"]["hidden_size"])

    def sample_z(self, n: int, seed: int) -> torch.Tensor:
        """``n`` latents from N(0, I) (``[n, dz]``, CPU float32), from a generator seeded by ``seed``."""
        self._require_latent()
        need(type(n) is int and n >= 1, f"n must be a positive int, got {n!r}")
        gen = torch.Generator().manual_seed(int(seed))
        return torch.randn(n, self.dz, generator=gen)

    def generate(
        self,
        *,
        n: int | None = None,
        z: torch.Tensor | None = None,
        prompts: list[str] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.8,
        top_p: float = 0.95,
        seed: int = 0,
        start: str = "",
    ) -> list[str]:
        """Sample code: the text generated after the context, up to (excluding) EOS.

        Latent: ``z`` [B, dz] (or ``n``: ``sample_z(n, seed)``); prompt:
        ``prompts``; none: ``n`` samples, each from a single EOS token.
        ``start`` (e.g. ``"def "``) is forced right after the context and
        is part of every returned string (a language prefix, public).
        ``temperature`` 0 is greedy; otherwise temperature + nucleus (``top_p``)
        sampling, reproducible for a given ``seed`` (one generator for the batch;
        the global RNG is not used). Rows are batched (prompts are left-padded).
        """
        from privcode.models.generate import generate  # transformers: heavy

        cond, tok = self.conditioning, self.tokenizer
        need(
            isinstance(temperature, int | float) and temperature >= 0,
            f"temperature must be >= 0 (0 = greedy), got {temperature!r}",
        )
        need(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}")
        need(max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need(n is None or (type(n) is int and n >= 1), f"n must be a positive int, got {n!r}")
        need(z is None or cond == "latent", f"z given, but this is a {cond!r} release")
        need(
            prompts is None or cond == "prompt",
            f"prompts given, but this is a {cond!r} "
            f"release (pass {'z or n' if cond == 'latent' else 'n'})",
        )
        need(isinstance(start, str), f"start must be a str, got {type(start).__name__}")
        start_ids = list(tok(start, add_special_tokens=False)["input_ids"]) if start else []
        emb = self.model.get_input_embeddings().weight
        if cond == "latent":
            need(z is not None or n is not None, "a latent release needs z ([B, dz]) or n")
            with torch.no_grad():
                embeds = self.prefix(self.sample_z(n, seed) if z is None else z).to(emb.dtype)
                if start_ids:
                    forced = emb[torch.tensor(start_ids, device=emb.device)]
                    embeds = torch.cat([embeds, forced.expand(len(embeds), -1, -1)], dim=1)
            need(n is None or n == len(embeds), f"n = {n} but z has {len(embeds)} rows")
            context = embeds.shape[1]
            inputs: dict[str, Any] = {"inputs_embeds": embeds}
        else:
            if cond == "prompt":
                need(
                    isinstance(prompts, list)
                    and prompts
                    and all(isinstance(p, str) for p in prompts),
                    "a prompt release needs prompts: a non-empty list of str",
                )
                need(n is None or n == len(prompts), f"n = {n} but {len(prompts)} prompts given")
                # As in training: prompt.rstrip() + "\n"; an empty prompt gets the EOS context.
                contexts = [
                    list(tok(p.rstrip() + "\n", add_special_tokens=False)["input_ids"])
                    if p.strip()
                    else [tok.eos_token_id]
                    for p in prompts
                ]
            else:
                need(n is not None, "an unconditional release needs n")
                contexts = [[tok.eos_token_id]] * n
            need(
                all(None not in c for c in contexts),
                f"{self.path}: the tokenizer has no EOS",
                ReleaseError,
            )
            contexts = [c + start_ids for c in contexts]
            context, inputs = max(len(c) for c in contexts), {"input_ids": contexts}
        limit = getattr(self.model.config, "max_position_embeddings", None)
        need(
            not limit or context + max_new_tokens <= limit,
            f"context ({context} tokens) + "
            f"max_new_tokens ({max_new_tokens}) exceeds the model's {limit} positions",
        )
        rows = generate(
            self.model,
            tok,
            **inputs,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            seed=int(seed),
            eos_ids=[] if tok.eos_token_id is None else [tok.eos_token_id],
        )
        return [start + g.text for g in rows]


def _weights_dtype(dtype: torch.dtype | str | None, config: Any) -> torch.dtype:
    """None: float32; ``"auto"``: the base checkpoint's dtype (as ``load_causal_lm``)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(saved or "float32").removeprefix("torch.")
    resolved = getattr(torch, str(dtype), None)
    need(
        isinstance(resolved, torch.dtype) and resolved.is_floating_point,
        f"dtype must be a floating torch dtype or its name (float32, bfloat16), got {dtype!r}",
    )
    return resolved  # type: ignore[return-value]


def load_release(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    base_model: str | None = None,
    merge: bool = True,
    dtype: torch.dtype | str | None = None,
) -> JuniorRelease:
    """Verify and load a release; ``base_model`` overrides the recorded base path.

    ``dtype`` (a torch dtype or its name; None = float32; ``"auto"`` = the base checkpoint's)
    is the junior's on ``device``: the adapter is applied (and merged) in float32 and only the
    result is cast; the prefix decoder D stays float32. ``merge`` folds the LoRA update into
    the base weights (``W + (alpha/r) B A``); ``merge=False`` keeps the PeftModel. A release
    with ``dp: false`` loads with a loud RuntimeWarning (and an error log): NOT PRIVATE, fit
    for audits only. Design notes: docs/architecture.md, "models/junior.py".
    """
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    root = Path(path)
    meta = verify_release(root)
    privacy = read_privacy(root)
    if not meta["dp"]:
        message = (
            f"release {root} (method {meta['method']}) is NOT PRIVATE: it was trained "
            "without differential privacy; use it for audits only, never for data "
            "that is shared"
        )
        log.error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    base_path = base_model or meta["base_model"]
    tokenizer = load_tokenizer(base_path)
    # Loaded in float32 onto the device (the merge is fast there), cast after the merge.
    base = load_causal_lm(base_path, device=device)
    prefix = meta.get("prefix")
    need(
        not prefix or base.config.hidden_size == prefix["hidden_size"],
        f"{root / RELEASE_JSON}: prefix hidden_size {prefix and prefix['hidden_size']} != "
        f"{base.config.hidden_size} of the base model {base_path}: wrong base?",
        ReleaseError,
    )
    # Sampling follows generate()'s arguments only, never the base's generation defaults.
    base.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = PeftModel.from_pretrained(base, str(root / ADAPTER), is_trainable=False)
    if merge:
        model = model.merge_and_unload()
    model.to(device=device, dtype=_weights_dtype(dtype, base.config)).eval()
    decoder = None
    if prefix:
        tensors = load_file(str(root / PREFIX_FILE))
        decoder = torch.nn.Linear(
            prefix["dz"], prefix["num_virtual_tokens"] * prefix["hidden_size"]
        )
        with torch.no_grad():
            decoder.weight.copy_(tensors["weight"])
            decoder.bias.copy_(tensors["bias"])
        decoder.requires_grad_(False)
        decoder.to(device).eval()
    return JuniorRelease(
        path=root,
        meta=meta,
        privacy=privacy,
        tokenizer=tokenizer,
        model=model,
        prefix_decoder=decoder,
        device=str(device),
    )
