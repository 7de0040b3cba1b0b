"""The report sections of the data, base, train, synth and premium stages.
Design notes: docs/development.md, "privcode/pipeline/report_stages.py".

Each ``*_section(manifest, ctx)`` renders one stage's part from its manifest summary
(:mod:`privcode.pipeline.sections`); the stage classes (:mod:`privcode.pipeline.stages`) call
them. Shareable: the privacy accounting, a loss curve on PUBLIC held-out code only, N. Owner-only
(:func:`owner_train_lines`, ``privcode budget show``): the corpus's composition, the store's
composition over every job and the DP training's wall clock, which move with records outside
this release's DP path. The base and premium models' clocks stay shareable.

"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest, SynthSummary, TrainSummary
from privcode.artifacts.base import BaseRecord
from privcode.artifacts.premium import PremiumSummary
from privcode.errors import PrivcodeError
from privcode.pipeline.report_sweep import privacy_utility, sweep_section
from privcode.pipeline.sections import ReportContext, Section, fmt, number, save_fig, table
from privcode.pipeline.sections import plt as pyplot
from privcode.synth.telemetry import POOLS_FILE

__all__ = [
    "base_section",
    "data_section",
    "owner_train_lines",
    "plot_base",
    "plot_corpus",
    "plot_pools",
    "plot_synth",
    "plot_train",
    "premium_section",
    "store_section",
    "synth_section",
    "train_section",
]

#: The shareable report's only words on the privacy store (the same in every run).
STORE_NOTE = (
    "The epsilon above is this release's own. A record's epsilon over every DP job that "
    "trained on it (the privacy store's composition), the training wall clock and the "
    "stages' timings are not part of this report: they move with records outside this "
    "release's DP path. The data owner finds them in the owner-only report and with "
    "`privcode budget show`."
)

#: The synth summary's funnel counts, in order (report.json's ``synth_funnel``).
FUNNEL = ("generated", "removed_execution", "removed_roundtrip", "removed_duplicate", "kept")


def plot_corpus(counts: dict[str, Any], path: Path) -> bool:
    """Bar chart of the corpus composition. Returns False when there is nothing to plot."""
    items = [(k, v) for k, v in sorted(counts.items()) if isinstance(v, int | float)]
    if not items:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(items) + 1.2))
    ax.barh([k for k, _ in items], [v for _, v in items], color="#4a7ab5")
    for i, (_, v) in enumerate(items):
        ax.text(v, i, f" {v}", va="center", fontsize=8)
    ax.set_xlabel("records / items")
    ax.set_title("Private demo corpus composition")
    ax.invert_yaxis()
    save_fig(fig, path)
    plt.close(fig)
    return True


def plot_base(info: BaseRecord, path: Path) -> bool:
    """Held-out loss of the base model (untrained vs trained) and its training curve."""
    plt = pyplot()
    history = info.loss_history
    ncols = 2 if history else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.4), squeeze=False)
    ax = axes[0][0]
    labels, values = ["trained"], [info.heldout_loss]
    if info.untrained_heldout_loss is not None:
        labels.insert(0, "untrained")
        values.insert(0, info.untrained_heldout_loss)
    ax.bar(labels, values, color=["#b0b0b0", "#4a7ab5"][-len(values) :])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("held-out cross-entropy (nats/token)")
    ax.set_title("Public base model on held-out public code")
    if history:
        ax = axes[0][1]
        ax.plot([h[0] for h in history], [h[1] for h in history], color="#4a7ab5")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title("Base model training")
    save_fig(fig, path)
    plt.close(fig)
    return True


def plot_train(summary: TrainSummary, path: Path) -> bool:
    """Loss of the DP model on PUBLIC held-out code at each checkpoint (DP-safe curve)."""
    curve = [(s, v) for s, v in summary.public_heldout_loss_curve if v is not None]
    if not curve:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", color="#4a7ab5")
    ax.set_xlabel("DP-SGD step")
    ax.set_ylabel("public held-out loss (nats/token)")
    eps = summary.epsilon
    title = "DP training: loss on public held-out code"
    ax.set_title(title + (f" (final eps={eps:.2f})" if isinstance(eps, float) else " (NOT DP)"))
    save_fig(fig, path)
    plt.close(fig)
    return True


def _train_section(info: TrainSummary) -> list[str]:
    steps = f"{info.steps_taken} of {info.steps_requested}"
    sigma = info.noise_multiplier
    rows = [
        ("method", info.method),
        (
            "Stage II conditions generation on",
            {
                "latent": "a latent z ~ N(0, I) through the released prefix decoder D",
                "prompt": "public prompts",
                "none": "nothing (unconditional)",
            }.get(info.conditioning, info.conditioning),
        ),
        ("epsilon, RDP accountant", info.epsilon_rdp),
        ("epsilon, PRV accountant", info.epsilon_prv),
        (
            "epsilon budget (enforced with the " + str(info.accountant) + " accountant)",
            info.epsilon_budget,
        ),
        ("delta", info.delta),
        ("DP-SGD steps taken", steps),
        (
            "noise multiplier sigma" + (" (calibrated)" if info.noise_calibrated else ""),
            sigma,
        ),
        ("sample rate q", info.sample_rate),
        ("expected batch size qN", info.expected_batch_size),
        ("clipping norm C", info.max_grad_norm),
        ("training records N", info.num_records),
        ("neighbouring datasets (adjacency)", info.adjacency),
        ("sampling and noise randomness", info.rng),
        ("dataset (opaque id)", info.dataset_id),
        ("Ray Train workers", info.num_workers),
    ]
    lines = ["## DP training (Stage I)", ""]
    if not info.dp:
        reason = info.reason_not_private
        lines += [
            "**WARNING: NOT PRIVATE. This run trained without differential privacy "
            f"(the DP engine's non-private mode: {reason}); its release must never be "
            "treated as a DP artifact.**",
            "",
        ]
    lines += [
        "The junior model (LoRA adapter, plus the PrivLC encoders and prefix decoder for "
        "latent methods), trained with DP-SGD on Ray Train: per-record clipping to C of the "
        "gradient over every trainable module jointly, Gaussian noise added once per step, "
        "Poisson sampling, one optimiser and one privacy ledger. The released artifact "
        "(`train/release/`) is the adapter, the prefix decoder D (latent methods) and "
        "`privacy.json`; the encoders E_c and E_p, which saw private code and prompts, are "
        "never released. Epsilon comes from the privacy store's ledger, which admitted the "
        "job on its records' budget and granted every step before it was applied.",
        "",
        table([(k, number(v)) for k, v in rows]),
        "",
        "The curve below is the loss of the trained model on PUBLIC held-out code (the base "
        "model's held-out standard-library files), computed from the weights at each "
        "checkpoint: post-processing of the DP release, safe to publish. The training loss "
        "on the private batches is deliberately not reported: it is an un-noised statistic "
        "of private records.",
        "",
    ]
    return lines + ([STORE_NOTE, ""] if info.dp else [])


def _training_records(data: StageManifest | None, train: StageManifest | None) -> Any:
    """N: the train stage's record count, else the data stage's ``train_records``."""
    n = train.summary.get("num_records") if train else None
    if n is None and data:
        n = (data.summary.get("counts") or {}).get("train_records")
    return n


def _corpus_section(data: StageManifest | None, train: StageManifest | None) -> list[str]:
    """SHAREABLE: of the private corpus, only N (public under the DP accounting)."""
    if not data:
        return ["## Private corpus", "", "_The data stage did not run._", ""]
    return [
        "## Private corpus",
        "",
        "The private corpus stays inside the privacy boundary. Its size N is treated as "
        "public by the DP accounting (it sets the sample rate q); its composition (exact counts of "
        "PII kinds, canaries and sources) is an un-noised statistic of the private data and "
        "is not part of this report.",
        "",
        table([("training records N", _training_records(data, train))]),
        "",
    ]


def _owner_corpus_section(data: StageManifest | None) -> list[str]:
    """OWNER-ONLY: the exact composition of the private corpus."""
    if not data:
        return ["## Private corpus composition", "", "_The data stage did not run._", ""]
    counts = data.summary.get("counts", {})
    what = (
        "the ingested corpus (your repositories and instruction files, after deduplication "
        "and the held-out split by file; `scan.json` beside it counts secrets and PII kinds "
        "per source)"
        if data.summary.get("inputs_state")
        else "the private demo corpus (stdlib functions and HumanEval with Faker PII and canaries)"
    )
    return [
        "## Private corpus composition",
        "",
        f"Exact counts of {what}. These are un-noised statistics of the private data, for "
        "the data owner only; nothing below is a record.",
        "",
        table([(k, v) for k, v in sorted(counts.items())], ("kind", "count")),
        "",
    ]


def _base_section(base: StageManifest | None) -> list[str]:
    if not base:
        return ["## Public base model", "", "_The base stage did not run._", ""]
    info = BaseRecord.from_json(base.summary, "the base stage's summary")
    rows = [
        ("model path", info.path),
        ("preset", info.preset or "(external model)"),
        ("parameters", info.params),
        ("held-out loss, trained (nats/token)", info.heldout_loss),
        ("held-out loss, untrained (nats/token)", info.untrained_heldout_loss),
        ("training seconds", info.train_seconds),
        ("tokens/s", info.tokens_per_second),
        ("cached build", info.cached),
    ]
    return [
        "## Public base model",
        "",
        "Trained from scratch on public code only (standard-library modules disjoint "
        "from the private corpus), or the external model given by `base.model`.",
        "",
        table(rows),
        "",
    ]


def plot_synth(summary: SynthSummary, path: Path) -> bool:
    """The Stage II funnel: generated, removed by each filter, kept (PrivCode++ Table 6)."""
    if not summary.generated:
        return False
    plt = pyplot()
    labels = ("generated", "execution\nfilter", "round-trip\nfilter", "duplicates", "kept")
    values = [getattr(summary, k) for k in FUNNEL]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    bars = ax.bar(labels, values, color=["#7f7f7f", "#c0504d", "#e39a3b", "#b5a642", "#4a7ab5"])
    ax.bar_label(bars, labels=[str(v) for v in values], fontsize=8)
    ax.set_ylabel("samples")
    ax.set_title("Stage II synthesis funnel")
    save_fig(fig, path)
    plt.close(fig)
    return True


#: The Stage II operator pools, in dataflow order, and their plot colours.
POOLS = {
    "generate": "#4a7ab5",
    "extract": "#b5a642",
    "execution": "#c0504d",
    "roundtrip": "#e39a3b",
}


def plot_pools(timeline: dict[str, Any], path: Path) -> bool:
    """Stage II's operator pools over time (``pools.json``): actors alive per pool, samples
    waiting in or inside each operator, and each operator's throughput (samples/s between
    points). Returns False when the timeline has fewer than two points."""
    t, pools = timeline.get("t") or [], timeline.get("pools") or {}
    if len(t) < 2 or not pools:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for name, series in pools.items():
        colour = POOLS.get(name)
        axes[0].step(t, series["alive"], where="post", color=colour, label=name)
        axes[1].plot(t, series["queued"], color=colour, label=name)
        rows = series["rows"]
        rate = [(rows[i] - rows[i - 1]) / max(t[i] - t[i - 1], 1e-9) for i in range(1, len(t))]
        axes[2].plot(t[1:], rate, color=colour, label=name)
    for ax, title in zip(
        axes,
        ("actors alive per pool", "samples queued in the operator", "throughput (samples/s)"),
        strict=True,
    ):
        ax.set_title(title)
        ax.set_xlabel("seconds")
    axes[0].legend(fontsize=8)
    save_fig(fig, path)
    plt.close(fig)
    return True


def _operator_rows(info: SynthSummary) -> list[tuple[str, Any]]:
    """One table row per operator pool: its throughput and its largest pool."""
    return [
        (
            f"operator {name}: samples/s per actor (per CPU), wall; largest pool",
            f"{number(op.get('rows_per_actor_s'))} ({number(op.get('rows_per_cpu_s'))}), "
            f"{number(op.get('rows_per_s'))}; {op.get('peak_actors')} actors "
            f"of {op.get('cpus_per_actor')} CPU",
        )
        for name, op in info.operators.items()
    ]


def _synth_section(info: SynthSummary) -> list[str]:
    g = max(info.generated, 1)

    def pct(key: str) -> str:
        count = getattr(info, key)
        return f"{count} ({100.0 * count / g:.1f}%)"

    rows = [
        (
            "released artifact (the only input)",
            f"method {info.method}, conditioning {info.conditioning}, dp {info.dp}",
        ),
        ("generated", info.generated),
        ("removed by the execution filter (sandbox)", pct("removed_execution")),
        ("removed by the round-trip filter", pct("removed_roundtrip")),
        ("removed as exact / near duplicates", pct("removed_duplicate")),
        ("kept (synthetic.parquet)", pct("kept")),
        (
            "execution verdicts",
            ", ".join(f"{k} {v}" for k, v in info.execution_statuses.items()),
        ),
        (
            "sandbox isolation (snippets)",
            ", ".join(f"{k} {v}" for k, v in (info.sandbox.get("isolation") or {}).items())
            or "not recorded",
        ),
        ("samples/s (end to end)", info.samples_per_second),
        *_operator_rows(info),
        (
            "shards (resumed from a previous run)",
            f"{info.shards} ({info.shards_resumed})",
        ),
    ]
    lines = ["## Synthetic data (Stage II)", ""]
    levels = [lv for lv in info.sandbox.get("isolation") or {} if lv != "parse-check"]
    weak = [lv for lv in levels if not lv.startswith("namespaces+uid+seccomp")]
    for note in info.sandbox.get("notes") or []:
        lines += [f"**WARNING: {note}** (sandbox: {', '.join(weak or levels)}).", ""]
    sandbox_words = (
        "(own namespaces, no network, unprivileged uid, seccomp, rlimits"
        + (
            ", a cgroup per snippet"
            if levels and all(lv.endswith("+cgroup") for lv in levels)
            else ""
        )
        + ", wall-clock kill)"
        if levels and not weak
        else "(see the isolation row: NOT the full sandbox)"
    )
    dp = info.dp
    if not dp:
        lines += [
            "**WARNING: NO differential-privacy guarantee. " + str(info.privacy_warning) + "**",
            "",
        ]
    lines += [
        (
            "Generated from the released DP artifact only (post-processing: the guarantee "
            "carries over), streamed"
            if dp
            else "Generated from the release only, streamed"
        )
        + " through Ray Data: generation by the junior, prompt "
        f"extraction, execution of every snippet in the sandbox {sandbox_words}, round-trip "
        "filtering, deduplication. For "
        "comparison, PrivCode++ (Table 6) reports 34.4% removed by execution and 5.9% by "
        "round-trip on 50,000 samples from a 1.5B junior.",
        "",
        table([(k, number(v)) for k, v in rows]),
        "",
    ]
    return lines


def _premium_section(info: PremiumSummary) -> list[str]:
    rows = [
        ("premium base model", info.model),
        ("synthetic records", info.records),
        ("training seconds", info.train_seconds),
    ]
    rows += [
        (
            f"epoch {p['epoch']}: train / held-out synthetic loss",
            f"{fmt(p.get('train_loss'))} / {fmt(p.get('eval_loss'))}",
        )
        for p in info.curve
    ]
    privacy = info.privacy
    if privacy.dp:
        head = [
            "LoRA fine-tuning of the premium base on the synthetic data only, without DP: "
            "the data is a function of the DP release, so the premium model inherits its "
            f"guarantee by post-processing: {privacy.guarantee}. Losses are on "
            "synthetic (public) data."
        ]
    else:
        head = [
            "**WARNING: NO differential-privacy guarantee holds for the premium model: "
            + privacy.guarantee
            + "**",
            "",
            "LoRA fine-tuning of the premium base on the synthetic data, without DP.",
        ]
    return ["## Premium model", "", *head, "", table([(k, number(v)) for k, v in rows]), ""]


# --------------------------------------------------------------------------- sections


def data_section(data: StageManifest, ctx: ReportContext) -> Section:
    """N in the shareable report; the exact composition (and its plot) for the owner only."""
    train = ctx.inputs.get("train")
    section = Section(
        lines=_corpus_section(data, train),
        owner_lines=_owner_corpus_section(data),
        summary={"training_records": _training_records(data, train)},
    )
    made = ctx.plots and plot_corpus(data.summary.get("counts", {}), ctx.private_dir / "corpus.png")
    section.add_plot(made, "corpus.png", "corpus composition", owner=True)
    return section


def base_section(base: StageManifest, ctx: ReportContext) -> Section:
    info = BaseRecord.from_json(base.summary, "the base stage's summary")
    section = Section(lines=_base_section(base), summary={"base_heldout_loss": info.heldout_loss})
    made = ctx.plots and plot_base(info, ctx.out_dir / "base_loss.png")
    section.add_plot(made, "base_loss.png", "base model loss")
    return section


def store_section(info: TrainSummary) -> list[str]:
    """OWNER-ONLY: the privacy store's per-record composition (``privcode budget show``).

    The budget, the worst record of this run's data and of the store (every DP job on it
    composed), what is left, the number of jobs and of record groups: they move with
    records outside this release's DP path, so they are never in the shareable report,
    ``report.json`` or ``privacy.json``. Never a record, a fingerprint or the store's path.
    """
    if not info.dp or not info.privacy_store:
        return []
    from privcode.privacy.budget import call

    try:
        shown = call(info.privacy_store, "show")
    except PrivcodeError as exc:
        return [f"Privacy store: unavailable to the report ({type(exc).__name__}).", ""]
    b = shown["budget"] or {}
    rows = [
        (
            f"per-record epsilon budget ({b.get('accountant')}, delta {b.get('delta')})",
            b.get("epsilon"),
        ),
        ("worst record of this run's data, every job on it composed", info.record_epsilon),
        ("worst record in the store", shown["epsilon_spent"]),
        ("left for the worst record", shown["epsilon_left"]),
        ("DP jobs recorded in the store", len(shown["jobs"])),
        ("record groups (records trained on by the same jobs)", len(shown["groups"])),
    ]
    return [
        "### Per-record budget (privacy store)",
        "",
        "A record's epsilon composes every DP job that trained on it, whatever run, "
        "directory or copy of the file (`privcode budget show`); a job is admitted only if "
        "its worst record stays within the budget. Not in the shareable report: these "
        "numbers move with records outside this release's DP path.",
        "",
        table([(k, number(v)) for k, v in rows]),
        "",
    ]


def owner_train_lines(info: TrainSummary) -> list[str]:
    """OWNER-ONLY: the DP training's wall clock, why it stopped, the store's composition.

    The wall clock grows with the Poisson-sampled private batches (un-noised), the stop
    reason reveals restarts, the composition moves with other jobs' records; the
    shareable report carries none of them.
    """
    stopped = {"steps": "all steps done", "budget": "budget spent"}.get(info.stop_reason)
    rows = [
        ("training seconds", info.train_seconds),
        ("stopped because (reveals restarts: owner-only)", stopped or info.stop_reason or "-"),
    ]
    return [
        "## DP training (Stage I): owner-only numbers",
        "",
        table([(k, number(v)) for k, v in rows]),
        "",
        *store_section(info),
    ]


def train_section(train: StageManifest, ctx: ReportContext) -> Section:
    """The release's accounting, the public held-out curve and the privacy-utility comparison;
    the wall clock and the store's composition for the owner only (:func:`owner_train_lines`)."""
    info = TrainSummary.from_json(train.summary, "the train stage's summary")
    sweep = privacy_utility(ctx.cfg, train)
    section = Section(
        lines=_train_section(info),
        owner_lines=owner_train_lines(info),
        summary={"train_epsilon": info.epsilon_by_accountant, "privacy_utility": sweep},
    )
    made = ctx.plots and plot_train(info, ctx.out_dir / "train_loss.png")
    section.add_plot(made, "train_loss.png", "DP training: public held-out loss")
    lines, plots = sweep_section(ctx.cfg, train, ctx.out_dir, ctx.plots, data=sweep)
    section.lines += lines
    section.plots += plots
    return section


def synth_section(synth: StageManifest, ctx: ReportContext) -> Section:
    info = SynthSummary.from_json(synth.summary, "the synth stage's summary")
    section = Section(
        lines=_synth_section(info),
        summary={"synth_funnel": {k: getattr(info, k) for k in FUNNEL}},
    )
    made = ctx.plots and plot_synth(info, ctx.out_dir / "synth_funnel.png")
    section.add_plot(made, "synth_funnel.png", "Stage II funnel")
    pools = ctx.stage_dir("synth") / POOLS_FILE
    if ctx.plots and info.operators and pools.is_file():  # the run that generated
        made = plot_pools(json.loads(pools.read_text()), ctx.out_dir / "synth_pools.png")
        section.add_plot(made, "synth_pools.png", "Stage II operator pools over time")
    return section


def premium_section(premium: StageManifest, ctx: ReportContext) -> Section:
    info = PremiumSummary.from_json(premium.summary, "the premium stage's summary")
    return Section(lines=_premium_section(info))
