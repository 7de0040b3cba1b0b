"""Report section for PAC-private generation, from the pac stage's manifest only.

Reads the aggregates :func:`privcode.pac.evaluate.evaluate_pac` put in the
stage summary (accuracies, charged and measured nats, attack successes and
their bounds); never a record, a posterior or the worlds. The worlds'
training seconds (un-noised: they grow with the private halves) go to the
owner-only report only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest
from privcode.pipeline.sections import ReportContext, Section
from privcode.pipeline.sections import fmt as _fmt
from privcode.pipeline.sections import grid as _grid
from privcode.pipeline.sections import plt as _plt
from privcode.pipeline.sections import save_fig as _save

__all__ = ["owner_pac_lines", "pac_report", "pac_section", "plot_pac"]


def _nats(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def plot_pac(summary: dict[str, Any], path: Path) -> bool:
    """Left: next-token accuracy (public, one world, PAC). Right: the MIA and
    world-identification bounds against the nats charged, with the measured points."""
    from privcode.pac.bounds import mia_success_bound, world_identification_bound

    util, leak = summary.get("utility") or {}, summary.get("leakage") or {}
    acc, m = util.get("accuracy") or {}, summary.get("m")
    if not acc or not leak or not m:
        return False
    import numpy as np

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["public", "world", "pac"]
    labels = ["public base", "one world\n(NOT private)", f"PAC (b={summary['budget']['b']:.2g})"]
    ax1.bar(labels, [acc[k] for k in names], color=["#999999", "#d62728", "#1f77b4"])
    ax1.set_ylabel("next-token accuracy (held-out)")
    ax1.set_title("Utility, teacher-forced")
    lo = max(min(leak["charged_nats"], 1e-8), 1e-12)
    hi = max(10 * summary["budget"]["deployment_budget"], 10 * lo)
    grid = np.logspace(np.log10(lo) - 1, np.log10(hi), 60)
    ax2.semilogx(
        grid, [mia_success_bound(x) for x in grid], color="#1f77b4", label="MIA success bound"
    )
    ax2.semilogx(
        grid,
        [world_identification_bound(x, m) for x in grid],
        color="#ff7f0e",
        label=f"world-ID bound (m={m})",
    )
    c = max(leak["charged_nats"], grid[0])
    ax2.errorbar(
        [c],
        [leak["mia_success"]],
        yerr=[3 * (leak.get("mia_success_se") or 0)],
        fmt="o",
        color="#1f77b4",
        capsize=3,
        label="MIA measured (+- 3 se)",
    )
    ax2.plot([c], [leak["world_id_success"]], "s", color="#ff7f0e", label="world-ID measured")
    ax2.axvline(
        summary["budget"]["deployment_budget"],
        color="grey",
        ls="--",
        lw=1,
        label="deployment budget",
    )
    ax2.set_xlabel("mutual information charged (nats)")
    ax2.set_ylabel("attack success")
    ax2.set_ylim(0, 1.02)
    ax2.legend(fontsize=7, loc="upper left")
    ax2.set_title(f"Privacy: {leak['sessions']} sessions x {leak['tokens']} tokens")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def pac_section(
    pac: StageManifest | None, out_dir: Path, plots: bool
) -> tuple[list[str], list[str]]:
    """Markdown lines and plot names of the PAC section (empty without a pac stage)."""
    if not pac:
        return [], []
    s = pac.summary
    util, leak, budget = s.get("utility") or {}, s.get("leakage") or {}, s.get("budget") or {}
    train = s.get("worlds") or {}
    acc = util.get("accuracy") or {}
    lines = [
        "## PAC-private generation (served ensemble)",
        "",
        f"{s.get('m')} LoRA worlds (rank {(train.get('lora') or {}).get('r')}, "
        f"{train.get('steps')} steps), each trained WITHOUT DP "
        "on a random half of the private records; the server releases tokens through "
        f"the PAC curator (per-token budget b = {_nats(budget.get('b'))} nats, "
        f"candidates: the public base's top-{s.get('top_k')}). A token on which the "
        "worlds agree is free.",
        "",
    ]
    lines += [f"Utility (teacher-forced, held-out records, {util.get('positions')} positions):", ""]
    lines += _grid(
        [
            "public base",
            "one world (NOT private)",
            "PAC",
            "gain retained",
            "unanimous",
            "mean a_t at dissent",
        ],
        [
            [
                acc.get("public"),
                acc.get("world"),
                acc.get("pac"),
                util.get("gain_retained"),
                util.get("unanimity_rate"),
                util.get("mean_active_at_dissent"),
            ]
        ],
    )
    lines += [
        f"Leakage ({leak.get('sessions')} generated sessions of {leak.get('tokens')} "
        f"tokens, {leak.get('decoder')} votes, a fresh secret each):",
        "",
    ]
    lines += _grid(
        [
            "charged (nats)",
            "measured I(S;H_T) +- se",
            "measured/charged",
            "MIA success +- se (bound)",
            "world-ID success +- se (bound)",
        ],
        [
            [
                _nats(leak.get("charged_nats")),
                f"{_nats(leak.get('measured_nats'))} +- {_nats(leak.get('measured_nats_se'))}",
                leak.get("measured_over_charged"),
                f"{_fmt(leak.get('mia_success'))} +- {_fmt(leak.get('mia_success_se'))} "
                f"({_fmt(leak.get('mia_bound'), 4)})",
                f"{_fmt(leak.get('world_id_success'))} +- "
                f"{_fmt(leak.get('world_id_success_se'))} "
                f"({_fmt(leak.get('world_id_bound'), 4)})",
            ]
        ],
    )
    lines += [
        "With a small b the per-token bound is nearly tight, so the measured "
        "information hovers around the charge; it exceeding the charge by more than "
        "3 standard errors would be a bug.",
        "",
    ]
    over = [
        name
        for name, value, se, bound in (
            (
                "information",
                leak.get("measured_nats"),
                leak.get("measured_nats_se"),
                leak.get("charged_nats"),
            ),
            (
                "MIA success",
                leak.get("mia_success"),
                leak.get("mia_success_se"),
                leak.get("mia_bound"),
            ),
            (
                "world identification",
                leak.get("world_id_success"),
                leak.get("world_id_success_se"),
                leak.get("world_id_bound"),
            ),
        )
        if None not in (value, se, bound) and value - 3 * se > bound
    ]
    if over:
        lines += [
            f"**WARNING: measured {', '.join(over)} above its bound by more than 3 "
            "standard errors: a bug in the mechanism or its accounting.**",
            "",
        ]
    em = s.get("canary_emission")
    if em and em.get("canaries"):
        e, n = em["emitted"], em["canaries"]
        lines += [
            f"Content is not protected (canary emission, the {n} most repeated canaries "
            f"({', '.join(map(str, em['repetitions']))} repetitions), greedy after their "
            f"own context, {em['tokens']} tokens): the public base emitted "
            f"{e['public']}/{n}, one world {e['world']}/{n}, PAC {e['pac']}/{n}. PAC "
            "bounds what leaks about which half of the corpus the served world saw, "
            "not a value every world learnt.",
            "",
        ]
    lines += [
        f"Serving budgets: {_fmt(budget.get('session_budget'), 6)} nats per session "
        f"({budget.get('private_tokens_per_session')} private tokens), "
        f"{_fmt(budget.get('deployment_budget'), 4)} nats per deployment: MIA success "
        f"<= {_fmt(budget.get('mia_bound_at_deployment_budget'), 4)}, world "
        f"identification <= {_fmt(budget.get('world_id_bound_at_deployment_budget'), 4)} "
        "for everything the deployment ever releases.",
        "",
    ]
    names: list[str] = []
    if plots and plot_pac(s, out_dir / "pac.png"):
        lines += ["![PAC-private generation](pac.png)", ""]
        names.append("pac.png")
    return lines, names


def owner_pac_lines(pac: StageManifest) -> list[str]:
    """OWNER-ONLY: the worlds' training seconds (never in the shareable report)."""
    seconds = (pac.summary.get("worlds") or {}).get("seconds")
    return ["## PAC worlds (owner-only numbers)", "", f"Worlds' training: {seconds} s.", ""]


def pac_report(pac: StageManifest, ctx: ReportContext) -> Section:
    """The pac stage's section: settings and aggregates shared, the worlds' seconds owner-only."""
    lines, plots = pac_section(pac, ctx.out_dir, ctx.plots)
    return Section(lines=lines, plots=plots, owner_lines=owner_pac_lines(pac))
