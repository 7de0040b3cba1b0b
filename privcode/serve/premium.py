"""Serve the premium model (base + merged LoRA adapter) as an OpenAI-compatible Ray Serve app.

``import_path: privcode.serve.premium:app`` with ``args`` (:func:`parse_args`; defaults: the
``serve`` config section; ``premium``: the release dir of ``privcode premium``), behind the
keys and client limits of :class:`privcode.serve.args.GuardArgs`: without an API key the app
refuses to start unless ``insecure_no_auth``. Routes (:mod:`privcode.serve.api`):
``/v1/completions``, ``/v1/chat/completions`` (the release's chat template,
:mod:`privcode.models.chat`), ``/v1/models[/<id>]``, ``/healthz``; ``n`` up to :data:`MAX_N`
(choice ``i`` seeded ``seed + i``), ``logprobs``, ``stream`` (:mod:`privcode.serve.streaming`).
:class:`PremiumModel` is the model-running core, usable without Ray; :class:`PremiumServer`
batches requests with ``@serve.batch`` into one ``generate`` call, each sampled row with its
own generator. Prompts and completions are never logged, only sizes and latency.
Details: docs/serving.md, "privcode/serve/premium.py".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from privcode.artifacts.premium import PremiumRecord
from privcode.errors import PrivcodeError
from privcode.serve.api import (
    CompletionRequest,
    CompletionResponse,
    Limits,
    RequestError,
    check_model,
    completion_model,
    fit_context,
    new_api,
    post_generation_routes,
    to_request,
)
from privcode.serve.args import (
    REPLICA_OPTIONS,
    SERVE_DEFAULTS,
    GuardArgs,
    as_args,
    guard_limits,
    parse_app_args,
)
from privcode.serve.chat import ChatResponse, chat_model, to_chat_request
from privcode.serve.formats import Answer, AnswerFormat
from privcode.serve.streaming import TextStream, TokenSink, answer_events

log = logging.getLogger("privcode.serve")

__all__ = [
    "Completion",
    "PremiumModel",
    "PremiumServer",
    "ServeArgs",
    "ServeError",
    "app",
    "build_api",
    "build_app",
    "parse_args",
    "prepare_request",
]

DEFAULT_MODEL_NAME = "privcode-premium"
#: Most choices per request (``n``): each is a row of the batch.
MAX_N = 8


class ServeError(PrivcodeError, ValueError):
    """The serving app cannot start: bad args, no API key, or a release that cannot be loaded."""


# --------------------------------------------------------------------------- args


@dataclass(frozen=True, kw_only=True)
class ServeArgs(GuardArgs):
    """The app's ``args`` (serveConfigV2 ``applications[].args``); defaults: the serve section."""

    premium: str
    max_tokens_limit: int = SERVE_DEFAULTS["max_tokens_limit"]
    max_batch_size: int = SERVE_DEFAULTS["max_batch_size"]
    batch_wait_timeout_s: float = 0.02
    served_model_name: str = DEFAULT_MODEL_NAME
    engine: str = SERVE_DEFAULTS["engine"]
    # engine vllm only (privcode.serve.premium_llm); ranges: the serve section's.
    vllm_tensor_parallel_size: int = SERVE_DEFAULTS["vllm_tensor_parallel_size"]
    vllm_gpu_memory_utilization: float = SERVE_DEFAULTS["vllm_gpu_memory_utilization"]
    vllm_max_model_len: int = SERVE_DEFAULTS["vllm_max_model_len"]
    vllm_dtype: str = SERVE_DEFAULTS["vllm_dtype"]
    vllm_min_replicas: int = SERVE_DEFAULTS["vllm_min_replicas"]
    vllm_max_replicas: int = SERVE_DEFAULTS["vllm_max_replicas"]
    vllm_accelerator_type: str | None = None
    vllm_lora_store: str | None = None
    #: UNSAFE: serve a release whose premium.json says no DP guarantee holds (refused otherwise).
    serve_non_dp_release: bool = False


_DEVICES = ("auto", "cpu", "cuda")


