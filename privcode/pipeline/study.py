"""``make study``: the privacy-utility trade-off of PrivCode's Fig. 6 at demo scale.

The study is a set of runs of one config on one corpus: ``study-eps<e>`` for each
epsilon (Stage I, II, the premium model, eval and audits) and one run holding the
non-DP comparison (``nondp``) and the base. This module reads their manifests
(aggregates only, like the shareable report) into :class:`StudyPoint` rows, judges
each of the seeds' directions (:func:`directions`) and writes ``docs/results.md``
with a table and a plot (:func:`write_results`).

A direction counts as reproduced only when the 95% Wilson intervals of the two
pass@1 values it compares do not overlap (or, for leakage, when the counts say
so outright); otherwise it is "not reproduced" with the numbers that say why.
Intervals come from the benchmark's tasks: one greedy completion per task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from privcode.artifacts import ArtifactError, StageManifest
from privcode.artifacts.summaries import AuditSummary, EvalSummary
from privcode.layout import RunLayout
from privcode.pipeline.sections import grid, plt, save_fig
from privcode.utils import PUBLIC_FILE_MODE, atomic_write_text

__all__ = ["Direction", "ModelScore", "StudyPoint", "collect", "directions", "render"]

log = logging.getLogger("privcode.pipeline.study")

#: The study's models, in table order: eval's name -> label.
MODELS = {"junior": "DP junior", "premium": "premium", "nondp": "non-DP", "base": "base"}


@dataclass(frozen=True)
class ModelScore:
    """One model of one run: utility (with 95% intervals) beside its leakage."""

    pass1: float | None = None
    ci: tuple[float, float] | None = None
    tasks: int | None = None
    general: float | None = None  #: pass@1 on the general yardstick (eval.also)
    general_ci: tuple[float, float] | None = None
    leaked: int | None = None
    canaries: int | None = None
    exposure_bits: float | None = None
    mia_auc: float | None = None


@dataclass(frozen=True)
class StudyPoint:
    """A run of the study: its epsilon (None: no DP) and its models' scores."""

    run: str
    epsilon: float | None
    benchmark: str = ""
    general: str = ""
    models: dict[str, ModelScore] = field(default_factory=dict)
    sigma: float | None = None  #: Stage I's noise multiplier (DP runs)
    steps: int | None = None  #: Stage I's steps taken
    method: str = ""


@dataclass(frozen=True)
class Direction:
    """One of the seeds' claims, judged on the study's numbers."""

    claim: str
    source: str
    reproduced: bool | None  #: None: the study lacks the numbers
    reason: str


# --------------------------------------------------------------------------- collect


def _manifest(run: RunLayout, stage: str) -> StageManifest | None:
    path = run.manifest(stage)
    if not path.is_file():
        return None
    try:
        return StageManifest.read(path)
    except ArtifactError as exc:
        log.warning("study: ignoring %s", exc)
        return None


def _ci(value: Any) -> tuple[float, float] | None:
    return (float(value[0]), float(value[1])) if value else None


def _audited(audit: AuditSummary | None, name: str) -> dict[str, Any]:
    if audit is None:
        return {}
    key = "nondpft" if name == "nondp" else name
    return audit.models.get(key) or {}


def _score(evaluation: EvalSummary | None, audit: AuditSummary | None, name: str) -> ModelScore:
    r = (evaluation.models.get(name) if evaluation else None) or {}
    also = next(iter((r.get("also") or {}).values()), {})
    x = _audited(audit, name)
    can = x.get("canaries") or {}
    attacks = (x.get("mia") or {}).get("attacks") or {}
    aucs = [float(v["auc"]) for v in attacks.values() if v.get("auc") is not None]
    return ModelScore(
        pass1=(r.get("pass_at_k") or {}).get("pass@1"),
        ci=_ci(r.get("pass@1_ci95")),
        tasks=r.get("n_tasks"),
        general=(also.get("pass_at_k") or {}).get("pass@1"),
        general_ci=_ci(also.get("pass@1_ci95")),
        leaked=can.get("leaked"),
        canaries=can.get("total"),
        exposure_bits=(x.get("exposure") or {}).get("mean_bits"),
        mia_auc=max(aucs) if aucs else None,
    )


