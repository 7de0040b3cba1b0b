"""The one Ray Train wiring of privcode: trainer, fit and checkpoints (junior, premium).
Design notes: docs/architecture.md, "models/ray_train.py".

:func:`torch_trainer` builds the ``TorchTrainer`` (gloo on CPU / NCCL on GPU) for the DP junior
(:mod:`privcode.train.loop`) and the premium model (:mod:`privcode.premium.train`); :func:`fit`
runs it; :func:`report_checkpoint` reports a checkpoint from either. In a worker group
``ray.train.report`` copies the checkpoint directory (it may be temporary); in local mode
(``num_workers=0``, no restarts) :func:`report_checkpoint` writes it under ``local_dir``
(a temporary sibling renamed into place; the newest ``keep`` stay).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from privcode.utils import torch_threads

__all__ = ["fit", "report_checkpoint", "torch_trainer"]


def torch_trainer(
    loop: Callable[[dict[str, Any]], None],
    loop_config: dict[str, Any],
    *,
    name: str,
    storage: str | Path,
    num_workers: int,
    cpus_per_worker: int,
    use_gpu: bool,
    max_failures: int,
    keep: int | None = None,
) -> Any:
    """A ``TorchTrainer`` of ``num_workers`` workers (0: Ray Train's local mode) running ``loop``.

    Each worker holds ``cpus_per_worker`` CPUs (and one GPU with ``use_gpu``);
    the worker group restarts from its last checkpoint up to ``max_failures``
    times; ``keep`` checkpoints are kept in ``storage/name`` (None: all).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    return TorchTrainer(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
        ),
    )


def report_checkpoint(
    metrics: dict[str, Any],
    write: Callable[[Path], None] | None,
    local_dir: str | Path | None,
    step: int,
    keep: int = 2,
) -> None:
    """``ray.train.report(metrics)`` with the checkpoint ``write(directory)`` fills.

    ``write`` None: a rank that reports metrics only (every rank must report).
    ``local_dir`` None: a worker group (the directory is temporary); else local
    mode (the directory is ``<local_dir>/checkpoint_<step>``).
    """
    import ray.train

    if write is None:
        ray.train.report(metrics, checkpoint=None)
        return
    if local_dir is None:
        with tempfile.TemporaryDirectory(prefix="privcode-ckpt-") as tmp:
            write(Path(tmp))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        return
    root = Path(local_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint_{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        write(tmp)
        shutil.rmtree(final, ignore_errors=True)  # the same step reported again
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(final)))
    for old in sorted(root.glob("checkpoint_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def fit(trainer: Any, num_workers: int, cpus_per_worker: int) -> Any:
    """``trainer.fit()``; in local mode (``num_workers`` 0) it trains in this process, so
    under ``cpus_per_worker`` torch threads, the caller's count restored after."""
    with torch_threads(cpus_per_worker) if num_workers == 0 else contextlib.nullcontext():
        return trainer.fit()
