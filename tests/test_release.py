"""The junior release: format, atomic writes, verification, loading, sampling.

Format and checks: privcode.artifacts.junior; writer: privcode.train.release; loader:
privcode.models.junior.

Built on the session's ``ci`` base model with a small LoRA adapter whose
``lora_B`` weights are perturbed (so the adapter changes the logits) and a
random prefix decoder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import privacy_record
from safetensors.torch import load_file, save_file

from privcode.artifacts.junior import ReleaseError, scan_release, verify_release
from privcode.config import BaseConfig
from privcode.models import ModelLoadError, attach_lora, load_causal_lm
from privcode.models.base import build_base
from privcode.models.junior import JuniorRelease, load_release
from privcode.train.release import write_release

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DZ, K = 16, 4
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def add(a, b):", "import os\nimport sys\n\nclass Walker:\n    def __init__(self):"]


def _lora_checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if "lora_" in name:
            h.update(name.encode())
            h.update(p.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def env(ci_base_cache, tmp_path_factory):
    """The base path, a saved adapter, its checksum, a decoder and two releases."""
    base = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    root = tmp_path_factory.mktemp("release")
    torch.manual_seed(0)
    model = attach_lora(load_causal_lm(base), r=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(root / "adapter"))
    hidden = model.config.hidden_size
    # Large weights, zero bias: z = 0 gives an all-zero prefix, 10 * randn a huge one.
    decoder = {
        "weight": torch.randn(K * hidden, DZ, generator=gen),
        "bias": torch.zeros(K * hidden),
    }
    prefix = {"dz": DZ, "num_virtual_tokens": K, "hidden_size": hidden}
    privacy = privacy_record(epsilon=8.0)
    latent = write_release(
        root / "latent",
        adapter_dir=root / "adapter",
        privacy=privacy,
        meta={
            "method": "privcode++",
            "conditioning": "latent",
            "dp": True,
            "base_model": base,
            "prefix": prefix,
            "alignment": "infonce",
        },
        prefix_decoder=decoder,
    )
    prompt = write_release(
        root / "prompt",
        adapter_dir=root / "adapter",
        privacy=privacy,
        meta={"method": "privcode", "conditioning": "prompt", "dp": True, "base_model": base},
    )
    return {
        "base": base,
        "root": root,
        "adapter": root / "adapter",
        "decoder": decoder,
        "prefix": prefix,
        "privacy": privacy,
        "lora": _lora_checksum(model),
        "latent": latent,
        "prompt": prompt,
    }


@pytest.fixture(scope="module")
def latent_rel(env) -> JuniorRelease:
    return load_release(env["latent"])


@pytest.fixture(scope="module")
def prompt_rel(env) -> JuniorRelease:
    return load_release(env["prompt"])


def _latent_meta(env, **kw):
    return {
        "method": "privcode++",
        "conditioning": "latent",
        "dp": True,
        "base_model": env["base"],
        "prefix": env["prefix"],
        **kw,
    }


# --------------------------------------------------------------------------- round trip


def test_layout_and_manifest(env):
    meta = verify_release(env["latent"])
    assert meta["format"] == "privcode-junior/1" and meta["conditioning"] == "latent"
    assert sorted(meta["files"]) == [
        "adapter/README.md",
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "prefix_decoder.safetensors",
        "privacy.json",
    ]
    assert set(load_file(str(env["latent"] / "prefix_decoder.safetensors"))) == {"weight", "bias"}
    assert "prefix_decoder.safetensors" not in verify_release(env["prompt"])["files"]
    # No temporary or old directories are left next to the releases.
    assert not [p for p in env["root"].iterdir() if p.name.startswith(".")]


def test_round_trip_in_a_fresh_process(env, latent_rel):
    script = (
        "import hashlib, json, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from privcode.models.junior import load_release\n"
        "rel = load_release(sys.argv[1], merge=False)\n"
        "h = hashlib.sha256()\n"
        "for name, p in sorted(rel.model.named_parameters()):\n"
        "    if 'lora_' in name:\n"
        "        h.update(name.encode()); h.update(p.detach().float().contiguous().numpy().tobytes())\n"
        "d = rel.prefix_decoder\n"
        "sha = lambda t: hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()\n"
        "texts = rel.generate(n=3, seed=7, max_new_tokens=12)\n"
        "print(json.dumps({'lora': h.hexdigest(), 'w': sha(d.weight), 'b': sha(d.bias),"
        " 'texts': texts}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(env["latent"])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lora"] == env["lora"]
    assert out["w"] == _tensor_sha(env["decoder"]["weight"])
    assert out["b"] == _tensor_sha(env["decoder"]["bias"])
    # Same seed in another process: the same samples.
    assert out["texts"] == latent_rel.generate(n=3, seed=7, max_new_tokens=12)


def test_adapter_is_applied(env, prompt_rel):
    ids = torch.tensor(
        [prompt_rel.tokenizer("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]]
    )
    with torch.no_grad():
        junior = prompt_rel.model(input_ids=ids).logits
        base = load_causal_lm(env["base"])(input_ids=ids).logits
    assert not prompt_rel.model.training
    assert (junior - base).abs().max() > 1e-3


def test_base_model_override(env, tmp_path):
    moved = write_release(
        tmp_path / "moved",
        adapter_dir=env["adapter"],
        privacy=env["privacy"],
        meta={
            "method": "dpft",
            "conditioning": "prompt",
            "dp": True,
            "base_model": str(tmp_path / "elsewhere" / "base"),
        },
    )
    with pytest.raises(ModelLoadError, match="elsewhere"):
        load_release(moved)
    rel = load_release(moved, base_model=env["base"], merge=False)
    assert _lora_checksum(rel.model) == env["lora"]


def test_merged_release_computes_what_the_adapter_does(env, prompt_rel):
    """The default load folds W + (alpha/r) B A into the base: same logits, no LoRA layers."""
    unmerged = load_release(env["prompt"], merge=False)
    assert not any("lora_" in n for n, _ in prompt_rel.model.named_parameters())
    assert any("lora_" in n for n, _ in unmerged.model.named_parameters())
    ids = torch.tensor([prompt_rel.tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a, b = prompt_rel.model(input_ids=ids).logits, unmerged.model(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-4 * b.abs().max()


# --------------------------------------------------------------------------- generation


def test_latent_generation(latent_rel):
    rel = latent_rel
    assert (rel.dz, rel.num_virtual_tokens, rel.conditioning, rel.dp) == (DZ, K, "latent", True)
    z = rel.sample_z(4, seed=3)
    assert z.shape == (4, DZ) and torch.equal(z, rel.sample_z(4, seed=3))
    assert rel.prefix(z).shape == (4, K, rel.meta["prefix"]["hidden_size"])
    state = torch.random.get_rng_state()
    a = rel.generate(z=z, max_new_tokens=16, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    assert a == rel.generate(z=z, max_new_tokens=16, seed=5)
    assert len(a) == 4 and all(isinstance(t, str) for t in a)
    far = torch.randn(1, DZ, generator=torch.Generator().manual_seed(9)) * 10
    g0 = rel.generate(z=far * 0, max_new_tokens=16, temperature=0)
    g1 = rel.generate(z=far, max_new_tokens=16, temperature=0)
    assert g0 != g1


def test_generate_argument_errors(latent_rel, prompt_rel):
    with pytest.raises(ValueError, match=f"\\[B, {DZ}\\]"):
        latent_rel.generate(z=torch.zeros(2, DZ + 1))
    with pytest.raises(ValueError, match="prompts given"):
        latent_rel.generate(prompts=["def f():"])
    with pytest.raises(ValueError, match="temperature"):
        latent_rel.generate(n=1, temperature=-0.5)
    with pytest.raises(ValueError, match="needs z"):
        latent_rel.generate()
    with pytest.raises(ValueError, match="needs prompts"):
        prompt_rel.generate(n=2)
    with pytest.raises(ValueError, match="z given"):
        prompt_rel.generate(prompts=["x"], z=torch.zeros(1, DZ))
    with pytest.raises(ReleaseError, match="no latent"):
        prompt_rel.prefix(torch.zeros(1, DZ))


def test_prompt_greedy_matches_a_manual_argmax_loop(prompt_rel):
    rel, steps = prompt_rel, 8
    ids = rel.tokenizer(PROMPTS[0].rstrip() + "\n", add_special_tokens=False)["input_ids"]
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):  # no KV cache: the whole sequence every step
            logits = rel.model(input_ids=torch.tensor([ids + new])).logits
            new.append(int(logits[0, -1].argmax()))
    eos = rel.tokenizer.eos_token_id
    expected = rel.tokenizer.decode(
        new[: new.index(eos)] if eos in new else new, skip_special_tokens=True
    )
    assert rel.generate(prompts=[PROMPTS[0]], max_new_tokens=steps, temperature=0) == [expected]


def test_batched_prompts_match_one_by_one(prompt_rel):
    batch = prompt_rel.generate(prompts=PROMPTS, max_new_tokens=16, temperature=0)
    single = [
        prompt_rel.generate(prompts=[p], max_new_tokens=16, temperature=0)[0] for p in PROMPTS
    ]
    assert batch == single
    sampled = prompt_rel.generate(prompts=PROMPTS, max_new_tokens=16, seed=11)
    assert sampled == prompt_rel.generate(prompts=PROMPTS, max_new_tokens=16, seed=11)


# --------------------------------------------------------------------------- verification


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_verify_detects_a_tampered_file(env, tmp_path):
    rel = _copy(env["latent"], tmp_path / "r")
    path = rel / "prefix_decoder.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ReleaseError, match="prefix_decoder.safetensors: sha256 mismatch"):
        verify_release(rel)
    with pytest.raises(ReleaseError, match="prefix_decoder.safetensors"):
        load_release(rel)


def test_verify_detects_unlisted_and_missing_files(env, tmp_path):
    rel = _copy(env["prompt"], tmp_path / "r")
    (rel / "adapter" / "encoder.safetensors").write_bytes(b"x")
    with pytest.raises(ReleaseError, match="encoder.safetensors: not listed"):
        verify_release(rel)
    rel = _copy(env["prompt"], tmp_path / "r2")
    (rel / "release.json").unlink()
    with pytest.raises(ReleaseError, match="release.json: missing"):
        verify_release(rel)
    rel = _copy(env["prompt"], tmp_path / "r3")
    meta = json.loads((rel / "release.json").read_text())
    (rel / "release.json").write_text(json.dumps({**meta, "format": "privcode-junior/0"}))
    with pytest.raises(ReleaseError, match="format"):
        verify_release(rel)


# --------------------------------------------------------------------------- write refusals


def test_write_refuses_leaks_and_bad_meta(env, tmp_path):
    dec, out = env["decoder"], tmp_path / "out"
    with pytest.raises(ValueError, match="exactly"):
        write_release(
            out,
            adapter_dir=env["adapter"],
            meta=_latent_meta(env),
            privacy=env["privacy"],
            prefix_decoder={**dec, "encoder.weight": torch.zeros(3, 3)},
        )
    with pytest.raises(ValueError, match="shape"):
        write_release(
            out,
            adapter_dir=env["adapter"],
            meta=_latent_meta(env),
            privacy=env["privacy"],
            prefix_decoder={"weight": dec["weight"][:, :-1], "bias": dec["bias"]},
        )
    with pytest.raises(ValueError, match="needs its prefix decoder"):
        write_release(
            out, adapter_dir=env["adapter"], meta=_latent_meta(env), privacy=env["privacy"]
        )
    with pytest.raises(ValueError, match="conditioning"):
        write_release(
            out,
            adapter_dir=env["adapter"],
            privacy=env["privacy"],
            meta={
                "method": "x",
                "conditioning": "latentish",
                "dp": True,
                "base_model": env["base"],
            },
        )
    bad = _copy(env["adapter"], tmp_path / "bad-adapter")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    save_file(
        {**tensors, "base_model.model.code_encoder.mu.weight": torch.zeros(2, 2)},
        str(bad / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="code_encoder.mu.weight"):
        write_release(
            out, adapter_dir=bad, meta=_latent_meta(env), privacy=env["privacy"], prefix_decoder=dec
        )
    extra = _copy(env["adapter"], tmp_path / "extra-adapter")
    (extra / "encoder.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="encoder.safetensors"):
        write_release(
            out,
            adapter_dir=extra,
            meta=_latent_meta(env),
            privacy=env["privacy"],
            prefix_decoder=dec,
        )
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["bad-adapter", "extra-adapter"]


def test_failed_rewrite_leaves_the_old_release_intact(env, tmp_path):
    rel = _copy(env["latent"], tmp_path / "rel")
    before = {p.relative_to(rel).as_posix(): p.read_bytes() for p in rel.rglob("*") if p.is_file()}
    # Fails midway: after the adapter is copied, when the decoder is checked.
    with pytest.raises(ValueError, match="exactly"):
        write_release(
            rel,
            adapter_dir=env["adapter"],
            meta=_latent_meta(env),
            privacy=env["privacy"],
            prefix_decoder={**env["decoder"], "encoder.weight": torch.zeros(1)},
        )
    after = {p.relative_to(rel).as_posix(): p.read_bytes() for p in rel.rglob("*") if p.is_file()}
    assert after == before
    verify_release(rel)
    assert os.listdir(tmp_path) == ["rel"]  # the temporary build was removed
    # A successful rewrite replaces it (and leaves nothing aside).
    write_release(
        rel,
        adapter_dir=env["adapter"],
        meta=_latent_meta(env, alignment="cos"),
        privacy=env["privacy"],
        prefix_decoder=env["decoder"],
    )
    assert verify_release(rel)["alignment"] == "cos" and os.listdir(tmp_path) == ["rel"]
    home = tmp_path / "not-a-release"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a release"):
        write_release(
            home,
            adapter_dir=env["adapter"],
            meta=_latent_meta(env),
            privacy=env["privacy"],
            prefix_decoder=env["decoder"],
        )
    assert (home / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- scanning / dp


def test_scan_release_finds_planted_needles(env, tmp_path):
    needle, other = "def secret_fn_8f3a(x):\n    return 'tok'", "zq_private_marker_771"
    assert scan_release(env["latent"], [needle, other]) == []
    rel = _copy(env["latent"], tmp_path / "r")
    (rel / "notes.txt").write_text("prefix " + needle + " suffix", encoding="utf-8")
    save_file(
        {"w": torch.zeros(2)}, str(rel / "adapter" / "blob.safetensors"), metadata={"note": other}
    )
    privacy = json.loads((rel / "privacy.json").read_text())
    (rel / "privacy.json").write_text(json.dumps({**privacy, "leak": needle}))
    hits = scan_release(rel, [needle, other])
    assert sorted(hits) == [
        ("adapter/blob.safetensors", other),
        ("notes.txt", needle),
        ("privacy.json", needle),
    ]


def test_non_private_release_warns_loudly(env, tmp_path):
    out = write_release(
        tmp_path / "uncond",
        adapter_dir=env["adapter"],
        privacy=privacy_record(dp=False),
        meta={
            "method": "pc-uncond",
            "conditioning": "none",
            "dp": False,
            "base_model": env["base"],
        },
    )
    with pytest.warns(RuntimeWarning, match="NOT PRIVATE"):
        rel = load_release(out)
    assert rel.dp is False and rel.dz is None
    texts = rel.generate(n=2, max_new_tokens=8, seed=1)
    assert len(texts) == 2 and texts == rel.generate(n=2, max_new_tokens=8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        load_release(env["prompt"])  # a DP release loads without the warning
