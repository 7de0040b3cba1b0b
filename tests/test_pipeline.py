"""The pipeline runner on the session Ray cluster: stages, manifests, skipping, report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import init_store

from privcode.config import load_config
from privcode.errors import PrivcodeError
from privcode.pipeline.runner import read_manifest, run_pipeline
from privcode.utils import sha256_file

pytestmark = pytest.mark.ray


@pytest.fixture()
def overrides(tmp_path, ci_base_cache):
    return [
        f"run.out_dir={tmp_path / 'runs'}",
        f"run.reports_dir={tmp_path / 'reports'}",
        f"privacy.store={init_store(tmp_path / 'privacy-store')}",  # the pac stage names data
        "run.name=t",
        # The train stage has its own tests (tests/test_train.py).
        "run.stages=[data, base, report]",
        "data.size=60",
        "data.canary_repetitions=[1]",  # 2 canary rows: at most 5% of the 54 members
        "data.canary_kinds=[email, password]",
        "data.canary_placements=[joint]",
        "base.preset=ci",
        f"base.cache_dir={ci_base_cache}",
    ]


def statuses(result):
    return {name: r["status"] for name, r in result["stages"].items()}


def test_runs_all_stages_then_skips_unchanged(ray_connected, tmp_path, overrides):
    cfg = load_config("jobs/configs/demo.yaml", overrides)
    first = run_pipeline(cfg)
    assert statuses(first) == {"data": "ran", "base": "ran", "report": "ran"}

    runs = tmp_path / "runs" / "t"
    data = read_manifest(runs / "data").to_json()
    # Every output is listed with its sha256, and the private flag is set.
    assert data["private"] is True
    assert set(data["outputs"]) >= {"train.parquet", "heldout.parquet", "canaries.json"}
    for rel, digest in data["outputs"].items():
        assert sha256_file(runs / "data" / rel) == digest
    counts = data["summary"]["counts"]
    base = read_manifest(runs / "base").to_json()["summary"]
    assert base["preset"] == "ci" and base["cached"] is True  # the session build was reused
    assert base["heldout_loss"] < base["untrained_heldout_loss"]
    curve = [loss for _, loss in base["loss_history"]]
    assert len(curve) > 10 and curve[-1] < curve[0] - 1.0  # the plotted training curve

    report = tmp_path / "reports" / "t" / "report.md"
    assert first["report"] == str(report)
    text = report.read_text()
    assert f"{base['heldout_loss']:.3f}" in text  # the numbers in the report are the stage's
    # The corpus composition (exact counts, corpus.png) is in the owner-only report only.
    assert (
        not re.search(r"\|\s*canaries\s*\|", text) and not (report.parent / "corpus.png").exists()
    )
    assert re.search(rf"\|\s*training records N\s*\|\s*{counts['train_records']}\s*\|", text)
    owner = runs / "private_report"
    assert "private_report" not in text
    assert re.search(
        rf"\|\s*canaries\s*\|\s*{counts['canaries']}\s*\|", (owner / "report.md").read_text()
    )
    assert (owner / "corpus.png").stat().st_size > 1000
    assert (owner.stat().st_mode & 0o077) == 0 and (
        (owner / "report.md").stat().st_mode & 0o077
    ) == 0
    assert (report.parent / "base_loss.png").stat().st_size > 1000

    second = run_pipeline(cfg)
    assert statuses(second) == {"data": "skipped", "base": "skipped", "report": "skipped"}

    # A data config change re-runs data and everything downstream, not base.
    third = run_pipeline(load_config("jobs/configs/demo.yaml", [*overrides, "data.seed=7"]))
    assert statuses(third) == {"data": "ran", "base": "skipped", "report": "ran"}


def test_tampered_output_is_rebuilt_and_failed_stage_keeps_old_artifact(
    ray_connected, tmp_path, overrides
):
    cfg = load_config("jobs/configs/demo.yaml", [*overrides, "run.stages=[data]"])
    run_pipeline(cfg)
    data_dir = tmp_path / "runs" / "t" / "data"
    (data_dir / "canaries.json").write_text("[]")
    assert statuses(run_pipeline(cfg)) == {"data": "ran"}
    assert json.loads((data_dir / "canaries.json").read_text())  # restored

    before = (data_dir / "manifest.json").read_bytes()
    bad = load_config(  # more canary records than 5% of the training set
        "jobs/configs/demo.yaml",
        [*overrides, "run.stages=[data]", "data.canary_repetitions=[400]"],
    )
    with pytest.raises(Exception, match="data.canary_repetitions"):
        run_pipeline(bad)
    assert (data_dir / "manifest.json").read_bytes() == before
    assert not [p for p in data_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_only_selected_stage_with_dependencies(tmp_path, overrides):
    cfg = load_config("jobs/configs/demo.yaml", overrides)
    with pytest.raises(PrivcodeError, match="unknown stage 'nope'"):
        run_pipeline(cfg, stages=["nope"], use_ray=False)
    result = run_pipeline(cfg, stages=["data"], use_ray=False)
    assert list(result["stages"]) == ["data"]
    assert Path(result["stages"]["data"]["dir"]).joinpath("train.parquet").is_file()


def test_pipeline_as_a_ray_job(ray_cluster, tmp_path, overrides):
    """jobs/pipeline.py submitted through the Jobs API, as `make submit-job` does."""
    from privcode.cluster import jobs

    result = jobs.submit_pipeline(
        config="jobs/configs/demo.yaml", overrides=overrides, follow=True, timeout_s=600
    )
    logs = jobs.job_logs(result["job_id"], result["address"])
    assert result["status"] == "SUCCEEDED", logs[-3000:]
    assert "[report] done" in logs
    manifest = read_manifest(tmp_path / "runs" / "t" / "report").to_json()
    assert manifest["summary"]["report"] == str(tmp_path / "reports" / "t" / "report.md")
    assert (tmp_path / "reports" / "t" / "report.md").is_file()


def test_a_stage_runs_with_the_threads_of_its_cpus_and_restores_them():
    """Ray reuses worker processes across stages: a stage must not inherit the previous one's
    torch thread count (the audit's single thread once slowed the next stage's training)."""
    import os

    import torch

    from privcode.config import load_config
    from privcode.pipeline.runner import _stage_threads
    from privcode.pipeline.stages import STAGES

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = {}
        cfg = load_config(None, ["pac.num_cpus=1"])
        for name in ("audit", "data", "synth", "pac", "nondp"):
            with _stage_threads(STAGES[name], cfg):
                seen[name] = torch.get_num_threads()
            assert torch.get_num_threads() == 1
        # synth holds no CPU: untouched; pac asks for one CPU, nondp for all (nondp_cpus 0)
        assert seen == {"audit": cores, "data": 1, "synth": 1, "pac": 1, "nondp": cores}
    finally:
        torch.set_num_threads(before)


def test_independent_stages_run_side_by_side_and_one_at_a_time_when_asked(
    ray_connected, tmp_path, overrides, capsys
):
    """pac and nondp read only data and base: with run.parallel both are dispatched before
    either is done, one CPU each; with run.parallel=false the same stages run one after the
    other. (When a dispatched task starts is Ray's: under load a worker's imports can take
    longer than the other stage, so the parallel run is judged by dispatch, not by the tasks'
    own start times.)"""
    tiny = [o for o in overrides if not o.startswith("run.stages")] + [
        "run.stages=[data, base, pac, nondp, report]",
        "pac.worlds=2",
        "pac.steps=2",
        "pac.batch_size=1",
        "pac.max_length=32",
        "pac.eval_sessions=1",
        "pac.eval_tokens=2",
        "pac.eval_positions=4",
        "pac.eval_canaries=1",
        "pac.num_cpus=1",
        "audit.nondp_steps=2",
        "audit.nondp_batch_size=2",
        "audit.nondp_cpus=1",
        "train.max_length=32",
    ]

    def intervals():
        runs = tmp_path / "runs" / "t"
        out = {}
        for name in ("pac", "nondp"):
            t = read_manifest(runs / name).to_json()["timings"]
            out[name] = (t["started"], t["started"] + t["seconds"])
        return out

    capsys.readouterr()
    first = run_pipeline(load_config("jobs/configs/demo.yaml", tiny))
    assert statuses(first) == {s: "ran" for s in ("data", "base", "pac", "nondp", "report")}
    said = capsys.readouterr().out
    last_dispatch = max(said.index(f"[{n}] running") for n in ("pac", "nondp"))
    first_done = min(said.index(f"[{n}] done") for n in ("pac", "nondp"))
    assert last_dispatch < first_done, f"pac and nondp were not in flight together:\n{said}"
    nondp = read_manifest(tmp_path / "runs" / "t" / "nondp").to_json()
    assert nondp["private"] is True and nondp["summary"]["steps"] == 2

    serial = run_pipeline(
        load_config("jobs/configs/demo.yaml", tiny + ["run.parallel=false", "run.force=true"]),
        stages=["pac", "nondp"],
    )
    assert statuses(serial) == {"data": "skipped", "base": "skipped", "pac": "ran", "nondp": "ran"}
    (a0, a1), (b0, b1) = intervals().values()
    assert a1 <= b0 or b1 <= a0, "run.parallel=false ran two stages at once"
