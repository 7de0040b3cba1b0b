"""The public base model: a small Qwen2 trained from scratch on public stdlib code.

:func:`build_base` trains a byte-level BPE tokenizer and a Qwen2-architecture
causal LM (grouped-query attention, tied embeddings, RoPE) on the public half
of the standard library only (:mod:`privcode.models.corpus`), evaluates it on
a held-out slice of public files before and after training, and saves both
with ``save_pretrained`` (safetensors), so that ``AutoTokenizer`` and
``AutoModelForCausalLM`` load the directory offline like any HF checkpoint.

The model trains on the public files' functions and methods, each a unit of
its own (:func:`privcode.models.corpus.function_units`), then (``tune_steps``) on
public helper-pattern functions written from an instruction
(:mod:`privcode.data.helpers`: the idioms of small service code, in a public
dialect), and is evaluated on held-out whole files.

Sizes come from :data:`PRESETS`. Each preset trains its *fixed* number of
steps whatever the machine's speed (a busy machine takes longer; it never
gets a weaker model), sized for a 2-core CPU: ``ci`` well under a minute,
``demo`` about 3 minutes, ``small`` about half an hour. ``build_info.json``
records the steps done, and :func:`check_complete` (called by every stage
that consumes a base) refuses a build that did not train all of them.

Builds are cached under ``<cache_dir>/<preset>-<hash>/`` where the hash
covers everything that changes the weights: the preset entry, the seed,
:data:`BUILD_VERSION` (the training recipe), the torch and transformers
versions, and a fingerprint of the corpus files. A build is written into a temporary sibling directory
and renamed into place only when complete; ``build_info.json`` is written
last, and a directory counts as a build only if it holds that file with the
expected hash. A lock file next to the target serializes concurrent builders
(for example two Ray workers) so that only one trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.base import BaseRecord
from privcode.artifacts.record import ArtifactError
from privcode.checks import check_number
from privcode.config import BaseConfig
from privcode.models import corpus as C
from privcode.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from privcode.models.tokenizer import SPECIAL_TOKENS, train_tokenizer
from privcode.utils import ThreadTuner, atomic_write_json, replace_dir, stable_hash
from privcode.utils import torch_threads as _torch_threads

__all__ = [
    "BUILD_VERSION",
    "PRESETS",
    "Preset",
    "build_base",
    "check_complete",
    "config_hash",
    "BUILD_INFO",
]

#: Bump whenever tokenizer/model training changes in a way that changes results:
#: it is part of the cache key, so old cached builds are not reused.
#: 2: trained on function units; no wall-clock guard (every build trains all its steps).
#: 3: public helper tuning after pretraining (``Preset.tune_steps``).
BUILD_VERSION = 3

#: Name of the metadata file; its presence (with a matching hash) marks a complete build.
BUILD_INFO = "build_info.json"

#: Fraction of public files held out for evaluation (chosen by path hash).
HELDOUT_FRACTION = 0.03

#: Held-out tokens scored before training: an untrained model's loss is about
#: log(vocab) everywhere, so a few windows give it (the trained one gets ``eval_tokens``).
UNTRAINED_EVAL_TOKENS = 4096

#: Held-out evaluation of an existing model (``base.model``): a few sequences,
#: enough for a sanity number, cheap even for a 7B model on a CPU.
EXTERNAL_EVAL_SEQ_LEN = 256
EXTERNAL_EVAL_TOKENS = 4 * EXTERNAL_EVAL_SEQ_LEN


@dataclass(frozen=True)
class Preset:
    """Size and schedule of one self-trained base model.

    ``hidden_size`` must be divisible by ``num_heads``, and ``num_heads`` by
    ``num_kv_heads`` (grouped-query attention as in real Qwen2).
    ``tokenizer_train_bytes`` caps the text the tokenizer is trained on
    (``None``: all training files). ``eval_tokens`` caps the held-out tokens.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_tokens: int
    tokenizer_train_bytes: int | None = None
    #: Steps of public helper tuning after pretraining (:func:`_tune_helpers`); 0 = none.
    tune_steps: int = 0
    tune_batch_size: int = 16
    tune_lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "seq_len",
            "batch_size",
            "steps",
            "max_position_embeddings",
        ):
            check_number(name, getattr(self, name), min=1, integer=True)
        for name in ("warmup_steps", "eval_tokens", "tune_steps", "tune_batch_size"):
            check_number(name, getattr(self, name), min=0, integer=True)
        if self.tokenizer_train_bytes is not None:
            check_number("tokenizer_train_bytes", self.tokenizer_train_bytes, min=1, integer=True)
        for name in ("lr", "grad_clip", "rope_theta"):
            check_number(name, getattr(self, name), min=0, min_exclusive=True)
        check_number("min_lr_ratio", self.min_lr_ratio, min=0, max=1)
        check_number("weight_decay", self.weight_decay, min=0)
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


