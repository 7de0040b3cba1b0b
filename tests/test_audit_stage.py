"""The eval and audit stages in a real pipeline run, and the report they feed.

A tiny run (60 records, the ``ci`` base, 4 DP steps) goes through data, base,
train, eval, audit (with the non-DP comparison), pac (4 worlds) and report on the session's
Ray cluster (conftest's ``tiny_pipeline``: the same run serves tests/test_train.py).
The assertions are about what crosses the privacy boundary: the audit summary,
the report and its HTML hold aggregates only (no canary value, no record text),
the detail files holding private values stay in the audit directory with mode
0600, and the numbers are in their ranges.

The demo-scale replication (in-place canaries in 5% of the records: the non-DP
``nondpft``'s exposure grows with a canary's repetitions and is far above the
DP junior's, which leaks none; the DP run's membership signal is weaker) is the
slow test at the end: ``make test-all``.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from conftest import init_store, tiny_pipeline_overrides

from privcode.config import load_config


@pytest.fixture(scope="module")
def tiny_run(tiny_pipeline):
    """The session's tiny pipeline run (conftest ``tiny_pipeline``, shared with
    tests/test_train.py): ``(root, result)``."""
    return tiny_pipeline


def _secrets(root: Path) -> list[str]:
    canaries = json.loads((root / "runs/t/data/canaries.json").read_text())["canaries"]
    return [c["value"] for c in canaries]


def test_eval_and_audit_stages_run_and_report(tiny_run):
    root, result = tiny_run
    assert {k: v["status"] for k, v in result["stages"].items()} == {
        s: "ran" for s in ("data", "base", "train", "eval", "audit", "pac", "report")
    }
    audit = json.loads((root / "runs/t/audit/audit.json").read_text())
    assert set(audit["models"]) == {"junior", "nondpft"}
    assert audit["models"]["nondpft"]["non_private"] is True
    for name, model in audit["models"].items():
        c = model["canaries"]
        assert c["total"] == 2 * 1 * 1 and 0 <= c["leaked"] <= c["total"]  # kinds x places x reps
        assert sum(cell["categories"] for cell in c["table"]) == c["total"]
        e = model["exposure"]
        assert 0 <= e["mean_bits"] <= e["max_possible_bits"] <= 4.4  # log2(21)
        for attack in ("loss", "reference_calibrated"):
            r = model["mia"]["attacks"][attack]
            assert 0.0 <= r["auc"] <= 1.0 and 0.0 <= r["tpr_at_1pct_fpr"] <= 1.0
        assert model["mia"]["violated"] is False, name
    assert 0 < audit["dp_bound"]["epsilon"] <= 4.0
    assert (root / "runs/t/audit/mia_roc.png").stat().st_size > 1000

    report = (root / "reports/t/report.md").read_text()
    for heading in (
        "## Utility: pass@k",
        "## Privacy audits",
        "### Canary leakage",
        "### Exposure",
        "### Membership inference",
    ):
        assert heading in report
    assert "![membership inference ROC](mia_roc.png)" in report
    html = (root / "reports/t/report.html").read_text()
    assert "<table>" in html and "data:image/png;base64," in html
    evaluation = json.loads((root / "runs/t/eval/junior.json").read_text())
    assert evaluation["n_tasks"] == 3 and 0.0 <= evaluation["pass_at_k"]["pass@1"] <= 1.0


def test_pac_stage_trains_worlds_and_measures_them(tiny_run):
    root, result = tiny_run
    pac = json.loads((root / "runs/t/pac/manifest.json").read_text())
    assert pac["private"] is True
    s = pac["summary"]
    assert s["m"] == 4 and s["worlds"]["m"] == 4 and s["worlds"]["steps"] == 4
    assert len(list((root / "runs/t/pac/worlds/adapters").iterdir())) == 4
    u, leak = s["utility"], s["leakage"]
    assert u["positions"] == 24 and all(0 <= a <= 1 for a in u["accuracy"].values())
    assert 0 <= u["unanimity_rate"] <= 1
    assert leak["sessions"] == 3 and leak["tokens"] == 8
    assert leak["charged_nats"] == pytest.approx(
        s["budget"]["b"] * leak["mean_private_tokens"], rel=1e-2
    )  # the mean is rounded
    assert leak["measured_nats"] >= 0 and 0.5 <= leak["mia_bound"] <= 1
    assert leak["measured_nats"] <= leak["charged_nats"] + 3 * leak["measured_nats_se"] + 1e-12
    em = s["canary_emission"]
    assert em["canaries"] == 2 and em["tokens"] == 8
    assert all(0 <= v <= 2 for v in em["emitted"].values())
    report = (root / "reports/t/report.md").read_text()
    assert "## PAC-private generation (served ensemble)" in report
    assert "Content is not protected" in report
    assert "![PAC-private generation](pac.png)" in report and "WARNING" not in report
    assert (root / "reports/t/pac.png").stat().st_size > 1000


def test_models_audited_in_ray_tasks_side_by_side_match_one_after_another(
    tiny_run, ci_base_cache, tmp_path, caplog
):
    """``audit.cpus_per_model``: each model in its own Ray task; the same numbers as the
    stage's in-process audit of the tiny run (one model after another)."""
    from privcode.audit.run import _fidelity, run_audits

    root, _ = tiny_run
    cfg = load_config(
        "jobs/configs/demo.yaml",
        [
            *tiny_pipeline_overrides(root, ci_base_cache),
            "audit.cpus_per_model=1",
            "audit.audits=[canaries,exposure,mia,fidelity,probe]",
            "audit.probe_models=[nondpft]",
            "audit.probe_scenarios=[game]",
            "audit.probe_max_tokens=8",
        ],
    )
    t = root / "runs/t"
    run = {
        "canaries": t / "data/canaries.json",
        "train": t / "data/train.parquet",
        "heldout": t / "data/heldout.parquet",
        "base": Path(json.loads((t / "base/manifest.json").read_text())["summary"]["path"]),
        "release": t / "train/release",
        "synthetic": t / "data/heldout.parquet",
    }
    models = {"junior": t / "train/release", "nondpft": t / "audit/nondpft"}
    checks = []  # a model still being written: the others first, one task at a time

    def junior_ready(timeout):
        checks.append((timeout, caplog.text.count("(Ray task)")))
        return "auditing nondpft (Ray task)" in caplog.text  # "written" once nondpft started

    with caplog.at_level("INFO", logger="privcode.audit"):
        side_by_side = run_audits(cfg, tmp_path, run, models, pending={"junior": junior_ready})
    assert checks[0] == (0, 0)  # never blocks while another model can be audited
    log = caplog.text
    assert (
        log.index("auditing <fidelity> (Ray task: fidelity)")
        < log.index("auditing nondpft (Ray task)")
        < log.index("auditing junior (Ray task)")
    )
    assert "auditing nondpft (Ray task: probe)" in log
    probe = side_by_side["models"]["nondpft"]["probe"]  # its own task, merged into the model's
    assert probe["per_category"]["all"]["responses"] == 2 * 2  # game: 2 questions x 2 tests
    assert "probe" not in side_by_side["models"]["junior"]
    # Fidelity in a task of its own (the held-out records stand in for synthetic code).
    in_process = _fidelity(cfg, run, tmp_path / "in_process")
    for key in ("n_synthetic", "n_private", "bleu4", "centroid_cosine"):
        assert side_by_side["fidelity"][key] == pytest.approx(in_process[key], abs=1e-6)
    sequential = json.loads((t / "audit/audit.json").read_text())
    assert list(side_by_side["models"]) == ["junior", "nondpft"]
    for name, one in sequential["models"].items():
        other = side_by_side["models"][name]
        assert other["canaries"]["leaked"] == one["canaries"]["leaked"]
        assert other["exposure"]["mean_bits"] == pytest.approx(
            one["exposure"]["mean_bits"], abs=1e-3
        )
        for attack, r in one["mia"]["attacks"].items():
            assert other["mia"]["attacks"][attack]["auc"] == pytest.approx(r["auc"], abs=1e-3)
    assert (tmp_path / "private/junior/canaries_private.json").is_file()
    assert (tmp_path / "mia_roc.png").stat().st_size > 1000


