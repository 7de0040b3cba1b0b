"""Membership inference: ROC metrics, the DP ceiling on them, and the loss attacks.

Scores (higher = member): ``-loss_model(x)`` (loss attack, Yeom et al. 2018) and
``-(loss_model(x) - loss_reference(x))`` (Carlini et al. 2022, offline, one reference: the
public base), ``loss`` the mean token NLL of :func:`privcode.audit.scoring.record_losses`.
ROC over every distinct score t: ``TPR(t) = #{members >= t} / n_m``,
``FPR(t) = #{non-members >= t} / n_n``; AUC = ``P(S_m > S_n) + 0.5 P(S_m = S_n)``;
``TPR@FPR<=a`` = the largest TPR at FPR <= a, never interpolated (resolution 1 / n_n).
The DP ceiling (Kairouz, Oh, Viswanath 2015) of an (eps, delta)-DP training:
``TPR <= min(1, e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR))`` (:func:`dp_tpr_ceiling`);
its minimum over the PLD privacy profile ``delta(eps)`` is tighter (:func:`pld_tpr_ceiling`).
Assumption: members and non-members are exchangeable (random membership in one pool).
:func:`check_against_dp` flags only a significant excess: at each point of an FPR grid, a
Clopper-Pearson lower bound on the TPR above the ceiling at an upper bound on the FPR, each at
``(1 - confidence) / (2 * grid size)`` (Bonferroni). An excess means a bug: wrong accounting,
a leaked non-DP path, or mislabelled sets. Design notes: docs/audits.md, "privcode/audit/mia.py".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from privcode.artifacts import ArtifactError, PrivacyRecord
from privcode.audit.scoring import AuditError
from privcode.utils import atomic_path

log = logging.getLogger("privcode.audit")

__all__ = [
    "DEFAULT_FPR_GRID",
    "auc",
    "check_against_dp",
    "dp_tpr_ceiling",
    "mia_metrics",
    "pld_tpr_ceiling",
    "plot_roc",
    "read_dp_params",
    "roc_curve",
    "run_mia",
    "tpr_at_fpr",
]

#: FPR points where :func:`check_against_dp` compares with the ceiling.
DEFAULT_FPR_GRID: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1, 0.2, 0.5)


def _scores(x: Any, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    if a.size == 0:
        raise AuditError(f"{what}: no scores")
    if not np.all(np.isfinite(a)):
        raise AuditError(f"{what}: {int(np.sum(~np.isfinite(a)))} non-finite scores")
    return a


def _counts_at(sorted_scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """``#{s >= t}`` for each threshold t (``sorted_scores`` ascending)."""
    return sorted_scores.size - np.searchsorted(sorted_scores, thresholds, side="left")


