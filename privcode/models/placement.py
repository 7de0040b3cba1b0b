"""Where a stage's model runs, and in which dtype: :func:`placement`.
Design notes: docs/architecture.md, "models/placement.py".

A stage task that reserved a GPU runs its models on the first visible CUDA device (Ray sets
``CUDA_VISIBLE_DEVICES`` to the GPUs it granted); one that reserved none, on the CPU. A config
asking for a GPU where none is visible is an error naming the config key: never a silent CPU
fallback. The dtype is the config's ``dtype`` resolved on that device by
:func:`privcode.models.loading.resolve_dtype` (``auto``: bfloat16 on a bf16-capable CUDA
device, float32 elsewhere). Only forward passes run in it; consumers cast logits to float32
before any softmax; trainable weights stay float32.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from privcode.errors import PrivcodeError
from privcode.models.loading import resolve_dtype

__all__ = ["DevicePlacementError", "Placement", "gpu_options", "placement", "task_device"]


class DevicePlacementError(PrivcodeError, RuntimeError):
    """A config asks for a GPU that this process cannot see; names the config key."""


@dataclass(frozen=True)
class Placement:
    """A model's device and the dtype of its weights and forward passes."""

    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> Any:
        """``torch.autocast`` in :attr:`dtype` on CUDA for a half dtype; else a no-op context."""
        if self.cuda and self.dtype != torch.float32:
            return torch.autocast(device_type="cuda", dtype=self.dtype)
        return contextlib.nullcontext()

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}


def task_device(use_gpu: bool, key: str) -> torch.device:
    """``cuda:<current>`` when ``use_gpu`` (CUDA must be visible), else ``cpu``.

    ``key`` is the config key that asked for the GPU (``eval.use_gpu``), named
    in the :class:`DevicePlacementError` raised when no CUDA device is visible.
    """
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DevicePlacementError(
            f"{key} asks for a GPU, but no CUDA device is visible in this process "
            f"(CUDA_VISIBLE_DEVICES={visible!r}, torch {torch.__version__} built with CUDA "
            f"{torch.version.cuda or 'none'}): run on a node with a GPU and a CUDA build of "
            f"torch, or set {key}=false to run on the CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


def placement(use_gpu: bool, dtype: str, key: str) -> Placement:
    """The device (:func:`task_device`) and the resolved ``dtype`` name on it."""
    device = task_device(use_gpu, key)
    return Placement(device, resolve_dtype(dtype, device))


def gpu_options(gpus: float) -> dict[str, float]:
    """Ray ``options`` asking for ``gpus`` GPUs; empty for none (a CPU task asks for nothing)."""
    return {"num_gpus": float(gpus)} if gpus > 0 else {}