def _epsilon(train: dict[str, Any]) -> float | None:
    """The release's epsilon when the run trained with DP (the train summary's own number)."""
    value = train.get("epsilon")
    if not train.get("dp") or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def collect(out_dir: str | Path, runs: list[str], reference: str | None = None) -> list[StudyPoint]:
    """One point per run that has an eval manifest, DP runs by epsilon, then the others.

    ``reference``: a run (among ``runs`` or not) read for the base and the non-DP
    comparison only (its point has no epsilon and no DP model).
    """
    points = []
    for name in [*runs, *([reference] if reference and reference not in runs else [])]:
        run = RunLayout(Path(out_dir), name)
        ev, au, tr = (_manifest(run, s) for s in ("eval", "audit", "train"))
        if ev is None:
            log.warning("study: run %s has no eval manifest: left out", name)
            continue
        evaluation = EvalSummary.from_json(ev.summary, f"{name}'s eval summary")
        audit = AuditSummary.from_json(au.summary, f"{name}'s audit summary") if au else None
        eps = _epsilon(tr.summary) if tr and name != reference else None
        general = next((b for r in evaluation.models.values() for b in (r.get("also") or {})), "")
        names = ("base", "nondp") if name == reference else MODELS
        models = {n: _score(evaluation, audit, n) for n in names}
        train = tr.summary if tr and eps is not None else {}
        points.append(
            StudyPoint(
                name,
                eps,
                evaluation.benchmark,
                general,
                models,
                sigma=train.get("noise_multiplier"),
                steps=train.get("steps_taken"),
                method=str(train.get("method") or ""),
            )
        )
    return sorted(points, key=lambda p: (p.epsilon is None, p.epsilon or 0.0, p.run))


# --------------------------------------------------------------------------- directions


def _disjoint(lo: ModelScore, hi: ModelScore) -> bool:
    """``hi`` above ``lo`` with 95% intervals that do not overlap."""
    if lo.ci is None or hi.ci is None:
        return False
    return hi.ci[0] > lo.ci[1]


def _p(s: ModelScore) -> str:
    if s.pass1 is None:
        return "n/a"
    ci = f" [{100 * s.ci[0]:.1f}, {100 * s.ci[1]:.1f}]" if s.ci else ""
    return f"{100 * s.pass1:.1f}%{ci}"


def _named(points: list[StudyPoint], model: str) -> list[tuple[str, ModelScore]]:
    return [
        (f"epsilon {p.epsilon:.3g}", p.models[model])
        for p in points
        if p.epsilon is not None and model in p.models and p.models[model].pass1 is not None
    ]


def _reference(points: list[StudyPoint], model: str) -> ModelScore | None:
    """A model trained the same way in every run (base, non-DP): its pass@1 from the
    first run that scored it, its leakage from the first run that audited it."""
    scored = [p.models[m] for p in points for m in [model] if m in p.models]
    first = next((s for s in scored if s.pass1 is not None), None)
    audited = next((s for s in scored if s.canaries), None)
    if first is None or audited is None:
        return first or audited
    return replace(
        first,
        leaked=audited.leaked,
        canaries=audited.canaries,
        exposure_bits=audited.exposure_bits,
        mia_auc=audited.mia_auc,
    )


