"""One token of PAC-private generation: votes, calibrated noise, posterior, release.

Setting (seed 004, docs/methods.md, PAC-private generation): ``m`` worlds (LoRA adapters on
overlapping halves of the private corpus, :func:`assign_worlds`); the realised world ``S`` is
the secret, drawn once, never released; the candidates ``V_t`` are the public base's top-k.
Step (:func:`pac_step`), given the curator's posterior ``P_{t-1}`` over worlds:

1. Votes (:func:`world_votes`): greedy ``argmax_v log p_s(v)`` or coupled Gumbel
   ``argmax_v (log p_s(v) + G_v)``, ONE public Gumbel vector ``G`` shared by all worlds.
2. ``A_t``: candidates voted for by a world of positive posterior; ``o_s``: world ``s``'s
   one-hot vote over ``A_t`` (``a_t = |A_t|``).
3. ``mu = sum_s P(s) o_s``, ``Sigma = sum_s P(s) (o_s - mu)(o_s - mu)^T``. Unanimity
   (``a_t = 1``, ``Sigma = 0``): release it; no noise, no posterior change, nothing charged.
4. Else ``B ~ N(0, Sigma_B)`` (:func:`noise_model`), full rank: ``Sigma_B = sum_j lambda_B,j
   u_j u_j^T`` over an orthonormal eigenbasis ``u_j`` of ``Sigma`` (all ``a_t`` directions),
   :func:`privcode.pac.bounds.anisotropic_noise_variances` applied to the floored variances
   ``lambda'_j = max(q_j, tau)``, ``q_j = u_j^T Sigma u_j``, ``tau = 1e-12 max_k q_k``;
   ``R_t = o_S + B`` (internal, never released); ``b`` nats are charged.
5. ``P_t(s) ~ P_{t-1}(s) N(R_t; o_s, Sigma_B)``: the exact Bayes posterior given ``R_t``.
6. Release ``Y_t = argmax_{v in A_t} R_t[v]``.

Privacy (posterior as prior): ``I(S; R_t | history) <= (1/2) tr(Sigma_B^-1 Sigma) = (1/2)
sum_j q_j / lambda_B,j <= (1/2) sum_j lambda'_j / lambda_B,j = b``; ``Y_t`` is a function of
``R_t``, so ``I(S; Y_1..T) <= b T``. The floor ``tau`` is what makes this hold: a direction of
tiny positive variance left noiseless would reveal ``S``'s component there, uncharged.
Pure numpy functions (randomness only from the generator passed in). Why the floor and what
it costs: docs/serving.md, "privcode/pac/mechanism.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privcode.pac.bounds import anisotropic_noise_variances

__all__ = ["PacStep", "assign_worlds", "noise_model", "pac_step", "world_votes"]

#: Floor on the variance each direction is noised for, relative to the largest (see step 4).
_VAR_FLOOR = 1e-12
#: Absolute floor (a vote covariance that underflowed, e.g. worlds of denormal posterior).
_TINY = float(np.finfo(np.float64).tiny)


def assign_worlds(num_records: int, m: int, seed: int) -> np.ndarray:
    """``[num_records, m]`` booleans: record ``i`` is in world ``s``; each row has exactly m/2.

    Each record draws a uniformly random half of the worlds (independently),
    so the membership prior of every record in the realised world is exactly
    1/2. ``m`` must be even and >= 2.
    """
    if int(m) != m or m < 2 or m % 2:
        raise ValueError(f"m must be an even integer >= 2, got {m!r}")
    if int(num_records) != num_records or num_records < 0:
        raise ValueError(f"num_records must be an integer >= 0, got {num_records!r}")
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((int(num_records), int(m))), axis=1)
    return ranks < m // 2


def world_votes(logprobs: np.ndarray, gumbel: np.ndarray | None = None) -> np.ndarray:
    """Each world's vote (a candidate index) from ``logprobs[m, k]`` over the candidates.

    ``gumbel``: one public ``[k]`` Gumbel(0, 1) draw shared by every world
    (coupled sampling); None = greedy. Ties go to the lowest index.
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.ndim != 2 or lp.shape[1] == 0:
        raise ValueError(f"logprobs must be [worlds, candidates], got shape {lp.shape}")
    if gumbel is not None:
        g = np.asarray(gumbel, dtype=np.float64)
        if g.shape != (lp.shape[1],):
            raise ValueError(f"gumbel must have shape ({lp.shape[1]},), got {g.shape}")
        lp = lp + g[None, :]
    return np.argmax(lp, axis=1)


