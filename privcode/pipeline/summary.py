"""The one-screen summary printed at the end of ``privcode run`` (and ``make demo``).

It reads the stage manifests' public summaries only (aggregates: epsilon,
counts, rates, accuracies, stage durations), never a record, so it may be
printed and logged like the shareable report. A stage that did not run (not
selected, or unchanged and skipped) contributes what its manifest on disk
says; a line whose stage is absent is left out.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from privcode.artifacts import StageManifest

__all__ = ["RunSummary", "run_summary"]


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
    """The summary of one run from the runner's stage results and manifests."""
    s = {name: m.summary for name, m in manifests.items()}
    lines: list[tuple[str, str]] = []
    for label, make in (
        ("privacy", _privacy),
        ("synthesis", _synthesis),
        ("premium", _premium),
        ("pass@1", _pass_at_1),
        ("leakage", _leakage),
        ("exposure", _exposure),
        ("MIA", _mia),
        ("PAC", _pac),
    ):
        text = make(s)
        if text:
            lines.append((label, text))
    report = s.get("report", {})
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


def _privacy(s: dict[str, dict[str, Any]]) -> str | None:
    t = s.get("train")
    if not t:
        return None
    if not t.get("dp", True):
        return f"NO DP: method {t.get('method')} (not private)"
    return (
        f"epsilon {_f(t.get('epsilon'), 2)} of {_f(t.get('epsilon_budget'), 2)} "
        f"(delta {t.get('delta')}, {t.get('accountant')}); {t.get('steps_taken')} steps, "
        f"sigma {_f(t.get('noise_multiplier'), 2)}, {t.get('method')}"
    )


def _synthesis(s: dict[str, dict[str, Any]]) -> str | None:
    y = s.get("synth")
    if not y or not y.get("generated"):
        return None
    return (
        f"kept {y['kept']}/{y['generated']} ({y['kept'] / y['generated']:.0%}); removed: "
        f"exec {y.get('removed_execution', 0)}, round-trip {y.get('removed_roundtrip', 0)}, "
        f"dup {y.get('removed_duplicate', 0)}"
    )


def _premium(s: dict[str, dict[str, Any]]) -> str | None:
    p = s.get("premium")
    if not p:
        return None
    curve = p.get("curve") or []
    loss = f", eval loss {_f(curve[-1].get('eval_loss'), 3)}" if curve else ""
    guarantee = "DP by post-processing" if (p.get("privacy") or {}).get("dp") else "NO DP"
    return f"trained on {p.get('records')} synthetic records{loss} ({guarantee})"


def _pass_at_1(s: dict[str, dict[str, Any]]) -> str | None:
    e = s.get("eval")
    if not e or not e.get("models"):
        return None
    cells = [
        f"{m} {_pct((r.get('pass_at_k') or {}).get('pass@1'))}" for m, r in e["models"].items()
    ]
    return ", ".join(cells) + f" ({e.get('benchmark')}, {_tasks(e)} problems)"


def _models(s: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The audited models, private ones first, in one order whether the run audited them
    now or read a manifest back (whose keys are sorted)."""
    a = s.get("audit") or {}
    models = sorted(
        (a.get("models") or {}).items(), key=lambda kv: (bool(kv[1].get("non_private")), kv[0])
    )
    return [("non-DP" if r.get("non_private") else name, r) for name, r in models]


def _leakage(s: dict[str, dict[str, Any]]) -> str | None:
    cells = [
        f"{label} {r['canaries'].get('leaked')}/{r['canaries'].get('total')}"
        for label, r in _models(s)
        if r.get("canaries")
    ]
    return ("canaries leaked: " + ", ".join(cells)) if cells else None


def _exposure(s: dict[str, dict[str, Any]]) -> str | None:
    cells = [
        f"{label} {_f(r['exposure']['mean_bits'], 1)}"
        for label, r in _models(s)
        if (r.get("exposure") or {}).get("mean_bits") is not None
    ]
    return ("mean canary exposure (bits): " + ", ".join(cells)) if cells else None


def _mia(s: dict[str, dict[str, Any]]) -> str | None:
    cells = []
    for label, r in _models(s):
        attacks = (r.get("mia") or {}).get("attacks") or {}
        if attacks:  # the strongest attack of each model
            auc = max(x.get("auc") or 0.0 for x in attacks.values())
            tpr = max(x.get("tpr_at_1pct_fpr") or 0.0 for x in attacks.values())
            cells.append(f"{label} {auc:.2f} ({tpr:.0%})")
    return ("AUC (TPR at 1% FPR): " + ", ".join(cells)) if cells else None


def _pac(s: dict[str, dict[str, Any]]) -> str | None:
    p = s.get("pac")
    u = (p or {}).get("utility") or {}
    acc = u.get("accuracy") or {}
    if not acc:
        return None
    leak = p.get("leakage") or {}
    return (
        f"accuracy {_pct(acc.get('pac'))} (one world {_pct(acc.get('world'))}, public "
        f"{_pct(acc.get('public'))}), m={p.get('m')}; {_f(leak.get('charged_nats'), 2)} "
        f"nats/session"
    )


def _tasks(e: dict[str, Any]) -> Any:
    return next((r.get("n_tasks") for r in e["models"].values() if r.get("n_tasks")), "?")


def _f(x: Any, digits: int) -> str:
    if x is None:
        return "n/a"
    return f"{float(x):.{digits}g}" if 0 < abs(float(x)) < 0.1 else f"{float(x):.{digits}f}"


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
