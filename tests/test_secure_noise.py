"""Secure mode's Gaussian noise (privcode.dp.randomness.secure_normal): ChaCha20, Box-Muller in float64.

The keys are fixed, so every number asserted here is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy import stats

from privcode.dp.dpsgd import gaussian_noise
from privcode.dp.engine import Privacy, make_private
from privcode.dp.randomness import (
    SecretRandomness,
    SecureNoise,
    box_muller,
    chacha20_stream,
    open_uniforms,
    secure_normal,
)

KEY = bytes(range(32))


def _library_keystream(key: bytes, step: int, index: int, nbytes: int) -> bytes:
    """ChaCha20 of the library, nonce laid out by hand: counter 0 | step | tensor index."""
    nonce = bytes(4) + step.to_bytes(8, "little") + index.to_bytes(4, "little")
    return Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(nbytes))


@pytest.mark.parametrize("draws", [1, 4])
def test_secure_normal_is_standard_normal_on_a_million_samples(draws):
    z = secure_normal(KEY, 0, 0, 1_000_000, draws=draws).numpy()
    assert z.dtype == np.float64 and z.shape == (1_000_000,)
    assert abs(z.mean()) < 0.004  # sd of the mean: 0.001
    assert abs(z.std() - 1.0) < 0.003  # sd of the std: 0.0007
    assert stats.kstest(z, stats.norm.cdf).pvalue > 1e-3
    assert abs(stats.kurtosis(z)) < 0.03  # excess kurtosis 0, sd 0.005


def test_secure_noise_has_the_std_and_dtype_asked_for_and_is_cast_last():
    x = SecureNoise(KEY, 5).normal((1000, 1000), 2.5, dtype=torch.float32, device="cpu")
    assert x.dtype == torch.float32 and x.shape == (1000, 1000)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 2.5) < 0.008
    ref = (secure_normal(KEY, 5, 0, 10**6) * 2.5).to(torch.float32)
    assert torch.equal(x.reshape(-1), ref)


def test_stream_is_a_function_of_key_step_and_tensor_index_only():
    a = secure_normal(KEY, 3, 1, 1001)
    assert torch.equal(a, secure_normal(KEY, 3, 1, 1001))
    for other in (secure_normal(KEY, 4, 1, 1001), secure_normal(KEY, 3, 2, 1001)):
        assert (a - other).abs().min() > 0  # no shared value: a different stream
    # Every key byte matters, the last 24 (bits 64..255) included: > 64 bits of key.
    for byte in range(32):
        flipped = bytearray(KEY)
        flipped[byte] ^= 0x80
        assert (a - secure_normal(bytes(flipped), 3, 1, 1001)).abs().min() > 0
    # A source numbers its tensors 0, 1, ...; the same key and step replays them.
    src = SecureNoise(KEY, 3)
    t0, t1 = (src.normal((1001,), 1.0, dtype=torch.float64, device="cpu") for _ in range(2))
    assert torch.equal(t0, secure_normal(KEY, 3, 0, 1001))
    assert torch.equal(t1, a) and src.next_index == 2


def test_uniforms_are_open_and_use_53_bit_odd_numerators():
    edge = np.array([0, 1, (1 << 11) - 1, 1 << 11, (1 << 64) - 1], dtype=np.uint64)
    u = open_uniforms(edge)
    assert u.tolist() == [2.0**-53, 2.0**-53, 2.0**-53, 2.0**-53, 1.0 - 2.0**-53]
    assert float(open_uniforms(np.array([3 << 11], dtype=np.uint64))[0]) == 3 * 2.0**-53
    z = box_muller(open_uniforms(np.array([0, (1 << 64) - 1], dtype=np.uint64)))
    assert z.isfinite().all() and abs(float(z[0])) == pytest.approx(math.sqrt(106 * math.log(2)))
    words = np.frombuffer(chacha20_stream(KEY, 0, 0).update(bytes(8 << 20)), dtype="<u8")
    u = open_uniforms(words)
    assert u.dtype == torch.float64 and 0.0 < u.min() and u.max() < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.001  # sd 0.0001 over 2^20 words


def test_keystream_matches_rfc8439_and_the_library_on_the_same_key_and_nonce():
    # RFC 8439 A.1, test vector 1: zero key, zero nonce, block counter 0.
    rfc = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    assert chacha20_stream(bytes(32), 0, 0).update(bytes(64)) == rfc
    step, index = 0x0123456789ABCDEF, 7
    lib = _library_keystream(KEY, step, index, 1024)
    assert chacha20_stream(KEY, step, index).update(bytes(1024)) == lib
    # And the normals, element by element in pure Python from the library's words.
    n = 8
    words = [int.from_bytes(lib[8 * i : 8 * i + 8], "little") for i in range(n)]
    u = [((w >> 11) | 1) / 2.0**53 for w in words]
    r = [math.sqrt(-2.0 * math.log(v)) for v in u[: n // 2]]
    ref = [ri * math.cos(2 * math.pi * v) for ri, v in zip(r, u[n // 2 :], strict=True)]
    ref += [ri * math.sin(2 * math.pi * v) for ri, v in zip(r, u[n // 2 :], strict=True)]
    got = secure_normal(KEY, step, index, n, draws=1).tolist()
    assert got == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_bad_keys_and_sizes_are_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        secure_normal(bytes(8), 0, 0, 10)  # a 64-bit seed is not a key
    with pytest.raises(ValueError):
        SecureNoise(KEY, -1)
    with pytest.raises(ValueError):
        secure_normal(KEY, 0, 0, 1 << 36)  # past one stream's 2^32 ChaCha20 blocks


def test_secure_gaussian_noise_ignores_a_torch_generator():
    # Before: the secure noise was torch.randn from the generator, so equal seeds gave
    # equal noise. Now it comes from a ChaCha20 stream under a fresh 256-bit key.
    def draw():
        g = torch.Generator().manual_seed(0)
        shape = (10_000,)
        return gaussian_noise(
            shape, 1.0, generator=g, dtype=torch.float32, device="cpu", secure=True
        )

    a, b = draw(), draw()
    assert not torch.equal(a, b) and abs(float(a.std()) - 1.0) < 0.05


def test_secure_engine_step_seeds_no_torch_generator_and_draws_step_keyed_chacha_noise(
    monkeypatch,
):
    """Before: a torch.Generator reseeded with 64 urandom bits per step drew the noise."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = make_private(
        model,
        opt,
        Privacy.dp_sgd(1.0, 1.0),
        num_records=20,
        sample_rate=0.5,
        reserve=lambda request_id: (True, 0, None),
        secure_rng=True,
    )
    seeds, draws = [], []

    class SpyGenerator(torch.Generator):
        def manual_seed(self, seed):
            seeds.append(seed)
            return super().manual_seed(seed)

    real_normal = SecureNoise.normal

    def spy_normal(self, shape, std, **kw):
        draws.append((self.step, self.next_index, math.prod(shape), std))
        return real_normal(self, shape, std, **kw)

    monkeypatch.setattr(torch, "Generator", SpyGenerator)
    monkeypatch.setattr(SecureNoise, "normal", spy_normal)
    x, y = torch.randn(20, 4), torch.randn(20, 3)

    def rows(local, step):
        return {"x": x[local], "y": y[local]}

    def loss_fn(module, batch):
        return ((module(batch["x"]) - batch["y"]) ** 2).sum(1)

    for step in (0, 1, 2):
        assert eng.step(step, rows, loss_fn).taken
    assert seeds == []
    assert draws == [(s, 0, 15, 1.0) for s in (0, 1, 2)]
    assert isinstance(SecretRandomness(1, secure=True).noise_source("cpu", 9), SecureNoise)
