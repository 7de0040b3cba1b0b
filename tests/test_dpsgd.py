"""The DP-SGD core without Ray: Poisson sampler, clipping, noise once, per-record losses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from privcode.config import TrainConfig
from privcode.dp.dpsgd import (
    PerSampleClipper,
    apply_flat_gradient,
    check_private_trainable,
    clip_and_sum,
    privatize,
)
from privcode.dp.sampler import PoissonSchedule, shard_of
from privcode.models.encoding import CODE, PROMPT, Encoded, collate
from privcode.train.methods import MethodContext, Objective, get_method

# --------------------------------------------------------------------------- sampler


def test_shards_partition_and_union_is_the_global_poisson_sample():
    sched = PoissonSchedule(num_records=1003, sample_rate=0.07, seed=12345)
    for world in (1, 2, 3, 8):
        shards = [shard_of(1003, r, world) for r in range(world)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(1003))
        for step in (0, 1, 17):
            parts = [sched.indices(step, r, world) for r in range(world)]
            union = np.sort(np.concatenate(parts))
            assert len(union) == len(set(union.tolist()))  # disjoint
            assert union.tolist() == np.flatnonzero(sched.global_mask(step)).tolist()
    # Same seed, same schedule; another seed, another one.
    again = PoissonSchedule(1003, 0.07, 12345)
    assert (again.indices(5) == sched.indices(5)).all()
    assert not (PoissonSchedule(1003, 0.07, 999).global_mask(5) == sched.global_mask(5)).all()


def test_shard_batch_sizes_follow_binomial_and_records_are_independent():
    n, q, world, steps = 600, 0.05, 3, 3000
    sched = PoissonSchedule(n, q, seed=2**100 + 7)
    sizes = np.zeros((steps, world))
    hits = np.zeros(n)
    masks = []
    for t in range(steps):
        for r in range(world):
            idx = sched.indices(t, r, world)
            sizes[t, r] = len(idx)
            hits[idx] += 1
        if t < 400:
            masks.append(sched.global_mask(t))
    for r in range(world):
        m = len(shard_of(n, r, world))
        mean, var = m * q, m * q * (1 - q)
        # Sample mean within 5 standard errors; variance within 15%.
        assert abs(sizes[:, r].mean() - mean) < 5 * math.sqrt(var / steps)
        assert sizes[:, r].var() == pytest.approx(var, rel=0.15)
    total = sizes.sum(axis=1)
    assert total.mean() == pytest.approx(n * q, rel=0.03)
    assert total.var() == pytest.approx(n * q * (1 - q), rel=0.15)
    # Shard sizes are uncorrelated (independent Bernoulli draws).
    assert abs(np.corrcoef(sizes[:, 0], sizes[:, 1])[0, 1]) < 0.1
    # Every record is included with probability q (binomial tolerance over steps).
    freq = hits / steps
    sd = math.sqrt(q * (1 - q) / steps)
    assert np.abs(freq - q).max() < 5.5 * sd
    # Consecutive steps are independent.
    m = np.array(masks, dtype=float)
    assert abs(np.corrcoef(m[:-1].ravel(), m[1:].ravel())[0, 1]) < 0.02


def test_schedule_rejects_bad_arguments_and_keeps_the_seed_out_of_its_state():
    with pytest.raises(ValueError):
        PoissonSchedule(10, 0.0, 1)
    with pytest.raises(ValueError):
        PoissonSchedule(0, 0.5, 1)
    with pytest.raises(ValueError):
        shard_of(10, 2, 2)
    state = PoissonSchedule(10, 0.5, 123456789).state_dict()
    assert "seed" not in state and 123456789 not in state.values()


# --------------------------------------------------------------------------- noise and clipping


def test_noise_std_matches_sigma_c_over_b_and_is_added_once():
    sigma, clip, b, dim = 1.3, 0.7, 20.0, 4000
    draws = []
    for seed in range(25):
        gen = torch.Generator().manual_seed(seed)
        draws.append(
            privatize(
                torch.zeros(dim),
                noise_multiplier=sigma,
                max_grad_norm=clip,
                expected_batch_size=b,
                add_noise=True,
                generator=gen,
                all_reduce=None,
            )
        )
    x = torch.stack(draws)
    expected = sigma * clip / b
    assert x.mean().abs() < 5 * expected / math.sqrt(x.numel())
    assert x.std().item() == pytest.approx(expected, rel=0.02)
    # Independent across seeds.
    assert abs(np.corrcoef(x[0].numpy(), x[1].numpy())[0, 1]) < 0.06

    # Two "ranks": only rank 0 adds noise; the sum has the same std, not sqrt(2) more.
    def ranks_sum(seed):
        gens = [torch.Generator().manual_seed(seed), None]
        parts = [
            privatize(
                torch.zeros(dim),
                noise_multiplier=sigma,
                max_grad_norm=clip,
                expected_batch_size=1.0,
                add_noise=(r == 0),
                generator=gens[r],
                all_reduce=None,
            )
            for r in range(2)
        ]
        return (parts[0] + parts[1]) / b

    y = torch.stack([ranks_sum(s) for s in range(25)])
    assert y.std().item() == pytest.approx(expected, rel=0.02)
    # No noise, no change: the sum is just divided by B.
    g = torch.arange(6, dtype=torch.float32)
    out = privatize(
        g,
        noise_multiplier=sigma,
        max_grad_norm=clip,
        expected_batch_size=3.0,
        add_noise=False,
        generator=None,
        all_reduce=None,
    )
    assert torch.allclose(out, g / 3.0) and torch.equal(g, torch.arange(6, dtype=torch.float32))


def test_clip_and_sum_bounds_each_record_jointly_over_parameters():
    torch.manual_seed(0)
    a = torch.randn(5, 3, 4) * torch.tensor([0.01, 1, 10, 100, 0.5]).view(5, 1, 1)
    b = torch.randn(5, 7)
    out = clip_and_sum([a, b], max_grad_norm=1.0)
    flat = torch.cat([a.reshape(5, -1), b.reshape(5, -1)], dim=1)
    norms = flat.norm(dim=1)
    manual = (flat * (1.0 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    assert torch.allclose(out, manual, atol=1e-5)
    # Each clipped record's norm is at most C: the sensitivity bound.
    for i in range(5):
        single = clip_and_sum([a[i : i + 1], b[i : i + 1]], 1.0)
        assert single.norm() <= 1.0 + 1e-6
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(7))]
    apply_flat_gradient(params, out)
    assert torch.equal(params[1].grad, out[12:])


# --------------------------------------------------------------------------- per-record gradients


def _tiny_lora_model(seed: int = 0):
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
    # Non-zero LoRA B so that every adapter weight has a gradient signal.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def _dpft(model: torch.nn.Module) -> Objective:
    """The dpft objective (per-record mean token CE) around ``model``."""
    return Objective(
        get_method("dpft"), model, MethodContext(cfg=TrainConfig(), eos_id=0, pad_id=0)
    )


def loss_fn(module: torch.nn.Module, batch) -> torch.Tensor:
    return module(batch)


def _rows(seed: int, n: int) -> list[Encoded]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        ids = torch.randint(1, 97, (length,), generator=g).tolist()
        split = length // 3
        rows.append(Encoded(tuple(ids), tuple([PROMPT] * split + [CODE] * (length - split))))
    return rows


@pytest.mark.heavy
def test_dpft_loss_of_a_record_does_not_depend_on_its_batch():
    model = _dpft(_tiny_lora_model())
    rows = _rows(1, 4)
    with torch.no_grad():
        together = loss_fn(model, collate(rows, pad_id=0))
        alone = torch.cat([loss_fn(model, collate([r], pad_id=0)) for r in rows])
    assert together.shape == (4,)
    assert torch.allclose(together, alone, atol=1e-5)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_clipped_sum_equals_sum_of_individually_clipped_record_gradients(mode):
    rows = _rows(2, 5)
    reference = _dpft(_tiny_lora_model())
    params = [p for p in reference.parameters() if p.requires_grad]
    grads = []
    for r in rows:
        reference.zero_grad()
        loss_fn(reference, collate([r], pad_id=0)).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
    norms = sorted(g.norm().item() for g in grads)
    clip = (norms[1] + norms[2]) / 2  # some records clipped, some not
    expected = sum(g * min(1.0, clip / (g.norm().item() + 1e-6)) for g in grads)

    model = _dpft(_tiny_lora_model())
    clipper = PerSampleClipper(model, mode=mode, max_grad_norm=clip)
    got = clipper.clipped_sum(loss_fn, collate(rows, pad_id=0), batch_size=len(rows))
    assert torch.allclose(got, expected, atol=2e-6, rtol=1e-4)
    # Nothing per-record survives the call, and frozen weights never get a gradient.
    for p in model.parameters():
        assert p.grad is None and getattr(p, "grad_sample", None) is None
    # An empty batch is a zero sum (the step then releases noise only).
    assert torch.equal(clipper.clipped_sum(loss_fn, None, 0), torch.zeros_like(got))


def test_refuses_batch_norm_and_wrong_loss_shapes():
    with pytest.raises(ValueError, match="batch-statistics"):
        check_private_trainable(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    clipper = PerSampleClipper(_dpft(_tiny_lora_model()))
    batch = collate(_rows(3, 3), pad_id=0)
    with pytest.raises(ValueError, match="one loss per record"):
        clipper.clipped_sum(lambda m, b: m(b).mean(), batch, batch_size=3)
    with pytest.raises(ValueError, match="grad_sample_mode"):
        PerSampleClipper(_tiny_lora_model(), mode="ew")


def _poisoned_loss(module, batch):
    # A record whose loss is NaN or inf (a poisoned record): scale NaN / inf on its row.
    return module(batch) * batch["scale"]


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_poisoned_record_contributes_zero_and_is_counted(mode, poison):
    """One record's NaN/inf gradient neither poisons the noisy sum nor stops the step."""
    rows = _rows(3, 4)
    clipper = PerSampleClipper(_dpft(_tiny_lora_model()), mode=mode, max_grad_norm=0.05)
    scale = torch.tensor([1.0, poison, 1.0, 1.0])
    got = clipper.clipped_sum(_poisoned_loss, collate(rows, 0, scale=scale), 4)
    assert clipper.last_nonfinite == 1 and torch.isfinite(got).all()
    clean = [rows[0], rows[2], rows[3]]
    expected = clipper.clipped_sum(_poisoned_loss, collate(clean, 0, scale=torch.ones(3)), 3)
    assert clipper.last_nonfinite == 0
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)
    noisy = privatize(
        got,
        noise_multiplier=1.0,
        max_grad_norm=0.05,
        expected_batch_size=4,
        add_noise=True,
        generator=torch.Generator().manual_seed(0),
        all_reduce=None,
    )
    assert torch.isfinite(noisy).all()
    # Every record poisoned: zeros, all counted.
    allbad = clipper.clipped_sum(
        _poisoned_loss, collate(rows, 0, scale=torch.full((4,), poison)), 4
    )
    assert clipper.last_nonfinite == 4 and torch.equal(allbad, torch.zeros_like(allbad))
