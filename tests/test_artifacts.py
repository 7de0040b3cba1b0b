"""The typed on-disk records (privcode.artifacts): round trips and errors that name the key."""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import privacy_record

from privcode.artifacts import ArtifactError, PrivacyRecord, StageManifest
from privcode.artifacts.manifest import hash_outputs
from privcode.dp.accounting import DPEvent


def test_privacy_record_round_trips_through_its_file(tmp_path):
    rec = privacy_record(
        epsilon=2.5, history=[{"noise_multiplier": 1.1, "sample_rate": 0.02, "steps": 7}]
    )
    path = rec.write(tmp_path / "privacy.json")
    assert PrivacyRecord.read(tmp_path) == rec  # a directory reads its FILE
    on_disk = json.loads(path.read_text())
    assert on_disk["history"] == [{"noise_multiplier": 1.1, "sample_rate": 0.02, "steps": 7}]
    assert on_disk["NOT_PRIVATE"] is None and "not_private" not in on_disk
    assert rec.history == (DPEvent(1.1, 0.02, 7),)
    assert rec.epsilon_by_accountant == {"rdp": 2.5, "prv": None}


def test_a_non_private_record_says_so_and_has_no_epsilon(tmp_path):
    rec = privacy_record(dp=False)
    assert rec.epsilon is None and rec.not_private and rec.reason_not_private == "test"
    assert json.loads(rec.write(tmp_path / "p.json").read_text())["NOT_PRIVATE"]
    with pytest.raises(ValueError, match="epsilon is null"):
        privacy_record(dp=True, epsilon=None)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("epsilon_rdp"), r"missing key 'epsilon_rdp'"),
        (lambda d: d.update(epsilon_rpd=1.0), r"unknown keys \['epsilon_rpd'\]"),
        (lambda d: d.update(num_records="400"), r"num_records: '400' is not int"),
        (lambda d: d.update(dp="yes"), r"dp: 'yes' is not bool"),
        (lambda d: d.update(epsilon=float("inf")), r"epsilon: inf is not a finite number"),
        (lambda d: d.update(history=[{"noise_multiplier": 0, "sample_rate": 0.1}]), r"history: "),
        (lambda d: d.update(public_heldout_loss_curve=[[1]]), r"\[step, loss\] pairs"),
    ],
)
def test_a_bad_privacy_record_is_an_error_naming_file_and_key(tmp_path, edit, message):
    obj = privacy_record().to_json()
    edit(obj)
    (tmp_path / "privacy.json").write_text(json.dumps(obj))
    with pytest.raises(ArtifactError, match=message) as err:
        PrivacyRecord.read(tmp_path / "privacy.json")
    assert str(tmp_path / "privacy.json") in str(err.value)


