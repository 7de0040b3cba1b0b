"""The DP-SGD step, split so that the noise is added exactly once across data-parallel ranks.
Design notes: docs/privacy.md, "privcode/dp/dpsgd.py".

One step over the Poisson batch ``S`` (:mod:`privcode.dp.sampler`) releases

    g_hat = ( sum_{i in S} clip_C(g_i) + N(0, sigma^2 C^2 I) ) / (q N)

with ``clip_C(g) = g * min(1, C / (||g|| + 1e-6))`` (one record moves the sum by at most C in
L2) and ``q N`` the EXPECTED batch size (the realised one is private). Rank ``r`` computes
``s_r = sum_{i in S_r} clip_C(g_i)`` (:meth:`PerSampleClipper.clipped_sum`); :func:`privatize`
adds the noise on rank 0 only, all-reduces (SUM) and divides. Per-record gradients: Opacus'
``GradSampleModule`` (``hooks``, ``functorch``, or ``ghost`` clipping). The guarantee assumes:
record i's loss depends on record i only (:func:`check_private_trainable` refuses
batch-statistics layers); only trainable parameters change, only through ``g_hat``; nothing else
computed from the batch leaves a step; the noise generator's state is secret
(:mod:`privcode.dp.randomness`). A non-finite per-record gradient counts as zero (count:
:attr:`PerSampleClipper.last_nonfinite`, for the private audit log only).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from privcode.dp.randomness import SecureNoise
from privcode.registry import GRAD_SAMPLE_MODES  # Opacus' ``ew`` fails on HF's keyword inputs

__all__ = [
    "GRAD_SAMPLE_MODES",
    "PerSampleClipper",
    "all_reduce_sum",
    "apply_flat_gradient",
    "check_private_trainable",
    "clip_and_sum",
    "clip_and_sum_finite",
    "dp_checkpoint",
    "forward_context",
    "enable_gradient_checkpointing",
    "gaussian_noise",
    "privatize",
    "trainable_parameters",
]


# torch warns when a full backward hook fires on a module whose inputs need no
# grad (the first layer of a model whose embeddings are frozen): expected here.
_HOOK_WARNING = "Full backward hook is firing"

#: Added to the norm in the clip factor, as Opacus does: keeps the factor finite.
CLIP_EPS = 1e-6

LossFn = Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor]


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters DP-SGD updates (LoRA weights), in a fixed order."""
    return [p for p in model.parameters() if p.requires_grad]


def check_private_trainable(model: torch.nn.Module) -> None:
    """Refuse models whose training mode mixes records or keeps batch statistics.

    BatchNorm (trainable or not) normalises with statistics of the whole
    batch and, in train mode, writes them into running buffers: both carry
    private information outside the clipped, noised gradient.
    """
    bad = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm | torch.nn.SyncBatchNorm)
    ]
    if bad:
        raise ValueError(f"DP-SGD cannot train a model with batch-statistics layers: {bad[:3]}")
    if not trainable_parameters(model):
        raise ValueError("the model has no trainable parameters")


def clip_and_sum(grad_samples: Sequence[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
    """``sum_i clip_C(g_i)`` flattened, from per-record gradients ``[B, *shape]`` per parameter.

    The norm of record ``i`` is taken over all parameters jointly (flat
    clipping), as the sensitivity bound needs.
    """
    if not grad_samples:
        raise ValueError("no per-sample gradients")
    return clip_and_sum_finite(grad_samples, max_grad_norm)[0]


def clip_and_sum_finite(
    grad_samples: Sequence[torch.Tensor], max_grad_norm: float
) -> tuple[torch.Tensor, int]:
    """:func:`clip_and_sum` and the number of records whose gradient was not finite.

    A record with a NaN/inf entry anywhere (its joint norm is then not
    finite) contributes zero instead of NaN.
    """
    if not grad_samples:
        raise ValueError("no per-sample gradients")
    batch = grad_samples[0].shape[0]
    norms = torch.stack(
        [
            g.reshape(batch, -1).to(torch.promote_types(g.dtype, torch.float32)).norm(2, dim=1)
            for g in grad_samples
        ]
    ).norm(2, dim=0)
    finite = torch.isfinite(norms)
    factor = torch.where(
        finite, (max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0), torch.zeros_like(norms)
    )
    bad = int((~finite).sum())
    parts = []
    for g in grad_samples:
        if bad:
            keep = finite.view(batch, *([1] * (g.dim() - 1)))
            g = torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))
        # Summed in (at least) fp32: per-record gradients of a bf16 pass are bf16.
        acc = torch.promote_types(g.dtype, torch.float32)
        parts.append(torch.einsum("b,b...->...", factor.to(acc), g.to(acc)).reshape(-1))
    return torch.cat(parts), bad


