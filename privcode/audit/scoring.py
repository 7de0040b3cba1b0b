"""Model log-likelihoods for the privacy audits: sequence scores and per-record losses.
Design notes: docs/audits.md, "privcode/audit/scoring.py".

:func:`load_scored_model` loads a plain causal LM, a LoRA adapter, a premium or a DP junior
release (detected by the files present) as a :class:`ScoredModel`, which scores text in the
format the model was trained on. Rows for a record ``(p, c)`` / a raw text ``t``:

* ``prompt``: ``tokens(p.rstrip() + "\\n") ++ tokens(c) ++ [EOS]`` / ``tokens(t)``;
* ``none``: ``[EOS] ++ tokens(c) ++ [EOS]`` / ``[EOS] ++ tokens(t)``;
* ``latent``: ``D(z) ++ tokens(c) ++ [EOS]`` / ``D(z) ++ tokens(t)``, the K virtual tokens of
  the released prefix decoder D first. E_c is never released, so the score is
  ``log p(x | D(0))`` (``latent_samples = 0``) or
  ``logmeanexp_j log p(x | D(z_j))`` over ``latent_samples`` seeded ``z_j ~ N(0, I)``.

``log p(x_t | ctx, x_<t) = logits[t-1, x_t] - logsumexp(logits[t-1])`` in float32;
:func:`sequence_logprobs` sums it over a continuation, :func:`record_losses` averages its
negative over the tokens the training objective put its loss on.
Privacy: records and texts scored here are private; nothing logs or raises with their content.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from privcode.checks import check_number
from privcode.errors import PrivcodeError
from privcode.models.artifacts import load_model
from privcode.models.encoding import CODE, PAD, encode_records, token_ids_offsets
from privcode.models.loading import ModelLoadError
from privcode.registry import METHODS

log = logging.getLogger("privcode.audit")

__all__ = [
    "AuditError",
    "ScoredModel",
    "as_scored",
    "describe",
    "load_scored_model",
    "record_losses",
    "sequence_logprobs",
    "tokenize_pairs",
]


class AuditError(PrivcodeError, ValueError):
    """An audit cannot run: a bad model path, bad inputs or settings; names what and where."""


@dataclass
class ScoredModel:
    """A causal LM in eval mode plus how it conditions its input (see the module docstring).

    ``info`` holds public facts only (path, kind, method, dp, epsilon, delta,
    the DP history): it goes into audit summaries.
    """

    model: Any
    tokenizer: Any
    conditioning: str = "prompt"  #: "prompt" | "none" | "latent"
    loss_on_prompt: bool = False  #: dpft / nondpft trained on prompt tokens too
    prefix_decoder: torch.nn.Linear | None = None
    num_virtual_tokens: int | None = None
    latent_samples: int = 0  #: 0: z = 0; n > 0: logmeanexp over n draws
    latent_seed: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.conditioning not in ("prompt", "none", "latent"):
            raise AuditError(
                f"conditioning must be prompt, none or latent, got {self.conditioning!r}"
            )
        if self.conditioning == "latent" and (
            self.prefix_decoder is None or not self.num_virtual_tokens
        ):
            raise AuditError("a latent model needs its prefix decoder and num_virtual_tokens")
        check_number("latent_samples", self.latent_samples, min=0, integer=True, error=AuditError)
        if self.tokenizer.eos_token_id is None:
            raise AuditError("the tokenizer has no EOS token (needed as BOS stand-in and end)")

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return int(next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None))

    def latents(self, n: int | None = None, seed: int | None = None) -> torch.Tensor:
        """``[m, dz]`` latents: ``n`` draws from N(0, I) (seeded), or z = 0 when n is 0/None."""
        dz = self.prefix_decoder.weight.shape[1]
        n = self.latent_samples if n is None else n
        if not n:
            return torch.zeros(1, dz)
        gen = torch.Generator().manual_seed(int(self.latent_seed if seed is None else seed))
        return torch.randn(n, dz, generator=gen)

    def prefix_embeds(self, z: torch.Tensor) -> torch.Tensor:
        """``D(z)`` as ``[m, K, hidden]`` in the model's embedding dtype and device."""
        emb = self.model.get_input_embeddings().weight
        with torch.inference_mode():
            out = self.prefix_decoder(
                z.to(
                    device=self.prefix_decoder.weight.device, dtype=self.prefix_decoder.weight.dtype
                )
            )
        return out.view(z.shape[0], self.num_virtual_tokens, -1).to(
            device=emb.device, dtype=emb.dtype
        )


