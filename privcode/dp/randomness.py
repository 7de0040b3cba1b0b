"""The run's secret randomness: the one source of every random choice on a private path.

The Poisson sample, the Gaussian noise, dropout masks and per-record noise in a loss (PrivLC's
``eps``) must be secret and independent of the data's layout: never from ``train.seed``, never
keyed by a record's position (one record would change other records' clipped gradients).
Per-record randomness is a function of the record's content and a secret (:func:`record_seeds`),
the rest comes from per-step secret streams. ``standard``: one 126-bit seed from OS entropy on
rank 0 at every (re)start, broadcast, never stored; streams
``SeedSequence(seed, spawn_key=(purpose, step[, rank]))`` drive fast, non-cryptographic PRNGs.
``secure`` (``train.secure_rng``): Poisson masks from ``os.urandom``; noise from
:func:`secure_normal` (ChaCha20 under a fresh ``os.urandom`` key per step, nonce
``0 (u32 LE) | t (u64 LE) | j (u32 LE)``, uniforms ``((w >> 11) | 1) 2^-53``, Box-Muller in
float64, 4 draws summed / 2); dropout and per-record keys fresh per step: no generator state spans
two steps. Design notes: docs/privacy.md, "privcode/dp/randomness.py".
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privcode.checks import check_number

__all__ = [
    "RNG_MODES",
    "SecretRandomness",
    "SecureNoise",
    "box_muller",
    "chacha20_stream",
    "open_uniforms",
    "record_key",
    "record_seeds",
    "secure_normal",
    "secure_poisson_mask",
]

#: ``train.secure_rng`` false / true.
RNG_MODES = ("standard", "secure")

# Spawn-key purposes of the derived streams (the sampling stream uses (step,)
# alone, see PoissonSchedule; 2**40 + k never collides with a step).
_NOISE, _DROPOUT, _RECORD = 1 << 40, (1 << 40) + 1, (1 << 40) + 2
_MASK63 = (1 << 63) - 1
#: ChaCha20 key bytes; its 32-bit block counter bounds one stream to 2^32 blocks of 64 bytes.
KEY_BYTES, _MAX_STREAM_BYTES = 32, 64 << 32


def secure_poisson_mask(num_records: int, sample_rate: float) -> np.ndarray:
    """``U_i < q`` for ``N`` uniforms of 53 bits each from ``os.urandom`` (a CSPRNG).

    Each record is in the sample independently with probability ``q``
    (rounded to a multiple of 2^-53).
    """
    if num_records < 1 or not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"need num_records >= 1 and q in (0, 1], got {num_records}, {sample_rate}")
    words = np.frombuffer(os.urandom(8 * num_records), dtype=np.uint64) >> np.uint64(11)
    return words < np.uint64(int(sample_rate * (1 << 53)))


def chacha20_stream(key: bytes, step: int, index: int) -> Any:
    """The ChaCha20 keystream of ``key`` for tensor ``index`` of ``step`` (an encryptor of zeros)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    if len(key) != KEY_BYTES:
        raise ValueError(f"the noise key must hold {KEY_BYTES} bytes, got {len(key)}")
    nonce = struct.pack("<IQI", 0, step, index)  # block counter | step | tensor index
    return Cipher(algorithms.ChaCha20(bytes(key), nonce), mode=None).encryptor()


def open_uniforms(words: np.ndarray, device: Any = "cpu") -> Any:
    """``((w >> 11) | 1) 2^-53``, float64 on ``device``: uniforms in (0, 1), odd multiples of 2^-53."""
    import torch

    odd = (words >> np.uint64(11)) | np.uint64(1)  # < 2^53: exact as int64 and as float64
    return torch.from_numpy(odd.view(np.int64)).to(device).to(torch.float64).mul_(2.0**-53)


def box_muller(u: Any) -> Any:
    """``2m`` float64 ``N(0, 1)`` from ``2m`` open uniforms: ``u1 = u[:m]``, ``u2 = u[m:]``."""
    import torch

    m = u.numel() // 2
    r = u[:m].log().mul_(-2.0).sqrt_()
    theta = u[m:].mul(2.0 * math.pi)
    return torch.cat((theta.cos().mul_(r), theta.sin_().mul_(r)))


def secure_normal(
    key: bytes, step: int, index: int, n: int, draws: int = 4, device: Any = "cpu"
) -> Any:
    """``n`` float64 ``N(0, 1)`` on ``device``: the sum of ``draws`` Box-Muller draws / sqrt(draws).

    All draws read one keystream (:func:`chacha20_stream`) in turn, one
    call per draw, never per element; the float64 maths runs on ``device``.
    """
    import torch

    m = -(-n // 2)
    if n < 0 or draws < 1 or 16 * m * draws > _MAX_STREAM_BYTES:
        raise ValueError(f"need 0 <= n and 1 <= draws within one stream, got {n}, {draws}")
    stream = chacha20_stream(key, step, index)
    total = torch.zeros(n, dtype=torch.float64, device=device)
    for _ in range(draws):
        words = np.frombuffer(stream.update(bytes(16 * m)), dtype="<u8")
        total += box_muller(open_uniforms(words, device))[:n]
    return total.div_(math.sqrt(draws))


class SecureNoise:
    """One step's secure noise source: a 256-bit key and the step; tensor ``j`` is its j-th draw."""

    def __init__(self, key: bytes, step: int) -> None:
        if len(key) != KEY_BYTES or not 0 <= step < 1 << 64:
            raise ValueError(f"need a {KEY_BYTES}-byte key and a step in [0, 2^64)")
        self._key, self.step, self.next_index = bytes(key), int(step), 0

    def normal(self, shape: Sequence[int], std: float, *, dtype: Any, device: Any) -> Any:
        """``N(0, std^2 I)`` of ``shape`` from the next tensor's stream, cast to ``dtype`` last."""
        index, self.next_index = self.next_index, self.next_index + 1
        z = secure_normal(self._key, self.step, index, math.prod(shape), device=device)
        return z.mul_(std).reshape(tuple(shape)).to(dtype)


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

    def noise_source(self, device: Any, step: int) -> Any:
        """What :func:`privcode.dp.dpsgd.privatize` draws this step's noise from (rank 0 only).

        Standard: :meth:`noise_generator`. Secure: a :class:`SecureNoise` of
        ``step`` under a fresh 256-bit ``os.urandom`` key (call once per step).
        """
        if self.secure:
            return SecureNoise(os.urandom(KEY_BYTES), step)
        return self.noise_generator(device)

    def noise_generator(self, device: Any) -> Any:
        """The standard mode's noise stream: one torch generator for the whole (re)start.

        Secure mode has none (a 64-bit torch seed is not a CSPRNG): its noise
        comes from :meth:`noise_source`'s :class:`SecureNoise` only.
        """
        import torch

        if self.secure:
            raise ValueError("secure mode draws its noise from noise_source(), never torch")
        if self._noise_gen is None:
            gen = torch.Generator(device=device)
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
