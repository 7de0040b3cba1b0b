"""Poisson sampling for data-parallel DP-SGD: one seeded schedule, sharded across workers.
Design notes: docs/privacy.md, "privcode/dp/sampler.py".

The batch of step ``t`` is ``S_t = {i : U_{t,i} < q}`` with ``U_{t,i}`` i.i.d. Uniform[0, 1):
every record independently with probability ``q``, ``|S_t| ~ Binomial(N, q)``, independent across
steps: the Poisson subsampling the RDP/PRV accountants analyse. Worker ``r`` of ``W`` owns
``i mod W == r`` and keeps its entries of the same global ``U_t`` drawn from ``(seed, t)``, so the
union of the shard samples is ``S_t`` for any world size (O(N) per step). The seed must be SECRET
(it reveals every batch and voids amplification by subsampling): drawn from OS entropy on rank 0,
broadcast, never stored; fixed only in the engine's non-private mode. Secure mode draws each mask
from ``os.urandom`` (:func:`privcode.dp.randomness.secure_poisson_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privcode.checks import check_number

__all__ = ["PoissonSchedule", "shard_of"]


def shard_of(num_records: int, rank: int, world_size: int) -> np.ndarray:
    """Global indices owned by ``rank``: ``i`` with ``i mod world_size == rank``."""
    check_number("world_size", world_size, min=1, integer=True)
    check_number("rank", rank, min=0, max=world_size, max_exclusive=True, integer=True)
    return np.arange(rank, num_records, world_size, dtype=np.int64)


@dataclass(frozen=True)
class PoissonSchedule:
    """The Poisson batches of every step, as a pure function of ``(seed, step)``.

    ``seed`` is a non-negative integer of up to 128 bits (see the module
    docstring: it must be secret in a real run).
    """

    num_records: int
    sample_rate: float
    seed: int

    def __post_init__(self) -> None:
        check_number("num_records", self.num_records, min=1, integer=True)
        check_number("sample_rate", self.sample_rate, min=0, max=1, min_exclusive=True)
        check_number(
            "seed", self.seed, min=0, max=1 << 128, max_exclusive=True, integer=True, secret=True
        )

    @property
    def expected_batch_size(self) -> float:
        """E|S_t| = q N: the divisor of the summed noisy gradient."""
        return self.sample_rate * self.num_records

    def _uniforms(self, step: int) -> np.ndarray:
        check_number("step", step, min=0, integer=True)
        # Philox with a (seed, step) seed sequence: streams of different steps
        # are independent, and any step can be drawn without the earlier ones.
        seq = np.random.SeedSequence(entropy=self.seed, spawn_key=(step,))
        return np.random.Generator(np.random.Philox(seq)).random(self.num_records)

    def global_mask(self, step: int) -> np.ndarray:
        """Boolean mask over all records: membership of each record in ``S_step``."""
        return self._uniforms(step) < self.sample_rate

    def indices(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Sorted global indices of ``S_step`` that belong to ``rank``'s shard."""
        mask = self.global_mask(step)
        shard = shard_of(self.num_records, rank, world_size)
        return shard[mask[shard]]

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint may hold: the shape of the schedule, NOT the secret seed.

        A restarted run draws a fresh seed: steps re-run after a failure are
        then fresh, independent samples, which is what the ledger (charging
        them again) assumes.
        """
        return {"num_records": self.num_records, "sample_rate": self.sample_rate}
