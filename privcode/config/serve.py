"""The ``serve`` section: routes, client limits and PAC serving defaults of both serving apps.

One source for ``privcode serve`` and the Helm chart's RayService (tests/test_serve_config.py
renders the chart and compares its applications with these defaults). The PAC mechanism's
own numbers (``b``, ``top_k``, the session and deployment budgets) stay in the ``pac`` section,
which trains and evaluates the same worlds.
"""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt

ROUTE = r"/[A-Za-z0-9._~-]+(/[A-Za-z0-9._~-]+)*|/"
#: Where Ray Serve LLM can load LoRA adapters from at run time (its LoraConfig accepts no
#: local path): an object store.
LORA_STORE = r"((s3|gs|abfss|azure)://\S+)?"


@dataclass(frozen=True)
class ServeConfig:
    """Both serving apps (premium model, PAC ensemble): routes, keys, limits, PAC policy."""

    premium_route: str = opt(
        "/premium", "HTTP route prefix of the premium model's app.", pattern=ROUTE
    )
    pac_route: str = opt("/ensemble", "HTTP route prefix of the PAC ensemble's app.", pattern=ROUTE)
    api_keys_dir: str = opt(
        "",
        "Directory of API keys, one file per client (a mounted Kubernetes Secret: the file "
        "name is the client, its content the key). PRIVCODE_API_KEYS_DIR overrides; "
        "PRIVCODE_API_KEY adds one key for the client 'default'. Without any key the apps "
        "refuse to start (privcode serve --insecure-no-auth: loopback only).",
    )
    rate_limit_rps: float = opt(
        5.0,
        "Requests per second each API key may send (a token bucket per key); past it: 429 "
        "with Retry-After. Per replica.",
        min=0.001,
        max=1e6,
    )
    rate_limit_burst: int = opt(
        20, "Requests a key may send at once before its rate applies.", min=1, max=1_000_000
    )
    max_body_bytes: int = opt(
        1 << 20, "Largest request body (bytes); larger ones get 413.", min=1024, max=64 << 20
    )
    max_prompt_chars: int = opt(
        65_536,
        "Longest prompt (characters), refused before tokenisation; the model's context "
        "then bounds its tokens.",
        min=1,
        max=16 << 20,
    )
    fallback_context: int = opt(
        4096,
        "Context (prompt + completion tokens) assumed when the model's config states none.",
        min=16,
    )
    max_tokens_limit: int = opt(
        512, "Largest max_tokens of a premium completion.", min=1, max=1 << 16
    )
    max_batch_size: int = opt(
        8, "Premium requests batched into one generate call.", min=1, max=1024
    )
    engine: str = opt(
        "transformers",
        "What runs the premium model: transformers (one replica batching generate calls; "
        "CPU or GPU) or vllm (Ray Serve LLM: vLLM replicas on GPUs behind the same guarded "
        "routes; needs vLLM on every node, pip install 'privcode[vllm]'). With vllm the premium "
        "stage also writes merged/ (base + adapter, safetensors) for vLLM to load.",
        choices=("transformers", "vllm"),
    )
    vllm_tensor_parallel_size: int = opt(
        1, "engine vllm: GPUs each vLLM replica shards the model over.", min=1, max=64
    )
    vllm_gpu_memory_utilization: float = opt(
        0.9,
        "engine vllm: share of each GPU's memory vLLM may take (weights + KV cache).",
        min=0.05,
        max=0.99,
    )
    vllm_max_model_len: int = opt(
        0,
        "engine vllm: context (prompt + completion tokens) of a vLLM replica; 0: the model's.",
        min=0,
        max=1 << 20,
    )
    vllm_dtype: str = opt(
        "auto",
        "engine vllm: weight dtype (auto: the checkpoint's, bfloat16 for a merged premium model).",
        choices=("auto", "bfloat16", "float16"),
    )
    vllm_min_replicas: int = opt(
        1, "engine vllm: fewest vLLM replicas (autoscaled on ongoing requests).", min=0, max=1024
    )
    vllm_max_replicas: int = opt(1, "engine vllm: most vLLM replicas.", min=1, max=1024)
    vllm_accelerator_type: str = opt(
        "",
        "engine vllm: the GPU type each vLLM replica needs (Ray's accelerator_type, e.g. H100, "
        "A10G); empty: any GPU.",
    )
    vllm_lora_store: str = opt(
        "",
        "engine vllm: an object store (s3://, gs://, abfss://, azure://) holding the premium "
        "adapter as <store>/<served_model_name>/: vLLM then serves the base model with the "
        "adapter loaded per request (multi-LoRA, several premium models on one base). Empty: "
        "vLLM loads the release's merged/ checkpoint (a PVC works).",
        pattern=LORA_STORE,
    )
    pac_max_tokens_limit: int = opt(
        256, "Largest max_tokens of a PAC completion.", min=1, max=1 << 16
    )
    pac_max_batch: int = opt(
        8,
        "PAC completions decoded together, one forward per token for all of them (requests "
        "of different sessions; one session's requests run one after another); more queue.",
        min=1,
        max=256,
    )
    pac_decoder: str = opt(
        "gumbel",
        "How the served worlds vote: gumbel (requests with temperature > 0 by coupled Gumbel "
        "votes, temperature 0 greedily) or greedy (every request greedily).",
        choices=("gumbel", "greedy"),
    )
    pac_scope: str = opt(
        "deployment",
        "deployment: one posterior shared by every session (the bound covers everything "
        "released). session: one per session; the bound holds per session only and NOT "
        "against a client opening several sessions: needs pac_acknowledge_session_scope.",
        choices=("deployment", "session"),
    )
    pac_acknowledge_session_scope: bool = opt(
        False, "Required for pac_scope: session (its bound does not hold across sessions)."
    )
    pac_session_ttl_s: float = opt(
        900.0,
        "A PAC session idle this long expires: its slot is freed, its charges stay spent.",
        min=1.0,
        max=30 * 86400.0,
    )
    pac_max_sessions: int = opt(
        4096, "Open PAC sessions of the deployment, all keys together.", min=1, max=1 << 20
    )
    pac_max_sessions_per_key: int = opt(
        16, "Open PAC sessions one API key may hold.", min=1, max=1 << 20
    )
    pac_key_budget_share: float = opt(
        0.25,
        "Share of the PAC deployment budget one API key may spend (all its sessions, one-shot "
        "requests and restarts together), so one client cannot spend everyone's.",
        min=1e-9,
        max=1.0,
    )
    pac_on_exhausted: str = opt(
        "error",
        "When a budget (session, key or deployment) cannot pay for a private token: error "
        "(429 privacy_budget_exhausted; a completion already under way ends there) or "
        "fallback (the public base model's tokens, flagged in every response and counted in "
        "privcode_pac_fallback_tokens).",
        choices=("error", "fallback"),
    )

    def cross_check(self) -> tuple[str, str] | None:
        if self.pac_scope == "session" and not self.pac_acknowledge_session_scope:
            return (
                "pac_scope",
                "'session' bounds each session alone, not a client opening several: set "
                "serve.pac_acknowledge_session_scope: true to accept that",
            )
        if self.pac_max_sessions_per_key > self.pac_max_sessions:
            return ("pac_max_sessions_per_key", "is larger than serve.pac_max_sessions")
        if self.vllm_min_replicas > self.vllm_max_replicas:
            return ("vllm_min_replicas", "is larger than serve.vllm_max_replicas")
        if self.premium_route == self.pac_route:
            return ("pac_route", "must differ from serve.premium_route")
        return None
