"""Real-shape random models (privcode.models.shapes): counts from the config equal built models'."""

from __future__ import annotations

import pytest
import torch

from privcode.models.shapes import (
    SHAPES,
    layers_that_fit,
    param_count,
    random_causal_lm,
    shape_config,
)

QWEN_15B, QWEN_7B = "qwen2.5-coder-1.5b", "qwen2.5-coder-7b"


def _built_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights listed once


def test_published_parameter_counts():
    # The published sizes: Qwen2.5-Coder-1.5B has 1.54B parameters (tied head), 7B 7.61B.
    assert param_count(QWEN_15B) == 1_543_714_304
    assert param_count(QWEN_7B) == 7_615_616_512
    # Per layer: q (+bias), k and v (+bias), o, the MLP's three, two norms.
    h, i, kv = 1536, 8960, 2 * 128
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    assert param_count(QWEN_15B, 2) - param_count(QWEN_15B, 1) == layer == 46_797_824
    assert param_count(QWEN_15B, 1) == 151936 * h + layer + h


def test_shape_configs_carry_the_architecture():
    cfg = shape_config(QWEN_15B)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (1536, 28, 12)
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (2, 8960, 151936)
    assert cfg.tie_word_embeddings is True and cfg.max_position_embeddings == 32768
    assert cfg.rope_parameters["rope_theta"] == 1e6
    big = shape_config(QWEN_7B, num_layers=3)
    assert (big.hidden_size, big.num_hidden_layers, big.num_key_value_heads) == (3584, 3, 4)
    assert big.tie_word_embeddings is False and big.vocab_size == 152064
    assert SHAPES[QWEN_7B]["num_hidden_layers"] == 28  # the override left the table alone


def test_tiny_model_matches_its_count_and_is_finite():
    model = random_causal_lm("tiny", seed=1)
    assert _built_count(model) == param_count("tiny")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the 1.5B
    assert not model.training
    std = shape_config("tiny").initializer_range
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() >= 2:
            assert abs(float(p.detach().std()) - std) < 0.15 * std, name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        else:
            assert torch.equal(p, torch.ones_like(p)), name
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 16, 512) and torch.isfinite(logits).all()


def test_seed_fixes_the_weights():
    a, b, c = (random_causal_lm("tiny", seed=s) for s in (3, 3, 4))
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters(), strict=True))
    assert all(torch.equal(x, y) for x, y, _ in pairs)
    assert not all(torch.equal(x, z) for x, _, z in pairs if x.dim() >= 2)


def test_dtype_and_layer_override():
    model = random_causal_lm("tiny", num_layers=3, dtype=torch.bfloat16)
    assert len(model.model.layers) == 3 and model.config.num_hidden_layers == 3
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert _built_count(model) == param_count("tiny", 3)


@pytest.mark.model  # builds one 1.5B-shaped layer and its 151,936 x 1,536 embedding (1.1 GB)
def test_qwen_15b_one_layer_matches_its_count():
    model = random_causal_lm(QWEN_15B, num_layers=1)
    assert _built_count(model) == param_count(QWEN_15B, 1) == 280_173_056
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert tuple(attn.k_proj.weight.shape) == (256, 1536)  # 2 KV heads of 128
    assert tuple(model.model.layers[0].mlp.up_proj.weight.shape) == (8960, 1536)


def test_layers_that_fit():
    five = param_count(QWEN_7B, 5)
    assert layers_that_fit(QWEN_7B, 2 * five) == 5
    assert layers_that_fit(QWEN_7B, 2 * five - 1) == 4
    assert layers_that_fit(QWEN_7B, 4 * five, bytes_per_param=4) == 5
    assert layers_that_fit(QWEN_7B, 1e12) == 28  # never more than the shape's own
    assert layers_that_fit(QWEN_7B, 1e9) == 0  # the embeddings alone are 2.2 GB in bf16


def test_bad_shape_and_layers_are_named():
    with pytest.raises(ValueError, match=r"unknown model shape 'qwen3'.*qwen2.5-coder-1.5b"):
        param_count("qwen3")
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1, got 0"):
        shape_config("tiny", num_layers=0)
