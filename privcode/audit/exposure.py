"""Exposure of canaries (Carlini et al. 2019, "The Secret Sharer").

For a canary value s after its context c, K random candidates r_1..r_K of the same format
(:func:`privcode.data.canaries.sample_canary_value`; distinct from each other and from every
canary value) and s are scored by ``L(v) = log p(v | c)``
(:func:`privcode.audit.scoring.sequence_logprobs`):

* rank ``r = 1 + #{k : L(r_k) >= L(s)}`` (ties count against the canary);
* exposure (rank estimator) ``= log2(K + 1) - log2(r)`` bits, in ``[0, log2(K + 1)]``;
* exposure (extrapolated, section 4.3) ``= -log2 P[X >= L(s)]`` under a skew-normal (else
  normal) fit to the candidates' scores, clipped to ``[0, space_bits]`` when the format's
  value space is known.

A joint canary takes the larger exposure of its two contexts (``by_context`` holds both).
Candidates are drawn once per kind (seeded by ``seed`` and the kind) and shared by its canaries.
Latent juniors: z = 0 or a marginal over z, as set on the
:class:`~privcode.audit.scoring.ScoredModel`. Privacy: the summary holds canary ids, ranks and
exposures only. Design notes: docs/audits.md, "privcode/audit/exposure.py".
"""

from __future__ import annotations

import logging
import math
import random
import time
import zlib
from typing import Any

import numpy as np

from privcode.audit.canaries import load_canaries
from privcode.audit.scoring import AuditError, as_scored, describe, sequence_logprobs

log = logging.getLogger("privcode.audit")

__all__ = ["canary_exposure", "exposure_from_scores", "extrapolated_exposure"]


def exposure_from_scores(canary_score: float, candidate_scores: Any) -> tuple[int, float]:
    """``(rank, exposure bits)`` of the canary among K candidates (ties against the canary)."""
    cands = np.asarray(candidate_scores, dtype=float)
    if cands.size == 0 or not np.all(np.isfinite(cands)) or not math.isfinite(canary_score):
        raise AuditError("exposure needs a finite canary score and >= 1 finite candidate score")
    rank = 1 + int(np.sum(cands >= canary_score))
    return rank, math.log2(cands.size + 1) - math.log2(rank)


def extrapolated_exposure(
    canary_score: float,
    candidate_scores: Any,
    *,
    fit: str = "skewnorm",
    space_bits: float | None = None,
) -> float:
    """``-log2 P[X >= canary_score]`` for X fitted to the candidates, clipped (module doc)."""
    from scipy import stats

    cands = np.asarray(candidate_scores, dtype=float)
    if cands.size < 3 or float(np.std(cands)) == 0.0:
        raise AuditError("the extrapolated exposure needs >= 3 candidates with spread")
    logsf = None
    if fit == "skewnorm":
        try:
            a, loc, scale = stats.skewnorm.fit(cands)
            logsf = float(stats.skewnorm.logsf(canary_score, a, loc, scale))
        except (ValueError, RuntimeError, FloatingPointError):
            logsf = None
    elif fit != "normal":
        raise AuditError(f"fit must be 'skewnorm' or 'normal', got {fit!r}")
    if logsf is None or not math.isfinite(logsf):
        logsf = float(stats.norm.logsf(canary_score, np.mean(cands), np.std(cands, ddof=1)))
    bits = max(0.0, -logsf / math.log(2))
    if space_bits is not None:
        bits = min(bits, float(space_bits))
    return bits if math.isfinite(bits) else float(space_bits or 0.0)


def _candidates(kind: str, k: int, seed: int, taken: set[str], locale: str) -> list[str]:
    from privcode.data.canaries import sample_canary_value

    rng = random.Random((int(seed) * 1_000_003 + zlib.crc32(kind.encode())) & ((1 << 63) - 1))
    out: dict[str, None] = {}
    tries = 0
    while len(out) < k:
        tries += 1
        if tries > 50 * k + 1000:
            raise AuditError(f"could not draw {k} distinct {kind} candidates")
        v = sample_canary_value(kind, rng, locale=locale)
        if v not in taken:
            out[v] = None
    return list(out)