def roc_curve(
    member_scores: Any, nonmember_scores: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, tpr, thresholds)``, thresholds descending from +inf (the point (0, 0))."""
    m = np.sort(_scores(member_scores, "member scores"))
    n = np.sort(_scores(nonmember_scores, "non-member scores"))
    thresholds = np.concatenate([[np.inf], np.unique(np.concatenate([m, n]))[::-1]])
    tpr = _counts_at(m, thresholds) / m.size
    fpr = _counts_at(n, thresholds) / n.size
    return fpr, tpr, thresholds


def auc(fpr: Any, tpr: Any) -> float:
    """Trapezoid area under the ROC (ties between a member and a non-member count 1/2)."""
    fpr, tpr = np.asarray(fpr, dtype=float), np.asarray(tpr, dtype=float)
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def tpr_at_fpr(fpr: Any, tpr: Any, fpr_target: float) -> float:
    """The largest TPR among ROC points with FPR <= ``fpr_target`` (no interpolation)."""
    fpr, tpr = np.asarray(fpr, dtype=float), np.asarray(tpr, dtype=float)
    ok = fpr <= fpr_target + 1e-12
    return float(tpr[ok].max()) if ok.any() else 0.0


def _roc_points(fpr: np.ndarray, tpr: np.ndarray, max_points: int) -> dict[str, list[float]]:
    """At most ~``max_points`` ROC points, log-spaced in FPR, each a real (conservative) point."""
    if fpr.size <= max_points:
        keep = np.arange(fpr.size)
    else:
        lo = max(float(fpr[fpr > 0].min()), 1e-6) if np.any(fpr > 0) else 1e-6
        grid = np.concatenate([[0.0], np.geomspace(lo, 1.0, max_points - 1)])
        keep = np.unique(np.searchsorted(fpr, grid, side="right") - 1)
    return {
        "fpr": [round(float(x), 6) for x in fpr[keep]],
        "tpr": [round(float(x), 6) for x in tpr[keep]],
    }


def mia_metrics(
    member_scores: Any,
    nonmember_scores: Any,
    fpr_targets: Sequence[float] = (0.01, 0.1),
    max_points: int = 200,
) -> dict[str, Any]:
    """AUC, TPR at each FPR target, counts and a down-sampled ROC (aggregates only)."""
    fpr, tpr, _ = roc_curve(member_scores, nonmember_scores)
    n_m, n_n = int(np.size(member_scores)), int(np.size(nonmember_scores))
    out: dict[str, Any] = {
        "auc": auc(fpr, tpr),
        "n_members": n_m,
        "n_nonmembers": n_n,
        "fpr_resolution": 1.0 / n_n,
    }
    out["tpr_at_fpr"] = {f"{a:g}": tpr_at_fpr(fpr, tpr, a) for a in fpr_targets}
    for a in fpr_targets:
        out[f"tpr_at_{a * 100:g}pct_fpr"] = tpr_at_fpr(fpr, tpr, a)
    out["roc"] = _roc_points(fpr, tpr, max_points)
    return out


# --------------------------------------------------------------------------- DP ceiling


def dp_tpr_ceiling(fpr: Any, epsilon: float, delta: float) -> np.ndarray:
    """``min(1, e^eps fpr + delta, 1 - e^-eps (1 - delta - fpr))`` (Kairouz et al. 2015)."""
    if not (math.isfinite(epsilon) and epsilon >= 0 and 0 <= delta <= 1):
        raise AuditError(f"need epsilon >= 0 and 0 <= delta <= 1, got ({epsilon}, {delta})")
    f = np.clip(np.asarray(fpr, dtype=float), 0.0, 1.0)
    a = math.exp(epsilon) * f + delta
    b = 1.0 - math.exp(-epsilon) * (1.0 - delta - f)
    return np.minimum(1.0, np.minimum(a, b))


def _history_events(history: Iterable[Any]) -> list[tuple[float, float, int]]:
    """``(sigma, q, steps)`` runs of equal consecutive steps from dicts or DPEvent-likes."""
    runs: list[list[Any]] = []
    for h in history:
        get = h.get if isinstance(h, Mapping) else (lambda k, _h=h: getattr(_h, k))
        sigma, q, steps = (
            float(get("noise_multiplier")),
            float(get("sample_rate")),
            int(get("steps") or 1),
        )
        if runs and runs[-1][0] == sigma and runs[-1][1] == q:
            runs[-1][2] += steps
        else:
            runs.append([sigma, q, steps])
    if not runs:
        raise AuditError("the DP history is empty")
    return [(s, q, n) for s, q, n in runs]


def pld_privacy_profile(
    history: Iterable[Any],
    epsilons: Sequence[float] | None = None,
    points: int = 60,
    discretization: float = 1e-3,
) -> tuple[np.ndarray, np.ndarray]:
    """``(eps, delta(eps))`` of the composed Poisson-subsampled Gaussian history (PLD).

    Add/remove-one neighbours; dp-accounting's pessimistic PLD estimate (a
    valid upper bound on each delta at any ``discretization`` of the privacy
    loss; coarser is faster and slightly looser). Default grid: 0 and
    ``points`` log-spaced values up to the epsilon at delta 1e-10.
    """
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=discretization)
    for sigma, q, steps in _history_events(history):
        event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        acc.compose(dp_event.SelfComposedDpEvent(event, steps))
    if epsilons is None:
        hi = max(float(acc.get_epsilon(1e-10)), 1e-2)
        epsilons = np.concatenate([[0.0], np.geomspace(1e-3, hi, points)])
    eps = np.asarray(sorted(set(float(e) for e in epsilons)), dtype=float)
    return eps, np.array([float(acc.get_delta(e)) for e in eps])


def pld_tpr_ceiling(
    fpr: Any,
    history: Iterable[Any],
    epsilons: Sequence[float] | None = None,
    profile: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """``min_eps dp_tpr_ceiling(fpr, eps, delta_PLD(eps))`` over an epsilon grid.

    Every grid point is a valid ceiling, so the minimum is too; it is at
    most the closed form at any (eps, delta) the mechanism satisfies whose
    eps is on the grid. ``profile`` (from :func:`pld_privacy_profile`)
    skips recomputing the deltas.
    """
    eps, deltas = profile if profile is not None else pld_privacy_profile(history, epsilons)
    f = np.asarray(fpr, dtype=float)
    out = np.ones_like(f)
    for e, d in zip(eps, deltas, strict=True):
        out = np.minimum(out, dp_tpr_ceiling(f, float(e), min(float(d), 1.0)))
    return out


def check_against_dp(
    member_scores: Any,
    nonmember_scores: Any,
    epsilon: float,
    delta: float,
    *,
    history: Iterable[Any] | None = None,
    confidence: float = 0.95,
    fpr_grid: Sequence[float] = DEFAULT_FPR_GRID,
    name: str = "mia",
    profile: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Is a measured TPR significantly above the DP ceiling? (module docstring: Statistics).

    ``history`` (DP steps: dicts with noise_multiplier, sample_rate, steps)
    or its precomputed ``profile`` tightens the ceiling with the PLD one.
    Returns ``violated`` plus, per grid point, the empirical FPR/TPR, the
    bounds and the ceiling. A violation is logged at WARNING, loudly.
    """
    from scipy.stats import beta

    if not 0 < confidence < 1:
        raise AuditError(f"confidence must be in (0, 1), got {confidence}")
    m = np.sort(_scores(member_scores, "member scores"))
    n = np.sort(_scores(nonmember_scores, "non-member scores"))
    alpha = (1.0 - confidence) / (2 * len(fpr_grid))
    if profile is None and history is not None:
        profile = pld_privacy_profile(history)
    points, violated = [], False
    for a in fpr_grid:
        allowed = math.floor(a * n.size + 1e-9)
        # The lowest threshold with at most `allowed` non-members at or above it: just
        # above the (allowed+1)-th largest non-member score v. In the continuous case
        # the true FPR P(X > v) is Beta(allowed + 1, n_n - allowed); ties only lower j.
        if allowed >= n.size:
            t = -np.inf
        else:
            t = float(np.nextafter(n[n.size - allowed - 1], np.inf))
        k = int(_counts_at(m, np.array([t]))[0])
        j = int(_counts_at(n, np.array([t]))[0])
        tpr_lo = float(beta.ppf(alpha, k, m.size - k + 1)) if k > 0 else 0.0
        fpr_hi = (
            float(beta.ppf(1 - alpha, allowed + 1, n.size - allowed)) if allowed < n.size else 1.0
        )
        ceiling = float(dp_tpr_ceiling(fpr_hi, epsilon, delta))
        if profile is not None:
            ceiling = min(ceiling, float(pld_tpr_ceiling(fpr_hi, None, profile=profile)))
        bad = tpr_lo > ceiling
        violated |= bad
        points.append(
            {
                "fpr_target": a,
                "fpr": j / n.size,
                "tpr": k / m.size,
                "tpr_lower": tpr_lo,
                "fpr_upper": fpr_hi,
                "ceiling": ceiling,
                "violated": bool(bad),
            }
        )
    result = {
        "violated": bool(violated),
        "epsilon": float(epsilon),
        "delta": float(delta),
        "confidence": confidence,
        "ceiling": "pld+closed-form" if profile is not None else "closed-form",
        "n_members": int(m.size),
        "n_nonmembers": int(n.size),
        "points": points,
    }
    if violated:
        worst = max(
            (p for p in points if p["violated"]), key=lambda p: p["tpr_lower"] - p["ceiling"]
        )
        log.warning(
            "!!! MEMBERSHIP INFERENCE BEATS THE DP CEILING (%s): at FPR <= %g the TPR "
            "lower bound %.4f exceeds the (eps=%.3g, delta=%.1e) ceiling %.4f "
            "(confidence %.2f). This cannot happen under correct DP: suspect the "
            "accounting, a non-DP path, or the member/non-member sets. !!!",
            name,
            worst["fpr_target"],
            worst["tpr_lower"],
            epsilon,
            delta,
            worst["ceiling"],
            confidence,
        )
    return result


