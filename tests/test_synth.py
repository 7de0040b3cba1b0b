"""Stage II end to end on a local Ray cluster: release -> Ray Data -> filters -> Parquet."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import privacy_record

from privcode.artifacts import SynthSummary
from privcode.config import SynthConfig, load_config
from privcode.errors import ConfigError
from privcode.synth.pipeline import SynthesisError, check_release_path, run_synthesis, work_key

TINY = SynthConfig(
    num_samples=24,
    shard_size=8,
    batch_size=4,
    max_new_tokens=24,
    temperature=1.0,
    generators_min=1,
    generators_max=1,
    sandbox_workers=2,
    sandbox_wall_seconds=5.0,
)


@pytest.fixture(scope="module")
def release(ci_release) -> Path:
    """A privcode++-format release of the ci base (conftest's ``ci_release``)."""
    return ci_release


def _light_release(root: Path, *, dp: bool) -> Path:
    """A verified prompt-conditioned release whose adapter is a stand-in LoRA tensor: enough
    for the release checks and for finalising shards already on disk (no model is loaded)."""
    from safetensors.torch import save_file

    from privcode.train.release import write_release

    adapter = root / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)},
        str(adapter / "adapter_model.safetensors"),
    )
    return write_release(
        root / "release",
        adapter_dir=adapter,
        meta={
            "method": "privcode" if dp else "nondpft",
            "conditioning": "prompt",
            "dp": dp,
            "base_model": "unused",
        },
        privacy=privacy_record(dp=dp, epsilon=4.0),
    )


@pytest.fixture
def no_ray(monkeypatch):
    """Fails a test that connects to Ray or builds the Ray Data pipeline."""
    from conftest import forbid_calls

    import privcode.cluster.local
    import privcode.synth.pipeline

    forbid_calls(
        monkeypatch,
        "Stage II must refuse before connecting to Ray or generating",
        (privcode.cluster.local, "connect"),
        (privcode.synth.pipeline, "_dataset"),
    )


def test_stage_two_refuses_a_non_dp_release_without_the_option(no_ray, tmp_path):
    nondp = _light_release(tmp_path, dp=False)
    with pytest.raises(
        SynthesisError,
        match=r"NOT differentially private \(dp: false\).*"
        r"synth\.allow_non_dp_release=true",
    ):
        run_synthesis(TINY, release=nondp, out_dir=tmp_path / "o", work_root=tmp_path / "w")
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()
    # Fail closed: a release.json without 'dp' counts as non-DP.
    from privcode.synth.pipeline import release_privacy

    meta = {k: v for k, v in check_release_path(nondp).items() if k != "dp"}
    with pytest.raises(SynthesisError, match="no 'dp' key in release.json"):
        release_privacy(nondp, meta)
    dp = _light_release(tmp_path / "dp", dp=True)
    assert release_privacy(dp, check_release_path(dp)) == {
        "dp": True,
        "epsilon": 4.0,
        "delta": 1e-5,
        "privacy_warning": None,
    }


