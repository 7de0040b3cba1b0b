"""Serve the premium model (base + merged LoRA adapter) as an OpenAI-compatible Ray Serve app.

``import_path: privcode.serve.premium:app`` with ``args`` (see
:func:`parse_args`): ``premium`` (the release dir of ``privcode premium``:
``adapter/`` + ``premium.json``), ``model`` (base-model override: on
Kubernetes the base lives elsewhere than at training time), ``device``
(``auto``|``cpu``|``cuda``), ``max_tokens_limit``, ``max_batch_size``,
``batch_wait_timeout_s``, ``api_key_env``, ``served_model_name``.

Routes (see :mod:`privcode.serve.http`): ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/<id>``, ``GET /healthz``.

:class:`PremiumModel` is the model-running core, usable without Ray: load,
validate a request against the model (:meth:`PremiumModel.prepare`), and
generate a batch (:meth:`PremiumModel.generate_batch`). :class:`PremiumServer`
is the thin Serve deployment around it, batching requests with
``@serve.batch``. Greedy requests share one left-padded ``generate`` call;
sampled requests share one per (temperature, top_p); a seeded request runs
alone after ``torch.manual_seed(seed)`` (under the generation lock), so it
is reproducible. Prompts and completions are never logged, only sizes and
latency.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ray import serve

from privcode.errors import PrivcodeError
from privcode.serve.http import (
    CompletionRequest,
    CompletionsAPI,
    RequestError,
    api_key_from_env,
    app_args,
    check_common_args,
    read_body_capped,
    route_path,
)

log = logging.getLogger("privcode.serve")

__all__ = [
    "Completion",
    "PremiumModel",
    "PremiumServer",
    "ServeArgs",
    "ServeError",
    "app",
    "api_key_from_env",
    "build_app",
    "parse_args",
]

DEFAULT_MODEL_NAME = "privcode-premium"


class ServeError(PrivcodeError, ValueError):
    """The serving app cannot start: bad args or a release/model that cannot be loaded."""


# --------------------------------------------------------------------------- args


@dataclass(frozen=True)
class ServeArgs:
    """The app's ``args`` (serveConfigV2 ``applications[].args``)."""

    premium: str
    model: str | None = None
    device: str = "auto"
    max_tokens_limit: int = 512
    max_batch_size: int = 8
    batch_wait_timeout_s: float = 0.02
    api_key_env: str = "PRIVCODE_API_KEY"
    served_model_name: str = DEFAULT_MODEL_NAME


_DEVICES = ("auto", "cpu", "cuda")


def _bad(key: str, why: str, value: Any) -> ServeError:
    return ServeError(f"serve args: {key!r} {why}, got {value!r}")


