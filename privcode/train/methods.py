"""Stage I training methods: a registry table of per-record loss functions.

The DP machinery (:mod:`privcode.dp.dpsgd`, :mod:`privcode.train.loop`) is
method-agnostic: it asks the method for a loss function

    loss_fn(model, batch) -> Tensor[B]

returning one loss per record of the batch (``batch`` as built by
:func:`privcode.train.data.collate`, plus the public ``step`` number). The
DP guarantee needs each entry to depend on its own record only (and on
public values: the step, the current weights, public data): no batch means,
no in-batch negatives, no batch statistics.

A method is registered with a *factory* ``build(ctx) -> loss_fn`` so that
methods needing more than the model (PrivCode's frozen reference model and
lambda(t) schedule, PrivCode++'s encoders) set themselves up once per worker.

Methods:

* ``dpft``: DP fine-tuning on prompt and code tokens jointly. The loss of
  record i is its mean next-token cross-entropy

      L_i = (1 / |T_i|) sum_{t in T_i} -log p(x_{i,t} | x_{i,<t})

  over ``T_i``, the positions 1..len-1 of the record's own (prompt + code +
  EOS) tokens (padding excluded; position 0 is context only). A record with
  a single token has no target and loss 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from privcode.train.data import PAD

__all__ = ["METHODS", "Method", "MethodContext", "get_method", "token_cross_entropy"]

LossFn = Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor]


@dataclass(frozen=True)
class MethodContext:
    """What a method's factory may use: public things only."""

    base_path: str = ""
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """A registry entry: name, one-line description, loss factory, and what it releases."""

    name: str
    description: str
    build: Callable[[MethodContext], LossFn]
    #: Names of the released modules besides the LoRA adapter (e.g. a prefix decoder).
    releases: tuple[str, ...] = ()


def token_cross_entropy(model: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token cross-entropy ``[B, T-1]`` and the target segments ``[B, T-1]``."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                                           reduction="none")
    return ce, batch["segments"][:, 1:]


def _dpft(ctx: MethodContext) -> LossFn:
    def loss_fn(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        ce, targets = token_cross_entropy(model, batch)
        mask = (targets != PAD).to(ce.dtype)
        return (ce * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)

    return loss_fn


#: Method name -> entry. ``TrainConfig.method`` picks from these names.
METHODS: dict[str, Method] = {
    m.name: m for m in (
        Method("dpft", "DP fine-tuning: mean token cross-entropy over prompt + code tokens",
               _dpft),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown training method {name!r} (known: {', '.join(METHODS)})") from None
