"""The public base model: tokenizer, training, held-out numbers, cache, corpus hygiene.

The ``ci`` preset is trained once per test session (``ci_base_cache`` in
conftest.py); every test here reads that build or copies of it, so this
module costs one ~40 s build plus a few seconds.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import time
import tokenize
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from privcode.artifacts.base import BaseRecord
from privcode.config import BaseConfig
from privcode.data.stdlib import PRIVATE_MODULES, private_source_files
from privcode.models import base as B
from privcode.models import base_training
from privcode.models import corpus as C
from privcode.models.loading import ModelLoadError, load_tokenizer
from privcode.models.presets import PRESETS
from privcode.utils import ThreadTuner

SOURCE = (
    "# -*- coding: utf-8 -*-\n"
    "def grüße(name: str) -> str:\n"
    '\t"""Tab-indented docstring: naïve café, 東京, emoji 🐍."""\n'
    "\tif name:\n"
    "\t\treturn f'Hallo {name}!'  \t# trailing tab\n"
    "\t    \n"
    "\tx = [1,\t2,   3]\r\n"
    "\treturn str(x)\n"
    "\n\n\n"
    "class Ω:\n    pass\n"
)


@pytest.fixture(scope="module")
def ci(ci_base_cache):
    """(config, info) of the session's ``ci`` build (answered from the cache)."""
    cfg = BaseConfig(preset="ci", cache_dir=ci_base_cache)
    return cfg, B.build_base(cfg, progress=False)


@pytest.fixture(scope="module")
def tok(ci):
    return load_tokenizer(ci[1]["path"])


# --------------------------------------------------------------------------- presets


def test_presets_are_gqa_qwen2_shapes():
    assert set(PRESETS) == {"ci", "demo", "small"}
    for name, p in PRESETS.items():
        assert p.hidden_size % p.num_heads == 0, name
        assert p.num_kv_heads < p.num_heads and p.num_heads % p.num_kv_heads == 0, name
        assert p.warmup_steps < p.steps, name
    sizes = [PRESETS[n].hidden_size * PRESETS[n].num_layers for n in ("ci", "demo", "small")]
    assert sizes == sorted(sizes)
    with pytest.raises(ValueError, match="divisible"):
        dataclasses.replace(PRESETS["ci"], num_heads=3)


def test_lr_schedule_warmup_then_cosine():
    p = PRESETS["ci"]
    lrs = [base_training.lr_at(s, p) for s in range(p.steps)]
    assert lrs[0] == pytest.approx(p.lr / p.warmup_steps)
    assert max(lrs) == pytest.approx(p.lr)
    assert lrs[p.warmup_steps - 1] == pytest.approx(p.lr)
    assert lrs[-1] == pytest.approx(p.lr * p.min_lr_ratio)
    after = lrs[p.warmup_steps :]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))


# --------------------------------------------------------------------------- build


def test_build_info_numbers(ci):
    cfg, info = ci
    preset = PRESETS["ci"]
    for key in (
        "path",
        "preset",
        "config_hash",
        "heldout_loss",
        "untrained_heldout_loss",
        "params",
        "train_seconds",
        "tokens_per_second",
        "cached",
        "tokens_seen",
    ):
        assert key in info, key
    assert info["preset"] == "ci" and info["config_hash"] == B.config_hash(cfg)
    assert 0.7e6 < info["params"] < 1.2e6
    vocab = info["vocab_size"]
    assert vocab == preset.vocab_size
    # An untrained model predicts ~uniformly; training must win by a wide margin.
    assert abs(info["untrained_heldout_loss"] - math.log(vocab)) < 0.3
    assert info["heldout_loss"] < info["untrained_heldout_loss"] - 1.0
    assert info["heldout_loss"] < math.log(vocab)
    assert info["heldout_bits_per_byte"] < info["untrained_heldout_bits_per_byte"]
    # Every build trains all its steps, however busy the machine (no wall-clock guard).
    assert info["steps"] == preset.steps and info["stopped_early"] is False
    record = B.check_complete(info)  # the typed base.json of the build
    assert record.path == info["path"] and record.heldout_loss == info["heldout_loss"]
    assert record.steps == record.complete_steps == preset.steps
    assert BaseRecord.from_json(record.to_json()) == record
    assert sum(info["steps_by_threads"].values()) == preset.steps  # ThreadTuner's choices
    assert info["tokens_seen"] == info["steps"] * preset.batch_size * preset.seq_len
    assert info["tokens_per_second"] == pytest.approx(info["tokens_seen"] / info["train_seconds"])
    assert 0 < info["train_units_tokenized"] <= info["train_units"]
    stored = json.loads((Path(info["path"]) / "build_info.json").read_text())
    assert stored["config_hash"] == info["config_hash"]
    assert stored["heldout_loss"] == info["heldout_loss"]