def test_nothing_private_leaves_the_audit_directory(tiny_run):
    root, _ = tiny_run
    secrets = _secrets(root)
    assert secrets and all(len(s) >= 8 for s in secrets)
    public = [
        root / "runs/t/audit/audit.json",
        root / "runs/t/audit/manifest.json",
        root / "runs/t/pac/manifest.json",
        root / "runs/t/pac/pac_eval.json",
        *sorted((root / "reports/t").iterdir()),
    ]
    for path in public:
        if path.suffix in (".json", ".md", ".html"):
            text = path.read_text()
            assert not [s for s in secrets if s in text], path
    details = [
        root / "runs/t/audit/private/junior/canaries_private.json",
        root / "runs/t/audit/private/nondpft/canaries_private.json",
    ]
    for path in details:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert json.loads((root / "runs/t/audit/manifest.json").read_text())["private"] is True


@pytest.mark.slow
def test_demo_scale_replication(ray_connected, tmp_path):
    """The demo config's models and audits on the stdlib demo corpus (its data settings pinned
    here: 1000 records, 900 members) with every canary row it may hold (5%, in place): 5
    kinds, joint placement, 1 and 8 repetitions = 10 canaries in 45 records. The non-DP
    comparison (every weight, 400 steps of batch 16: a member is drawn about 7 times,
    a canary of 8 repetitions about 57) ranks the 8-repetition canaries first among their
    candidates, well above the 1-repetition ones and the DP junior's; PrivCode++ at epsilon
    4 leaks no canary, its exposure stays at chance and its membership signal is weaker.
    Measured (5-6 minutes on 2 busy CPUs): nondpft 7.65 of 7.65 bits at 8 repetitions, 4.9
    at 1, MIA AUC 0.82, TPR at 1% FPR 30%; the junior 1.0-1.1 and 1.6 bits, AUC 0.53, TPR
    0-2%. Neither leaks a value verbatim: the former 100-repetition copies leaked after about
    500 draws, which at 8 repetitions would take ~3,500 steps."""
    from privcode.pipeline.runner import run_pipeline

    overrides = [
        f"run.out_dir={tmp_path / 'runs'}",
        f"run.reports_dir={tmp_path / 'reports'}",
        f"privacy.store={init_store(tmp_path / 'privacy-store')}",
        "run.name=replication",
        "run.stages=[data, base, train, audit, report]",
        "data.source=demo",
        "data.size=1000",
        "data.include_humaneval=false",
        "data.pii_fraction=0.3",
        "data.canary_kinds=[email, name, ip_address, password, username]",
        "data.canary_placements=[joint]",
        "data.canary_repetitions=[1, 8]",
        "audit.audits=[canaries, exposure, mia]",
        "audit.nondp_steps=400",
        "audit.nondp_lr=0.003",
        "audit.nondp_batch_size=16",
        "audit.canary_samples=4",
        "audit.exposure_candidates=200",
    ]
    run_pipeline(load_config("jobs/configs/demo.yaml", overrides))
    runs = tmp_path / "runs/replication"
    counts = json.loads((runs / "data/manifest.json").read_text())["summary"]["counts"]
    # In place: the canaries add no row; 45 of the 900 training records carry one (5%).
    assert (counts["train_records"], counts["canary_records"], counts["canaries"]) == (900, 45, 10)
    audit = json.loads((runs / "audit/audit.json").read_text())
    dp, nondp = audit["models"]["junior"], audit["models"]["nondpft"]
    assert dp["canaries"]["leaked"] == 0 and dp["canaries"]["total"] == 10
    top = dp["exposure"]["max_possible_bits"]  # log2(201) = 7.65 bits
    dp_bits, nondp_bits = dp["exposure"]["by_cell"]["joint"], nondp["exposure"]["by_cell"]["joint"]
    assert nondp_bits["8"] > 0.85 * top  # (nearly) every 8-repetition canary ranked first
    assert nondp_bits["8"] > nondp_bits["1"] + 1.0  # more repetitions, more exposure
    assert nondp_bits["8"] > dp_bits["8"] + 3.0
    assert dp["exposure"]["mean_bits"] < 3.0  # chance is about 1.4 bits
    assert nondp["exposure"]["top_rank_count"] >= 4 > dp["exposure"]["top_rank_count"]
    dp_mia, nondp_mia = dp["mia"]["attacks"]["loss"], nondp["mia"]["attacks"]["loss"]
    assert dp_mia["auc"] < 0.65 < nondp_mia["auc"]
    assert dp_mia["tpr_at_1pct_fpr"] < nondp_mia["tpr_at_1pct_fpr"]