def parse_args(args: Mapping[str, Any] | None) -> ServeArgs:
    """Validate the app args; :class:`ServeError` names the bad (or unknown) key."""
    out = app_args(args, ServeArgs, "serve args", ServeError)
    for key in ("premium", "api_key_env", "served_model_name"):
        if key in out and (not isinstance(out[key], str) or not out[key].strip()):
            raise _bad(key, "must be a non-empty string", out[key])
    if "premium" not in out:
        raise ServeError(
            "serve args: 'premium' is required (the premium release dir, with "
            "adapter/ and premium.json)"
        )
    if out.get("model") is not None and (
        not isinstance(out["model"], str) or not out["model"].strip()
    ):
        raise _bad("model", "must be a non-empty string (a base-model dir) or null", out["model"])
    if "device" in out and out["device"] not in _DEVICES:
        raise _bad("device", f"must be one of {', '.join(_DEVICES)}", out["device"])
    check_common_args(out, (("max_tokens_limit", 1, 1 << 20), ("max_batch_size", 1, 1024)), _bad)
    value = out.get("batch_wait_timeout_s")
    if "batch_wait_timeout_s" in out and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60
    ):
        raise _bad("batch_wait_timeout_s", "must be a number of seconds in [0, 60]", value)
    return ServeArgs(**out)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Prepared:
    """A request validated against the model, with its prompt token ids."""

    request: CompletionRequest
    ids: tuple[int, ...]


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

    def __init__(
        self,
        premium: str | Path,
        *,
        model: str | None = None,
        device: str = "auto",
        max_tokens_limit: int = 512,
        name: str = DEFAULT_MODEL_NAME,
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
        self.context = ctx or (tmax if tmax and tmax < 1_000_000 else None)
        self.max_tokens_limit = max_tokens_limit
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
        if request.max_tokens > self.max_tokens_limit:
            raise RequestError(
                f"'max_tokens' must be at most {self.max_tokens_limit}, got {request.max_tokens}",
                "max_tokens",
            )
        ids = self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
        ids = tuple(ids) if ids else (self.start_id,)
        if self.context is not None:
            if len(ids) >= self.context:
                raise RequestError(
                    f"'prompt' is {len(ids)} tokens; this model's context is {self.context} tokens",
                    "prompt",
                )
            if len(ids) + request.max_tokens > self.context:
                raise RequestError(
                    f"this model's context is {self.context} tokens, but "
                    f"{len(ids) + request.max_tokens} were requested "
                    f"({len(ids)} in the prompt, {request.max_tokens} for the "
                    "completion): lower 'max_tokens'",
                    "max_tokens",
                )
        return Prepared(request, ids)

    def complete(self, request: CompletionRequest) -> Completion:
        """One request, on its own."""
        result = self.generate_batch([self.prepare(request)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    # -- generation

    def generate_batch(self, items: Sequence[Prepared]) -> list[Completion | Exception]:
        """Results in the order of ``items``; a failing group yields its exception per item."""
        groups: dict[Any, list[int]] = {}
        for i, item in enumerate(items):
            r = item.request
            key = (
                ("greedy",)
                if r.greedy
                else (("seeded", i) if r.seed is not None else ("sample", r.temperature, r.top_p))
            )
            groups.setdefault(key, []).append(i)
        results: list[Completion | Exception | None] = [None] * len(items)
        for index in groups.values():
            try:
                outs = self._generate_group([items[i] for i in index])
            except Exception as exc:  # noqa: BLE001 - reported per request by the caller
                outs = [exc] * len(index)
            for i, out in zip(index, outs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    def _generate_group(self, items: Sequence[Prepared]) -> list[Completion]:
        import torch
        from transformers import StoppingCriteriaList

        from privcode.models.sampling import sampling_kwargs

        first = items[0].request
        width = max(len(it.ids) for it in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, it in enumerate(items):  # left padding: every prompt ends at column width-1
            input_ids[row, width - len(it.ids) :] = torch.tensor(it.ids, dtype=torch.long)
            mask[row, width - len(it.ids) :] = 1
        stopper = _RowStop(self.tokenizer, [it.request for it in items], width)
        kwargs = sampling_kwargs(0.0 if first.greedy else first.temperature, first.top_p)
        with self._lock, torch.inference_mode():
            if not first.greedy:
                if first.seed is not None:
                    torch.manual_seed(first.seed)
                else:
                    torch.seed()  # a fresh seed: an earlier seeded request must not leak in
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max(it.request.max_tokens for it in items),
                stopping_criteria=StoppingCriteriaList([stopper]),
                **kwargs,
            )
        new = out[:, width:].tolist()
        return [
            self._finish(it, tokens, stopper.stopped.get(row))
            for row, (it, tokens) in enumerate(zip(items, new, strict=True))
        ]

    def _finish(self, item: Prepared, tokens: list[int], stopped_at: int | None) -> Completion:
        req = item.request
        end = min(
            len(tokens), req.max_tokens, stopped_at if stopped_at is not None else len(tokens)
        )
        used, reason = tokens[:end], "length"
        for i, tok in enumerate(used):
            if tok in self.eos_ids:
                used, reason = used[:i], "stop"
                end = i + 1
                break
        text = self.tokenizer.decode(used, skip_special_tokens=True)
        hits = [pos for pos in (text.find(s) for s in req.stop) if pos >= 0]
        if hits:
            text, reason = text[: min(hits)], "stop"
        return Completion(
            text=text, finish_reason=reason, prompt_tokens=len(item.ids), completion_tokens=end
        )


class _RowStop:
    """Per-row stopping: a row is done at its own ``max_tokens`` or once a stop string shows.

    Records the number of new tokens at which each row stopped in ``stopped``.
    """

    def __init__(self, tokenizer: Any, requests: Sequence[CompletionRequest], start: int):
        self.tokenizer, self.requests, self.start = tokenizer, requests, start
        self.stopped: dict[int, int] = {}
        # A stop string of c characters spans at most 4c byte-level tokens.
        self.window = [4 * max((len(s) for s in r.stop), default=0) + 8 for r in requests]

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        n = input_ids.shape[1] - self.start
        done = []
        for row, req in enumerate(self.requests):
            if row not in self.stopped:
                hit = n >= req.max_tokens
                if not hit and req.stop:
                    tail = input_ids[row, max(self.start, input_ids.shape[1] - self.window[row]) :]
                    text = self.tokenizer.decode(tail.tolist(), skip_special_tokens=True)
                    hit = any(s in text for s in req.stop)
                if hit:
                    self.stopped[row] = n
            done.append(row in self.stopped)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


# --------------------------------------------------------------------------- Ray Serve

_serve_log = logging.getLogger("ray.serve")


@serve.deployment(
    name="PremiumServer",
    num_replicas=1,
    max_ongoing_requests=64,
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=20,
)
class PremiumServer:
    """Ray Serve deployment: the HTTP API of :class:`PremiumModel`, with request batching."""

    def __init__(self, args: dict[str, Any]):
        cfg = parse_args(args)
        self.model = PremiumModel(
            cfg.premium,
            model=cfg.model,
            device=cfg.device,
            max_tokens_limit=cfg.max_tokens_limit,
            name=cfg.served_model_name,
        )
        self._generate.set_max_batch_size(cfg.max_batch_size)
        self._generate.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.api = CompletionsAPI(
            self.model,
            self._generate_one,
            api_key_from_env(cfg.api_key_env, _serve_log),
            _serve_log,
        )

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _generate(self, items: list[Prepared]) -> list[Completion | Exception]:
        _serve_log.info("generating a batch of %d", len(items))
        return await asyncio.to_thread(self.model.generate_batch, items)

    async def _generate_one(self, item: Prepared) -> Completion:
        result = await self._generate(item)
        if isinstance(result, Exception):
            raise result
        return result

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            status, body, headers = await self.api.handle(
                request.method,
                route_path(request.scope),
                request.headers,
                lambda: read_body_capped(request),
            )
        except Exception as exc:  # noqa: BLE001 - the message may hold request data: not echoed
            _serve_log.error("request failed: %s", type(exc).__name__)
            status, headers = 500, {}
            body = {
                "error": {
                    "message": "internal error while generating",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
        return JSONResponse(body, status_code=status, headers=headers)


def build_app(args: Mapping[str, Any], **deployment_options: Any) -> serve.Application:
    """The app for ``args``; ``deployment_options`` go to ``PremiumServer.options``."""
    cfg = parse_args(args)
    options = {"max_ongoing_requests": max(64, 2 * cfg.max_batch_size), **deployment_options}
    return PremiumServer.options(**options).bind(asdict(cfg))


def app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / serveConfigV2: ``import_path: privcode.serve.premium:app``."""
    return build_app(args)