#: Preset name -> size and schedule. Step counts were sized from throughput
#: measured on an idle 2-core CPU (ci ~10.5k tokens/s, demo ~3.9k, small ~1k);
#: small batches of many steps learn more per second than large batches here.
PRESETS: dict[str, Preset] = {
    # ~0.9M parameters, 560 x 512 = 287k tokens: ~27 s of training, ~40 s in all.
    "ci": Preset(
        vocab_size=4096,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        seq_len=128,
        batch_size=4,
        steps=560,
        lr=2e-3,
        warmup_steps=20,
        eval_tokens=16_384,
        tokenizer_train_bytes=2_000_000,
        tune_steps=0,  # none: 40 steps left the tests' DP junior unable to beat it (5.42 vs 5.40 nats)
    ),
    # ~3.9M parameters, 520 x 1024 = 532k tokens: ~2.3 minutes of training, ~2.6 in all.
    "demo": Preset(
        vocab_size=6144,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=768,
        seq_len=256,
        batch_size=4,
        steps=520,
        lr=2e-3,
        warmup_steps=30,
        eval_tokens=32_768,
        tune_steps=300,
    ),
    # ~19M parameters, 800 x 2048 = 1.6M tokens (about one pass over the corpus): ~27 minutes.
    "small": Preset(
        vocab_size=16384,
        hidden_size=384,
        num_layers=8,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=1024,
        seq_len=512,
        batch_size=4,
        steps=800,
        lr=1e-3,
        warmup_steps=40,
        eval_tokens=65_536,
        tune_steps=300,
    ),
}


# --------------------------------------------------------------------------- hashing / cache


def config_hash(cfg: BaseConfig, files: list[C.SourceFile] | None = None) -> str:
    """Cache key of a build: preset entry, seed, build version, library versions, corpus.

    ``cache_dir`` is not part of it (moving the cache keeps it valid).
    ``files`` defaults to the public corpus (read from disk).
    """
    if cfg.model:
        return stable_hash(
            {"version": BUILD_VERSION, "model": str(Path(cfg.model).expanduser().resolve())}
        )
    import transformers

    preset = _preset(cfg.preset)
    files = C.public_corpus() if files is None else files
    return stable_hash(
        {
            "version": BUILD_VERSION,
            "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
            "preset": cfg.preset,
            "spec": dataclasses.asdict(preset),
            "seed": cfg.seed,
            "heldout_fraction": HELDOUT_FRACTION,
            "corpus": C.corpus_fingerprint(files),
        }
    )


def check_complete(info: BaseRecord | Mapping[str, Any]) -> BaseRecord:
    """The record of ``info`` (a base stage's summary, or a build's info) if it trained all its steps.

    Raises :class:`~privcode.models.loading.ModelLoadError` naming the build
    otherwise (a build from before :data:`BUILD_VERSION` 2 could stop early on
    a busy machine, a summary of another shape is not a build): such a model
    is too weak for the later stages to mean anything. External models
    (``base.model``) pass.
    """
    where = f"the base model at {info.get('path', '?')}" if isinstance(info, Mapping) else ""
    try:
        record = info if isinstance(info, BaseRecord) else BaseRecord.of_build(info, where)
    except ArtifactError as exc:
        raise ModelLoadError(f"{exc}: rebuild the base stage (--set run.force=true)") from None
    if record.external:
        return record
    wanted = record.complete_steps
    if record.stopped_early or record.steps != wanted or record.version != BUILD_VERSION:
        raise ModelLoadError(
            f"the base model at {record.path} is incomplete or stale (trained "
            f"{record.steps} of {wanted} steps, build version {record.version} vs "
            f"{BUILD_VERSION}): delete it and rebuild (the base stage does so with "
            "--set run.force=true)"
        )
    return record


def _preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelLoadError(
            f"base.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})"
        ) from None


