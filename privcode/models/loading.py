"""Load any local Hugging Face causal LM and its tokenizer; attach LoRA adapters.

Everything here is offline: paths are local directories, loaded with
``local_files_only=True``, and remote code is never executed. A preset name
(``ci``, ``demo``, ``small``) stands for the self-trained base model of that
preset in the default cache, built on first use.

LoRA target modules come from :data:`LORA_TARGETS`, a table keyed by
``model.config.model_type``. An architecture missing from the table falls back
to every linear layer except the output head, with a warning: that works for
most decoder-only models but adapts more weights than needed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from privcode.errors import PrivcodeError
from privcode.models.presets import PRESETS

__all__ = [
    "LORA_TARGETS",
    "ModelLoadError",
    "attach_lora",
    "count_parameters",
    "load_causal_lm",
    "load_tokenizer",
    "lora_target_modules",
    "resolve_dtype",
    "resolve_model_path",
]


class ModelLoadError(PrivcodeError, ValueError):
    """A model path is missing, is not a HF model, or is not a causal LM; names the path."""


_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: model_type -> leaf names of the linear layers LoRA adapts (attention + MLP).
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    "qwen2": _LLAMA_LIKE,
    "qwen2_moe": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"),
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "olmo": _LLAMA_LIKE,
    "cohere": _LLAMA_LIKE,
    "deepseek_v2": (
        "q_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    "phi": ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "starcoder2": ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"),
    "gpt_bigcode": ("c_attn", "c_proj", "c_fc"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "falcon": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "bloom": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "gptj": ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"),
    "codegen": ("qkv_proj", "out_proj", "fc_in", "fc_out"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}

#: Architectures whose projections are transformers ``Conv1D`` (weight stored
#: transposed): peft needs ``fan_in_fan_out=True`` for them.
_CONV1D_TYPES = frozenset({"gpt2"})


def _is_preset(name: str) -> bool:

    return name in PRESETS


def resolve_model_path(
    path_or_preset: str | Path, cache_dir: str | None = None, progress: bool = True
) -> Path:
    """A local model directory: the path itself, or the cached build of a preset name.

    A preset name wins only when no file or directory of that name exists in
    the working directory. A missing preset build is built (seed 0) into
    ``cache_dir`` (default: ``BaseConfig.cache_dir``).
    """
    text = str(path_or_preset)
    path = Path(text).expanduser()
    if not path.exists() and _is_preset(text):
        from privcode.config import BaseConfig
        from privcode.models.base import build_base

        cfg = (
            BaseConfig(preset=text)
            if cache_dir is None
            else BaseConfig(preset=text, cache_dir=cache_dir)
        )
        return Path(build_base(cfg, progress=progress)["path"])
    if not path.exists():
        raise ModelLoadError(
            f"model path {text!r} does not exist (expected a local HF model "
            "directory or a preset name: ci, demo, small)"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def _torch_dtype(dtype: Any) -> Any:
    if dtype is None:
        # float32 by default: CPU kernels for half types are slow, and DP noise
        # on bf16 weights loses most of its precision.
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"unknown dtype {dtype!r} (use a torch.dtype, its name, or 'auto')")


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of a config's ``dtype`` (:data:`privcode.registry.DTYPES`) on ``device``.

    ``auto`` is bfloat16 on a CUDA device that supports it and float32
    otherwise (CPU kernels of half types are slow). An explicit ``bfloat16``
    on a CUDA device without bf16 support is an error naming the device.
    """
    dev = torch.device(device)
    if name == "auto":
        if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        if dev.type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype bfloat16: the CUDA device {dev} does not support bf16")
        return torch.bfloat16
    raise ValueError(f"unknown dtype {name!r} (one of auto, float32, bfloat16)")


