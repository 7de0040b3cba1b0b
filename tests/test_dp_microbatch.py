"""DP-SGD at real sizes: virtual batches, bf16 autocast and gradient checkpointing (privcode.dp).

The privacy maths must not move: a step cut into micro-batches releases the
same clipped sum (then the same one noise draw) as the step in one pass;
checkpointed and autocast passes give the same (fp32) sum, the latter within
bf16's precision. References: the one-pass engine with noise off, and the
clipped sum computed record by record with plain autograd.
"""

from __future__ import annotations

import pytest
import torch

from privcode.config import TrainConfig
from privcode.dp import dpsgd
from privcode.dp.dpsgd import PerSampleClipper
from privcode.dp.engine import Privacy, make_private
from privcode.models.encoding import CODE, PROMPT, Encoded, collate
from privcode.train.methods import MethodContext, Objective, get_method

pytestmark = pytest.mark.heavy

N = 24


def _lora_lm(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from privcode.models.loading import attach_lora

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    model = attach_lora(Qwen2ForCausalLM(cfg), r=4, alpha=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero B: every adapter weight gets a gradient
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def _objective(method: str = "dpft", seed: int = 0) -> Objective:
    cfg = TrainConfig(method=method, latent_dim=8, num_virtual_tokens=2, align_negatives="none")
    return Objective(get_method(method), _lora_lm(seed), MethodContext(cfg=cfg, eos_id=1, pad_id=0))


def _records(n: int = N, seed: int = 3) -> list[Encoded]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))  # unequal: padding differs per cut
        ids = torch.randint(2, 97, (length,), generator=g).tolist()
        cut = length // 3
        structural = torch.randint(0, 2, (length,), generator=g).tolist()
        out.append(
            Encoded(tuple(ids), tuple([PROMPT] * cut + [CODE] * (length - cut)), tuple(structural))
        )
    return out


RECORDS = _records()


def _batch_fn(engine):
    def batch_fn(local, step):
        return collate(
            [RECORDS[j] for j in local],
            0,
            step=step,
            record_keys=torch.tensor([1000 + j for j in local], dtype=torch.long),
            record_secret=engine.randomness.record_secret(step),
        )

    return batch_fn


def loss_fn(module, batch):
    return module(batch)


def _train(method: str, micro: int, steps: int = 3, mode: str = "hooks", **kw) -> torch.Tensor:
    objective = _objective(method)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    # The non-private mode with a clip norm is DP-SGD's clipped sum with the noise off; its
    # fixed seed makes both runs sample the same batches and the same per-record noise.
    privacy = Privacy.non_private(
        "micro-batch test", seed=11, max_grad_norm=0.05, grad_sample_mode=mode
    )
    engine = make_private(
        objective, opt, privacy, num_records=N, sample_rate=0.6, micro_batch_size=micro, **kw
    )
    batch_fn = _batch_fn(engine)
    for step in range(steps):
        assert engine.step(step, batch_fn, loss_fn).taken
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


@pytest.mark.parametrize("method", ["dpft", "privcode", "privcode++"])
def test_a_micro_batched_step_equals_the_one_pass_step_with_noise_off(method):
    whole = _train(method, 0)
    for micro in (1, 4, 7):
        cut = _train(method, micro)
        torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole, _objective_weights(method))  # the steps moved the weights


def _objective_weights(method: str) -> torch.Tensor:
    o = _objective(method)
    return torch.cat([p.detach().reshape(-1) for p in o.parameters() if p.requires_grad])


def test_micro_batches_sum_to_the_record_by_record_clipped_sum():
    """Independent reference: sum_i clip_C(grad loss_i), one plain autograd call per record."""
    clip = 0.05
    ref_model = _objective()
    params = [p for p in ref_model.parameters() if p.requires_grad]
    want = torch.zeros(sum(p.numel() for p in params))
    local = list(range(0, N, 2))
    for j in local:
        loss = ref_model(collate([RECORDS[j]], 0, step=0))[0]
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        want += g * min(1.0, clip / (float(g.norm()) + dpsgd.CLIP_EPS))

    objective = _objective()
    opt = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.1)
    engine = make_private(
        objective,
        opt,
        Privacy.non_private("reference", seed=0, max_grad_norm=clip),
        num_records=N,
        sample_rate=0.5,
        micro_batch_size=3,
    )
    got, nonfinite = engine._clipped_sum(
        local, 0, lambda rows, s: collate([RECORDS[j] for j in rows], 0, step=s), loss_fn
    )
    assert nonfinite == 0 and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_the_noise_is_drawn_once_per_step_whatever_the_number_of_micro_batches(monkeypatch):
    draws = []
    real = dpsgd.gaussian_noise

    def counting(*args, **kw):
        draws.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(dpsgd, "gaussian_noise", counting)
    objective = _objective()
    opt = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.1)
    engine = make_private(
        objective,
        opt,
        Privacy.dp_sgd(1.0, 0.05),
        num_records=N,
        sample_rate=0.9,
        reserve=lambda rid: (True, 0, None),
        micro_batch_size=2,
    )
    passes = []
    real_sum = engine.clipper.clipped_sum

    def counted_sum(*a, **kw):
        passes.append(a[2])
        return real_sum(*a, **kw)

    monkeypatch.setattr(engine.clipper, "clipped_sum", counted_sum)
    for step in range(2):
        assert engine.step(step, _batch_fn(engine), loss_fn).taken
    assert len(draws) == 2  # one per step
    assert len(passes) >= 4 and max(passes) <= 2  # several micro-batches of at most 2


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_gradient_checkpointing_gives_the_same_clipped_sum(mode):
    whole = _train("privcode", 0, steps=2, mode=mode)
    checkpointed = _train("privcode", 4, steps=2, mode=mode, gradient_checkpointing=True)
    torch.testing.assert_close(checkpointed, whole, rtol=1e-5, atol=1e-6)


