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
        ("PAC", pac and _pac(pac)),
        ("synthesis", synth and _synthesis(synth)),
        ("premium", premium and _premium(premium)),
    )
    lines = _tradeoff(evaluation, audit)
    lines += [(label, text) for label, text in candidates if text]
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


#: Rows of the trade-off table: eval's model names, then the audit's label for the same model.
_ROWS = (("base", "base"), ("junior", "junior"), ("premium", "premium"), ("nondp", "non-DP"))


def _tradeoff(e: EvalSummary | None, a: AuditSummary | None) -> list[tuple[str, str]]:
    """Utility and leakage per model side by side: the first thing a run's summary shows.

    One row per model that the eval or the audit scored: pass@1 with its 95% Wilson
    interval, canaries leaked verbatim, mean canary exposure, the strongest MIA's AUC.
    """
    scores = e.models if e else {}
    audited = dict(_models(a)) if a else {}
    rows = []
    for name, label in _ROWS:
        r, x = scores.get(name) or {}, audited.get(label) or {}
        p1 = (r.get("pass_at_k") or {}).get("pass@1")
        if p1 is None and not x:
            continue
        ci = r.get("pass@1_ci95")
        util = "-" if p1 is None else f"{100 * p1:5.1f}%"
        if ci:
            util += f" [{100 * ci[0]:4.1f}, {100 * ci[1]:4.1f}]"
        can = x.get("canaries") or {}
        leaked = f"{can['leaked']}/{can['total']}" if can.get("total") else "-"
        bits = (x.get("exposure") or {}).get("mean_bits")
        attacks = (x.get("mia") or {}).get("attacks") or {}
        auc = max((v.get("auc") or 0.0 for v in attacks.values()), default=None)
        rows.append(
            f"{label:<8} {util:<22} {leaked:>7} {_f(bits, 1) if bits is not None else '-':>8}"
            f" {f'{auc:.2f}' if auc is not None else '-':>7}"
        )
    if not rows:
        return []
    bench = f"pass@1 {e.benchmark} ({_tasks(e)})" if e else "pass@1"
    head = f"{'model':<8} {bench:<22} {'leaked':>7} {'exposure':>8} {'MIA AUC':>7}"
    return [("trade-off", head)] + [("", row) for row in rows]


def _models(a: AuditSummary) -> list[tuple[str, dict[str, Any]]]:
    """The audited models, private ones first, in one order whether the run audited them
    now or read a manifest back (whose keys are sorted)."""
    models = sorted(a.models.items(), key=lambda kv: (bool(kv[1].get("non_private")), kv[0]))
    return [("non-DP" if r.get("non_private") else name, r) for name, r in models]


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