def forward_context(device: torch.device, dtype: torch.dtype | None) -> Any:
    """``torch.autocast`` in ``dtype`` on ``device``'s type; a no-op context for None / fp32."""

    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In-place SUM over the default process group (no-op without one or with one rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gaussian_noise(
    shape: torch.Size | Sequence[int],
    std: float,
    *,
    generator: torch.Generator | SecureNoise | None,
    dtype: torch.dtype,
    device: torch.device | str,
    secure: bool = False,
) -> torch.Tensor:
    """``N(0, std^2 I)``; in secure mode the sum of 4 standard draws divided by 2.

    The 4-draw form is Opacus' ``secure_mode`` mitigation of floating-point
    attacks on the Gaussian sampler (Holohan and Braghin, 2021): same
    distribution, the low-order bits of one draw no longer identify it.
    Secure draws come from ``generator``'s ChaCha20 stream when it is a
    :class:`SecureNoise`, else from one under a fresh key: never from torch.
    """
    if not secure:
        return torch.randn(tuple(shape), generator=generator, dtype=dtype, device=device).mul_(std)
    if not isinstance(generator, SecureNoise):
        generator = SecureNoise(os.urandom(32), 0)
    return generator.normal(shape, std, dtype=dtype, device=device)


def privatize(
    local_sum: torch.Tensor,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    add_noise: bool,
    generator: torch.Generator | SecureNoise | None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = all_reduce_sum,
    secure: bool = False,
) -> torch.Tensor:
    """The released gradient ``(sum_r s_r + [rank 0] N(0, sigma^2 C^2 I)) / (q N)``.

    ``local_sum`` is this rank's ``s_r`` (zeros for an empty shard sample:
    the step still happens and releases noise only). ``add_noise`` must be
    true on exactly one rank. ``all_reduce`` sums in place across ranks
    (``None``: single process). ``secure`` draws the noise as
    :func:`gaussian_noise` does in secure mode. Returns a new tensor;
    ``local_sum`` is kept.
    """
    if expected_batch_size <= 0:
        raise ValueError(f"expected batch size must be positive, got {expected_batch_size}")
    if noise_multiplier < 0:
        raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
    total = local_sum.detach().clone()
    if add_noise and noise_multiplier > 0:
        total.add_(
            gaussian_noise(
                total.shape,
                noise_multiplier * max_grad_norm,
                generator=generator,
                dtype=total.dtype,
                device=total.device,
                secure=secure,
            )
        )
    if all_reduce is not None:
        total = all_reduce(total)
    return total.div_(expected_batch_size)


def apply_flat_gradient(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set ``p.grad`` of each parameter from consecutive slices of ``flat``."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} entries, parameters {offset}")


def dp_checkpoint(gsm: Any) -> Callable[..., Any]:
    """A checkpoint function for HF layers (``_gradient_checkpointing_func``) that Opacus can use.

    Non-reentrant checkpointing runs a layer's forward twice, and Opacus' forward hook would
    capture activations both times (no ``grad_sample``). Here the first run has the hooks of
    ``gsm`` (the ``GradSampleModule``) off, so the activations come from the recomputation only,
    just before that layer's backward hooks consume them; early stopping of the recomputation is
    off, so every module's forward hook runs. ``gsm=None``: plain non-reentrant checkpointing.
    Why: docs/privacy.md, "privcode/dp/dpsgd.py".
    """
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    def checkpointed(function: Callable[..., Any], *args: Any) -> Any:
        calls = 0

        def run(*inner: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1 or gsm is None:
                return function(*inner)
            before = gsm.hooks_enabled
            gsm.hooks_enabled = False
            try:
                return function(*inner)
            finally:
                gsm.hooks_enabled = before

        with set_checkpoint_early_stop(False):
            return checkpoint(run, *args, use_reentrant=False)

    return checkpointed


def enable_gradient_checkpointing(model: torch.nn.Module, gsm: Any = None) -> int:
    """Turn on activation checkpointing in every HF model inside ``model``; returns how many.

    Uses :func:`dp_checkpoint` (with ``gsm``, Opacus' wrapper, when per-record
    gradients are computed). Raises ``ValueError`` when nothing in ``model``
    supports checkpointing.
    """
    from transformers import PreTrainedModel

    func = dp_checkpoint(gsm)
    found = 0
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing:
            m._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
            found += 1
            break  # the outermost HF model sets every layer below it
    if not found:
        raise ValueError("gradient checkpointing: no Hugging Face model in this module supports it")
    return found


def _rows(batch: Mapping[str, Any], keep: torch.Tensor, batch_size: int) -> dict[str, Any]:
    """The rows ``keep`` of a batch: tensors with a leading batch dimension are indexed."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch_size:
            out[k] = v.index_select(0, keep.to(v.device))
        else:
            out[k] = v
    return out


class PerSampleClipper:
    """Opacus per-record gradients of a model, reduced to the clipped sum of one shard batch.

    ``model`` is wrapped in an Opacus ``GradSampleModule`` (``self.module``;
    call the model through it) with ``loss_reduction="sum"``, so the
    per-record gradient of record ``i`` is the gradient of ``loss_fn``'s
    ``i``-th entry. Only parameters with ``requires_grad`` get per-record
    gradients; frozen ones get none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mode: str = "hooks",
        max_grad_norm: float = 1.0,
        *,
        autocast_dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
    ):
        from opacus.grad_sample.utils import prepare_module

        if mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode {mode!r} is not one of {GRAD_SAMPLE_MODES}")
        check_private_trainable(model)
        self.mode = mode
        self.max_grad_norm = float(max_grad_norm)
        self.model = model
        self.params = trainable_parameters(model)
        kwargs: dict[str, Any] = {"batch_first": True, "loss_reduction": "sum", "strict": True}
        if mode == "ghost":
            kwargs["max_grad_norm"] = self.max_grad_norm
        self.module = prepare_module(model, mode, wrap_model=True, **kwargs)
        self.autocast_dtype = autocast_dtype if autocast_dtype != torch.float32 else None
        if gradient_checkpointing:
            enable_gradient_checkpointing(model, self.module)
        self.numel = sum(p.numel() for p in self.params)
        #: Records of the last :meth:`clipped_sum` whose loss or gradient was not
        #: finite (they contributed zero). PRIVATE: never log or report it.
        self.last_nonfinite = 0

    def zeros(self) -> torch.Tensor:
        p = self.params[0]
        return torch.zeros(
            self.numel, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device
        )

    def _clear(self) -> None:
        for p in self.params:
            p.grad = None
            p.grad_sample = None
            if hasattr(p, "_norm_sample"):
                p._norm_sample = None

    def clipped_sum(
        self, loss_fn: LossFn, batch: Mapping[str, Any] | None, batch_size: int
    ) -> torch.Tensor:
        """``s_r = sum_i clip_C(grad loss_i)`` (flat) for a batch of ``batch_size`` records.

        ``batch_size == 0`` returns zeros without a forward pass. Gradient
        state is cleared before returning, so no per-record value survives.
        """
        self.last_nonfinite = 0
        if batch_size == 0 or batch is None:
            return self.zeros()
        self._clear()
        self.module.train()
        try:
            with forward_context(self.params[0].device, self.autocast_dtype):
                losses = loss_fn(self.module, batch)
            if losses.dim() != 1 or losses.shape[0] != batch_size:
                raise ValueError(
                    f"loss_fn must return one loss per record, shape [{batch_size}], "
                    f"got {tuple(losses.shape)}"
                )
            if self.mode == "ghost":
                return self._ghost(losses, loss_fn, batch, batch_size)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_HOOK_WARNING)
                losses.sum().backward()
            samples = [p.grad_sample for p in self.params]
            if any(g is None for g in samples):
                raise RuntimeError(
                    "a trainable parameter got no per-sample gradient: it is "
                    "not used by the loss, or its layer is not supported"
                )
            total, self.last_nonfinite = clip_and_sum_finite(samples, self.max_grad_norm)
            return total
        finally:
            self._clear()

    def _ghost(
        self, losses: torch.Tensor, loss_fn: LossFn, batch: Mapping[str, Any], batch_size: int
    ) -> torch.Tensor:
        # First backward: Opacus' hooks store per-record gradient norms only.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_HOOK_WARNING)
            losses.sum().backward(retain_graph=True)
        coef = self.module.get_clipping_coef().detach()
        for p in self.params:
            p.grad = None
        finite = torch.isfinite(losses.detach()) & torch.isfinite(coef)
        if not bool(finite.all()):
            # 0 * NaN is NaN: a non-finite record cannot be weighted out of the
            # second backward, so the finite records are recomputed alone (rows
            # do not interact, so their losses and norms are the same).
            keep = torch.nonzero(finite).flatten()
            self.last_nonfinite = batch_size - int(keep.numel())
            self._clear()
            if keep.numel() == 0:
                return self.zeros()
            sub = _rows(batch, keep, batch_size)
            bad = self.last_nonfinite
            total = self.clipped_sum(loss_fn, sub, int(keep.numel()))
            self.last_nonfinite += bad
            return total
        # Second backward with the clip factors as constant weights: p.grad is
        # then sum_i c_i g_i; hooks off so nothing is recomputed.
        self.module.disable_hooks()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_HOOK_WARNING)
                (coef.to(losses.dtype) * losses).sum().backward()
        finally:
            self.module.enable_hooks()
        return torch.cat([p.grad.reshape(-1) for p in self.params])