def read_dp_params(release_dir: str | Path) -> dict[str, Any]:
    """``{"epsilon", "delta", "history", "dp"}`` from a junior release's ``privacy.json``."""
    try:
        privacy = PrivacyRecord.read(Path(release_dir) / PrivacyRecord.FILE)
    except ArtifactError as exc:
        raise AuditError(str(exc)) from None
    return {
        "dp": privacy.dp,
        "epsilon": privacy.epsilon,
        "delta": privacy.delta,
        "history": [e.to_dict() for e in privacy.history],
    }


# --------------------------------------------------------------------------- attacks


def _pick(
    records: Any, what: str, max_n: int | None, rng: np.random.Generator, drop_canaries: bool
) -> tuple[list[Any], int]:
    from privcode.data.records import read_records

    recs = read_records(records) if isinstance(records, str | Path) else list(records)
    dropped = 0
    if drop_canaries:
        kept = [r for r in recs if (r.metadata or {}).get("kind") != "canary"]
        dropped, recs = len(recs) - len(kept), kept
    if not recs:
        raise AuditError(f"{what}: no records to score")
    if max_n is not None and len(recs) > max_n:
        recs = [recs[i] for i in sorted(rng.choice(len(recs), size=max_n, replace=False))]
    return recs, dropped


def run_mia(
    model: Any,
    reference: Any,
    members: Any,
    nonmembers: Any,
    *,
    epsilon: float | None = None,
    delta: float | None = None,
    history: Sequence[Any] | None = None,
    max_per_side: int | None = None,
    seed: int = 0,
    batch_size: int = 16,
    max_length: int = 256,
    base_model: str | None = None,
    device: str = "cpu",
    drop_canary_records: bool = True,
    confidence: float = 0.95,
    reference_cache: dict[Any, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Loss and reference-calibrated attacks of ``model`` on members vs non-members.

    ``model`` / ``reference`` (None: loss attack only): a
    :class:`~privcode.audit.scoring.ScoredModel` or a path for
    :func:`~privcode.audit.scoring.load_scored_model`. ``members`` / ``nonmembers``: records or
    a ``.parquet``/``.jsonl`` path (train / heldout), canary records dropped by default (planted
    duplicates, not exchangeable), each side subsampled (seeded) to ``max_per_side``. The DP
    check runs when ``epsilon`` is given or the model is a DP junior release (its privacy
    record). ``reference_cache``: kept by the caller across one audit run's models, it holds
    the reference's losses per scoring format and record set. Returns aggregates only.
    """
    from privcode.audit.scoring import ScoredModel, describe, load_scored_model, record_losses

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    target = (
        model
        if isinstance(model, ScoredModel)
        else load_scored_model(model, base_model=base_model, device=device)
    )
    ref = (
        reference
        if reference is None or isinstance(reference, ScoredModel)
        else load_scored_model(reference, device=device)
    )
    mem, dropped_m = _pick(members, "members", max_per_side, rng, drop_canary_records)
    non, dropped_n = _pick(nonmembers, "non-members", max_per_side, rng, drop_canary_records)
    kw = dict(batch_size=batch_size, max_length=max_length)
    loss_m, loss_n = record_losses(target, None, mem, **kw), record_losses(target, None, non, **kw)
    attacks: dict[str, tuple[np.ndarray, np.ndarray]] = {"loss": (-loss_m, -loss_n)}
    if ref is not None:
        fmt = "code" if target.conditioning in ("latent", "none") else "prompt+code"
        rk = dict(kw, fmt=fmt, loss_on_prompt=target.loss_on_prompt)
        key = (
            id(ref),
            fmt,
            target.loss_on_prompt,
            batch_size,
            max_length,  # in memory only
            hash(tuple((r.prompt, r.code) for r in mem)),
            hash(tuple((r.prompt, r.code) for r in non)),
        )
        cached = reference_cache.get(key) if reference_cache is not None else None
        if cached is None:
            rk["cache"] = reference_cache  # token log-probs shared across loss masks
            cached = (record_losses(ref, None, mem, **rk), record_losses(ref, None, non, **rk))
            if reference_cache is not None:
                reference_cache[key] = cached
        ref_m, ref_n = cached
        attacks["reference_calibrated"] = (-(loss_m - ref_m), -(loss_n - ref_n))
    result: dict[str, Any] = {
        "model": describe(target),
        "reference": describe(ref) if ref is not None else None,
        "attacks": {},
        "dp": None,
        "violated": False,
        "dropped_canary_records": dropped_m + dropped_n,
    }
    unscorable = 0
    for name, (sm, sn) in attacks.items():
        keep_m, keep_n = np.isfinite(sm), np.isfinite(sn)
        unscorable = max(unscorable, int((~keep_m).sum() + (~keep_n).sum()))
        attacks[name] = (sm[keep_m], sn[keep_n])
        result["attacks"][name] = mia_metrics(sm[keep_m], sn[keep_n])
    result["unscorable_records"] = unscorable
    result["mean_loss"] = {
        "members": float(np.nanmean(loss_m)),
        "nonmembers": float(np.nanmean(loss_n)),
    }
    info = target.info
    if epsilon is None and info.get("dp") and info.get("epsilon") is not None:
        epsilon, delta = float(info["epsilon"]), float(info.get("delta") or 1e-5)
        history = history if history is not None else (info.get("history") or None)
    if epsilon is not None:
        delta = 1e-5 if delta is None else float(delta)
        profile = pld_privacy_profile(history) if history else None
        checks = {
            name: check_against_dp(
                sm, sn, epsilon, delta, profile=profile, confidence=confidence, name=name
            )
            for name, (sm, sn) in attacks.items()
        }
        result["dp"] = {
            "epsilon": float(epsilon),
            "delta": delta,
            "checks": checks,
            "ceiling_at": {f"{a:g}": float(dp_tpr_ceiling(a, epsilon, delta)) for a in (0.01, 0.1)},
        }
        result["violated"] = any(c["violated"] for c in checks.values())
    result["seconds"] = round(time.perf_counter() - start, 3)
    log.info(
        "membership inference: %d members, %d non-members, loss-attack AUC %.3f",
        len(mem),
        len(non),
        result["attacks"]["loss"]["auc"],
    )
    return result


def plot_roc(
    results: Mapping[str, Any],
    path: str | Path,
    epsilon: float | None = None,
    delta: float | None = None,
    title: str = "Membership inference ROC",
) -> Path:
    """ROC curves on log-log axes with the diagonal and, given ``epsilon``, the DP ceiling.

    ``results``: a :func:`run_mia` result (its ``attacks``) or a mapping
    name -> :func:`mia_metrics` dict. Written to a temporary name, then renamed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = results.get("attacks", results)
    if not curves or not all(isinstance(v, Mapping) and "roc" in v for v in curves.values()):
        raise AuditError("plot_roc needs mia_metrics results (each with a 'roc')")
    if epsilon is None and isinstance(results.get("dp"), Mapping):
        epsilon, delta = results["dp"]["epsilon"], results["dp"]["delta"]
    lo = min(min(v["fpr_resolution"] for v in curves.values()), 1e-2) / 2
    fig, ax = plt.subplots(figsize=(5.5, 5))
    grid = np.geomspace(lo, 1.0, 200)
    ax.plot(grid, grid, "k--", lw=1, label="chance")
    if epsilon is not None:
        d = 1e-5 if delta is None else float(delta)
        ax.plot(
            grid,
            dp_tpr_ceiling(grid, float(epsilon), d),
            color="black",
            lw=2.5,
            alpha=0.6,
            label=f"DP ceiling (eps={float(epsilon):.3g}, delta={d:.0e})",
        )
    # tab20 pairs: one hue per model, light for its second attack; none is the ceiling's black
    colors = plt.get_cmap("tab20").colors
    for i, (name, v) in enumerate(curves.items()):
        f = np.maximum(np.asarray(v["roc"]["fpr"], dtype=float), lo)
        t = np.maximum(np.asarray(v["roc"]["tpr"], dtype=float), lo)
        ax.step(
            f, t, where="post", color=colors[i % len(colors)], label=f"{name} (AUC {v['auc']:.3f})"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.05)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120)
    plt.close(fig)
    return path
