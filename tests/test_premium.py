"""The premium fine-tune: LoRA on synthetic data with Ray Train, no DP, refuses private data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from privcode.config import BaseConfig, DataConfig, PremiumConfig
from privcode.premium.train import PremiumError, deepspeed_config, run_premium


def _synthetic(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from privcode.data.public import public_pairs

    prov = json.dumps({"release_sha256": "ab" * 32, "method": "privcode++",
                       "conditioning": "latent", "dp": True}, sort_keys=True)
    rows = [{"id": f"syn-{i}", "prompt": p, "code": c, "provenance": prov}
            for i, (p, c) in enumerate(public_pairs(n, seed=3))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def test_premium_learns_the_synthetic_data_and_inherits_the_release_guarantee(
        ray_connected, base_path, tmp_path):
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm

    data = _synthetic(tmp_path / "synthetic.parquet", 48)
    cfg = PremiumConfig(epochs=3, batch_size=8, lr=3e-3, lora_r=4, lora_alpha=8,
                        max_length=96, eval_fraction=0.1)
    summary = run_premium(cfg, data_path=data, model_path=base_path, out_dir=tmp_path / "out",
                          storage_dir=tmp_path / "storage")
    curve = summary["curve"]
    assert [p["epoch"] for p in curve] == [1, 2, 3]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"]  # it fits the synthetic data
    assert all(p["eval_loss"] is not None for p in curve)
    info = json.loads((tmp_path / "out" / "premium.json").read_text())
    assert info["privacy"]["dp_training"] is False
    assert info["privacy"]["post_processing_of"]["method"] == "privcode++"
    model = PeftModel.from_pretrained(load_causal_lm(base_path), str(tmp_path / "out" / "adapter"))
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0
    assert not (tmp_path / "storage" / "premium").exists()


def test_premium_refuses_data_that_is_not_synthetic(tmp_path, base_path):
    from privcode.data.demo import build_demo_corpus

    corpus = tmp_path / "corpus"
    build_demo_corpus(corpus, DataConfig(size=20, canary_repetitions=(1,),
                                         canary_kinds=("email",)), progress=False)
    with pytest.raises(PremiumError, match="not a Stage II synthetic dataset"):
        run_premium(PremiumConfig(), data_path=corpus / "train.parquet", model_path=base_path,
                    out_dir=tmp_path / "out", storage_dir=tmp_path / "s")
    assert not (tmp_path / "out").exists()


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
    cfg = PremiumConfig(epochs=2, batch_size=4, lr=3e-3, lora_r=4, lora_alpha=8,
                        max_length=64, eval_fraction=0.1, deepspeed="zero1")
    summary = run_premium(cfg, data_path=data, model_path=base_path, out_dir=tmp_path / "out",
                          storage_dir=tmp_path / "storage")
    assert [p["epoch"] for p in summary["curve"]] == [1, 2]
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
