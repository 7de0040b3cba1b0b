"""Training one base build, for :func:`privcode.models.base.build_base` (which caches and locks it).

:func:`train_build` trains a byte-level BPE tokenizer and a Qwen2 causal LM into an
empty directory, scores held-out public files before and after, and writes
``build_info.json`` last.

The model trains on the public files' functions and methods, each a unit of
its own (:func:`privcode.models.corpus.function_units`), then (``tune_steps``) on
public helper-pattern functions written from an instruction
(:mod:`privcode.data.helpers`: the idioms of small service code, in a public
dialect), and is evaluated on held-out whole files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from privcode.config import BaseConfig
from privcode.models import corpus as C
from privcode.models.presets import Preset
from privcode.models.tokenizer import SPECIAL_TOKENS, train_tokenizer
from privcode.utils import ThreadTuner, atomic_write_json
from privcode.utils import torch_threads as _torch_threads

__all__ = [
    "BUILD_INFO",
    "BUILD_VERSION",
    "HELDOUT_FRACTION",
    "lr_at",
    "torch_threads",
    "train_build",
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


def train_build(
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
