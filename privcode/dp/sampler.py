"""Poisson sampling for data-parallel DP-SGD: one seeded schedule, sharded across workers.

Maths. With ``N`` records and sample rate ``q``, the batch of step ``t`` is
``S_t = {i : U_{t,i} < q}`` where the ``U_{t,i}`` are i.i.d. Uniform[0, 1).
So every record is in ``S_t`` independently with probability ``q``, ``|S_t|
~ Binomial(N, q)``, and the batches of different steps are independent:
exactly the Poisson subsampling that the RDP/PRV accountants analyse.

Sharding. Worker ``r`` of ``W`` owns the records ``i`` with ``i mod W == r``
and keeps ``S_t`` restricted to its shard. Every worker draws the *same*
global vector ``U_t`` from ``(seed, t)`` and only looks at its own entries,
so

* each shard sample is a Poisson(q) sample of its shard (sizes
  ``Binomial(|shard|, q)``, independent across shards), and
* the union of the shard samples is ``S_t`` itself: a Poisson(q) sample of the
  whole set, the same for any number of workers (a run on 1 worker and on 2
  workers with the same seed sees the same records at every step).

Drawing all ``N`` uniforms on every worker costs O(N) per step (about a
millisecond per 100k records); it buys the world-size invariance above.

Seed. The schedule is a pure function of ``(seed, step)``: a restarted
worker needs only the step to carry on, and all ranks agree without
communication once they share the seed. The seed must be SECRET: anyone who
knows it knows which records were in every batch, which voids the
amplification by subsampling the accountant relies on. The training loop
therefore draws it from OS entropy on rank 0 and broadcasts it (never to
disk); a fixed seed exists only in the DP engine's non-private mode. In secure
mode (``train.secure_rng``) the mask of every step is drawn from
``os.urandom`` instead (:func:`privcode.dp.randomness.secure_poisson_mask`)
and broadcast by rank 0: the same distribution, from a CSPRNG.
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
