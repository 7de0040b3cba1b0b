"""The one-screen summary printed at the end of ``privcode run`` (and ``make demo``).

It reads the stage manifests' public summaries only (aggregates: epsilon,
counts, rates, accuracies, stage durations), never a record, so it may be
printed and logged like the shareable report. A stage that did not run (not
selected, or unchanged and skipped) contributes what its manifest on disk
says; a line whose stage is absent is left out.
"""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass, field
from typing import Any, TypeVar

from privcode.artifacts import ArtifactError, JsonRecord, StageManifest
from privcode.artifacts.premium import PremiumSummary
from privcode.artifacts.summaries import (
    AuditSummary,
    EvalSummary,
    PacSummary,
    SynthSummary,
    TrainSummary,
)

__all__ = ["RunSummary", "run_summary"]

log = logging.getLogger(__name__)
R = TypeVar("R", bound=JsonRecord)


@dataclass(frozen=True)
class RunSummary:
    """What a run produced, in one screen."""

    run: str
    ran: tuple[str, ...]
    skipped: tuple[str, ...]
    seconds: dict[str, float]
    wall_seconds: float = 0.0
    lines: tuple[tuple[str, str], ...] = field(default=())
    report: str | None = None
    private_report: str | None = None

    def format(self) -> str:
        head = (
            f"privcode run '{self.run}' done in {_duration(self.wall_seconds)}: "
            f"{len(self.ran)} stage(s) ran"
            + (f", {len(self.skipped)} unchanged (cached)" if self.skipped else "")
        )
        out = [head, "-" * min(len(head), 78)]
        out += [f"  {label:<10} {text}" for label, text in self.lines]
        if self.ran:
            times = ", ".join(f"{s} {_duration(self.seconds.get(s, 0.0))}" for s in self.ran)
            out += textwrap.wrap(
                times, 78, initial_indent=f"  {'time':<10} ", subsequent_indent=" " * 13
            )
        if self.report:
            out.append(f"  {'report':<10} {self.report} (aggregates only, shareable)")
        if self.private_report:
            out.append(f"  {'private':<10} {self.private_report} (owner only: do not share)")
        return "\n".join(out)


def run_summary(
    run: str,
    stages: dict[str, dict[str, Any]],
    manifests: dict[str, StageManifest],
    wall_seconds: float = 0.0,
) -> RunSummary:
    """The summary of one run from the runner's stage results and manifests.

    Each stage's summary is read as its typed record; one of another shape
    (which the runner would have re-run) loses its line, with a warning.
    """
    train = _read(manifests, "train", TrainSummary)
    synth = _read(manifests, "synth", SynthSummary)
    premium = _read(manifests, "premium", PremiumSummary)
    evaluation = _read(manifests, "eval", EvalSummary)
    audit = _read(manifests, "audit", AuditSummary)
    pac = _read(manifests, "pac", PacSummary)
    candidates = (
        ("privacy", train and _privacy(train)),
        ("synthesis", synth and _synthesis(synth)),
        ("premium", premium and _premium(premium)),
        ("pass@1", evaluation and _pass_at_1(evaluation)),
        ("leakage", audit and _leakage(audit)),
        ("exposure", audit and _exposure(audit)),
        ("MIA", audit and _mia(audit)),
        ("PAC", pac and _pac(pac)),
    )
    lines = [(label, text) for label, text in candidates if text]
    report = manifests["report"].summary if "report" in manifests else {}
    return RunSummary(
        run=run,
        ran=tuple(n for n, r in stages.items() if r.get("status") == "ran"),
        skipped=tuple(n for n, r in stages.items() if r.get("status") == "skipped"),
        seconds={n: float(r.get("seconds") or 0.0) for n, r in stages.items()},
        wall_seconds=float(wall_seconds),
        lines=tuple(lines),
        report=report.get("report"),
        private_report=report.get("private_report"),
    )


# --------------------------------------------------------------------------- lines


def _read(manifests: dict[str, StageManifest], stage: str, record: type[R]) -> R | None:
    """Stage ``stage``'s summary as ``record``; None when absent or of another shape."""
    if stage not in manifests:
        return None
    try:
        return record.from_json(manifests[stage].summary, f"the {stage} stage's summary")
    except ArtifactError as exc:
        log.warning("run summary: leaving out the %s stage (%s)", stage, exc)
        return None


