"""Checkpoints reported to Ray Train, from a worker group or from Ray Train's local mode.

In a worker group (``ScalingConfig(num_workers >= 1)``) ``ray.train.report``
copies a checkpoint directory into the run's storage before it returns, so
the directory may be temporary. In Ray Train's local mode
(``num_workers=0``: the training function runs in the calling process, with
the same ``ray.train`` API and no worker actors to start) ``report`` keeps
the ``Checkpoint`` object only, so :func:`report_checkpoint` writes the
directory under ``local_dir`` instead (a temporary sibling renamed into
place; the newest ``keep`` stay) and it lives until the run's storage is
removed. Local mode has no worker-group restarts (``FailureConfig`` does not
apply).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["fit", "report_checkpoint"]


def report_checkpoint(metrics: dict[str, Any], write: Callable[[Path], None] | None,
                      local_dir: str | Path | None, step: int, keep: int = 2) -> None:
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
    from privcode.utils import torch_threads

    with torch_threads(cpus_per_worker) if num_workers == 0 else contextlib.nullcontext():
        return trainer.fit()
