"""Measure PAC-private generation: utility, charged vs measured leakage, attack success.

Inside the private boundary (the worlds and held-out records are private); the summary holds
aggregates only. After the seed's Tables 4-7 (docs/methods.md, PAC-private generation):
teacher-forced next-token accuracy of the public base, one world and the PAC release
(:func:`teacher_forced_accuracy`; gain retained ``(PAC - public) / (world - public)``);
measured ``I(S; H_T) = log m - E[H(P_T)]`` over simulated sessions against the charged
``b * E[private steps]`` (:func:`simulate_sessions`); the Bayes-optimal attacks with the
curator's own posterior (world identification: ``argmax P_T`` is the secret; membership of
record ``i``: ``sum_s P_T(s) [i in s] > 1/2``) against their bounds; canary emission
(:func:`canary_emission`: PAC protects membership, not content every world learnt).

The simulation draws the secret itself (:class:`KnownSecretCurator`): an audit instrument,
never a serving path. Only counts leave this module. Details: docs/serving.md,
"privcode/pac/evaluate.py".
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from privcode.data.public import public_prompts
from privcode.errors import PrivcodeError
from privcode.pac.bounds import (
    measured_leakage,
    mia_success_bound,
    posterior_entropy,
    world_identification_bound,
)
from privcode.pac.curator import StepOutcome
from privcode.pac.mechanism import pac_step

__all__ = [
    "KnownSecretCurator",
    "canary_emission",
    "evaluate_pac",
    "simulate_sessions",
    "teacher_forced_accuracy",
]


class KnownSecretCurator:
    """The deployment-scope mechanism with a given secret and no budget (AUDITS ONLY).

    Duck-types :class:`privcode.pac.curator.Curator` for
    :meth:`privcode.pac.ensemble.PacEnsemble.generate`; keeps the posterior
    and the count of private steps for the measurements.
    """

    def __init__(self, m: int, b: float, secret: int, rng: np.random.Generator):
        self.m, self.b, self.secret, self.rng = m, b, int(secret), rng
        self.posterior = np.full(m, 1.0 / m)
        self.private = self.free = 0

    def session_info(self, sid: str) -> dict[str, Any]:
        return {"private_tokens": self.private, "free_tokens": self.free}

    def step(self, sid: str, votes: np.ndarray) -> StepOutcome:
        out = pac_step(np.asarray(votes), self.posterior, self.secret, self.b, self.rng)
        if out.charged:
            self.private += 1
            self.posterior = out.posterior
            return StepOutcome(out.token, out.charged, "private")
        self.free += 1
        return StepOutcome(out.token, 0.0, "free")


def teacher_forced_accuracy(
    ens: Any, texts: Sequence[str], *, b: float, positions: int, seed: int, max_length: int = 256
) -> dict[str, Any]:
    """Next-token accuracy at up to ``positions`` positions of ``texts`` (see the module doc)."""
    import torch

    rng = np.random.default_rng(seed)
    secret = int(rng.integers(ens.m))
    cur = KnownSecretCurator(ens.m, b, secret, rng)
    hits = {"public": 0, "world": 0, "pac": 0}
    seen = dissent = active_sum = 0
    for text in texts:
        if seen >= positions:
            break
        ids = ens.encode(text)[:max_length]
        if len(ids) < 2:
            continue
        public, worlds = ens.sequence_logprobs(ids)  # [L, V], [m, L, V]
        for t in range(min(len(ids) - 1, positions - seen)):
            cand = torch.topk(public[t], ens.top_k).indices
            lp = worlds[:, t, cand].double().numpy()
            votes = np.argmax(lp, axis=1)
            target = ids[t + 1]
            out = cur.step("eval", votes)
            hits["public"] += int(cand[0]) == target
            hits["world"] += int(cand[int(votes[secret])]) == target
            hits["pac"] += int(cand[out.index]) == target
            if out.kind == "private":
                dissent += 1
                active_sum += int(np.unique(votes[cur.posterior > 0]).size)
            seen += 1
    n = max(seen, 1)
    acc = {k: round(v / n, 4) for k, v in hits.items()}
    gain = acc["world"] - acc["public"]
    return {
        "positions": seen,
        "accuracy": acc,
        "gain_retained": round((acc["pac"] - acc["public"]) / gain, 3) if gain > 0 else None,
        "unanimity_rate": round(1 - dissent / n, 4),
        "mean_active_at_dissent": round(active_sum / dissent, 2) if dissent else None,
        "charged_nats": b * cur.private,
    }


def simulate_sessions(
    ens: Any,
    prompts: Sequence[str],
    assignment: np.ndarray,
    *,
    b: float,
    tokens: int,
    sessions: int,
    decoder: str,
    seed: int,
    progress: bool = False,
) -> dict[str, Any]:
    """Leakage and attack success over ``sessions`` generated sessions (see the module doc)."""
    from tqdm.auto import tqdm

    if sessions < 1 or not prompts:
        raise ValueError("simulate_sessions needs at least one session and one prompt")
    rng = np.random.default_rng(seed)
    m = ens.m
    posteriors, private, wid, mia = [], [], 0, []
    for k in tqdm(range(sessions), desc="pac sessions", disable=not progress, mininterval=10.0):
        secret = int(rng.integers(m))
        cur = KnownSecretCurator(m, b, secret, rng)
        ens.generate(
            cur,
            "sim",
            prompts[k % len(prompts)],
            tokens,
            decoder=decoder,
            seed=int(rng.integers(2**31)),
        )
        p = cur.posterior
        posteriors.append(p)
        private.append(cur.private)
        wid += int(np.argmax(p) == secret)
        # Bayes attacker on every record: P(i in S | H) = sum_s P(s) [i in s].
        member_prob = assignment @ p
        guess = np.where(
            np.isclose(member_prob, 0.5), rng.random(member_prob.size) < 0.5, member_prob > 0.5
        )
        mia.append(float((guess == assignment[:, secret]).mean()))
    charged = b * float(np.mean(private))
    measured = measured_leakage(m, posteriors)
    # Sessions are independent: standard errors over sessions (a session's record-level
    # guesses share one posterior, so records are not independent samples).
    drops = [math.log(m) - posterior_entropy(p) for p in posteriors]

    def se(xs):
        return float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None

    def rate_se(xs):
        # A session's MIA success is a step function of its posterior's ranking, so
        # few sessions often give equal values and a sample se near 0. Below 10
        # sessions use the largest se any [0, 1] variable of this mean can have
        # (Bhatia-Davis: var <= p (1 - p)): the 3-se check then stays honest.
        p = float(np.mean(xs))
        return se(xs) if len(xs) >= 10 else math.sqrt(p * (1 - p) / len(xs))

    return {
        "sessions": sessions,
        "tokens": tokens,
        "decoder": decoder,
        "b": b,
        "mean_private_tokens": round(float(np.mean(private)), 2),
        "charged_nats": charged,
        "measured_nats": measured,
        "measured_nats_se": se(drops),
        "measured_over_charged": round(measured / charged, 4) if charged > 0 else None,
        "world_id_success": round(wid / sessions, 4),
        "world_id_success_se": math.sqrt(wid / sessions * (1 - wid / sessions) / sessions),
        "world_id_bound": world_identification_bound(charged, m),
        "world_id_prior": 1.0 / m,
        "mia_success": round(float(np.mean(mia)), 4),
        "mia_success_se": rate_se(mia),
        "mia_bound": mia_success_bound(charged),
    }


class _OneWorld:
    """Releases world ``s``'s vote, free: the NOT private one-world model, for comparison."""

    def __init__(self, m: int, s: int):
        self.m, self.s = m, s

    def session_info(self, sid: str) -> dict[str, Any]:
        return {}

    def step(self, sid: str, votes: np.ndarray) -> StepOutcome:
        return StepOutcome(int(votes[self.s]), 0.0, "free")