def directions(points: list[StudyPoint]) -> list[Direction]:
    """The seeds' directions, each judged as reproduced or not, with the numbers why."""
    junior, premium = _named(points, "junior"), _named(points, "premium")
    base, nondp = _reference(points, "base"), _reference(points, "nondp")
    out = []
    if len(junior) >= 2:
        (lo_name, lo), (hi_name, hi) = junior[0], junior[-1]
        ok = _disjoint(lo, hi)
        out.append(
            Direction(
                "utility grows with epsilon (DP junior)",
                "PrivCode Fig. 6",
                ok,
                f"{lo_name}: {_p(lo)}; {hi_name}: {_p(hi)}"
                + ("" if ok else " (the intervals overlap)"),
            )
        )
    else:
        out.append(
            Direction("utility grows with epsilon", "PrivCode Fig. 6", None, "fewer than 2 DP runs")
        )
    if junior:
        best_name, best = max(junior, key=lambda t: t[1].pass1 or 0.0)
        if base is not None:
            claim = "the DP junior learns from the private code (junior > base)"
            detail = f"base {_p(base)}; best junior ({best_name}) {_p(best)}"
            out.append(Direction(claim, "PrivCode Table 2", _disjoint(base, best), detail))
        if nondp is not None:
            claim = "DP costs utility (non-DP > DP at every epsilon)"
            detail = f"non-DP {_p(nondp)}; best DP junior ({best_name}) {_p(best)}"
            out.append(Direction(claim, "PrivCode Table 2, Fig. 6", _disjoint(best, nondp), detail))
    if premium and junior:
        pairs = [(jn, j, pr) for (jn, j), (_, pr) in zip(junior, premium, strict=False)]
        worse = [jn for jn, j, pr in pairs if (pr.pass1 or 0.0) < (j.pass1 or 0.0)]
        learned = any((j.pass1 or 0.0) > 0 for _, j, _ in pairs)
        out.append(
            Direction(
                "the premium model, trained on the junior's synthetic code, is at least as good "
                "as the junior",
                "PrivCode Table 2, PrivCode++ Table 1",
                not worse and learned,
                ("below the junior at " + ", ".join(worse))
                if worse
                else ("at or above the junior at every epsilon" if learned else "both score 0"),
            )
        )
    out.append(_leakage(points, nondp))
    return out


def _leakage(points: list[StudyPoint], nondp: ModelScore | None) -> Direction:
    dp = [
        s
        for p in points
        if p.epsilon is not None
        for m, s in p.models.items()
        if m in ("junior", "premium")
    ]
    dp = [s for s in dp if s.canaries]
    claim, source = (
        "the non-DP model leaks canaries verbatim, the DP models none",
        "PrivCode Table 3",
    )
    if nondp is None or not nondp.canaries or not dp:
        return Direction(claim, source, None, "no canary audit of both kinds of model")
    dp_leaked = sum(s.leaked or 0 for s in dp)
    ok = (nondp.leaked or 0) > 0 and dp_leaked == 0
    exp = [s.exposure_bits for s in dp if s.exposure_bits is not None]
    reason = (
        f"non-DP {nondp.leaked}/{nondp.canaries}; DP models {dp_leaked}/"
        f"{sum(s.canaries or 0 for s in dp)}; exposure non-DP "
        f"{_g(nondp.exposure_bits, '.1f')} bits vs DP at most {_g(max(exp) if exp else None, '.1f')}"
    )
    return Direction(claim, source, ok, reason)


# --------------------------------------------------------------------------- render


