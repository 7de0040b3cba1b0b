"""The run report: Markdown plus PNG plots, built from stage manifests only.

The report never opens a dataset: it reads the aggregates that each stage put
in its manifest summary (counts, losses, timings). The DP training section
shows the privacy accounting and a loss curve on PUBLIC held-out code only.

Run alone (``privcode report``), it also reads the manifests of
the other configured stages from disk when they are current.

Two reports, split at the privacy boundary (docs: only aggregates leave it):

* The SHAREABLE report, ``<reports_dir>/<run>/`` (``report.md``,
  ``report.html``, ``report.json``, PNGs); the same files also live in the
  report stage's artifact directory, whose manifest hashes them. Aggregates
  only: rates, counts of the DP pipeline, AUCs, means, the ROC curve of a
  membership attack, the privacy accounting. Of the private corpus it shows
  N (training records, which the DP accounting treats as public) and the
  opaque dataset id, never a digest of the corpus.
* The OWNER-ONLY report, ``<run.out_dir>/<run>/private_report/``
  (``report.md``, ``report.html``, PNGs; directory 0700, files 0600), inside
  the run's private storage: the exact composition of the private corpus
  (un-noised counts: PII kinds, canaries, ``corpus.png``) and every plot that
  shows one private record (the fidelity t-SNE). Neither the shareable report
  nor the release links to it or names its path; :func:`write_report`
  returns its path (``private_report``) for the command line only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from privcode.config import PipelineConfig
from privcode.layout import RunLayout
from privcode.pipeline.report_audit import OWNER_ONLY_PLOTS as AUDIT_OWNER_ONLY_PLOTS
from privcode.utils import atomic_path, atomic_write_json, atomic_write_text


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "n/a" if value is None else str(value)


def _table(rows: list[tuple[str, Any]], header: tuple[str, str] = ("quantity", "value")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    return "\n".join(lines)


def _save_fig(fig: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plot_corpus(counts: dict[str, Any], path: Path) -> bool:
    """Bar chart of the corpus composition. Returns False when there is nothing to plot."""
    items = [(k, v) for k, v in sorted(counts.items()) if isinstance(v, int | float)]
    if not items:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.4 * len(items) + 1.2))
    ax.barh([k for k, _ in items], [v for _, v in items], color="#4a7ab5")
    for i, (_, v) in enumerate(items):
        ax.text(v, i, f" {v}", va="center", fontsize=8)
    ax.set_xlabel("records / items")
    ax.set_title("Private demo corpus composition")
    ax.invert_yaxis()
    _save_fig(fig, path)
    plt.close(fig)
    return True


def plot_base(info: dict[str, Any], path: Path) -> bool:
    """Held-out loss of the base model (untrained vs trained) and its training curve."""
    trained = info.get("heldout_loss")
    if trained is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = info.get("loss_history") or []
    ncols = 2 if history else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.4), squeeze=False)
    ax = axes[0][0]
    labels, values = ["trained"], [trained]
    if info.get("untrained_heldout_loss") is not None:
        labels.insert(0, "untrained")
        values.insert(0, info["untrained_heldout_loss"])
    ax.bar(labels, values, color=["#b0b0b0", "#4a7ab5"][-len(values) :])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("held-out cross-entropy (nats/token)")
    ax.set_title("Public base model on held-out public code")
    if history:
        ax = axes[0][1]
        steps = (
            [h[0] for h in history]
            if isinstance(history[0], list | tuple)
            else list(range(len(history)))
        )
        losses = [h[1] for h in history] if isinstance(history[0], list | tuple) else history
        ax.plot(steps, losses, color="#4a7ab5")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title("Base model training")
    _save_fig(fig, path)
    plt.close(fig)
    return True


def plot_train(summary: dict[str, Any], path: Path) -> bool:
    """Loss of the DP model on PUBLIC held-out code at each checkpoint (DP-safe curve)."""
    curve = [(s, v) for s, v in summary.get("public_heldout_loss_curve") or [] if v is not None]
    if not curve:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", color="#4a7ab5")
    ax.set_xlabel("DP-SGD step")
    ax.set_ylabel("public held-out loss (nats/token)")
    eps = summary.get("epsilon")
    title = "DP training: loss on public held-out code"
    ax.set_title(title + (f" (final eps={eps:.2f})" if isinstance(eps, float) else " (NOT DP)"))
    _save_fig(fig, path)
    plt.close(fig)
    return True


def _number(value: Any) -> Any:
    """4 significant digits; small values (delta, q) in scientific notation."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def _train_section(train: dict[str, Any] | None) -> list[str]:
    if not train:
        return []
    info = train.get("summary", {})
    steps = f"{info.get('steps_taken')} of {info.get('steps_requested')}"
    sigma = info.get("noise_multiplier")
    rows = [
        ("method", info.get("method")),
        (
            "Stage II conditions generation on",
            {
                "latent": "a latent z ~ N(0, I) through the released prefix decoder D",
                "prompt": "public prompts",
                "none": "nothing (unconditional)",
            }.get(info.get("conditioning"), info.get("conditioning")),
        ),
        ("epsilon, RDP accountant", info.get("epsilon_rdp")),
        ("epsilon, PRV accountant", info.get("epsilon_prv")),
        (
            "epsilon budget (enforced with the " + str(info.get("accountant")) + " accountant)",
            info.get("epsilon_budget"),
        ),
        ("delta", info.get("delta")),
        ("DP-SGD steps taken", steps),
        (
            "stopped because",
            {"steps": "all steps done", "budget": "budget spent"}.get(
                info.get("stop_reason"), info.get("stop_reason")
            ),
        ),
        (
            "noise multiplier sigma" + (" (calibrated)" if info.get("noise_calibrated") else ""),
            sigma,
        ),
        ("sample rate q", info.get("sample_rate")),
        ("expected batch size qN", info.get("expected_batch_size")),
        ("clipping norm C", info.get("max_grad_norm")),
        ("training records N", info.get("num_records")),
        ("neighbouring datasets (adjacency)", info.get("adjacency")),
        ("sampling and noise randomness", info.get("rng")),
        ("dataset (opaque id)", info.get("dataset_id")),
        ("Ray Train workers", info.get("num_workers")),
        ("training seconds", info.get("train_seconds")),
    ]
    lines = ["## DP training (Stage I)", ""]
    if not info.get("dp", True):
        reason = (info.get("training_mode") or {}).get("reason", "method nondpft")
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
        "never released. Epsilon comes from the run's privacy ledger, which granted every "
        "step before it was applied.",
        "",
        _table([(k, _number(v)) for k, v in rows]),
        "",
        "The curve below is the loss of the trained model on PUBLIC held-out code (the base "
        "model's held-out standard-library files), computed from the weights at each "
        "checkpoint: post-processing of the DP release, safe to publish. The training loss "
        "on the private batches is deliberately not reported: it is an un-noised statistic "
        "of private records.",
        "",
    ]
    return lines