def parse_args(args: Mapping[str, Any] | None) -> ServeArgs:
    """Validate the app args; :class:`ServeError` names the bad (or unknown) key."""
    cfg = parse_app_args(args, ServeArgs, "serve args", ServeError, required=("premium",))
    if cfg.device not in _DEVICES:
        raise ServeError(f"serve args: 'device' must be one of {', '.join(_DEVICES)}")
    if not 0 <= cfg.batch_wait_timeout_s <= 60:
        raise ServeError(
            "serve args: 'batch_wait_timeout_s' must be a number of seconds in [0, 60]"
        )
    if cfg.engine != "vllm":  # a vLLM setting would be silently ignored
        defaults = ServeArgs(premium=cfg.premium)
        given = sorted(
            k
            for k in (args or {})
            if k.startswith("vllm_") and getattr(cfg, k) != getattr(defaults, k)
        )
        if given:
            raise ServeError(f"serve args: {given[0]!r} needs 'engine': 'vllm'")
    if cfg.vllm_min_replicas > cfg.vllm_max_replicas:
        raise ServeError("serve args: 'vllm_min_replicas' is larger than 'vllm_max_replicas'")
    return cfg


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    #: Per token of ``text`` (privcode.models.generate.TokenLogprob), when asked for.
    logprobs: tuple[Any, ...] | None = None

    def answer(self) -> Answer:
        return Answer(self.text, self.finish_reason, self.completion_tokens, self.logprobs)


@dataclass(frozen=True)
class Prepared:
    """A request validated against the model, with its prompt token ids; ``sink`` (a
    :class:`~privcode.serve.streaming.TokenSink`) gets its tokens as they are drawn."""

    request: CompletionRequest
    ids: tuple[int, ...]
    sink: TokenSink | None = None

    def choices(self) -> list[Prepared]:
        """One row per choice (``n``), choice ``i`` seeded ``seed + i``."""
        r = self.request
        return [
            dataclasses.replace(self, request=dataclasses.replace(r, seed=r.choice_seed(i)))
            for i in range(r.n)
        ]


def prepare_request(model: Any, request: CompletionRequest) -> Prepared:
    """``request`` checked against ``model``'s limits and context, with its prompt's token ids
    (the tokenizer's special tokens added, as the engine would; ``model``: ``tokenizer``,
    ``start_id``, ``max_tokens_limit``, ``max_prompt_chars``, ``context``)."""
    if request.max_tokens > model.max_tokens_limit:
        raise RequestError(
            f"'max_tokens' must be at most {model.max_tokens_limit}, got {request.max_tokens}",
            "max_tokens",
        )

    def encode(prompt: str) -> list[int]:
        return model.tokenizer(prompt, add_special_tokens=True)["input_ids"] or [model.start_id]

    return Prepared(request, fit_context(request, model.max_prompt_chars, encode, model.context))


def _resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ServeError(
            "serve args: 'device' is 'cuda' but no CUDA device is visible to this "
            "replica (set ray_actor_options.num_gpus, or use 'auto' / 'cpu')"
        )
    return torch.device(device)


def check_release_privacy(cfg: ServeArgs) -> None:
    """Refuse a premium release whose ``premium.json`` says no DP guarantee holds (it was
    tuned on data that is not synthesised from a DP release) unless ``serve_non_dp_release``
    asks for it by name; then every replica logs that it serves a NOT PRIVATE model. An
    unreadable record is left to the loader, which names what is wrong."""

    try:
        record = PremiumRecord.read(Path(cfg.premium).expanduser() / PremiumRecord.FILE)
    except Exception:  # noqa: BLE001 - reported by _check_release / the loader
        return
    if record.privacy.dp:
        return
    warning = record.privacy.privacy_warning or "no differential-privacy guarantee holds"
    if not cfg.serve_non_dp_release:
        raise ServeError(
            f"{cfg.premium}: its premium.json says NO differential-privacy guarantee holds "
            f"({warning}); refusing to serve it. Set serve_non_dp_release: true to serve it "
            "anyway (UNSAFE: the model may reproduce the private records)"
        )
    log.error("serving a NOT PRIVATE premium model (serve_non_dp_release): %s", warning)


def _check_release(release: Path) -> None:
    if not (release / "premium.json").is_file():
        raise ServeError(
            f"{release}: not a premium release (no premium.json); pass the "
            "directory `privcode premium` wrote"
        )
    if not (release / "adapter" / "adapter_config.json").is_file():
        raise ServeError(f"{release}: the premium release has no adapter/adapter_config.json")


