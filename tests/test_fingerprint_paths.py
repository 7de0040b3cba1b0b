"""`privcode run` and the job `make submit-job` submits agree on every stage fingerprint.

The submit side makes run.out_dir, run.reports_dir and base.cache_dir absolute (the job
runs in a throw-away copy of the working dir); fingerprints that hashed the paths as
spelt made each entry point re-run 9 of 10 stages after the other (issue 41 point 12),
training the junior, and spending privacy budget, again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from privcode.artifacts import StageManifest
from privcode.cluster import jobs
from privcode.config import load_config
from privcode.pipeline.runner import LOCATION_FIELDS, fingerprint, is_current
from privcode.pipeline.stages import STAGES
from privcode.utils import stable_hash

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "demo.yaml"
LOCAL_HEAD = "http://127.0.0.1:8265"


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    """Relative paths resolve against the cwd, as for both entry points; ~ is tmp_path/home."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _chain(cfg) -> dict[str, str]:
    """Every stage's fingerprint, in table order, each with its inputs' fingerprints."""
    known: dict[str, StageManifest] = {}
    for name, stage in STAGES.items():
        known[name] = StageManifest(name, fingerprint(cfg, stage, known), {})
    return {name: m.fingerprint for name, m in known.items()}


def _run_and_job(*overrides: str):
    """The config of ``privcode run`` and of the job submitted with the same ``--set``s."""
    cfg = load_config(DEMO, list(overrides))
    job = load_config(DEMO, jobs.job_overrides(cfg, list(overrides), LOCAL_HEAD))
    return cfg, job


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("run.out_dir=runs/x", "run.reports_dir=out/../reports/x", "base.cache_dir=cache/base"),
        ("privacy.store=store", "run.out_dir=./runs"),
    ],
    ids=["demo", "relative", "store"],
)
def test_the_submitted_job_has_the_fingerprints_of_privcode_run(overrides):
    cfg, job = _run_and_job(*overrides)
    for dotted in jobs._PERSISTENT_PATHS:  # the rewrite happened: not a vacuous comparison
        section, _, key = dotted.partition(".")
        value = getattr(job.section(section), key)
        assert value == "" or os.path.isabs(value), dotted
    assert (cfg.run.out_dir, cfg.base.cache_dir) != (job.run.out_dir, job.base.cache_dir)
    assert _chain(job) == _chain(cfg)


def test_a_relative_path_and_its_absolute_spelling_are_one_place(tmp_path):
    rel = _chain(load_config(DEMO, ["run.reports_dir=reports/x", "run.out_dir=runs/x"]))
    absolute = _chain(
        load_config(
            DEMO, [f"run.reports_dir={tmp_path}/reports/x", f"run.out_dir={tmp_path}/runs/x"]
        )
    )
    assert rel == absolute


def test_a_result_setting_still_changes_the_train_fingerprint():
    cfg, job = _run_and_job()
    other_cfg, other_job = _run_and_job("train.epsilon=2.0")
    for before, after in ((cfg, other_cfg), (job, other_job), (cfg, other_job)):
        a, b = _chain(before), _chain(after)
        assert a["train"] != b["train"]
        assert a["data"] == b["data"] and a["base"] == b["base"]
        assert a["synth"] != b["synth"]  # reads the release: follows train


def test_another_report_place_re_runs_the_report_and_nothing_else(tmp_path, monkeypatch):
    a = _chain(load_config(DEMO, ["run.reports_dir=reports"]))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    b = _chain(load_config(DEMO, ["run.reports_dir=reports"]))  # same spelling, other cwd
    assert {n for n in a if a[n] != b[n]} == {"report"}


def test_moving_the_base_cache_re_runs_nothing():
    assert _chain(load_config(DEMO, ["base.cache_dir=/elsewhere/cache"])) == _chain(
        load_config(DEMO)
    )


def test_every_rewritten_path_a_stage_reads_is_a_location_field():
    """A stage that comes to read another path the submit side rewrites must say how."""
    cfg = load_config(DEMO)
    for stage in STAGES.values():
        read = stage.config_read(cfg)
        for dotted in jobs._PERSISTENT_PATHS:
            section, _, key = dotted.partition(".")
            if key in read.get(section, {}):
                assert dotted in LOCATION_FIELDS, (stage.name, dotted)


def _old_fingerprint(cfg, stage, upstream) -> str:
    """The scheme before this fix: the declared config hashed as spelt."""
    return stable_hash(
        {
            "stage": stage.name,
            "version": stage.version,
            "config": stage.config_read(cfg),
            "run": None,
            "inputs": {
                n: upstream[n].fingerprint for n in (*stage.needs, *stage.after) if n in upstream
            },
        }
    )


def test_a_manifest_from_the_old_scheme_is_not_current(tmp_path):
    """`make demo`'s manifests from before the fix hashed relative paths: the stages reading
    one (base, report) and all after base run once more, rather than pass as current."""
    cfg = load_config(DEMO)
    new = _chain(cfg)
    old: dict[str, StageManifest] = {}
    for name, stage in STAGES.items():
        old[name] = StageManifest(name, _old_fingerprint(cfg, stage, old), {})
    stale = {n for n in STAGES if old[n].fingerprint != new[n]}
    assert stale == set(STAGES) - {"data"}
    directory = tmp_path / "base"
    directory.mkdir()
    old["base"].write(directory / StageManifest.FILE)
    assert not is_current(directory, new["base"])
    assert is_current(directory, old["base"].fingerprint)  # the manifest itself reads fine


def test_privcode_run_then_the_submitted_job_skips_every_stage(
    ray_connected, tmp_path, ci_base_cache
):
    """`make demo` then `make submit-job` with the same relative paths: nothing runs again."""
    from privcode.pipeline.runner import run_pipeline

    (tmp_path / "cache").symlink_to(ci_base_cache)  # a relative base.cache_dir, prebuilt
    overrides = [
        "run.out_dir=runs",
        "run.reports_dir=reports",
        "base.cache_dir=cache",
        "run.name=t",
        "run.stages=[data, base, report]",
        "data.size=60",
        "data.canary_repetitions=[1]",
        "data.canary_kinds=[email, password]",
        "data.canary_placements=[joint]",
        "base.preset=ci",
    ]
    first = run_pipeline(load_config(DEMO, overrides))
    assert {n: r["status"] for n, r in first["stages"].items()} == dict.fromkeys(
        ("data", "base", "report"), "ran"
    )
    result = jobs.submit_pipeline(config=str(DEMO), overrides=overrides, follow=True, timeout_s=600)
    logs = jobs.job_logs(result["job_id"], result["address"])
    assert result["status"] == "SUCCEEDED", logs[-3000:]
    for name in ("data", "base", "report"):
        assert f"[{name}] unchanged, skipped ({tmp_path}/runs/t/{name})" in logs, logs[-3000:]
    assert "running ..." not in logs