def _training_records(data: dict[str, Any] | None, train: dict[str, Any] | None) -> Any:
    """N: the train stage's record count, else the data stage's ``train_records``."""
    n = ((train or {}).get("summary") or {}).get("num_records")
    if n is None:
        n = (((data or {}).get("summary") or {}).get("counts") or {}).get("train_records")
    return n


def _corpus_section(data: dict[str, Any] | None, train: dict[str, Any] | None) -> list[str]:
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
        _table([("training records N", _training_records(data, train))]),
        "",
    ]


def _owner_corpus_section(data: dict[str, Any] | None) -> list[str]:
    """OWNER-ONLY: the exact composition of the private corpus."""
    if not data:
        return ["## Private corpus composition", "", "_The data stage did not run._", ""]
    counts = data.get("summary", {}).get("counts", {})
    return [
        "## Private corpus composition",
        "",
        "Exact counts of the private demo corpus (stdlib functions and HumanEval with "
        "Faker PII and canaries). These are un-noised statistics of the private data, for "
        "the data owner only; nothing below is a record.",
        "",
        _table([(k, v) for k, v in sorted(counts.items())], ("kind", "count")),
        "",
    ]


def _base_section(base: dict[str, Any] | None) -> list[str]:
    if not base:
        return ["## Public base model", "", "_The base stage did not run._", ""]
    info = base.get("summary", {})
    rows = [
        ("model path", info.get("path")),
        ("preset", info.get("preset") or "(external model)"),
        ("parameters", info.get("params")),
        ("held-out loss, trained (nats/token)", info.get("heldout_loss")),
        ("held-out loss, untrained (nats/token)", info.get("untrained_heldout_loss")),
        ("training seconds", info.get("train_seconds")),
        ("tokens/s", info.get("tokens_per_second")),
        ("cached build", info.get("cached")),
    ]
    return [
        "## Public base model",
        "",
        "Trained from scratch on public code only (standard-library modules disjoint "
        "from the private corpus), or the external model given by `base.model`.",
        "",
        _table(rows),
        "",
    ]