class PremiumModel:
    """The premium model (base + merged adapter) and its tokenizer; generation without Ray."""

    @classmethod
    def from_args(cls, cfg: ServeArgs) -> PremiumModel:
        """The model a replica's :class:`ServeArgs` name (release, base override, limits)."""
        limits = ("max_tokens_limit", "max_prompt_chars", "fallback_context")
        return cls(
            cfg.premium,
            model=cfg.model,
            device=cfg.device,
            name=cfg.served_model_name,
            **{k: getattr(cfg, k) for k in limits},
        )

    def __init__(
        self,
        premium: str | Path,
        *,
        model: str | None = None,
        device: str = "auto",
        max_tokens_limit: int = SERVE_DEFAULTS["max_tokens_limit"],
        name: str = DEFAULT_MODEL_NAME,
        max_prompt_chars: int = SERVE_DEFAULTS["max_prompt_chars"],
        fallback_context: int = SERVE_DEFAULTS["fallback_context"],
    ):
        import torch
        from transformers import GenerationConfig

        from privcode.models.artifacts import load_model
        from privcode.models.loading import ModelLoadError

        release = Path(premium).expanduser()
        _check_release(release)
        self.device = _resolve_device(device)
        dtype = torch.float32
        if self.device.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        start = time.perf_counter()
        try:
            loaded = load_model(release, base_model=model, device=self.device, dtype=dtype)
        except ModelLoadError as exc:
            how = (
                ""
                if model
                else "; if the base model lives elsewhere on this machine, "
                "pass its path as the 'model' arg"
            )
            raise ServeError(f"premium release {release}: cannot load it: {exc}{how}") from exc
        self.model, self.tokenizer, base = loaded.model, loaded.tokenizer, loaded.base_model
        info = loaded.meta  # premium.json
        template = info.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None  # None: the kit's
        tok = self.tokenizer
        self.eos_ids = loaded.eos_ids  # the checkpoint's end-of-sequence ids
        self.pad_id = next(i for i in (tok.pad_token_id, *self.eos_ids, 0) if i is not None)
        self.start_id = next(
            i for i in (tok.bos_token_id, *self.eos_ids, self.pad_id) if i is not None
        )
        # Only the client's settings count: the checkpoint's sampling defaults
        # (repetition penalty, top_k, ...) would change greedy/top_p results.
        self.model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id,
            eos_token_id=list(self.eos_ids) or None,
            pad_token_id=self.pad_id,
        )
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        tmax = getattr(tok, "model_max_length", None)
        # A model that states no context gets the configured one: never an unbounded prompt.
        self.context = ctx or (tmax if tmax and tmax < 1_000_000 else None) or fallback_context
        self.max_tokens_limit, self.max_prompt_chars = max_tokens_limit, max_prompt_chars
        self.name, self.release, self.base = name, str(release), str(base)
        self.created = (
            int(info.get("created", time.time()))
            if isinstance(info.get("created"), int | float)
            else int(time.time())
        )
        self._lock = threading.Lock()
        log.info(
            "premium model loaded: release=%s base=%s device=%s dtype=%s context=%s in %.1f s",
            release,
            base,
            self.device,
            dtype,
            self.context,
            time.perf_counter() - start,
        )

    # -- requests

    def prepare(self, request: CompletionRequest) -> Prepared:
        """Tokenise and check a request against the model (context length, limits)."""
        return prepare_request(self, request)

    def complete(self, request: CompletionRequest) -> Completion:
        """One request, on its own."""
        result = self.generate_batch([self.prepare(request)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    # -- generation

    def generate_batch(self, items: Sequence[Prepared]) -> list[Completion | Exception]:
        """Results in the order of ``items``, all from ONE :func:`privcode.models.generate.generate`
        call: greedy, sampled and seeded requests together (each sampled row draws from its
        own generator, seeded by its request or afresh). A failure is every item's exception."""
        try:
            return list(self._generate_rows(items))
        except Exception as exc:  # noqa: BLE001 - reported per request by the caller
            return [exc] * len(items)

    def _generate_rows(self, items: Sequence[Prepared]) -> list[Completion]:
        from privcode.models.generate import generate  # torch and transformers: heavy

        reqs = [it.request for it in items]
        sinks = [it.sink for it in items]

        def listen(row: int, token: int) -> bool:
            sink = sinks[row]
            return True if sink is None else sink.put(token)

        with self._lock:
            out = generate(
                self.model,
                self.tokenizer,
                input_ids=[it.ids for it in items],
                max_new_tokens=[r.max_tokens for r in reqs],
                temperature=[r.temperature for r in reqs],
                top_p=[r.top_p for r in reqs],
                seed=[None if r.seed is None else r.seed % (1 << 63) for r in reqs],
                stop=[r.stop for r in reqs],
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                logprobs=[r.logprobs for r in reqs],
                listener=listen if any(sinks) else None,
            )
        return [
            Completion(g.text, g.finish_reason, len(it.ids), g.completion_tokens, g.logprobs)
            for it, g in zip(items, out, strict=True)
        ]

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """``messages`` rendered with the release's chat template (the text to continue)."""
        from privcode.models.chat import render_chat

        return render_chat(self.tokenizer, messages, self.chat_template)


# --------------------------------------------------------------------------- HTTP


def build_api(
    model: Any,
    generate: Callable[[Prepared], Awaitable[Completion]],
    limits: Limits,
    logger: logging.Logger | None = None,
) -> Any:
    """The premium app's FastAPI object over ``model`` (a :class:`PremiumModel` or alike:
    ``name``, ``created``, ``max_tokens_limit``, ``max_prompt_chars``, ``tokenizer``,
    ``eos_ids``, ``prepare``, ``chat_prompt``) and ``generate`` (the deployment's batched
    call; a row with a sink streams into it). No Ray needed: tests drive it directly."""
    from fastapi.responses import StreamingResponse

    logger = logger or log
    limit, chars = model.max_tokens_limit, model.max_prompt_chars
    completion_body = completion_model(limit, chars, max_n=MAX_N)
    chat_body = chat_model(limit, chars, max_n=MAX_N)
    card = {"id": model.name, "object": "model", "created": model.created, "owned_by": "privcode"}
    api = new_api(
        "privcode premium model",
        "OpenAI-compatible completions and chat from the premium model (trained on DP "
        "synthetic data).",
        limits,
        lambda: card,
        logger,
    )

    async def respond(request: CompletionRequest, kind: str) -> Any:
        start = time.perf_counter()
        check_model(request, model.name)
        rows = model.prepare(request).choices()
        fmt = AnswerFormat(kind, model.name, model.tokenizer, include_usage=request.include_usage)
        if request.stream:
            choices = []
            for row in rows:
                sink = TokenSink()
                text = TextStream(model.tokenizer, request.stop, model.eos_ids)
                answer = _answer(generate(dataclasses.replace(row, sink=sink)))
                choices.append((sink, answer, text))
            events = answer_events(fmt, choices, len(rows[0].ids))
            return StreamingResponse(events, media_type="text/event-stream")
        results = await asyncio.gather(*(generate(row) for row in rows))
        # Sizes and latency only: prompts and completions can be private.
        logger.info(
            "%s: prompt_tokens=%d completion_tokens=%d n=%d sampled=%s latency_ms=%.1f",
            "chat" if fmt.chat else "completion",
            len(rows[0].ids),
            sum(r.completion_tokens for r in results),
            len(rows),
            not request.greedy,
            1000 * (time.perf_counter() - start),
        )
        return fmt.body([r.answer() for r in results], results[0].prompt_tokens)

    async def completions(body: completion_body) -> Any:  # type: ignore[valid-type]
        return await respond(to_request(body, limit), "text_completion")

    async def chat(body: chat_body) -> Any:  # type: ignore[valid-type]
        return await respond(to_chat_request(body, limit, model.chat_prompt), "chat.completion")

    post_generation_routes(
        api,
        completions,
        chat,
        bodies=(completion_body, chat_body),
        responses=(CompletionResponse, ChatResponse),
    )
    return api


async def _answer(completion: Awaitable[Completion]) -> Answer:
    return (await completion).answer()


# --------------------------------------------------------------------------- Ray Serve

_serve_log = logging.getLogger("ray.serve")


@serve.deployment(name="PremiumServer", max_ongoing_requests=64, **REPLICA_OPTIONS)
@serve.ingress()
class PremiumServer:
    """Ray Serve deployment: :func:`build_api` over :class:`PremiumModel`, requests batched."""

    def __init__(self, args: dict[str, Any]):
        cfg = parse_args(args)
        self.limits = guard_limits(cfg, ServeError)  # no key, no app (before loading weights)
        check_release_privacy(cfg)
        self.model = PremiumModel.from_args(cfg)
        self._generate.set_max_batch_size(cfg.max_batch_size)
        self._generate.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)

    def __serve_build_asgi_app__(self) -> Any:
        return build_api(self.model, self._generate_one, self.limits, _serve_log)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _generate(self, items: list[Prepared]) -> list[Completion | Exception]:
        return await asyncio.to_thread(self.model.generate_batch, items)

    async def _generate_one(self, item: Prepared) -> Completion:
        result = await self._generate(item)
        if isinstance(result, Exception):
            raise result
        return result


def build_app(args: Mapping[str, Any], **deployment_options: Any) -> serve.Application:
    """The app for ``args``; ``deployment_options`` go to ``PremiumServer.options``.

    ``engine: vllm`` builds :func:`privcode.serve.premium_llm.build_app` instead: the same
    routes and checks in front of Ray Serve LLM's vLLM replicas."""
    cfg = parse_args(args)
    if cfg.engine == "vllm":
        from privcode.serve import premium_llm

        return premium_llm.build_app(cfg, **deployment_options)
    options = {"max_ongoing_requests": max(64, 2 * cfg.max_batch_size), **deployment_options}
    return PremiumServer.options(**options).bind(as_args(cfg))


def app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / serveConfigV2: ``import_path: privcode.serve.premium:app``."""
    return build_app(args)