def test_stage_two_with_the_option_says_no_dp_guarantee_everywhere(ray_connected, tmp_path):
    """A non-DP release with synth.allow_non_dp_release: the run goes through (its one shard
    is already on disk, so nothing is generated) and every artifact says NO DP guarantee."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from privcode.data.public import public_pairs

    nondp = _light_release(tmp_path, dp=False)
    cfg = dataclasses.replace(TINY, num_samples=6, shard_size=8, allow_non_dp_release=True)
    shard = tmp_path / "w" / work_key(cfg, check_release_path(nondp)) / "shards"
    shard.mkdir(parents=True)
    rows = [
        {
            "index": i,
            "z_seed": f"{cfg.seed}:{i}",
            "prompt": p,
            "code": c,
            "exec_status": "ok",
            "exec_passed": True,
            "exec_seconds": 0.01,
            "roundtrip_passed": True,
            "roundtrip_score": 0.9,
        }
        for i, (p, c) in enumerate(public_pairs(6, seed=5))
    ]
    pq.write_table(pa.Table.from_pylist(rows), shard / "shard-00000.parquet")
    with pytest.warns(RuntimeWarning, match="NO differential-privacy guarantee"):
        summary = run_synthesis(
            cfg, release=nondp, out_dir=tmp_path / "o", work_root=tmp_path / "w", progress=False
        )
    assert summary["shards_resumed"] == 1 and summary["generated_this_run"] == 0
    assert summary["kept"] >= 1
    assert SynthSummary.from_json(summary).privacy_warning  # the stage's typed summary
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    for artifact in (summary, stats):
        assert artifact["dp"] is False
        assert artifact["privacy_warning"].startswith(
            "NO differential-privacy guarantee: synthesised from a non-DP release"
        )
    assert stats["release"]["dp"] is False and stats["release"]["epsilon"] is None
    provenances = (
        pq.read_table(tmp_path / "o" / "synthetic.parquet").column("provenance").to_pylist()
    )
    assert len(provenances) == summary["kept"]
    for prov in map(json.loads, provenances):
        assert prov["dp"] is False and prov["no_dp_guarantee"] is True
        assert prov["NOT_PRIVATE"].startswith("NO differential-privacy guarantee")
        assert prov["method"] == "nondpft" and prov["epsilon"] is None


def test_stage_two_refuses_private_inputs(tmp_path):
    from privcode.config import DataConfig
    from privcode.data.demo import build_demo_corpus

    corpus = tmp_path / "corpus"
    build_demo_corpus(
        corpus,
        DataConfig(
            size=30,  # 27 members: one canary row is at most 5% of them
            canary_repetitions=(1,),
            canary_kinds=("email",),
            canary_placements=("joint",),
        ),
        progress=False,
    )
    for private in (corpus / "train.parquet", corpus):
        with pytest.raises(SynthesisError, match="refusing to start"):
            check_release_path(private)
        with pytest.raises(SynthesisError, match="refusing to start"):
            run_synthesis(TINY, release=private, out_dir=tmp_path / "o", work_root=tmp_path / "w")
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()
    with pytest.raises(SynthesisError, match="not a released Stage I artifact"):
        check_release_path(tmp_path)
    # There is no private-data key in the Stage II config at all.
    with pytest.raises(ConfigError, match="unknown key 'synth.data'"):
        load_config(None, [f"synth.data={corpus / 'train.parquet'}"])


def test_pipeline_end_to_end_counts_add_up(ray_connected, release, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    summary = run_synthesis(
        TINY, release=release, out_dir=out, work_root=tmp_path / "work", progress=False
    )
    assert summary["generated"] == 24 and summary["shards"] == 3
    assert SynthSummary.from_json(summary).dp is True  # the stage's typed summary
    assert summary["shards_written"] == 3 and summary["shards_resumed"] == 0
    removed = (
        summary["removed_execution"] + summary["removed_roundtrip"] + summary["removed_duplicate"]
    )
    assert removed + summary["kept"] == summary["generated"]
    assert sum(summary["execution_statuses"].values()) == 24
    stats = json.loads((out / "stats.json").read_text())
    assert stats["funnel"]["generated"] == 24 and stats["release"]["method"] == "privcode++"
    # A DP release: the (epsilon, delta) of its privacy.json travel with the data.
    assert summary["dp"] is True and stats["dp"] is True
    assert summary["privacy_warning"] is None and stats["privacy_warning"] is None
    assert (summary["epsilon"], summary["delta"]) == (4.0, 1e-5)
    table = pq.read_table(out / "synthetic.parquet")
    assert table.num_rows == summary["kept"]
    assert {
        "id",
        "prompt",
        "code",
        "z_seed",
        "exec_status",
        "roundtrip_score",
        "provenance",
    } <= set(table.column_names)
    for prov in map(json.loads, set(table.column("provenance").to_pylist())):
        assert prov["dp"] is True and (prov["epsilon"], prov["delta"]) == (4.0, 1e-5)
        assert "no_dp_guarantee" not in prov
    # Every generated row, with its verdicts, is in the shards (nothing lost, no duplicates).
    work = Path(summary["work_dir"])
    rows = [
        r for f in sorted((work / "shards").glob("*.parquet")) for r in pq.read_table(f).to_pylist()
    ]
    assert sorted(r["index"] for r in rows) == list(range(24))
    assert all(r["z_seed"] == f"{TINY.seed}:{r['index']}" for r in rows)
    assert all(r["exec_status"] for r in rows)
    assert all((r["roundtrip_score"] == r["roundtrip_score"]) == r["exec_passed"] for r in rows)


def test_each_filter_runs_as_its_own_pool(ray_connected, release, tmp_path):
    """Pools of two execution-filter and two round-trip actors (synth.executors_min=2,
    scorers_min=2) share the work: every row once, with its verdicts."""
    import dataclasses

    import pyarrow.parquet as pq
    from ray.util.state import list_actors

    def actors(name: str) -> set[str]:
        found = list_actors(filters=[("class_name", "=", f"MapWorker(MapBatches({name}))")])
        return {a.actor_id for a in found}

    before = {n: actors(n) for n in ("ExecutionFilter", "RoundTripScore")}
    cfg = dataclasses.replace(
        TINY,
        num_samples=16,
        executors_min=2,
        executors_max=2,
        execution_cpus=0.05,
        execution_batch_size=4,
        scorers_min=2,
        scorers_max=2,
        roundtrip_cpus=0.05,
        roundtrip_batch_size=4,
    )
    summary = run_synthesis(
        cfg, release=release, out_dir=tmp_path / "out", work_root=tmp_path / "work", progress=False
    )
    assert summary["generated"] == 16
    for name, old in before.items():
        assert len(actors(name) - old) == 2, name  # both actors of the pool started
    rows = [
        r
        for f in sorted((Path(summary["work_dir"]) / "shards").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert sorted(r["index"] for r in rows) == list(range(16))
    assert all((r["roundtrip_score"] == r["roundtrip_score"]) == r["exec_passed"] for r in rows)
    # The pools' telemetry saw each pool at its size, and every row through every operator.
    ops = summary["operators"]
    assert set(ops) == {"generate", "extract", "execution", "roundtrip"}
    # (sampled each second: a pool's second actor may come and go between two samples)
    assert all(1 <= ops[p]["peak_actors"] <= 2 for p in ("execution", "roundtrip")), ops
    assert all(ops[p]["rows"] == 16 for p in ops), ops
    assert all(ops[p]["busy_s"] > 0 and ops[p]["rows_per_actor_s"] > 0 for p in ops), ops
    assert ops["roundtrip"]["rows_per_cpu_s"] == pytest.approx(
        ops["roundtrip"]["rows_per_actor_s"] / 0.05, rel=0.01
    )
    pools = json.loads((tmp_path / "out" / "pools.json").read_text())
    assert len(pools["t"]) >= 2 and pools["t"] == sorted(pools["t"])
    timeline = pools["pools"]["execution"]
    assert all(len(v) == len(pools["t"]) for v in timeline.values())
    assert 1 <= max(timeline["alive"]) <= 2 and timeline["rows"][-1] == 16


def _processes_titled(title: str) -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(title in part for part in (p.info["cmdline"] or []))
    ]


def _wait_until_no_process_titled(title: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = _processes_titled(title)
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes {alive} titled {title!r} still alive after {timeout}s")


@pytest.mark.slow  # about 70 s on 2 CPUs (two Stage II runs, a CLI subprocess): `make test-all`
def test_rerun_after_a_killed_run_resumes_without_duplicates(ray_connected, release, tmp_path):
    """SIGKILL the synthesis driver once a shard is on disk; the rerun finishes the rest."""
    import pyarrow.parquet as pq

    cfg_file = tmp_path / "synth.yaml"
    cfg_file.write_text(
        json.dumps(
            {
                "run": {"name": "s", "out_dir": str(tmp_path / "runs"), "stages": ["synth"]},
                "synth": {
                    "release": str(release),
                    "num_samples": 96,
                    "shard_size": 8,
                    "batch_size": 4,
                    "max_new_tokens": 24,
                    "generators_min": 1,
                    "generators_max": 1,
                    "sandbox_workers": 2,
                },
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "privcode.cli", "synthesize", "--config", str(cfg_file)],
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    shards = tmp_path / "runs" / "s" / ".synth"
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if len(list(shards.glob("*/shards/shard-*.parquet"))) >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        assert _processes_titled("ray::privcode:synth"), "the synth stage task is not running"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    # The stage runs as a Ray task in the shared cluster: it outlives its driver until the
    # raylet reaps the dead job's workers, and may finish a shard or two meanwhile.
    _wait_until_no_process_titled("ray::privcode:synth", timeout=120)
    done = sorted(shards.glob("*/shards/shard-*.parquet"))
    assert 1 <= len(done) < 12
    cfg = load_config(cfg_file)
    summary = run_synthesis(
        cfg.synth, release=release, out_dir=tmp_path / "out", work_root=shards, progress=False
    )
    assert summary["shards_resumed"] == len(done)
    assert summary["shards_written"] == 12 - len(done)
    rows = [
        r
        for f in sorted(shards.glob("*/shards/shard-*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert sorted(r["index"] for r in rows) == list(range(96))
    assert not list(shards.glob("*/shards/.*.tmp"))  # no half-written shard left behind


def test_a_junior_that_writes_no_runnable_code_stops_after_the_first_shard():
    from privcode.synth.pipeline import _check_runnable

    rows = [{"exec_passed": False, "exec_status": "syntax"}] * 9 + [
        {"exec_passed": True, "exec_status": "ok"}
    ]
    _check_runnable(rows, 0.1)  # 1 of 10 runs: enough
    _check_runnable(rows, 0.0)
    with pytest.raises(
        SynthesisError,
        match=r"only 1 of the first 10 samples run \(execution "
        r"statuses: ok 1, syntax 9; synth.min_runnable_"
        r"fraction=0.2\).*base stage.*train stage",
    ):
        _check_runnable(rows, 0.2)


def test_a_killed_runs_half_written_shards_are_cleared():
    import tempfile

    from privcode.synth.pipeline import _clear_stale_temporaries

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        (work / "shards").mkdir()
        stale = work / "shards" / ".shard-00003.parquet.abc.tmp"  # a killed run's half shard
        stale.write_bytes(b"half")
        done = work / "shards" / "shard-00000.parquet"
        done.write_bytes(b"whole")
        assert _clear_stale_temporaries(work) == 1
        assert not stale.exists() and done.read_bytes() == b"whole"
        assert _clear_stale_temporaries(work) == 0


def test_stage_two_stops_when_full_isolation_is_missing(no_ray, tmp_path, monkeypatch):
    """Nothing is generated when the execution filter could not run with full isolation."""
    from privcode.sandbox import pool as sandbox_pool

    release = _light_release(tmp_path, dp=True)

    monkeypatch.setattr(sandbox_pool, "_LEVEL", "rlimits-only")
    monkeypatch.setattr(sandbox_pool, "_MISSING", "not running as root (uid 1000)")
    with pytest.raises(SynthesisError, match="execution filter cannot run: .*'full' but"):
        run_synthesis(TINY, release=release, out_dir=tmp_path / "o", work_root=tmp_path / "w")
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()
