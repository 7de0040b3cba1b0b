"""RunLayout: every path of a run from one object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from privcode.config import load_config
from privcode.layout import RunLayout


def test_paths_of_a_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["run.name=exp1", "run.out_dir=store/runs", "run.reports_dir=pub"])
    layout = RunLayout.of(cfg)
    root = tmp_path / "store" / "runs" / "exp1"
    assert layout == RunLayout.of(cfg.run) and layout.root == root
    assert layout.stage("audit") == root / "audit"
    assert layout.manifest("train") == root / "train" / "manifest.json"
    assert layout.work("synth") == root / ".synth"
    assert (layout.train_data, layout.heldout_data, layout.canaries) == (
        root / "data" / "train.parquet",
        root / "data" / "heldout.parquet",
        root / "data" / "canaries.json",
    )
    assert layout.release == root / "train" / "release"
    assert layout.synthetic == root / "synth" / "synthetic.parquet"
    assert layout.premium == root / "premium"
    assert layout.nondp_model == root / "nondp" / "nondpft"
    assert layout.pac_worlds == root / "pac" / "worlds"
    assert layout.private_report == root / "private_report"
    assert layout.public_reports == tmp_path / "pub" / "exp1"
    tmp = root / ".train.x.tmp"  # a stage's temporary directory
    assert layout.release_in(tmp) == tmp / "release"
    assert layout.pac_worlds_in(tmp) == tmp / "worlds"
    assert layout.nondp_model_in(tmp) == tmp / "nondpft"
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="plain directory name"):
            RunLayout(Path("runs"), bad)


def test_manifests_of_every_run_skip_hidden_dirs_and_runs_without_the_stage(tmp_path):
    for run in ("b", "a", ".tmp", "c"):
        stage = tmp_path / run / ("train" if run != "c" else "eval")
        stage.mkdir(parents=True)
        (stage / "manifest.json").write_text(json.dumps({"run": run}))
    found = RunLayout(tmp_path, "a").manifests_of_every_run("train")
    assert list(found) == ["a", "b"] and found["b"] == tmp_path / "b" / "train" / "manifest.json"
