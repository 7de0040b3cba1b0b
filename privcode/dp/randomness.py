"""The run's secret randomness: the one source of every random choice on a private path.

A DP-SGD step makes four kinds of random choices, and the guarantee needs all
of them secret and independent of the data's layout:

* the Poisson sample ``S_t`` (:mod:`privcode.dp.sampler`),
* the Gaussian noise ``N(0, sigma^2 C^2 I)`` (:func:`privcode.dp.dpsgd.privatize`),
* dropout masks (LoRA dropout, a base model's own dropout) in the forward,
* per-record noise inside a record's loss (PrivLC's ``eps`` of ``z = mu + sigma eps``).

A public seed (``train.seed``) would let anyone replay them. A record's
position in the file must not key them either: adding or removing one record
would shift the randomness of every later record, so one record's presence
would change many clipped gradients, and the sensitivity-C argument for the
add/remove relation fails. So per-record randomness is a function of the
record's own content and a secret (:func:`record_seeds`), and everything else
comes from per-step secret streams.

Modes:

* ``standard`` (default): one 126-bit secret seed drawn from OS entropy by
  rank 0 at every (re)start and broadcast, never stored. Streams are derived
  with ``numpy.random.SeedSequence(seed, spawn_key=(purpose, step[, rank]))``
  and drive fast PRNGs (Philox, MT19937), which are not cryptographically
  secure: as in Opacus' default mode, an attacker who could reconstruct the
  generator state from released values is out of scope.
* ``secure`` (``train.secure_rng``, as Opacus' ``secure_mode``): the Poisson
  mask is drawn from ``os.urandom`` (a CSPRNG) on rank 0 and broadcast; the
  noise generator is reseeded from ``os.urandom`` at every step and the noise
  is the sum of 4 draws divided by 2 (Opacus' mitigation of floating-point
  attacks on the Gaussian sampler); dropout and per-record keys come from
  fresh ``os.urandom`` bytes at every step. No generator state spans two
  steps, so one leaked state reveals at most one step.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privcode.checks import check_number

__all__ = ["RNG_MODES", "SecretRandomness", "record_key", "record_seeds", "secure_poisson_mask"]

#: ``train.secure_rng`` false / true.
RNG_MODES = ("standard", "secure")

# Spawn-key purposes of the derived streams (the sampling stream uses (step,)
# alone, see PoissonSchedule; 2**40 + k never collides with a step).
_NOISE, _DROPOUT, _RECORD = 1 << 40, (1 << 40) + 1, (1 << 40) + 2
_MASK63 = (1 << 63) - 1


def secure_poisson_mask(num_records: int, sample_rate: float) -> np.ndarray:
    """``U_i < q`` for ``N`` uniforms of 53 bits each from ``os.urandom`` (a CSPRNG).

    Each record is in the sample independently with probability ``q``
    (rounded to a multiple of 2^-53).
    """
    if num_records < 1 or not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"need num_records >= 1 and q in (0, 1], got {num_records}, {sample_rate}")
    words = np.frombuffer(os.urandom(8 * num_records), dtype=np.uint64) >> np.uint64(11)
    return words < np.uint64(int(sample_rate * (1 << 53)))


def record_key(token_ids: Sequence[int], segments: Sequence[int] = ()) -> int:
    """A 63-bit key of one encoded record: a function of the record's content alone.

    Two records with the same tokens get the same key (and the same per-record
    randomness at a step): harmless, since adding or removing one of them
    changes nobody else's. The key never leaves the worker.
    """
    h = hashlib.blake2b(digest_size=8, person=b"privcode-rec")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.asarray(segments, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK63


def record_seeds(step_secret: bytes, keys: Sequence[int]) -> list[int]:
    """Per-record 63-bit seeds ``BLAKE2b_secret(key)``: secret, and a function of the record only."""
    if len(step_secret) < 16:
        raise ValueError("the step secret must hold at least 16 bytes")
    out = []
    for key in keys:
        h = hashlib.blake2b(int(key).to_bytes(8, "little"), digest_size=8, key=step_secret[:64])
        out.append(int.from_bytes(h.digest(), "little") & _MASK63)
    return out


def _words(seed: int, *spawn: int, n: int = 2) -> list[int]:
    state = np.random.SeedSequence(entropy=seed, spawn_key=spawn).generate_state(n, np.uint64)
    return [int(w) for w in state]


@dataclass
class SecretRandomness:
    """The secret streams of one worker of one training (re)start.

    ``seed`` is the run's secret seed (same on every rank); ``secure`` picks
    the mode (module docstring); ``rank`` separates per-rank streams (dropout).
    """

    seed: int
    secure: bool = False
    rank: int = 0

    def __post_init__(self) -> None:
        check_number(
            "seed", self.seed, min=0, max=1 << 128, max_exclusive=True, integer=True, secret=True
        )
        self._noise_gen: Any = None

    @property
    def mode(self) -> str:
        return RNG_MODES[int(self.secure)]

    def noise_generator(self, device: Any) -> Any:
        """The torch generator of this step's Gaussian noise (rank 0 only).

        Standard: one stream for the whole (re)start. Secure: a generator
        reseeded from ``os.urandom`` at every call (call once per step).
        """
        import torch

        if self._noise_gen is None or self.secure:
            gen = torch.Generator(device=device)
            if self.secure:
                gen.manual_seed(int.from_bytes(os.urandom(8), "little"))
            else:
                hi, lo = _words(self.seed, _NOISE)
                gen.manual_seed((hi << 32 | lo) & ((1 << 64) - 1))
            self._noise_gen = gen
        return self._noise_gen

    def seed_step(self, step: int) -> None:
        """Seed torch's global RNG (CPU and CUDA) for this rank's step: dropout masks.

        Anything in the forward that draws from the global RNG (``nn.Dropout``,
        LoRA dropout) then draws from a secret stream, not from ``train.seed``.
        """
        import torch

        if self.secure:
            torch.manual_seed(int.from_bytes(os.urandom(8), "little") & _MASK63)
        else:
            torch.manual_seed(_words(self.seed, _DROPOUT, step, self.rank, n=1)[0] & _MASK63)

    def record_secret(self, step: int) -> bytes:
        """The 32-byte secret that keys this step's per-record randomness (:func:`record_seeds`).

        Standard: the same on every rank (so a record's randomness does not
        depend on the worker that holds it); secure: fresh ``os.urandom``.
        """
        if self.secure:
            return os.urandom(32)
        return b"".join(w.to_bytes(8, "little") for w in _words(self.seed, _RECORD, step, n=4))
