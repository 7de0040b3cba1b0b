"""The premium fine-tune under DeepSpeed ZeRO-2/3: no rank-0-only collective, fp32 adapters, dtype.

ZeRO-3 partitions the weights over the ranks: every forward pass gathers them
with collectives, and so does assembling the trained adapter (DeepSpeed's
``safe_get_full_fp32_param``). A rank that skips either (a held-out evaluation
or a save on rank 0 only) leaves the others waiting in that collective until
gloo's 30-minute timeout. The CPU tests run two gloo Ray Train workers through
:func:`run_premium` on the ``ci`` base with a pytest timeout, so such a hang
fails the test in minutes instead of blocking the run; they check that the
two-rank held-out loss equals a one-process evaluation of the saved adapter
(so the adapter is the full, trained fp32 weights, not a rank's partition).
The ``gpu`` test runs a ZeRO-3 step on one CUDA worker in bf16.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_premium import _synthetic

from privcode.config import BaseConfig, PremiumConfig
from privcode.premium.train import deepspeed_config, run_premium

#: The smallest run that still has two workers, several steps and a held-out set: 16 records,
#: 4 held out (1 round of 2 batches over 2 ranks), 12 trained on (3 steps of 2 records per rank).
TINY = {
    "epochs": 1,
    "batch_size": 2,
    "lr": 3e-3,
    "lora_r": 4,
    "lora_alpha": 8,
    "max_length": 64,  # the prompts are 20-90 tokens: 32 would leave most without code
    "eval_fraction": 0.25,
}
RECORDS = 16


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def _one_process_heldout_loss(base: str, adapter: Path, data: Path, cfg: PremiumConfig) -> float:
    """The held-out loss of ``adapter`` over ``base``, evaluated in this process (one rank)."""
    from peft import PeftModel

    from privcode.models.encoding import encode_records
    from privcode.models.loading import load_causal_lm, load_tokenizer
    from privcode.premium import train as pt

    tokenizer = load_tokenizer(base)
    pairs = pt._read_synthetic(data)
    train_idx, eval_idx = pt._split(len(pairs), cfg.eval_fraction, cfg.seed)
    held = encode_records([pt._Pair(*pairs[i]) for i in eval_idx], tokenizer, cfg.max_length)
    model = PeftModel.from_pretrained(load_causal_lm(base), str(adapter))
    batch = min(cfg.batch_size, len(train_idx) // cfg.num_workers)
    return pt._heldout_loss(model, held, batch, tokenizer.pad_token_id, torch.device("cpu"), 0, 1)


def _adapter_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter / "adapter_model.safetensors"))


# About 25 s each on 2 idle cores (after the session's ci base and Ray head); 5 minutes seen at
# load 16. A hang would wait for gloo's 30-minute timeout: this fails it at 8 minutes.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("stage", [pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_two_gloo_workers_train_under_zero_without_a_rank0_only_collective(
    ray_connected, base_path, tmp_path, stage
):
    """Two ranks, ZeRO-2 or ZeRO-3 over gloo: held-out forward and adapter save on every rank.

    The old rank-0-only evaluation hangs the ZeRO-3 run here (rank 1 waits in the
    adapter's collective while rank 0 gathers weights for its forward): the timeout fails it.
    """
    data = _synthetic(tmp_path / "synthetic.parquet", RECORDS)
    cfg = PremiumConfig(**TINY, num_workers=2, deepspeed=stage)
    assert cfg.dtype == "auto"  # float32 on the CPU: DeepSpeed's bf16 section stays off
    summary = run_premium(
        cfg,
        data_path=data,
        model_path=base_path,
        out_dir=tmp_path / "out",
        storage_dir=tmp_path / "storage",
    )
    (point,) = summary["curve"]
    assert point["epoch"] == 1 and math.isfinite(point["train_loss"]) and point["train_loss"] > 0
    adapter = tmp_path / "out" / "adapter"
    tensors = _adapter_tensors(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and tensors
    for name, t in tensors.items():  # full fp32 weights, not a rank's (empty) ZeRO-3 partition
        assert t.dtype == torch.float32, name
        assert 4 in t.shape and t.numel() >= 4 * 8, (name, tuple(t.shape))
    # LoRA B starts at zero: every B moved, so the saved weights are the trained ones.
    assert all(t.abs().sum() > 0 for n, t in tensors.items() if "lora_B" in n)
    # The two ranks' all-reduced held-out mean == one process evaluating the saved adapter.
    ref = _one_process_heldout_loss(base_path, adapter, data, cfg)
    assert point["eval_loss"] == pytest.approx(ref, abs=2e-5)


def test_premium_dtype_sets_deepspeed_bf16_and_loads_the_base_in_it(base_path):
    """premium.dtype: auto = float32 on the CPU; bfloat16 loads a bf16 base with fp32 LoRA
    weights and turns DeepSpeed's bf16 section on; float32 leaves it off."""
    from privcode.config import ConfigError, load_config
    from privcode.models.loading import resolve_dtype
    from privcode.premium.train import _premium_model

    assert resolve_dtype(PremiumConfig().dtype, "cpu") == torch.float32
    with pytest.raises(ConfigError, match=r"premium\.dtype: 'float16' is not one of"):
        load_config(None, ["premium.dtype=float16"])
    for name, bf16 in (("float32", False), ("bfloat16", True)):
        cfg = PremiumConfig(dtype=name, deepspeed="zero3", lora_r=4, lora_alpha=8)
        dtype = resolve_dtype(cfg.dtype, "cpu")
        assert deepspeed_config(cfg, use_bf16=dtype == torch.bfloat16)["bf16"]["enabled"] is bf16
        model = _premium_model(base_path, cfg, dtype)
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        trained = {p.dtype for p in model.parameters() if p.requires_grad}
        assert frozen == {dtype} and trained == {torch.float32}


def test_gradient_checkpointing_keeps_the_loss_and_the_lora_gradients(base_path):
    """premium.gradient_checkpointing (HF, non-reentrant): each decoder layer's attention runs
    again in the backward pass (its activations recomputed, not stored), and the loss and LoRA
    gradients equal those without it (fp32 on the CPU)."""
    from privcode.models.encoding import collate, encode_records
    from privcode.models.loading import load_tokenizer
    from privcode.premium.train import _code_loss, _Pair, _premium_model

    tokenizer = load_tokenizer(base_path)
    rows = encode_records(
        [_Pair(f"Return {i} plus x.", f"def f(x):\n    return x + {i}\n") for i in range(3)],
        tokenizer,
        32,
    )
    batch = collate(rows, tokenizer.pad_token_id, device=torch.device("cpu"))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = PremiumConfig(lora_r=4, lora_alpha=8, gradient_checkpointing=checkpointing)
        model = _premium_model(base_path, cfg, torch.float32)
        model.train()
        for n, p in model.named_parameters():  # nonzero B, so A's gradients are not all zero
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        base = model.get_base_model()
        flag = getattr(base, "is_activation_checkpointing", None)
        assert (base.is_gradient_checkpointing if flag is None else flag) is checkpointing
        # HF checkpoints the layer's forward, not its __call__: its submodules' hooks show
        # the recomputation (a pre-hook: torch stops a recomputation once it has what it needs).
        attn = next(m for n, m in base.named_modules() if n.endswith("layers.0.self_attn"))
        calls = []
        attn.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        loss = _code_loss(model, batch)
        assert len(calls) == 1
        loss.backward()
        assert len(calls) == (2 if checkpointing else 1)  # recomputed in the backward pass
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((float(loss.detach()), grads))
    (loss0, g0), (loss1, g1) = results
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert g0.keys() == g1.keys() and all(g0[n].abs().sum() > 0 for n in g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(420)
def test_zero3_premium_step_on_one_cuda_worker_in_bf16(ray_connected, base_path, tmp_path):
    """ZeRO-3 on one GPU worker (NCCL), premium.dtype auto = bfloat16 on a bf16 GPU: the
    steps run, the eval loss is finite, the adapter is saved in fp32 and matches a CPU fp32
    evaluation of it within bf16's precision."""
    assert torch.cuda.is_bf16_supported(), "this test is written for a bf16-capable GPU"
    data = _synthetic(tmp_path / "synthetic.parquet", RECORDS)
    cfg = PremiumConfig(**TINY, num_workers=1, use_gpu=True, deepspeed="zero3")
    summary = run_premium(
        cfg,
        data_path=data,
        model_path=base_path,
        out_dir=tmp_path / "out",
        storage_dir=tmp_path / "storage",
    )
    (point,) = summary["curve"]
    assert math.isfinite(point["train_loss"]) and math.isfinite(point["eval_loss"])
    assert json.loads((tmp_path / "out" / "premium.json").read_text())["config"]["dtype"] == "auto"
    adapter = tmp_path / "out" / "adapter"
    tensors = _adapter_tensors(adapter)
    assert tensors and all(t.dtype == torch.float32 for t in tensors.values())
    assert all(t.abs().sum() > 0 for n, t in tensors.items() if "lora_B" in n)
    ref = _one_process_heldout_loss(base_path, adapter, data, cfg)  # fp32 on the CPU
    assert point["eval_loss"] == pytest.approx(ref, rel=0.05)
