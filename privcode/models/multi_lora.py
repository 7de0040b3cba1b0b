"""Many LoRA adapters in ONE batched forward: row ``i`` of the batch through adapter ``i``.

For every LoRA-wrapped ``Linear`` (weight ``W``; adapter ``j``: ``A_j: [r_j, in]``,
``B_j: [out, r_j]``, scaling ``s_j``) and input ``x: [n, seq, in]``::

    y[i] = W x[i] (+ bias)  +  s_{a(i)} * B_{a(i)} (A_{a(i)} x[i])

the base part one matmul over all rows, the adapter part two batched matmuls per rank over the
``g`` adapters of rank ``r`` stacked once (``A: [g, r, in]``, ``B^T: [g, r, out]``, ``s: [g]``)::

    delta[rows] = s[:, None, None] * bmm(bmm(x[rows], A^T), B^T)

Rows without adapter (:data:`BASE`) are skipped. Ranks are grouped, not zero-padded: each row
equals peft's forward of its adapter bit for bit on the CPU. :class:`StackedLora` re-points
peft's ``lora_A``/``lora_B`` at views of the stacks; ``with stacked.active():`` swaps every
``lora.Linear``'s ``forward``. Eval only; refused by name: LoRA variants (DoRA), ``lora_bias``,
merged adapters, LoRA off a ``Linear``, training mode. Not thread-safe: one active forward per
model. Design notes: docs/architecture.md, "models/multi_lora.py".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from privcode.errors import PrivcodeError

__all__ = ["BASE", "MultiLoraError", "StackedLora"]

#: The slot name of "no adapter" (peft's name for it in a mixed batch).
BASE = "__base__"


class MultiLoraError(PrivcodeError, ValueError):
    """An adapter or layer the stacked LoRA forward cannot compute (names the module and why)."""


@dataclass(frozen=True)
class _Stack:
    """One layer's adapters of ONE rank, stacked (one copy; peft's weights are views of it).

    The layouts are the ones CPU ``bmm`` measured fastest for a decode step: ``A`` as peft
    holds it (read transposed), ``B`` transposed (2x faster than ``[g, out, r]`` there, m = 128).
    """

    slots: tuple[int, ...]  #: the slot of each stacked adapter, in stack order
    a: torch.Tensor  #: [g, r, in]: A
    b: torch.Tensor  #: [g, r, out]: B^T
    scale: torch.Tensor  #: [g, 1, 1]


@dataclass(frozen=True)
class _Group:
    """The batch rows one stack serves in a forward, and their weights in row order."""

    rows: slice | torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor


def _lora_layers(model: torch.nn.Module, names: Sequence[str]) -> list[tuple[str, Any]]:
    """(qualified name, module) of every peft LoRA layer holding one of ``names``; refuses
    the ones the stacked forward cannot compute."""
    from peft.tuners.lora import Linear, LoraLayer

    wanted, found = set(names), []
    for qual, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        held = wanted & (set(module.lora_A) | set(getattr(module, "lora_embedding_A", {})))
        if not held:
            continue
        if not isinstance(module, Linear):
            raise MultiLoraError(
                f"{qual}: LoRA on a {type(module).__name__} (adapters {sorted(held)}); the "
                "stacked forward handles LoRA on Linear layers only"
            )
        for name in sorted(held):
            _check_adapter(qual, module, name)
        found.append((qual, module))
    if not found:
        raise MultiLoraError(f"the model has no LoRA Linear layer holding any of {sorted(wanted)}")
    return found


def _check_adapter(qual: str, module: Any, name: str) -> None:
    if name in getattr(module, "lora_variant", {}) or module.use_dora.get(name, False):
        variant = type(module.lora_variant.get(name)).__name__
        raise MultiLoraError(
            f"{qual}: adapter {name!r} is a LoRA variant ({variant}, e.g. DoRA); the stacked "
            "forward computes plain LoRA only"
        )
    if module.lora_bias.get(name, False):
        raise MultiLoraError(f"{qual}: adapter {name!r} has lora_bias; not supported")
    if name in getattr(module, "merged_adapters", ()):
        raise MultiLoraError(f"{qual}: adapter {name!r} is merged into the base weight; unmerge it")


def _stacks(module: Any, slots: Sequence[str | None], share: bool) -> list[_Stack]:
    """One layer's stacks: the adapters it holds, one stack per rank (ranks are not padded:
    a padded GEMM rounds differently from peft's own)."""
    by_rank: dict[int, list[int]] = {}
    for i, name in enumerate(slots):
        if name is not None and name in module.lora_A:
            by_rank.setdefault(int(module.r[name]), []).append(i)
    return [_stack(module, [slots[i] for i in idx], tuple(idx), share) for idx in by_rank.values()]


def _stack(module: Any, names: list[Any], idx: tuple[int, ...], share: bool) -> _Stack:
    weights_a = [module.lora_A[n].weight for n in names]
    weights_b = [module.lora_B[n].weight for n in names]
    dtype = weights_a[0].dtype
    a = torch.stack([w.to(dtype) for w in weights_a]).contiguous()
    b = torch.stack([w.to(dtype).t() for w in weights_b]).contiguous()
    scale = [float(module.scaling[n]) for n in names]
    scale_t = torch.tensor(scale, dtype=dtype, device=a.device).view(-1, 1, 1)
    if share:  # peft's parameters become views of the stack: the weights are held once
        for k, (wa, wb) in enumerate(zip(weights_a, weights_b, strict=True)):
            if wa.dtype == wb.dtype == dtype:
                wa.data, wb.data = a[k], b[k].t()
    return _Stack(idx, a, b, scale_t)


