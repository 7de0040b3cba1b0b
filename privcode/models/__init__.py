"""Models: the offline public base model, loading of any local HF causal LM, LoRA, and
:func:`load_model`, the one loader of every model artifact (releases, adapters, models).

``build_base`` (in :mod:`privcode.models.base`) imports torch and transformers;
this package's attributes are loaded lazily so that importing
``privcode.models`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PRESETS",
    "LoadedModel",
    "ModelLoadError",
    "attach_lora",
    "build_base",
    "count_parameters",
    "load_causal_lm",
    "load_model",
    "load_tokenizer",
    "lora_target_modules",
    "model_kind",
    "resolve_model_path",
]

_WHERE = {
    "PRESETS": "privcode.models.presets",
    "build_base": "privcode.models.base",
    "LoadedModel": "privcode.models.artifacts",
    "load_model": "privcode.models.artifacts",
    "model_kind": "privcode.models.artifacts",
    "ModelLoadError": "privcode.models.loading",
    "attach_lora": "privcode.models.loading",
    "count_parameters": "privcode.models.loading",
    "load_causal_lm": "privcode.models.loading",
    "load_tokenizer": "privcode.models.loading",
    "lora_target_modules": "privcode.models.loading",
    "resolve_model_path": "privcode.models.loading",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'privcode.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
