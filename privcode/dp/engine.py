"""The one DP engine: every update of weights from private records goes through it.
Design notes: docs/privacy.md, "privcode/dp/engine.py".

As Opacus' ``make_private``: :func:`make_private` wraps a module and its optimizer in a
:class:`PrivateEngine`, whose :meth:`~PrivateEngine.step` at step ``t`` on rank ``r``: (1)
reserves: rank 0 asks the budget (which fsyncs BEFORE it grants) for ``(sigma, q)`` and
broadcasts the answer; a denied step is never taken, an unreachable budget raises
:class:`BudgetUnavailable`; (2) samples ``S_t ∩ shard_r`` (:mod:`privcode.dp.sampler`, a secret
seed); (3) clips: ``s_r = sum clip_C(g_i)`` (:class:`privcode.dp.dpsgd.PerSampleClipper`), in
micro-batches of ``micro_batch_size`` if set (the same sum whatever the cut); (4) noises:
``g = (sum_r s_r + N(0, sigma^2 C^2 I)) / (q N)``, drawn once on rank 0
(:func:`privcode.dp.dpsgd.privatize`); (5) applies ``p.grad = g``, then the optimizer.
The only off switch is :meth:`Privacy.non_private`, with a required reason;
:meth:`Privacy.record` names the mode on every artifact. Only whether the step was taken, the
budget's position and denial reason and the PRIVATE non-finite count leave a step.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from privcode.dp.dpsgd import (
    LossFn,
    PerSampleClipper,
    apply_flat_gradient,
    enable_gradient_checkpointing,
    forward_context,
    privatize,
    trainable_parameters,
)
from privcode.dp.randomness import SecretRandomness, secure_poisson_mask
from privcode.dp.sampler import PoissonSchedule, shard_of
from privcode.errors import PrivcodeError

log = logging.getLogger("privcode.dp")

__all__ = [
    "BudgetUnavailable",
    "NonPrivateSum",
    "Privacy",
    "PrivateEngine",
    "Reserve",
    "StepOutcome",
    "broadcast_ints",
    "make_private",
]

DP_SGD, NON_PRIVATE = "dp-sgd", "non-private"

#: ``reserve(request_id) -> (granted, position, reason)``, called on rank 0 only; raises
#: when the budget cannot answer. ``request_id`` names one release: a retried call with
#: the same id must not be charged twice.
Reserve = Callable[[str], tuple[bool, int, str | None]]
#: ``batch_fn(local_positions, step)``: the collated rows of those shard positions.
BatchFn = Callable[[list[int], int], Mapping[str, Any]]

_GRANTED, _DENIED, _ERROR = 1, 0, -1


class BudgetUnavailable(PrivcodeError):
    """The budget could not answer a reservation: the step is not taken."""


@dataclass(frozen=True)
class Privacy:
    """How an engine trains: DP-SGD, or the one named non-private mode.

    ``dp-sgd``: clip to ``max_grad_norm``, noise ``noise_multiplier * C``,
    every step reserved, sampling from a secret seed. ``non-private``: no
    noise, no reservation; clipped only when ``max_grad_norm`` is set;
    ``seed`` fixes the sampling (replayable: allowed only here); ``reason``
    says why and is written into every artifact (:meth:`record`).
    """

    mode: str
    noise_multiplier: float = 0.0
    max_grad_norm: float | None = None
    grad_sample_mode: str = "hooks"
    reason: str = ""
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode == DP_SGD:
            if not (self.max_grad_norm or 0) > 0:
                raise ValueError("dp-sgd needs a positive max_grad_norm")
            if self.noise_multiplier < 0:
                raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
            if self.seed is not None or self.reason:
                raise ValueError("dp-sgd takes no fixed seed and no non-private reason")
        elif self.mode == NON_PRIVATE:
            if not self.reason.strip():
                raise ValueError("non-private training needs a reason (written into its artifacts)")
            if self.noise_multiplier:
                raise ValueError("non-private training adds no noise")
        else:
            raise ValueError(f"privacy mode {self.mode!r} is not {DP_SGD!r} or {NON_PRIVATE!r}")

    @classmethod
    def dp_sgd(
        cls, noise_multiplier: float, max_grad_norm: float, grad_sample_mode: str = "hooks"
    ) -> Privacy:
        return cls(DP_SGD, float(noise_multiplier), float(max_grad_norm), grad_sample_mode)

    @classmethod
    def non_private(
        cls,
        reason: str,
        *,
        seed: int | None = None,
        max_grad_norm: float | None = None,
        grad_sample_mode: str = "hooks",
    ) -> Privacy:
        return cls(NON_PRIVATE, 0.0, max_grad_norm, grad_sample_mode, reason, seed)

    @property
    def private(self) -> bool:
        return self.mode == DP_SGD

    def record(self) -> dict[str, Any]:
        """What artifacts say about the training mode (public settings only)."""
        rec: dict[str, Any] = {"mode": self.mode}
        if not self.private:
            rec.update(
                reason=self.reason,
                clipped=self.max_grad_norm is not None,
                fixed_seed=self.seed is not None,
                NOT_PRIVATE="trained WITHOUT differential privacy",
            )
        return rec


@dataclass(frozen=True)
class StepOutcome:
    """One :meth:`PrivateEngine.step`. ``nonfinite`` is PRIVATE (audit log only)."""

    taken: bool
    position: int = -1
    reason: str | None = None
    nonfinite: int = 0


class NonPrivateSum:
    """The plain (unclipped) gradient sum of a batch: the non-private mode. NOT PRIVATE.

    Same interface as :class:`privcode.dp.dpsgd.PerSampleClipper`; the engine
    adds no noise. ``train_mode`` False leaves the module's mode to the caller
    (peft's mixed-adapter batches need eval mode).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        train_mode: bool = True,
        *,
        autocast_dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
    ):
        self.module = module
        self.params = trainable_parameters(module)
        self.numel = sum(p.numel() for p in self.params)
        self.train_mode = train_mode
        self.autocast_dtype = autocast_dtype
        if gradient_checkpointing:
            enable_gradient_checkpointing(module)
        self.last_nonfinite = 0

    def clipped_sum(
        self, loss_fn: LossFn, batch: Mapping[str, Any] | None, batch_size: int
    ) -> torch.Tensor:
        p0 = self.params[0]
        if batch_size == 0 or batch is None:
            return torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)
        for p in self.params:
            p.grad = None
        if self.train_mode:
            self.module.train()
        with forward_context(p0.device, self.autocast_dtype):
            losses = loss_fn(self.module, batch)
        losses.sum().backward()
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1)
                for p in self.params
            ]
        )
        for p in self.params:
            p.grad = None
        return flat


