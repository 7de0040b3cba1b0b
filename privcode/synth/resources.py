"""Ray resources of Stage II's filter actors (torch- and Ray-free: the stage planner reads it).

One actor each: the extractor, the execution filter (the sandbox pool) and
the round trip. An actor running an LLM (:func:`llm_filters`: the extractor
with ``extractor=hf``, the round trip with ``summarizer=hf`` or
``scorer=bertscore``) gets ``synth.filter_cpus`` / ``synth.filter_gpus``,
and its models load on its GPU in ``synth.dtype``
(:mod:`privcode.synth.operators`); the others keep small CPU shares.
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
    "filter_footprint",
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

    An LLM-filter actor (:func:`llm_filters`) gets ``synth.filter_cpus`` CPUs
    (0: its built-in share) and ``synth.filter_gpus`` GPUs; the others keep
    their small CPU shares and no GPU.
    """
    shares = {"extract": EXTRACT_CPUS, "execution": EXECUTION_CPUS, "roundtrip": ROUNDTRIP_CPUS}
    gpus = {"num_gpus": float(cfg.filter_gpus)} if cfg.filter_gpus > 0 else {}
    return {
        name: {"num_cpus": cfg.filter_cpus or shares[name], **gpus}
        if llm
        else {"num_cpus": shares[name]}
        for name, llm in llm_filters(cfg).items()
    }


def filter_footprint(cfg: SynthConfig) -> tuple[float, float]:
    """(CPUs, GPUs) the filter actors hold together (one actor each)."""
    opts = filter_actor_options(cfg).values()
    return sum(o["num_cpus"] for o in opts), sum(o.get("num_gpus", 0.0) for o in opts)


def llm_placement(cfg: SynthConfig) -> dict[str, Any]:
    """What an LLM-filter actor resolves its device and dtype from (in the actor)."""
    return {"gpu": cfg.filter_gpus > 0, "dtype": cfg.dtype, "key": "synth.filter_gpus"}