def _read_build(directory: Path, expected_hash: str) -> dict | None:
    """The stored info of a complete build with ``expected_hash`` in ``directory``, else None."""
    import json

    info_path = directory / BUILD_INFO
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("config_hash") != expected_hash:
        return None
    required = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not all((directory / name).is_file() for name in required):
        return None
    return info


def _check_replaceable(directory: Path) -> None:
    """Refuse to replace anything but an empty directory or an earlier base build."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ModelLoadError(f"base output {directory} exists and is not a directory")
    if any(directory.iterdir()) and not (directory / BUILD_INFO).is_file():
        raise ModelLoadError(
            f"refusing to overwrite {directory}: it is not empty and holds no "
            f"{BUILD_INFO} (not a privcode base build)"
        )


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    """Exclusive lock on a hidden sibling file: one builder per target directory."""
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` build to ``final``, replacing an older build there.

    The old build is first moved aside, so ``final`` is never a half-written
    mix; a reader racing the swap may briefly find no build and rebuild/wait.
    """
    replace_dir(tmp, final)


def _make_readable(directory: Path) -> None:
    """World-readable like a normal checkout: mkdtemp (and some writers) create
    owner-only entries, which would hide a shared cache from other users/pods."""
    os.chmod(directory, 0o755)
    for entry in directory.iterdir():
        if entry.is_file():
            os.chmod(entry, 0o644)


