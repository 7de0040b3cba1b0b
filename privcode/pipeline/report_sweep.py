"""The report's privacy-utility section: utility against epsilon, from manifests only.
Design notes: docs/development.md, "privcode/pipeline/report_sweep.py".

``privacy_utility.png``: left, benchmark pass@1 of the junior and the premium model of every
run against its epsilon (95% intervals); right, the junior's loss on PUBLIC held-out code
against epsilon. The line is this run: at checkpoint k, the epsilon of k compositions of the
Poisson-subsampled Gaussian mechanism at the run's q, sigma and delta
(:mod:`privcode.dp.accounting`, the run's accountant); the markers are runs' final epsilon and
held-out loss.

Assumptions: the runs compared share ``dataset_id`` (the store's opaque keyed id, never a
digest of the corpus) and ``method``; pass@1 and MIA numbers count only when their manifest
lists the run's current train fingerprint; the line assumes q and sigma fixed and counts this
run's steps only. Only manifests are read, never a dataset.

"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from privcode.artifacts import ArtifactError, StageManifest
from privcode.errors import AccountingError
from privcode.layout import RunLayout
from privcode.pipeline.sections import grid as _grid
from privcode.pipeline.sections import plt as _plt
from privcode.pipeline.sections import save_fig as _save

__all__ = [
    "collect_points",
    "plot_privacy_utility",
    "privacy_utility",
    "sweep_section",
    "within_run_curve",
]

log = logging.getLogger("privcode.pipeline.report")

MIA_ATTACK = "reference_calibrated"


def _load(path: Path) -> StageManifest | None:
    """The manifest at ``path``; None when absent, or corrupt (with a warning naming the file)."""
    if not path.is_file():
        return None
    try:
        return StageManifest.read(path)
    except ArtifactError as exc:
        log.warning("privacy-utility: ignoring manifest %s", exc)
        return None


def _num(value: Any) -> float | None:
    """A finite float, None for None; TypeError / ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a finite number: {value!r}")
    return float(value)


def _final_loss(curve: Any) -> float | None:
    losses = [v for _, v in (curve or []) if v is not None]
    return _num(losses[-1]) if losses else None


def _pass1(models: dict[str, Any], name: str) -> float | None:
    return _num(((models.get(name) or {}).get("pass_at_k") or {}).get("pass@1"))


def _stage_numbers(run: RunLayout, stage: str, train_fp: Any) -> dict[str, Any] | None:
    """The summary of ``stage`` of ``run`` when it was computed from train ``train_fp``."""
    manifest = _load(run.manifest(stage))
    if manifest is None or manifest.inputs.get("train") != train_fp:
        return None
    return manifest.summary


def _point(run: RunLayout, manifest: StageManifest) -> dict[str, Any] | None:
    s = manifest.summary
    if not s.get("dp") or s.get("epsilon") is None:
        return None
    point = {
        "run": run.name,
        "epsilon": _num(s["epsilon"]),
        "delta": _num(s.get("delta")),
        "accountant": s.get("accountant"),
        "steps": s.get("steps_taken"),
        "noise_multiplier": _num(s.get("noise_multiplier")),
        "heldout_loss": _final_loss(s.get("public_heldout_loss_curve")),
        "pass1_junior": None,
        "pass1_premium": None,
        "pass1_base": None,
        "pass1_nondp": None,
        "pass1_ci": {},
        "mia_tpr_at_1pct_fpr": None,
    }
    fp = manifest.fingerprint
    for stage, fill in (("eval", _fill_eval), ("audit", _fill_audit)):
        summary = _stage_numbers(run, stage, fp)
        if summary is not None:
            try:
                fill(point, summary)
            except (TypeError, ValueError, AttributeError) as exc:
                log.warning("privacy-utility: ignoring %s (%s)", run.manifest(stage), exc)
    return point