def _g(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(p: StudyPoint, model: str, s: ModelScore) -> list[Any]:
    gen = "-" if s.general is None else f"{100 * s.general:.1f}"
    leaked = f"{s.leaked}/{s.canaries}" if s.canaries else "-"
    eps = (
        "none (NOT PRIVATE)"
        if model == "nondp"
        else "-"
        if model == "base"
        else _g(p.epsilon, ".3g")
    )
    dp = p.epsilon is not None and model in ("junior", "premium")
    stage1 = f"{p.steps} steps, sigma {p.sigma:.2f}" if dp and p.sigma is not None else "-"
    return [
        eps,
        MODELS[model],
        stage1,
        _p(s),
        gen,
        leaked,
        _g(s.exposure_bits, ".1f"),
        _g(s.mia_auc, ".2f"),
        p.run,
    ]


def table(points: list[StudyPoint]) -> list[str]:
    """The study's table: one row per (run, model) scored, DP runs by epsilon."""
    rows, seen = [], set()
    for p in points:
        for model in MODELS:
            s = p.models.get(model)
            if s is None or (s.pass1 is None and not s.canaries):
                continue
            if model in ("base", "nondp"):
                if model in seen:
                    continue
                seen.add(model)
                s = _reference(points, model) or s
            if p.epsilon is None and model in ("junior", "premium"):
                continue
            rows.append(_row(p, model, s))
    bench = next((p.benchmark for p in points if p.benchmark), "benchmark")
    general = next((p.general for p in points if p.general), "")
    head = ["epsilon", "model", "Stage I", f"pass@1 {bench} [95% CI]", f"pass@1 {general or '-'} %"]
    return grid([*head, "canaries leaked", "exposure (bits)", "MIA AUC", "run"], rows)


def render(
    points: list[StudyPoint], found: list[Direction], plot: str | None, notes: str = ""
) -> str:
    """docs/results.md: the table, the plot and the directions."""
    mark = {True: "reproduced", False: "not reproduced", None: "not measured"}
    lines = ["# Results: the privacy-utility trade-off at demo scale", ""]
    lines += [notes, ""] if notes else []
    lines += table(points)
    if plot:
        lines += [f"![pass@1 against epsilon]({plot})", ""]
    lines += ["## The seeds' directions", ""]
    lines += grid(
        ["claim", "seed", "here", "why"],
        [[d.claim, d.source, mark[d.reproduced], d.reason] for d in found],
    )
    return "\n".join(lines).rstrip() + "\n"


def plot_study(points: list[StudyPoint], path: Path) -> bool:
    """pass@1 (95% intervals) against epsilon per model; base and non-DP as bands."""
    dp = [p for p in points if p.epsilon is not None]
    if not dp:
        return False
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6.4, 4.0))
    for model, color in (("junior", "#4a7ab5"), ("premium", "#e39a3b")):
        pts = [(p.epsilon, p.models[model]) for p in dp if p.models[model].pass1 is not None]
        if not pts:
            continue
        xs = [e for e, _ in pts]
        ys = [100 * s.pass1 for _, s in pts]
        err = [
            [100 * (s.pass1 - s.ci[0]) if s.ci else 0 for _, s in pts],
            [100 * (s.ci[1] - s.pass1) if s.ci else 0 for _, s in pts],
        ]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=color, label=MODELS[model])
    for model, color in (("nondp", "#c0504d"), ("base", "#7f7f7f")):
        s = _reference(points, model)
        if s is None or s.pass1 is None:
            continue
        ax.axhline(100 * s.pass1, ls="--", color=color, label=f"{MODELS[model]}")
        if s.ci:
            ax.axhspan(100 * s.ci[0], 100 * s.ci[1], color=color, alpha=0.12)
    eps = sorted({p.epsilon for p in dp})
    if eps[0] > 0 and eps[-1] >= 4 * eps[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(eps, [f"{e:.3g}" for e in eps])
    ax.set_xlabel("epsilon (DP-SGD, Stage I)")
    ax.set_ylabel(f"pass@1 on {dp[0].benchmark} (% of tasks)")
    ax.set_ylim(
        0,
        max(
            5.0,
            1.15
            * max(
                100 * (s.ci[1] if s.ci else s.pass1 or 0.0)
                for p in points
                for s in p.models.values()
                if s.pass1 is not None
            ),
        ),
    )
    ax.set_title("Utility against privacy")
    ax.legend(fontsize=8)
    save_fig(fig, path)
    pyplot.close(fig)
    return True


def write_results(
    out_dir: str | Path,
    runs: list[str],
    path: str | Path,
    notes: str = "",
    reference: str | None = None,
) -> Path:
    """Collect, judge, plot (``<path stem>_privacy_utility.png``) and write ``path`` atomically."""

    points = collect(out_dir, runs, reference)
    if not points:
        raise ArtifactError(f"study: none of the runs {runs} under {out_dir} has been evaluated")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    png = target.with_name(f"{target.stem}_privacy_utility.png")
    plotted = plot_study(points, png)
    atomic_write_text(
        target,
        render(points, directions(points), png.name if plotted else None, notes),
        PUBLIC_FILE_MODE,  # a document (docs/results.md), not run data
    )
    return target