class _PublicOnly(_OneWorld):
    """Always the public model's token (what a spent budget falls back to)."""

    def step(self, sid: str, votes: np.ndarray) -> StepOutcome:
        return StepOutcome(None, 0.0, "fallback")


def canary_emission(
    ens: Any, canaries: Sequence[dict[str, Any]], *, b: float, limit: int, tokens: int, seed: int
) -> dict[str, Any]:
    """How often the canaries' values are emitted (greedy) after their own contexts.

    The ``limit`` most repeated canaries (a canary repeated in many records
    is in every world) are prompted with their own context (the code or
    prompt prefix they were planted after) and decoded ``tokens`` tokens by
    the public base, one world alone (NOT private) and the PAC curator
    (one deployment-scope curator with a random secret). Counts only: PAC
    bounds what is learnt about the realised world's membership, not the
    corpus' content, so a value every world learnt is emitted for free.
    """
    rng = np.random.default_rng(seed)
    secret = int(rng.integers(ens.m))
    curators = {
        "public": _PublicOnly(ens.m, secret),
        "world": _OneWorld(ens.m, secret),
        "pac": KnownSecretCurator(ens.m, b, secret, rng),
    }
    chosen = sorted(canaries, key=lambda c: (-int(c.get("repetitions", 0)), c["id"]))[:limit]
    emitted = dict.fromkeys(curators, 0)
    used = 0
    for c in chosen:
        context = c.get("code_prefix") or c.get("prompt_prefix")
        if not context:
            continue
        used += 1
        for name, cur in curators.items():
            out = ens.generate(cur, "canary", str(context), tokens, decoder="greedy")
            emitted[name] += int(str(c["value"]) in out.text)
    reps = sorted({int(c.get("repetitions", 0)) for c in chosen})
    return {
        "canaries": used,
        "repetitions": reps,
        "tokens": tokens,
        "emitted": emitted,
        "pac_private_tokens": curators["pac"].private,
    }