def _fill_eval(point: dict[str, Any], summary: dict[str, Any]) -> None:
    models = summary.get("models") or {}
    for name in ("junior", "premium", "base", "nondp"):
        point[f"pass1_{name}"] = _pass1(models, name)
        ci = (models.get(name) or {}).get("pass@1_ci95")
        if ci:
            point["pass1_ci"][name] = (_num(ci[0]), _num(ci[1]))


def _fill_audit(point: dict[str, Any], summary: dict[str, Any]) -> None:
    junior = (summary.get("models") or {}).get("junior") or {}
    attack = ((junior.get("mia") or {}).get("attacks") or {}).get(MIA_ATTACK) or {}
    point["mia_tpr_at_1pct_fpr"] = _num(attack.get("tpr_at_1pct_fpr"))


def collect_points(
    out_root: Path, current_run: str, reference: StageManifest | None = None
) -> list[dict[str, Any]]:
    """One point per DP run under ``out_root`` on this run's corpus and method, by epsilon.

    ``reference`` is the current run's train manifest (read from
    ``out_root/current_run/train`` when None). Each point: run, current,
    epsilon, delta, accountant, steps, noise_multiplier, heldout_loss,
    pass1_junior, pass1_premium, mia_tpr_at_1pct_fpr (None when unknown).
    """
    layout = RunLayout(Path(out_root), current_run)
    manifests: dict[str, StageManifest | None] = {
        run: _load(path) for run, path in layout.manifests_of_every_run("train").items()
    }
    if reference is not None:
        manifests[current_run] = reference
    current = manifests.get(current_run)
    ref = current.summary if current else {}
    key = (ref.get("dataset_id"), ref.get("method"))
    if not key[0]:
        return []  # no opaque dataset id (never fall back to a corpus digest)
    points = []
    for run, manifest in manifests.items():
        if manifest is None:
            continue
        try:
            s = manifest.summary
            if (s.get("dataset_id"), s.get("method")) != key:
                continue
            point = _point(RunLayout(layout.out_dir, run), manifest)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            log.warning(
                "privacy-utility: skipping run %s: bad %s (%s)",
                run,
                RunLayout(layout.out_dir, run).manifest("train"),
                exc,
            )
            continue
        if point is not None:
            points.append({**point, "current": run == current_run})
    return sorted(points, key=lambda p: (p["epsilon"], p["run"]))


def within_run_curve(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """[{step, epsilon, loss}] for each checkpoint of a DP run's public held-out loss curve."""
    from privcode.dp.accounting import DPEvent, epsilon

    if not summary.get("dp"):
        return []
    out = []
    try:
        q, sigma = summary["sample_rate"], summary["noise_multiplier"]
        delta, accountant = summary["delta"], summary.get("accountant") or "rdp"
        for step, loss in summary.get("public_heldout_loss_curve") or []:
            if loss is None:
                continue
            eps = 0.0 if step == 0 else epsilon([DPEvent(sigma, q, int(step))], delta, accountant)
            out.append({"step": int(step), "epsilon": eps, "loss": float(loss)})
    except (AccountingError, KeyError, TypeError, ValueError) as exc:
        log.warning("privacy-utility: no within-run curve (%s)", exc)
        return []
    return out


def privacy_utility(cfg: Any, train_manifest: StageManifest | None) -> dict[str, Any] | None:
    """``{"runs": collect_points(...), "within_run": within_run_curve(...)}``; None without train."""
    if not train_manifest:
        return None
    return {
        "runs": collect_points(RunLayout.of(cfg).out_dir, cfg.run.name, reference=train_manifest),
        "within_run": within_run_curve(train_manifest.summary),
    }


def _epsilon_axis(ax: Any, values: list[float]) -> None:
    """Log scale (plain tick labels) when the epsilons are positive and span a factor >= 5."""
    from matplotlib.ticker import FuncFormatter

    if values and min(values) > 0 and max(values) >= 5 * min(values):
        ax.set_xscale("log")
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))


