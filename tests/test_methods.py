"""Stage I methods: per-record objectives, the syntax-aware KL, PrivLC and the method registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from privcode.config import BaseConfig, TrainConfig, load_config
from privcode.errors import ConfigError
from privcode.models.encoding import CODE, PROMPT, collate, encode_records, segment_rows
from privcode.train.build import build_objective
from privcode.train.methods import METHODS, get_method

CFG = TrainConfig(
    latent_dim=16,
    num_virtual_tokens=4,
    encoder_hidden=32,
    align_bank_size=8,
    preemb_steps=2,
    max_length=64,
    allow_non_private=True,
)
DP_METHODS = [name for name, m in METHODS.items() if m.dp]


class Rec:
    def __init__(self, prompt: str, code: str):
        self.prompt, self.code = prompt, code


RECORDS = [
    Rec("Write a function that adds two numbers.", "def add(a, b):\n    return a + b\n"),
    Rec("", "def show(x):\n    for i in range(len(x)):\n        print(x[i])\n"),
    Rec(
        "Return the largest item or None.",
        "def biggest(xs):\n    if not xs:\n        return None\n    return max(xs)\n",
    ),
]
OTHER = Rec(
    "Something else entirely, much longer than the original prompt was.",
    "class Box:\n    def __init__(self, v):\n        self.v = [v] * 3\n",
)


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def _objective(name: str, base_path: str, **changes):
    cfg = dataclasses.replace(CFG, method=name, **changes)
    return build_objective(get_method(name), cfg, base_path, "cpu", will_restore=False)


def _per_sample_grads(objective, batch) -> torch.Tensor:
    """[B, P] per-record gradients over every trainable parameter (Opacus hooks)."""
    from opacus.grad_sample.utils import prepare_module

    from privcode.dp.dpsgd import trainable_parameters

    params = trainable_parameters(objective)
    module = prepare_module(
        objective, "hooks", wrap_model=True, batch_first=True, loss_reduction="sum", strict=True
    )
    torch.manual_seed(0)  # the VAE's eps: the same draws in both batches
    module.train()
    module(batch).sum().backward()
    grads = torch.cat([p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in params], 1)
    for p in params:
        p.grad = p.grad_sample = None
    module._close()
    return grads


@pytest.mark.parametrize("name", DP_METHODS)
def test_per_record_gradient_does_not_depend_on_other_records(name, base_path):
    objective, tok, _ = _objective(name, base_path)
    with torch.no_grad():  # a non-identity adapter, so the KL term is live
        for n, p in objective.lm.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    pad = tok.pad_token_id
    a = collate(encode_records(RECORDS, tok, 64), pad, step=3)
    b = collate(encode_records([RECORDS[0], OTHER, RECORDS[2]], tok, 64), pad, step=3)
    ga, gb = _per_sample_grads(objective, a), _per_sample_grads(objective, b)
    assert ga.shape[1] == sum(p.numel() for p in objective.parameters() if p.requires_grad)
    # Relative to the norm: lambda(3) ~ 970 scales the KL gradient up, and with it
    # float32 noise from the batches' different padding widths.
    for i in (0, 2):
        assert ga[i].norm() > 0
        assert float((ga[i] - gb[i]).norm() / ga[i].norm()) < 1e-4
    assert float((ga[1] - gb[1]).norm() / ga[1].norm()) > 1e-2


def test_kl_is_zero_while_the_junior_equals_the_reference(base_path):
    objective, tok, _ = _objective("privcode", base_path)
    nonast, _, _ = _objective("privcode-nonast", base_path)
    batch = collate(encode_records(RECORDS, tok, 64), tok.pad_token_id, step=0)
    with torch.no_grad():
        # LoRA B = 0 at init: the adapter is the identity, so KL_AST = 0 and the
        # loss is the CE alone, even at lambda(0) = 1000.
        torch.testing.assert_close(objective(batch), nonast(batch), rtol=1e-5, atol=1e-5)
        for n, p in objective.lm.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
        for n, p in nonast.lm.named_parameters():
            if "lora_B" in n:
                p.copy_(dict(objective.lm.named_parameters())[n])
        diff = objective(batch) - nonast(batch)
    assert objective.ast_weight(0) == 1000.0
    assert bool((diff > 0).all())  # KL > 0 on every record with structural tokens


def test_ast_weight_schedules_per_method(base_path):
    import math

    privcode, _, _ = _objective("privcode", base_path)
    stable, _, _ = _objective("privcode-stableast", base_path, stable_ast_lambda=2.5)
    dpft, _, _ = _objective("dpft", base_path)
    assert privcode.ast_weight(10) == pytest.approx(0.1 + 999.9 * math.exp(-0.1))
    assert stable.ast_weight(0) == stable.ast_weight(500) == 2.5
    assert dpft.ast_weight(0) == 0.0


def test_structural_flags_reach_the_batch_and_untokenizable_code_is_counted(base_path):
    from privcode.models.loading import load_tokenizer

    tok = load_tokenizer(base_path)
    stats: dict[str, int] = {}
    enc = encode_records([*RECORDS, Rec("p", "def broken(:\n  '''x")], tok, 64, stats=stats)
    assert stats == {"untokenizable": 1}
    assert not any(enc[3].structural)
    for e in enc[:3]:
        assert all(s == 0 or g == CODE for s, g in zip(e.structural, e.segments, strict=True))
    ids = list(enc[0].input_ids)
    flagged = tok.decode([i for i, s in zip(ids, enc[0].structural, strict=True) if s])
    assert "def" in flagged and "return" in flagged and "+" in flagged
    assert "add" not in flagged.replace("def", "")


def test_segment_rows_left_aligns_each_segment(base_path):
    from privcode.models.loading import load_tokenizer

    tok = load_tokenizer(base_path)
    enc = encode_records(RECORDS, tok, 64)
    batch = collate(enc, tok.pad_token_id)
    code = segment_rows(batch, CODE, bos_id=7)
    prompt = segment_rows(batch, PROMPT)
    for i, e in enumerate(enc):
        want = [t for t, s in zip(e.input_ids, e.segments, strict=True) if s == CODE]
        n = len(want)
        assert code["input_ids"][i, 0] == 7
        assert code["input_ids"][i, 1 : n + 1].tolist() == want
        assert code["attention_mask"][i].sum() == n + 1
        p = [t for t, s in zip(e.input_ids, e.segments, strict=True) if s == PROMPT]
        assert prompt["input_ids"][i, : len(p)].tolist() == p
        assert prompt["attention_mask"][i].sum() == len(p)
    assert prompt["attention_mask"][1].sum() == 0  # record 1 has no prompt


def test_privlc_modules_and_release_shapes(base_path):
    pp, _, _ = _objective("privcode++", base_path)
    noalign, _, _ = _objective("privcode++-noalign", base_path)
    promptemb, _, _ = _objective("pc-promptemb", base_path)
    preemb, _, losses = _objective("pc-preemb", base_path)
    privcode, _, _ = _objective("privcode", base_path)
    assert pp.code_encoder is not None and pp.prompt_encoder is not None
    assert noalign.prompt_encoder is None and promptemb.code_encoder is None
    assert privcode.released_prefix_decoder() is None
    d = pp.released_prefix_decoder()
    assert set(d) == {"weight", "bias"} and d["weight"].shape == (4 * pp.hidden, 16)
    # pc-preemb: PrivLC pretrained on public pairs (losses recorded), then frozen.
    assert len(losses) == 2 and all(x > 0 for x in losses)
    assert all(not p.requires_grad for p in preemb.privlc_parameters())
    assert all(p.requires_grad for n, p in preemb.named_parameters() if "lora_" in n)
    assert {m.conditioning for m in METHODS.values()} == {"latent", "prompt", "none"}
    assert METHODS["privcode++"].conditioning == "latent"
    assert METHODS["privcode"].conditioning == "prompt"
    assert METHODS["pc-uncond"].conditioning == "none"


@pytest.mark.heavy
def test_public_alignment_negatives_are_public_prompts():
    from privcode.data.demo import collect_candidates
    from privcode.data.public import public_pairs, public_prompts

    prompts = public_prompts(16)
    assert len(prompts) == 16 and len(set(prompts)) == 16
    private_code = {c.code for c in collect_candidates(4096, include_humaneval=True)}
    assert not private_code & {c for _, c in public_pairs(64)}


def test_align_loss_uses_only_its_own_row():
    from privcode.train.privlc import align_loss, vae_kl

    torch.manual_seed(0)
    zc, zp, bank = torch.randn(3, 8), torch.randn(3, 8), torch.randn(5, 8)
    full = align_loss(zc, zp, bank, 0.1)
    zc2, zp2 = zc.clone(), zp.clone()
    zc2[1], zp2[1] = torch.randn(8), torch.randn(8)
    other = align_loss(zc2, zp2, bank, 0.1)
    torch.testing.assert_close(full[[0, 2]], other[[0, 2]])
    # Perfect alignment and orthogonal negatives: the loss is log(1 + M e^{-1/tau} / e^0)...
    e = torch.eye(8)
    got = align_loss(e[:1], e[:1], e[1:4], 0.5)
    assert got.item() == pytest.approx(float(torch.log(1 + 3 * torch.exp(torch.tensor(-2.0)))))
    assert align_loss(e[:1], e[:1], None, 0.5).item() == pytest.approx(0.0, abs=1e-7)
    assert vae_kl(torch.zeros(2, 4), torch.zeros(2, 4)).tolist() == [0.0, 0.0]
    assert vae_kl(torch.ones(1, 4), torch.zeros(1, 4)).item() == pytest.approx(2.0)


def test_nondpft_is_refused_without_the_explicit_flag(tmp_path):
    from privcode.train.loop import TrainingError
    from privcode.train.run import run_training

    with pytest.raises(ConfigError, match="NOT PRIVATE.*allow_non_private"):
        load_config(None, ["train.method=nondpft"])
    assert (
        load_config(None, ["train.method=nondpft", "train.allow_non_private=true"]).train.method
        == "nondpft"
    )
    cfg = TrainConfig(method="nondpft")  # built directly, bypassing the loader
    with pytest.raises(TrainingError, match="NOT PRIVATE"):
        run_training(
            cfg,
            data_path=tmp_path / "x.parquet",
            base_path=tmp_path,
            out_dir=tmp_path / "o",
            run_name="r",
            storage_dir=tmp_path / "s",
        )
    assert not (tmp_path / "o").exists() and not (tmp_path / "l").exists()