@contextlib.contextmanager
def torch_threads() -> Iterator[int]:
    """Use every core this process may run on for the build; restore the setting after."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    with _torch_threads(cores) as n:
        yield n


@contextlib.contextmanager
def _hf_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (weight writing) when ``progress`` is off."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- public API


def build_base(cfg: BaseConfig, out_dir: Path | None = None, progress: bool = True) -> dict:
    """Build (or reuse) the public base model described by ``cfg``; return its info.

    * ``cfg.model`` set: nothing is trained; the local HF causal LM at that
      path is validated and scored on a small held-out public sample.
    * otherwise the ``cfg.preset`` model is trained (see module docstring)
      into ``out_dir``, or into ``<cfg.cache_dir>/<preset>-<hash>/`` when
      ``out_dir`` is None. A complete build with the same hash already there
      is returned as is, with ``cached: True``.

    The returned dict holds at least ``path``, ``preset``, ``config_hash``,
    ``heldout_loss``, ``untrained_heldout_loss``, ``params``,
    ``train_seconds``, ``tokens_per_second`` and ``cached``; it is the content
    of ``build_info.json`` plus ``path`` and ``cached``.
    Raises :class:`~privcode.models.loading.ModelLoadError` (a
    :class:`~privcode.errors.PrivcodeError`) on a bad model path or output dir.
    """
    if cfg.model:
        return _external_base(cfg)
    started = time.monotonic()
    preset = _preset(cfg.preset)
    files = C.public_corpus()
    digest = config_hash(cfg, files)
    final = Path(out_dir) if out_dir is not None else Path(cfg.cache_dir) / f"{cfg.preset}-{digest}"
    final = final.expanduser().resolve()

    info = _read_build(final, digest)
    if info is None:
        _check_replaceable(final)
        with _build_lock(final):
            # Another process may have finished the same build while we waited.
            info = _read_build(final, digest)
            if info is None:
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
                try:
                    info = _train(cfg, preset, files, digest, tmp, progress, started)
                    _make_readable(tmp)
                    _swap_into_place(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                return {**info, "path": str(final), "cached": False}
    return {**info, "path": str(final), "cached": True}


# --------------------------------------------------------------------------- training


def _model_config(preset: Preset, tokenizer) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def _optimizer(model: torch.nn.Module, preset: Preset) -> torch.optim.Optimizer:
    # No weight decay on biases and norm gains (1-D tensors): decaying them
    # only hurts, the usual transformer recipe.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": preset.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=preset.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lr_at(step: int, preset: Preset) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    span = max(1, preset.steps - preset.warmup_steps - 1)
    progress = min(1.0, (step - preset.warmup_steps) / span)
    floor = preset.min_lr_ratio
    return preset.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _tokenizer_texts(files: list[C.SourceFile], limit: int | None) -> list[str]:
    """Whole files, in order, until ``limit`` UTF-8 bytes are reached (None: all)."""
    if limit is None:
        return [f.text for f in files]
    texts, total = [], 0
    for f in files:
        if total >= limit:
            break
        texts.append(f.text)
        total += len(f.text.encode("utf-8"))
    return texts


def _train(
    cfg: BaseConfig,
    preset: Preset,
    files: list[C.SourceFile],
    digest: str,
    out: Path,
    progress: bool,
    started: float,
) -> dict:
    """Train tokenizer + model into the empty directory ``out``; return the build info."""
    import transformers
    from tqdm.auto import tqdm
    from transformers import Qwen2ForCausalLM

    train_files, heldout_files = C.split_heldout(files, HELDOUT_FRACTION)
    order = C.shuffled(C.function_units(train_files), cfg.seed)

    with torch_threads() as threads:
        t0 = time.monotonic()
        tok_texts = _tokenizer_texts(order, preset.tokenizer_train_bytes)
        tokenizer = train_tokenizer(
            tok_texts, preset.vocab_size, model_max_length=preset.max_position_embeddings
        )
        tokenizer_seconds = time.monotonic() - t0

        needed = preset.steps * preset.tokens_per_step
        stream, files_tokenized = C.token_stream(tokenizer, order, max_tokens=needed)
        heldout_stream, _ = C.token_stream(tokenizer, heldout_files, max_tokens=preset.eval_tokens)

        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(_model_config(preset, tokenizer))
        n_params = sum(p.numel() for p in model.parameters())
        before = C.evaluate_loss(
            model,
            tokenizer,
            heldout_stream,
            preset.seq_len,
            min(preset.eval_tokens, UNTRAINED_EVAL_TOKENS),
        )

        optimizer = _optimizer(model, preset)
        batches = C.batches(stream, preset.seq_len, preset.batch_size, cfg.seed)
        model.train()
        steps_done, last_loss = 0, float("nan")
        history: list[tuple[int, float]] = []  # (step, train loss), ~100 points for the report
        every = max(1, preset.steps // 100)
        # Off a terminal (Ray worker logs, CI) redraws become log lines: fewer of them.
        bar = tqdm(
            total=preset.steps,
            desc=f"base {cfg.preset}",
            unit="step",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 15.0,
        )
        t_train = time.monotonic()
        tuner = ThreadTuner(threads)  # 1 thread when the machine is busy: faster there
        try:
            for step in range(preset.steps):
                tuner.threads_for(step)
                t_step = time.perf_counter()
                lr = lr_at(step, preset)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = next(batches)
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps_done = step + 1
                last_loss = loss.detach().item()
                tuner.observe(step, time.perf_counter() - t_step)
                if step % every == 0 or steps_done == preset.steps:
                    history.append((steps_done, round(last_loss, 4)))
                elapsed = time.monotonic() - t_train
                bar.update(1)
                bar.set_postfix(
                    loss=f"{last_loss:.3f}",
                    tok_s=f"{steps_done * preset.tokens_per_step / elapsed:.0f}",
                    refresh=False,
                )
        finally:
            bar.close()
            torch.set_num_threads(threads)
        train_seconds = time.monotonic() - t_train
        tokens_seen = steps_done * preset.tokens_per_step
        tuned = _tune_helpers(model, tokenizer, preset, cfg.seed, progress, batches)
        after = C.evaluate_loss(
            model, tokenizer, heldout_stream, preset.seq_len, preset.eval_tokens
        )

        model.eval()
        with _hf_progress(progress):
            model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    info = {
        "version": BUILD_VERSION,
        "preset": cfg.preset,
        "preset_spec": dataclasses.asdict(preset),
        "seed": cfg.seed,
        "config_hash": digest,
        "external": False,
        "heldout_loss": after["loss"],
        "untrained_heldout_loss": before["loss"],
        "heldout_bits_per_byte": after["bits_per_byte"],
        "untrained_heldout_bits_per_byte": before["bits_per_byte"],
        "heldout_tokens": after["tokens"],
        "final_train_loss": last_loss,
        "helper_tuning": tuned,
        "loss_history": history,
        "params": n_params,
        "vocab_size": len(tokenizer),
        "seq_len": preset.seq_len,
        "steps": steps_done,
        "stopped_early": steps_done < preset.steps,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / max(1, stream.numel()),
        "train_seconds": train_seconds,
        "tokens_per_second": tokens_seen / train_seconds if train_seconds > 0 else None,
        "tokenizer_seconds": tokenizer_seconds,
        "build_seconds": time.monotonic() - started,
        "num_threads": threads,
        "steps_by_threads": {str(n): k for n, k in tuner.steps.items()},
        "public_modules": C.modules(files),
        "train_files": len(train_files),
        "train_units": len(order),
        "train_units_tokenized": files_tokenized,
        "heldout_files": C.relpaths(heldout_files),
        "tokenizer": {
            "vocab_size": len(tokenizer),
            "trained_on_files": len(tok_texts),
            "special_tokens": list(SPECIAL_TOKENS),
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "model_max_length": tokenizer.model_max_length,
        },
        "model_config": model.config.to_diff_dict(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    # Written last: its presence marks the directory as a complete build.
    atomic_write_json(out / BUILD_INFO, info)
    return info


def _tune_helpers(
    model: Any, tokenizer: Any, preset: Preset, seed: int, progress: bool, replay: Iterator[Any]
) -> dict:
    """Tune on PUBLIC helper-pattern functions (:mod:`privcode.data.helpers`); what was done.

    ``preset.tune_steps`` AdamW steps of ``tune_batch_size`` (instruction, code) rows,
    cross-entropy on the code tokens only (as Stage I's loss), plus the loss of one
    pretraining batch from ``replay`` (without it the held-out loss on public code went
    from 5.32 to 8.97 nats: the model forgot Python), learning rate warmed up over
    the first 10% of the steps. A pretrained code LLM knows these idioms; the tiny base
    learns them here in a few minutes, so that the private records have to teach only the
    company's own library (measured: docs/utility.md).
    """
    from privcode.data.helpers import helper_pairs

    if preset.tune_steps == 0:
        return {"steps": 0}
    pairs = helper_pairs(4000, seed)
    eos = tokenizer.eos_token_id
    rows = []
    for instruction, code in pairs:
        head = tokenizer(instruction + "\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(code, add_special_tokens=False)["input_ids"] + [eos]
        rows.append((head + body, len(head)))
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.tune_lr, weight_decay=0.0)
    warmup = max(1, preset.tune_steps // 10)
    model.train()
    losses = []
    for step in range(preset.tune_steps):
        for group in optimizer.param_groups:
            group["lr"] = preset.tune_lr * min(1.0, (step + 1) / warmup)
        pick = torch.randint(len(rows), (preset.tune_batch_size,), generator=gen).tolist()
        width = max(len(rows[i][0]) for i in pick)
        ids = torch.full((len(pick), width), eos, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(pick):
            tokens, start = rows[i]
            ids[r, : len(tokens)] = torch.tensor(tokens)
            labels[r, start : len(tokens)] = ids[r, start : len(tokens)]
            mask[r, : len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        window = next(replay)
        (loss + model(input_ids=window, labels=window).loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
        if progress and (step % 50 == 0 or step + 1 == preset.tune_steps):
            print(
                f"base helper tuning: step {step + 1}/{preset.tune_steps} loss {losses[-1]:.3f}",
                file=sys.stderr,
                flush=True,
            )
    return {
        "steps": preset.tune_steps,
        "records": len(rows),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }


# --------------------------------------------------------------------------- existing model


def _external_base(cfg: BaseConfig) -> dict:
    """Validate the local HF causal LM ``cfg.model`` and score it on held-out public code."""
    path = Path(cfg.model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"base.model: {cfg.model!r} does not exist (only local model "
            "directories are supported; nothing is downloaded)"
        )
    started = time.monotonic()
    with torch_threads() as threads:
        model = load_causal_lm(path, dtype="auto")
        tokenizer = load_tokenizer(path)
        _, heldout_files = C.split_heldout(C.public_corpus(), HELDOUT_FRACTION)
        stream, _ = C.token_stream(tokenizer, heldout_files, max_tokens=EXTERNAL_EVAL_TOKENS)
        scores = C.evaluate_loss(
            model, tokenizer, stream, EXTERNAL_EVAL_SEQ_LEN, EXTERNAL_EVAL_TOKENS, batch_size=2
        )
    return {
        "version": BUILD_VERSION,
        "path": str(path.resolve()),
        "preset": None,
        "seed": cfg.seed,
        "config_hash": config_hash(cfg),
        "external": True,
        "model_type": model.config.model_type,
        "heldout_loss": scores["loss"],
        "untrained_heldout_loss": None,
        "heldout_bits_per_byte": scores["bits_per_byte"],
        "untrained_heldout_bits_per_byte": None,
        "heldout_tokens": scores["tokens"],
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "tokens_seen": 0,
        "train_seconds": 0.0,
        "tokens_per_second": None,
        "build_seconds": time.monotonic() - started,
        "num_threads": threads,
        "cached": False,
    }
