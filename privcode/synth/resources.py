"""Ray resources of Stage II's filter actors (torch- and Ray-free: the stage planner reads it).

Each filter is an autoscaling actor pool (:func:`filter_pools`: ``synth.extractors_*``,
``executors_*``, ``scorers_*``) with its own CPUs (``synth.extract_cpus``,
``execution_cpus``, ``roundtrip_cpus``) and batch size (:func:`filter_batch_sizes`). An
actor running an LLM (:func:`llm_filters`: the extractor with ``extractor=hf``, the round
trip with ``summarizer=hf`` or ``scorer=bertscore``) gets ``synth.filter_gpus`` GPUs and
(unless its own CPUs are set) ``synth.filter_cpus``, and its models load on its GPU in
``synth.dtype`` (:mod:`privcode.synth.operators`); the others keep small CPU shares.
"""

from __future__ import annotations

from typing import Any

from privcode.config import SynthConfig

__all__ = [
    "EXECUTION_CPUS",
    "EXTRACT_CPUS",
    "FILTER_CPUS",
    "ROUNDTRIP_CPUS",
    "auto_sized",
    "filter_actor_options",
    "filter_batch_sizes",
    "filter_footprint",
    "filter_pools",
    "llm_filters",
    "llm_placement",
]

#: CPUs Ray reserves for the filter actors (extract, execution, round trip), one each,
#: when none of them runs an LLM (then ``synth.filter_cpus``/``filter_gpus``: see
#: :func:`filter_actor_options`).
EXTRACT_CPUS, EXECUTION_CPUS, ROUNDTRIP_CPUS = 0.1, 0.2, 0.2
FILTER_CPUS = EXTRACT_CPUS + EXECUTION_CPUS + ROUNDTRIP_CPUS


def llm_filters(cfg: SynthConfig) -> dict[str, bool]:
    """Which filter actors run a model worth a GPU: the extractor with ``extractor=hf``,
    the round trip with ``summarizer=hf`` or ``scorer=bertscore``."""
    return {
        "extract": cfg.extractor == "hf",
        "execution": False,
        "roundtrip": cfg.summarizer == "hf" or cfg.scorer == "bertscore",
    }


def filter_actor_options(cfg: SynthConfig) -> dict[str, dict[str, float]]:
    """Ray resources of each filter actor (``extract``, ``execution``, ``roundtrip``).

    Its own ``synth.<filter>_cpus`` when set; else an LLM-filter actor (:func:`llm_filters`)
    gets ``synth.filter_cpus`` (0: its built-in share), the others their small built-in
    shares. LLM-filter actors get ``synth.filter_gpus`` GPUs, the others none.
    """
    shares = {"extract": EXTRACT_CPUS, "execution": EXECUTION_CPUS, "roundtrip": ROUNDTRIP_CPUS}
    own = {
        "extract": cfg.extract_cpus,
        "execution": cfg.execution_cpus,
        "roundtrip": cfg.roundtrip_cpus,
    }
    gpus = {"num_gpus": float(cfg.filter_gpus)} if cfg.filter_gpus > 0 else {}
    out = {}
    for name, llm in llm_filters(cfg).items():
        cpus = own[name] or (cfg.filter_cpus if llm else 0.0) or shares[name]
        out[name] = {"num_cpus": cpus, **(gpus if llm else {})}
    return out


def filter_pools(
    cfg: SynthConfig, cluster: dict[str, float] | None = None
) -> dict[str, tuple[int, int]]:
    """(fewest, most) actors of each filter's autoscaling pool.

    A most of 0 (the default) is sized from ``cluster`` (``ray.cluster_resources()`` when
    the run starts): one actor per CPU of the cluster, and per GPU for an actor that holds
    GPUs, at least the fewest. Without ``cluster`` (the planner, before the run) it counts
    as the fewest: :func:`auto_sized` pools grow into whatever the cluster has.
    """
    opts = filter_actor_options(cfg)
    pools = {}
    for name, (low, high) in {
        "extract": (cfg.extractors_min, cfg.extractors_max),
        "execution": (cfg.executors_min, cfg.executors_max),
        "roundtrip": (cfg.scorers_min, cfg.scorers_max),
    }.items():
        if high == 0:
            high = low if cluster is None else _from_cluster(opts[name], cluster)
        pools[name] = (low, max(low, high))
    return pools


def _from_cluster(actor: dict[str, float], cluster: dict[str, float]) -> int:
    """One actor per CPU of ``cluster`` (whole CPUs: an actor's work is at least one core's),
    and no more than its GPUs hold when the actor takes GPUs."""
    count = int(cluster.get("CPU", 0.0) // max(1.0, actor["num_cpus"]))
    if actor.get("num_gpus"):
        count = min(count, int(cluster.get("GPU", 0.0) // actor["num_gpus"]))
    return count


def auto_sized(cfg: SynthConfig) -> list[str]:
    """The filter pools whose most is sized from the cluster (``synth.*_max`` 0)."""
    keys = {"extractors_max": "extract", "executors_max": "execution", "scorers_max": "roundtrip"}
    return [key for key in keys if getattr(cfg, key) == 0]


#: The round trip's default samples per call: it sorts a call's texts by length into
#: token-budget batches, so a larger call pads less (bench/bench_synth.py's canned rows on
#: one core: 64 pairs a call 64 samples/s, 512 pairs 86 samples/s).
ROUNDTRIP_BATCH = 512


def filter_batch_sizes(cfg: SynthConfig) -> dict[str, int]:
    """Samples per call of each filter; 0 in the config: as small as generation's, but at
    least 16 (the sandbox pool's parallelism), so rows reach the driver, and shards complete,
    at that granularity; the round trip's at least :data:`ROUNDTRIP_BATCH` (no larger than a
    shard) for its length-sorted batches."""
    default = max(cfg.batch_size, 16)
    return {
        "extract": cfg.extract_batch_size or default,
        "execution": cfg.execution_batch_size or default,
        "roundtrip": cfg.roundtrip_batch_size or max(default, min(ROUNDTRIP_BATCH, cfg.shard_size)),
    }


def filter_footprint(
    cfg: SynthConfig, cluster: dict[str, float] | None = None
) -> tuple[float, float]:
    """(CPUs, GPUs) the filter pools hold together at their largest (pools sized from the
    cluster: at their fewest without ``cluster``)."""
    opts, pools = filter_actor_options(cfg), filter_pools(cfg, cluster)
    cpus = sum(pools[n][1] * o["num_cpus"] for n, o in opts.items())
    return cpus, sum(pools[n][1] * o.get("num_gpus", 0.0) for n, o in opts.items())


def llm_placement(cfg: SynthConfig) -> dict[str, Any]:
    """What an LLM-filter actor resolves its device and dtype from (in the actor)."""
    return {"gpu": cfg.filter_gpus > 0, "dtype": cfg.dtype, "key": "synth.filter_gpus"}
