"""Reports and metrics leak no overlap (issue 41, point 5), no Ray, no model, no store.

One record that an earlier job trained on moves the privacy store's composition
(the worst record of this run's data 4.153 -> 4.959, record groups 2 -> 3) and
the wall clocks, while the release's own epsilon stays 4.153. Two runs that
differ only so must give byte-identical shareable reports (``report.md``,
``report.html``, ``report.json``, PNGs, in the stage directory and in
``reports/<run>/``); the owner-only report still shows the composition and the
seconds. ``privacy.json`` has no field for any of them.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import as_manifests, base_summary, full_train_summary
from report_support import report_config
from test_report_pac import SUMMARY as PAC_SUMMARY

from privcode.artifacts import PrivacyRecord
from privcode.pipeline.report import private_report_dir, write_report

RELEASE_EPSILON = 4.153
#: What one earlier-trained record changes: (this run's worst record, record groups,
#: training seconds, stage seconds, PAC worlds' seconds, why training stopped: a restart
#: after the store's last step was granted ends on "budget").
BEFORE = (4.153, 2, 812.25, 3.5, 51.3, "steps")
AFTER = (4.959, 3, 845.75, 4.25, 57.9, "budget")
#: Fields of the train summary that must never reach privacy.json.
OWNER_ONLY_FIELDS = {
    "record_epsilon",
    "record_budget",
    "train_seconds",
    "privacy_store",
    "ledger_steps",
    "stop_reason",
}


STAGES = "run.stages=[data, base, train, pac, report]"


def _store_show(worst: float, groups: int) -> dict[str, Any]:
    """What ``privcode budget show`` would answer for a store with ``groups`` record groups."""
    return {
        "budget": {"epsilon": 8.0, "delta": 1e-5, "accountant": "rdp"},
        "epsilon_spent": worst,
        "epsilon_left": 8.0 - worst,
        "jobs": [{"job": f"j{i}"} for i in range(groups)],
        "groups": [{"jobs": [f"j{i}"], "records": 10} for i in range(groups)],
    }


def _inputs(tmp_path: Path, variant: tuple) -> dict:
    worst, _, train_seconds, stage_seconds, worlds_seconds, stopped = variant
    train = full_train_summary(
        {
            "epsilon": RELEASE_EPSILON,
            "epsilon_rdp": RELEASE_EPSILON,
            "epsilon_prv": 3.9,
            "epsilon_budget": 8.0,
            "record_epsilon": worst,
            "record_budget": 8.0,
            "train_seconds": train_seconds,
            "stop_reason": stopped,
            "public_heldout_loss_curve": [[0, 6.0], [30, 5.8]],
        }
    )
    pac = {
        **PAC_SUMMARY,
        "seconds": worlds_seconds + 10,
        "worlds": {**PAC_SUMMARY["worlds"], "seconds": worlds_seconds},
        "worlds_dir": "worlds",
    }
    timings = {"seconds": stage_seconds}
    return as_manifests(
        {
            "data": {"timings": timings, "summary": {"counts": {"train_records": 2625}}},
            "base": {"timings": timings, "summary": base_summary(tmp_path / "base")},
            "train": {"timings": timings, "summary": train},
            "pac": {"timings": timings, "summary": pac},
        }
    )


def _render(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: tuple):
    """Write the reports of ``variant`` from scratch: ({shareable name: bytes}, owner report.md)."""
    import privcode.privacy.budget as budget

    monkeypatch.setattr(budget, "call", lambda root, method: _store_show(*variant[:2]))
    cfg = report_config(tmp_path, STAGES)
    stage, published = tmp_path / "stage", tmp_path / "reports" / "demo"
    for directory in (stage, published, private_report_dir(cfg)):
        shutil.rmtree(directory, ignore_errors=True)
    stage.mkdir()
    write_report(cfg, stage, _inputs(tmp_path, variant))
    files = {
        f"{where}/{path.name}": path.read_bytes()
        for where, directory in (("stage", stage), ("published", published))
        for path in sorted(directory.iterdir())
    }
    return files, (private_report_dir(cfg) / "report.md").read_text()


def test_one_earlier_trained_record_leaves_the_shareable_report_byte_identical(
    tmp_path, monkeypatch
):
    before, owner_before = _render(tmp_path, monkeypatch, BEFORE)
    after, owner_after = _render(tmp_path, monkeypatch, AFTER)
    assert {"stage/report.md", "stage/report.json", "published/report.html"} <= set(before)
    assert "stage/train_loss.png" in before and "published/pac.png" in before
    assert before == after  # byte for byte, every shareable file
    text = before["stage/report.md"].decode()
    assert f"{RELEASE_EPSILON:.4g}" in text  # the release's own epsilon stays
    for gone in ("worst record", "record groups", "| seconds |", " s)", "Per-record budget"):
        assert gone not in text, gone
    # The public base's clock stays (public code only); the DP training's goes.
    dp_training = text.split("## DP training (Stage I)")[1].split("\n## ")[0]
    assert "training seconds" not in dp_training and "`privcode budget show`" in dp_training
    for blob in before.values():
        assert b"store_worst_record" not in blob and b"record_groups" not in blob
        assert b"845.75" not in blob and b"4.959" not in blob
    assert owner_before != owner_after


@pytest.mark.parametrize("variant", [BEFORE, AFTER])
def test_the_owner_report_still_shows_the_composition_and_the_seconds(
    tmp_path, monkeypatch, variant
):
    worst, groups, train_seconds, stage_seconds, worlds_seconds, stopped = variant
    _, owner = _render(tmp_path, monkeypatch, variant)
    reason = {"steps": "all steps done", "budget": "budget spent"}[stopped]
    assert f"| stopped because (reveals restarts: owner-only) | {reason} |" in owner
    assert "### Per-record budget (privacy store)" in owner
    assert f"| worst record of this run's data, every job on it composed | {worst:.4g} |" in owner
    assert f"| worst record in the store | {worst:.4g} |" in owner
    assert f"| left for the worst record | {8.0 - worst:.4g} |" in owner
    assert f"| DP jobs recorded in the store | {groups} |" in owner
    assert f"| record groups (records trained on by the same jobs) | {groups} |" in owner
    assert f"| training seconds | {train_seconds:.4g} |" in owner
    assert f"| train | {stage_seconds:.1f} |" in owner
    assert f"Worlds' training: {worlds_seconds} s." in owner


def test_privacy_json_has_no_field_for_the_store_or_the_clock():
    """The release's record carries its own epsilon and public settings only."""
    fields = {f.name for f in dataclasses.fields(PrivacyRecord)}
    assert not fields & OWNER_ONLY_FIELDS
