"""Real architecture shapes with random weights: production-sized models, nothing downloaded.
Design notes: docs/architecture.md, "models/shapes.py".

:data:`SHAPES` holds the public architecture hyper-parameters (``config.json`` values of the
paper's Qwen2.5-Coder-1.5B / -7B) as ``transformers.Qwen2Config`` keyword arguments;
:func:`random_causal_lm` builds such a model with random, finite weights (HF's Qwen2 init
distribution, seeded) and :func:`param_count` counts its parameters from the config alone
(hidden ``H``, ``L`` layers, ``n`` query / ``k`` KV heads of width ``d = H / n``, MLP width
``I``, vocabulary ``V``)::

    P = V H [+ V H if the LM head is untied] + H
        + L (H n d + n d + 2 (H k d + k d) + n d H + 3 H I + 2 H)

For benchmarks and plans only: not trained, and nothing computed with them is private.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "SHAPES",
    "layers_that_fit",
    "param_count",
    "random_causal_lm",
    "shape_config",
]

#: name -> ``transformers.Qwen2Config`` keyword arguments. The two Qwen2.5-Coder
#: entries are the published models' architecture values; ``tiny`` has the same
#: structure (GQA, tied head, q/k/v biases) at a size tests can build in milliseconds.
#: What every entry shares (Qwen2.5's RoPE base, RMSNorm epsilon and activation).
_QWEN2 = {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
#: The Qwen2.5-Coder tokenizer's special tokens and context.
_CODER = {"max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-1.5b": {
        **_QWEN2,
        **_CODER,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-coder-7b": {
        **_QWEN2,
        **_CODER,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "tiny": {
        **_QWEN2,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 1,
    },
}


def _kwargs(shape: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
        return dict(SHAPES[shape])
    return dict(shape)


def shape_config(shape: str | Mapping[str, Any], num_layers: int | None = None) -> Any:
    """The ``Qwen2Config`` of ``shape`` (a :data:`SHAPES` name or kwargs), ``num_layers`` layers.

    ``num_layers`` (default: the shape's own) cuts or extends the stack; every
    other dimension stays the shape's.
    """
    from transformers import Qwen2Config

    kwargs = _kwargs(shape)
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        kwargs["num_hidden_layers"] = num_layers
    return Qwen2Config(**kwargs)


def param_count(shape: str | Mapping[str, Any], num_layers: int | None = None) -> int:
    """Parameters of ``shape`` with ``num_layers`` layers, from the config (nothing is built).

    The formula is the module docstring's (tied embeddings counted once).
    """
    cfg = shape_config(shape, num_layers)
    h, n, k = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // n
    v, i = cfg.vocab_size, cfg.intermediate_size
    layer = (h * n * d + n * d) + 2 * (h * k * d + k * d) + n * d * h + 3 * h * i + 2 * h
    head = 0 if cfg.tie_word_embeddings else v * h
    return v * h + head + cfg.num_hidden_layers * layer + h


def layers_that_fit(
    shape: str | Mapping[str, Any], budget_bytes: float, *, bytes_per_param: float = 2.0
) -> int:
    """The most layers (at most the shape's own) whose weights fit ``budget_bytes``; 0 if none.

    ``bytes_per_param``: 2 for bf16 weights, 4 for fp32, 16 for a full
    fine-tune under AdamW with fp32 master weights (the caller's estimate).
    """
    full = int(_kwargs(shape)["num_hidden_layers"])
    one = param_count(shape, 1)
    per_layer = param_count(shape, 2) - one
    fixed = one - per_layer
    fits = int((budget_bytes / bytes_per_param - fixed) // per_layer)
    return max(0, min(full, fits))


@torch.no_grad()
def _fill_random_(model: torch.nn.Module, std: float, seed: int) -> None:
    """HF's Qwen2 init distribution, one pass per tensor on its own device (see the module doc)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():  # tied weights are listed once
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:  # RMSNorm gains
            p.fill_(1.0)


def random_causal_lm(
    shape: str | Mapping[str, Any],
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Any:
    """A ``Qwen2ForCausalLM`` of ``shape`` with random weights, built on ``device`` in ``dtype``.

    ``num_layers`` overrides the layer count (a 7B shape cut to fit one GPU).
    Built without transformers' init passes and filled once (module
    docstring); the same ``seed`` gives the same weights on the same device.
    Returned in eval mode (as ``from_pretrained`` returns models).
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = shape_config(shape, num_layers)
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.tie_weights()  # no_init_weights skips init_weights, which ties the head (transformers 5)
    _fill_random_(model, float(cfg.initializer_range), seed)
    return model.eval()
