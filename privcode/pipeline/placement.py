"""Where a stage's Ray task and workers can run: what ONE node gives, never the cluster's sum.
Design notes: docs/kubernetes.md, "privcode/pipeline/placement.py".

A Ray task runs on one node, so a request larger than every node waits forever.
:func:`stage_resources` turns a stage's request (:meth:`Stage.cpus`, :meth:`Stage.gpus`) into
its task's options: ``num_cpus`` its own number, or for a whole-node stage (``cpus`` None) the
most CPUs of one node that can also give its GPUs (a CPU-only stage: of the largest node
without a GPU, where there is one); ``num_gpus`` 1 when its ``use_gpu`` key is true, else 0. A
request no node can meet is a :class:`PlacementError` naming the key, before anything runs.
:func:`cluster_nodes` is ``ray.nodes()`` plus the node groups an autoscaler may still start;
:func:`place` packs a stage's bundles first-fit decreasing by (GPUs, CPUs): a heuristic
(exact for equal-sized bundles) that assumes an otherwise idle cluster.

"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from privcode.config import PipelineConfig
from privcode.errors import PrivcodeError
from privcode.pipeline.stage import Stage

__all__ = [
    "PlacementError",
    "cluster_nodes",
    "describe_nodes",
    "largest_node_cpus",
    "place",
    "stage_bundles",
    "stage_resources",
]

_EPS = 1e-9
#: Nodes counted per autoscaler group with no upper bound (``max_count`` -1).
UNBOUNDED_GROUP = 64

Node = Mapping[str, Any]


class PlacementError(PrivcodeError):
    """A stage asks for more than any node of the cluster can give; names the config key."""


def _alive(nodes: Sequence[Node]) -> list[Mapping[str, float]]:
    return [n.get("Resources") or {} for n in nodes if n.get("Alive")]


def _has(resources: Mapping[str, float], key: str) -> float:
    return float(resources.get(key, 0.0))


def largest_node_cpus(nodes: Sequence[Node], gpus: float = 0.0) -> float:
    """The most CPUs one alive node holds (among those with ``gpus`` GPUs): a single task can
    never use more, and asking for more (all the cluster's CPUs, spread over nodes) would
    wait forever where no one node holds them."""
    return max(
        (_has(r, "CPU") for r in _alive(nodes) if _has(r, "GPU") >= gpus - _EPS), default=0.0
    )


def describe_nodes(nodes: Sequence[Node]) -> str:
    """``"1 x {CPU 0}, 2 x {CPU 1}, up to 8 more x {CPU 8, GPU 1}"``: the shapes of ``nodes``."""
    now: Counter[str] = Counter()
    more: Counter[str] = Counter()
    for n in nodes:
        if not n.get("Alive"):
            continue
        r = n.get("Resources") or {}
        shape = ", ".join(f"{k} {_has(r, k):g}" for k in ("CPU", "GPU") if k == "CPU" or k in r)
        if "MaxCount" in n:
            more[shape] += int(n["MaxCount"]) if n["MaxCount"] >= 0 else UNBOUNDED_GROUP
        else:
            now[shape] += 1
    parts = [f"{c} x {{{s}}}" for s, c in sorted(now.items())]
    parts += [f"up to {c} more x {{{s}}} (autoscaler)" for s, c in sorted(more.items())]
    return ", ".join(parts) or "no alive node"


def stage_resources(
    stage: type[Stage], cfg: PipelineConfig, nodes: Sequence[Node]
) -> dict[str, float]:
    """``{"num_cpus", "num_gpus"}`` of ``stage``'s Ray task on the cluster of ``nodes``.

    Pure: ``nodes`` is a ``ray.nodes()`` list (module docstring).
    :class:`PlacementError` when no single node can give the request.
    """
    gpus = float(stage.gpus(cfg))
    want = stage.cpus(cfg)
    where = " with a GPU" if gpus else ""
    if gpus and not any(_has(r, "GPU") >= gpus - _EPS for r in _alive(nodes)):
        key = stage.gpu_key(cfg)
        raise PlacementError(
            f"the {stage.name} stage's task asks for {gpus:g} GPU ({key} is true), but no node "
            f"of this Ray cluster has one ({describe_nodes(nodes)}): add GPU nodes (the "
            f"chart's workerGroups.gpu) or set {key}=false"
        )
    most = largest_node_cpus(nodes, gpus)
    if want is None and not gpus:
        cpu_only = [_has(r, "CPU") for r in _alive(nodes) if _has(r, "GPU") <= 0]
        most = max(cpu_only, default=0.0) or most
    if want is None:
        if most <= 0:
            raise PlacementError(
                f"the {stage.name} stage takes every CPU of one node, but no node{where} of this "
                f"Ray cluster has a CPU ({describe_nodes(nodes)})"
            )
        want = most
    elif want > most + _EPS:
        key = stage.cpu_key or f"the {stage.name} stage's fixed request"
        raise PlacementError(
            f"the {stage.name} stage's task asks for {want:g} CPUs ({key}), more than any "
            f"node{where} of this Ray cluster has (largest: {most:g}; {describe_nodes(nodes)}): "
            "a task runs on one node; lower it or add a larger node"
        )
    return {"num_cpus": float(want), "num_gpus": gpus}


def stage_bundles(
    stage: type[Stage], cfg: PipelineConfig, nodes: Sequence[Node], *, every_worker: bool = False
) -> list[tuple[float, float]]:
    """(CPUs, GPUs) of the stage's task and of the workers it needs at once (``required``;
    ``every_worker``: all ``count`` of them)."""
    task = stage_resources(stage, cfg, nodes)
    bundles = [(task["num_cpus"], task["num_gpus"])]
    for w in stage.workers(cfg):
        bundles += [(float(w.cpus), float(w.gpus))] * (w.count if every_worker else w.required)
    return bundles


def place(bundles: Sequence[tuple[float, float]], nodes: Sequence[Node]) -> bool:
    """Whether every (CPUs, GPUs) bundle fits the nodes at once (first-fit decreasing).

    An autoscaler group (``MaxCount``) counts as that many nodes of its shape.
    """
    free: list[list[float]] = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        r = n.get("Resources") or {}
        count = int(n.get("MaxCount", 1))
        free += [
            [_has(r, "CPU"), _has(r, "GPU")] for _ in range(UNBOUNDED_GROUP if count < 0 else count)
        ]
    for cpus, gpus in sorted(bundles, key=lambda b: (b[1], b[0]), reverse=True):
        for slot in free:
            if slot[0] >= cpus - _EPS and slot[1] >= gpus - _EPS:
                slot[0] -= cpus
                slot[1] -= gpus
                break
        else:
            return False
    return True


def cluster_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()`` of the connected cluster, plus one entry per autoscaler node group.

    The groups come from the autoscaler's cluster config in the GCS (KubeRay's
    autoscaler v2 publishes it; Ray Train reads the same to check worker
    groups); none without an autoscaler, or where Ray offers no such config.
    """
    import ray

    nodes = [dict(n) for n in ray.nodes()]
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001 - an internal API: without it, the nodes there are now
        config = None
    for group in getattr(config, "node_group_configs", None) or ():
        if group.max_count != 0 and group.resources:
            resources = {k: float(v) for k, v in group.resources.items()}
            nodes.append(
                {
                    "Alive": True,
                    "Resources": resources,
                    "NodeGroup": group.name,
                    "MaxCount": group.max_count,
                }
            )
    return nodes
