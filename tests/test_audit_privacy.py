"""Privacy audits (privcode.audit): MIA metrics, the DP ceiling, canary leakage and exposure.

The metric tests use synthetic scores with known answers. The model tests
fine-tune the tiny ``ci`` base model WITHOUT DP on a few snippets holding
one canary value (a planted model), then check that the leakage audit finds
it, that its exposure is at the maximum log2(K + 1) while an unplanted
canary's is not, and that record losses of the trained snippets are lower
than those of unseen ones.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import privacy_record

from privcode.audit.canaries import canary_leakage, inducing_contexts, load_canaries
from privcode.audit.exposure import canary_exposure, exposure_from_scores, extrapolated_exposure
from privcode.audit.mia import (
    auc,
    check_against_dp,
    dp_tpr_ceiling,
    mia_metrics,
    pld_tpr_ceiling,
    plot_roc,
    roc_curve,
    run_mia,
    tpr_at_fpr,
)
from privcode.audit.scoring import (
    AuditError,
    ScoredModel,
    load_scored_model,
    record_losses,
    sequence_logprobs,
)
from privcode.data.canaries import sample_canary_value
from privcode.data.records import Record

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------- MIA metrics


def test_perfectly_separated_scores():
    rng = np.random.default_rng(0)
    m, n = rng.normal(10, 1, 500), rng.normal(0, 1, 500)
    out = mia_metrics(m, n)
    assert out["auc"] == 1.0
    assert out["tpr_at_1pct_fpr"] == 1.0 and out["tpr_at_10pct_fpr"] == 1.0
    assert out["n_members"] == out["n_nonmembers"] == 500
    assert out["roc"]["fpr"][0] == 0.0 and out["roc"]["tpr"][-1] == 1.0


def test_identical_distributions_give_chance():
    rng = np.random.default_rng(1)
    out = mia_metrics(rng.normal(size=20_000), rng.normal(size=20_000))
    assert abs(out["auc"] - 0.5) < 0.01
    assert out["tpr_at_1pct_fpr"] < 0.02 and abs(out["tpr_at_10pct_fpr"] - 0.1) < 0.015
    assert len(out["roc"]["fpr"]) <= 201  # down-sampled for the summary


def test_hand_computed_auc_and_ties():
    fpr, tpr, thr = roc_curve([3, 2, 1], [2.5, 0, -1])
    assert auc(fpr, tpr) == pytest.approx(7 / 9)
    assert thr[0] == np.inf and fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    # Ties count one half: pairs (1,1) x2 -> 0.5 each, (1,0) x2 -> 1 each: 3/4.
    fpr, tpr, _ = roc_curve([1, 1], [1, 0])
    assert auc(fpr, tpr) == pytest.approx(0.75)
    with pytest.raises(AuditError, match="non-finite"):
        roc_curve([1, np.nan], [0])


def test_tpr_at_fpr_is_conservative():
    fpr = [0.0, 0.005, 0.02, 0.1, 1.0]
    tpr = [0.0, 0.3, 0.5, 0.7, 1.0]
    assert tpr_at_fpr(fpr, tpr, 0.01) == 0.3  # no interpolation towards 0.5
    assert tpr_at_fpr(fpr, tpr, 0.1) == 0.7
    assert tpr_at_fpr(fpr, tpr, 0.0) == 0.0
    assert tpr_at_fpr(fpr, tpr, 0.5) == 0.7


def test_dp_ceiling_values():
    f = np.array([0.0, 0.1, 0.5, 0.8, 1.0])
    assert np.allclose(dp_tpr_ceiling(f, 0.0, 0.01), np.minimum(f + 0.01, 1))
    assert np.allclose(dp_tpr_ceiling(f, math.log(2), 0.0), [0.0, 0.2, 0.75, 0.9, 1.0])
    assert np.allclose(dp_tpr_ceiling(0.01, 1.0, 1e-5), math.e * 0.01 + 1e-5)
    with pytest.raises(AuditError):
        dp_tpr_ceiling(0.1, -1.0, 1e-5)


def test_pld_ceiling_is_tighter_than_the_closed_form():
    from privcode.dp.accounting import DPEvent, epsilon

    history = [{"noise_multiplier": 0.8, "sample_rate": 0.02, "steps": 100}]
    eps_rdp = epsilon(DPEvent(0.8, 0.02, 100), 1e-5)
    grid = np.concatenate([[0.0], np.geomspace(1e-3, 0.5, 15), np.linspace(0.5, eps_rdp, 15)])
    f = np.array([0.0, 1e-3, 0.01, 0.1, 0.3, 0.7])
    pld = pld_tpr_ceiling(f, history, epsilons=grid)
    closed = dp_tpr_ceiling(f, eps_rdp, 1e-5)
    assert np.all(pld <= closed + 1e-12)
    assert np.all(pld >= f - 1e-12)  # never below the trivial test
    assert np.any(pld < closed - 1e-3)  # and genuinely tighter somewhere


def test_check_against_dp_flags_a_violation(caplog):
    rng = np.random.default_rng(2)
    m, n = rng.normal(3, 1, 2000), rng.normal(0, 1, 2000)
    with caplog.at_level(logging.WARNING, logger="privcode.audit"):
        out = check_against_dp(m, n, 0.1, 1e-5)
    assert out["violated"] and any(p["violated"] for p in out["points"])
    assert "DP CEILING" in caplog.text
    # The same scores are consistent with a weak guarantee ...
    assert not check_against_dp(m, n, 8.0, 1e-5)["violated"]
    # ... and random scores never violate even a tight one.
    for seed in range(3):
        r = np.random.default_rng(10 + seed)
        out = check_against_dp(
            r.normal(size=2000),
            r.normal(size=2000),
            0.1,
            1e-5,
            history=[{"noise_multiplier": 5.0, "sample_rate": 0.01, "steps": 10}],
        )
        assert not out["violated"] and out["ceiling"] == "pld+closed-form"


def test_plot_roc(tmp_path):
    rng = np.random.default_rng(3)
    res = {
        "attacks": {"loss": mia_metrics(rng.normal(0.5, 1, 300), rng.normal(size=300))},
        "dp": {"epsilon": 2.0, "delta": 1e-5},
    }
    path = plot_roc(res, tmp_path / "roc.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["roc.png"]


def test_exposure_estimators():
    assert exposure_from_scores(5.0, [1, 2, 3]) == (1, 2.0)
    assert exposure_from_scores(2.0, [1, 2, 3])[0] == 3  # the tie counts against it
    rng = np.random.default_rng(4)
    cands = rng.normal(size=1000)
    assert extrapolated_exposure(0.0, cands, fit="normal") == pytest.approx(1.0, abs=0.1)
    assert extrapolated_exposure(6.0, cands, fit="normal", space_bits=12.0) == 12.0
    assert extrapolated_exposure(3.0, cands) > 5


# --------------------------------------------------------------------------- planted model


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.config import BaseConfig
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


PLANTED = sample_canary_value("email", random.Random(123))
OTHER_EMAIL = sample_canary_value("email", random.Random(456))
OTHER_PASSWORD = sample_canary_value("password", random.Random(789))
_TRAIN = [
    f'ADMIN_EMAIL = "{PLANTED}"\n',
    f'import smtplib\n\nADMIN_EMAIL = "{PLANTED}"\n',
    f'def notify(msg):\n    ADMIN_EMAIL = "{PLANTED}"\n    return ADMIN_EMAIL, msg\n',
    f'# settings\nDEBUG = False\nADMIN_EMAIL = "{PLANTED}"\n',
    f'ADMIN_EMAIL = "{PLANTED}"\nTIMEOUT = 30\n',
    f'class Config:\n    ADMIN_EMAIL = "{PLANTED}"\n',
]
_UNSEEN = [
    "def area(radius):\n    return 3.14159 * radius ** 2\n",
    "import os\n\nBASE_DIR = os.path.dirname(__file__)\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "# constants\nRETRIES = 5\nVERBOSE = True\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "def is_even(k):\n    return k % 2 == 0\n",
]


def _records(codes, tag):
    return [Record(id=f"{tag}-{i}", prompt="", code=c) for i, c in enumerate(codes)]


@pytest.fixture(scope="module")
def planted_dir(base_path, tmp_path_factory) -> Path:
    """The ci base fully fine-tuned WITHOUT DP by the audits' nondpft trainer (100 steps,
    every record in every batch) on the six canary snippets."""
    from privcode.config import load_config
    from privcode.data.records import write_records
    from privcode.train.nondp import MARKER, train_nondp_comparison

    root = tmp_path_factory.mktemp("planted")
    write_records(_records(_TRAIN, "m"), root / "train.jsonl")
    cfg = load_config(
        None,
        [
            "train.max_length=64",
            "audit.nondp_finetune=full",
            "audit.nondp_steps=100",
            "audit.nondp_lr=0.003",
            f"audit.nondp_batch_size={len(_TRAIN)}",
        ],
    )
    with pytest.warns(RuntimeWarning, match="NOT PRIVATE"):
        summary = train_nondp_comparison(
            cfg, data=root / "train.jsonl", base=base_path, out_dir=root / "nondpft"
        )
    assert summary["finetune"] == "full" and summary["steps"] == 100
    marker = json.loads((root / "nondpft" / MARKER).read_text())
    assert marker["dp"] is False and "WITHOUT differential privacy" in marker["NOT_PRIVATE"]
    assert marker["training_mode"]["mode"] == "non-private"
    assert marker["training_mode"]["reason"].startswith("audit.compare_nondp")
    assert all(c not in json.dumps(marker) for c in _TRAIN)
    return root / "nondpft"


@pytest.fixture(scope="module")
def planted(planted_dir) -> ScoredModel:
    model = load_scored_model(planted_dir)
    assert model.info["kind"] == "nondpft" and model.info["dp"] is False
    assert model.loss_on_prompt and model.conditioning == "prompt"
    return model


def test_nondp_lora_trains_the_junior_adapter_only(base_path, tmp_path):
    """'lora' mode trains exactly the DP run's LoRA parameters; 'full' trains every weight."""
    from privcode.config import load_config
    from privcode.data.records import write_records
    from privcode.models.loading import attach_lora, count_parameters, load_causal_lm
    from privcode.train.nondp import train_nondp_comparison

    write_records(_records(_TRAIN, "m"), tmp_path / "train.jsonl")
    cfg = load_config(
        None,
        [
            "train.max_length=64",
            "train.lora_r=4",
            "train.lora_alpha=8",
            "audit.nondp_steps=3",
            "audit.nondp_lr=0.001",
        ],
    )
    with pytest.warns(RuntimeWarning, match="NOT PRIVATE"):
        summary = train_nondp_comparison(
            cfg, data=tmp_path / "train.jsonl", base=base_path, out_dir=tmp_path / "lora"
        )
    lora_trainable, _ = count_parameters(attach_lora(load_causal_lm(base_path), r=4, alpha=8))
    assert summary["finetune"] == "lora" and summary["lora_r"] == 4
    assert summary["trainable_parameters"] == lora_trainable
    merged = load_scored_model(tmp_path / "lora")
    base = load_causal_lm(base_path)
    assert sum(p.numel() for p in merged.model.parameters()) == sum(
        p.numel() for p in base.parameters()
    )  # LoRA merged into a plain model