def as_scored(model: Any, tokenizer: Any = None) -> ScoredModel:
    """``model`` itself if it is a :class:`ScoredModel`, else a plain ``prompt`` wrapper."""
    if isinstance(model, ScoredModel):
        return model
    if tokenizer is None:
        raise AuditError("a tokenizer is needed to score a plain model")
    model.eval()
    return ScoredModel(model=model, tokenizer=tokenizer, info={"kind": "model"})


def load_scored_model(
    path: str | Path,
    *,
    base_model: str | None = None,
    device: Any = "cpu",
    dtype: Any = None,
    latent_samples: int = 0,
    latent_seed: int = 0,
) -> ScoredModel:
    """Load what ``path`` holds through :func:`privcode.models.artifacts.load_model` (a junior
    or premium release, a peft adapter, the non-DP comparison, a base stage directory, a HF
    model or a preset name) and wrap it for scoring. A junior's privacy record goes into
    ``info``; ``base_model`` overrides the recorded base path of a release or adapter.
    ``device``/``dtype`` as in ``load_model`` (None: float32); log-probabilities are
    computed from float32 logits whatever the weights' dtype.
    """
    root = Path(path).expanduser()
    info: dict[str, Any] = {"path": str(root)}
    try:
        loaded = load_model(path, base_model=base_model, device=device, dtype=dtype)
    except ModelLoadError as exc:
        raise AuditError(f"cannot load a model to audit from {root}: {exc}") from exc
    if loaded.kind == "junior":
        rel, privacy = loaded.release, loaded.release.privacy
        method = rel.meta["method"]
        info.update(
            kind="junior",
            method=method,
            dp=rel.dp,
            epsilon=privacy.epsilon,
            delta=privacy.delta,
            history=[e.to_dict() for e in privacy.history],
        )
        m = METHODS.get(method)
        return ScoredModel(
            model=rel.model,
            tokenizer=rel.tokenizer,
            conditioning=rel.conditioning,
            loss_on_prompt=bool(m and m.loss_on_prompt),
            prefix_decoder=rel.prefix_decoder,
            num_virtual_tokens=rel.num_virtual_tokens,
            latent_samples=latent_samples,
            latent_seed=latent_seed,
            info=info,
        )
    if loaded.kind == "premium":
        info.update(
            kind="premium",
            dp=False,
            base_model=loaded.base_model,
            post_processing_of=(loaded.meta.get("privacy") or {}).get("post_processing_of"),
        )
    elif loaded.kind == "adapter":
        info.update(kind="adapter", base_model=loaded.base_model)
    elif loaded.kind == "nondpft":
        info.update(
            kind="nondpft",
            method="nondpft",
            dp=False,
            finetune=loaded.meta.get("finetune"),
            base_model=loaded.base_model,
        )
    else:
        info.update(kind="model", model_path=str(loaded.meta.get("path") or path))
    return ScoredModel(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        loss_on_prompt=loaded.kind == "nondpft",
        info=info,
    )


# --------------------------------------------------------------------------- core forward