def test_report_command_rerenders_from_the_manifests_on_disk(
    tiny_run, ci_base_cache, capsys, tmp_path
):
    """`privcode report` runs the report stage alone (forced) and still shows every stage."""
    import shutil

    from privcode.cli import main

    # On a copy of the run: the shared run keeps the report its pipeline run wrote (a report
    # rendered alone records other inputs, so a rerun of the pipeline would redo it).
    # The store is not copied: a store is one directory (a copy is refused); the copy's
    # config names the run's own.
    for name in ("runs", "reports"):
        shutil.copytree(tiny_run[0] / name, tmp_path / name, symlinks=True)
    root = tmp_path
    before = json.loads((root / "runs/t/report/manifest.json").read_text())["timings"]["started"]
    args = ["report", "--config", "jobs/configs/demo.yaml"]
    for override in tiny_pipeline_overrides(root, ci_base_cache):
        args += ["--set", override]
    args += ["--set", f"privacy.store={tiny_run[0] / 'privacy-store'}"]
    assert main(args) == 0
    out = capsys.readouterr().out  # the end-of-run summary
    assert f"report     {root / 'reports/t/report.md'} (aggregates only, shareable)" in out
    assert f"private    {root / 'runs/t/private_report/report.md'} (owner only" in out
    manifest = json.loads((root / "runs/t/report/manifest.json").read_text())
    assert manifest["timings"]["started"] > before
    # The runner passed the configured stages that are current on disk.
    assert set(manifest["inputs"]) == {"data", "base", "train", "eval", "audit", "pac"}
    report = (root / "reports/t/report.md").read_text()
    for heading in ("## Utility: pass@k", "### Membership inference", "### Privacy-utility"):
        assert heading in report
