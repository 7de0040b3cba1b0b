"""The stage protocol: :class:`Stage`, and what a stage receives from the runner.

A stage declares the config it reads (``sections``), the stages whose
artifacts it consumes (``needs``, ``after``, ``late``), the CPUs it wants, a
``run(cfg, out_dir, inputs)`` that writes its files into ``out_dir`` and
returns a JSON summary, and a ``report_section`` that renders its part of the
report from its own manifest. ``inputs`` maps each upstream stage to its
:class:`~privcode.artifacts.StageManifest` (or a :class:`PendingInput`).
The concrete stages are in :mod:`privcode.pipeline.stages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from privcode.artifacts import JsonRecord, StageManifest
from privcode.config import PipelineConfig, section_to_dict
from privcode.pipeline.sections import ReportContext, Section

__all__ = [
    "NONDP_TRAIN_FIELDS",
    "Inputs",
    "PendingInput",
    "Stage",
    "Workers",
    "base_path",
    "RayTrainStage",
    "summary_of",
    "wait_input",
]

#: The train fields the non-DP comparison reads (:func:`privcode.train.nondp.train_nondp_comparison`
#: and the ``nondpft`` objective it builds); a test scans that module so none is missed.
NONDP_TRAIN_FIELDS = (
    "train.steps",
    "train.lr",
    "train.expected_batch_size",
    "train.max_length",
    "train.weight_decay",
    "train.use_gpu",
    "train.lora_r",
    "train.lora_alpha",
    "train.lora_dropout",
)


@dataclass(frozen=True)
class PendingInput:
    """A ``late`` input (:attr:`Stage.late`) still running: its fingerprint and Ray result.

    Ray resolves object refs passed as task arguments, not those held in an
    object, so the stage starts without waiting for it; :func:`wait_input` does.
    """

    fingerprint: str
    ref: Any


Inputs = dict[str, "StageManifest | PendingInput"]


@dataclass(frozen=True)
class Workers:
    """Ray workers a stage starts besides its own task (Ray Train, actor pools, sub-tasks).

    ``count`` workers of ``cpus`` CPUs and ``gpus`` GPUs each at most; ``required``
    of them must be placeable at once for the stage to progress (a Ray Train
    worker group needs all of its workers; an actor pool its minimum size; queued
    tasks one). ``key`` is the config key that sizes them (named in a plan).
    """

    kind: str
    count: int
    cpus: float
    gpus: float
    required: int
    key: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "count": self.count,
            "cpus": self.cpus,
            "gpus": self.gpus,
            "required": self.required,
            "key": self.key,
        }


def wait_input(inputs: Inputs, name: str, timeout: float | None = None) -> StageManifest | None:
    """The manifest of upstream stage ``name`` (None if not an input or, after ``timeout``
    seconds, still running), waiting while it runs (``timeout`` None: until it is done).

    A running ``late`` input's failure raises here.
    """
    entry = inputs.get(name)
    if isinstance(entry, PendingInput):
        import ray

        from privcode.pipeline.runner import _get

        if timeout is not None and not ray.wait([entry.ref], timeout=timeout)[0]:
            return None
        inputs[name] = entry = _get(entry.ref)  # a user-facing error reads as itself
    return entry


def summary_of(inputs: Inputs, name: str) -> dict[str, Any]:
    """The summary of finished input ``name`` (KeyError when it is not an input)."""
    entry = inputs[name]
    if not isinstance(entry, StageManifest):
        raise RuntimeError(f"input {name!r} is still running: wait_input() it first")
    return entry.summary


def base_path(inputs: Inputs) -> str:
    """The base model's path from the base stage's manifest, once it is known to be complete."""
    from privcode.models.base import check_complete

    return check_complete(summary_of(inputs, "base")).path


class Stage:
    """One pipeline stage. Subclasses set the class attributes and ``run``."""

    name: ClassVar[str]
    #: The config this stage reads, and so its fingerprint: a whole section
    #: (``"audit"``), one field (``"train.data"``) or fields by prefix
    #: (``"audit.nondp_*"``); :meth:`config_read` gives the values.
    sections: ClassVar[tuple[str, ...]] = ()
    #: Upstream stages whose manifests this stage reads (must run earlier).
    needs: ClassVar[tuple[str, ...]] = ()
    #: Optional upstream stages: read (and run first, entering the fingerprint)
    #: only when they are part of the same run; never pulled in on their own.
    after: ClassVar[tuple[str, ...]] = ()
    #: Of ``after``, the stages this one may start beside: when one of them is
    #: running (on Ray, ``run.parallel``), this stage starts anyway and gets
    #: ``inputs[name]`` = its fingerprint and a pending result, which ``run``
    #: waits on where it needs the artifact (:func:`wait_input`).
    late: ClassVar[tuple[str, ...]] = ()
    #: CPUs requested for the Ray task; None means every CPU of one node (the
    #: largest that can also give the task's GPUs: a task never spans nodes).
    num_cpus: ClassVar[float | None] = 1
    #: The config key that sets the task's CPUs (named when no node can give them).
    cpu_key: ClassVar[str | None] = None
    #: The bool config key that reserves one GPU for the task (``eval.use_gpu``).
    gpu_flag: ClassVar[str | None] = None
    #: Bump when the stage's code changes what it writes: forces a re-run.
    version: ClassVar[int] = 1
    #: Whether the stage's artifacts hold private data (inside the boundary).
    private: ClassVar[bool] = False
    #: The typed record of this stage's summary (None: a plain JSON object): the runner
    #: checks it before writing the manifest and before skipping the stage as current.
    summary_type: ClassVar[type[JsonRecord] | None] = None

    def run(self, cfg: PipelineConfig, out_dir: Path, inputs: Inputs) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def config_read(cls, cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
        """``{section: {field: value}}`` of what :attr:`sections` declares (see there).

        A whole section gives the same mapping as :func:`section_to_dict`, so a
        stage that reads whole sections keeps its fingerprint. An entry naming
        no field of its section is a ValueError (a typo would silently leave
        the field out of the fingerprint).
        """
        out: dict[str, dict[str, Any]] = {}
        for entry in cls.sections:
            name, _, pattern = entry.partition(".")
            values = section_to_dict(cfg.section(name))
            if not pattern:
                out[name] = values
                continue
            chosen = {
                k: v
                for k, v in values.items()
                if (k.startswith(pattern[:-1]) if pattern.endswith("*") else k == pattern)
            }
            if not chosen:
                raise ValueError(f"stage {cls.name!r}: {entry!r} names no field of '{name}'")
            out.setdefault(name, {}).update(chosen)
        return {name: dict(sorted(fields.items())) for name, fields in out.items()}

    def still_valid(self, summary: dict[str, Any]) -> bool:
        """Extra check before skipping: do things outside the stage dir still exist?"""
        return True

    def report_section(self, manifest: StageManifest, ctx: ReportContext) -> Section | None:
        """This stage's part of the run report, from its own manifest (None: no section)."""
        return None

    @classmethod
    def cpus(cls, cfg: PipelineConfig) -> float | None:
        """CPUs for this run's Ray task (and its torch threads); default ``num_cpus``."""
        return cls.num_cpus

    @classmethod
    def gpu_key(cls, cfg: PipelineConfig) -> str | None:
        """The config key that gives this run's task one GPU (named when no node has one):
        :attr:`gpu_flag` when it is true; None: a CPU task."""
        if cls.gpu_flag is None:
            return None
        section, _, field = cls.gpu_flag.partition(".")
        return cls.gpu_flag if getattr(cfg.section(section), field) else None

    @classmethod
    def gpus(cls, cfg: PipelineConfig) -> float:
        """GPUs reserved for this run's Ray task: one when :meth:`gpu_key` names a key."""
        return 1.0 if cls.gpu_key(cfg) else 0.0

    @classmethod
    def workers(cls, cfg: PipelineConfig) -> tuple[Workers, ...]:
        """The Ray workers the stage starts besides its task (none by default)."""
        return ()

    @classmethod
    def gpu_footprint(cls, cfg: PipelineConfig) -> float:
        """GPUs the stage keeps busy: its task's plus every worker's it may start."""
        return cls.gpus(cfg) + sum(w.count * w.gpus for w in cls.workers(cfg))

    @classmethod
    def footprint(cls, cfg: PipelineConfig) -> float | None:
        """CPUs the stage keeps busy: its task's plus those of the workers it starts.

        The runner starts a stage beside others only while the footprints fit
        the cluster, so a stage that starts workers later (Ray Train) finds
        them free. None: the whole cluster (the stage runs alone).
        """
        return cls.cpus(cfg)