def _privacy(t: TrainSummary) -> str:
    if not t.dp:
        return f"NO DP: method {t.method} (not private)"
    line = (
        f"epsilon {_f(t.epsilon, 2)} of {_f(t.epsilon_budget, 2)} "
        f"(delta {t.delta}, {t.accountant}); {t.steps_taken} steps, "
        f"sigma {_f(t.noise_multiplier, 2)}, {t.method}"
    )
    if t.record_epsilon is not None and t.record_budget is not None:
        line += (
            f"; worst record {_f(t.record_epsilon, 2)} of {_f(t.record_budget, 2)} "
            "over every run (privacy store)"
        )
    return line


def _synthesis(y: SynthSummary) -> str | None:
    if not y.generated:
        return None
    return (
        f"kept {y.kept}/{y.generated} ({y.kept / y.generated:.0%}); removed: "
        f"exec {y.removed_execution}, round-trip {y.removed_roundtrip}, "
        f"dup {y.removed_duplicate}"
    )


def _premium(p: PremiumSummary) -> str:
    loss = f", eval loss {_f(p.curve[-1].get('eval_loss'), 3)}" if p.curve else ""
    guarantee = "DP by post-processing" if p.privacy.dp else "NO DP"
    return f"trained on {p.records} synthetic records{loss} ({guarantee})"


def _pass_at_1(e: EvalSummary) -> str | None:
    if not e.models:
        return None
    cells = [f"{m} {_pct((r.get('pass_at_k') or {}).get('pass@1'))}" for m, r in e.models.items()]
    return ", ".join(cells) + f" ({e.benchmark}, {_tasks(e)} problems)"


def _models(a: AuditSummary) -> list[tuple[str, dict[str, Any]]]:
    """The audited models, private ones first, in one order whether the run audited them
    now or read a manifest back (whose keys are sorted)."""
    models = sorted(a.models.items(), key=lambda kv: (bool(kv[1].get("non_private")), kv[0]))
    return [("non-DP" if r.get("non_private") else name, r) for name, r in models]


def _leakage(a: AuditSummary) -> str | None:
    cells = [
        f"{label} {r['canaries'].get('leaked')}/{r['canaries'].get('total')}"
        for label, r in _models(a)
        if r.get("canaries")
    ]
    return ("canaries leaked: " + ", ".join(cells)) if cells else None


def _exposure(a: AuditSummary) -> str | None:
    cells = [
        f"{label} {_f(r['exposure']['mean_bits'], 1)}"
        for label, r in _models(a)
        if (r.get("exposure") or {}).get("mean_bits") is not None
    ]
    return ("mean canary exposure (bits): " + ", ".join(cells)) if cells else None


def _mia(a: AuditSummary) -> str | None:
    cells = []
    for label, r in _models(a):
        attacks = (r.get("mia") or {}).get("attacks") or {}
        if attacks:  # the strongest attack of each model
            auc = max(x.get("auc") or 0.0 for x in attacks.values())
            tpr = max(x.get("tpr_at_1pct_fpr") or 0.0 for x in attacks.values())
            cells.append(f"{label} {auc:.2f} ({tpr:.0%})")
    return ("AUC (TPR at 1% FPR): " + ", ".join(cells)) if cells else None


def _pac(p: PacSummary) -> str | None:
    acc = p.utility.get("accuracy") or {}
    if not acc:
        return None
    return (
        f"accuracy {_pct(acc.get('pac'))} (one world {_pct(acc.get('world'))}, public "
        f"{_pct(acc.get('public'))}), m={p.m}; {_f(p.leakage.get('charged_nats'), 2)} "
        f"nats/session"
    )


def _tasks(e: EvalSummary) -> Any:
    return next((r.get("n_tasks") for r in e.models.values() if r.get("n_tasks")), "?")


def _f(x: Any, digits: int) -> str:
    if x is None:
        return "n/a"
    return f"{float(x):.{digits}g}" if 0 < abs(float(x)) < 0.1 else f"{float(x):.{digits}f}"


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