def test_corpus_is_public_only(ci):
    _, info = ci
    modules = set(info["public_modules"])
    assert modules and not modules & set(PRIVATE_MODULES)
    assert {"argparse", "collections", "typing"} <= modules
    files = C.public_corpus()
    assert not {f.module for f in files} & set(PRIVATE_MODULES)
    train, held = C.split_heldout(files, base_training.HELDOUT_FRACTION)
    assert info["heldout_files"] == C.relpaths(held)
    assert not set(C.relpaths(train)) & set(C.relpaths(held))
    assert len(held) == max(1, round(base_training.HELDOUT_FRACTION * len(files)))
    # Deterministic: the split depends on paths only, the order on the seed only.
    assert C.split_heldout(files)[1] == held
    assert C.shuffled(train, 1) == C.shuffled(train, 1) != C.shuffled(train, 2)


def test_auto_classes_load_offline(ci, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    path = Path(ci[1]["path"])
    assert (path / "model.safetensors").is_file() and not (path / "pytorch_model.bin").exists()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, Qwen2ForCausalLM)
    c = model.config
    assert c.model_type == "qwen2" and c.tie_word_embeddings
    assert c.num_key_value_heads < c.num_attention_heads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert c.vocab_size == len(tokenizer)
    assert (c.eos_token_id, c.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    # The saved weights are the trained ones: same held-out loss as reported.
    preset = PRESETS["ci"]
    _, held = C.split_heldout(C.public_corpus(), base_training.HELDOUT_FRACTION)
    stream, _ = C.token_stream(tokenizer, held, max_tokens=preset.eval_tokens)
    again = C.evaluate_loss(model, tokenizer, stream, preset.seq_len, preset.eval_tokens)
    assert again["loss"] == pytest.approx(ci[1]["heldout_loss"], abs=1e-3)
    # AutoTokenizer picks transformers' Qwen2Tokenizer (NFC-normalizing); on NFC
    # text it agrees with the lossless load_tokenizer() id for id.
    text = SOURCE + "".join(f.text for f in held)
    assert tokenizer(text)["input_ids"] == load_tokenizer(path)(text)["input_ids"]
    ids = tokenizer("def main():\n    ", return_tensors="pt")["input_ids"]
    out = model.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape[1] > ids.shape[1]


def test_second_build_is_cached(ci):
    cfg, info = ci
    t0 = time.monotonic()
    again = B.build_base(cfg, progress=False)
    assert time.monotonic() - t0 < 10
    assert again["cached"] is True and again["path"] == info["path"]
    assert again["heldout_loss"] == info["heldout_loss"]
    assert Path(info["path"]).name == f"ci-{info['config_hash']}"


def test_out_dir_reuses_a_complete_build(ci, tmp_path):
    cfg, info = ci
    copy = tmp_path / "copy"
    shutil.copytree(info["path"], copy)
    again = B.build_base(cfg, out_dir=copy, progress=False)
    assert again["cached"] is True and again["path"] == str(copy.resolve())


def test_out_dir_that_is_not_a_build_is_refused(ci, tmp_path):
    cfg, _ = ci
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ModelLoadError, match="refusing to overwrite"):
        B.build_base(cfg, out_dir=tmp_path, progress=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(cfg, preset, files, digest, out, progress, started):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(B, "train_build", boom)
    cfg = BaseConfig(preset="ci", cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="disk full"):
        B.build_base(cfg, progress=False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_config_hash_covers_seed_and_preset_not_cache_dir(tmp_path):
    files = C.public_corpus()
    h = B.config_hash(BaseConfig(preset="ci", seed=0), files)
    assert h == B.config_hash(BaseConfig(preset="ci", seed=0, cache_dir=str(tmp_path)), files)
    assert h != B.config_hash(BaseConfig(preset="ci", seed=1), files)
    assert h != B.config_hash(BaseConfig(preset="demo", seed=0), files)


# --------------------------------------------------------------------------- existing model


def test_existing_model_is_validated_and_scored(ci):
    _, info = ci
    ext = B.build_base(BaseConfig(model=info["path"]), progress=False)
    assert ext["path"] == info["path"] and ext["external"] is True
    assert ext["params"] == info["params"] and ext["untrained_heldout_loss"] is None
    assert ext["heldout_loss"] < math.log(info["vocab_size"])
    assert ext["train_seconds"] == 0.0 and ext["cached"] is False
    record = B.check_complete(ext)  # an external model passes, as a record without a preset
    assert record.external and record.preset is None and record.model_type


def test_existing_model_errors_name_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        B.build_base(BaseConfig(model=str(missing)), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="empty.*no config.json"):
        B.build_base(BaseConfig(model=str(tmp_path / "empty")), progress=False)
    from transformers import T5Config

    T5Config(d_model=8, num_layers=1, num_heads=1, d_kv=8, d_ff=8, vocab_size=32).save_pretrained(
        tmp_path / "t5"
    )
    with pytest.raises(ModelLoadError, match="t5.*not a causal LM"):
        B.build_base(BaseConfig(model=str(tmp_path / "t5")), progress=False)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens(tok):
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|endoftext|>"
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    for special in (
        "<|im_start|>",
        "<|im_end|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|file_sep|>",
    ):
        ids = tok(special)["input_ids"]
        assert len(ids) == 1 and ids[0] < len(tok), special
    assert max(tok.all_special_ids) < len(tok)
    # Encoding adds nothing: the token sequence is exactly the text.
    assert tok("x")["input_ids"] == tok.convert_tokens_to_ids(tok.tokenize("x"))


@pytest.mark.parametrize(
    "text",
    [
        SOURCE,
        "",
        " ",
        "\t",
        "\n",
        "\r\n",
        "\x00\x01\x7f",
        "    " * 10,
        "a\u200bb\ufeff",
        "emoji 👩‍👩‍👧 flags 🇫🇷 math 𝔘𝔫𝔦 combining é",
        "<|endoftext|> inside <|pad|>text",
    ],
)
def test_tokenizer_round_trip(tok, text):
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips_arbitrary_unicode(tok, text):
    assert tok.decode(tok(text)["input_ids"]) == text


def test_tokenizer_round_trips_real_code_incl_unseen_private_files(tok):
    public = [f.text for f in C.public_corpus()[:15]]
    private = [p.read_text(encoding="utf-8") for p in private_source_files()[:15]]
    for text in public + private:
        assert tok.decode(tok(text)["input_ids"]) == text
    # Indentation is compressed: a 4-space-indented line needs far fewer tokens than bytes.
    text = "\n".join(public)
    assert len(text.encode()) / len(tok(text)["input_ids"]) > 2.5


def test_offsets_mapping_tiles_the_text(tok):
    ascii_src = "def f(a, b):\n\tif a:\n        return b  # done\n\n"
    enc = tok(ascii_src, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    assert len(spans) == len(enc["input_ids"])
    assert "".join(ascii_src[a:b] for a, b in spans) == ascii_src
    for (a, b), i in zip(spans, enc["input_ids"], strict=True):
        assert tok.decode([i]) == ascii_src[a:b]
    # Non-ASCII: spans stay ordered, cover every character, and never leave the text.
    enc = tok(SOURCE, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    covered = set()
    for (a, b), (c, _) in zip(spans, spans[1:] + [(len(SOURCE), 0)], strict=True):
        assert 0 <= a < b <= len(SOURCE) and a <= c
        covered.update(range(a, b))
    assert covered == set(range(len(SOURCE)))
    # Python tokenize positions map onto BPE token positions through the offsets.
    line_starts = [0]
    for line in SOURCE.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    names = [
        t for t in tokenize.generate_tokens(io.StringIO(SOURCE).readline) if t.type == tokenize.NAME
    ]
    for t in names:
        start = line_starts[t.start[0] - 1] + t.start[1]
        hits = [k for k, (a, b) in enumerate(spans) if a <= start < b]
        assert hits, t
        assert SOURCE[start : start + len(t.string)] == t.string


def test_token_stream_and_batches_are_deterministic(tok):
    files = C.public_corpus()[:5]
    stream, used = C.token_stream(tok, files, max_tokens=1000)
    assert stream.numel() == 1000 and used >= 1
    full, used_all = C.token_stream(tok, files)
    assert used_all == 5 and int((full == tok.eos_token_id).sum()) == 5
    assert torch.equal(full[:1000], stream)
    b1 = [next(C.batches(stream, 100, 3, seed=7)) for _ in range(1)][0]
    b2 = next(C.batches(stream, 100, 3, seed=7))
    assert b1.shape == (3, 100) and torch.equal(b1, b2)
    gen = C.batches(stream, 100, 3, seed=7)
    seen = torch.cat([next(gen) for _ in range(3)])  # 9 of 10 windows, none twice
    assert len({tuple(r.tolist()) for r in seen}) == 9


def test_an_incomplete_or_stale_build_is_refused_by_its_consumers(ci):
    _, info = ci
    short = {**info, "steps": info["steps"] - 1, "stopped_early": True}
    with pytest.raises(ModelLoadError, match="incomplete or stale.*delete it and rebuild"):
        B.check_complete(short)
    with pytest.raises(ModelLoadError, match="build version 1"):
        B.check_complete({**info, "version": 1})
    from privcode.artifacts import StageManifest
    from privcode.pipeline.stages import STAGES, base_path

    assert not STAGES["base"]().still_valid(short)  # the base stage rebuilds it
    with pytest.raises(ModelLoadError):
        base_path({"base": StageManifest("base", "fp", short)})
    assert base_path({"base": StageManifest("base", "fp", info)}) == info["path"]
    renamed = {k: v for k, v in info.items() if k != "heldout_loss"}
    with pytest.raises(ModelLoadError, match="missing key 'heldout_loss'"):
        B.check_complete(renamed)
    assert not STAGES["base"]().still_valid(renamed)


def test_function_units_are_whole_functions_without_literal_tables():
    text = (
        "import os\n\n"
        'def add(a, b):\n    """Add."""\n    return a + b\n\n'
        "class K:\n    def m(self, x):\n        y = x * 2\n        return os.path.join(y)\n\n"
        "TABLE = [1, 2]\n"
        "def table():\n    return [0x1, 0x2, 0x3, 0x4, 'a', 'b', 'c', 'd', 'e', 'f']\n\n"
        "def one(): return 1\n"
    )
    units = C.function_units([C.SourceFile("m.py", "m", text)])
    assert [u.text for u in units] == [
        'def add(a, b):\n    """Add."""\n    return a + b\n',
        "def m(self, x):\n    y = x * 2\n    return os.path.join(y)\n",
    ]
    assert [u.relpath for u in units] == ["m.py::3", "m.py::8"]
    for u in units:
        compile(u.text, u.relpath, "exec")


def _tune(threads: int, seconds_at, steps: int = 256) -> tuple[ThreadTuner, list]:
    """Drive a tuner with step times ``seconds_at[threads]`` (or ``seconds_at(step, threads)``)."""
    applied = []
    tuner = ThreadTuner(threads, probe_every=32, probe_steps=4, set_threads=applied.append)
    timing = seconds_at if callable(seconds_at) else (lambda step, n: seconds_at[n])
    for step in range(steps):
        n = tuner.threads_for(step)
        tuner.observe(step, timing(step, n))
    return tuner, applied


def test_thread_tuner_moves_to_one_thread_when_it_is_faster_and_stays_when_not():
    # Idle (step times measured for the demo base: 0.29 s on 2 threads, 0.57 on 1): steps
    # 0-3 on one thread, the probe at 4-7 switches; later probes of one thread end after
    # one step (over 1.5x slower) and back off: 8 + 32, then waits of 64 and 128 steps.
    idle, applied = _tune(2, {2: 0.29, 1: 0.57})
    assert idle.current == 2 and idle.probes == 4
    assert idle.steps == {1: 4 + 3, 2: 256 - 7}
    assert applied[:2] == [1, 2] and set(applied) == {1, 2}
    # Beside a busy process (4.8 s vs 0.55 s, measured): every probe of two threads costs
    # one step, at steps 4, 69 and 198.
    busy, _ = _tune(2, {2: 4.8, 1: 0.55})
    assert busy.current == 1 and busy.steps == {1: 253, 2: 3} and busy.probes == 3
    within_noise, _ = _tune(2, {2: 0.47, 1: 0.51})  # under 10% faster: one thread stays
    assert within_noise.current == 1 and within_noise.steps[2] == 3 * 4
    # Two threads 5% faster than one (a busy machine, measured within 10-25% either side):
    # the first probe of one thread (steps 40-43) moves back to it; later probes of two
    # threads (76-79, 144-147) run their 4 steps and lose.
    mildly, _ = _tune(2, lambda step, n: {2: 0.29 if step < 36 else 0.52, 1: 0.55}[n])
    assert mildly.current == 1 and mildly.steps[2] == 4 + 32 + 4 + 4
    # The machine turns busy at step 100: the probe at step 105 moves back to one thread
    # (two threads ran 4-7, 8-39, 41-104, then one step each in the probes at 141 and 206).
    turns, _ = _tune(2, lambda step, n: (4.8 if step >= 100 else 0.29) if n == 2 else 0.55)
    assert turns.current == 1 and turns.steps[2] == 4 + 32 + 64 + 2
    single, applied = _tune(1, {1: 0.5})  # one core: nothing to probe
    assert single.options == [1] and applied == [1] and single.steps == {1: 256}
    with pytest.raises(ValueError):
        ThreadTuner(2, probe_every=4, probe_steps=4)
