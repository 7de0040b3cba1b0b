"""The m PAC worlds: batched mixed-adapter training equals m independent trainings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from privcode.config import BaseConfig, PacConfig
from privcode.data.records import write_records
from privcode.models.base import build_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base(ci_base_cache):
    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("pac-data") / "train.jsonl"
    recs = [
        {
            "id": f"r{i}",
            "prompt": f"Return {i} plus x.",
            "code": f"def add_{i}(x):\n    return x + {i}\n",
        }
        for i in range(24)
    ]
    write_records(recs, path)
    return path


def test_mixed_adapter_gradients_equal_separate_trainings(base, corpus):
    """One batched pass over rows of two worlds gives each adapter exactly the gradient of
    its own rows alone (the identity the trainer relies on)."""
    from peft import get_peft_model

    from privcode.data.records import read_records
    from privcode.models.encoding import collate, encode_records
    from privcode.models.loading import load_causal_lm, load_tokenizer, lora_config
    from privcode.pac.worlds import _row_losses

    tok = load_tokenizer(base)
    enc = encode_records(read_records(corpus)[:6], tok, 32)
    lm = load_causal_lm(base)
    cfg = lora_config(lm, r=4, alpha=8)
    model = get_peft_model(lm, cfg, adapter_name="w0")
    model.add_adapter("w1", cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    model.eval()
    pad = tok.pad_token_id or 0
    rows = collate(enc, pad)
    names = ["w0"] * 3 + ["w1"] * 3
    _row_losses(model, rows, names).sum().backward()
    mixed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for name, part in (("w0", enc[:3]), ("w1", enc[3:])):
        r = collate(part, pad)
        _row_losses(model, r, [name] * 3).sum().backward()
    separate = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert set(mixed) == set(separate) and any(".w1." in n for n in mixed)
    for n in mixed:
        torch.testing.assert_close(mixed[n], separate[n], atol=1e-6, rtol=1e-4)


def test_train_worlds_writes_m_adapters_that_learn_their_members(base, corpus, tmp_path):
    from peft import PeftModel

    from privcode.data.records import read_records
    from privcode.models.encoding import collate, encode_records
    from privcode.models.loading import load_causal_lm, load_tokenizer
    from privcode.pac.worlds import MANIFEST, train_worlds

    cfg = PacConfig(worlds=4, steps=40, batch_size=3, lr=1e-2, max_length=32, lora_r=4)
    with pytest.warns(RuntimeWarning, match="WITHOUT DP"):
        summary = train_worlds(cfg, data=corpus, base=base, out_dir=tmp_path, progress=False)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["format"] == "privcode-pac-worlds/1" and manifest["m"] == 4
    assert manifest["worlds"] == ["w000", "w001", "w002", "w003"] and manifest["dp"] is False
    # Trained by the DP engine's one off switch, which names itself in the artifact.
    assert manifest["training_mode"]["mode"] == "non-private"
    from privcode.models.chat import CHAT_TEMPLATE

    assert manifest["chat_template"] == CHAT_TEMPLATE  # the worlds' training format
    assert "PAC curator" in manifest["training_mode"]["reason"]
    assert summary["records"] == 24 and "Return" not in json.dumps(summary)
    assignment = np.load(tmp_path / "assignment.npy")
    assert assignment.shape == (24, 4) and (assignment.sum(1) == 2).all()
    for w in manifest["worlds"]:
        assert (tmp_path / "adapters" / w / "adapter_config.json").is_file()

    tok = load_tokenizer(base)
    enc = encode_records(read_records(corpus), tok, 32)
    pad = tok.pad_token_id or 0
    model = PeftModel.from_pretrained(
        load_causal_lm(base), str(tmp_path / "adapters" / "w000"), adapter_name="w000"
    )
    model.load_adapter(str(tmp_path / "adapters" / "w001"), adapter_name="w001")
    model.eval()
    members = [i for i in range(24) if assignment[i, 0]]
    rows = collate([enc[i] for i in members], pad)
    from privcode.pac.worlds import _row_losses

    with torch.no_grad():
        world = _row_losses(model, rows, ["w000"] * len(members)).mean().item()
        public = _row_losses(model, rows, ["__base__"] * len(members)).mean().item()
        other = _row_losses(model, rows, ["w001"] * len(members))
    assert world < 0.7 * public  # the world fitted its members
    assert not torch.allclose(other, torch.tensor(world))  # worlds differ


def test_grouping_does_not_change_the_worlds(ray_connected, base, corpus, tmp_path):
    """Two parallel Ray tasks (2 worlds each) train the same adapters as one batched pass
    over 4 worlds: a world's init and batches depend on (seed, world) only, and its
    gradient on its own rows only."""
    from safetensors.torch import load_file

    from privcode.pac.worlds import train_worlds

    runs = {}
    for groups in (1, 2):
        cfg = PacConfig(
            worlds=4, steps=3, batch_size=2, lr=1e-2, max_length=24, lora_r=2, world_groups=groups
        )
        with pytest.warns(RuntimeWarning):
            summary = train_worlds(
                cfg, data=corpus, base=base, out_dir=tmp_path / str(groups), progress=False
            )
        assert [g["worlds"] for g in summary["groups"]] == ([4] if groups == 1 else [2, 2])
        runs[groups] = {
            w: load_file(str(tmp_path / str(groups) / "adapters" / w / "adapter_model.safetensors"))
            for w in ("w000", "w001", "w002", "w003")
        }
    for w, weights in runs[1].items():
        assert set(weights) == set(runs[2][w])
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, runs[2][w][name], atol=1e-5, rtol=1e-4)
    a, b = runs[1]["w000"], runs[1]["w001"]
    assert any(not torch.allclose(a[k], b[k]) for k in a)  # and the worlds differ


def test_worlds_config_is_checked():
    from privcode.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="pac.worlds.*even"):
        load_config(None, overrides=["pac.worlds=5"])
