"""Stage II's Ray Data graph: sample indices -> Generate -> Extract -> ExecutionFilter ->
RoundTripScore, each operator an autoscaling actor pool (:mod:`privcode.synth.resources`).

The LLM filters run in their actor (``hf``), call an OpenAI-compatible endpoint
(``endpoint``: :mod:`privcode.synth.llm_endpoint`), or become Ray Data LLM processors on
vLLM engines (``vllm``: :mod:`privcode.synth.llm_stages`); :func:`build_dataset` wires
whichever the config names. The driver (:mod:`privcode.synth.pipeline`) consumes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privcode.config import SandboxConfig, SynthConfig
from privcode.data.public import public_prompts
from privcode.synth.llm_stages import apply_vllm_stage
from privcode.synth.resources import (
    filter_actor_options,
    filter_batch_sizes,
    filter_pools,
    llm_placement,
)

__all__ = ["build_dataset", "generator_options", "llm_options", "sandbox_limits"]

#: The columns a row holds after the execution filter (what a vLLM summariser stage keeps).
EXECUTED_COLUMNS = (
    "index",
    "z_seed",
    "code",
    "cond_prompt",
    "prompt",
    "exec_status",
    "exec_passed",
    "exec_seconds",
    "exec_error",
    "exec_isolation",
)


def _public_prompts(n: int, seed: int) -> list[str]:

    return public_prompts(max(1, min(n, 2000)), seed=seed)


def llm_options(cfg: SynthConfig, role: str) -> dict[str, Any]:
    """The options of the ``role`` (extractor, summarizer) model: its path (hf), or the
    endpoint's URL, model id, token variable and concurrency (endpoint)."""
    kind, model = getattr(cfg, role), getattr(cfg, f"{role}_model")
    if kind == "endpoint":
        from privcode.synth.llm_endpoint import endpoint_options

        return {**endpoint_options(cfg, model), "max_new_tokens": cfg.llm_max_new_tokens}
    if kind == "hf":
        return {"model": model, "max_new_tokens": cfg.llm_max_new_tokens} if model else {}
    return {}


def generator_options(cfg: SynthConfig) -> dict[str, Any]:
    """The options of :class:`~privcode.synth.operators.Generate` (sampling, placement)."""
    return {
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "start_text": cfg.start_text,
        "trim": cfg.trim,
        "gpu": cfg.gpus_per_generator > 0,
        "dtype": cfg.dtype,
    }


def sandbox_limits(cfg: SynthConfig) -> dict[str, Any]:
    """The execution filter's per-snippet limits (``SandboxLimits`` fields)."""
    return {
        "cpu_seconds": cfg.sandbox_cpu_seconds,
        "wall_seconds": cfg.sandbox_wall_seconds,
        "memory_mb": cfg.sandbox_memory_mb,
    }


def build_dataset(
    cfg: SynthConfig,
    release: Path,
    indices: list[int],
    conditioning: str,
    generator: type | None = None,
    sandbox: SandboxConfig | None = None,
):
    import ray.data
    from ray.data import ActorPoolStrategy

    gen_opts = generator_options(cfg)
    prompts = _public_prompts(len(indices), cfg.seed) if conditioning == "prompt" else []
    from privcode.synth.operators import ExecutionFilter, Extract, Generate, RoundTripScore

    blocks = max(1, min(len(indices) // max(cfg.batch_size, 1), 200))
    ds = ray.data.from_items(
        [{"index": i, "z_seed": f"{cfg.seed}:{i}"} for i in indices], override_num_blocks=blocks
    )
    ds = ds.map_batches(
        generator or Generate,
        fn_constructor_args=(str(release), gen_opts, prompts),
        batch_size=cfg.batch_size,
        batch_format="numpy",
        compute=ActorPoolStrategy(
            min_size=cfg.generators_min, max_size=max(cfg.generators_min, cfg.generators_max)
        ),
        num_cpus=cfg.cpus_per_generator,
        num_gpus=cfg.gpus_per_generator or None,
    )
    resources, sizes = filter_actor_options(cfg), filter_batch_sizes(cfg)
    pools = filter_pools(cfg, {k: float(v) for k, v in ray.cluster_resources().items()})

    def pool(name: str) -> ActorPoolStrategy:
        low, high = pools[name]
        return ActorPoolStrategy(min_size=low, max_size=high)

    if cfg.extractor == "vllm":  # vLLM engines on GPUs, a Ray Data LLM processor
        ds = apply_vllm_stage(ds, cfg, "extractor", ("index", "z_seed", "code", "cond_prompt"))
    else:
        ds = ds.map_batches(
            Extract,
            fn_constructor_args=(cfg.extractor, llm_options(cfg, "extractor"), llm_placement(cfg)),
            batch_size=sizes["extract"],
            batch_format="numpy",
            compute=pool("extract"),
            **resources["extract"],
        )
    sb = sandbox or SandboxConfig()
    limits = sandbox_limits(cfg)
    ds = ds.map_batches(
        ExecutionFilter,
        fn_constructor_args=(
            limits,
            cfg.sandbox_workers,
            sb.isolation,
            sb.executor,
            cfg.parse_check_languages,
        ),
        batch_size=sizes["execution"],
        batch_format="numpy",
        compute=pool("execution"),
        **resources["execution"],
    )
    if cfg.summarizer == "vllm":  # the summaries from vLLM engines; the round trip scores
        ds = apply_vllm_stage(ds, cfg, "summarizer", EXECUTED_COLUMNS)
    rt_opts = {f"summarizer_{k}": v for k, v in llm_options(cfg, "summarizer").items()}
    if cfg.scorer_model:
        rt_opts["scorer_model"] = cfg.scorer_model
    if cfg.scorer == "embedding":
        rt_opts["scorer_precision"] = cfg.scorer_precision
    ds = ds.map_batches(
        RoundTripScore,
        fn_constructor_args=(
            cfg.summarizer,
            cfg.scorer,
            cfg.roundtrip_threshold,
            rt_opts,
            llm_placement(cfg),
            max(1, int(resources["roundtrip"]["num_cpus"])),
        ),
        batch_size=sizes["roundtrip"],
        batch_format="numpy",
        compute=pool("roundtrip"),
        **resources["roundtrip"],
    )
    return ds
