"""The report split at the privacy boundary (issue 13, points 2 and 6), no Ray, no model.

The shareable report (``reports/<run>/`` and the report stage's artifact
directory) holds aggregates only: no per-record plot (the fidelity t-SNE), no
exact composition of the private corpus (``corpus.png``, PII and canary
counts), no corpus digest nor any 8+ character prefix of one, no restart
count, and no path to the owner-only report. The owner-only report
(``<run.out_dir>/<run>/private_report/``, directory 0700, files 0600) holds
those, under a header saying it is private.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from pathlib import Path

import numpy as np
import pytest
from conftest import as_manifests, base_summary, full_train_summary
from report_support import report_config
from test_fidelity import hashed_embedder

from privcode.pipeline.report import private_report_dir, write_report

PNG = b"\x89PNG\r\n\x1a\n"
DIGEST = hashlib.sha256(b"the private corpus, as train.parquet").hexdigest()
DATASET = "ds-" + "5e" * 10
# Distinctive, un-noised composition counts of the private corpus (owner-only).
COUNTS = {
    "train_records": 2625,
    "canaries": 59,
    "canary_records": 413,
    "pii_records": 317,
    "pii_email": 137,
    "pii_password": 181,
    "heldout": 271,
}
SHAREABLE = ("report.md", "report.html", "report.json")


def _png(path: Path, payload: bytes) -> bytes:
    """A stand-in PNG with a unique payload (to recognise its bytes wherever they go)."""
    blob = PNG + payload
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return blob


STAGES = "run.stages=[data, base, train, audit, report]"


def _inputs(tmp_path: Path, fidelity: dict) -> dict:
    data = {
        "stage": "data",
        "fingerprint": "fp-data",
        "timings": {"seconds": 1},
        "summary": {"counts": dict(COUNTS)},
    }
    base = {
        "stage": "base",
        "fingerprint": "fp-base",
        "timings": {"seconds": 2},
        "summary": base_summary(tmp_path / "base"),
    }
    train = {
        "stage": "train",
        "fingerprint": "fp-train",
        "timings": {"seconds": 3},
        "summary": full_train_summary(
            {
                "dp": True,
                "method": "privcode++",
                "dataset_id": DATASET,
                "rng": "secure",
                "adjacency": "add/remove one record (N public)",
                "accountant": "rdp",
                "epsilon": 3.9,
                "epsilon_rdp": 3.9,
                "epsilon_prv": 3.1,
                "epsilon_budget": 4.0,
                "delta": 1e-5,
                "noise_multiplier": 1.1,
                "sample_rate": 16 / 2625,
                "steps_taken": 30,
                "steps_requested": 30,
                "ledger_steps": 30,
                "num_records": 2625,
                "expected_batch_size": 16,
                "data_path": str(tmp_path / "runs/demo/data/train.parquet"),
                "public_heldout_loss_curve": [[0, 6.0], [15, 5.9], [30, 5.8]],
            }
        ),
    }
    audit = {
        "stage": "audit",
        "fingerprint": "fp-audit",
        "timings": {"seconds": 4},
        "inputs": {"train": "fp-train"},
        "summary": {
            "models": {
                "junior": {
                    "mia": {
                        "attacks": {
                            "loss": {"auc": 0.51, "tpr_at_1pct_fpr": 0.01, "tpr_at_10pct_fpr": 0.1},
                            "reference_calibrated": {
                                "auc": 0.52,
                                "tpr_at_1pct_fpr": 0.02,
                                "tpr_at_10pct_fpr": 0.11,
                            },
                        }
                    }
                }
            },
            "fidelity": fidelity,
            "audits": ["mia", "fidelity"],
            "seconds": 1.0,
        },
    }
    return as_manifests({"data": data, "base": base, "train": train, "audit": audit})


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _shareable_files(tmp_path: Path, stage: Path) -> list[Path]:
    return _files(stage) + _files(tmp_path / "reports" / "demo")


FIDELITY = {
    "bleu4": 0.41,
    "bleu4_corpus": 0.39,
    "ast_similarity": 0.62,
    "nn_cosine_mean": 0.83,
    "frechet": 0.27,
    "centroid_cosine": 0.97,
    "n_synthetic": 40,
    "n_private": 40,
    "projection": "tsne",
    "plot": "fidelity_tsne.png",
}


@pytest.fixture()
def rendered(tmp_path):
    """write_report over hand-made manifests, with the audit stage's t-SNE and ROC on disk,
    and files an older version published (t-SNE, corpus.png) in reports/<run>/."""
    cfg = report_config(tmp_path, STAGES)
    audit_dir = tmp_path / "runs" / "demo" / "audit"
    tsne = _png(audit_dir / "fidelity" / "fidelity_tsne.png", b"per-record t-SNE points")
    _png(audit_dir / "mia_roc.png", b"ROC curve, an aggregate")
    published = tmp_path / "reports" / "demo"
    _png(published / "fidelity_tsne.png", b"stale")
    _png(published / "corpus.png", b"stale")
    stage = tmp_path / "stage"
    stage.mkdir()
    summary = write_report(cfg, stage, _inputs(tmp_path, FIDELITY))
    return cfg, stage, summary, tsne


def test_shareable_report_holds_aggregates_only(rendered, tmp_path):
    cfg, stage, summary, tsne = rendered
    owner = private_report_dir(cfg)
    published = tmp_path / "reports" / "demo"
    # The stage's artifact directory holds exactly the shareable files; so does reports/<run>/.
    assert sorted(p.name for p in stage.iterdir()) == sorted([*SHAREABLE, *summary["plots"]])
    assert sorted(p.name for p in published.iterdir()) == sorted([*SHAREABLE, *summary["plots"]])
    assert "mia_roc.png" in summary["plots"]  # the ROC curve is an aggregate: it stays
    for directory in (stage, published):
        assert not (directory / "fidelity_tsne.png").exists()
        assert not (directory / "corpus.png").exists()
    files = _shareable_files(tmp_path, stage)
    for path in files:
        blob = path.read_bytes()
        lower = blob.lower()
        # No corpus digest, nor any 8+ character prefix (or substring) of it.
        assert not any(DIGEST[i : i + 8].encode() in lower for i in range(len(DIGEST) - 7)), path
        # No path to, or name of, the owner-only report.
        assert str(owner).encode() not in blob and b"private_report" not in blob, path
        assert blob != tsne and b"per-record t-SNE points" not in blob, path
    text = (stage / "report.md").read_text()
    html = (stage / "report.html").read_text()
    for doc in (text, html):
        assert "restart" not in doc.lower()
        assert "fidelity_tsne" not in doc and "corpus.png" not in doc
        assert "sha256" not in doc.lower()
        # The exact composition of the private corpus is not shared ...
        for kind in ("pii_email", "pii_password", "pii_records", "canary_records", "heldout"):
            assert kind not in doc, kind
    assert not re.search(r"\|\s*canaries\s*\|\s*59\s*\|", text)
    # ... only N, and the opaque dataset id, RNG and adjacency of the DP accounting.
    assert re.search(r"\|\s*training records N\s*\|\s*2625\s*\|", text)
    assert f"`{DATASET}`" in text and f"| {DATASET} |" in text
    assert re.search(r"\|[^|\n]*randomness[^|\n]*\|\s*secure\s*\|", text)
    assert "add/remove one record (N public)" in text
    # The fidelity aggregates stay.
    assert re.search(r"\|\s*nn_cosine_mean\s*\|\s*0\.830\s*\|", text)
    saved = json.loads((published / "report.json").read_text())
    assert "corpus_counts" not in saved and "private_report" not in saved
    assert saved["training_records"] == 2625
    assert "restarts" not in json.dumps(saved)


def test_owner_report_holds_the_private_parts_with_owner_only_modes(rendered):
    cfg, _, summary, tsne = rendered
    owner = private_report_dir(cfg)
    assert owner == Path(cfg.run.out_dir).resolve() / "demo" / "private_report"
    assert summary["private_report"] == str(owner / "report.md")
    assert stat.S_IMODE(owner.stat().st_mode) == 0o700
    names = sorted(p.name for p in owner.iterdir())
    assert names == ["corpus.png", "fidelity_tsne.png", "report.html", "report.md"]
    for path in owner.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (owner / "fidelity_tsne.png").read_bytes() == tsne
    assert (owner / "corpus.png").read_bytes()[:8] == PNG
    text = (owner / "report.md").read_text()
    assert "PRIVATE" in text and "do not share" in text
    assert "![t-SNE of synthetic vs private code](fidelity_tsne.png)" in text
    assert "![corpus composition](corpus.png)" in text
    for kind, count in COUNTS.items():
        assert re.search(rf"\|\s*{kind}\s*\|\s*{count}\s*\|", text), kind
    assert "data:image/png;base64," in (owner / "report.html").read_text()


def test_owner_report_tightens_modes_and_drops_stale_plots(tmp_path):
    """An owner directory left world-readable is tightened; plots it no longer shows go."""
    cfg = report_config(tmp_path, STAGES)
    owner = private_report_dir(cfg)
    owner.mkdir(parents=True)
    owner.chmod(0o755)
    _png(owner / "fidelity_tsne.png", b"an older t-SNE")
    (owner / "report.md").write_text("old")
    (owner / "report.md").chmod(0o644)
    stage = tmp_path / "stage"
    stage.mkdir()
    inputs = _inputs(tmp_path, {})
    del inputs["audit"]
    write_report(cfg, stage, inputs)
    assert stat.S_IMODE(owner.stat().st_mode) == 0o700
    assert sorted(p.name for p in owner.iterdir()) == ["corpus.png", "report.html", "report.md"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in owner.iterdir())


# --------------------------------------------------------------------------- a real fidelity run


def _private_codes() -> list[str]:
    return [
        f"def private_handler_{i}(token):\n"
        f"    secret = 'sk-owner-{i:03d}-{7919 * (i + 3)}'\n"
        f"    return token.replace('acct_{i}', secret) + '{'x' * i}'\n"
        for i in range(8)
    ]


def _synthetic_codes() -> list[str]:
    return [f"def helper_{i}(values):\n    return sorted(values)[:{i + 1}]\n" for i in range(6)]


def _coordinate_strings(coords: np.ndarray) -> set[str]:
    out = set()
    for x in coords.ravel():
        out |= {repr(float(x)), f"{x:.6f}", f"{x:.4f}", str(np.float32(x))}
    return {s for s in out if len(s.lstrip("-")) >= 6}  # long enough not to occur by chance


def test_real_fidelity_run_leaves_no_private_code_or_coordinate_in_the_shareable_report(tmp_path):
    from privcode.audit.fidelity import _project_2d, fidelity_report

    cfg = report_config(tmp_path, STAGES)
    private, synthetic = _private_codes(), _synthetic_codes()
    audit_dir = tmp_path / "runs" / "demo" / "audit"
    fid = fidelity_report(
        synthetic, private, audit_dir / "fidelity", seed=3, embedder=hashed_embedder
    )
    assert fid["projection"] == "tsne" and (audit_dir / "fidelity" / "fidelity_tsne.png").is_file()
    # The same projection the plot drew: the private records' 2-D coordinates.
    coords, _ = _project_2d(np.vstack([hashed_embedder(synthetic), hashed_embedder(private)]), 3)
    private_coords = _coordinate_strings(coords[len(synthetic) :])
    assert private_coords
    stage = tmp_path / "stage"
    stage.mkdir()
    summary = write_report(cfg, stage, _inputs(tmp_path, fid))
    secrets = [
        *private,
        *(line.strip() for c in private for line in c.splitlines() if len(line.strip()) >= 20),
    ]
    tsne = (audit_dir / "fidelity" / "fidelity_tsne.png").read_bytes()
    files = _shareable_files(tmp_path, stage)
    assert {p.name for p in files} >= set(SHAREABLE)
    for path in files:
        blob = path.read_bytes()
        assert blob != tsne, path
        assert not [s for s in secrets if s.encode() in blob], path
        if path.suffix in (".md", ".html", ".json"):
            text = path.read_text()
            assert not [c for c in private_coords if c in text], path
    assert f"{fid['nn_cosine_mean']:.3f}" in (stage / "report.md").read_text()
    # The plot went to the owner-only report, unchanged.
    owner = Path(summary["private_report"]).parent
    assert (owner / "fidelity_tsne.png").read_bytes() == tsne