def noise_model(sigma: np.ndarray, b: float) -> tuple[np.ndarray, np.ndarray]:
    """``(U, var)``: the step's noise ``Sigma_B = U diag(var) U^T`` for vote covariance ``sigma``.

    ``U`` ([a, a], orthonormal columns ``u_j``): an eigenbasis of ``sigma``; ``var``
    ([a], all > 0): ``anisotropic_noise_variances(max(q_j, tau), b)`` with
    ``q_j = u_j^T sigma u_j`` and ``tau = 1e-12 max_k q_k`` (module docstring, step 4).
    Every direction is noised, so ``(1/2) sum_j q_j / var_j <= b`` holds for the basis
    actually used, whatever the round-off in the eigen-decomposition.
    """
    sigma = np.asarray(sigma, dtype=np.float64)
    _, u = np.linalg.eigh(sigma)
    q = np.clip(np.einsum("ij,ij->j", u, sigma @ u), 0.0, None)  # the bound's exact terms
    tau = max(_VAR_FLOOR * float(q.max()), _TINY)
    # More noise never loosens the bound: the absolute floor only guards against var = 0.
    return u, np.maximum(anisotropic_noise_variances(np.maximum(q, tau), b), _TINY)


@dataclass(frozen=True)
class PacStep:
    """What one step produced. Only ``token`` may leave the server."""

    token: int  #: the released candidate index Y_t
    posterior: np.ndarray  #: P_t over worlds (secret-dependent: never released)
    charged: float  #: nats charged: b, or 0 at unanimity
    active: int  #: a_t, candidates voted for by worlds of positive posterior


def pac_step(
    votes: np.ndarray, posterior: np.ndarray, secret: int, b: float, rng: np.random.Generator
) -> PacStep:
    """One PAC-private token (see the module docstring) from the worlds' ``votes[m]``."""
    votes = np.asarray(votes)
    prior = np.asarray(posterior, dtype=np.float64)
    m = prior.shape[0] if prior.ndim == 1 else -1
    if votes.shape != (m,) or not np.issubdtype(votes.dtype, np.integer):
        raise ValueError(
            f"votes must be integer indices, one per world ({m}), got {votes.dtype} {votes.shape}"
        )
    if np.any(prior < 0) or not math.isclose(prior.sum(), 1.0, rel_tol=1e-9):
        raise ValueError("posterior must be a probability vector over the worlds")
    if not 0 <= secret < m or prior[secret] <= 0:
        raise ValueError("the realised world must be a world of positive posterior")
    alive = prior > 0
    active = np.unique(votes[alive])
    if active.size == 1:
        return PacStep(int(active[0]), prior.copy(), 0.0, 1)
    onehot = (votes[:, None] == active[None, :]).astype(np.float64)  # [m, a]
    mu = prior @ onehot
    centred = onehot - mu
    sigma = (centred * prior[:, None]).T @ centred
    u, noise_var = noise_model(sigma, b)
    r = onehot[secret] + u @ (rng.standard_normal(noise_var.size) * np.sqrt(noise_var))
    # Log-density of N(R; o_s, Sigma_B), up to a constant shared by all s.
    # A world whose posterior underflowed to a denormal still counts as alive (it only
    # makes the step conservative: charged, noisier); its tiny directions may overflow z.
    with np.errstate(divide="ignore", over="ignore"):
        z = ((r[None, :] - onehot) @ u) ** 2 / noise_var[None, :]
        logw = np.where(alive, np.log(prior), -np.inf) - 0.5 * z.sum(axis=1)
    w = np.exp(logw - logw[alive].max())
    return PacStep(int(active[int(np.argmax(r))]), w / w.sum(), float(b), int(active.size))