class RayTrainStage(Stage):
    """A stage whose work runs in a Ray Train worker group of config section :attr:`train_section`
    (train, premium): ``num_workers`` x ``cpus_per_worker``, all started together, one GPU
    each with ``use_gpu`` (its ScalingConfig). The task itself only orchestrates, except in
    local mode (``num_workers`` 0), where it trains on ``cpus_per_worker`` and starts none."""

    train_section: ClassVar[str] = ""
    num_cpus = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.cpu_key = f"{cls.train_section}.cpus_per_worker"

    @classmethod
    def cpus(cls, cfg: PipelineConfig) -> float | None:
        section = cfg.section(cls.train_section)
        return section.cpus_per_worker if section.num_workers == 0 else 0

    @classmethod
    def workers(cls, cfg: PipelineConfig) -> tuple[Workers, ...]:
        section = cfg.section(cls.train_section)
        n, gpus = section.num_workers, 1.0 if section.use_gpu else 0.0
        key = f"{cls.train_section}.num_workers"
        return (
            (Workers("Ray Train workers", n, float(section.cpus_per_worker), gpus, n, key),)
            if n
            else ()
        )

    @classmethod
    def footprint(cls, cfg: PipelineConfig) -> float | None:
        section = cfg.section(cls.train_section)
        return max(1, section.num_workers) * section.cpus_per_worker
