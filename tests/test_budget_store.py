"""Budgets that belong to the data, end to end: real Ray, real training, the real store.

A renamed run is refused before any stage; epsilons of a sweep on one corpus
compose per record; a pre-store run ledger is imported once; `privcode budget`
shows, raises and wipes; `make clean` leaves the store (test_record_groups); the store's
lifecycle (init, verify, no silent reset, wipe on record) is tests/test_store_lifecycle.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import init_store

from privcode.config import TrainConfig
from privcode.dp.accounting import DPEvent, epsilon
from privcode.errors import BudgetRefused, PrivcodeError
from privcode.privacy.ledger import Budget
from privcode.privacy.wal import write_new
from privcode.train.run import run_training

pytestmark = pytest.mark.ray

SMALL = TrainConfig(
    method="dpft",
    expected_batch_size=8,
    max_length=32,
    eval_tokens=0,
    checkpoint_every=50,
    num_workers=0,
    noise_multiplier=1.0,
    steps=3,
    epsilon=9.0,  # the cap of each job: this plan alone is ~4.1 (admission holds a job to it)
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from privcode.config import DataConfig
    from privcode.data.demo import build_demo_corpus

    out = tmp_path_factory.mktemp("corpus")
    cfg = DataConfig(
        size=40, canary_kinds=("email",), canary_placements=("joint",), canary_repetitions=(1,)
    )  # one canary row: at most 5% of the 36 members
    build_demo_corpus(out, cfg, progress=False)
    return out / "train.parquet"


def _train(cfg, data, base, store, name, **kwargs):
    return run_training(
        cfg,
        data_path=data,
        base_path=base,
        out_dir=store.parent / name / "release",
        run_name=name,
        storage_dir=store.parent / name / "storage",
        privacy_store=store,
        **kwargs,
    )


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "privcode.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_sweep_composes_per_record_and_a_legacy_ledger_counts(
    ray_connected, corpus, ci_model, tmp_path
):
    base_path = ci_model
    store = init_store(tmp_path / "privacy-store")
    from privcode.data.records import read_records

    q = SMALL.expected_batch_size / len(read_records(corpus))
    # A pre-store run ledger of this corpus (format 1): its 4 steps count once.
    legacy = tmp_path / "runs" / "old" / "ledger" / "abcd" / "ledger.wal"
    header = {"type": "header", "format": 1, "run_id": "old", "budget": 9.0, "delta": 1e-5}
    grant = {"type": "event", "noise_multiplier": 1.0, "sample_rate": q, "steps": 4}
    write_new(legacy, [{**header, "accountant": "rdp"}, {**grant, "seq": 1}])
    budget = Budget(9.0, 1e-5)
    a = _train(SMALL, corpus, base_path, store, "eps-a", budget=budget, legacy_ledgers=(legacy,))
    b = _train(SMALL, corpus, base_path, store, "eps-b", budget=budget, legacy_ledgers=(legacy,))
    one = epsilon([DPEvent(1.0, q, 3)], 1e-5)
    assert a.summary.epsilon == pytest.approx(one) and b.summary.epsilon == pytest.approx(one)
    assert a.summary.record_epsilon == pytest.approx(epsilon([DPEvent(1.0, q, 7)], 1e-5))
    assert b.summary.record_epsilon == pytest.approx(epsilon([DPEvent(1.0, q, 10)], 1e-5))
    # A third run asking for what is left and more is refused before it starts.
    big = dataclasses.replace(SMALL, steps=20)  # ~8.2 alone: under its cap, over what is left
    with pytest.raises(BudgetRefused, match="worst of the") as refused:
        _train(big, corpus, base_path, store, "eps-c", budget=budget)
    assert not (tmp_path / "eps-c" / "release").exists()
    assert "has spent epsilon" in str(refused.value)

    shown = json.loads(_cli("budget", "show", "--store", str(store), "--json").stdout)
    assert shown["budget"]["epsilon"] == 9.0 and len(shown["jobs"]) == 3
    assert [j["imported"] for j in shown["jobs"]] == [True, False, False]
    assert shown["epsilon_spent"] == pytest.approx(b.summary.record_epsilon)
    text = _cli("budget", "show", "--store", str(store)).stdout
    assert "worst record" in text and "record groups" in text
    # Raised on record only; wiped only when confirmed by path.
    out = _cli(
        "budget", "raise", "--store", str(store), "--epsilon", "8", "--who", "me", "--why", "x"
    )
    assert out.returncode == 2 and "does not raise" in out.stderr
    out = _cli("budget", "wipe", "--store", str(store))
    assert out.returncode == 2 and "--confirm" in out.stderr and store.is_dir()


def test_the_preflight_knows_records_by_their_training_rows(
    tiny_pipeline, ci_base_cache, monkeypatch
):
    """Once the run's base is built, the preflight asks with the same rows and tokenizer id
    as the train stage's admission (an edit past train.max_length is the same record)."""
    from conftest import tiny_pipeline_overrides

    from privcode.config import load_config
    from privcode.data.records import read_records
    from privcode.layout import RunLayout
    from privcode.models.encoding import encode_records
    from privcode.models.loading import load_tokenizer
    from privcode.pipeline import admission as preflight_module
    from privcode.pipeline.runner import read_manifest
    from privcode.privacy import admission
    from privcode.privacy.identities import tokenizer_id

    root, _ = tiny_pipeline
    cfg = load_config("jobs/configs/demo.yaml", tiny_pipeline_overrides(root, ci_base_cache))
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, force=True))
    asked = {}
    real = admission.admit

    def spy(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(admission, "admit", spy)
    preflight_module.preflight(cfg, ["train"])
    records = read_records(root / "runs" / "t" / "data" / "train.parquet")
    base = read_manifest(RunLayout.of(cfg).stage("base")).summary["path"]
    tokenizer = load_tokenizer(base)
    assert asked["reserve"] is False and asked["tokenizer"] == tokenizer_id(tokenizer)
    expected = encode_records(records, tokenizer, cfg.train.max_length)
    assert [r.input_ids for r in asked["rows"]] == [r.input_ids for r in expected]


def test_a_renamed_run_is_refused_before_any_stage(tiny_pipeline, ci_base_cache):
    from conftest import tiny_pipeline_overrides

    from privcode.config import load_config
    from privcode.pipeline.runner import run_pipeline

    root, _ = tiny_pipeline
    # The store's per-record budget is in the owner-only report, not the shareable one.
    report = (root / "reports" / "t" / "report.md").read_text()
    assert "Per-record budget" not in report and "worst record" not in report
    owner = (root / "runs" / "t" / "private_report" / "report.md").read_text()
    assert "### Per-record budget (privacy store)" in owner
    assert "worst record in the store" in owner and str(root) not in owner
    data = root / "runs" / "t" / "data" / "train.parquet"
    overrides = [
        *tiny_pipeline_overrides(root, ci_base_cache),
        "run.name=t-renamed",
        f"train.data={data}",
        "privacy.epsilon_budget=4.5",
    ]
    with pytest.raises(BudgetRefused, match="checked before any stage"):
        run_pipeline(load_config("jobs/configs/demo.yaml", overrides))
    # Without train.data too: the renamed run's data stage would build the same records
    # (same data section), so it is refused before its data stage runs.
    built_here = [o for o in overrides if not o.startswith("train.data=")]
    with pytest.raises(BudgetRefused, match="checked before any stage"):
        run_pipeline(load_config("jobs/configs/demo.yaml", built_here))
    assert not (root / "runs" / "t-renamed").exists() or not any(
        (root / "runs" / "t-renamed").glob("*/manifest.json")
    )
    # A budget above the store's is refused too: only `privcode budget raise` raises it.
    with pytest.raises(PrivcodeError, match="privcode budget raise"):
        run_pipeline(
            load_config("jobs/configs/demo.yaml", [*overrides, "privacy.epsilon_budget=100"])
        )
