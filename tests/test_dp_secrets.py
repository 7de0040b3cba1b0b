"""What a DP-SGD step keeps secret beyond the noise: randomness, non-finite records, names.

Issue 13's side channels, each pinned by a behaviour: the released history
holds DP events only; per-record latent noise and dropout masks come from the
run's secret and not from a public seed or a record's position; a poisoned
record cannot turn the noisy sum into NaN; secure mode draws from os.urandom;
datasets are named by a keyed HMAC, never a digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import init_store
from test_methods import Rec

from privcode.artifacts.privacy import released_history
from privcode.config import BaseConfig, TrainConfig
from privcode.dp.accounting import DPEvent, epsilon
from privcode.dp.dpsgd import PerSampleClipper, gaussian_noise
from privcode.dp.randomness import SecretRandomness, record_key, record_seeds, secure_poisson_mask
from privcode.models.encoding import CODE, PROMPT, Encoded, collate, encode_records
from privcode.privacy.store import ENV_VAR, PrivacyStore, StoreError, resolve_store
from privcode.train.build import build_objective
from privcode.train.methods import get_method

# --------------------------------------------------------------------------- 1. history


@pytest.mark.heavy  # the RDP accountant over 31 grants: 4 s
def test_released_history_holds_exactly_the_dp_events():
    """Grants carry times, sequence numbers and request ids; the release carries none."""
    grants = [
        {
            "type": "event",
            "seq": i + 1,
            "noise_multiplier": 1.1,
            "sample_rate": 0.02,
            "steps": 1,
            "epsilon": 0.1 * i,
            "time": 1.7e9 + 0.66 * i,
            "request_id": f"abc:{i}",
            "crc": "00",
        }
        for i in range(30)
    ]
    grants += [{"seq": 31, "noise_multiplier": 0.9, "sample_rate": 0.02, "steps": 5, "time": 1.8e9}]
    released = released_history(grants)
    assert [e.to_dict() for e in released] == [
        {"noise_multiplier": 1.1, "sample_rate": 0.02, "steps": 30},
        {"noise_multiplier": 0.9, "sample_rate": 0.02, "steps": 5},
    ]
    # Merging composes to the same epsilon.
    per_grant = [DPEvent(g["noise_multiplier"], g["sample_rate"], g["steps"]) for g in grants]
    assert epsilon(list(released), 1e-5) == pytest.approx(epsilon(per_grant, 1e-5), rel=1e-9)


# --------------------------------------------------------------------------- 3. latent noise


RECORDS = [
    Rec("Add two numbers.", "def add(a, b):\n    return a + b\n"),
    Rec("Largest item or None.", "def biggest(xs):\n    return max(xs) if xs else None\n"),
]
INSERTED = [
    Rec("Something else, before the others.", "class Box:\n    v = [1] * 3\n"),
    Rec("And one more.", "def one():\n    return 1\n"),
]
CFG = TrainConfig(
    method="privcode++",
    latent_dim=16,
    num_virtual_tokens=4,
    encoder_hidden=32,
    align_bank_size=8,
    max_length=64,
)


@pytest.fixture(scope="module")
def base_path(ci_base_cache) -> str:
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


def _dp_batch(encoded: list[Encoded], pad: int, secret: bytes, step: int = 3) -> dict:
    """A batch as the DP loop builds it: content keys and the step's secret."""
    keys = torch.tensor([record_key(e.input_ids, e.segments) for e in encoded])
    return collate(encoded, pad, step=step, record_keys=keys, record_secret=secret)


def test_latent_noise_of_a_record_ignores_the_records_before_it(base_path):
    """privcode++'s eps of record b: the same with or without records inserted before it."""
    objective, tok, _ = build_objective(
        get_method("privcode++"), CFG, base_path, "cpu", will_restore=False
    )
    objective.train()
    pad = tok.pad_token_id
    secret = SecretRandomness(seed=12345).record_secret(3)
    alone = encode_records(RECORDS, tok, 64)
    shifted = encode_records(INSERTED + RECORDS, tok, 64)
    with torch.no_grad():
        torch.manual_seed(0)
        la = objective(_dp_batch(alone, pad, secret))
        torch.manual_seed(1)  # the global RNG plays no part
        lb = objective(_dp_batch(shifted, pad, secret))
        # A different secret gives other noise: the loss is random, keyed by the secret.
        other = objective(_dp_batch(alone, pad, SecretRandomness(seed=99).record_secret(3)))
    assert torch.allclose(la, lb[len(INSERTED) :], atol=1e-5), (la, lb)
    assert not torch.allclose(la, other, atol=1e-4)


def test_record_seeds_depend_on_the_record_and_the_secret_only():
    keys = [record_key([5, 6, 7], [PROMPT, CODE, CODE]), record_key([8, 9], [CODE, CODE])]
    s = os.urandom(32)
    assert record_seeds(s, keys)[1] == record_seeds(s, [123, *keys])[2]
    assert record_seeds(s, keys) != record_seeds(os.urandom(32), keys)
    assert record_key([5, 6, 7], [PROMPT, CODE, CODE]) != record_key([5, 6, 7], [CODE] * 3)


# --------------------------------------------------------------------------- 4. dropout


