"""Loading local HF causal LMs and LoRA adapters (on the session's ``ci`` base build).

Other architectures are checked on tiny randomly initialised models built
from their configs (nothing is downloaded).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import base_summary, premium_json

from privcode.artifacts.base import BaseRecord
from privcode.artifacts.nondp import NondpRecord
from privcode.config import BaseConfig
from privcode.models import (
    ModelLoadError,
    attach_lora,
    count_parameters,
    load_causal_lm,
    load_tokenizer,
    lora_target_modules,
    resolve_model_path,
)
from privcode.models.base import build_base

QWEN2_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ci_path(ci_base_cache) -> str:
    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


@pytest.fixture
def batch(ci_path):
    tok = load_tokenizer(ci_path)
    enc = tok(
        ["def add(a, b):\n    return a + b\n", "import os\nprint(os.sep)\n"],
        return_tensors="pt",
        padding=True,
    )
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {**enc, "labels": labels}


def _tiny(model_type: str):
    """A tiny random model of ``model_type`` (config only: no download)."""
    import transformers as T

    make = {
        "gpt2": lambda: T.GPT2LMHeadModel(
            T.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64)
        ),
        "llama": lambda: T.LlamaForCausalLM(
            T.LlamaConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=64,
            )
        ),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                vocab_size=64,
            )
        ),
        "starcoder2": lambda: T.Starcoder2ForCausalLM(
            T.Starcoder2Config(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=64,
            )
        ),
    }
    return make[model_type]()


# --------------------------------------------------------------------------- loading


def test_load_causal_lm_and_tokenizer(ci_path):
    model = load_causal_lm(ci_path)
    assert model.config.model_type == "qwen2" and not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert (
        load_causal_lm(ci_path, dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16
    )
    tok = load_tokenizer(ci_path)
    assert len(tok) == model.config.vocab_size


def test_preset_name_resolves_to_the_cached_build(ci_path, ci_base_cache):
    assert str(resolve_model_path("ci", cache_dir=ci_base_cache)) == ci_path
    model = load_causal_lm("ci", cache_dir=ci_base_cache)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(model)[1]


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere.*does not exist"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        from privcode.models.loading import _torch_dtype

        _torch_dtype("float99")


# --------------------------------------------------------------------------- LoRA targets


def test_lora_targets_for_qwen2(ci_path):
    assert lora_target_modules(load_causal_lm(ci_path)) == QWEN2_TARGETS


@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("llama", QWEN2_TARGETS),
        ("gpt2", ["c_attn", "c_proj", "c_fc"]),
        ("gpt_neox", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
        ("starcoder2", ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
    ],
)
def test_lora_targets_from_the_table(model_type, expected):
    model = _tiny(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table hit must not warn
        assert lora_target_modules(model) == expected


def test_lora_targets_fallback_warns_and_skips_the_head():
    class Cfg:
        model_type = "mystery"

    class Mystery(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Cfg()
            self.block = torch.nn.ModuleDict(
                {
                    "wq": torch.nn.Linear(4, 4),
                    "ff": torch.nn.Linear(4, 4),
                    "norm": torch.nn.LayerNorm(4),
                }
            )
            self.lm_head = torch.nn.Linear(4, 10)

    with pytest.warns(UserWarning, match="mystery"):
        assert lora_target_modules(Mystery()) == ["ff", "wq"]


def test_attach_lora_on_gpt2_conv1d_layers():
    model = attach_lora(_tiny("gpt2"), r=2, alpha=4)
    x = torch.randint(0, 64, (2, 5))
    model(input_ids=x, labels=x).loss.backward()
    trainable, total = count_parameters(model)
    assert 0 < trainable < total


# --------------------------------------------------------------------------- attach_lora


def test_attach_lora_trains_only_adapters(ci_path, batch):
    base = load_causal_lm(ci_path)
    _, total_before = count_parameters(base)
    expected = 0
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QWEN2_TARGETS:
            expected += 8 * (module.in_features + module.out_features)
    model = attach_lora(base, r=8, alpha=16)
    trainable, total = count_parameters(model)
    assert trainable == expected > 0
    assert total == total_before + trainable and trainable < 0.1 * total
    for name, p in model.named_parameters():
        assert p.requires_grad == ("lora_A" in name or "lora_B" in name), name
    # Forward/backward: gradients reach the adapters only; a step changes the loss.
    model.train()
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt.step()
    with torch.no_grad():
        assert model(**batch).loss != loss.detach()


def test_lora_adapter_save_load_round_trip(ci_path, batch, tmp_path):
    from peft import PeftModel

    model = attach_lora(load_causal_lm(ci_path), r=4, alpha=8)
    with torch.no_grad():  # make the adapter non-trivial (lora_B starts at zero)
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(load_causal_lm(ci_path), tmp_path / "adapter")
    reloaded.eval()
    saved = {n: p for n, p in model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys() and saved
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    with torch.no_grad():
        assert torch.allclose(reloaded(**batch).logits, expected, atol=1e-6)
        base_logits = load_causal_lm(ci_path)(
            **{k: v for k, v in batch.items() if k != "labels"}
        ).logits
    assert not torch.allclose(base_logits, expected, atol=1e-4)


def test_load_model_reads_every_kind_and_merges_adapters_exactly(ci_path, batch, tmp_path, caplog):
    """One loader: a plain model, a base stage dir, a peft adapter, a premium release and
    the non-DP comparison, each by its marker file; merged logits equal the PeftModel's."""
    import json
    import shutil

    from privcode.models import load_model, model_kind

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model = attach_lora(load_causal_lm(ci_path), r=4, alpha=8)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        expected = model.eval()(**inputs).logits  # the unmerged adapter: the reference
    model.save_pretrained(tmp_path / "adapter")
    shutil.copytree(tmp_path / "adapter", tmp_path / "premium" / "adapter")
    (tmp_path / "premium" / "premium.json").write_text(premium_json(ci_path))
    (tmp_path / "stage").mkdir()
    BaseRecord.from_json(base_summary(ci_path)).write(tmp_path / "stage")
    shutil.copytree(ci_path, tmp_path / "nondp")
    NondpRecord(
        finetune="full",
        steps=1,
        lr=1e-3,
        expected_batch_size=2,
        max_length=32,
        lora_r=None,
        trainable_parameters=1,
        seconds=0.1,
        not_private="NOT PRIVATE (test)",
        training_mode={"mode": "non-private", "reason": "test"},
        base_model=ci_path,
    ).write(tmp_path / "nondp" / "nondp.json")
    kinds = {d: model_kind(tmp_path / d) for d in ("adapter", "premium", "stage", "nondp")}
    assert (
        kinds
        == {"adapter": "adapter", "premium": "premium", "stage": "base-stage", "nondp": "nondpft"}
        and model_kind(ci_path) == "model"
    )

    for path, kind, base, dp in (
        (tmp_path / "adapter", "adapter", ci_path, False),
        (tmp_path / "premium", "premium", ci_path, True),
    ):
        loaded = load_model(path)
        assert (loaded.kind, loaded.base_model, loaded.dp) == (kind, base, dp)
        assert not any(p.requires_grad for p in loaded.model.parameters())
        assert not hasattr(loaded.model, "peft_config")  # merged into the base weights
        with torch.no_grad():  # fp32: W + BA merged rounds apart from W x + B(A x) by ~1e-5
            assert torch.allclose(loaded.model(**inputs).logits, expected, atol=1e-4)
    plain = load_causal_lm(ci_path)
    with torch.no_grad():
        reference = plain(**inputs).logits
    for path, kind in (
        (ci_path, "model"),
        (tmp_path / "stage", "model"),
        (tmp_path / "nondp", "nondpft"),
    ):
        with caplog.at_level("WARNING", logger="privcode.models.artifacts"):
            loaded = load_model(path)
        assert loaded.kind == kind and loaded.dp is False
        with torch.no_grad():
            assert torch.allclose(loaded.model(**inputs).logits, reference, atol=1e-6)
    assert "NOT PRIVATE" in caplog.text
    assert load_model(tmp_path / "adapter").eos_ids == (load_tokenizer(ci_path).eos_token_id,)

    (tmp_path / "premium" / "premium.json").write_text(premium_json("/nowhere"))
    with pytest.raises(ModelLoadError, match="nowhere.*does not exist"):
        load_model(tmp_path / "premium")
    assert load_model(tmp_path / "premium", base_model=ci_path).base_model == ci_path
    (tmp_path / "premium" / "premium.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="premium.json: missing key 'model'"):
        load_model(tmp_path / "premium")
    (tmp_path / "premium" / "premium.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match="premium.json: not a JSON object"):
        load_model(tmp_path / "premium")
    (tmp_path / "stage" / "base.json").write_text(json.dumps({"path": ci_path}))
    with pytest.raises(ModelLoadError, match="not a base stage: .*base.json: missing key"):
        load_model(tmp_path / "stage")  # a base.json of another shape names the file and key