def canary_exposure(
    model: Any,
    canaries: Any,
    *,
    tokenizer: Any = None,
    num_candidates: int = 1000,
    seed: int = 0,
    batch_size: int = 64,
    fit: str = "skewnorm",
) -> dict[str, Any]:
    """Exposure of every canary under ``model`` (ScoredModel or HF model + ``tokenizer``).

    Returns ``{"model", "num_candidates", "max_exposure_bits", "canaries": [{id, kind,
    placement, repetitions, rank, exposure, exposure_extrapolated, by_context: {code|prompt:
    {rank, exposure, exposure_extrapolated, log_likelihood, candidates_mean,
    candidates_std}}}], "mean_exposure": {by placement: {repetitions: mean bits}},
    "seconds"}``.
    """
    start = time.perf_counter()
    sm = as_scored(model, tokenizer)
    items = load_canaries(canaries)
    if type(num_candidates) is not int or num_candidates < 3:
        raise AuditError(f"num_candidates must be an int >= 3, got {num_candidates!r}")
    taken = {c["value"] for c in items}
    cands = {
        kind: _candidates(
            kind, num_candidates, seed, taken, str((c.get("format") or {}).get("locale") or "en_US")
        )
        for kind, c in {c["kind"]: c for c in items}.items()
    }
    contexts = {
        c["id"]: [
            (name, c[key])
            for name, key in (("code", "code_prefix"), ("prompt", "prompt_prefix"))
            if c.get(key)
        ]
        for c in items
    }
    missing = [cid for cid, ctx in contexts.items() if not ctx]
    if missing:
        raise AuditError(f"canaries without a code_prefix or prompt_prefix: {missing}")
    # Every distinct (context, value) pair is scored once.
    pairs: dict[tuple[str, str], int] = {}
    for c in items:
        for _, text in contexts[c["id"]]:
            for v in [c["value"], *cands[c["kind"]]]:
                pairs.setdefault((text, v), len(pairs))
    keys = list(pairs)
    scores = sequence_logprobs(
        sm, None, [t for t, _ in keys], [v for _, v in keys], batch_size=batch_size
    )
    rows = []
    for c in items:
        space = (c.get("format") or {}).get("space_bits")
        by_context = {}
        for name, text in contexts[c["id"]]:
            own = float(scores[pairs[(text, c["value"])]])
            cs = np.array([scores[pairs[(text, v)]] for v in cands[c["kind"]]])
            rank, bits = exposure_from_scores(own, cs)
            by_context[name] = {
                "rank": rank,
                "exposure": bits,
                "exposure_extrapolated": extrapolated_exposure(own, cs, fit=fit, space_bits=space),
                "log_likelihood": own,
                "candidates_mean": float(cs.mean()),
                "candidates_std": float(cs.std(ddof=1)),
            }
        best = max(by_context.values(), key=lambda d: (d["exposure"], d["exposure_extrapolated"]))
        rows.append(
            {
                "id": c["id"],
                "kind": c["kind"],
                "placement": c["placement"],
                "repetitions": c["repetitions"],
                "rank": best["rank"],
                "exposure": best["exposure"],
                "exposure_extrapolated": max(
                    d["exposure_extrapolated"] for d in by_context.values()
                ),
                "by_context": by_context,
            }
        )
    means: dict[str, dict[str, float]] = {}
    for r in rows:
        means.setdefault(r["placement"], {}).setdefault(str(r["repetitions"]), []).append(
            r["exposure"]
        )
    means = {
        p: {k: float(np.mean(v)) for k, v in sorted(d.items(), key=lambda kv: int(kv[0]))}
        for p, d in sorted(means.items())
    }
    summary = {
        "model": describe(sm),
        "num_candidates": num_candidates,
        "max_exposure_bits": math.log2(num_candidates + 1),
        "fit": fit,
        "seed": seed,
        "canaries": rows,
        "mean_exposure": means,
        "seconds": round(time.perf_counter() - start, 3),
    }
    log.info(
        "exposure: %d canaries, K=%d, max %.2f bits",
        len(rows),
        num_candidates,
        max(r["exposure"] for r in rows),
    )
    return summary
