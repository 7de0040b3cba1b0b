"""The PAC ensemble: one batched m+1-row forward equals the m worlds and the base run apart,
the KV cache changes nothing, and generation follows the mechanism (free unanimity, charged
dissent, public fallback), stop strings and limits; bad artifacts are clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from privcode.config import BaseConfig
from privcode.errors import PrivcodeError
from privcode.pac.curator import Curator, UnknownSessionError
from privcode.pac.ensemble import PacEnsemble, PacEnsembleError, read_manifest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 8
PROMPT = "def add(a, b):\n"
SECRET_PROMPT = "SECRET-PROMPT-9c1e"


def _write_artifact(root, base, adapters):
    """A worlds artifact: adapters[s] (a saved adapter dir) becomes world s."""
    names = [f"w{s:03d}" for s in range(len(adapters))]
    for name, src in zip(names, adapters, strict=True):
        shutil.copytree(src, root / "adapters" / name)
    (root / "pac.json").write_text(
        json.dumps(
            {
                "format": "privcode-pac-worlds/1",
                "m": len(names),
                "base_model": str(base),
                "worlds": names,
                "lora": {"r": 4, "alpha": 8},
                "NOT_PRIVATE": "test worlds",
            }
        )
    )
    return root


@pytest.fixture(scope="module")
def artifacts(ci_base_cache, tmp_path_factory):
    """Four distinct random worlds (large random lora_B, so they dominate the tiny base and
    disagree), and two identical worlds (copies of the first distinct one)."""
    from privcode.models.base import build_base
    from privcode.models.loading import attach_lora, load_causal_lm

    base = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    tmp = tmp_path_factory.mktemp("pac")
    saved = []
    for seed in range(4):
        model = attach_lora(load_causal_lm(base), r=4, alpha=8)
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
        model.save_pretrained(str(tmp / f"raw{seed}"))
        saved.append(tmp / f"raw{seed}")
    distinct = _write_artifact(tmp / "distinct", base, saved)
    same = _write_artifact(tmp / "same", base, [saved[0], saved[0]])
    return {"base": base, "distinct": distinct, "same": same}


@pytest.fixture(scope="module")
def ens(artifacts):
    return PacEnsemble(artifacts["distinct"], device="cpu", top_k=K)


@pytest.fixture(scope="module")
def same_ens(artifacts):
    return PacEnsemble(artifacts["same"], device="cpu", top_k=K)


@pytest.fixture(scope="module")
def refs(artifacts):
    """The base and each world as separate single models (the slow, obvious way)."""
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm

    base = artifacts["base"]
    worlds = [
        PeftModel.from_pretrained(
            load_causal_lm(base), str(artifacts["distinct"] / "adapters" / f"w{s:03d}")
        ).eval()
        for s in range(4)
    ]
    return {"base": load_causal_lm(base), "worlds": worlds}


@torch.inference_mode()
def full_lp(model, ids) -> np.ndarray:
    logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1).double().numpy()


def reference(ens, refs, n, choose, prompt=PROMPT):
    """Greedy-style decoding by full recompute: ``choose(base_lp, worlds_lp, cand, step)``."""
    ids, out = ens.encode(prompt), []
    for step in range(n):
        base_lp = full_lp(refs["base"], ids)
        cand = np.argsort(-base_lp, kind="stable")[:K]
        worlds_lp = np.stack([full_lp(w, ids)[cand] for w in refs["worlds"]])
        tok = int(cand[choose(base_lp[cand], worlds_lp, step)])
        out.append(tok)
        if tok in ens.eos_ids:
            break
        ids.append(tok)
    return out


def curator(m, b=0.5, budget=100.0, session=100.0):
    cur = Curator(m, b, deployment_budget=budget, session_budget=session, rng_seed=0)
    return cur, cur.open_session()


def test_one_batched_forward_equals_the_worlds_and_the_base_run_apart(ens, refs):
    ids = ens.encode(PROMPT)
    vocab = full_lp(refs["base"], ids).size
    ens.top_k = vocab  # compare the whole distributions, not only V_t
    try:
        lp, _ = ens.step_logprobs(ids)
    finally:
        ens.top_k = K
    order = np.argsort(lp.candidates)
    base_lp = full_lp(refs["base"], ids)
    np.testing.assert_allclose(lp.public[order], base_lp, atol=1e-5, rtol=0)
    for s, world in enumerate(refs["worlds"]):
        np.testing.assert_allclose(lp.worlds[s][order], full_lp(world, ids), atol=1e-5, rtol=0)
    assert np.abs(lp.worlds[0] - lp.worlds[1]).max() > 0.1  # the worlds really differ
    # Candidates: the base's top-k, best first.
    small, _ = ens.step_logprobs(ids)
    assert small.candidates.tolist() == np.argsort(-base_lp, kind="stable")[:K].tolist()
    assert small.worlds.shape == (4, K) and small.public.shape == (K,)
    assert np.all(np.diff(small.public) <= 0)


def test_the_kv_cache_equals_a_full_recompute(ens):
    ids = ens.encode(PROMPT)
    lp, past = ens.step_logprobs(ids)
    extra = []
    for _ in range(3):
        extra.append(int(lp.candidates[1]))
        lp, past = ens.step_logprobs([extra[-1]], past)
    full, _ = ens.step_logprobs(ids + extra)
    assert lp.candidates.tolist() == full.candidates.tolist()
    # fp32 log-probs near -8: a cached and a full attention sum in another order, which
    # moves them by up to about 2e-6 relative (1.3e-5 absolute, seen on a busy machine).
    np.testing.assert_allclose(lp.worlds, full.worlds, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lp.public, full.public, atol=1e-5, rtol=1e-5)


def test_sequence_logprobs_equal_the_step_prefill_at_every_prefix(ens):
    ids = ens.encode(PROMPT)
    public, worlds = ens.sequence_logprobs(ids)
    assert public.shape[0] == len(ids) and worlds.shape[:2] == (ens.m, len(ids))
    for t in (0, len(ids) // 2, len(ids) - 1):
        lp, _ = ens.step_logprobs(ids[: t + 1])
        cand = torch.as_tensor(lp.candidates)
        # float32 sums over prefixes of different lengths: a few 1e-5 apart
        np.testing.assert_allclose(public[t, cand].numpy(), lp.public, atol=1e-4, rtol=0)
        np.testing.assert_allclose(worlds[:, t, cand].numpy(), lp.worlds, atol=1e-4, rtol=0)


def test_identical_worlds_are_free_and_decode_like_the_single_adapter(same_ens, refs):
    cur, sid = curator(2)
    out = same_ens.generate(cur, sid, PROMPT, 12)
    n = len(out.token_ids)
    assert (out.free_tokens, out.private_tokens, out.fallback_tokens, out.charged_nats) == (
        n,
        0,
        0,
        0.0,
    )
    assert list(out.token_ids) == reference(same_ens, refs, 12, lambda b, w, t: np.argmax(w[0]))
    assert cur.session_info(sid)["free_tokens"] == n
    # Coupled Gumbel: one public draw per step, seeded; identical worlds still agree.
    draws = np.random.default_rng(5)
    gumbels = [draws.gumbel(size=K) for _ in range(12)]
    out = same_ens.generate(cur, sid, PROMPT, 12, decoder="gumbel", temperature=0.7, seed=5)
    assert out.free_tokens == len(out.token_ids) and out.charged_nats == 0
    expected = reference(same_ens, refs, 12, lambda b, w, t: np.argmax(w[0] / 0.7 + gumbels[t]))
    assert list(out.token_ids) == expected
    again = same_ens.generate(cur, sid, PROMPT, 12, decoder="gumbel", temperature=0.7, seed=5)
    assert again == out


def test_dissenting_worlds_are_charged_b_per_private_token(ens):
    cur, sid = curator(4, b=0.5)
    out = ens.generate(cur, sid, PROMPT, 16)
    assert out.private_tokens > 0 and out.fallback_tokens == 0
    assert out.private_tokens + out.free_tokens == len(out.token_ids)
    assert out.charged_nats == 0.5 * out.private_tokens
    info = cur.session_info(sid)
    assert (info["private_tokens"], info["charged"]) == (out.private_tokens, out.charged_nats)


@pytest.mark.parametrize("decoder", ["greedy", "gumbel"])
def test_a_spent_budget_falls_back_to_the_public_model(ens, refs, decoder):
    cur, sid = curator(4, b=0.5, session=0.25)  # not enough for one private token
    gumbels = [np.random.default_rng(3).gumbel(size=(16, K))[t] for t in range(16)]

    def choose(base, worlds, t):
        g = gumbels[t] if decoder == "gumbel" else np.zeros(K)
        votes = np.argmax(worlds + g, axis=1)
        return votes[0] if np.all(votes == votes[0]) else np.argmax(base + g)

    out = ens.generate(cur, sid, PROMPT, 16, decoder=decoder, seed=3)
    assert out.private_tokens == 0 and out.charged_nats == 0 and out.fallback_tokens > 0
    assert out.fallback_tokens + out.free_tokens == len(out.token_ids)
    assert list(out.token_ids) == reference(ens, refs, 16, choose)


#: Mid-statement, so that the first token is never end-of-text (the base, pretrained on
#: whole functions each followed by EOS, may end a function right after its signature).
BODY_PROMPT = "def add(a, b):\n    total = a"


def test_stop_strings_and_max_tokens(same_ens):
    cur, sid = curator(2)
    full = same_ens.generate(cur, sid, BODY_PROMPT, 24)
    if full.finish_reason == "length":
        assert len(full.token_ids) == 24
    assert len(full.text) >= 6, "the random worlds should write some text"
    stop = full.text[3:5]
    cut = same_ens.generate(cur, sid, BODY_PROMPT, 24, stop=("\x00never", stop))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    one = same_ens.generate(cur, sid, BODY_PROMPT, 1)
    assert len(one.token_ids) == 1 and one.token_ids[0] == full.token_ids[0]
    assert one.finish_reason in ("length", "stop")


def test_requests_are_checked_and_nothing_private_is_logged(ens, caplog):
    cur, sid = curator(4)
    with pytest.raises(PacEnsembleError, match="m=2"):
        ens.generate(curator(2)[0], sid, PROMPT, 4)
    with pytest.raises(UnknownSessionError):
        ens.generate(cur, "nope", PROMPT, 4)
    for kw, match in (
        ({"decoder": "beam"}, "decoder"),
        ({"temperature": 0}, "temperature"),
        ({"stop": ("",)}, "stop"),
    ):
        with pytest.raises(PacEnsembleError, match=match):
            ens.generate(cur, sid, PROMPT, 4, **kw)
    with pytest.raises(PacEnsembleError, match="max_tokens"):
        ens.generate(cur, sid, PROMPT, 0)
    with pytest.raises(PacEnsembleError, match="context"):
        ens.generate(cur, sid, PROMPT, 10**6)
    caplog.set_level(logging.DEBUG)
    out = ens.generate(cur, sid, SECRET_PROMPT, 6)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET_PROMPT not in logged
    assert len(out.text.strip()) < 8 or out.text not in logged


def _bad(tmp_path, artifacts, **changes):
    root = tmp_path / "bad"
    shutil.copytree(artifacts["distinct"], root, symlinks=True)
    info = json.loads((root / "pac.json").read_text())
    for key, value in changes.items():
        if value is None:
            info.pop(key)
        else:
            info[key] = value
    (root / "pac.json").write_text(json.dumps(info))
    return root


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"worlds": None}, "missing key 'worlds'"),
        ({"format": "other/1"}, "'format'"),
        ({"m": 5}, "m=5"),
        ({"m": 1, "worlds": ["w000"]}, "'m' must be"),
        ({"worlds": ["w000", "w001", "w002", "w009"]}, "w009.*missing adapter"),
        ({"worlds": ["w000", "w001", "w002", "../w003"]}, "invalid world name"),
        ({"worlds": ["w000", "w001", "w001", "w002"]}, "distinct"),
        ({"base_model": None}, "'base_model'"),
        ({"lora": "r8"}, "lora: 'r8' is not"),
    ],
)
def test_a_bad_manifest_is_a_clear_error(tmp_path, artifacts, changes, match):
    root = _bad(tmp_path, artifacts, **changes)
    with pytest.raises(PacEnsembleError, match=match) as info:
        PacEnsemble(root, device="cpu")
    assert isinstance(info.value, PrivcodeError)


def test_missing_artifact_and_base_are_clear_errors(tmp_path, artifacts):
    with pytest.raises(PacEnsembleError, match="no pac.json"):
        PacEnsemble(tmp_path, device="cpu")
    root = _bad(tmp_path, artifacts, base_model=str(tmp_path / "gone"))
    with pytest.raises(PacEnsembleError, match="cannot load the base model.*model override"):
        PacEnsemble(root, device="cpu")
    # The override wins over pac.json's base_model.
    assert read_manifest(root, model=artifacts["base"]).base_model == artifacts["base"]
    shutil.rmtree(root / "adapters" / "w002")
    with pytest.raises(PacEnsembleError, match="w002"):
        PacEnsemble(root, model=artifacts["base"], device="cpu")
