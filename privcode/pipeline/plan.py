"""``privcode plan``: what a config will ask of a cluster, without running any model.
Design notes: docs/kubernetes.md, "privcode/pipeline/plan.py".

For every stage of ``run.stages`` (and the stages they need), a :class:`Plan` lists its Ray
task's resources, the workers it starts
(:meth:`Stage.workers <privcode.pipeline.stage.Stage.workers>`) and whether the cluster,
connected or described (``--node CPU=8,GPU=1,count=8``), places them
(:mod:`privcode.pipeline.placement`). For the train stage, from the record count N:
``q = B / N``, sigma (configured, or :func:`~privcode.train.noise.noise_for` for ``epsilon``
over ``steps``), the epsilon that sigma spends at ``delta``, and :class:`MemoryEstimate`, from
the base model's ``config.json`` alone.

Nothing here reads a private record: N is a count the release publishes anyway.

"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts import StageManifest
from privcode.config import PipelineConfig
from privcode.errors import PrivcodeError
from privcode.layout import RunLayout
from privcode.pipeline.placement import (
    Node,
    PlacementError,
    cluster_nodes,
    describe_nodes,
    place,
    stage_bundles,
    stage_resources,
)
from privcode.pipeline.runner import _with_dependencies
from privcode.pipeline.stage import Workers
from privcode.pipeline.stages import STAGES
from privcode.registry import METHODS

__all__ = [
    "MemoryEstimate",
    "Plan",
    "PrivacyPlan",
    "StagePlan",
    "estimate_dp_memory",
    "parse_node",
    "plan_pipeline",
]

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class StagePlan:
    """One stage: its task's resources, the workers it starts, whether the cluster places them.

    ``num_cpus`` None: the task takes a whole node, whose size only a cluster tells.
    ``placeable`` None: no cluster to check against; False: ``problem`` says why.
    """

    stage: str
    num_cpus: float | None
    num_gpus: float
    workers: tuple[Workers, ...]
    placeable: bool | None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "workers": [w.to_json() for w in self.workers]}


@dataclass(frozen=True)
class PrivacyPlan:
    """The train stage's DP-SGD plan: ``q = B / N``, sigma, and the epsilon it spends."""

    records: int
    expected_batch_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    calibrated: bool
    epsilon: float
    delta: float
    accountant: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-worker memory of the junior's DP-SGD step: an ESTIMATE from the model's shapes.

    Bytes, for micro-batch ``b``, sequence ``T`` (with a latent prefix's virtual tokens),
    vocabulary ``V``, hidden ``H``, KV width ``k d``, MLP width ``I``, ``L`` layers:
    ``weights`` = params x 2 (bfloat16) or x 4 (float32), the reference model counted once;
    ``optimizer`` = trainable x 16 (fp32 value, gradient, AdamW's two moments);
    ``per_record_grads`` = trainable x 4 x b; ``logits`` = b x T x V x 4, twice with the
    syntax-aware KL; ``activations`` = (6H + 2 k d + 4I) x b T L values in the forward dtype,
    with gradient checkpointing H x b T L plus one layer's full set. Some terms are left out:
    plan for 20-30% more than ``total_bytes`` (docs/kubernetes.md, "privcode/pipeline/plan.py").
    """

    model: str
    dtype: str
    params: int
    trainable_params: int
    micro_batch: int
    sequence: int
    vocab_size: int
    gradient_checkpointing: bool
    weights_bytes: int
    optimizer_bytes: int
    per_record_grads_bytes: int
    logits_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.optimizer_bytes
            + self.per_record_grads_bytes
            + self.logits_bytes
            + self.activations_bytes
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class Plan:
    """What ``privcode plan`` prints: stages, the train stage's privacy and memory, notes."""

    config: str
    cluster: str
    stages: tuple[StagePlan, ...]
    privacy: PrivacyPlan | None
    memory: MemoryEstimate | None
    notes: tuple[str, ...] = field(default=())

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.stage == name)

    @property
    def placeable(self) -> bool | None:
        """True when every stage can be placed; None without a cluster to check against."""
        verdicts = [s.placeable for s in self.stages]
        return None if None in verdicts else all(verdicts)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "cluster": self.cluster,
            "placeable": self.placeable,
            "stages": [s.to_json() for s in self.stages],
            "privacy": asdict(self.privacy) if self.privacy else None,
            "memory": self.memory.to_json() if self.memory else None,
            "notes": list(self.notes),
        }

    def format(self) -> str:
        lines = [f"plan of {self.config}", f"cluster: {self.cluster}", ""]
        for s in self.stages:
            cpus = "a whole node" if s.num_cpus is None else f"{s.num_cpus:g} CPU"
            task = f"task {cpus}" + (f", {s.num_gpus:g} GPU" if s.num_gpus else "")
            verdict = {None: "?", True: "fits", False: "DOES NOT FIT"}[s.placeable]
            lines.append(f"  {s.stage:<8} {verdict:<13} {task}")
            for w in s.workers:
                gpu = f", {w.gpus:g} GPU" if w.gpus else ""
                lines.append(
                    f"  {'':<8} {'':<13} + {w.kind}: {w.count} x ({w.cpus:g} CPU{gpu}), "
                    f"{w.required} at once ({w.key})"
                )
            if s.problem:
                lines.append(f"  {'':<8} {'':<13} ! {s.problem}")
        p = self.privacy
        if p:
            how = "calibrated" if p.calibrated else "configured"
            lines += [
                "",
                f"train DP-SGD: N {p.records:,}, B {p.expected_batch_size}, q = B/N = "
                f"{p.sample_rate:.5f}, {p.steps} steps, sigma {p.noise_multiplier:.4f} ({how}) "
                f"-> epsilon {p.epsilon:.3f} ({p.accountant}, delta {p.delta:g})",
            ]
        m = self.memory
        if m:
            lines += [
                "",
                f"train memory per worker (ESTIMATE, {m.model}: {m.params / 1e9:.2f}B params "
                f"in {m.dtype}, {m.trainable_params / 1e6:.1f}M trainable, micro-batch "
                f"{m.micro_batch} x {m.sequence} tokens, V {m.vocab_size:,}):",
                f"  weights {m.weights_bytes / GB:.2f} GB, trainable+AdamW "
                f"{m.optimizer_bytes / GB:.2f} GB, per-record grads "
                f"{m.per_record_grads_bytes / GB:.2f} GB, logits {m.logits_bytes / GB:.2f} GB, "
                f"activations {m.activations_bytes / GB:.2f} GB"
                + (" (checkpointed)" if m.gradient_checkpointing else ""),
                f"  total about {m.total_bytes / GB:.1f} GB (plan for 20-30% more)",
            ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def parse_node(spec: str) -> list[dict[str, Any]]:
    """``"CPU=8,GPU=1,count=2"`` -> two ``ray.nodes()``-style entries of that shape."""
    resources: dict[str, float] = {}
    count = 1
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not sep or number < 0:
            raise PrivcodeError(f"--node {spec!r}: {part!r} is not RESOURCE=NUMBER (e.g. CPU=8)")
        if key == "count":
            count = int(number)
        else:
            resources[key] = number
    return [{"Alive": True, "Resources": dict(resources)} for _ in range(count)]


def _train_records(cfg: PipelineConfig) -> int | None:

    manifest = StageManifest.find(RunLayout.of(cfg).stage("data"))
    counts = (manifest.summary.get("counts") or {}) if manifest else {}
    n = counts.get("train_records")
    return int(n) if n else None


def privacy_plan(cfg: PipelineConfig, records: int) -> PrivacyPlan:
    """q = B / N, sigma (configured or calibrated) and the epsilon of ``steps`` such steps."""
    from privcode.dp.accounting import DPEvent, epsilon
    from privcode.train.noise import noise_for

    t = cfg.train
    if records < 1:
        raise PrivcodeError(f"--records {records}: the train stage needs at least one record")
    q = min(1.0, t.expected_batch_size / records)
    sigma, calibrated = noise_for(t, q)
    eps = epsilon(DPEvent(sigma, q, t.steps), t.delta, t.accountant)
    return PrivacyPlan(
        records, t.expected_batch_size, q, t.steps, sigma, calibrated, eps, t.delta, t.accountant
    )


def _model_dir(cfg: PipelineConfig) -> Path | None:
    if cfg.base.model and (Path(cfg.base.model).expanduser() / "config.json").is_file():
        return Path(cfg.base.model).expanduser()

    manifest = StageManifest.find(RunLayout.of(cfg).stage("base"))
    path = Path(str((manifest.summary if manifest else {}).get("path", "")))
    return path if (path / "config.json").is_file() else None


def estimate_dp_memory(cfg: PipelineConfig, model_dir: str | Path) -> MemoryEstimate:
    """:class:`MemoryEstimate` of the train stage's DP step on the model of ``model_dir``
    (its ``config.json`` only: the model is built on the meta device, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from privcode.models.loading import lora_target_modules
    from privcode.train.privlc import CodeEncoder, PromptEncoder, make_prefix_decoder

    t = cfg.train
    mc = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc)
    params = sum(p.numel() for p in model.parameters())
    targets = set(lora_target_modules(model))
    lora = sum(
        t.lora_r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    method = METHODS[t.method]
    h = int(mc.hidden_size)
    width = t.encoder_hidden or h
    privlc: list[torch.nn.Module] = []
    with torch.device("meta"):
        if method.latent is not None:
            privlc.append(make_prefix_decoder(t.latent_dim, t.num_virtual_tokens, h, 0.02))
        if method.latent == "code":
            privlc.append(CodeEncoder(h, width, t.latent_dim))
        if method.latent == "prompt" or method.align:
            privlc.append(PromptEncoder(h, width, t.latent_dim))
    trainable = lora
    if not method.pretrain_public:  # pc-preemb: PrivLC frozen during DP training
        trainable += sum(p.numel() for m in privlc for p in m.parameters())
    dtype = t.dtype if t.dtype != "auto" else ("bfloat16" if t.use_gpu else "float32")
    width_bytes = _BYTES[dtype]
    b = t.micro_batch_size or max(1, -(-t.expected_batch_size // max(1, t.num_workers)))
    seq = t.max_length + (t.num_virtual_tokens if method.latent is not None else 0)
    vocab, layers = int(mc.vocab_size), int(mc.num_hidden_layers)
    heads = int(mc.num_attention_heads)
    kv = int(getattr(mc, "num_key_value_heads", None) or heads) * (
        int(getattr(mc, "head_dim", None) or h // heads)
    )
    inter = int(getattr(mc, "intermediate_size", 4 * h))
    per_layer = 6 * h + 2 * kv + 4 * inter  # values per token kept for backward
    if t.gradient_checkpointing:
        act = b * seq * (layers * h + per_layer) * width_bytes
    else:
        act = b * seq * layers * per_layer * width_bytes
    models = 2 if method.ast is not None else 1  # the reference's logits for the KL term
    return MemoryEstimate(
        model=str(model_dir),
        dtype=dtype,
        params=int(params),
        trainable_params=int(trainable),
        micro_batch=int(b),
        sequence=int(seq),
        vocab_size=vocab,
        gradient_checkpointing=bool(t.gradient_checkpointing),
        weights_bytes=int(params * width_bytes),
        optimizer_bytes=int(trainable * 16),
        per_record_grads_bytes=int(trainable * 4 * b),
        logits_bytes=int(b * seq * vocab * 4 * models),
        activations_bytes=int(act),
    )


def _stage_plan(name: str, cfg: PipelineConfig, nodes: Sequence[Node] | None) -> StagePlan:
    stage = STAGES[name]
    workers = stage.workers(cfg)
    if nodes is None:
        return StagePlan(name, stage.cpus(cfg), stage.gpus(cfg), workers, None)
    try:
        task = stage_resources(stage, cfg, nodes)
    except PlacementError as exc:
        return StagePlan(name, stage.cpus(cfg), stage.gpus(cfg), workers, False, str(exc))
    cpus, gpus = task["num_cpus"], task["num_gpus"]
    if place(stage_bundles(stage, cfg, nodes), nodes):
        return StagePlan(name, cpus, gpus, workers, True)
    need = ", ".join(f"{w.required} x ({w.cpus:g} CPU, {w.gpus:g} GPU) ({w.key})" for w in workers)
    problem = f"its task and the workers it needs at once ({need}) do not fit these nodes together"
    return StagePlan(name, cpus, gpus, workers, False, problem)


def _path_notes(cfg: PipelineConfig, names: Sequence[str]) -> list[str]:
    paths: list[tuple[str, str]] = []
    if "data" in names and cfg.data.source == "ingest":
        paths += [("data.inputs", p) for p in cfg.data.inputs]
    if cfg.base.model:
        paths.append(("base.model", cfg.base.model))
    if "premium" in names and cfg.premium.model:
        paths.append(("premium.model", cfg.premium.model))
    return [
        f"{key}: {p} does not exist here (it must on the cluster's nodes)"
        for key, p in paths
        if p.startswith(("/", "~", ".")) and not Path(p).expanduser().exists()
    ]


def plan_pipeline(
    cfg: PipelineConfig,
    nodes: Sequence[Node] | None = None,
    records: int | None = None,
    stages: Sequence[str] | None = None,
) -> Plan:
    """The :class:`Plan` of ``stages`` (default ``run.stages``, with what they need).

    ``nodes``: a ``ray.nodes()``-style list; None: the connected cluster's when Ray is
    initialized in this process (:func:`~privcode.pipeline.placement.cluster_nodes`),
    else no placement check. ``records``: the training set's N (default: the data
    stage's manifest count, if there is one); without it, no privacy plan.
    """

    if nodes is None and "ray" in sys.modules and sys.modules["ray"].is_initialized():
        nodes = cluster_nodes()
    names = _with_dependencies(list(stages or cfg.run.stages))
    plans = tuple(_stage_plan(n, cfg, nodes) for n in names)
    notes = _path_notes(cfg, names)
    privacy = memory = None
    if "train" in names:
        n = records if records is not None else _train_records(cfg)
        if n is None:
            notes.append("no record count: pass --records N for q, sigma and epsilon")
        else:
            privacy = privacy_plan(cfg, n)
        model = _model_dir(cfg)
        if model is None:
            notes.append("no base model config.json found (base.model): no memory estimate")
        else:
            memory = estimate_dp_memory(cfg, model)
    cluster = "none given (no placement check)" if nodes is None else describe_nodes(nodes)
    return Plan(cfg.source or "<config>", cluster, plans, privacy, memory, tuple(notes))