def plot_privacy_utility(
    points: list[dict[str, Any]], within_run: list[dict[str, Any]], path: Path
) -> bool:
    """pass@1 against epsilon per model (left) and public held-out loss (right).

    Left: junior and premium pass@1 of every run (95% Wilson intervals as error bars),
    the base and the non-DP comparison of the current run as horizontal lines (their
    intervals shaded). Without any pass@1 only the loss panel is drawn; False when there
    is nothing to plot.
    """
    line = [(p["epsilon"], p["loss"]) for p in within_run]
    marks = [p for p in points if p.get("heldout_loss") is not None]
    scored = [
        p for p in points if p.get("pass1_junior") is not None or p.get("pass1_premium") is not None
    ]
    if not line and not marks and not scored:
        return False
    plt = _plt()
    panels = (1 if scored else 0) + (1 if line or marks else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.8 * panels, 3.8), squeeze=False)
    if scored:
        _pass1_panel(axes[0][0], points, scored)
    if line or marks:
        _loss_panel(axes[0][-1], points, line, marks)
    _save(fig, path)
    plt.close(fig)
    return True


def _pass1_panel(ax: Any, points: list[dict[str, Any]], scored: list[dict[str, Any]]) -> None:
    tops = [5.0]
    for key, label, color in (
        ("junior", "DP junior", "#4a7ab5"),
        ("premium", "premium", "#e39a3b"),
    ):
        pts = [p for p in scored if p.get(f"pass1_{key}") is not None]
        if not pts:
            continue
        ys = [100 * p[f"pass1_{key}"] for p in pts]
        cis = [p.get("pass1_ci", {}).get(key) for p in pts]
        err = [
            [y - 100 * c[0] if c else 0.0 for y, c in zip(ys, cis, strict=True)],
            [100 * c[1] - y if c else 0.0 for y, c in zip(ys, cis, strict=True)],
        ]
        ax.errorbar(
            [p["epsilon"] for p in pts],
            ys,
            yerr=err,
            marker="o",
            capsize=3,
            color=color,
            label=label,
        )
        tops += [100 * c[1] for c in cis if c] + ys
    current = next((p for p in points if p.get("current")), None) or {}
    for key, label, color in (
        ("nondp", "non-DP (NOT PRIVATE)", "#c0504d"),
        ("base", "base", "#7f7f7f"),
    ):
        value = current.get(f"pass1_{key}")
        if value is None:
            continue
        ax.axhline(100 * value, ls="--", color=color, label=label)
        ci = current.get("pass1_ci", {}).get(key)
        if ci:
            ax.axhspan(100 * ci[0], 100 * ci[1], color=color, alpha=0.12)
            tops.append(100 * ci[1])
        tops.append(100 * value)
    _epsilon_axis(ax, [p["epsilon"] for p in scored])
    ax.set_ylim(0, 1.15 * max(tops))
    ax.set_xlabel("epsilon")
    ax.set_ylabel("pass@1 (% of tasks, 95% CI)")
    ax.set_title("Benchmark pass@1 vs privacy")
    ax.legend(fontsize=8)


