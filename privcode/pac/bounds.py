"""PAC privacy for autoregressive generation: budgets, noise and attacker bounds.

Setting (seed 004, docs/methods.md, PAC-private generation): the secret ``S`` is the realised
world, uniform over ``m`` worlds; each private record is in exactly ``m/2`` worlds (membership
prior exactly 1/2). Each released token costs at most ``b`` nats of mutual information, so a
session's ``T`` tokens give ``I(S; Y_1..T) <= I(S; H_T) <= b T`` (:func:`charged_mi`).

Noise (anisotropic rule): for the posterior-weighted vote covariance
``Sigma = sum_j lambda_j u_j u_j^T``, variance ``lambda_B,j = sqrt(lambda_j) * (sum_k
sqrt(lambda_k)) / (2 b)`` along ``u_j`` gives ``(1/2) sum_j lambda_j / lambda_B,j = b``
(:func:`gaussian_mi_bound`); ``lambda_j = 0`` gets no noise, and unanimity (``Sigma = 0``) is free.

Attacker bounds: a guess right with prior probability ``pi``, after a release with
``I(S; release) <= I``, succeeds with probability at most the ``p >= pi`` solving
``KL(Bern(p) || Bern(pi)) = I`` (:func:`success_bound`), 1 once ``I >= -log pi``: membership
prior 1/2 (:func:`mia_success_bound`), world identification ``1/m``
(:func:`world_identification_bound`). Measured leakage: ``I(S; H_T) = log m - E[H(P_T)]``,
``P_T`` the curator's final posterior (:func:`measured_leakage`).

All in nats; pure functions (no state, no randomness). Worked numbers: docs/serving.md,
"privcode/pac/bounds.py".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "anisotropic_noise_variances",
    "bernoulli_kl",
    "charged_mi",
    "gaussian_mi_bound",
    "measured_leakage",
    "mia_success_bound",
    "posterior_entropy",
    "success_bound",
    "world_identification_bound",
]


def _check_mi(mi: float) -> float:
    mi = float(mi)
    if not math.isfinite(mi) or mi < 0:
        raise ValueError(f"mutual information must be a finite number >= 0 nats, got {mi!r}")
    return mi


def bernoulli_kl(p: float, q: float) -> float:
    """``KL(Bern(p) || Bern(q))`` in nats, for ``p in [0, 1]``, ``q in (0, 1)``."""
    if not 0.0 <= p <= 1.0 or not 0.0 < q < 1.0:
        raise ValueError(f"need 0 <= p <= 1 and 0 < q < 1, got p={p!r}, q={q!r}")
    out = 0.0
    if p > 0:
        out += p * math.log(p / q)
    if p < 1:
        out += (1 - p) * math.log((1 - p) / (1 - q))
    return out


def success_bound(mi: float, prior: float) -> float:
    """The largest ``p >= prior`` with ``KL(Bern(p) || Bern(prior)) <= mi``.

    The KL is increasing in ``p`` on ``[prior, 1]`` and reaches ``-log prior``
    at ``p = 1``; the root is found by bisection to machine precision.
    """
    mi = _check_mi(mi)
    if not 0.0 < prior < 1.0:
        raise ValueError(f"prior must be in (0, 1), got {prior!r}")
    if mi >= -math.log(prior):
        return 1.0
    lo, hi = prior, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if bernoulli_kl(mid, prior) <= mi:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15:
            break
    return lo


def mia_success_bound(mi: float) -> float:
    """Membership-inference success bound at per-record prior 1/2 (each record in m/2 worlds)."""
    return success_bound(mi, 0.5)


def world_identification_bound(mi: float, m: int) -> float:
    """Bound on guessing the realised world among ``m`` uniform worlds."""
    if int(m) != m or m < 2:
        raise ValueError(f"m must be an integer >= 2, got {m!r}")
    return success_bound(mi, 1.0 / int(m))


def charged_mi(b: float, tokens: int) -> float:
    """The budget a session of ``tokens`` released tokens is charged: ``b * T`` nats."""
    if not b > 0 or not math.isfinite(b):
        raise ValueError(f"per-token budget b must be a finite number > 0, got {b!r}")
    if int(tokens) != tokens or tokens < 0:
        raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
    return float(b) * int(tokens)


def anisotropic_noise_variances(eigenvalues: Sequence[float] | np.ndarray, b: float) -> np.ndarray:
    """``lambda_B,j = sqrt(lambda_j) * sum_k sqrt(lambda_k) / (2 b)`` per eigen-direction.

    ``eigenvalues``: of the vote covariance (PSD; round-off negatives down to
    ``-1e-12`` relative to the largest are treated as 0). All zero: no noise.
    """
    if not b > 0 or not math.isfinite(b):
        raise ValueError(f"per-token budget b must be a finite number > 0, got {b!r}")
    lam = np.asarray(eigenvalues, dtype=np.float64)
    if lam.ndim != 1:
        raise ValueError(f"eigenvalues must be a 1-d array, got shape {lam.shape}")
    scale = float(np.max(np.abs(lam))) if lam.size else 0.0
    if lam.size and (not np.all(np.isfinite(lam)) or np.min(lam) < -1e-12 * max(scale, 1.0)):
        raise ValueError("eigenvalues must be finite and >= 0 (a covariance is PSD)")
    roots = np.sqrt(np.clip(lam, 0.0, None))
    return roots * roots.sum() / (2.0 * float(b))


def gaussian_mi_bound(
    eigenvalues: Sequence[float] | np.ndarray, noise_variances: Sequence[float] | np.ndarray
) -> float:
    """PAC bound ``(1/2) sum_j lambda_j / lambda_B,j`` (directions without variance count 0).

    A direction with vote variance but no noise leaks without bound: ``inf``.
    """
    lam = np.clip(np.asarray(eigenvalues, dtype=np.float64), 0.0, None)
    noise = np.asarray(noise_variances, dtype=np.float64)
    if lam.shape != noise.shape:
        raise ValueError(f"shapes differ: {lam.shape} eigenvalues vs {noise.shape} variances")
    moving = lam > 0
    if np.any(noise[moving] <= 0):
        return math.inf
    return 0.5 * float(np.sum(lam[moving] / noise[moving]))


def posterior_entropy(posterior: Sequence[float] | np.ndarray) -> float:
    """Shannon entropy (nats) of a distribution over worlds; it must sum to 1."""
    p = np.asarray(posterior, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or np.any(p < 0) or not math.isclose(p.sum(), 1.0, rel_tol=1e-9):
        raise ValueError("posterior must be a non-empty 1-d probability vector summing to 1")
    nz = p[p > 0]
    return float(-np.sum(nz * np.log(nz)))


def measured_leakage(m: int, final_posteriors: Iterable[Sequence[float] | np.ndarray]) -> float:
    """``I(S; H_T) = log m - E[H(P_T)]``: mean over sessions of the posterior-entropy drop."""
    posteriors = [np.asarray(p, dtype=np.float64) for p in final_posteriors]
    if not posteriors:
        raise ValueError("need at least one session's final posterior")
    if any(p.shape != (m,) for p in posteriors):
        raise ValueError(f"every posterior must have m={m} entries")
    return math.log(m) - float(np.mean([posterior_entropy(p) for p in posteriors]))