def broadcast_ints(values: Sequence[int], device: Any) -> list[int]:
    """Rank 0's ``values`` on every rank (int64; no-op with one process)."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


def _all_reduce_count(value: int, world: int, device: Any) -> int:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


def _seed(privacy: Privacy, device: Any) -> int:
    """The schedule/noise seed: OS entropy on rank 0 (secret), broadcast; fixed only if non-private.

    Fresh at every engine start: a step re-run after a restart gets a new,
    independent batch and noise draw, as its new budget charge assumes.
    """
    seed = int(privacy.seed) % (1 << 126) if privacy.seed is not None else secrets.randbits(126)
    hi, lo = broadcast_ints([seed >> 63, seed & ((1 << 63) - 1)], device)
    return hi << 63 | lo


class PrivateEngine:
    """reserve -> sample -> clip -> noise -> apply, for one data-parallel rank. See the module."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        privacy: Privacy,
        *,
        num_records: int,
        sample_rate: float,
        reserve: Reserve | None = None,
        rank: int = 0,
        world: int = 1,
        device: Any = "cpu",
        secure_rng: bool = False,
        sampler: Callable[[int], list[int]] | None = None,
        expected_batch_size: float | None = None,
        train_mode: bool = True,
        micro_batch_size: int = 0,
        autocast_dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
    ):
        if privacy.private:
            if rank == 0 and reserve is None:
                raise ValueError("dp-sgd needs a budget to reserve every step from")
            if sampler is not None or expected_batch_size is not None:
                raise ValueError("dp-sgd samples Poisson batches from its secret schedule only")
        elif reserve is not None:
            raise ValueError("non-private training reserves nothing from a budget")
        self.privacy = privacy
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.optimizer = optimizer
        if micro_batch_size < 0:
            raise ValueError(f"micro_batch_size must be >= 0, got {micro_batch_size}")
        self.micro_batch_size = int(micro_batch_size)
        if privacy.max_grad_norm is not None:
            self.clipper: PerSampleClipper | NonPrivateSum = PerSampleClipper(
                module,
                mode=privacy.grad_sample_mode,
                max_grad_norm=privacy.max_grad_norm,
                autocast_dtype=autocast_dtype,
                gradient_checkpointing=gradient_checkpointing,
            )
        else:
            self.clipper = NonPrivateSum(
                module,
                train_mode=train_mode,
                autocast_dtype=autocast_dtype,
                gradient_checkpointing=gradient_checkpointing,
            )
        self.params = self.clipper.params  # the flat gradient's order
        self.num_records, self.sample_rate = int(num_records), float(sample_rate)
        self.expected_batch_size = (
            float(expected_batch_size)
            if expected_batch_size is not None
            else self.sample_rate * self.num_records
        )
        seed = _seed(privacy, self.device)
        self.schedule = PoissonSchedule(self.num_records, self.sample_rate, seed)
        self.randomness = SecretRandomness(seed, secure=secure_rng and privacy.private, rank=rank)
        self._reserve_fn, self._sampler = reserve, sampler
        if not privacy.private:
            log.warning("non-private training (%s): no noise, no budget", privacy.reason)

    @property
    def module(self) -> Any:
        """The module to compute losses through (Opacus' wrapper when clipping)."""
        return self.clipper.module

    def _reserve(self, request_id: str) -> tuple[int, int, str | None]:
        code, position, reason = _GRANTED, -1, None
        if self.rank == 0 and self._reserve_fn is not None:
            try:
                granted, position, reason = self._reserve_fn(request_id)
                code = _GRANTED if granted else _DENIED
            except Exception as exc:  # noqa: BLE001 - any budget failure must stop training
                code, reason = _ERROR, f"{type(exc).__name__}: {exc}"
        code, position = broadcast_ints([code, position], self.device)
        if code == _ERROR:
            raise BudgetUnavailable(
                "privacy budget unavailable, step not taken" + (f": {reason}" if reason else "")
            )
        return code, position, reason

    def sample(self, step: int) -> list[int]:
        """Global indices of ``S_step`` in this rank's shard ``{i : i mod W = rank}``."""
        if self._sampler is not None:
            return list(self._sampler(step))
        if not self.randomness.secure:
            return [int(i) for i in self.schedule.indices(step, self.rank, self.world)]
        n = self.num_records
        mask = secure_poisson_mask(n, self.sample_rate) if self.rank == 0 else np.zeros(n, bool)
        if self.world > 1:
            t = torch.from_numpy(mask.astype(np.uint8)).to(self.device)
            dist.broadcast(t, src=0)
            mask = t.cpu().numpy().astype(bool)
        shard = shard_of(n, self.rank, self.world)
        return [int(i) for i in shard[mask[shard]]]

    def _clipped_sum(
        self, local: list[int], step: int, batch_fn: BatchFn, loss_fn: LossFn
    ) -> tuple[torch.Tensor, int]:
        """``s_r`` over this shard's sample, one micro-batch at a time; and its non-finite count.

        No collective runs in here: ranks may make different numbers of passes.
        """
        if not local:
            return self.clipper.clipped_sum(loss_fn, None, 0), 0
        size = self.micro_batch_size or len(local)
        total: torch.Tensor | None = None
        nonfinite = 0
        for start in range(0, len(local), size):
            chunk = local[start : start + size]
            part = self.clipper.clipped_sum(loss_fn, batch_fn(chunk, step), len(chunk))
            nonfinite += self.clipper.last_nonfinite
            total = part if total is None else total.add_(part)
            del part
        assert total is not None
        return total, nonfinite

    def step(
        self, step: int, batch_fn: BatchFn, loss_fn: LossFn, request_id: str = ""
    ) -> StepOutcome:
        """One update (see the module). ``batch_fn`` gets this shard's local positions."""
        code, position, reason = self._reserve(request_id or f"step:{step}")
        if code == _DENIED:
            return StepOutcome(False, position, reason)
        chosen = self.sample(step)
        local = [(i - self.rank) // self.world for i in chosen] if self._sampler is None else chosen
        self.randomness.seed_step(step)
        local_sum, own_nonfinite = self._clipped_sum(local, step, batch_fn, loss_fn)
        nonfinite = _all_reduce_count(own_nonfinite, self.world, self.device)
        grad = privatize(
            local_sum,
            noise_multiplier=self.privacy.noise_multiplier,
            max_grad_norm=self.privacy.max_grad_norm or 1.0,
            expected_batch_size=self.expected_batch_size,
            add_noise=self.rank == 0 and self.privacy.private,
            secure=self.randomness.secure,
            generator=(
                self.randomness.noise_source(self.device, step)
                if self.rank == 0 and self.privacy.private
                else None
            ),
        )
        apply_flat_gradient(self.params, grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(True, position, None, nonfinite)


def make_private(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, privacy: Privacy, **kwargs: Any
) -> PrivateEngine:
    """The engine for ``module`` (its trainable parameters) and ``optimizer`` (over them)."""
    return PrivateEngine(module, optimizer, privacy, **kwargs)
