"""One token of PAC-private generation: votes, calibrated noise, posterior, release.

Setting (seed 004, METHODS.md section 5). ``m`` worlds (LoRA adapters
trained on overlapping halves of the private corpus, :func:`assign_worlds`);
the realised world ``S`` is the secret, drawn once and never released. At
each step the public base model's top-k tokens are the candidates ``V_t``.

Step (:func:`pac_step`), given the curator's posterior ``P_{t-1}`` over worlds:

1. Votes (:func:`world_votes`): world ``s`` votes for one candidate, greedy
   ``argmax_v log p_s(v)`` or coupled Gumbel ``argmax_v (log p_s(v) + G_v)``
   with ONE public Gumbel vector ``G`` shared by all worlds.
2. ``A_t``: the candidates voted for by some world of positive posterior;
   ``o_s`` is world ``s``'s one-hot vote over ``A_t`` (``a_t = |A_t|``).
3. ``mu = sum_s P(s) o_s``, ``Sigma = sum_s P(s) (o_s - mu)(o_s - mu)^T``.
   Unanimity (``a_t = 1``, ``Sigma = 0``): release that token; no noise, no
   posterior change, nothing charged.
4. Otherwise noise ``B ~ N(0, Sigma_B)``, ``Sigma_B = sum_j lambda_B,j u_j u_j^T``
   with the anisotropic rule of :func:`privcode.pac.bounds.anisotropic_noise_variances`
   over the eigenpairs ``(lambda_j, u_j)`` of ``Sigma``; ``R_t = o_S + B``
   (internal, never released); ``b`` nats are charged.
5. ``P_t(s) ~ P_{t-1}(s) N(R_t; o_s, Sigma_B)``, the density taken on the
   support of ``Sigma_B`` (the span of the ``u_j`` with ``lambda_j > 0``):
   every ``o_s - o_S`` of a world with positive posterior lies in it, so the
   restriction loses nothing.
6. Release ``Y_t = argmax_{v in A_t} R_t[v]``.

Why this is private: ``I(S; R_t | history) <= (1/2) sum_j lambda_j / lambda_B,j = b``
under the posterior as prior (PAC privacy), and ``Y_t`` is a function of
``R_t``; composition over a session gives ``I(S; Y_1..T) <= b T``.

Pure functions of their arguments (randomness only from the ``numpy``
generator passed in); numpy only, so they run inside any server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privcode.pac.bounds import anisotropic_noise_variances

__all__ = ["PacStep", "assign_worlds", "pac_step", "world_votes"]

#: Eigenvalues below this fraction of the largest are round-off: the worlds agree there.
_EIG_TOL = 1e-12


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


@dataclass(frozen=True)
class PacStep:
    """What one step produced. Only ``token`` may leave the server."""

    token: int                 #: the released candidate index Y_t
    posterior: np.ndarray      #: P_t over worlds (secret-dependent: never released)
    charged: float             #: nats charged: b, or 0 at unanimity
    active: int                #: a_t, candidates voted for by worlds of positive posterior


def pac_step(votes: np.ndarray, posterior: np.ndarray, secret: int, b: float,
             rng: np.random.Generator) -> PacStep:
    """One PAC-private token (see the module docstring) from the worlds' ``votes[m]``."""
    votes = np.asarray(votes)
    prior = np.asarray(posterior, dtype=np.float64)
    m = prior.shape[0] if prior.ndim == 1 else -1
    if votes.shape != (m,) or not np.issubdtype(votes.dtype, np.integer):
        raise ValueError(f"votes must be integer indices, one per world ({m}), got "
                         f"{votes.dtype} {votes.shape}")
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
    lam, u = np.linalg.eigh(sigma)
    keep = lam > _EIG_TOL * max(float(lam.max()), 0.0)
    lam, u = lam[keep], u[:, keep]
    noise_var = anisotropic_noise_variances(lam, b)
    r = onehot[secret] + u @ (rng.standard_normal(lam.size) * np.sqrt(noise_var))
    # Log-density of N(R; o_s, Sigma_B) on the support, up to a constant shared by all s.
    # A world whose posterior underflowed to a denormal still counts as alive (it only
    # makes the step conservative: charged, noisier); its tiny directions may overflow z.
    with np.errstate(divide="ignore", over="ignore"):
        z = ((r[None, :] - onehot) @ u) ** 2 / noise_var[None, :]
        logw = np.where(alive, np.log(prior), -np.inf) - 0.5 * z.sum(axis=1)
    w = np.exp(logw - logw[alive].max())
    return PacStep(int(active[int(np.argmax(r))]), w / w.sum(), float(b), int(active.size))