def _row_logprobs(
    sm: ScoredModel, rows: Sequence[Sequence[int]], batch_size: int, z: torch.Tensor | None = None
) -> list[np.ndarray]:
    """Per row, ``lp[t] = log p(row[t] | prefix, row[<t])`` (float64 array, len(row)).

    Without a latent prefix ``lp[0]`` is NaN (nothing predicts the first
    token). With ``z`` ([1, dz]) the K virtual tokens D(z) come first.
    Rows are scored longest first in batches of ``batch_size``.
    """
    if batch_size < 1:
        raise AuditError(f"batch_size must be >= 1, got {batch_size}")
    out: list[np.ndarray | None] = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    device, emb_layer = sm.device, sm.model.get_input_embeddings()
    prefix = sm.prefix_embeds(z) if z is not None else None
    k = 0 if prefix is None else prefix.shape[1]
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            width = max(len(rows[i]) for i in idx)
            if width == 0:
                for i in idx:
                    out[i] = np.zeros(0)
                continue
            ids = torch.full((len(idx), width), sm.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, : len(rows[i])] = torch.tensor(list(rows[i]), dtype=torch.long)
                mask[j, : len(rows[i])] = 1
            ids, mask = ids.to(device), mask.to(device)
            mask[:, 0] = 1  # an empty row still attends to something; its output is dropped
            if prefix is None:
                logits = sm.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                targets = ids[:, 1:]
            else:
                embeds = torch.cat([prefix.expand(len(idx), -1, -1), emb_layer(ids)], dim=1)
                attn = torch.cat([torch.ones_like(mask[:, :1]).expand(-1, k), mask], dim=1)
                logits = sm.model(inputs_embeds=embeds, attention_mask=attn).logits[:, k - 1 : -1]
                targets = ids
            logits = logits.float()
            lp = (
                (logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1))
                .double()
                .cpu()
                .numpy()
            )
            for j, i in enumerate(idx):
                n = len(rows[i])
                out[i] = np.concatenate([[np.nan], lp[j, : n - 1]]) if prefix is None else lp[j, :n]
    return out  # type: ignore[return-value]


def _masked_sums(
    sm: ScoredModel,
    rows: list[list[int]],
    masks: list[np.ndarray],
    batch_size: int,
    cache: dict[Any, Any] | None = None,
) -> np.ndarray:
    """``log p`` summed over each row's masked targets; logmeanexp over latent draws.

    ``cache`` (no latent): per-token log-probs kept by model and rows, so the
    same rows under another mask (loss on the prompt or not) are not rescored.
    """
    if sm.conditioning != "latent":
        key = ("row_logprobs", id(sm), batch_size, tuple(map(tuple, rows)))  # in memory only
        lps = cache.get(key) if cache is not None else None
        if lps is None:
            lps = _row_logprobs(sm, rows, batch_size)
            if cache is not None:
                cache[key] = lps
        return np.array([float(np.sum(lp[m])) for lp, m in zip(lps, masks, strict=True)])
    zs = sm.latents()
    per_z = np.stack(
        [
            np.array(
                [
                    float(np.sum(lp[m]))
                    for lp, m in zip(
                        _row_logprobs(sm, rows, batch_size, z=zs[j : j + 1]), masks, strict=True
                    )
                ]
            )
            for j in range(zs.shape[0])
        ]
    )
    top = per_z.max(axis=0)
    return top + np.log(np.mean(np.exp(per_z - top), axis=0))


# --------------------------------------------------------------------------- public API