def test_stage_manifest_round_trip_and_intact(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    m = StageManifest(
        stage="base",
        fingerprint="f" * 16,
        summary={"n": 1},
        outputs=hash_outputs(tmp_path),
        timings={"started": 1.0, "seconds": 2.5},
    )
    m.write(tmp_path)
    again = StageManifest.find(tmp_path)
    assert again == m and again.seconds == 2.5 and again.intact(tmp_path)
    (tmp_path / "a.txt").write_text("y")
    assert not again.intact(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    assert StageManifest.find(tmp_path) is None
    assert StageManifest.find(tmp_path / "absent") is None


def test_a_stage_summary_of_the_wrong_shape_fails_the_stage_and_is_never_current(
    tmp_path, monkeypatch
):
    """The runner checks a typed summary before writing the manifest, and before skipping."""
    from conftest import full_train_summary

    from privcode.artifacts import TrainSummary
    from privcode.config import load_config
    from privcode.pipeline import runner
    from privcode.pipeline.stages import STAGES

    cfg = load_config("jobs/configs/demo.yaml", [f"run.out_dir={tmp_path}", "run.name=t"])
    good = full_train_summary({"epsilon": 3.0, "epsilon_rdp": 3.0})
    bad = {k: v for k, v in good.items() if k != "epsilon_rdp"}
    monkeypatch.setattr(STAGES["train"], "run", lambda self, cfg, out, inputs: bad)
    final = tmp_path / "t" / "train"
    with pytest.raises(
        ArtifactError, match=r"the train stage's summary: missing key 'epsilon_rdp'"
    ):
        runner.execute_stage("train", cfg, str(final), "fp", {})
    assert not final.exists() and not list((tmp_path / "t").iterdir())  # nothing half-written
    monkeypatch.setattr(STAGES["train"], "run", lambda self, cfg, out, inputs: good)
    manifest = runner.execute_stage("train", cfg, str(final), "fp", {})
    assert TrainSummary.from_json(manifest.summary).epsilon_by_accountant["rdp"] == 3.0
    # A manifest whose summary has another shape (an older version's) is not current.
    StageManifest(stage="train", fingerprint="fp", summary=bad).write(final)
    monkeypatch.setattr(STAGES["train"], "still_valid", lambda self, summary: True)
    assert not runner.is_current(final, "fp", STAGES["train"])
    StageManifest(stage="train", fingerprint="fp", summary=good).write(final)
    assert runner.is_current(final, "fp", STAGES["train"])


def test_premium_record_needs_its_privacy_block(tmp_path):
    from conftest import premium_json

    from privcode.artifacts.premium import PremiumRecord

    path = tmp_path / "premium.json"
    path.write_text(premium_json("base"))
    record = PremiumRecord.read(tmp_path)  # a directory reads its premium.json
    assert record.privacy.dp and record.summary().privacy == record.privacy
    obj = json.loads(premium_json("base"))
    del obj["privacy"]
    path.write_text(json.dumps(obj))
    with pytest.raises(ArtifactError, match="missing key 'privacy'"):
        PremiumRecord.read(path)
    obj = json.loads(premium_json("base", dp=False))
    obj["privacy"]["privacy_warning"] = None  # no DP guarantee must say so
    path.write_text(json.dumps(obj))
    with pytest.raises(ArtifactError, match="needs its privacy_warning"):
        PremiumRecord.read(path)


def test_the_nondp_marker_cannot_claim_privacy(tmp_path):
    from privcode.artifacts.nondp import NondpRecord

    record = NondpRecord(
        finetune="lora",
        steps=2,
        lr=1e-3,
        expected_batch_size=4,
        max_length=64,
        lora_r=4,
        trainable_parameters=10,
        seconds=0.5,
        not_private="NOT PRIVATE",
        training_mode={"mode": "non-private", "reason": "test"},
        base_model="base",
    )
    record.write(tmp_path / "nondp.json")
    on_disk = json.loads((tmp_path / "nondp.json").read_text())
    assert on_disk["dp"] is False and on_disk["NOT_PRIVATE"] == "NOT PRIVATE"
    assert NondpRecord.read(tmp_path).summary().to_json()["steps"] == 2
    (tmp_path / "nondp.json").write_text(json.dumps({**on_disk, "dp": True}))
    with pytest.raises(ArtifactError, match="must say dp false"):
        NondpRecord.read(tmp_path)


# --------------------------------------------------------------------------- file modes


@pytest.fixture(params=[0o000, 0o022], ids=["umask-000", "umask-022"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root):
    return {p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


def test_atomic_writes_are_private_unless_published_whatever_the_umask(tmp_path, umask):
    from privcode.utils import PUBLIC_FILE_MODE, atomic_path, atomic_write_json

    atomic_write_json(tmp_path / "run" / "a" / "x.json", {"k": 1})
    atomic_write_json(tmp_path / "pub" / "y.json", {"k": 1}, mode=PUBLIC_FILE_MODE)
    with atomic_path(tmp_path / "run" / "z.bin") as tmp:
        tmp.unlink()  # a writer that re-creates its file gets the umask's mode, then ours
        tmp.write_bytes(b"z")
    assert _modes(tmp_path) == {
        "run": 0o700,
        "run/a": 0o700,
        "run/a/x.json": 0o600,
        "run/z.bin": 0o600,
        "pub": 0o755,
        "pub/y.json": 0o644,
    }


def test_a_stage_writes_an_owner_only_run_directory_whatever_the_umask(tmp_path, umask):
    """The real data stage, through the runner: run root, stage dir and every file."""
    from privcode.config import load_config
    from privcode.layout import RunLayout
    from privcode.pipeline import runner

    overrides = [f"run.out_dir={tmp_path / 'runs'}", "run.name=m", "data.size=30"]
    overrides += ["data.canary_kinds=[email]", "data.canary_placements=[joint]"]
    cfg = load_config("jobs/configs/demo.yaml", [*overrides, "data.canary_repetitions=[1]"])
    layout = RunLayout.of(cfg)
    runner.execute_stage("data", cfg, str(layout.stage("data")), "fp", {})
    modes = _modes(layout.out_dir)
    assert {"m/data/train.parquet", "m/data/manifest.json", "m/data/canaries.json"} <= set(modes)
    assert stat.S_IMODE(layout.out_dir.stat().st_mode) == 0o700
    for rel, mode in modes.items():
        expected = 0o700 if (layout.out_dir / rel).is_dir() else 0o600
        assert mode == expected, (rel, oct(mode))
