"""Report sections for utility (pass@k) and the privacy audits, from stage manifests only.

Like :mod:`privcode.pipeline.report`, these read the aggregates each stage put
in its manifest summary (rates, counts, AUCs, exposure in bits, fidelity
numbers) and plots the stage wrote; they never open a dataset or a
per-canary / per-leak detail file.

What goes where: :func:`eval_section` and :func:`audit_section` write the
SHAREABLE report and hold aggregates only (rates, counts, AUCs, means, the ROC
curve of a membership attack). Anything that shows one private record (its
text, its coordinates, its score, a per-record table) goes to the owner-only
report through :func:`audit_owner_section`: today the fidelity t-SNE, one
point per sampled private record (a 2-D projection of its embedding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest
from privcode.artifacts.summaries import AuditSummary, EvalSummary
from privcode.pipeline.sections import ReportContext, Section
from privcode.pipeline.sections import copy_plot as _copy_plot
from privcode.pipeline.sections import fmt as _fmt
from privcode.pipeline.sections import grid as _grid
from privcode.pipeline.sections import plt as _plt
from privcode.pipeline.sections import save_fig as _save

__all__ = [
    "OWNER_ONLY_PLOTS",
    "audit_owner_section",
    "audit_report",
    "audit_section",
    "eval_report",
    "eval_section",
]

#: The fidelity t-SNE: one point per sampled private record (owner-only report).
TSNE_PLOT = "fidelity_tsne.png"
#: Plots of the audit stage that show private records: owner-only report, never shared.
OWNER_ONLY_PLOTS = (TSNE_PLOT,)


# --------------------------------------------------------------------------- utility


def plot_pass_at_k(models: dict[str, Any], path: Path) -> bool:
    scored = {m: r["pass_at_k"] for m, r in models.items() if r.get("pass_at_k")}
    if not scored:
        return False
    plt = _plt()
    keys = sorted({k for r in scored.values() for k in r}, key=lambda k: int(k.split("@")[1]))
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        xs = [i + j * width for i in range(len(scored))]
        ys = [100 * scored[m].get(key, 0.0) for m in scored]
        ax.bar(xs, ys, width=width, label=key)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(scored))], list(scored))
    ax.set_ylabel("% of tasks")
    ax.set_ylim(0, max(5.0, 1.15 * max(100 * v for r in scored.values() for v in r.values())))
    ax.legend(fontsize=8)
    ax.set_title("pass@k (sandboxed execution)")
    _save(fig, path)
    plt.close(fig)
    return True


def eval_section(
    evaluation: StageManifest | None, out_dir: Path, plots: bool
) -> tuple[list[str], list[str]]:
    """Markdown lines and plot names of the utility section."""
    if not evaluation:
        return [], []
    info = EvalSummary.from_json(evaluation.summary, "the eval stage's summary")
    models = info.models
    keys = sorted(
        {k for r in models.values() for k in (r.get("pass_at_k") or {})},
        key=lambda k: int(k.split("@")[1]),
    )
    rows = []
    for name, r in models.items():
        if "skipped" in r:
            rows.append([name, *(["-"] * len(keys)), "-", "-", r["skipped"]])
            continue
        ci = r.get("pass@1_ci95")
        notes = list(r.get("notes") or [])
        if r.get("non_private"):
            notes.insert(0, "NOT PRIVATE: the audits' non-DP comparison, never released")
        rows.append(
            [
                name,
                *[f"{100 * r['pass_at_k'].get(k, 0.0):.1f}" for k in keys],
                f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "-",
                r.get("n_tasks"),
                "; ".join(notes),
            ]
        )
        for bench, extra in (r.get("also") or {}).items():
            p1, ci = (extra.get("pass_at_k") or {}).get("pass@1"), extra.get("pass@1_ci95")
            rows.append(
                [
                    f"{name} ({bench})",
                    *[f"{100 * p1:.1f}" if k == "pass@1" and p1 is not None else "-" for k in keys],
                    f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "-",
                    extra.get("n_tasks"),
                    f"the general yardstick beside `{info.benchmark}`",
                ]
            )
    limit = info.limit
    weak = sorted(
        {f"{r['sandbox']}: {r['sandbox_note']}" for r in models.values() if r.get("sandbox_note")}
    )
    lines = ["## Utility: pass@k", ""]
    lines += [f"**WARNING: sandbox {w}.**\n" for w in weak]
    lines += [
        f"Benchmark `{info.benchmark}`"
        + (f" (first {limit} tasks)" if limit else "")
        + ": completions executed against the benchmark's tests in the project's sandbox, "
        "never with the benchmark's own unsandboxed `exec`. pass@k in % of tasks "
        "(unbiased estimator).",
        "",
    ]
    lines += _grid(["model", *keys, "pass@1 95% CI (Wilson)", "tasks", "notes"], rows)
    names = []
    if plots and plot_pass_at_k(models, out_dir / "pass_at_k.png"):
        lines += ["![pass@k](pass_at_k.png)", ""]
        names.append("pass_at_k.png")
    return lines, names


# --------------------------------------------------------------------------- audits


def audit_section(
    audit: StageManifest | None, audit_dir: Path | None, out_dir: Path, plots: bool
) -> tuple[list[str], list[str]]:
    """Markdown lines and plot names of the privacy-audit section."""
    if not audit:
        return [], []
    info = AuditSummary.from_json(audit.summary, "the audit stage's summary")
    lines = [
        "## Privacy audits",
        "",
        "Run inside the private boundary; only aggregates appear here (rates, counts, "
        "AUCs, exposure in bits). The per-canary and per-leak details and any per-record "
        "plot stay inside the boundary, with the data owner.",
        "",
    ]
    models = info.models
    if any(m.get("non_private") for m in models.values()):
        how = info.nondpft_training
        detail = (
            f" ({'every weight' if how.finetune == 'full' else 'LoRA adapter'}, "
            f"{how.steps} steps, lr {how.lr}, expected batch {how.expected_batch_size})"
            if how
            else ""
        )
        lines += [
            "> The `nondpft` model is a comparison fine-tuned WITHOUT differential "
            f"privacy on the same data{detail}; it shows what the audits detect when "
            "nothing protects the data. It is never released.",
            "",
        ]
    names: list[str] = []
    lines += _canary_lines(models)
    lines += _exposure_lines(models)
    mia_lines, mia_plots = _mia_lines(info, audit_dir, out_dir, plots)
    lines += mia_lines
    names += mia_plots
    lines += _fidelity_lines(info.fidelity)
    lines += _probe_lines(models)
    return lines, names


def _canary_lines(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        c = m.get("canaries")
        if not c:
            continue
        for cell in c.get("table", []):
            rows.append(
                [
                    name,
                    cell["placement"],
                    cell["repetitions"],
                    cell["leaked"],
                    cell["categories"],
                    100 * cell["rate"],
                ]
            )
    if not rows:
        return []
    return [
        "### Canary leakage",
        "",
        "Each canary is prompted with its own context and kind-specific inducing prompts, "
        "sampled at temperature 1; a category leaks when its value appears verbatim in any "
        "output. Rate = leaked categories / categories, in %.",
        "",
        *_grid(["model", "placement", "repetitions", "leaked", "categories", "rate %"], rows),
    ]


def _exposure_lines(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        e = m.get("exposure")
        if not e:
            continue
        rows.append(
            [
                name,
                e.get("candidates"),
                e.get("mean_bits"),
                e.get("max_bits"),
                e.get("max_possible_bits"),
                e.get("top_rank_count"),
            ]
        )
    if not rows:
        return []
    return [
        "### Exposure",
        "",
        "Rank of each canary among K random values of the same format by model "
        "log-likelihood; exposure = log2(K+1) - log2(rank) bits (max log2(K+1): the canary "
        "is the single most likely value).",
        "",
        *_grid(
            ["model", "K", "mean bits", "max bits", "max possible", "canaries ranked 1st"], rows
        ),
    ]


def _mia_lines(
    info: AuditSummary, audit_dir: Path | None, out_dir: Path, plots: bool
) -> tuple[list[str], list[str]]:
    rows, flags = [], []
    for name, m in info.models.items():
        for attack, r in (m.get("mia") or {}).get("attacks", {}).items():
            rows.append(
                [
                    name,
                    attack,
                    r.get("auc"),
                    100 * r.get("tpr_at_1pct_fpr", 0.0),
                    100 * r.get("tpr_at_10pct_fpr", 0.0),
                ]
            )
            if r.get("dp_violation"):
                flags.append(f"{name} / {attack}")
    if not rows:
        return [], []
    lines = [
        "### Membership inference",
        "",
        "Loss attack (score = -loss) and reference-calibrated attack (score = base loss - "
        "model loss) on members (training records) vs held-out non-members. TPR in %.",
        "",
        *_grid(["model", "attack", "AUC", "TPR@1%FPR", "TPR@10%FPR"], rows),
    ]
    bound = info.dp_bound
    if bound:
        lines += [
            f"DP ceiling at the junior's (epsilon {_fmt(bound.epsilon, 2)}, delta "
            f"{bound.delta}): TPR <= min(e^eps FPR + delta, 1 - e^-eps (1 - delta "
            f"- FPR)); at 1% FPR that is {_fmt(100 * bound.tpr_at_1pct_fpr, 1)}%.",
            "",
        ]
    if flags:
        lines += [
            f"> **WARNING: measured TPR above the DP ceiling ({', '.join(flags)}), beyond "
            "statistical error. That contradicts the accountant: look for a bug.**",
            "",
        ]
    names = []
    if plots and audit_dir is not None:
        name = _copy_plot(audit_dir / "mia_roc.png", out_dir, "mia_roc.png")
        if name:
            lines += ["![membership inference ROC](mia_roc.png)", ""]
            names.append(name)
    return lines, names


_FIDELITY_METRICS = (
    "bleu4",
    "bleu4_corpus",
    "ast_similarity",
    "nn_cosine_mean",
    "frechet",
    "centroid_cosine",
    "n_synthetic",
    "n_private",
)


def _fidelity_lines(fid: dict[str, Any] | None) -> list[str]:
    """The fidelity aggregates (means, distances, counts); never the t-SNE (per-record)."""
    if not fid:
        return []
    return [
        "### Fidelity of the synthetic data",
        "",
        "Synthetic code vs the private corpus (each synthetic sample paired with its "
        "nearest private neighbour in embedding space; MiniLM embeddings). Aggregates "
        "only: the embedding plot shows one point per private record and is not part of "
        "this report.",
        "",
        *_grid(["metric", "value"], [[k, fid.get(k)] for k in _FIDELITY_METRICS]),
    ]


def audit_owner_section(
    audit: StageManifest | None, audit_dir: Path | None, private_dir: Path, plots: bool
) -> tuple[list[str], list[str]]:
    """Markdown lines and plot names of the audit part of the OWNER-ONLY report.

    The fidelity t-SNE (``<audit_dir>/fidelity/fidelity_tsne.png``: one point
    per sampled private record) is copied into ``private_dir``, never into
    the shareable report's directory.
    """
    fid = (
        AuditSummary.from_json(audit.summary, "the audit stage's summary").fidelity
        if audit
        else None
    )
    if not fid:
        return [], []
    lines = [
        "## Fidelity: synthetic vs private code embeddings",
        "",
        "A 2-D projection (t-SNE, or PCA for fewer than 5 points) of the code embeddings "
        "of the sampled synthetic and private snippets: ONE POINT PER PRIVATE RECORD. "
        "It is private data and must not be shared or released.",
        "",
        *_grid(["metric", "value"], [[k, fid.get(k)] for k in _FIDELITY_METRICS]),
    ]
    names = []
    if plots and audit_dir is not None:
        name = _copy_plot(audit_dir / "fidelity" / TSNE_PLOT, private_dir, TSNE_PLOT)
        if name:
            lines += [f"![t-SNE of synthetic vs private code]({TSNE_PLOT})", ""]
            names.append(name)
    return lines, names


def _probe_lines(models: dict[str, Any]) -> list[str]:
    rows = []
    for name, m in models.items():
        p = m.get("probe")
        if not p:
            continue
        for category, metrics in sorted((p.get("per_category") or {}).items()):
            rows.append(
                [
                    name,
                    category,
                    *[metrics.get(k) for k in ("LP-1", "LP-2", "IL-2")],
                    metrics.get("confirmed"),
                ]
            )
    if not rows:
        return []
    return [
        "### Leak probing by test generation",
        "",
        "The model writes a function, then unit tests with realistic inputs; PII in the "
        "test inputs is extracted, judged (format validators) and verified against the "
        "private corpus (1 to 100 hits). LP-L: responses with >= L confirmed leaked "
        "elements; IL-L: with >= L interconnected ones.",
        "",
        *_grid(["model", "category", "LP-1", "LP-2", "IL-2", "confirmed leaks"], rows),
    ]


# --------------------------------------------------------------------------- sections


def eval_report(evaluation: StageManifest, ctx: ReportContext) -> Section:
    """The eval stage's section: pass@k per model (shareable)."""
    lines, plots = eval_section(evaluation, ctx.out_dir, ctx.plots)
    return Section(lines=lines, plots=plots)


def audit_report(audit: StageManifest, ctx: ReportContext) -> Section:
    """The audit stage's section: aggregates shared; the fidelity t-SNE to the owner only."""
    directory = ctx.stage_dir("audit")
    lines, plots = audit_section(audit, directory, ctx.out_dir, ctx.plots)
    owner_lines, owner_plots = audit_owner_section(audit, directory, ctx.private_dir, ctx.plots)
    return Section(lines=lines, plots=plots, owner_lines=owner_lines, owner_plots=owner_plots)
