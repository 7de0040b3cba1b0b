"""The premium model on vLLM (``serve.engine: vllm``): Ray Serve LLM behind privcode's own routes.

``privcode.serve.premium:app`` with ``engine: vllm`` builds this app: the same ingress
(``PremiumServer``), routes, schema, keys, limits and request checks as the transformers engine
(:func:`privcode.serve.premium.build_api`), forwarding each checked request through a
deployment handle to a Ray Serve LLM ``LLMServer`` (vLLM, on GPUs). Ray's own OpenAI app has no
authentication and no limits, so it is not used. vLLM loads the release's ``merged/``
checkpoint (:func:`privcode.models.artifacts.export_merged`, written here if missing), or with
``vllm_lora_store`` the base plus the adapter from an object store. The ingress tokenises and
checks each prompt against the context and sends vLLM the token ids, so what was checked is
what runs. Requests and answers cross the handle as plain dicts (:func:`engine_payload`,
:func:`completion_from`): only the vLLM replicas need vLLM (:mod:`privcode.serve.vllm_server`);
without it installed the builder refuses to start.
Details: docs/serving.md, "Engines: transformers and vLLM".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from privcode.artifacts import ArtifactError
from privcode.artifacts.premium import PremiumRecord
from privcode.serve.api import RequestError
from privcode.serve.args import REPLICA_OPTIONS, as_args, guard_limits
from privcode.serve.premium import (
    Completion,
    Prepared,
    ServeArgs,
    ServeError,
    build_api,
    check_release_privacy,
    parse_args,
    prepare_request,
)

__all__ = [
    "BASE_ID_SUFFIX",
    "EngineFront",
    "PremiumLLMServer",
    "build_app",
    "completion_from",
    "engine_payload",
    "llm_config",
    "model_source",
    "require_vllm",
]

log = logging.getLogger("privcode.serve")
_serve_log = logging.getLogger("ray.serve")

#: With a LoRA store, vLLM's base model is served as ``<served_model_name><suffix>`` and the
#: premium model as ``<that>:<served_model_name>`` (Ray Serve LLM's multiplexed LoRA ids).
BASE_ID_SUFFIX = "-base"
_VLLM_MISSING = (
    "serve.engine 'vllm' needs vLLM on every node of the Ray cluster: pip install "
    "'privcode[vllm]' (vLLM through ray[llm]; the chart's image must have it); without a "
    "GPU cluster use engine 'transformers'"
)


# --------------------------------------------------------------------------- configuration


def _release_record(release: Path) -> Mapping[str, Any]:

    try:
        return PremiumRecord.read(release / PremiumRecord.FILE).to_json()
    except ArtifactError as exc:
        raise ServeError(f"{release}: not a premium release: {exc}") from None


def model_source(cfg: ServeArgs, *, merge: bool = True) -> str:
    """What vLLM loads: the base model with a LoRA store, else the release's ``merged/``
    checkpoint (written here from ``adapter/`` when missing and ``merge``)."""
    from privcode.models.artifacts import MERGED_DIR, export_merged
    from privcode.models.loading import ModelLoadError

    check_release_privacy(cfg)
    release = Path(cfg.premium).expanduser()
    record = _release_record(release)
    if cfg.vllm_lora_store:
        return cfg.model or str(record["model"])
    merged = release / MERGED_DIR
    if not (merged / "config.json").is_file():
        if not merge:
            raise ServeError(
                f"{release}: no merged/ checkpoint for vLLM (the premium stage writes it when "
                "serve.engine is vllm; or python -c 'from privcode.models.artifacts import "
                'export_merged; export_merged("<release>")\')'
            )
        log.info("premium release %s: writing merged/ for vLLM", release)
        try:
            export_merged(release, base_model=cfg.model)
        except ModelLoadError as exc:
            raise ServeError(f"{release}: cannot merge the adapter for vLLM: {exc}") from exc
    return str(merged.resolve())


def llm_config(cfg: ServeArgs, source: str) -> Any:
    """Ray Serve LLM's ``LLMConfig`` for ``cfg`` (validated by Ray's pydantic model; building
    it needs no vLLM and no GPU, starting it does)."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    engine_kwargs: dict[str, Any] = {
        "tensor_parallel_size": cfg.vllm_tensor_parallel_size,
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
        "dtype": cfg.vllm_dtype,
    }
    if cfg.vllm_max_model_len:
        engine_kwargs["max_model_len"] = cfg.vllm_max_model_len
    model_id = cfg.served_model_name + (BASE_ID_SUFFIX if cfg.vllm_lora_store else "")
    spec: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": engine_kwargs,
        "deployment_config": {
            "autoscaling_config": {
                "min_replicas": cfg.vllm_min_replicas,
                "max_replicas": cfg.vllm_max_replicas,
                "initial_replicas": max(cfg.vllm_min_replicas, 1),
            },
        },
        # vLLM's usage reporting phones home; nothing leaves the cluster.
        "runtime_env": {"env_vars": {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}},
        "log_engine_metrics": True,
    }
    if cfg.vllm_accelerator_type:
        spec["accelerator_type"] = cfg.vllm_accelerator_type
    if cfg.vllm_lora_store:
        spec["lora_config"] = {
            "dynamic_lora_loading_path": cfg.vllm_lora_store.rstrip("/"),
            "max_num_adapters_per_replica": 16,
        }
        engine_kwargs["enable_lora"] = True
        engine_kwargs["max_lora_rank"] = _lora_rank(Path(cfg.premium).expanduser())
    try:
        return LLMConfig(**spec)
    except ValueError as exc:  # pydantic's ValidationError
        raise ServeError(f"serve args: Ray Serve LLM refuses the vLLM config: {exc}") from None