def test_checkpointing_really_recomputes_and_opacus_keeps_no_stale_activations():
    objective = _objective()
    clipper = PerSampleClipper(objective, max_grad_norm=1.0, gradient_checkpointing=True)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m
        for m in objective.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    assert layers, "no layer has checkpointing on"
    calls = {"n": 0}
    first = layers[0].self_attn.q_proj
    first.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    batch = collate(RECORDS[:5], 0, step=0)
    s = clipper.clipped_sum(loss_fn, batch, 5)
    assert calls["n"] == 2  # the forward and its recomputation in the backward
    assert torch.isfinite(s).all()
    leftovers = [m for m in objective.modules() if getattr(m, "activations", None)]
    assert not leftovers


def test_bf16_autocast_sums_in_fp32_close_to_the_fp32_sum():
    local = list(range(10))

    def clipped(dtype):
        objective = _objective()
        clipper = PerSampleClipper(objective, max_grad_norm=0.05, autocast_dtype=dtype)
        return clipper.clipped_sum(loss_fn, collate([RECORDS[j] for j in local], 0, step=0), 10)

    full, half = clipped(None), clipped(torch.bfloat16)
    assert half.dtype == torch.float32
    rel = float((half - full).norm() / full.norm())
    assert 0 < rel < 3e-2, rel  # bf16 has an 8-bit mantissa: about 0.4% per op


def test_micro_batch_size_must_not_be_negative():
    objective = _objective()
    opt = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        make_private(
            objective,
            opt,
            Privacy.non_private("x", seed=0, max_grad_norm=1.0),
            num_records=N,
            sample_rate=0.5,
            micro_batch_size=-1,
        )


def test_dp_overhead_memory_table_smallest():
    """bench/dp_overhead.py --shape (the virtual-batch memory table) at its smallest setting."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "dp_overhead.py"),
            "--shape",
            "tiny",
            "--micro",
            "1",
            "2",
            "--batch",
            "2",
            "--length",
            "8",
            "--threads",
            "1",
            "--checkpointing",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        line.split()
        for line in proc.stdout.splitlines()
        if re.match(r"^\s*[12]\s+(on|off)\s+[0-9]+\s+[0-9.]+\s+[0-9.]+$", line)
    ]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("1", "off"),
        ("1", "on"),
        ("2", "off"),
        ("2", "on"),
    ]
    assert "one DP-SGD step over 2 records x 8 tokens" in proc.stdout


@pytest.mark.model
def test_a_bf16_junior_trains_fp32_adapters_over_bf16_base_weights(ci_model):
    """train.dtype bfloat16: the frozen base in bf16, LoRA and PrivLC in fp32, a micro-batched
    autocast step updates them (finite), and the update is close to the fp32 junior's."""
    from privcode.models.encoding import encode_records
    from privcode.models.loading import resolve_dtype
    from privcode.train.build import build_objective

    class Rec:
        def __init__(self, prompt, code):
            self.prompt, self.code = prompt, code

    records = [Rec(f"add {i}", f"def f(x):\n    return x + {i}\n") for i in range(6)]
    updates = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TrainConfig(
            method="privcode++", dtype=dtype, latent_dim=8, align_negatives="none", max_length=32
        )
        objective, tokenizer, _ = build_objective(
            get_method("privcode++"), cfg, ci_model, "cpu", will_restore=False
        )
        frozen = {p.dtype for p in objective.lm.parameters() if not p.requires_grad}
        trainable = [p for p in objective.parameters() if p.requires_grad]
        assert frozen == {resolve_dtype(dtype)}
        assert {p.dtype for p in trainable} == {torch.float32}
        encoded = encode_records(records, tokenizer, cfg.max_length)
        before = torch.cat([p.detach().reshape(-1).clone() for p in trainable])
        engine = make_private(
            objective,
            torch.optim.SGD(trainable, lr=1.0),
            Privacy.non_private("bf16 test", seed=5, max_grad_norm=1.0),
            num_records=len(encoded),
            sample_rate=1.0,
            micro_batch_size=4,
            autocast_dtype=resolve_dtype(dtype),
        )
        pad = tokenizer.pad_token_id or 0

        def batch_fn(local, step, encoded=encoded, pad=pad, engine=engine):
            return collate(
                [encoded[j] for j in local],
                pad,
                step=step,
                record_keys=torch.tensor(local, dtype=torch.long),
                record_secret=engine.randomness.record_secret(step),
            )

        assert engine.step(0, batch_fn, loss_fn).taken
        after = torch.cat([p.detach().reshape(-1) for p in trainable])
        assert torch.isfinite(after).all()
        updates[dtype] = after - before
    full, half = updates["float32"], updates["bfloat16"]
    cos = float(torch.nn.functional.cosine_similarity(full, half, dim=0))
    assert cos > 0.9, cos