def _loss_panel(
    ax: Any,
    points: list[dict[str, Any]],
    line: list[tuple[float, float]],
    marks: list[dict[str, Any]],
) -> None:
    positive = [e for e, _ in line if e > 0] + [p["epsilon"] for p in marks]
    _epsilon_axis(ax, positive)
    if ax.get_xscale() == "log":
        for e, loss in line:
            if e == 0:
                ax.axhline(loss, ls=":", color="#7f7f7f", label="step 0 (epsilon 0)")
        line = [(e, v) for e, v in line if e > 0]
    if line:
        ax.plot(
            [e for e, _ in line],
            [v for _, v in line],
            marker=".",
            color="#4a7ab5",
            label="this run, by checkpoint",
        )
    for i, p in enumerate(marks):
        ax.scatter(
            [p["epsilon"]],
            [p["heldout_loss"]],
            color="#c0504d",
            zorder=3,
            marker="*" if p.get("current") else "o",
            s=70 if p.get("current") else 30,
            label="runs (final)" if i == 0 else None,
        )
        ax.annotate(
            p["run"],
            (p["epsilon"], p["heldout_loss"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    deltas = {p.get("delta") for p in points}
    ax.set_xlabel(
        "epsilon"
        + (f" (delta {deltas.pop():g})" if len(deltas) == 1 and None not in deltas else "")
    )
    ax.set_ylabel("public held-out loss (nats/token)")
    ax.set_title("Loss on public held-out code vs privacy")
    ax.legend(fontsize=8)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def _g(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def sweep_section(
    cfg: Any,
    train_manifest: StageManifest | None,
    out_dir: Path,
    plots: bool,
    data: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """Markdown lines and plot names of "### Privacy-utility" (``data``: :func:`privacy_utility`)."""
    if not train_manifest:
        return [], []
    info = train_manifest.summary
    lines = ["### Privacy-utility", ""]
    if not info.get("dp"):
        return lines + ["_This run has no DP guarantee: no privacy-utility curve._", ""], []
    data = data if data is not None else privacy_utility(cfg, train_manifest)
    points, within = data["runs"], data["within_run"]
    dataset = info.get("dataset_id")
    lines += [
        f"Utility against privacy spent. The line follows this run: the loss on public "
        f"held-out code at each checkpoint against the epsilon of the DP-SGD steps taken so "
        f"far (q = {_g(info.get('sample_rate'), '.4g')}, sigma = "
        f"{_g(info.get('noise_multiplier'), '.4g')}, delta = {_g(info.get('delta'), 'g')}, "
        f"{info.get('accountant')} accountant). The markers are the final epsilon and loss of "
        f"each run of this output directory trained on the same dataset "
        + (f"(opaque id `{dataset}`) " if dataset else "")
        + f"with the same method (`{info.get('method')}`); other runs are not comparable.",
        "",
    ]
    if (info.get("ledger_steps") or 0) > (info.get("steps_taken") or 0):
        lines += [
            f"The ledger of this run also holds earlier steps on this corpus "
            f"({info.get('ledger_steps')} in all, {info.get('steps_taken')} in this "
            "training): the run's epsilon is above the end of the line.",
            "",
        ]
    if len(points) >= 2:
        rows = [
            [
                f"{p['run']}" + (" (this run)" if p.get("current") else ""),
                f"{p['epsilon']:.3f}",
                p.get("steps"),
                _g(p.get("noise_multiplier"), ".4g"),
                _g(p.get("heldout_loss"), ".4f"),
                _pct(p.get("pass1_junior")),
                _pct(p.get("pass1_premium")),
                _pct(p.get("mia_tpr_at_1pct_fpr")),
            ]
            for p in points
        ]
        lines += _grid(
            [
                "run",
                "epsilon",
                "steps",
                "sigma",
                "held-out loss",
                "pass@1 junior %",
                "pass@1 premium %",
                "MIA TPR@1%FPR %",
            ],
            rows,
        )
        lines += [
            "pass@1 and MIA (reference-calibrated attack on the junior) are shown when "
            "the run's eval / audit stage used its current DP model; n/a otherwise.",
            "",
        ]
    else:
        lines += [
            f"Only this run's epsilon ({_g(info.get('epsilon'), '.3f')}) has been trained "
            f'on this corpus with this method. `make sweep EPSILONS="1 8"` trains and '
            f"evaluates the same config at other budgets (runs `{cfg.run.name}-eps1`, "
            f"`{cfg.run.name}-eps8`) and re-renders this report with one point per run.",
            "",
        ]
    names = []
    if plots and plot_privacy_utility(points, within, Path(out_dir) / "privacy_utility.png"):
        lines += ["![privacy-utility curve](privacy_utility.png)", ""]
        names.append("privacy_utility.png")
    return lines, names