#: ``tokenizer_class`` values meaning "tokenizer.json is the whole tokenizer".
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _declared_tokenizer_class(directory: Path) -> str | None:

    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def load_tokenizer(path: str | Path, *, cache_dir: str | None = None):
    """The tokenizer saved in a local model directory (or of a preset's cached build).

    A directory whose ``tokenizer_config.json`` declares the generic class (as privcode's
    builds do) is loaded from ``tokenizer.json`` exactly as saved, lossless on arbitrary
    Unicode; other directories go through ``AutoTokenizer``. A tokenizer without a pad token
    gets its EOS token as pad. ``cache_dir`` only matters for a preset name (see
    :func:`resolve_model_path`). Why: docs/architecture.md, "models/loading.py".
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = resolve_model_path(path, cache_dir=cache_dir)
    generic = (
        _declared_tokenizer_class(directory) in _GENERIC_TOKENIZER_CLASSES
        and (directory / "tokenizer.json").is_file()
    )
    loader = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{directory}: cannot load a tokenizer: {exc}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path_or_preset: str | Path,
    dtype: Any = None,
    device: str | torch.device | None = None,
    *,
    cache_dir: str | None = None,
):
    """Load a causal LM from a local HF directory or a preset name, in eval mode.

    ``dtype``: None -> float32; ``"auto"`` -> the checkpoint's dtype; or a
    ``torch.dtype`` / its name (``"bfloat16"``). ``device``: where to move the
    model (default: stay on CPU). ``cache_dir`` only matters for a preset name.
    Raises :class:`ModelLoadError` naming the path if it is missing, not a
    model, or not a causal LM.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    directory = resolve_model_path(path_or_preset, cache_dir=cache_dir)
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"{directory}: config.json is not a usable model config: {exc}"
        ) from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(
            f"{directory}: a {config.model_type!r} model is not a causal LM "
            "(AutoModelForCausalLM has no class for it)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=_torch_dtype(dtype)
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{directory}: cannot load the model weights: {exc}") from exc
    if device is not None:
        model.to(device)
    model.eval()
    return model


# --------------------------------------------------------------------------- LoRA


def _linear_leaf_names(model: torch.nn.Module) -> set[str]:
    from transformers.pytorch_utils import Conv1D

    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and isinstance(module, torch.nn.Linear | Conv1D)
    }


def _output_head_names(model: torch.nn.Module) -> set[str]:
    names = {"lm_head"}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        names |= {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if module is head and name
        }
    return names


def lora_target_modules(model: torch.nn.Module) -> list[str]:
    """Leaf names of the linear layers to adapt, from :data:`LORA_TARGETS`.

    Only names the model really has are returned. An unknown ``model_type``
    (or a table entry matching nothing) falls back to every linear layer
    except the output head, with a warning.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    present = _linear_leaf_names(model)
    known = [name for name in LORA_TARGETS.get(model_type, ()) if name in present]
    if known:
        return known
    fallback = sorted(present - _output_head_names(model))
    if not fallback:
        raise ValueError(f"model of type {model_type!r} has no linear layers to adapt with LoRA")
    warnings.warn(
        f"no LoRA target table for model_type {model_type!r}: adapting every linear "
        f"layer except the output head ({', '.join(fallback)})",
        stacklevel=2,
    )
    return fallback


def attach_lora(
    model: torch.nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | tuple[str, ...] | None = None,
):
    """Wrap ``model`` in a peft ``PeftModel`` with LoRA adapters (base weights frozen).

    ``target_modules`` defaults to :func:`lora_target_modules`. The model is
    modified in place (peft injects the adapter layers) and returned wrapped;
    only the ``lora_A``/``lora_B`` weights require gradients.
    """
    from peft import get_peft_model

    return get_peft_model(model, lora_config(model, r, alpha, dropout, target_modules))


def lora_config(
    model: torch.nn.Module,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: list[str] | tuple[str, ...] | None = None,
):
    """The peft ``LoraConfig`` :func:`attach_lora` uses for ``model`` (targets per model type)."""
    from peft import LoraConfig

    if r < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {r}")
    targets = list(target_modules) if target_modules else lora_target_modules(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        fan_in_fan_out=model_type in _CONV1D_TYPES,
    )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total