def plot_synth(summary: dict[str, Any], path: Path) -> bool:
    """The Stage II funnel: generated, removed by each filter, kept (PrivCode++ Table 6)."""
    if not summary.get("generated"):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("generated", "removed_execution", "removed_roundtrip", "removed_duplicate", "kept")
    labels = ("generated", "execution\nfilter", "round-trip\nfilter", "duplicates", "kept")
    values = [summary.get(k, 0) for k in keys]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    bars = ax.bar(labels, values, color=["#7f7f7f", "#c0504d", "#e39a3b", "#b5a642", "#4a7ab5"])
    ax.bar_label(bars, labels=[str(v) for v in values], fontsize=8)
    ax.set_ylabel("samples")
    ax.set_title("Stage II synthesis funnel")
    _save_fig(fig, path)
    plt.close(fig)
    return True


def _synth_section(synth: dict[str, Any] | None) -> list[str]:
    if not synth:
        return []
    info = synth.get("summary", {})
    g = max(int(info.get("generated") or 0), 1)

    def pct(key: str) -> str:
        return f"{info.get(key, 0)} ({100.0 * info.get(key, 0) / g:.1f}%)"

    rows = [
        (
            "released artifact (the only input)",
            f"method {info.get('method')}, conditioning "
            f"{info.get('conditioning')}, dp {info.get('dp')}",
        ),
        ("generated", info.get("generated")),
        ("removed by the execution filter (sandbox)", pct("removed_execution")),
        ("removed by the round-trip filter", pct("removed_roundtrip")),
        ("removed as exact / near duplicates", pct("removed_duplicate")),
        ("kept (synthetic.parquet)", pct("kept")),
        (
            "execution verdicts",
            ", ".join(f"{k} {v}" for k, v in (info.get("execution_statuses") or {}).items()),
        ),
        ("samples/s (end to end)", info.get("samples_per_second")),
        (
            "shards (resumed from a previous run)",
            f"{info.get('shards')} ({info.get('shards_resumed')})",
        ),
    ]
    lines = ["## Synthetic data (Stage II)", ""]
    dp = info.get("dp") is True
    if not dp:
        lines += [
            "**WARNING: NO differential-privacy guarantee. "
            + str(
                info.get("privacy_warning")
                or "The input release is NOT PRIVATE; so is this dataset."
            )
            + "**",
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
        "extraction, execution of every snippet in the sandbox (no network, unprivileged "
        "uid, rlimits, wall-clock kill), round-trip filtering, deduplication. For "
        "comparison, PrivCode++ (Table 6) reports 34.4% removed by execution and 5.9% by "
        "round-trip on 50,000 samples from a 1.5B junior.",
        "",
        _table([(k, _number(v)) for k, v in rows]),
        "",
    ]
    return lines


def _premium_section(premium: dict[str, Any] | None) -> list[str]:
    if not premium:
        return []
    info = premium.get("summary", {})
    curve = info.get("curve") or []
    rows = [
        ("premium base model", info.get("model")),
        ("synthetic records", info.get("records")),
        ("training seconds", info.get("train_seconds")),
    ]
    rows += [
        (
            f"epoch {p['epoch']}: train / held-out synthetic loss",
            f"{_fmt(p.get('train_loss'))} / {_fmt(p.get('eval_loss'))}",
        )
        for p in curve
    ]
    privacy = info.get("privacy") or {}
    if privacy.get("dp") is True:
        head = [
            "LoRA fine-tuning of the premium base on the synthetic data only, without DP: "
            "the data is a function of the DP release, so the premium model inherits its "
            f"guarantee by post-processing: {privacy.get('guarantee')}. Losses are on "
            "synthetic (public) data."
        ]
    else:
        head = [
            "**WARNING: NO differential-privacy guarantee holds for the premium model: "
            + str(
                privacy.get("guarantee")
                or privacy.get("privacy_warning")
                or "its source is not a DP release"
            )
            + "**",
            "",
            "LoRA fine-tuning of the premium base on the synthetic data, without DP.",
        ]
    return ["## Premium model", "", *head, "", _table([(k, _number(v)) for k, v in rows]), ""]


_CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#222;line-height:1.45}table{border-collapse:collapse;margin:.5rem 0 1rem}
th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:left}th{background:#f2f4f7}
img{max-width:100%;border:1px solid #eee;margin:.5rem 0}code{background:#f5f5f5;padding:0 .2rem}
h1,h2{border-bottom:1px solid #ddd;padding-bottom:.2rem}"""


def render_html(markdown_text: str, image_dir: Path, title: str) -> str:
    """report.md as one self-contained HTML page (python-markdown; PNGs inlined as data URIs)."""
    import base64
    import html
    import re

    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"])

    def inline(match: re.Match) -> str:
        path = image_dir / match.group(2)
        if not path.is_file() or path.parent.resolve() != image_dir.resolve():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f'{match.group(1)}"data:image/png;base64,{data}"'

    body = re.sub(r'(<img[^>]*?src=)"([^"/]+\.png)"', inline, body)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_CSS}</style></head><body>{body}</body></html>"
    )


def _complete_inputs(
    cfg: PipelineConfig, inputs: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """``inputs`` plus the current on-disk manifests of configured stages the runner left out.

    ``privcode report`` passes only the report's required inputs
    (data, base); a stage of ``run.stages`` that the report reads when present
    (train, synth, ...) is added when its artifact on disk is exactly what this
    config would produce (same fingerprint, outputs intact), as the runner
    would have skipped it.
    """
    from privcode.pipeline.runner import fingerprint, is_current, read_manifest
    from privcode.pipeline.stages import STAGES

    manifests = dict(inputs)
    for name, stage in STAGES.items():
        if (
            name in manifests
            or name not in cfg.run.stages
            or name not in STAGES["report"].after
            or any(dep not in manifests for dep in stage.needs)
        ):
            continue
        directory = RunLayout.of(cfg).stage(name)
        if is_current(directory, fingerprint(cfg, stage, manifests), stage):
            manifests[name] = read_manifest(directory)
    return {name: manifests[name] for name in STAGES if name in manifests}


#: Plots that show private data: written to the owner-only report only, and
#: withdrawn from the published directory when an older version put them there.
OWNER_ONLY_PLOTS = ("corpus.png", *AUDIT_OWNER_ONLY_PLOTS)

_OWNER_HEADER = (
    "> **PRIVATE: owner-only report.** It holds un-noised statistics of the private "
    "corpus and plots with one point per private record. It lives in the run's "
    "private storage, for the data owner, inside the privacy boundary: do not "
    "share, publish, or attach it to a release or to the shareable report."
)


def private_report_dir(cfg: PipelineConfig) -> Path:
    """``<run.out_dir>/<run>/private_report``: the owner-only report, in private storage."""
    return RunLayout.of(cfg).private_report


def _private_dir(cfg: PipelineConfig) -> Path:
    """The owner report's directory, created 0700 (tightened when it already exists)."""
    directory = private_report_dir(cfg)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory


def _write_owner_report(cfg: PipelineConfig, inputs: dict[str, dict[str, Any]]) -> Path:
    """Write the owner-only report (module docstring); returns its ``report.md``."""
    from privcode.pipeline.report_audit import audit_owner_section

    directory = _private_dir(cfg)
    data, audit = inputs.get("data"), inputs.get("audit")
    title = f"{cfg.report.title}: owner-only report"
    lines = [f"# {title}", "", _OWNER_HEADER, "", f"Run `{cfg.run.name}`.", ""]
    lines += _owner_corpus_section(data)
    plots: list[str] = []
    if (
        cfg.report.plots
        and data
        and plot_corpus(data.get("summary", {}).get("counts", {}), directory / "corpus.png")
    ):
        lines += ["![corpus composition](corpus.png)", ""]
        plots.append("corpus.png")
    extra, names = audit_owner_section(
        audit, RunLayout.of(cfg).stage("audit") if audit else None, directory, cfg.report.plots
    )
    lines += extra
    plots += names
    text = "\n".join(lines)
    atomic_write_text(directory / "report.md", text)
    atomic_write_text(directory / "report.html", render_html(text, directory, title))
    keep = {"report.md", "report.html", *plots}
    for path in directory.iterdir():
        if path.is_file() and path.name not in keep and path.suffix == ".png":
            path.unlink()  # a plot of an earlier render that this one no longer shows
    for name in keep:
        os.chmod(directory / name, 0o600)
    return directory / "report.md"


def write_report(
    cfg: PipelineConfig, out_dir: Path, inputs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Write the shareable report into ``out_dir``, publish it, and write the owner-only one.

    ``out_dir`` (the report stage's artifact directory) and the published
    ``<reports_dir>/<run>/`` receive the shareable files only; the owner-only
    report goes to :func:`private_report_dir`. The returned summary is
    ``report.json`` plus ``private_report`` (the owner report's path, for the
    command line; it is not written to ``report.json``).
    """
    given, inputs = set(inputs), _complete_inputs(cfg, inputs)
    data, base = inputs.get("data"), inputs.get("base")
    train = inputs.get("train")
    lines = [f"# {cfg.report.title}", "", f"Run `{cfg.run.name}` (config `{cfg.source}`).", ""]
    lines += ["## Stages", "", "| stage | fingerprint | seconds |", "|---|---|---|"]
    for name, manifest in inputs.items():
        lines.append(
            f"| {name} | `{manifest.get('fingerprint')}` | "
            f"{_fmt(manifest.get('timings', {}).get('seconds'), 1)} |"
        )
    lines.append("")
    lines += _corpus_section(data, train)
    plots: list[str] = []
    lines += _base_section(base)
    if cfg.report.plots and base and plot_base(base.get("summary", {}), out_dir / "base_loss.png"):
        lines += ["![base model loss](base_loss.png)", ""]
        plots.append("base_loss.png")
    lines += _train_section(train)
    if (
        cfg.report.plots
        and train
        and plot_train(train.get("summary", {}), out_dir / "train_loss.png")
    ):
        lines += ["![DP training: public held-out loss](train_loss.png)", ""]
        plots.append("train_loss.png")
    from privcode.pipeline.report_sweep import privacy_utility, sweep_section

    sweep = privacy_utility(cfg, train)
    extra, names = sweep_section(cfg, train, out_dir, cfg.report.plots, data=sweep)
    lines += extra
    plots += names
    synth = inputs.get("synth")
    lines += _synth_section(synth)
    if (
        cfg.report.plots
        and synth
        and plot_synth(synth.get("summary", {}), out_dir / "synth_funnel.png")
    ):
        lines += ["![Stage II funnel](synth_funnel.png)", ""]
        plots.append("synth_funnel.png")
    lines += _premium_section(inputs.get("premium"))
    from privcode.pipeline.report_audit import audit_section, eval_section

    extra, names = eval_section(inputs.get("eval"), out_dir, cfg.report.plots)
    lines += extra
    plots += names
    audit = inputs.get("audit")
    audit_dir = RunLayout.of(cfg).stage("audit") if audit else None
    extra, names = audit_section(audit, audit_dir, out_dir, cfg.report.plots)
    lines += extra
    plots += names
    from privcode.pipeline.report_pac import pac_section

    extra, names = pac_section(inputs.get("pac"), out_dir, cfg.report.plots)
    lines += extra
    plots += names
    leaked = [name for name in plots if name in OWNER_ONLY_PLOTS]
    if leaked:  # a section must never put a per-record plot in the shareable report
        raise AssertionError(f"owner-only plots in the shareable report: {leaked}")
    atomic_write_text(out_dir / "report.md", "\n".join(lines))
    atomic_write_text(
        out_dir / "report.html", render_html("\n".join(lines), out_dir, cfg.report.title)
    )
    summary = {
        "report": str(RunLayout.of(cfg).public_reports / "report.md"),
        "plots": plots,
        "base_heldout_loss": (base or {}).get("summary", {}).get("heldout_loss"),
        "training_records": _training_records(data, train) if data or train else None,
        "train_epsilon": {
            k: (train or {}).get("summary", {}).get(f"epsilon_{k}") for k in ("rdp", "prv")
        }
        if train
        else None,
        "synth_funnel": {
            k: (synth or {}).get("summary", {}).get(k)
            for k in (
                "generated",
                "removed_execution",
                "removed_roundtrip",
                "removed_duplicate",
                "kept",
            )
        }
        if synth
        else None,
        "privacy_utility": sweep,
        # Stages not passed by the runner (privcode report), read from disk.
        "inputs_read_from_disk": [name for name in inputs if name not in given],
    }
    atomic_write_json(out_dir / "report.json", summary)
    publish = RunLayout.of(cfg).public_reports
    publish.mkdir(parents=True, exist_ok=True)
    for name in ["report.md", "report.html", "report.json", *plots]:
        with atomic_path(publish / name) as tmp:
            shutil.copyfile(out_dir / name, tmp)
    for name in OWNER_ONLY_PLOTS:  # published by an older version: withdrawn
        (publish / name).unlink(missing_ok=True)
    owner = _write_owner_report(cfg, inputs)
    return {**summary, "private_report": str(owner)}
