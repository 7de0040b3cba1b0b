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


def filter_pools(cfg: SynthConfig) -> dict[str, tuple[int, int]]:
    """(fewest, most) actors of each filter's autoscaling pool."""
    return {
        "extract": (cfg.extractors_min, max(cfg.extractors_min, cfg.extractors_max)),
        "execution": (cfg.executors_min, max(cfg.executors_min, cfg.executors_max)),
        "roundtrip": (cfg.scorers_min, max(cfg.scorers_min, cfg.scorers_max)),
    }


def filter_batch_sizes(cfg: SynthConfig) -> dict[str, int]:
    """Samples per call of each filter; 0 in the config: as small as generation's, but at
    least 16 (the sandbox pool's parallelism), so rows reach the driver, and shards complete,
    at that granularity."""
    default = max(cfg.batch_size, 16)
    return {
        "extract": cfg.extract_batch_size or default,
        "execution": cfg.execution_batch_size or default,
        "roundtrip": cfg.roundtrip_batch_size or default,
    }


def filter_footprint(cfg: SynthConfig) -> tuple[float, float]:
    """(CPUs, GPUs) the filter pools hold together at their largest."""
    opts, pools = filter_actor_options(cfg), filter_pools(cfg)
    cpus = sum(pools[n][1] * o["num_cpus"] for n, o in opts.items())
    return cpus, sum(pools[n][1] * o.get("num_gpus", 0.0) for n, o in opts.items())


def llm_placement(cfg: SynthConfig) -> dict[str, Any]:
    """What an LLM-filter actor resolves its device and dtype from (in the actor)."""
    return {"gpu": cfg.filter_gpus > 0, "dtype": cfg.dtype, "key": "synth.filter_gpus"}
