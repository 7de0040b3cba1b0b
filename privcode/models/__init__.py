"""Models: the offline public base model, loading of any local HF causal LM, LoRA, and
:func:`load_model`, the one loader of every model artifact (releases, adapters, models).

``build_base`` (in :mod:`privcode.models.base`) imports torch and transformers;
this package's attributes are loaded lazily so that importing
``privcode.models`` stays cheap for the CLI.
"""

from __future__ import annotations

from privcode.utils import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "presets": "PRESETS",
        "base": "build_base",
        "artifacts": "LoadedModel load_model model_kind",
        "loading": (
            "ModelLoadError attach_lora count_parameters load_causal_lm load_tokenizer "
            "lora_target_modules resolve_model_path"
        ),
    },
)
