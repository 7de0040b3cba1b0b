"""The premium fine-tune: LoRA on synthetic data with Ray Train, no DP, refuses private data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from privcode.config import BaseConfig, DataConfig, PremiumConfig
from privcode.premium.train import PremiumError, deepspeed_config, run_premium

#: The provenance Stage II writes for a DP release (privcode.synth.pipeline._provenance).
DP_PROVENANCE = {
    "release_sha256": "ab" * 32,
    "method": "privcode++",
    "conditioning": "latent",
    "dp": True,
    "epsilon": 4.0,
    "delta": 1e-5,
}
NON_DP_PROVENANCE = {
    **DP_PROVENANCE,
    "method": "nondpft",
    "conditioning": "prompt",
    "dp": False,
    "epsilon": None,
    "delta": None,
    "no_dp_guarantee": True,
    "NOT_PRIVATE": "NO differential-privacy guarantee: ...",
}


def _synthetic(path: Path, n: int, provenance=DP_PROVENANCE) -> Path:
    """``n`` public pairs with Stage II's columns; ``provenance``: a dict (JSON-encoded), a
    string as is, or a callable of the row index (mixed provenance)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from privcode.data.public import public_pairs

    def prov(i: int):
        value = provenance(i) if callable(provenance) else provenance
        return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value

    rows = [
        {"id": f"syn-{i}", "prompt": p, "code": c, "provenance": prov(i)}
        for i, (p, c) in enumerate(public_pairs(n, seed=3))
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def no_training(monkeypatch):
    """Fails a test that connects to Ray or starts a Ray Train fine-tune."""
    import ray.train.torch
    from conftest import forbid_calls

    import privcode.cluster.local

    forbid_calls(
        monkeypatch,
        "run_premium must refuse before connecting to Ray or training",
        (privcode.cluster.local, "connect"),
        (ray.train.torch, "TorchTrainer"),
    )


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def test_premium_learns_the_synthetic_data_and_inherits_the_release_guarantee(
    ray_connected, base_path, tmp_path
):
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm

    data = _synthetic(tmp_path / "synthetic.parquet", 48)
    # Ray Train's local mode (the demo's setting); test_premium_with_deepspeed_zero1_on_cpu
    # trains in a worker group.
    cfg = PremiumConfig(
        epochs=3,
        batch_size=8,
        lr=3e-3,
        lora_r=4,
        lora_alpha=8,
        max_length=96,
        eval_fraction=0.1,
        num_workers=0,
    )
    summary = run_premium(
        cfg,
        data_path=data,
        model_path=base_path,
        out_dir=tmp_path / "out",
        storage_dir=tmp_path / "storage",
    )
    curve = summary["curve"]
    assert [p["epoch"] for p in curve] == [1, 2, 3]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"]  # it fits the synthetic data
    assert all(p["eval_loss"] is not None for p in curve)
    info = json.loads((tmp_path / "out" / "premium.json").read_text())
    assert info["privacy"]["dp_training"] is False
    assert info["privacy"]["post_processing_of"]["method"] == "privcode++"
    assert info["privacy"]["dp"] is True and info["privacy"]["no_dp_guarantee"] is False
    assert (info["privacy"]["epsilon"], info["privacy"]["delta"]) == (4.0, 1e-5)
    assert info["privacy"]["guarantee"].startswith("(4.0, 1e-05)-DP, inherited by post-processing")
    assert summary["privacy"] == info["privacy"]
    from privcode.models.chat import CHAT_TEMPLATE

    assert info["chat_template"] == CHAT_TEMPLATE  # what serving renders chats with
    model = PeftModel.from_pretrained(load_causal_lm(base_path), str(tmp_path / "out" / "adapter"))
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
    assert not any((tmp_path / "storage").glob("premium-*"))  # local checkpoints removed


def test_premium_refuses_data_that_is_not_synthetic(tmp_path, base_path):
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
    with pytest.raises(PremiumError, match="not a Stage II synthetic dataset"):
        run_premium(
            PremiumConfig(),
            data_path=corpus / "train.parquet",
            model_path=base_path,
            out_dir=tmp_path / "out",
            storage_dir=tmp_path / "s",
        )
    assert not (tmp_path / "out").exists()


def test_premium_refuses_a_non_dp_source_without_the_option(no_training, tmp_path):
    data = _synthetic(tmp_path / "synthetic.parquet", 8, NON_DP_PROVENANCE)
    with pytest.raises(
        PremiumError,
        match=r"synthetic.parquet: its source release .* is NOT "
        r"differentially private \(provenance dp: false\).*"
        r"premium\.allow_non_dp_source=true",
    ):
        run_premium(
            PremiumConfig(),
            data_path=data,
            model_path=tmp_path / "base",
            out_dir=tmp_path / "out",
            storage_dir=tmp_path / "s",
        )
    assert not (tmp_path / "out").exists()


_BAD_PROVENANCE = {
    "not-json": ("stage two", "is not Stage II provenance JSON"),
    "json-not-stage-two": ({"source": "somewhere", "dp": True}, "is not Stage II provenance JSON"),
    "json-list": ("[1, 2]", "is not Stage II provenance JSON"),
    "dp-missing": (
        {k: v for k, v in DP_PROVENANCE.items() if k != "dp"},
        "is not Stage II provenance JSON",
    ),
    "dp-not-true": ({**DP_PROVENANCE, "dp": "yes"}, r"NOT differentially private"),
    "mixed": (
        lambda i: {**DP_PROVENANCE, "release_sha256": f"{i % 2}" * 64},
        "2 different provenances",
    ),
    "some-rows-missing": (
        lambda i: None if i == 3 else DP_PROVENANCE,
        "1 of 8 rows have no provenance",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_PROVENANCE))
def test_premium_refuses_a_provenance_that_is_not_stage_two_dp(no_training, tmp_path, case):
    provenance, problem = _BAD_PROVENANCE[case]
    data = _synthetic(tmp_path / "synthetic.parquet", 8, provenance)
    with pytest.raises(
        PremiumError,
        match=rf"synthetic.parquet: .*{problem}.*"
        r"premium\.allow_non_dp_source",
    ):
        run_premium(
            PremiumConfig(),
            data_path=data,
            model_path=tmp_path / "base",
            out_dir=tmp_path / "out",
            storage_dir=tmp_path / "s",
        )
    assert not (tmp_path / "out").exists()


def test_premium_with_the_option_says_no_dp_guarantee_holds(monkeypatch, tmp_path):
    """premium.allow_non_dp_source: it trains (a stand-in for the Ray Train fit), and
    premium.json says plainly that no DP guarantee holds; nothing claims inheritance."""
    import privcode.premium.train as premium_train

    def fit(job, out_dir, storage):
        (out_dir / "adapter").mkdir(parents=True)
        return [{"epoch": 1, "train_loss": 1.0, "eval_loss": None}], 0.1

    monkeypatch.setattr(premium_train, "_fit", fit)
    data = _synthetic(tmp_path / "synthetic.parquet", 8, NON_DP_PROVENANCE)
    with pytest.warns(RuntimeWarning, match="NO differential-privacy guarantee"):
        summary = run_premium(
            PremiumConfig(allow_non_dp_source=True),
            data_path=data,
            model_path=tmp_path / "base",
            out_dir=tmp_path / "out",
            storage_dir=tmp_path / "s",
        )
    privacy = json.loads((tmp_path / "out" / "premium.json").read_text())["privacy"]
    assert summary["privacy"] == privacy
    assert privacy["dp"] is False and privacy["no_dp_guarantee"] is True
    assert privacy["epsilon"] is None and privacy["delta"] is None
    assert privacy["guarantee"].startswith("NONE: its source release")
    assert privacy["privacy_warning"].startswith("NO differential-privacy guarantee")
    assert "inherit" not in json.dumps(privacy).lower()
    assert privacy["post_processing_of"]["dp"] is False  # the source, as recorded
    # Unparsable provenance, with the option: no source recorded, still no guarantee.
    data = _synthetic(tmp_path / "other.parquet", 8, "stage two")
    with pytest.warns(RuntimeWarning, match="NO differential-privacy guarantee"):
        summary = run_premium(
            PremiumConfig(allow_non_dp_source=True),
            data_path=data,
            model_path=tmp_path / "base",
            out_dir=tmp_path / "out2",
            storage_dir=tmp_path / "s",
        )
    assert summary["privacy"]["dp"] is False and summary["privacy"]["post_processing_of"] is None
    assert "not Stage II provenance JSON" in summary["privacy"]["guarantee"]


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_deepspeed_configs_fill_their_auto_values(stage):
    cfg = PremiumConfig(deepspeed=stage, batch_size=4, lr=2e-4)
    ds = deepspeed_config(cfg, use_bf16=True)
    assert ds["zero_optimization"]["stage"] == int(stage[-1])
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["bf16"]["enabled"] is True
    assert ds["optimizer"]["params"]["lr"] == 2e-4
    assert "auto" not in json.dumps(ds)


@pytest.mark.slow
def test_premium_with_deepspeed_zero1_on_cpu(ray_connected, base_path, tmp_path):
    """DeepSpeed ZeRO-1 over gloo on CPU (its CPU Adam op JIT-compiles on first use)."""
    data = _synthetic(tmp_path / "synthetic.parquet", 32)
    cfg = PremiumConfig(
        epochs=2,
        batch_size=4,
        lr=3e-3,
        lora_r=4,
        lora_alpha=8,
        max_length=64,
        eval_fraction=0.1,
        deepspeed="zero1",
    )
    summary = run_premium(
        cfg,
        data_path=data,
        model_path=base_path,
        out_dir=tmp_path / "out",
        storage_dir=tmp_path / "storage",
    )
    assert [p["epoch"] for p in summary["curve"]] == [1, 2]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_premium_refuses_too_few_records_before_training_and_names_stage_two(no_training, tmp_path):
    data = _synthetic(tmp_path / "synthetic.parquet", 8)
    with pytest.raises(
        PremiumError,
        match=r"holds 8 synthetic record\(s\), fewer than "
        r"premium.min_records=100: Stage II \(the synth "
        r"stage\) kept too little.*stats.json",
    ):
        run_premium(
            PremiumConfig(min_records=100),
            data_path=data,
            model_path=tmp_path / "base",
            out_dir=tmp_path / "out",
            storage_dir=tmp_path / "s",
        )
    assert not (tmp_path / "out").exists()


def test_every_rank_joins_the_heldout_forward_and_the_mean_is_the_one_rank_mean(monkeypatch):
    """ZeRO-3 partitions the weights: every rank must make the same number of forward passes
    over the held-out set (rank 0 alone would hang the others). The ranks' sums add up to the
    single-rank mean of the batch losses."""
    import torch

    from privcode.models.encoding import Encoded
    from privcode.premium import train as pt

    calls: dict[int, int] = {}
    current = {"rank": 0}

    def fake_loss(net, batch):
        calls[current["rank"]] = calls.get(current["rank"], 0) + 1
        return batch["input_ids"].double().mean()

    class Net:
        def eval(self):
            pass

    monkeypatch.setattr(pt, "_code_loss", fake_loss)
    held = [Encoded((i + 1,) * 3, (1,) * 3, ()) for i in range(7)]  # 7 rows, batches of 2
    one = pt._heldout_loss(Net(), held, 2, 0, torch.device("cpu"), 0, 1)
    assert one == pytest.approx((1.5 + 3.5 + 5.5 + 7) / 4)
    sums = []
    for rank in range(3):  # 3 ranks, no process group: each returns its own mean
        current["rank"] = rank
        real = [held[(r * 3 + rank) * 2 : (r * 3 + rank) * 2 + 2] for r in range(2)]
        mean = pt._heldout_loss(Net(), held, 2, 0, torch.device("cpu"), rank, 3)
        batches = [b for b in real if b]
        sums.append((mean * len(batches), len(batches)))
    assert calls == {0: 2 + 4, 1: 2, 2: 2}  # rank 0's first 4: the one-rank run; 2 each here
    assert sum(s for s, _ in sums) / sum(n for _, n in sums) == pytest.approx(one)


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_the_premium_stage_writes_merged_weights_for_the_vllm_engine(
    engine, premium_release, tmp_path, monkeypatch
):
    import shutil

    import privcode.premium.train as premium_train
    from privcode.config import load_config
    from privcode.models.artifacts import MERGED_DIR, MERGED_MARKER
    from privcode.pipeline.stages import PremiumStage

    def trained(cfg, *, data_path, model_path, out_dir, storage_dir):
        shutil.copytree(premium_release, out_dir, dirs_exist_ok=True)
        return {"stand-in": True}

    monkeypatch.setattr(premium_train, "run_premium", trained)
    base = json.loads((premium_release / "premium.json").read_text())["model"]
    cfg = load_config(
        overrides=[f"serve.engine={engine}", f"premium.model={base}", f"run.out_dir={tmp_path}"]
    )
    out = tmp_path / "premium"
    assert PremiumStage().run(cfg, out, {}) == {"stand-in": True}
    merged = out / MERGED_DIR
    assert (merged / "model.safetensors").is_file() == (engine == "vllm")
    if engine == "vllm":
        assert json.loads((merged / MERGED_MARKER).read_text())["privacy"]["dp"] is True