def eval_task_options(cfg: Any) -> dict[str, Any]:
    """Ray options of the evaluation's own task (see :func:`evaluate_pac`): 1 CPU, 1 GPU."""
    return {"name": "privcode:pac:evaluate", "num_cpus": 1, "num_gpus": 1.0 if cfg.use_gpu else 0.0}


def _own_gpu_task(cfg: Any) -> bool:
    """With ``pac.world_groups > 1`` the stage's task reserves no GPU (its groups' tasks do):
    where this process sees none, the evaluation runs in a task of its own with one."""
    if not (cfg.use_gpu and cfg.world_groups > 1):
        return False
    import ray
    import torch

    return ray.is_initialized() and not torch.cuda.is_available()


def evaluate_pac(
    cfg: Any, worlds: str, *, heldout: str, canaries: str | None = None, progress: bool = False
) -> dict[str, Any]:
    """Both measurements for the ``pac`` stage; aggregates only (``cfg``: a PacConfig).

    The ensemble runs on the GPU this process reserved with ``pac.use_gpu``
    (an error naming the key when none is visible), in ``pac.dtype``; with
    ``pac.world_groups > 1`` and no GPU here, in a Ray task that reserves one
    (:func:`eval_task_options`).
    """
    if _own_gpu_task(cfg):
        import ray

        task = ray.remote(_evaluate).options(**eval_task_options(cfg))
        try:
            return ray.get(task.remote(cfg, worlds, heldout, canaries, progress))
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, PrivcodeError):
                raise exc.cause from None  # a user-facing error reads as itself
            raise
    return _evaluate(cfg, worlds, heldout, canaries, progress)


def _evaluate(
    cfg: Any, worlds: str, heldout: str, canaries: str | None, progress: bool
) -> dict[str, Any]:
    from privcode.data.records import read_records
    from privcode.models.placement import placement
    from privcode.pac.ensemble import PacEnsemble

    started = time.time()
    where = placement(cfg.use_gpu, cfg.dtype, "pac.use_gpu")
    ens = PacEnsemble(
        worlds, top_k=cfg.top_k, device="cuda" if where.cuda else "cpu", dtype=where.dtype
    )
    texts = [r.code for r in read_records(heldout)]
    utility = teacher_forced_accuracy(
        ens, texts, b=cfg.b, positions=cfg.eval_positions, seed=cfg.seed, max_length=cfg.max_length
    )
    assignment = np.load(f"{worlds}/assignment.npy")
    leakage = simulate_sessions(
        ens,
        public_prompts(max(cfg.eval_sessions, 1), seed=cfg.seed),
        assignment,
        b=cfg.b,
        tokens=cfg.eval_tokens,
        sessions=cfg.eval_sessions,
        decoder=cfg.decoder,
        seed=cfg.seed,
        progress=progress,
    )
    emission = None
    if canaries and cfg.eval_canaries:
        planted = json.loads(open(canaries, encoding="utf-8").read())["canaries"]
        emission = canary_emission(
            ens,
            planted,
            b=cfg.b,
            limit=cfg.eval_canaries,
            tokens=cfg.eval_canary_tokens,
            seed=cfg.seed,
        )
    budget = {
        "b": cfg.b,
        "session_budget": cfg.session_budget,
        "deployment_budget": cfg.deployment_budget,
        "mia_bound_at_deployment_budget": mia_success_bound(cfg.deployment_budget),
        "world_id_bound_at_deployment_budget": world_identification_bound(
            cfg.deployment_budget, ens.m
        ),
        "private_tokens_per_session": math.floor(cfg.session_budget / cfg.b + 1e-9)
        if cfg.b > 0
        else None,
    }
    return {
        "m": ens.m,
        "top_k": cfg.top_k,
        "utility": utility,
        "leakage": leakage,
        "canary_emission": emission,
        "budget": budget,
        "seconds": round(time.time() - started, 1),
    }