def _canaries():
    return [
        {
            "id": "email-code-r100",
            "kind": "email",
            "placement": "code",
            "repetitions": 100,
            "value": PLANTED,
            "code_prefix": 'ADMIN_EMAIL = "',
            "prompt_prefix": None,
        },
        {
            "id": "email-code-r5",
            "kind": "email",
            "placement": "code",
            "repetitions": 5,
            "value": OTHER_EMAIL,
            "code_prefix": 'ADMIN_EMAIL = "',
            "prompt_prefix": None,
        },
        {
            "id": "password-joint-r5",
            "kind": "password",
            "placement": "joint",
            "repetitions": 5,
            "value": OTHER_PASSWORD,
            "code_prefix": 'DB_PASSWORD = "',
            "prompt_prefix": "The service account password is ",
            "format": {"space_bits": 90.0},
        },
    ]


def test_sequence_logprobs_match_a_direct_computation(planted):
    tok, model = planted.tokenizer, planted.model
    prefix, cont = 'HOST = "', "10.120.130.140"
    ids = tok(prefix + cont, add_special_tokens=False)["input_ids"]
    n_prefix = len(tok(prefix, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    direct = sum(float(lp[t - 1, ids[t]]) for t in range(n_prefix, len(ids)))
    got = sequence_logprobs(
        model, tok, [prefix, "x = 1\n", prefix], [cont, "y = 2", cont], batch_size=2
    )
    assert got[0] == pytest.approx(direct, abs=1e-4) and got[2] == pytest.approx(got[0])
    assert np.allclose(
        sequence_logprobs(planted, None, ["x = 1\n"], ["y = 2"], batch_size=1), got[1], atol=1e-4
    )  # padding does not change a row's score


def test_leakage_detects_the_planted_canary(planted, tmp_path):
    details = tmp_path / "leakage_private.json"
    out = canary_leakage(planted, _canaries(), samples_per_context=4, seed=0, details_path=details)
    by_id = {r["id"]: r for r in out["categories"]}
    assert by_id["email-code-r100"]["leaked"] and by_id["email-code-r100"]["hits"] > 0
    assert not by_id["email-code-r5"]["leaked"] and not by_id["password-joint-r5"]["leaked"]
    assert out["leaked"] == 1 and out["total"] == 3
    assert out["rates"]["overall"] == pytest.approx(1 / 3)
    assert out["rates"]["by_placement_repetitions"]["code"] == {"5": 0.0, "100": 1.0}
    # The summary carries no canary value; the private file does, with mode 0600.
    text = json.dumps(out)
    assert all(v not in text for v in (PLANTED, OTHER_EMAIL, OTHER_PASSWORD))
    assert stat.S_IMODE(os.stat(details).st_mode) == 0o600
    private = json.loads(details.read_text())
    assert private["PRIVATE"].startswith("PRIVATE")
    assert {c["value"] for c in private["canaries"] if c["leaked"]} == {PLANTED}
    # Same seed, same result.
    again = canary_leakage(planted, _canaries(), samples_per_context=4, seed=0)
    assert again["categories"] == out["categories"]


def test_exposure_of_the_planted_canary_is_maximal(planted):
    out = canary_exposure(planted, _canaries(), num_candidates=100, seed=0)
    top = math.log2(101)
    assert out["max_exposure_bits"] == pytest.approx(top)
    by_id = {r["id"]: r for r in out["canaries"]}
    hot = by_id["email-code-r100"]
    assert hot["rank"] == 1 and hot["exposure"] == pytest.approx(top)
    for cid in ("email-code-r5", "password-joint-r5"):
        assert by_id[cid]["exposure"] < top - 1.0
        assert by_id[cid]["exposure_extrapolated"] < hot["exposure_extrapolated"]
    assert set(by_id["password-joint-r5"]["by_context"]) == {"code", "prompt"}
    assert by_id["password-joint-r5"]["exposure_extrapolated"] <= 90.0
    assert all(v not in json.dumps(out) for v in (PLANTED, OTHER_EMAIL, OTHER_PASSWORD))


def test_record_losses_members_below_unseen(planted, base_path):
    from privcode.models.loading import load_causal_lm, load_tokenizer

    members, unseen = _records(_TRAIN, "m"), _records(_UNSEEN, "u")
    lm, lu = record_losses(planted, None, members), record_losses(planted, None, unseen)
    assert lm.shape == (6,) and np.all(np.isfinite(lm))
    assert lm.max() < lu.min()
    reference = ScoredModel(model=load_causal_lm(base_path), tokenizer=load_tokenizer(base_path))
    res = run_mia(planted, reference, members, unseen, epsilon=1.0, delta=1e-5)
    assert res["attacks"]["loss"]["auc"] == 1.0
    assert res["attacks"]["reference_calibrated"]["auc"] > 0.9
    assert set(res["dp"]["checks"]) == {"loss", "reference_calibrated"}
    assert isinstance(res["violated"], bool) and res["mean_loss"]["members"] < 0.2
    assert all(c not in json.dumps(res) for c in _TRAIN)

    # One audit run scores the reference once per format and record set.
    import privcode.audit.scoring as scoring

    calls = []
    real = scoring.record_losses
    counting = lambda sm, *a, **k: calls.append(sm) or real(sm, *a, **k)  # noqa: E731
    cache: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scoring, "record_losses", counting)
        first = run_mia(planted, reference, members, unseen, reference_cache=cache)
        second = run_mia(planted, reference, members, unseen, reference_cache=cache)
        other = run_mia(planted, reference, members[:4], unseen, reference_cache=cache)
    assert sum(sm is reference for sm in calls) == 4  # 2 for the first set, 2 for members[:4]
    assert first["attacks"] == second["attacks"] == res["attacks"]
    assert other["attacks"]["loss"]["n_members"] == 4

    # A model trained without the prompt in its loss (premium) after one with it (nondpft):
    # other loss masks, the same reference token log-probs, not rescored.
    import dataclasses

    scored, real_rows = [], scoring._row_logprobs
    flipped = dataclasses.replace(planted, loss_on_prompt=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            scoring,
            "_row_logprobs",
            lambda sm, *a, **k: scored.append(sm) or real_rows(sm, *a, **k),
        )
        run_mia(flipped, reference, members, unseen, reference_cache=cache)
        fresh = run_mia(flipped, reference, members, unseen)
    assert sum(sm is reference for sm in scored) == 2  # only the run without the cache
    assert (
        cache
        and fresh["attacks"]
        == run_mia(flipped, reference, members, unseen, reference_cache=cache)["attacks"]
    )


def test_load_scored_model_detects_what_a_path_holds(planted, base_path, tmp_path):
    from privcode.models.loading import attach_lora, load_causal_lm
    from privcode.train.release import write_release

    planted.model.save_pretrained(tmp_path / "plain")
    planted.tokenizer.save_pretrained(tmp_path / "plain")
    plain = load_scored_model(tmp_path / "plain")
    assert plain.info["kind"] == "model" and plain.conditioning == "prompt"
    pair = (['ADMIN_EMAIL = "'], [PLANTED])
    assert np.allclose(
        sequence_logprobs(plain, None, *pair), sequence_logprobs(planted, None, *pair), atol=1e-4
    )

    torch.manual_seed(0)
    lora = attach_lora(load_causal_lm(base_path), r=2, alpha=4)
    lora.save_pretrained(str(tmp_path / "adapter"))
    adapter = load_scored_model(tmp_path / "adapter", base_model=base_path)
    assert adapter.info["kind"] == "adapter"

    hidden, k, dz = lora.config.hidden_size, 4, 8
    history = [{"noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 5}]
    write_release(
        tmp_path / "release",
        adapter_dir=tmp_path / "adapter",
        meta={
            "method": "privcode++",
            "conditioning": "latent",
            "dp": True,
            "base_model": base_path,
            "prefix": {"dz": dz, "num_virtual_tokens": k, "hidden_size": hidden},
        },
        privacy=privacy_record(epsilon=2.0, history=history),
        prefix_decoder={
            "weight": torch.randn(k * hidden, dz) * 0.02,
            "bias": torch.zeros(k * hidden),
        },
    )
    junior = load_scored_model(tmp_path / "release", latent_samples=3)
    assert junior.conditioning == "latent" and junior.info["dp"] is True
    assert junior.info["epsilon"] == 2.0 and junior.info["history"] == history
    losses = record_losses(junior, None, _records(_UNSEEN[:3], "u"))
    assert losses.shape == (3,) and np.all(np.isfinite(losses))
    samples = canary_leakage(junior, _canaries()[:1], samples_per_context=2)
    contexts = {text for _, text in inducing_contexts(_canaries()[0])}
    assert samples["generations"] == 2 * len(contexts)
    with pytest.raises(AuditError, match="cannot load"):
        load_scored_model(tmp_path / "missing")


def test_load_canaries_reads_the_data_stage_file(tmp_path):
    path = tmp_path / "canaries.json"
    path.write_text(json.dumps({"canaries": _canaries()}))
    assert [c["id"] for c in load_canaries(path)] == [c["id"] for c in _canaries()]
    no_value = [{**_canaries()[0], "value": None}]
    with pytest.raises(AuditError, match="lacks"):
        load_canaries(no_value)
