"""The PAC-private token step: unanimity is free, the noise rule holds, the posterior is
Bayes-consistent, and the released token carries at most b nats about the world."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privcode.pac.bounds import anisotropic_noise_variances, gaussian_mi_bound
from privcode.pac.mechanism import assign_worlds, noise_model, pac_step, world_votes


def test_every_record_is_in_exactly_half_the_worlds():
    worlds = assign_worlds(1000, 16, seed=3)
    assert worlds.shape == (1000, 16) and worlds.dtype == bool
    assert np.all(worlds.sum(axis=1) == 8)
    assert np.array_equal(worlds, assign_worlds(1000, 16, seed=3))
    assert not np.array_equal(worlds, assign_worlds(1000, 16, seed=4))
    sizes = worlds.sum(axis=0)  # Binomial(1000, 1/2) each: mean 500, sd ~16
    assert np.all(np.abs(sizes - 500) < 80)
    with pytest.raises(ValueError, match="even"):
        assign_worlds(10, 7, seed=0)


def test_votes_greedy_and_coupled_gumbel():
    lp = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.6, 0.3, 0.1]]))
    assert world_votes(lp).tolist() == [0, 1, 0]
    # One shared Gumbel draw: identical worlds always vote alike (coupling) ...
    rng = np.random.default_rng(0)
    draws = [world_votes(lp, rng.gumbel(size=3)) for _ in range(20000)]
    assert all(v[0] == v[2] for v in draws)
    # ... and each world's vote is a sample of its own distribution (Gumbel-max).
    freq = np.bincount([v[1] for v in draws], minlength=3) / len(draws)
    assert np.allclose(freq, [0.2, 0.7, 0.1], atol=0.015)
    with pytest.raises(ValueError, match="gumbel"):
        world_votes(lp, np.zeros(2))


def test_unanimity_costs_nothing_and_draws_no_noise():
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    prior = np.full(4, 0.25)
    step = pac_step(np.array([2, 2, 2, 2]), prior, secret=1, b=2.0**-16, rng=rng)
    assert (step.token, step.charged, step.active) == (2, 0.0, 1)
    assert np.array_equal(step.posterior, prior)
    assert rng.bit_generator.state == state
    # Worlds already ruled out (posterior 0) do not count as dissent.
    step = pac_step(np.array([2, 2, 0, 2]), np.array([0.5, 0.5, 0.0, 0.0]), 0, 0.1, rng)
    assert (step.token, step.charged) == (2, 0.0)


def test_large_budget_reveals_the_world_small_budget_hides_it():
    votes, prior = np.array([0, 0, 1, 2]), np.full(4, 0.25)
    rng = np.random.default_rng(1)
    step = pac_step(votes, prior, secret=2, b=1e4, rng=rng)  # almost no noise
    assert step.token == 1 and step.charged == 1e4 and step.active == 3
    assert step.posterior[2] > 0.999
    tiny = pac_step(votes, prior, secret=2, b=2.0**-32, rng=rng)
    assert np.allclose(tiny.posterior, prior, atol=1e-4)


@pytest.mark.heavy
def test_posterior_is_bayes_consistent():
    """With S drawn from the prior, the expected posterior after a step is the prior."""
    rng = np.random.default_rng(2)
    votes, prior = np.array([0, 0, 1, 2, 1, 0]), np.array([0.3, 0.1, 0.2, 0.2, 0.15, 0.05])
    trials = 20000
    mean = np.zeros(6)
    for _ in range(trials):
        mean += pac_step(votes, prior, int(rng.choice(6, p=prior)), 0.3, rng).posterior
    assert np.allclose(mean / trials, prior, atol=0.01)


@pytest.mark.heavy
@pytest.mark.parametrize("b", [0.05, 0.3])
def test_released_token_carries_at_most_b_nats(b):
    """I(S; Y_t) <= I(S; R_t) <= b, estimated exactly enough by simulation (uniform S)."""
    rng = np.random.default_rng(5)
    votes, m, n = np.array([0, 0, 1, 2]), 4, 12000
    counts = np.zeros((m, 3))
    for s in range(m):
        for _ in range(n):
            counts[s, pac_step(votes, np.full(m, 1 / m), s, b, rng).token] += 1
    p_y_s = counts / n
    p_y = p_y_s.mean(axis=0)
    mi = sum(
        p_y_s[s, y] * math.log(p_y_s[s, y] / p_y[y]) / m
        for s in range(m)
        for y in range(3)
        if p_y_s[s, y] > 0
    )
    assert 0.0 < mi <= b
    # the release still follows the realised world's vote more often than not
    assert all(p_y_s[s, votes[s]] > 1 / 3 for s in range(m))


# Tiny b, vote covariance whose eigenvalues span 0.5 .. 1e-15: each world votes alone, so
# Sigma = diag(P) - P P^T has rank m - 1 with eigenvalues ~ P(i); the three rarest worlds'
# directions lie below 1e-12 of the largest, where the mechanism used to add no noise.
TINY_B = 2.0**-32
RARE = np.array([1e-5, 1e-9, 3e-13, 2e-14, 1e-15])
SPREAD_PRIOR = np.concatenate([[0.5, 0.5 - RARE.sum()], RARE])
SPREAD_VOTES = np.arange(SPREAD_PRIOR.size)


def _vote_covariance(votes, prior):
    onehot = (votes[:, None] == np.unique(votes)[None, :]).astype(np.float64)
    centred = onehot - prior @ onehot
    return onehot, (centred * prior[:, None]).T @ centred


def test_tiny_b_noise_covers_every_moving_direction_and_the_charge_covers_the_leak():
    onehot, sigma = _vote_covariance(SPREAD_VOTES, SPREAD_PRIOR)
    lam = np.linalg.eigvalsh(sigma)
    below = (lam > 0) & (lam < 1e-12 * lam.max())
    assert below.sum() >= 3  # positive directions the old 1e-12 cutoff left without noise
    u, var = noise_model(sigma, TINY_B)
    a = sigma.shape[0]
    assert u.shape == (a, a) and np.allclose(u.T @ u, np.eye(a), atol=1e-12)
    # Every direction is noised, so Sigma_B is positive definite: no direction of Sigma
    # (in particular no rare world's) is released exactly.
    assert np.all(np.isfinite(var)) and np.all(var > 0)
    # Charge: (1/2) tr(Sigma_B^-1 Sigma) over the basis actually used, q_j = u_j^T Sigma u_j.
    q = np.einsum("ij,ij->j", u, sigma @ u)
    charge = gaussian_mi_bound(np.clip(q, 0, None), var)
    assert charge <= TINY_B * (1 + 1e-9)
    # Leakage: I(S; R) <= (1/2) log det(I + Sigma_B^-1 Sigma) (Gaussian, same Sigma_B), exactly.
    w = u / np.sqrt(var)[None, :]  # Sigma_B^-1/2 in the basis u
    gauss_mi = 0.5 * float(np.sum(np.log1p(np.clip(np.linalg.eigvalsh(w.T @ sigma @ w), 0, None))))
    assert 0 < gauss_mi <= charge
    # Each rare world is told apart from the majority world only through finite, small KL.
    for i in range(2, a):
        d = onehot[i] - onehot[0]
        assert 0 < 0.5 * float(((d @ u) ** 2 / var).sum()) < 1e-2
    # Utility: where the worlds disagree the noise is the plain anisotropic rule's, to 1e-4.
    plain = anisotropic_noise_variances(np.clip(q, 0, None), TINY_B)
    big = q > 1e-12 * q.max()
    assert np.allclose(var[big], plain[big], rtol=1e-4)


class _RecordingRng:
    """A numpy generator that keeps its standard normal draws."""

    def __init__(self, seed):
        self._gen, self.draws = np.random.default_rng(seed), []

    def standard_normal(self, size):
        self.draws.append(self._gen.standard_normal(size))
        return self.draws[-1]


@pytest.mark.parametrize("secret", [0, 4, 6])
def test_tiny_b_step_noises_every_direction_and_its_posterior_uses_the_same_model(secret):
    """pac_step draws one normal per direction (>= rank Sigma: every positive-eigenvalue
    direction is noised), releases argmax of R = o_S + U diag(sqrt(var)) z, and returns
    the exact Bayes posterior under that same N(o_s, Sigma_B), the one noise_model charges."""
    onehot, sigma = _vote_covariance(SPREAD_VOTES, SPREAD_PRIOR)
    rng = _RecordingRng(secret)
    step = pac_step(SPREAD_VOTES, SPREAD_PRIOR, secret, TINY_B, rng)
    assert step.charged == TINY_B and len(rng.draws) == 1
    assert rng.draws[0].size >= np.unique(SPREAD_VOTES).size - 1  # = rank of Sigma
    u, var = noise_model(sigma, TINY_B)
    r = onehot[secret] + u @ (rng.draws[0] * np.sqrt(var))
    assert step.token == int(np.argmax(r))
    logw = np.log(SPREAD_PRIOR) - 0.5 * ((((r[None, :] - onehot) @ u) ** 2) / var).sum(axis=1)
    bayes = np.exp(logw - logw.max())
    assert np.allclose(step.posterior, bayes / bayes.sum(), rtol=1e-9, atol=0)
