"""Stage I training methods: the per-record objectives of the registry's methods.
Design notes: docs/methods.md, "train/methods.py".

A method builds an :class:`Objective` (an ``nn.Module``: the LoRA junior ``lm`` and the
method's own trainable modules) whose ``forward(batch)`` returns one loss per record ``[B]``;
DP-SGD clips each entry's gradient over EVERY trainable parameter jointly. The DP guarantee
needs entry i to depend on record i only (and public values): no batch means, no in-batch
negatives, no batch statistics. Registry entries: :data:`privcode.registry.METHODS`.
``CE(c | ctx)``: mean CE over the code tokens (+ EOS); ``KL_AST``: KL of the junior to the frozen
base over structural code tokens (0 while LoRA's B = 0); ``lambda(t)``:
:func:`privcode.train.syntax.ast_lambda`; PrivLC terms: :mod:`privcode.train.privlc`::

    privcode            CE(c | p) + lambda(t) KL_AST   (-nonast: no KL; -stableast: lambda_const)
    privcode++          CE(c | D(z_c)) + lambda(t) KL_AST + L_VAE + lambda_a L_align
    privcode++-noalign  CE(c | D(z_c)) + lambda(t) KL_AST + L_VAE
    pc-promptemb        CE(c | D(z_p)) + lambda(t) KL_AST
    pc-preemb           CE(c | D(z_c)) + lambda(t) KL_AST   (PrivLC public-pretrained, frozen)
    pc-uncond           CE(c | BOS) + lambda(t) KL_AST
    dpft / nondpft      mean CE over prompt and code tokens of p + c   (nondpft: no DP)

"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from privcode.dp.randomness import record_seeds
from privcode.models.encoding import CODE, PAD, PROMPT, segment_rows, token_ce
from privcode.registry import METHODS, Method, get_method
from privcode.train.privlc import (
    CodeEncoder,
    PromptEncoder,
    align_loss,
    make_prefix_decoder,
    vae_kl,
)
from privcode.train.syntax import ast_lambda, kl_at_positions

__all__ = [
    "METHODS",
    "Method",
    "MethodContext",
    "Objective",
    "get_method",
    "pretrain_public",
]


@dataclass(frozen=True)
class MethodContext:
    """What a method may use besides the model: public things only."""

    cfg: Any  #: the TrainConfig
    eos_id: int
    pad_id: int
    #: Token ids of PUBLIC prompts: the alignment loss' negative bank.
    public_bank: Sequence[Sequence[int]] = field(default_factory=tuple)


def _masked_mean_ce(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    ce = token_ce(logits, targets)
    m = mask.to(ce.dtype)
    return (ce * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def _safe_mask(mask: torch.Tensor) -> torch.Tensor:
    # An all-padding row (e.g. no prompt) still attends to its first token, so
    # attention never normalises over nothing; its outputs are masked anyway.
    m = mask.clone()
    m[:, 0] = 1
    return m


class Objective(nn.Module):
    """The junior ``lm`` plus the method's modules; ``forward(batch) -> [B]`` per-record losses."""

    def __init__(self, method: Method, lm: nn.Module, ctx: MethodContext):
        super().__init__()
        cfg = ctx.cfg
        self.method, self.cfg = method, cfg
        self.eos_id, self.pad_id = int(ctx.eos_id), int(ctx.pad_id)
        self.lm = lm
        hidden = int(lm.get_input_embeddings().weight.shape[1])
        width = cfg.encoder_hidden or hidden
        self.hidden = hidden
        self.code_encoder = self.prompt_encoder = self.decoder = None
        if method.latent is not None:
            emb_std = float(lm.get_input_embeddings().weight.detach().float().std())
            self.decoder = make_prefix_decoder(
                cfg.latent_dim, cfg.num_virtual_tokens, hidden, emb_std
            )
        if method.latent == "code":
            self.code_encoder = CodeEncoder(hidden, width, cfg.latent_dim)
        if method.latent == "prompt" or method.align:
            self.prompt_encoder = PromptEncoder(hidden, width, cfg.latent_dim)
        self._bank_ids = [list(ids) for ids in ctx.public_bank if ids]
        if method.align and cfg.align_negatives == "public" and not self._bank_ids:
            raise ValueError("align_negatives='public' needs a non-empty public prompt bank")
        #: Off during pc-preemb's public pretraining (it trains PrivLC, not the adapter).
        self.ast_enabled = True
        self._bank_h: torch.Tensor | None = None
        self._bank_epoch = -1

    # ------------------------------------------------------------------ pieces

    def privlc_parameters(self) -> list[nn.Parameter]:
        mods = [m for m in (self.code_encoder, self.prompt_encoder, self.decoder) if m is not None]
        return [p for m in mods for p in m.parameters()]

    def released_prefix_decoder(self) -> dict[str, torch.Tensor] | None:
        """D's tensors for the release (``weight``, ``bias``); None without PrivLC."""
        if self.decoder is None:
            return None
        return {
            "weight": self.decoder.weight.detach().cpu().contiguous(),
            "bias": self.decoder.bias.detach().cpu().contiguous(),
        }

    def ast_weight(self, step: int) -> float:
        cfg = self.cfg
        if self.method.ast == "decay":
            return ast_lambda(
                step, cfg.ast_lambda_max, cfg.ast_lambda_min, cfg.ast_alpha, cfg.ast_dt
            )
        if self.method.ast == "constant":
            return float(cfg.stable_ast_lambda)
        return 0.0

    def _pooled(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled final hidden states of the junior (adapter on), no gradient."""
        with torch.no_grad():
            backbone = self.lm.get_base_model().base_model
            h = backbone(input_ids=ids, attention_mask=_safe_mask(mask)).last_hidden_state
            m = mask.to(h.dtype)[..., None]
            return ((h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).float()

    def _bank_latents(self, step: int) -> torch.Tensor | None:
        if not self.method.align or self.cfg.align_negatives != "public":
            return None
        epoch = step // self.cfg.align_bank_refresh
        device = self.lm.get_input_embeddings().weight.device
        if self._bank_h is None or epoch != self._bank_epoch:
            width = max(len(ids) for ids in self._bank_ids)
            ids = torch.full((len(self._bank_ids), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(self._bank_ids):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            self._bank_h = self._pooled(ids.to(device), mask.to(device))
            self._bank_epoch = epoch
        with torch.no_grad():
            return self.prompt_encoder(self._bank_h.to(self._param_dtype()))

    def _record_noise(self, batch: Mapping[str, Any], like: torch.Tensor) -> torch.Tensor:
        """The VAE's eps ~ N(0, I) per record, from the run's secret.

        In DP training the batch carries ``record_keys`` (a function of each
        record's content, :func:`privcode.dp.randomness.record_key`) and the
        step's ``record_secret``: eps of a record is then a function of that
        record and the secret alone, so adding or removing other records (or
        resharding over workers) changes no other record's eps. Never the
        public ``train.seed`` nor a record's position. Without them (public
        data), torch's global RNG, which the DP loop seeds from the secret.
        """
        keys, secret = batch.get("record_keys"), batch.get("record_secret")
        if keys is None or secret is None:
            return torch.randn_like(like)
        rows = [
            torch.randn(like.shape[-1], generator=torch.Generator().manual_seed(s))
            for s in record_seeds(secret, keys.tolist())
        ]
        return torch.stack(rows).to(device=like.device, dtype=like.dtype)

    def _param_dtype(self) -> torch.dtype:
        return next(p for p in self.privlc_parameters()).dtype

    def _kl(
        self,
        junior_logits: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """KL_AST per row: ``junior_logits`` [B, T, V] against the frozen base on the same ``inputs``.

        The reference is the junior with its adapter disabled, no gradient,
        fed the same inputs (with a prefix: the same virtual tokens,
        detached), and its logits are cut like the junior's (from ``start``,
        without the last position). ``positions`` [B, T] selects the
        structural targets.
        """
        if not bool(positions.any()):
            return junior_logits.new_zeros(junior_logits.shape[0], dtype=torch.float32)
        with torch.no_grad(), self.lm.disable_adapter():
            ref = self.lm(**{k: v.detach() for k, v in inputs.items()}).logits[:, start:-1]
        return kl_at_positions(junior_logits, ref, positions)

    # ------------------------------------------------------------------ forward

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        step = int(batch.get("step", 0))
        lam = self.ast_weight(step)
        if self.method.inputs == "prefix":
            return self._latent_loss(batch, step, lam)
        if self.method.inputs == "code":
            rows = segment_rows(batch, CODE, bos_id=self.eos_id)
            ids, mask, struct = rows["input_ids"], rows["attention_mask"], rows["structural"]
            target_mask = mask[:, 1:]
        else:
            ids, mask, struct = batch["input_ids"], batch["attention_mask"], batch["structural"]
            targets = batch["segments"][:, 1:]
            target_mask = (targets != PAD) if self.method.loss_on_prompt else (targets == CODE)
        inputs = {"input_ids": ids, "attention_mask": _safe_mask(mask)}
        logits = self.lm(**inputs).logits[:, :-1]
        loss = _masked_mean_ce(logits, ids[:, 1:], target_mask)
        if lam > 0 and self.ast_enabled:
            positions = (struct[:, 1:] > 0) & (target_mask > 0)
            loss = loss + lam * self._kl(logits, positions, 0, **inputs)
        return loss

    def _latent_loss(self, batch: Mapping[str, Any], step: int, lam: float) -> torch.Tensor:
        cfg, k = self.cfg, self.cfg.num_virtual_tokens
        code = segment_rows(batch, CODE)
        ids, mask = code["input_ids"], code["attention_mask"]
        dtype = self._param_dtype()
        extra = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
        h_p = None
        if self.prompt_encoder is not None:
            prompt = segment_rows(batch, PROMPT)
            h_p = self._pooled(prompt["input_ids"], prompt["attention_mask"]).to(dtype)
        if self.method.latent == "code":
            mu, logvar = self.code_encoder(self._pooled(ids, mask).to(dtype))
            eps = self._record_noise(batch, mu)
            z = mu + (0.5 * logvar).exp() * eps
            if cfg.vae_weight > 0:
                extra = extra + cfg.vae_weight * vae_kl(mu.float(), logvar.float())
            if self.method.align and cfg.align_weight > 0:
                z_p = self.prompt_encoder(h_p)
                extra = extra + cfg.align_weight * align_loss(
                    mu, z_p, self._bank_latents(step), cfg.align_temperature
                )
        else:
            z = self.prompt_encoder(h_p)
        prefix = self.decoder(z).view(ids.shape[0], k, self.hidden)
        embeds = self.lm.get_input_embeddings()(ids)
        inputs = torch.cat([prefix.to(embeds.dtype), embeds], dim=1)
        attn = torch.cat([torch.ones_like(mask[:, :1]).expand(-1, k), _safe_mask(mask)], dim=1)
        # Position k-1 (the last virtual token) predicts the first code token.
        logits = self.lm(inputs_embeds=inputs, attention_mask=attn).logits[:, k - 1 : -1]
        loss = _masked_mean_ce(logits, ids, mask) + extra
        if lam > 0 and self.ast_enabled:
            positions = (code["structural"] > 0) & (mask > 0)
            loss = loss + lam * self._kl(
                logits, positions, k - 1, inputs_embeds=inputs, attention_mask=attn
            )
        return loss


def build_objective(method: Method, lm: nn.Module, ctx: MethodContext) -> Objective:
    return Objective(method, lm, ctx)


def pretrain_public(
    objective: Objective, batches: Callable[[int], Mapping[str, Any]], steps: int, lr: float
) -> list[float]:
    """Non-private pretraining of the PrivLC modules on PUBLIC batches (``pc-preemb``).

    ``batches(i)`` gives the i-th public batch (collated like private ones).
    Only E_c, E_p and D are updated (the LoRA weights are held fixed); the
    mean loss per step is returned. Public data: no clipping, no noise, no
    budget. The caller freezes the PrivLC modules afterwards.
    """
    params = objective.privlc_parameters()
    lora = [p for p in objective.lm.parameters() if p.requires_grad]
    for p in lora:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    objective.ast_enabled = False
    try:
        objective.train()
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = objective(batches(i)).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        objective.ast_enabled = True
        for p in lora:
            p.requires_grad_(True)
    return losses
