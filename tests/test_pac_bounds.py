"""PAC-private generation maths against the seed's published numbers and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privcode.pac.bounds import (
    anisotropic_noise_variances,
    bernoulli_kl,
    charged_mi,
    gaussian_mi_bound,
    measured_leakage,
    mia_success_bound,
    posterior_entropy,
    success_bound,
    world_identification_bound,
)


def test_bounds_match_the_seed_text():
    """docs/methods.md, PAC-private generation: the checks the seed states explicitly."""
    assert mia_success_bound(2.0**-32 * 1e6) == pytest.approx(0.51079, abs=5e-6)
    assert mia_success_bound(charged_mi(2.0**-16, 64)) == pytest.approx(0.5221, abs=5e-5)
    assert mia_success_bound(charged_mi(2.0**-8, 64)) == pytest.approx(0.8379, abs=5e-5)
    assert world_identification_bound(charged_mi(2.0**-16, 64), 128) == pytest.approx(
        0.012, abs=5e-4
    )


@pytest.mark.parametrize(
    ("b", "tokens", "world_id", "mia"),
    [
        # the seed's Table 6 (greedy sweep), bounds in parentheses there
        (2.0**-4, 64, 0.894, 1.000),
        (2.0**-8, 64, 0.130, 0.838),
        (2.0**-16, 64, 0.012, 0.522),
        (2.0**-32, 64, 0.008, 0.500),
        (2.0**-8, 256, 0.337, 1.000),
        # the seed's Table 7 (sessions)
        (2.0**-16, 1024, 0.028, 0.588),
        (2.0**-16, 4096, 0.056, 0.675),
        (2.0**-20, 4096, 0.017, 0.544),
        (2.0**-24, 4096, 0.010, 0.511),
    ],
)
def test_bounds_match_the_seed_tables(b, tokens, world_id, mia):
    mi = charged_mi(b, tokens)
    assert world_identification_bound(mi, 128) == pytest.approx(world_id, abs=5e-4)
    assert mia_success_bound(mi) == pytest.approx(mia, abs=5e-4)


def test_success_bound_inverts_the_kl_and_saturates():
    for prior in (0.5, 1 / 128, 0.9):
        for mi in (1e-9, 1e-3, 0.1):
            p = success_bound(mi, prior)
            assert prior <= p <= 1.0
            if p < 1.0:
                assert bernoulli_kl(p, prior) == pytest.approx(mi, rel=1e-9, abs=1e-15)
        assert success_bound(0.0, prior) == pytest.approx(prior)
        assert success_bound(-math.log(prior), prior) == 1.0  # KL(Bern(1) || Bern(prior))
    # small-I expansion: KL ~ 2 (p - 1/2)^2 at prior 1/2
    assert mia_success_bound(1e-8) - 0.5 == pytest.approx(math.sqrt(1e-8 / 2), rel=1e-3)
    with pytest.raises(ValueError, match=">= 0 nats"):
        success_bound(-1e-3, 0.5)
    with pytest.raises(ValueError, match="m must be an integer"):
        world_identification_bound(0.1, 1)


def test_anisotropic_noise_spends_exactly_b():
    """(1/2) sum lambda_j / lambda_B,j = b for any spectrum: the PAC calibration."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        lam = rng.exponential(size=int(rng.integers(1, 10))) * rng.choice([1e-6, 1.0, 1e3])
        lam[rng.random(lam.size) < 0.3] = 0.0  # directions where the worlds agree
        if not lam.any():
            continue
        b = float(rng.choice([2.0**-32, 2.0**-16, 0.5]))
        noise = anisotropic_noise_variances(lam, b)
        assert np.all(noise[lam == 0] == 0.0) and np.all(noise[lam > 0] > 0)
        assert gaussian_mi_bound(lam, noise) == pytest.approx(b, rel=1e-9)
    # unanimity: no disagreement, no noise, nothing spent
    assert not anisotropic_noise_variances([0.0, 0.0], 2.0**-16).any()
    assert gaussian_mi_bound([0.0, 0.0], [0.0, 0.0]) == 0.0
    # a single direction: lambda_B = lambda / (2 b)
    assert anisotropic_noise_variances([0.25], 0.5)[0] == pytest.approx(0.25)
    assert gaussian_mi_bound([1.0], [0.0]) == math.inf
    with pytest.raises(ValueError, match="PSD"):
        anisotropic_noise_variances([1.0, -0.5], 0.1)


def test_measured_leakage_from_posteriors():
    m = 8
    uniform = np.full(m, 1 / m)
    assert posterior_entropy(uniform) == pytest.approx(math.log(m))
    assert measured_leakage(m, [uniform, uniform]) == pytest.approx(0.0, abs=1e-12)
    point = np.eye(m)[3]
    assert measured_leakage(m, [point]) == pytest.approx(math.log(m))
    assert measured_leakage(m, iter([uniform, point])) == pytest.approx(math.log(m) / 2)
    with pytest.raises(ValueError, match="m=8"):
        measured_leakage(m, [np.full(4, 0.25)])
    with pytest.raises(ValueError, match="probability vector"):
        posterior_entropy([0.5, 0.6])