def test_dropout_masks_come_from_the_secret_not_the_public_seed(base_path):
    """With lora_dropout > 0 the DP step's masks are a function of the secret seed."""
    cfg = dataclasses.replace(CFG, method="dpft", lora_dropout=0.5, seed=7)
    objective, tok, _ = build_objective(
        get_method("dpft"), cfg, base_path, "cpu", will_restore=False
    )
    with torch.no_grad():
        for n, p in objective.lm.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    clipper = PerSampleClipper(objective, max_grad_norm=1e6)
    batch = collate(encode_records(RECORDS, tok, 64), tok.pad_token_id, step=0)

    def step_sum(seed_rng) -> torch.Tensor:
        seed_rng()
        return clipper.clipped_sum(lambda m, b: m(b), batch, len(RECORDS))

    a1 = step_sum(lambda: SecretRandomness(seed=111).seed_step(0))
    a2 = step_sum(lambda: SecretRandomness(seed=111).seed_step(0))
    b = step_sum(lambda: SecretRandomness(seed=222).seed_step(0))
    public = step_sum(lambda: torch.manual_seed(cfg.seed))
    assert torch.equal(a1, a2)  # the masks are drawn from the secret stream ...
    assert not torch.allclose(a1, b)  # ... which the secret changes ...
    assert not torch.allclose(a1, public)  # ... and the public seed does not reproduce.
    assert not torch.allclose(step_sum(lambda: SecretRandomness(seed=111).seed_step(1)), a1)
    # Secure mode: fresh urandom masks at every step.
    s = SecretRandomness(seed=111, secure=True)
    assert not torch.allclose(step_sum(lambda: s.seed_step(0)), step_sum(lambda: s.seed_step(0)))


# --------------------------------------------------------------------------- 9. secure mode


def test_secure_poisson_mask_is_bernoulli_q():
    n, q = 200_000, 0.03
    mask = secure_poisson_mask(n, q)
    assert mask.dtype == bool and mask.shape == (n,)
    sd = math.sqrt(n * q * (1 - q))
    assert abs(int(mask.sum()) - n * q) < 5 * sd
    assert not np.array_equal(mask, secure_poisson_mask(n, q))  # fresh draws
    assert secure_poisson_mask(10, 1.0).all()


def test_secure_noise_has_the_configured_std_and_a_fresh_generator_per_step():
    std = 2.5
    x = gaussian_noise(
        (400_000,),
        std,
        generator=torch.Generator().manual_seed(0),
        dtype=torch.float64,
        device="cpu",
        secure=True,
    )
    assert float(x.mean()) == pytest.approx(0.0, abs=5 * std / math.sqrt(x.numel()))
    assert float(x.std()) == pytest.approx(std, rel=0.01)
    secure, standard = SecretRandomness(seed=5, secure=True), SecretRandomness(seed=5)
    with pytest.raises(ValueError, match="noise_source"):
        secure.noise_generator("cpu")  # no torch generator in secure mode
    a, b = secure.noise_source("cpu", 3), secure.noise_source("cpu", 3)  # a fresh key per call
    kw = {"dtype": torch.float64, "device": "cpu"}
    assert not torch.equal(a.normal((4,), 1.0, **kw), b.normal((4,), 1.0, **kw))
    assert standard.noise_generator("cpu") is standard.noise_generator("cpu")
    assert secure.mode == "secure" and standard.mode == "standard"


# --------------------------------------------------------------------------- 2. dataset ids


def test_dataset_id_is_a_keyed_hmac_in_a_private_store(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"id": "1", "prompt": "p", "code": "c"}\n')
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    store = PrivacyStore(init_store(tmp_path / "store"))
    ds = store.dataset_id(data)
    assert ds.startswith("ds-") and ds == PrivacyStore(tmp_path / "store").dataset_id(data)
    assert digest[:8] not in ds
    assert stat.S_IMODE(os.stat(tmp_path / "store").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.key_path).st_mode) == 0o600
    # Another store (another key): another id. Without the key the id says nothing.
    assert PrivacyStore(init_store(tmp_path / "other")).dataset_id(data) != ds
    # A damaged key fails closed with a message naming the file.
    store.key_path.write_bytes(b"short")
    with pytest.raises(Exception, match="damaged"):
        PrivacyStore(tmp_path / "store").dataset_id(data)


def test_store_key_is_never_created_by_opening(tmp_path):
    """Only `privcode budget init` makes a key; every process opening the store reads it."""
    with pytest.raises(StoreError, match="privcode budget init"):
        PrivacyStore(tmp_path / "s")
    assert not (tmp_path / "s").exists()
    init_store(tmp_path / "s")
    code = (
        "import sys; from privcode.privacy.store import PrivacyStore\n"
        "print(PrivacyStore(sys.argv[1]).opaque('t', 'x'))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "s")], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(outs) == 1 and all(p.returncode == 0 for p in procs)


def test_store_location_env_then_config_then_the_user_default(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    default = (tmp_path / "xdg" / "privcode" / "privacy-store").resolve()
    assert resolve_store("", tmp_path / "runs") == default  # never beside run.out_dir
    assert resolve_store(tmp_path / "s", tmp_path / "runs") == (tmp_path / "s").resolve()
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_store("", tmp_path / "runs") == (tmp_path / "env").resolve()
    with pytest.raises(StoreError, match="two privacy stores"):  # env and config disagree
        resolve_store(tmp_path / "s", tmp_path / "runs")
