"""Int8 linear layers whose result for a row depends on that row only: :func:`quantize_rows`.

``y = (q(x) @ Wq^T) * s_x * s_W + b``: each input row ``x`` (one token) is quantised
symmetrically with its own scale ``s_x = max|x| / 127``, each output channel of ``W`` with its
own ``s_W = max|W_j| / 127``; the int8 product accumulates in int32 (``torch._int_mm``, VNNI on
x86). Written here rather than taken from ``torch.ao.quantization.quantize_dynamic`` for a
measured reason (bench/bench_roundtrip.py, MiniLM on one core): torch's dynamic quantisation
scales activations per tensor, over the whole batch, so a text's embedding depends on which
texts share its batch (a resumed shard could score a pair differently), and its round-trip
scores moved by up to 0.147 from float32's; per-row scales make every text's embedding its
own (equal to within 3e-8 in any batch) and move scores by at most 0.031, at the same speed
class (2.2x float32 here; torch's 2.6x).
"""

from __future__ import annotations

import torch

__all__ = ["RowInt8Linear", "quantize_rows"]


class RowInt8Linear(torch.nn.Module):
    """An ``nn.Linear`` in int8: per-output-channel weights, per-row activations (see above)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_t", q.t().contiguous())  # (in, out) for _int_mm
        self.register_buffer("weight_scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        q = (rows / scale).round_().clamp_(-127, 127).to(torch.int8)
        out = torch._int_mm(q, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_rows(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every ``nn.Linear`` below it replaced by :class:`RowInt8Linear` (in
    place; CPU inference only)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, RowInt8Linear(child))
        else:
            quantize_rows(child)
    return module
