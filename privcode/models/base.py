"""The public base model: a small Qwen2 trained from scratch on public stdlib code.
Design notes: docs/architecture.md, "models/base.py".

:func:`build_base` trains a byte-level BPE tokenizer and a Qwen2 causal LM on the public half
of the standard library only (:mod:`privcode.models.corpus`; the recipe:
:mod:`privcode.models.base_training`), scores it on held-out public files before and after
training, and saves both with ``save_pretrained`` (HF's ``Auto*`` classes load it offline).
A preset (:data:`~privcode.models.presets.PRESETS`) trains a fixed number of steps;
:func:`check_complete` refuses a build that did not train all of them.

Builds are cached under ``<cache_dir>/<preset>-<hash>/``, the hash covering everything that
changes the weights. A build is written to a temporary sibling and renamed into place,
``build_info.json`` last: a directory counts as a build only with that file and the expected
hash. A lock file next to the target lets only one concurrent builder train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.base import BaseRecord
from privcode.artifacts.record import ArtifactError
from privcode.config import BaseConfig
from privcode.models import corpus as C
from privcode.models.base_training import (
    BUILD_INFO,
    BUILD_VERSION,
    HELDOUT_FRACTION,
    torch_threads,
    train_build,
)
from privcode.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from privcode.models.presets import PRESETS, Preset
from privcode.utils import replace_dir, stable_hash

__all__ = [
    "build_base",
    "check_complete",
    "config_hash",
]

#: Held-out evaluation of an existing model (``base.model``): a few sequences,
#: enough for a sanity number, cheap even for a 7B model on a CPU.
EXTERNAL_EVAL_SEQ_LEN = 256
EXTERNAL_EVAL_TOKENS = 4 * EXTERNAL_EVAL_SEQ_LEN


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


# --------------------------------------------------------------------------- public API


def build_base(cfg: BaseConfig, out_dir: Path | None = None, progress: bool = True) -> dict:
    """Build (or reuse) the public base model described by ``cfg``; return its info.

    ``cfg.model`` set: nothing is trained; the local HF causal LM at that path is validated
    and scored on a small held-out public sample. Otherwise the ``cfg.preset`` model is
    trained (see module docstring) into ``out_dir``, or ``<cfg.cache_dir>/<preset>-<hash>/``
    when ``out_dir`` is None, where a complete build of the same hash is returned as is
    (``cached: True``). Returns ``build_info.json``'s content plus ``path`` and ``cached``
    (keys: docs/architecture.md, "models/base.py"). Raises
    :class:`~privcode.models.loading.ModelLoadError` on a bad model path or output dir.
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
                    info = train_build(cfg, preset, files, digest, tmp, progress, started)
                    _make_readable(tmp)
                    _swap_into_place(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                return {**info, "path": str(final), "cached": False}
    return {**info, "path": str(final), "cached": True}


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
