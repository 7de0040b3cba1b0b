"""PrivCode's syntax-aware loss term: the decaying KL weight and the KL over structural tokens.

PrivCode adds, on top of the language-model loss, a KL term restricted to the
*structural* tokens of the code (flagged per token by
:func:`privcode.models.encoding.structural_flags`), weighted by a decaying schedule.

**Weight schedule** (:func:`ast_lambda`)::

    lambda(t) = lambda_min + (lambda_max - lambda_min) * exp(-alpha * floor(t / dt))

**KL term** (:func:`kl_at_positions`): for each record ``b``,
``sum_{t : mask[b, t]} KL(p_junior[b, t] || p_ref[b, t])`` over the whole
vocabulary, with ``p = softmax(logits)`` in float32 and ``ref`` a constant.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ast_lambda", "kl_at_positions"]


def ast_lambda(
    step: int, lambda_max: float = 1000.0, lambda_min: float = 0.1, alpha: float = 0.01, dt: int = 1
) -> float:
    """Weight of the syntax KL term at training step ``step``:
    ``lambda_min + (lambda_max - lambda_min) * exp(-alpha * floor(step / dt))``.

    Starts at ``lambda_max`` and decays towards ``lambda_min`` in a staircase
    of width ``dt`` steps. Raises ``ValueError`` naming the bad argument
    unless ``step >= 0``, ``dt >= 1``, ``alpha >= 0`` and
    ``lambda_max >= lambda_min >= 0``.
    """
    # "not (x >= y)" also rejects NaN.
    if not step >= 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not dt >= 1:
        raise ValueError(f"dt must be >= 1, got {dt}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not lambda_min >= 0:
        raise ValueError(f"lambda_min must be >= 0, got {lambda_min}")
    if not lambda_max >= lambda_min:
        raise ValueError(f"lambda_max must be >= lambda_min ({lambda_min}), got {lambda_max}")
    k = math.floor(step / dt)
    return lambda_min + (lambda_max - lambda_min) * math.exp(-alpha * k)


def kl_at_positions(
    junior_logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-record sum of ``KL(p_junior || p_ref)`` over the masked positions.

    ``junior_logits`` and ``ref_logits`` are ``[B, T, V]``, ``mask`` is
    ``[B, T]`` (bool or 0/1); returns float32 ``[B]`` (zeros where a record
    has no masked position). ``p = softmax(logits)`` in float32; logits must
    be finite. Differentiable w.r.t. ``junior_logits`` only (``ref_logits``
    is detached); row ``b``'s result depends only on row ``b``.
    """
    if junior_logits.dim() != 3 or junior_logits.shape != ref_logits.shape:
        raise ValueError(
            f"logits must both be [B, T, V], got {tuple(junior_logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
        )
    if mask.shape != junior_logits.shape[:2]:
        raise ValueError(
            f"mask must be [B, T] = {tuple(junior_logits.shape[:2])}, got {tuple(mask.shape)}"
        )
    rows, cols = mask.to(device=junior_logits.device, dtype=torch.bool).nonzero(as_tuple=True)
    # Only the selected [N, V] rows are upcast and softmaxed: a full [B, T, V]
    # float32 copy would dominate memory for a large vocabulary.
    log_pj = torch.log_softmax(junior_logits[rows, cols].float(), dim=-1)
    log_pr = torch.log_softmax(ref_logits.detach()[rows, cols].float(), dim=-1)
    kl = (log_pj.exp() * (log_pj - log_pr)).sum(dim=-1)
    out = torch.zeros(junior_logits.shape[0], dtype=torch.float32, device=junior_logits.device)
    # Out-of-place index_add keeps the graph; with an empty mask it is zeros
    # that are still connected to junior_logits (backward works, grads are 0).
    return out.index_add(0, rows, kl)