def _groups(stacks: list[_Stack], index: Sequence[int]) -> list[_Group]:
    """For batch row r through slot ``index[r]``: each stack's rows and weights in row order
    (slices and the stacks themselves where the order allows: no copy)."""
    groups = []
    for st in stacks:
        pos = {slot: k for k, slot in enumerate(st.slots)}
        rows = [r for r, slot in enumerate(index) if slot in pos]
        if not rows:
            continue
        take = [pos[index[r]] for r in rows]
        if take == list(range(len(st.slots))):
            a, b, scale = st.a, st.b, st.scale
        else:
            picked = torch.tensor(take, device=st.a.device)
            a, b, scale = st.a[picked], st.b[picked], st.scale[picked]
        span = rows == list(range(rows[0], rows[-1] + 1))
        where = slice(rows[0], rows[-1] + 1) if span else torch.tensor(rows, device=st.a.device)
        groups.append(_Group(where, a, b, scale))
    return groups


def _stacked_forward(module: Any, groups: list[_Group], rows: int, repeat: int = 1):
    """The replacement ``forward`` of one ``lora.Linear``: base for all rows + each row's delta.

    ``repeat`` > 1: the batch is ``repeat`` tiles of the ``rows`` slots (tile t, row r at
    ``t * rows + r``); each group's tiles go through its stack as one longer sequence, so k
    requests of the same m + 1 rows cost the same two bmm per layer, not k times more."""

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        if x.shape[0] != rows * repeat:
            raise MultiLoraError(
                f"stacked LoRA forward: batch of {x.shape[0]} rows, not {rows} x {repeat}"
            )
        xs = x.reshape(repeat, rows, -1, x.shape[-1])
        ys = result.view(repeat, rows, -1, result.shape[-1])
        for g in groups:
            h = xs[:, g.rows].to(g.a.dtype)  # [repeat, g, seq, in]
            n, seq = h.shape[1], h.shape[2]
            h = h.transpose(0, 1).reshape(n, repeat * seq, -1)
            delta = torch.bmm(torch.bmm(h, g.a.transpose(1, 2)), g.b) * g.scale
            delta = delta.view(n, repeat, seq, -1).transpose(0, 1).to(result.dtype)
            ys[:, g.rows] = ys[:, g.rows] + delta
        return result

    return forward


class StackedLora:
    """The LoRA layers of ``model`` (a peft model) stacked over ``slots``: slot ``i`` is row
    ``i`` of the batch, the adapter name ``slots[i]`` or :data:`BASE` (no adapter).

    ``share``: re-point peft's adapter weights at views of the stacks (one copy in
    memory). Build it after every adapter is loaded and the model is on its device;
    moving the model afterwards leaves the stacks behind.
    """

    def __init__(self, model: torch.nn.Module, slots: Sequence[str], *, share: bool = True):
        names = [s for s in slots if s != BASE]
        if not names:
            raise MultiLoraError(f"StackedLora needs at least one adapter slot, got {list(slots)}")
        if len(set(names)) != len(names):
            raise MultiLoraError(f"slots name an adapter twice: {list(slots)}")
        self.model, self.slots = model, tuple(slots)
        layers = [m for _, m in _lora_layers(model, names)]
        unknown = set(names) - {n for m in layers for n in m.lora_A}
        if unknown:
            raise MultiLoraError(f"no LoRA layer of the model holds adapter(s) {sorted(unknown)}")
        per_slot = [None if s == BASE else s for s in slots]
        with torch.no_grad():
            self._layers = [(m, _stacks(m, per_slot, share)) for m in layers]
        identity = range(len(slots))
        self._identity = [(m, _groups(st, identity)) for m, st in self._layers]
        self._active = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the stacks (shared with peft where ``share`` applied)."""
        tensors = [t for _, sts in self._layers for st in sts for t in (st.a, st.b)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @contextlib.contextmanager
    def active(
        self, index: Sequence[int] | torch.Tensor | None = None, *, repeat: int = 1
    ) -> Iterator[None]:
        """Within: every forward of ``model`` runs batch row ``r`` through slot ``index[r]``
        (default: slot ``r``; the batch then has ``len(slots)`` rows). The default order
        costs no copy; another index gathers each layer's weights once, on entry.
        ``repeat``: the batch is that many tiles of the ``index`` rows (requests decoded
        together), each tile through the same slots."""
        if self.model.training:
            raise MultiLoraError("the stacked LoRA forward is for eval mode only (no dropout)")
        if self._active:
            raise MultiLoraError("StackedLora.active() is already active (not re-entrant)")
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise MultiLoraError(f"repeat must be an integer >= 1, got {repeat!r}")
        if index is None:
            rows, plan = len(self.slots), self._identity
        else:
            order = [int(i) for i in torch.as_tensor(index).reshape(-1).tolist()]
            if not order or not all(0 <= i < len(self.slots) for i in order):
                raise MultiLoraError(f"index must list slots in [0, {len(self.slots)}): {order}")
            rows, plan = len(order), [(m, _groups(st, order)) for m, st in self._layers]
        saved = [(m, m.__dict__.get("forward")) for m, _ in plan]
        self._active = True
        try:
            for module, groups in plan:
                module.forward = _stacked_forward(module, groups, rows, repeat)
            yield
        finally:
            for module, old in saved:
                if old is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = old
            self._active = False