def tokenize_pairs(
    sm: ScoredModel, prefixes: Sequence[str], continuations: Sequence[str]
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Token rows of ``prefix + continuation`` and the mask of the continuation's tokens.

    The text is tokenised jointly, as in training (a separate tokenisation
    of the continuation would cut it where training never did: ``" ali"``
    vs ``" " + "ali"``). The scored tokens are those ending after the
    prefix; a token straddling the boundary (``" ali"`` after ``"to "``)
    is scored, so a few prefix characters may be included: the same ones
    for every continuation of a given prefix, which is what ranking needs.
    ``none`` models get an EOS first; ``prompt`` models one only when no
    context token is left (an empty prefix), as their BOS stand-in.
    """
    if len(prefixes) != len(continuations):
        raise AuditError(f"{len(prefixes)} prefixes but {len(continuations)} continuations")
    if any(not c for c in continuations):
        raise AuditError("continuations must be non-empty strings")
    encoded = token_ids_offsets(
        sm.tokenizer, [p + c for p, c in zip(prefixes, continuations, strict=True)]
    )
    rows, masks = [], []
    for prefix, (ids, offsets) in zip(prefixes, encoded, strict=True):
        cut = len(prefix)
        first = next((t for t, (_, end) in enumerate(offsets) if end > cut), len(ids))
        lead = []
        if sm.conditioning == "none" or (sm.conditioning == "prompt" and first == 0):
            lead = [sm.eos_id]
        row = lead + ids
        mask = np.zeros(len(row), dtype=bool)
        mask[len(lead) + first :] = True
        rows.append(row)
        masks.append(mask)
    return rows, masks


def sequence_logprobs(
    model: Any,
    tokenizer: Any,
    prefixes: Sequence[str],
    continuations: Sequence[str],
    batch_size: int = 32,
) -> np.ndarray:
    """``log p(continuation | prefix)`` (natural log, summed over tokens) for each pair.

    ``model``: a :class:`ScoredModel` (``tokenizer`` may then be None) or a
    plain HF causal LM. See :func:`tokenize_pairs` for which tokens count.
    """
    sm = as_scored(model, tokenizer)
    rows, masks = tokenize_pairs(sm, list(prefixes), list(continuations))
    return _masked_sums(sm, rows, masks, batch_size)


def record_losses(
    model: Any,
    tokenizer: Any,
    records: Sequence[Any],
    *,
    batch_size: int = 16,
    max_length: int = 256,
    loss_on_prompt: bool | None = None,
    fmt: str | None = None,
    cache: dict[Any, Any] | None = None,
) -> np.ndarray:
    """Mean token NLL of each record (objects with ``prompt`` and ``code``), as in training.

    The format follows the model's conditioning (module docstring), or
    ``fmt``: ``"prompt+code"`` / ``"code"`` (EOS ++ code) to score a plain
    reference model like a target. Loss tokens: code + EOS, plus the prompt
    when ``loss_on_prompt`` (default: the model's training objective). With
    ``latent_samples > 0``: ``-logmeanexp_z(sum_t log p) / n_tokens``. A
    record with no loss token left after truncation gets NaN. ``cache``: see
    :func:`_masked_sums` (one audit run's dict, in memory only).
    """
    sm = as_scored(model, tokenizer)
    fmt = fmt or {"prompt": "prompt+code", "none": "code", "latent": "latent"}[sm.conditioning]
    if fmt not in ("prompt+code", "code", "latent") or (fmt == "latent") != (
        sm.conditioning == "latent"
    ):
        raise AuditError(f"format {fmt!r} does not fit a {sm.conditioning!r} model")
    on_prompt = sm.loss_on_prompt if loss_on_prompt is None else bool(loss_on_prompt)
    encoded = encode_records(list(records), sm.tokenizer, max_length)
    rows, masks = [], []
    for enc in encoded:
        segs = np.array(enc.segments)
        if fmt == "prompt+code":
            row = list(enc.input_ids)
            mask = (segs != PAD) if on_prompt else (segs == CODE)
            mask[0] = False  # nothing predicts the first token
        else:
            row = [t for t, s in zip(enc.input_ids, enc.segments, strict=True) if s == CODE]
            if fmt == "code":
                row = [sm.eos_id] + row
            mask = np.ones(len(row), dtype=bool)
            if fmt == "code":
                mask[0] = False
        rows.append(row)
        masks.append(np.asarray(mask, dtype=bool))
    sums = _masked_sums(sm, rows, masks, batch_size, cache)
    counts = np.array([m.sum() for m in masks], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        losses = np.where(counts > 0, -sums / np.maximum(counts, 1), np.nan)
    if not np.all(np.isfinite(losses)):
        log.warning(
            "record_losses: %d of %d records have no scorable token",
            int(np.sum(~np.isfinite(losses))),
            len(losses),
        )
    return losses


def describe(sm: ScoredModel) -> dict[str, Any]:
    """The public description of a scored model for audit summaries."""
    keys = ("path", "kind", "method", "dp", "epsilon", "delta", "base_model")
    out = {k: sm.info[k] for k in keys if k in sm.info}
    out["conditioning"] = sm.conditioning
    if sm.conditioning == "latent":
        out["latent_scoring"] = (
            "z = 0 (prior mean)"
            if not sm.latent_samples
            else f"marginal over {sm.latent_samples} z ~ N(0, I) draws"
        )
    return out
