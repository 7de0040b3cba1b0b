"""The stacked multi-adapter LoRA forward (privcode.models.multi_lora): row i through slot i
equals peft's mixed-adapter batch, each world run alone and the plain base, to 1e-5, at
prefill and at a cached step, with adapters of different ranks and scalings; a row order
gathers; the PAC ensemble's step log-probs equal its old peft path; what it cannot compute
is refused by name (and the ensemble falls back to peft's mixed batch)."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
from test_pac_ensemble import _write_artifact

from privcode.config import BaseConfig
from privcode.errors import PrivcodeError
from privcode.models.multi_lora import BASE, MultiLoraError, StackedLora
from privcode.pac.ensemble import PacEnsemble

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-5
#: (rank, alpha) of the three worlds: scalings 2, 4 and 1.5; ranks 4, 8, 4 (rows 0 and 2
#: share a stack: a gathered, non-contiguous group).
SPECS = ((4, 8), (8, 32), (4, 6))
IDS = [5, 17, 99, 230, 7, 8, 41]


@pytest.fixture(scope="module")
def base(ci_base_cache):
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def _adapter(base, path, seed, r, alpha, **config):
    """A saved random adapter (random lora_B, as bench_pac.make_worlds: non-zero deltas)."""
    from peft import get_peft_model

    from privcode.models.loading import load_causal_lm, lora_config

    lm = load_causal_lm(base)
    cfg = lora_config(lm, r=r, alpha=alpha)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = get_peft_model(lm, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi-lora")
    return [_adapter(base, tmp / f"a{s}", 200 + s, r, a) for s, (r, a) in enumerate(SPECS)]


def _peft(base, paths, names):
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm

    model = PeftModel.from_pretrained(load_causal_lm(base), str(paths[0]), adapter_name=names[0])
    for path, name in zip(paths[1:], names[1:], strict=True):
        model.load_adapter(str(path), adapter_name=name)
    return model.eval()


@pytest.fixture(scope="module")
def model(base, adapters):
    return _peft(base, adapters, ["w0", "w1", "w2"])


def _run(model, ids, past=None, **kwargs):
    """(logits [rows, seq, vocab], cache) of one forward of ``ids`` (rows of token ids)."""
    keep = inspect.signature(type(model.get_base_model()).forward).parameters
    arg = "cache" if "cache" in keep else "past_key_values"
    with torch.inference_mode():
        out = model(input_ids=torch.tensor(ids), use_cache=True, **{arg: past}, **kwargs)
    cache = getattr(out, "cache", None)
    return out.logits.float(), cache if cache is not None else out.past_key_values


def _prefill_and_step(model, rows, **kwargs):
    logits, past = _run(model, [IDS] * rows, **kwargs)
    step, _ = _run(model, [[IDS[-1]]] * rows, past, **kwargs)
    return logits, step


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


def _close(a, b) -> bool:
    """Equal to ATOL of the logits' scale (float32 sums in another order: about 1e-5 on
    logits near 6, by machine and thread count)."""
    return _max_diff(a, b) <= ATOL * max(1.0, float(b.abs().max()))


def test_stacked_forward_equals_peft_mixed_batch_each_world_alone_and_the_base(
    model, base, adapters
):
    slots = ["w0", "w1", "w2", BASE]
    stacked = StackedLora(model, slots)
    with stacked.active():
        got = _prefill_and_step(model, 4)
    mixed = _prefill_and_step(model, 4, adapter_names=slots)
    alone = []
    for name in slots[:3]:
        model.set_adapter(name)
        alone.append(_prefill_and_step(model, 1))
    with model.disable_adapter():
        plain = _prefill_and_step(model, 1)
    for phase in (0, 1):  # prefill [4, 7, vocab], then one cached token [4, 1, vocab]
        assert _close(got[phase], mixed[phase])
        for s, world in enumerate(alone):
            assert _close(got[phase][s], world[phase][0])
        assert _close(got[phase][3], plain[phase][0])
        assert _max_diff(got[phase][0], got[phase][1]) > 0.1  # the adapters really act
        assert _max_diff(got[phase][0], got[phase][3]) > 0.1
    # peft's own weights now read the stacks (held once): a freshly loaded world agrees.
    assert stacked.nbytes > 0
    fresh = _peft(base, [adapters[1]], ["w1"])
    assert _close(_prefill_and_step(fresh, 1)[0][0], got[0][1])


def test_an_index_runs_rows_through_any_slots(model):
    stacked = StackedLora(model, ["w0", "w1", BASE, "w2"], share=False)
    order = [3, 0, 2, 0, 1]  # a repeated slot, the base in the middle, ranks interleaved
    with stacked.active(index=order):
        got = _prefill_and_step(model, len(order))
    names = [stacked.slots[i] for i in order]
    want = _prefill_and_step(model, len(order), adapter_names=names)
    for phase in (0, 1):
        assert _close(got[phase], want[phase])
    # Outside the context the model is peft's again.
    model.set_adapter("w1")
    assert _close(_prefill_and_step(model, 1)[0][0], got[0][4])


def test_repeated_tiles_equal_the_same_rows_gathered(model):
    # Two requests decoded together: tile t is rows [4t, 4t + 4), each through slots 0..3.
    stacked = StackedLora(model, ["w0", "w1", "w2", BASE], share=False)
    ids = [IDS] * 4 + [list(reversed(IDS))] * 4  # the tiles differ
    with stacked.active(repeat=2):
        got, past = _run(model, ids)
        step, _ = _run(model, [[IDS[-1]]] * 4 + [[IDS[0]]] * 4, past)
    with stacked.active(index=[0, 1, 2, 3] * 2):
        want, past = _run(model, ids)
        want_step, _ = _run(model, [[IDS[-1]]] * 4 + [[IDS[0]]] * 4, past)
    assert _close(got, want) and _close(step, want_step)
    assert _max_diff(got[0], got[4]) > 0.1  # the tiles really differ
    with pytest.raises(MultiLoraError, match="repeat must be"), stacked.active(repeat=0):
        pass
    with pytest.raises(MultiLoraError, match=r"not 4 x 2"), stacked.active(repeat=2):
        _run(model, [IDS] * 4)


def test_what_it_cannot_compute_is_refused_by_name(model, base, tmp_path):
    stacked = StackedLora(model, ["w0", BASE])
    with pytest.raises(MultiLoraError, match="rows"), stacked.active():
        _run(model, [IDS] * 3)
    with pytest.raises(MultiLoraError, match="not re-entrant"), stacked.active():
        with stacked.active():
            pass
    with pytest.raises(MultiLoraError, match=r"index must list slots"), stacked.active([0, 2]):
        pass
    model.train()
    try:
        with pytest.raises(MultiLoraError, match="eval mode"), stacked.active():
            pass
    finally:
        model.eval()
    for slots, match in (([BASE], "at least one adapter"), (["w0", "w0"], "twice")):
        with pytest.raises(MultiLoraError, match=match):
            StackedLora(model, slots)
    with pytest.raises(MultiLoraError, match="nope"):
        StackedLora(model, ["w0", "nope"])
    dora = _peft(base, [_adapter(base, tmp_path / "dora", 1, 4, 8, use_dora=True)], ["d"])
    with pytest.raises(MultiLoraError, match="'d' is a LoRA variant.*DoRA") as info:
        StackedLora(dora, ["d", BASE])
    assert isinstance(info.value, PrivcodeError)
    emb = _adapter(base, tmp_path / "emb", 2, 4, 8, target_modules=["embed_tokens"])
    with pytest.raises(MultiLoraError, match="embed_tokens: LoRA on a Embedding"):
        StackedLora(_peft(base, [emb], ["e"]), ["e", BASE])


@pytest.fixture(scope="module")
def worlds(base, adapters, tmp_path_factory):
    return _write_artifact(tmp_path_factory.mktemp("mlora-worlds"), base, adapters)


def test_step_logprobs_equal_the_old_peft_path(worlds):
    new = PacEnsemble(worlds, device="cpu", top_k=16)
    old = PacEnsemble(worlds, device="cpu", top_k=16, batching="peft")
    assert new._stacked is not None and old._stacked is None
    ids = new.encode("def add(a, b):\n")
    (a, pa), (b, pb) = new.step_logprobs(ids), old.step_logprobs(ids)
    for _ in range(3):
        assert a.candidates.tolist() == b.candidates.tolist()
        np.testing.assert_allclose(a.worlds, b.worlds, atol=ATOL, rtol=0)
        np.testing.assert_allclose(a.public, b.public, atol=ATOL, rtol=0)
        token = [int(a.candidates[1])]
        (a, pa), (b, pb) = new.step_logprobs(token, pa), old.step_logprobs(token, pb)
    for x, y in zip(new.sequence_logprobs(ids), old.sequence_logprobs(ids), strict=True):
        assert _close(x, y)


def test_the_ensemble_falls_back_to_peft_for_adapters_it_cannot_stack(base, tmp_path, caplog):
    # lora_bias: peft's mixed batch computes it, the stacked forward refuses it (DoRA both do).
    biased = [_adapter(base, tmp_path / f"b{s}", s, 4, 8, lora_bias=True) for s in range(2)]
    caplog.set_level(logging.WARNING, logger="privcode.pac")
    ens = PacEnsemble(_write_artifact(tmp_path / "worlds", base, biased), device="cpu", top_k=4)
    assert ens._stacked is None
    assert "mixed-adapter batch, because" in caplog.text and "lora_bias" in caplog.text
    lp, _ = ens.step_logprobs(ens.encode("x = 1\n"))
    assert lp.worlds.shape == (2, 4) and np.isfinite(lp.worlds).all()
