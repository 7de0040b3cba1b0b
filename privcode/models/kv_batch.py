"""Requests decoded together: groups of rows in one left-padded KV cache of a causal LM.

Each GROUP of rows (the PAC ensemble's m + 1 rows of one completion) joins with the cache of
its own prefill and leaves at any step; one forward per step. In a cache of ``width`` columns
group ``g`` of real length ``n_g`` sits right-aligned, after ``pad_g = width - n_g`` zeros::

    keys[layer] = cat_g( [0 .. 0 | k_g] )      attention_mask[row of g] = [0]*pad_g + [1]*(n_g + 1)
                                               position_ids[row of g]   = n_g

so every row attends to its own tokens only, at its own positions: the log-probs equal the
group's solo decode up to float rounding. One group alone is its own cache, untouched. Only
plain dynamic cache layers; sliding-window, static or quantized caches are refused by name
(:class:`KvBatchError`). Design notes: docs/architecture.md, "models/kv_batch.py".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from privcode.errors import PrivcodeError

__all__ = ["KvBatch", "KvBatchError", "own_caches"]


class KvBatchError(PrivcodeError, ValueError):
    """A cache this batch cannot hold beside others (names the layer type), or a bad group."""


@dataclass
class _Group:
    rows: int
    length: int  #: real tokens in the cache (the next token's position)


def _layers(cache: Any) -> list[Any]:
    from transformers.cache_utils import DynamicLayer

    layers = list(getattr(cache, "layers", ()))
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise KvBatchError(
                f"cache layer {type(layer).__name__}: decoding requests together needs plain "
                "dynamic cache layers (no sliding window, static or quantized cache)"
            )
    if not layers:
        raise KvBatchError(f"{type(cache).__name__} holds no cache layers to batch")
    return layers


def _pad_left(t: torch.Tensor, columns: int) -> torch.Tensor:
    return t if columns == 0 else torch.nn.functional.pad(t, (0, 0, columns, 0))


def _own_cache(cache: Any, start: int, rows: int, length: int, width: int) -> Any:
    """Rows ``[start, start + rows)`` of ``cache`` (``width`` columns, the last ``length``
    theirs), their padding cut: a cache of their own."""
    from transformers.cache_utils import DynamicCache

    own = DynamicCache()
    at, cut = slice(start, start + rows), width - length
    for i, layer in enumerate(_layers(cache)):
        own.update(layer.keys[at, :, cut:].contiguous(), layer.values[at, :, cut:].contiguous(), i)
    return own


def own_caches(cache: Any, rows: int, lengths: Iterable[int]) -> list[Any]:
    """The groups of a right-aligned batched ``cache`` (``rows`` rows each; group g's real
    tokens are its last ``lengths[g]`` columns), each as a cache of its own, unpadded, to
    :meth:`KvBatch.join` (a batched prefill's)."""
    width = _layers(cache)[0].keys.shape[2]
    return [_own_cache(cache, g * rows, rows, n, width) for g, n in enumerate(lengths)]


class KvBatch:
    """Groups of rows (keyed by any hashable) decoded together; see the module docstring."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.width = 0
        self.groups: dict[Hashable, _Group] = {}  # in row order

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups.values())

    def join(self, key: Hashable, cache: Any, rows: int, length: int) -> None:
        """Add group ``key``: ``rows`` rows whose ``cache`` holds ``length`` tokens (its
        prefill's; the batch takes it over)."""
        if key in self.groups:
            raise KvBatchError(f"group {key!r} is already in the batch")
        if not self.groups:
            self.cache, self.width = cache, length
            self.groups[key] = _Group(rows, length)
            return
        width = max(self.width, length)
        for old, new in zip(_layers(self.cache), _layers(cache), strict=True):
            grow, fit = width - self.width, width - length
            old.keys = torch.cat([_pad_left(old.keys, grow), _pad_left(new.keys, fit)])
            old.values = torch.cat([_pad_left(old.values, grow), _pad_left(new.values, fit)])
        self.width = width
        self.groups[key] = _Group(rows, length)

    def leave(self, key: Hashable, *, take: bool = False) -> Any:
        """Remove group ``key`` (its rows and the padding nobody needs any more); ``take``:
        return its cache (its own rows, unpadded: to :meth:`join` again later)."""
        if key not in self.groups:
            raise KvBatchError(f"group {key!r} is not in the batch")
        start = 0
        for k, g in self.groups.items():
            if k == key:
                break
            start += g.rows
        gone = self.groups.pop(key)
        if not self.groups:
            cache, self.cache, self.width = self.cache, None, 0
            return cache if take else None
        mine = _own_cache(self.cache, start, gone.rows, gone.length, self.width) if take else None
        keep = torch.cat(
            [torch.arange(start), torch.arange(start + gone.rows, self.rows + gone.rows)]
        )
        trim = self.width - max(g.length for g in self.groups.values())
        for layer in _layers(self.cache):
            at = keep.to(layer.keys.device)
            layer.keys = layer.keys[at, :, trim:].contiguous()
            layer.values = layer.values[at, :, trim:].contiguous()
        self.width -= trim
        return mine

    def forward_kwargs(self) -> dict[str, Any]:
        """The mask and positions of the next one-token step (none while nothing is padded)."""
        if all(g.length == self.width for g in self.groups.values()):
            return {}
        pads = torch.cat(
            [torch.full((g.rows,), self.width - g.length) for g in self.groups.values()]
        )
        columns = torch.arange(self.width + 1)
        device = _layers(self.cache)[0].keys.device
        mask = (columns[None, :] >= pads[:, None]).long().to(device)
        positions = (self.width - pads)[:, None].to(device)
        return {"attention_mask": mask, "position_ids": positions}

    def stepped(self) -> None:
        """One token was appended to every row's cache (the forward extended it in place)."""
        self.width += 1
        for g in self.groups.values():
            g.length += 1
