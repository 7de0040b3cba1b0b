"""The report's privacy-utility section, from hand-made manifests (no Ray, no model)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
from conftest import as_manifest, base_summary, full_train_summary
from report_support import report_config

from privcode.artifacts import StageManifest
from privcode.dp.accounting import DPEvent, calibrate, epsilon
from privcode.pipeline.report import write_report
from privcode.pipeline.report_sweep import (
    collect_points,
    plot_privacy_utility,
    sweep_section,
    within_run_curve,
)

DATASET = "ds-" + "a" * 20  # an opaque dataset id (privcode.privacy.store)
DELTA = 1e-5
Q = 16 / 2625
STEPS = 30
PNG = b"\x89PNG\r\n\x1a\n"


@functools.cache
def _sigma(target: float) -> float:
    return calibrate(target, DELTA, Q, STEPS)


def train_summary(
    target: float,
    *,
    dataset: str | None = DATASET,
    method: str = "privcode++",
    dp: bool = True,
    losses=(6.04, 5.90, 5.80, 5.70),
) -> dict:
    """A consistent train summary: sigma calibrated for ``target``, epsilon its RDP value."""
    sigma = _sigma(target)
    eps = epsilon([DPEvent(sigma, Q, STEPS)], DELTA)
    return full_train_summary(
        {
            "dp": dp,
            "method": method,
            "dataset_id": dataset,
            "accountant": "rdp",
            "epsilon": eps if dp else None,
            "epsilon_rdp": eps,
            "epsilon_budget": target,
            "delta": DELTA,
            "noise_multiplier": sigma,
            "sample_rate": Q,
            "steps_taken": STEPS,
            "ledger_steps": STEPS,
            "expected_batch_size": 16,
            "num_records": 2625,
            "public_heldout_loss_curve": [[10 * i, v] for i, v in enumerate(losses)],
        }
    )


def write_manifest(directory: Path, summary: dict, fingerprint: str = "fp", **extra) -> dict:
    manifest = {
        "stage": directory.name,
        "fingerprint": fingerprint,
        "summary": summary,
        "outputs": {},
        "timings": {"seconds": 1.0},
        **extra,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return StageManifest.from_json(manifest)


def eval_summary(junior: float, premium: float | None) -> dict:
    models = {
        "base": {"pass_at_k": {"pass@1": 0.05}, "n_tasks": 40},
        "junior": {"pass_at_k": {"pass@1": junior}, "n_tasks": 40},
    }
    models["premium"] = (
        {"pass_at_k": {"pass@1": premium}, "n_tasks": 40}
        if premium is not None
        else {"skipped": "the premium model's stage is not part of this run"}
    )
    return {"benchmark": "humaneval", "limit": 40, "models": models}


def audit_summary(tpr: float) -> dict:
    attacks = {
        "loss": {"auc": 0.5, "tpr_at_1pct_fpr": 0.5},
        "reference_calibrated": {"auc": 0.52, "tpr_at_1pct_fpr": tpr},
    }
    return {
        "models": {
            "junior": {"mia": {"attacks": attacks}},
            "nondpft": {"mia": {"attacks": {"reference_calibrated": {"tpr_at_1pct_fpr": 0.9}}}},
        }
    }


@pytest.fixture()
def runs(tmp_path) -> Path:
    """demo (eps 4, eval + audit), demo-eps1 (eval), demo-eps8 (stale eval), and the rejects."""
    root = tmp_path / "runs"
    write_manifest(root / "demo" / "train", train_summary(4.0), "fp-demo")
    write_manifest(root / "demo" / "eval", eval_summary(0.10, 0.15), inputs={"train": "fp-demo"})
    write_manifest(root / "demo" / "audit", audit_summary(0.02), inputs={"train": "fp-demo"})
    write_manifest(
        root / "demo-eps1" / "train", train_summary(1.0, losses=(6.04, 6.0, 5.98, 5.95)), "fp-1"
    )
    write_manifest(root / "demo-eps1" / "eval", eval_summary(0.05, None), inputs={"train": "fp-1"})
    write_manifest(
        root / "demo-eps8" / "train", train_summary(8.0, losses=(6.04, 5.8, 5.6, 5.5)), "fp-8"
    )
    # An eval of an older train artifact of this run: its numbers must not be used.
    write_manifest(root / "demo-eps8" / "eval", eval_summary(0.9, 0.9), inputs={"train": "old"})
    write_manifest(root / "othercorpus" / "train", train_summary(2.0, dataset="ds-" + "b" * 20))
    write_manifest(root / "othermethod" / "train", train_summary(2.0, method="dpft"))
    write_manifest(root / "nondp" / "train", train_summary(2.0, dp=False))
    (root / "broken" / "train").mkdir(parents=True)
    (root / "broken" / "train" / "manifest.json").write_text("{not json")
    (root / "nomanifest" / "train").mkdir(parents=True)
    return root


def test_collect_points_keeps_same_corpus_and_method_dp_runs(runs, caplog):
    with caplog.at_level(logging.WARNING, logger="privcode.pipeline.report"):
        points = collect_points(runs, "demo")
    assert [p["run"] for p in points] == ["demo-eps1", "demo", "demo-eps8"]  # by epsilon
    assert str(runs / "broken" / "train" / "manifest.json") in caplog.text
    by_run = {p["run"]: p for p in points}
    for name, target in (("demo-eps1", 1.0), ("demo", 4.0), ("demo-eps8", 8.0)):
        p, s = by_run[name], train_summary(target)
        assert p["epsilon"] == pytest.approx(s["epsilon"])
        assert p["epsilon"] == pytest.approx(target, rel=1e-3)
        assert (p["delta"], p["steps"], p["noise_multiplier"]) == (DELTA, STEPS, _sigma(target))
        assert p["current"] is (name == "demo")
    assert by_run["demo"]["heldout_loss"] == 5.70
    assert by_run["demo-eps1"]["heldout_loss"] == 5.95
    assert (by_run["demo"]["pass1_junior"], by_run["demo"]["pass1_premium"]) == (0.10, 0.15)
    assert by_run["demo"]["mia_tpr_at_1pct_fpr"] == 0.02  # the junior's, reference attack
    assert (by_run["demo-eps1"]["pass1_junior"], by_run["demo-eps1"]["pass1_premium"]) == (
        0.05,
        None,
    )
    assert by_run["demo-eps1"]["mia_tpr_at_1pct_fpr"] is None
    assert by_run["demo-eps8"]["pass1_junior"] is None  # stale eval ignored


def test_collect_points_tolerates_corrupt_eval_and_missing_current(runs, caplog):
    (runs / "demo" / "eval" / "manifest.json").write_text("[1, 2")
    with caplog.at_level(logging.WARNING, logger="privcode.pipeline.report"):
        points = collect_points(runs, "demo")
    assert str(runs / "demo" / "eval" / "manifest.json") in caplog.text
    demo = next(p for p in points if p["run"] == "demo")
    assert demo["pass1_junior"] is None and demo["mia_tpr_at_1pct_fpr"] == 0.02
    assert collect_points(runs, "no-such-run") == []
    # The current run's manifest can be given (it wins over the one on disk).
    other = as_manifest(
        {"fingerprint": "x", "summary": train_summary(2.0, dataset="ds-" + "b" * 20)}
    )
    assert [p["run"] for p in collect_points(runs, "demo", reference=other)] == [
        "demo",
        "othercorpus",
    ]  # equal epsilons: by name


def _dp_accounting_epsilon(q: float, sigma: float, steps: int) -> float:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from privcode.dp.accounting import RDP_ORDERS

    reference = RdpAccountant(orders=list(RDP_ORDERS))
    reference.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return reference.get_epsilon(DELTA)


def test_within_run_curve_is_the_accountants_trajectory():
    s = train_summary(4.0)
    curve = within_run_curve(s)
    assert [c["step"] for c in curve] == [0, 10, 20, 30]
    assert [c["loss"] for c in curve] == [6.04, 5.90, 5.80, 5.70]
    eps = [c["epsilon"] for c in curve]
    assert eps[0] == 0.0
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    sigma = s["noise_multiplier"]
    assert eps[-1] == epsilon([DPEvent(sigma, Q, STEPS)], DELTA, "rdp")
    assert eps[1] == epsilon([DPEvent(sigma, Q, 10)], DELTA, "rdp")
    assert eps[-1] == pytest.approx(s["epsilon_rdp"], rel=1e-9)
    assert eps[-1] == pytest.approx(4.0, rel=1e-3)  # sigma was calibrated for 4
    assert eps[-1] == pytest.approx(_dp_accounting_epsilon(Q, sigma, STEPS), rel=1e-3)
    # The summary's accountant is used: PRV is tighter than RDP here.
    prv = within_run_curve({**s, "accountant": "prv"})
    assert prv[0]["epsilon"] == 0.0 and 0 < prv[-1]["epsilon"] < eps[-1]
    assert within_run_curve({**s, "dp": False}) == []
    assert within_run_curve({**s, "noise_multiplier": 0.0}) == []  # refused, not a crash


def test_plot_privacy_utility_writes_a_png(runs, tmp_path):
    points = collect_points(runs, "demo")
    within = within_run_curve(train_summary(4.0))
    path = tmp_path / "pu.png"
    assert plot_privacy_utility(points, within, path)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000
    one = tmp_path / "one.png"
    assert plot_privacy_utility(points[1:2], within, one)  # one run, no pass@1 panel
    assert one.read_bytes()[:8] == PNG
    assert not plot_privacy_utility([], [], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_sweep_section_table(runs, tmp_path):
    cfg = report_config(tmp_path)
    train = StageManifest.read(runs / "demo" / "train" / "manifest.json")
    out = tmp_path / "out"
    out.mkdir()
    lines, names = sweep_section(cfg, train, out, True)
    text = "\n".join(lines)
    assert lines[0] == "### Privacy-utility"
    assert (
        "| run | epsilon | steps | sigma | held-out loss | pass@1 junior % | pass@1 premium % "
        "| MIA TPR@1%FPR % |" in text
    )
    rows = [line for line in lines if line.startswith("| demo")]
    s1, s4, s8 = (train_summary(t) for t in (1.0, 4.0, 8.0))
    assert rows == [
        f"| demo-eps1 | {s1['epsilon']:.3f} | 30 | {s1['noise_multiplier']:.4g} | 5.9500 | 5.0 "
        "| n/a | n/a |",
        f"| demo (this run) | {s4['epsilon']:.3f} | 30 | {s4['noise_multiplier']:.4g} | 5.7000 "
        "| 10.0 | 15.0 | 2.0 |",
        f"| demo-eps8 | {s8['epsilon']:.3f} | 30 | {s8['noise_multiplier']:.4g} | 5.5000 | n/a "
        "| n/a | n/a |",
    ]
    assert "othercorpus" not in text and "broken" not in text and "make sweep" not in text
    assert names == ["privacy_utility.png"]
    assert (out / "privacy_utility.png").read_bytes()[:8] == PNG
    # Plots off: the table, no image.
    lines, names = sweep_section(cfg, train, out, False)
    assert names == [] and not any("privacy_utility.png" in line for line in lines)


def test_sweep_section_single_run_explains_make_sweep(tmp_path):
    cfg = report_config(tmp_path)
    train = write_manifest(tmp_path / "runs" / "demo" / "train", train_summary(4.0))
    lines, names = sweep_section(cfg, train, tmp_path, False)
    text = "\n".join(lines)
    assert 'make sweep EPSILONS="1 8"' in text and "`demo-eps1`" in text
    assert "| run | epsilon" not in text
    assert sweep_section(cfg, None, tmp_path, False) == ([], [])
    nondp = sweep_section(
        cfg, as_manifest({"summary": train_summary(4.0, dp=False)}), tmp_path, False
    )[0]
    assert "no DP guarantee" in "\n".join(nondp)


def _upstream(tmp_path):
    data = {
        "stage": "data",
        "fingerprint": "fp-data",
        "summary": {"counts": {"records": 100, "canaries": 5}},
        "timings": {"seconds": 1},
    }
    base = {
        "stage": "base",
        "fingerprint": "fp-base",
        "timings": {"seconds": 2},
        "summary": base_summary(tmp_path / "base"),
    }
    return as_manifest(data, "data"), as_manifest(base, "base")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else None]


def test_write_report_includes_the_section(runs, tmp_path):
    cfg = report_config(tmp_path, "run.stages=[data, base, train, report]")
    data, base = _upstream(tmp_path)
    train = StageManifest.read(runs / "demo" / "train" / "manifest.json")
    out = tmp_path / "stage"
    out.mkdir()
    summary = write_report(cfg, out, {"data": data, "base": base, "train": train})
    text = (tmp_path / "reports" / "demo" / "report.md").read_text()
    assert "### Privacy-utility" in _section(text, "## DP training (Stage I)")
    assert "| demo-eps8 |" in text
    assert "privacy_utility.png" in summary["plots"]
    assert (tmp_path / "reports" / "demo" / "privacy_utility.png").read_bytes()[:8] == PNG
    saved = json.loads((out / "report.json").read_text())
    assert [p["run"] for p in saved["privacy_utility"]["runs"]] == [
        "demo-eps1",
        "demo",
        "demo-eps8",
    ]
    assert saved["privacy_utility"]["within_run"][0] == {"step": 0, "epsilon": 0.0, "loss": 6.04}
    # Without a train stage there is no section and no key content.
    bare = write_report(cfg, out, {"data": data, "base": base})
    assert bare["privacy_utility"] is None
    assert "Privacy-utility" not in (out / "report.md").read_text()


def test_report_alone_gets_current_upstream_manifests_from_the_runner(tmp_path):
    """`privcode run --stages report`: the runner passes the configured stages that are current."""
    from privcode.pipeline.runner import current_optional_inputs, fingerprint
    from privcode.pipeline.stages import STAGES
    from privcode.privacy.store import PrivacyStore

    cfg = report_config(tmp_path, "run.stages=[data, base, train, report]")
    data, base = _upstream(tmp_path)
    upstream = {"data": data, "base": base}
    corpus = tmp_path / "train.parquet"
    corpus.write_bytes(b"stand-in corpus")
    from conftest import init_store

    store = init_store(tmp_path / "privacy-store")
    summary = {
        **train_summary(4.0, dataset=PrivacyStore(store).dataset_id(corpus)),
        "data_path": str(corpus),
        "privacy_store": str(store),
    }
    fp = fingerprint(cfg, STAGES["train"], upstream)
    train_dir = tmp_path / "runs" / "demo" / "train"
    write_manifest(train_dir, summary, fp)
    order = ["data", "base", "report"]
    found = current_optional_inputs(cfg, STAGES["report"], upstream, order)
    assert list(found) == ["train"] and found["train"].fingerprint == fp
    out = tmp_path / "stage"
    out.mkdir()
    write_report(cfg, out, {**upstream, **found})
    text = (out / "report.md").read_text()
    assert "## DP training (Stage I)" in text and "### Privacy-utility" in text
    # A stale train artifact (another config's fingerprint) is not used ...
    write_manifest(train_dir, summary, "other-fingerprint")
    assert current_optional_inputs(cfg, STAGES["report"], upstream, order) == {}
    # ... nor one this invocation runs itself, nor one of a stage the config does not run.
    write_manifest(train_dir, summary, fp)
    assert current_optional_inputs(cfg, STAGES["report"], upstream, [*order, "train"]) == {}
    cfg = report_config(tmp_path, "run.stages=[data, base, report]")
    assert current_optional_inputs(cfg, STAGES["report"], upstream, order) == {}


def test_runs_without_a_dataset_id_are_grouped_with_nothing(runs):
    """An older train summary (a corpus digest, no dataset id) is never compared by digest."""
    legacy = {**train_summary(2.0, dataset=None), "corpus_sha256": "c" * 64}
    write_manifest(runs / "legacy-a" / "train", legacy)
    write_manifest(runs / "legacy-b" / "train", legacy)
    assert "legacy-a" not in [p["run"] for p in collect_points(runs, "demo")]
    assert collect_points(runs, "legacy-a") == []  # not even with its same-digest twin
    assert (
        collect_points(runs, "demo", reference=as_manifest({"fingerprint": "x", "summary": legacy}))
        == []
    )


def test_no_corpus_digest_in_the_written_report(runs, tmp_path):
    """A train summary carrying ``corpus_sha256`` (older versions) is refused by its type;
    other runs' legacy manifests never put it, or any 8+ character prefix of it, in a
    report file (shareable or owner-only); the dataset id is shown."""
    import hashlib

    from privcode.artifacts import ArtifactError

    digest = hashlib.sha256(b"the private corpus").hexdigest()
    cfg = report_config(tmp_path, "run.stages=[data, base, train, report]")
    data, base = _upstream(tmp_path)
    train = StageManifest.read(runs / "demo" / "train" / "manifest.json")
    legacy = as_manifest({"summary": {**train.summary, "corpus_sha256": digest}}, "train")
    out = tmp_path / "stage"
    out.mkdir()
    with pytest.raises(ArtifactError, match=r"unknown keys \['corpus_sha256'\]"):
        write_report(cfg, out, {"data": data, "base": base, "train": legacy})
    write_manifest(runs / "legacy-c" / "train", {**train.summary, "corpus_sha256": digest})
    summary = write_report(cfg, out, {"data": data, "base": base, "train": train})
    files = [
        p
        for d in (out, tmp_path / "reports" / "demo", Path(summary["private_report"]).parent)
        for p in d.rglob("*")
        if p.is_file()
    ]
    assert {p.name for p in files} >= {"report.md", "report.html", "report.json"}
    for path in files:
        blob = path.read_bytes().lower()
        assert not any(digest[i : i + 8].encode() in blob for i in range(len(digest) - 7)), path
    text = (out / "report.md").read_text()
    assert f"`{DATASET}`" in _section(text, "### Privacy-utility")
    assert "sha256" not in text.lower()
