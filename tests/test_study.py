"""The study's table generator: manifests of a tiny study in, docs/results.md out."""

from __future__ import annotations

import pytest

from privcode.artifacts import StageManifest
from privcode.eval.passk import wilson_interval
from privcode.layout import RunLayout
from privcode.pipeline.study import collect, directions, render, write_results

TASKS = 300


def _model(passed: int, also: int | None = None) -> dict:
    lo, hi = wilson_interval(passed, TASKS)
    r = {"pass_at_k": {"pass@1": passed / TASKS}, "n_tasks": TASKS, "pass@1_ci95": [lo, hi]}
    if also is not None:
        r["also"] = {
            "humaneval": {
                "pass_at_k": {"pass@1": also / 164},
                "n_tasks": 164,
                "pass@1_ci95": list(wilson_interval(also, 164)),
            }
        }
    return r


def _audited(leaked: int, bits: float, auc: float, **extra) -> dict:
    return {
        "canaries": {"leaked": leaked, "total": 12},
        "exposure": {"mean_bits": bits},
        "mia": {"attacks": {"loss": {"auc": auc}, "reference_calibrated": {"auc": auc - 0.01}}},
        **extra,
    }


def _write(root, run: str, eps: float | None, models: dict, audit: dict) -> None:
    layout = RunLayout(root, run)
    for stage, summary in (
        (
            "train",
            {"dp": eps is not None, "epsilon": eps, "steps_taken": 30, "noise_multiplier": 0.5},
        ),
        ("eval", {"benchmark": "acme", "benchmark_file": "", "limit": 0, "models": models}),
        ("audit", {"models": audit, "audits": ["canaries", "exposure", "mia"], "seconds": 1.0}),
    ):
        layout.stage(stage).mkdir(parents=True, exist_ok=True)
        StageManifest(stage, f"fp-{run}-{stage}", summary).write(layout.manifest(stage))


@pytest.fixture()
def study(tmp_path):
    """eps 1 and 8 (junior learns at 8), the demo run with base and non-DP."""
    _write(
        tmp_path,
        "study-eps1",
        1.0,
        {"junior": _model(3, 0), "premium": _model(6, 0)},
        {"junior": _audited(0, 1.2, 0.51), "premium": _audited(0, 1.3, 0.50)},
    )
    _write(
        tmp_path,
        "study-eps8",
        8.0,
        {"junior": _model(60, 1), "premium": _model(75, 1)},
        {"junior": _audited(0, 1.5, 0.53), "premium": _audited(0, 1.4, 0.52)},
    )
    _write(
        tmp_path,
        "demo",
        4.0,
        {"base": _model(2, 0), "junior": _model(30), "nondp": _model(130, 2)},
        {
            "junior": _audited(0, 1.4, 0.52),
            "nondpft": _audited(5, 4.0, 0.71, non_private=True),
        },
    )
    return tmp_path


def test_collect_orders_by_epsilon_and_reads_numbers(study):
    points = collect(study, ["demo", "study-eps8", "study-eps1", "missing"])
    assert [p.epsilon for p in points] == [1.0, 4.0, 8.0]
    eps8 = points[-1].models
    assert eps8["junior"].pass1 == pytest.approx(0.2)
    assert eps8["junior"].general == pytest.approx(1 / 164)
    assert eps8["junior"].ci == pytest.approx(wilson_interval(60, TASKS))
    assert points[1].models["nondp"].leaked == 5
    assert points[1].models["nondp"].mia_auc == pytest.approx(0.71)  # the strongest attack


def test_directions_judged_by_disjoint_intervals(study):
    found = {
        d.claim.split(" (")[0]: d
        for d in directions(collect(study, ["demo", "study-eps1", "study-eps8"]))
    }
    assert found["utility grows with epsilon"].reproduced is True  # 1% [0.3, 2.9] vs 20%
    assert found["the DP junior learns from the private code"].reproduced is True
    assert found["DP costs utility"].reproduced is True  # 43% vs 20%
    leak = found["the non-DP model leaks canaries verbatim, the DP models none"]
    assert leak.reproduced is True and "non-DP 5/12" in leak.reason
    premium = next(d for d in found.values() if d.claim.startswith("the premium model"))
    assert premium.reproduced is True


def test_overlapping_intervals_are_not_reproduced(tmp_path):
    for run, eps, passed in (("a", 1.0, 10), ("b", 8.0, 14)):  # 3.3% vs 4.7%: overlap
        _write(tmp_path, run, eps, {"junior": _model(passed)}, {"junior": _audited(0, 1.0, 0.5)})
    d = directions(collect(tmp_path, ["a", "b"]))[0]
    assert d.reproduced is False and "overlap" in d.reason


def test_results_markdown_and_plot(study):
    path = write_results(study, ["demo", "study-eps1", "study-eps8"], study / "docs" / "results.md")
    text = path.read_text()
    assert (study / "docs" / "results_privacy_utility.png").stat().st_size > 1000
    assert "pass@1 acme [95% CI]" in text and "pass@1 humaneval %" in text
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("|")
    ]
    assert ["8", "DP junior", "30 steps, sigma 0.50", "20.0% [15.9, 24.9]", "0.6"] == rows[
        rows.index(next(r for r in rows if r[:2] == ["8", "DP junior"]))
    ][:5]
    assert "none (NOT PRIVATE)" in text and "reproduced" in text
    assert text.count("| base |") == 1  # base and non-DP once, from the run that scored them
    ref = collect(study, ["study-eps1", "study-eps8"], reference="demo")
    assert [p.epsilon for p in ref] == [1.0, 8.0, None]
    assert set(ref[-1].models) == {"base", "nondp"}
    assert [d.reproduced for d in directions(ref)][:3] == [True, True, True]
    md = render(collect(study, ["study-eps1"]), [], None)
    assert "DP junior" in md and "non-DP" not in md


def test_report_shows_the_general_yardstick_beside_the_domain(tmp_path):
    from privcode.pipeline.report_audit import eval_section

    models = {"junior": _model(60, 3), "nondp": {**_model(130), "non_private": True}}
    summary = {"benchmark": "acme", "benchmark_file": "", "limit": 0, "models": models}
    lines, _ = eval_section(StageManifest("eval", "fp", summary), tmp_path, plots=False)
    text = "\n".join(lines)
    assert "junior (humaneval)" in text and "1.8" in text  # 3 of 164
    assert "NOT PRIVATE" in text
