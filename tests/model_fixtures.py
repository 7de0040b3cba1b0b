"""Session fixtures of small model artifacts over the ci base: a premium release and PAC
worlds (imported by tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def premium_release(ci_base_cache, tmp_path_factory):
    """A premium-style release: a LoRA adapter + premium.json.

    The adapter's B matrices are large random values, so the adapter dominates
    the tiny base model: completions are varied, non-blank token soup whatever
    the base model learnt (a busy machine can stop its training early).
    """
    import torch
    from conftest import premium_json  # conftest imports this module

    from privcode.config import BaseConfig
    from privcode.models.base import build_base
    from privcode.models.loading import attach_lora, load_causal_lm

    base = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    root = tmp_path_factory.mktemp("premium")
    with torch.random.fork_rng():  # LoRA's A matrices: not from what earlier tests drew
        torch.manual_seed(0)
        model = attach_lora(load_causal_lm(base), r=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(root / "adapter"))
    (root / "premium.json").write_text(premium_json(base), encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def pac_worlds(ci_base_cache, tmp_path_factory):
    """A worlds artifact of m=4 LoRA adapters with different large random B matrices.

    The adapters dominate the tiny base model, so the worlds disagree on most
    tokens (they cost budget) while some tokens stay unanimous.
    """
    import json

    import torch

    from privcode.config import BaseConfig
    from privcode.models.base import build_base
    from privcode.models.loading import attach_lora, load_causal_lm

    base = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    root = tmp_path_factory.mktemp("pac-worlds")
    model = attach_lora(load_causal_lm(base), r=4, alpha=8)  # one "default" adapter, re-drawn
    names = [f"w{s:03d}" for s in range(4)]
    for s, name in enumerate(names):
        gen = torch.Generator().manual_seed(100 + s)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen))
        model.save_pretrained(str(root / "adapters" / name))
    (root / "pac.json").write_text(
        json.dumps(
            {
                "format": "privcode-pac-worlds/1",
                "m": 4,
                "base_model": str(base),
                "worlds": names,
                "lora": {"r": 4, "alpha": 8},
                "NOT_PRIVATE": "test worlds",
            }
        ),
        encoding="utf-8",
    )
    return root


@pytest.fixture(scope="session")
def pac_unanimous(pac_worlds, tmp_path_factory):
    """A PacEnsemble over ``pac_worlds`` with every adapter world 0's: every token is
    unanimous (free), so greedy PAC decoding is deterministic and does not depend on the
    curator's noise, nor on the order its steps come in."""
    import shutil

    from privcode.pac.ensemble import PacEnsemble

    root = tmp_path_factory.mktemp("unanimous") / "worlds"
    shutil.copytree(pac_worlds, root)
    for world in sorted((root / "adapters").iterdir())[1:]:
        shutil.rmtree(world)
        shutil.copytree(root / "adapters" / "w000", world)
    return PacEnsemble(root, device="cpu")


@pytest.fixture(scope="session")
def pac_ensemble(pac_worlds):
    """A PacEnsemble over ``pac_worlds`` (worlds that disagree on most tokens)."""
    from privcode.pac.ensemble import PacEnsemble

    return PacEnsemble(pac_worlds, device="cpu")
