"""The one-screen end-of-run summary: every line from the manifests' aggregates."""

from __future__ import annotations

import json

from conftest import as_manifests, full_train_summary, premium_json

from privcode.pipeline.summary import run_summary

SYNTH = dict(
    shards=1,
    shards_resumed=0,
    shards_written=1,
    generated_this_run=1000,
    rates={},
    execution_statuses={},
    seconds=211.0,
    samples_per_second=4.7,
    release="release",
    release_sha256="0" * 64,
    synthetic_sha256="1" * 64,
    work_dir="synth",
    conditioning="latent",
    method="privcode++",
    dp=True,
    epsilon=3.9995,
    delta=1e-5,
    privacy_warning=None,
)
PREMIUM = json.loads(premium_json("base"))
MANIFESTS = {
    "train": {
        "summary": full_train_summary(
            {
                "dp": True,
                "epsilon": 3.9995,
                "epsilon_budget": 4.0,
                "delta": 1e-5,
                "accountant": "rdp",
                "steps_taken": 30,
                "noise_multiplier": 0.563,
                "method": "privcode++",
            }
        )
    },
    "synth": {
        "summary": {
            **SYNTH,
            "generated": 1000,
            "kept": 312,
            "removed_execution": 435,
            "removed_roundtrip": 59,
            "removed_duplicate": 194,
        }
    },
    "premium": {
        "summary": {
            **{k: PREMIUM[k] for k in ("model", "data_sha256", "train_seconds", "privacy")},
            "records": 312,
            "curve": [{"epoch": 2, "eval_loss": 0.859}],
        }
    },
    "eval": {
        "summary": {
            "benchmark": "humaneval",
            "benchmark_file": "HumanEval.jsonl.gz",
            "limit": 40,
            "models": {
                "base": {
                    "n_tasks": 40,
                    "pass_at_k": {"pass@1": 0.025},
                    "pass@1_ci95": [0.004431, 0.128837],
                },
                "junior": {"n_tasks": 40, "pass_at_k": {"pass@1": 0.0}},
            },
        }
    },
    "audit": {
        "summary": {
            "audits": ["canaries", "exposure", "mia"],
            "seconds": 60.0,
            "models": {
                "junior": {
                    "non_private": False,
                    "canaries": {"leaked": 0, "total": 45},
                    "exposure": {"mean_bits": 1.21},
                    "mia": {
                        "attacks": {
                            "loss": {"auc": 0.508, "tpr_at_1pct_fpr": 0.01},
                            "reference_calibrated": {"auc": 0.512, "tpr_at_1pct_fpr": 0.02},
                        }
                    },
                },
                "nondpft": {
                    "non_private": True,
                    "canaries": {"leaked": 8, "total": 45},
                    "exposure": {"mean_bits": 4.46},
                    "mia": {"attacks": {"loss": {"auc": 0.724, "tpr_at_1pct_fpr": 0.315}}},
                },
            },
        }
    },
    "pac": {
        "summary": {
            "m": 8,
            "top_k": 8,
            "utility": {"accuracy": {"pac": 0.1875, "world": 0.2305, "public": 0.2148}},
            "leakage": {"charged_nats": 0.000419},
            "canary_emission": None,
            "budget": {},
            "seconds": 30.0,
            "worlds": {},
            "worlds_dir": "worlds",
        }
    },
    "report": {
        "summary": {
            "report": "reports/demo/report.md",
            "private_report": "runs/demo/private_report/report.md",
        }
    },
}


def test_summary_lines_hold_the_numbers_of_every_stage():
    stages = {
        "train": {"status": "ran", "seconds": 75.0},
        "synth": {"status": "ran", "seconds": 211.0},
        "eval": {"status": "skipped"},
    }
    text = run_summary("demo", stages, as_manifests(MANIFESTS), wall_seconds=301).format()
    lines = text.splitlines()
    assert lines[0] == "privcode run 'demo' done in 5m01s: 2 stage(s) ran, 1 unchanged (cached)"
    assert "epsilon 4.00 of 4.00 (delta 1e-05, rdp); 30 steps, sigma 0.56, privcode++" in text
    assert "kept 312/1000 (31%); removed: exec 435, round-trip 59, dup 194" in text
    assert "trained on 312 synthetic records, eval loss 0.859 (DP by post-processing)" in text
    # the trade-off leads: utility and leakage per model, side by side
    assert lines[2:6] == [
        "  trade-off  model    pass@1 humaneval (40)   leaked exposure MIA AUC",
        "             base       2.5% [ 0.4, 12.9]          -        -       -",
        "             junior     0.0%                    0/45      1.2    0.51",
        "             non-DP   -                         8/45      4.5    0.72",  # strongest MIA
    ]
    assert "accuracy 18.8% (one world 23.1%, public 21.5%), m=8; 0.00042 nats/session" in text
    assert "time       train 1m15s, synth 3m31s" in text
    assert "reports/demo/report.md (aggregates only, shareable)" in text
    assert "runs/demo/private_report/report.md (owner only" in text
    assert all(len(line) <= 90 for line in lines), max(lines, key=len)


def test_summary_lists_private_models_first_whatever_the_manifest_order():
    audit = MANIFESTS["audit"]["summary"]["models"]
    premium = {"non_private": False, "canaries": {"leaked": 0, "total": 45}}
    both = {**audit, "premium": premium}
    for models in (both, dict(sorted(both.items()))):
        audit_summary = {**MANIFESTS["audit"]["summary"], "models": models}
        manifests = {**MANIFESTS, "audit": {"summary": audit_summary}}
        text = run_summary("demo", {}, as_manifests(manifests)).format()
        rows = [line.split()[0] for line in text.splitlines()[4:7]]
        assert rows == ["junior", "premium", "non-DP"]


def test_summary_leaves_out_stages_that_are_absent_and_flags_no_dp():
    train = full_train_summary({"dp": False, "method": "nondpft"})
    manifests = {"train": {"summary": train}}
    s = run_summary("x", {"train": {"status": "ran", "seconds": 3}}, as_manifests(manifests), 3)
    assert [label for label, _ in s.lines] == ["privacy"]
    assert "NO DP" in s.format() and s.report is None


def test_a_summary_of_another_shape_loses_its_line_not_the_run(caplog):
    renamed = {k: v for k, v in MANIFESTS["synth"]["summary"].items() if k != "kept"}
    manifests = {**MANIFESTS, "synth": {"summary": {**renamed, "retained": 312}}}
    text = run_summary("demo", {}, as_manifests(manifests)).format()
    assert "synthesis" not in text and "epsilon 4.00 of 4.00" in text
    assert "unknown keys ['retained']" in caplog.text