#: The LoRA ranks vLLM accepts for max_lora_rank.
_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def _lora_rank(release: Path) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds the premium adapter's rank
    (16, vLLM's default, when the release is not readable here)."""

    try:
        rank = int(json.loads((release / "adapter" / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return 16
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ServeError(
        f"{release}: LoRA rank {rank} is above vLLM's largest ({_VLLM_LORA_RANKS[-1]})"
    )


def engine_id(cfg: ServeArgs) -> str:
    """The model id vLLM answers to: the LoRA id with a store, else the merged model's."""
    if cfg.vllm_lora_store:
        return f"{cfg.served_model_name}{BASE_ID_SUFFIX}:{cfg.served_model_name}"
    return cfg.served_model_name


# --------------------------------------------------------------------------- requests


def engine_payload(item: Prepared, model_id: str) -> dict[str, Any]:
    """The OpenAI completions request vLLM runs for ``item``: its checked token ids, never the
    text again (vLLM would re-tokenise it), and its own seed when it gave one."""
    r = item.request
    payload: dict[str, Any] = {
        "model": model_id,
        "prompt": list(item.ids),
        "max_tokens": r.max_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "n": 1,
        "stream": False,
    }
    if r.stop:
        payload["stop"] = list(r.stop)
    if r.seed is not None and not r.greedy:
        payload["seed"] = r.seed % (1 << 63)
    if r.logprobs is not None:
        payload["logprobs"] = r.logprobs
    if item.sink is not None:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return payload


@dataclass(frozen=True)
class EngineLogprob:
    """One token's log-prob as vLLM reports it (its text, not its id)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def _logprobs(choice: Mapping[str, Any]) -> tuple[EngineLogprob, ...] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, Mapping):
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or [])
    return tuple(
        EngineLogprob(str(t), float(v if v is not None else 0.0), tuple((top or {}).items()))
        for t, v, top in zip(
            lp.get("tokens") or [], lp.get("token_logprobs") or [], tops, strict=False
        )
    )


def completion_from(response: Any, prompt_tokens: int) -> Completion:
    """vLLM's completion response (an object or its dict) as a :class:`Completion`; an engine
    error response raises :class:`RequestError` with its status (the message names no input)."""
    if hasattr(response, "model_dump"):
        response = response.model_dump()
    if not isinstance(response, Mapping):
        raise TypeError(f"the vLLM server answered a {type(response).__name__}")
    error = response.get("error")
    if error:
        status = int(error.get("code") or 500) if isinstance(error, Mapping) else 500
        raise RequestError(
            "the vLLM engine refused the request"
            if 400 <= status < 500
            else "the vLLM engine failed",
            status=status if 400 <= status < 600 else 500,
            type="invalid_request_error" if status < 500 else "server_error",
        )
    choice = response["choices"][0]
    usage = response.get("usage") or {}
    reason = "length" if choice.get("finish_reason") == "length" else "stop"
    return Completion(
        text=choice.get("text") or "",
        finish_reason=reason,
        prompt_tokens=int(usage.get("prompt_tokens", prompt_tokens)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        logprobs=_logprobs(choice),
    )


async def streamed_completion(chunks: Any, item: Prepared) -> Completion:
    """vLLM's stream of completion chunks (dicts) for ``item``: each text delta into its sink
    as it comes, the whole as a :class:`Completion`. A cancelled sink closes the stream."""
    text, reason, usage, records = [], "length", {}, []
    async for chunk in chunks:
        if chunk.get("error") or not isinstance(chunk.get("choices"), list):
            completion_from(chunk, len(item.ids))  # raises the error's status
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice.get("text") or ""
            records.extend(_logprobs(choice) or ())
            if choice.get("finish_reason"):
                reason = "length" if choice["finish_reason"] == "length" else "stop"
            if delta:
                text.append(delta)
                if item.sink is not None and not item.sink.put_now(delta):
                    break  # the client is gone: leaving the stream aborts the request
        if item.sink is not None and item.sink.cancelled:
            break
    return Completion(
        text="".join(text),
        finish_reason=reason,
        prompt_tokens=int(usage.get("prompt_tokens", len(item.ids))),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        logprobs=tuple(records) if item.request.logprobs is not None else None,
    )


class EngineFront:
    """What :func:`~privcode.serve.premium.build_api` needs of a model, for vLLM's checkpoint:
    its name, tokenizer and context (no weights: the ingress replica is a CPU process)."""

    def __init__(self, cfg: ServeArgs, source: str):

        from privcode.models.loading import ModelLoadError, load_tokenizer

        try:
            self.tokenizer = load_tokenizer(source)
        except ModelLoadError as exc:
            raise ServeError(f"premium model {source}: cannot load its tokenizer: {exc}") from exc
        tok = self.tokenizer
        eos = tok.eos_token_id
        self.start_id = next(
            i for i in (tok.bos_token_id, eos, tok.pad_token_id, 0) if i is not None
        )
        self.context = cfg.vllm_max_model_len or _model_context(source) or cfg.fallback_context
        self.max_tokens_limit, self.max_prompt_chars = cfg.max_tokens_limit, cfg.max_prompt_chars
        self.name = cfg.served_model_name
        self.created = int(time.time())
        self.eos_ids = tuple(i for i in (eos,) if i is not None)
        template = _release_record(Path(cfg.premium).expanduser()).get("chat_template")
        self.chat_template = template if isinstance(template, str) else None

    def prepare(self, request: Any) -> Prepared:
        return prepare_request(self, request)

    def chat_prompt(self, messages: Any) -> str:
        """``messages`` rendered with the release's chat template (as the other engine)."""
        from privcode.models.chat import render_chat

        return render_chat(self.tokenizer, messages, self.chat_template)


def _model_context(source: str) -> int | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    ctx = getattr(config, "max_position_embeddings", None)
    return ctx if isinstance(ctx, int) and ctx > 0 else None


# --------------------------------------------------------------------------- Ray Serve


@serve.deployment(name="PremiumServer", max_ongoing_requests=256, **REPLICA_OPTIONS)
@serve.ingress()
class PremiumLLMServer:
    """The guarded ingress: checks each request as the transformers engine does, then runs it
    on the vLLM deployment (``llm``: a handle to :class:`privcode.serve.vllm_server.
    PrivcodeLLMServer`, or anything with an async ``complete(payload) -> dict``)."""

    def __init__(self, args: dict[str, Any], llm: Any, source: str):
        cfg = parse_args(args)
        self.limits = guard_limits(cfg, ServeError)  # no key, no app
        self.front = EngineFront(cfg, source)
        self.model_id = engine_id(cfg)
        handle = llm
        if cfg.vllm_lora_store:  # Serve routes a LoRA id to a replica that holds the adapter
            handle = llm.options(multiplexed_model_id=self.model_id)
        self.llm = handle

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.front, self._complete, self.limits, _serve_log)

    async def _complete(self, item: Prepared) -> Completion:
        payload = engine_payload(item, self.model_id)
        if item.sink is not None:
            chunks = self.llm.options(stream=True).stream.remote(payload)
            return await streamed_completion(chunks, item)
        response = await self.llm.complete.remote(payload)
        return completion_from(response, len(item.ids))


def _vllm_deployment(cfg: ServeArgs, config: Any) -> Any:
    try:
        from ray.serve.llm import build_llm_deployment

        from privcode.serve.vllm_server import PrivcodeLLMServer
    except ImportError:
        raise ServeError(_VLLM_MISSING) from None
    return build_llm_deployment(config, name_prefix="PremiumLLM:", deployment_cls=PrivcodeLLMServer)


def require_vllm() -> None:
    """:class:`ServeError` saying what to install when vLLM is not importable here."""

    if importlib.util.find_spec("vllm") is None:
        raise ServeError(_VLLM_MISSING)


def build_app(cfg: ServeArgs, **deployment_options: Any) -> serve.Application:
    """The vLLM-backed premium app for parsed ``cfg`` (``engine: vllm``); ``deployment_options``
    go to the ingress (``PremiumServer``). Refuses without vLLM before writing anything."""
    require_vllm()
    guard_limits(cfg, ServeError)  # no key, no app: before merging or placing GPUs
    source = model_source(cfg)
    llm = _vllm_deployment(cfg, llm_config(cfg, source))
    return PremiumLLMServer.options(**deployment_options).bind(as_args(cfg), llm, source)
