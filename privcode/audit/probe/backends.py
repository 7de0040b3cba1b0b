"""The audited model ("Test LLM") behind one interface: local HF models, HTTP endpoints, scripts.
Design notes: docs/audits.md, "privcode/audit/probe/backends.py".

``Backend.complete(prompts, max_tokens=, temperature=, n=, seed=)`` returns ``n`` completions
(the generated text only) per prompt.

* :class:`HFBackend`: any artifact :func:`privcode.models.artifacts.load_model` reads;
  reproducible for a ``seed``, temperature 0 greedy; a long prompt keeps its last tokens.
* :class:`OpenAIBackend`: an OpenAI-compatible server, one request per completion (sample
  ``j`` of prompt ``i`` seeded ``seed + i * n + j``), key from the variable ``api_key_env``;
  transport and retries are :class:`privcode.models.endpoint.EndpointClient`'s (never a
  spent PAC budget); 400/413/422 give a counted empty completion unless
  ``skip_invalid=False``; 401/403/404 raise.
* :class:`ScriptedBackend`: canned answers chosen by substrings of the prompt, for tests.

PRIVACY: prompts and completions are never logged or put into errors.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError
from privcode.models.endpoint import EndpointClient, EndpointError, EndpointStatusError

log = logging.getLogger("privcode.audit.probe")

__all__ = [
    "Backend",
    "BackendError",
    "HFBackend",
    "InvalidRequestError",
    "OpenAIBackend",
    "ScriptedBackend",
    "make_backend",
]


class BackendError(PrivcodeError):
    """The audited model cannot be loaded or queried (names the model/endpoint and the cause)."""


class InvalidRequestError(BackendError):
    """The endpoint refused one request as invalid (HTTP 400/413/422)."""


def _check_args(prompts: Sequence[str], max_tokens: int, temperature: float, n: int) -> None:
    if not isinstance(prompts, list | tuple) or not all(isinstance(p, str) for p in prompts):
        raise BackendError("prompts must be a list of strings")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BackendError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise BackendError(f"temperature must be >= 0, got {temperature!r}")
    if not isinstance(n, int) or n < 1:
        raise BackendError(f"n must be a positive int, got {n!r}")


class Backend(abc.ABC):
    """The audited model: ``complete`` -> ``n`` completions per prompt."""

    @abc.abstractmethod
    def complete(
        self,
        prompts: Sequence[str],
        *,
        max_tokens: int = 256,
        temperature: float = 0.7,
        n: int = 1,
        seed: int = 0,
    ) -> list[list[str]]:
        """For each prompt, ``n`` generated texts (without the prompt)."""

    def describe(self) -> dict[str, Any]:
        """What the summary may say about the backend (never a key)."""
        return {"kind": type(self).__name__}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (HTTP sessions, models)."""


# --------------------------------------------------------------------------- scripted


class ScriptedBackend(Backend):
    """Deterministic canned answers.

    ``answer`` is either a callable ``(prompt, index) -> str`` (``index`` is
    the sample number 0..n-1) or a list of ``(substring, answers)`` rules: the
    first rule whose substring occurs in the prompt answers, cycling through
    ``answers`` (a str or a list of str); no match gives ``default``. Every
    prompt received is kept in ``self.prompts``.
    """

    def __init__(
        self, answer: Callable[[str, int], str] | Sequence[tuple[str, Any]], default: str = ""
    ):
        self._answer = answer
        self.default = default
        self.prompts: list[str] = []

    def _one(self, prompt: str, index: int) -> str:
        if callable(self._answer):
            return self._answer(prompt, index)
        for needle, answers in self._answer:
            if needle in prompt:
                answers = [answers] if isinstance(answers, str) else list(answers)
                return answers[index % len(answers)]
        return self.default

    def complete(self, prompts, *, max_tokens=256, temperature=0.7, n=1, seed=0):
        _check_args(prompts, max_tokens, temperature, n)
        self.prompts.extend(prompts)
        return [[self._one(p, j) for j in range(n)] for p in prompts]


# --------------------------------------------------------------------------- Hugging Face


class HFBackend(Backend):
    """A local HF causal LM, a premium release or a junior release (see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: Any = None,
        base_model: str | None = None,
        batch_size: int = 4,
        chat_template: str = "auto",
        cache_dir: str | None = None,
    ):
        import torch

        from privcode.models.artifacts import load_model
        from privcode.models.loading import ModelLoadError

        if chat_template not in ("auto", "never"):
            raise BackendError(f"chat_template must be 'auto' or 'never', got {chat_template!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendError("HFBackend: device 'cuda' requested but no CUDA device is visible")
        self.path, self.device = str(path), torch.device(device)
        self.batch_size, self.chat_template = max(1, int(batch_size)), chat_template
        try:
            loaded = load_model(
                path, base_model=base_model, device=device, dtype=dtype, cache_dir=cache_dir
            )
        except (ModelLoadError, OSError, ValueError, KeyError, RuntimeError) as exc:
            if isinstance(exc, PrivcodeError) and not isinstance(exc, ModelLoadError):
                raise
            raise BackendError(f"cannot load the audited model {path}: {exc}") from exc
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.kind = loaded.kind if loaded.kind in ("junior", "premium") else "model"
        tok = self.tokenizer
        self.eos_id = tok.eos_token_id
        self.pad_id = next(i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None)
        config = getattr(self.model, "config", None)
        self.context = getattr(config, "max_position_embeddings", None) or 2048

    def describe(self) -> dict[str, Any]:
        return {"kind": "hf", "model": self.path, "release": self.kind, "device": str(self.device)}

    def _encode(self, prompt: str) -> list[int]:
        tok = self.tokenizer
        if self.chat_template == "auto" and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return list(ids)
        ids = list(tok(prompt, add_special_tokens=True)["input_ids"])
        if not ids:
            ids = [self.eos_id if self.eos_id is not None else self.pad_id]
        return ids

    def complete(self, prompts, *, max_tokens=256, temperature=0.7, n=1, seed=0):
        from privcode.models.generate import generate  # torch and transformers: heavy

        _check_args(prompts, max_tokens, temperature, n)
        # Keep room for the prompt: at most 3/4 of the context is generated.
        max_new = max(1, min(max_tokens, (3 * self.context) // 4))
        keep = self.context - max_new
        per = 1 if float(temperature) == 0.0 else n  # greedy samples are copies
        out: list[list[str]] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = [self._encode(p)[-keep:] for p in prompts[start : start + self.batch_size]]
            rows = generate(
                self.model,
                self.tokenizer,
                input_ids=[ids for ids in batch for _ in range(per)],
                max_new_tokens=max_new,
                temperature=float(temperature),
                top_p=0.95,
                seed=int(seed) + start,
                eos_ids=[] if self.eos_id is None else [self.eos_id],
                pad_id=self.pad_id,
            )
            texts = [g.text for g in rows]
            out += [texts[i * per : (i + 1) * per] * (n // per) for i in range(len(batch))]
        return out

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------- OpenAI HTTP


class OpenAIBackend(Backend):
    """An OpenAI-compatible completions (or chat) endpoint (see the module docstring), a
    thin adapter over :class:`privcode.models.endpoint.EndpointClient`.

    ``base_url``: the server root (``http://host:8000``) or its ``/v1``
    prefix. ``model``: the model name to send; None asks ``GET /v1/models``
    and takes the first id.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key_env: str | None = "PRIVCODE_API_KEY",
        chat: bool = False,
        timeout: float = 120.0,
        max_retries: int = 2,
        concurrency: int = 4,
        backoff_s: float = 0.5,
        send_seed: bool = True,
        skip_invalid: bool = True,
    ):
        try:
            self.client = EndpointClient(
                base_url,
                api_key_env=api_key_env,
                timeout_s=timeout,
                retries=max_retries,
                backoff_s=backoff_s,
                concurrency=max(1, concurrency),
                key="endpoint",
                plain_http_anywhere=True,
            )
        except EndpointError as exc:
            raise BackendError(f"{exc} (got {base_url!r})") from None
        self.api, self.chat = self.client.api, chat
        self.concurrency, self.send_seed = max(1, concurrency), send_seed
        self.api_key_env, self.skip_invalid, self.failed = api_key_env, skip_invalid, 0
        if api_key_env and not self.client.has_key:
            log.warning("$%s is not set: querying %s without an API key", api_key_env, self.api)
        self._lock = threading.Lock()
        self.model = model or self._first_model()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "openai",
            "endpoint": self.api,
            "model": self.model,
            "api": "chat/completions" if self.chat else "completions",
            "api_key_env": self.api_key_env,
            "failed_requests": self.failed,
        }

    def _first_model(self) -> str:
        try:
            models = self.client.models()
        except EndpointError as exc:
            raise BackendError(str(exc)) from None
        if not models:
            raise BackendError(f"{self.api}/models lists no model; pass the model name")
        return models[0]

    def _one(self, prompt: str, max_tokens: int, temperature: float, seed: int) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": float(temperature),
        }
        if self.send_seed:
            body["seed"] = int(seed)
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        try:
            return self.client.complete(body, chat=self.chat)
        except EndpointStatusError as exc:
            if exc.status not in (400, 413, 422):
                raise BackendError(str(exc)) from None
            if not self.skip_invalid:
                raise InvalidRequestError(str(exc)) from None
        except EndpointError as exc:
            raise BackendError(str(exc)) from None
        with self._lock:
            if not self.failed:
                log.warning(
                    "%s refused a request as invalid (e.g. prompt + max_tokens over "
                    "the model's context): counting it as an empty completion",
                    self.api,
                )
            self.failed += 1
        return ""

    def complete(self, prompts, *, max_tokens=256, temperature=0.7, n=1, seed=0):
        _check_args(prompts, max_tokens, temperature, n)
        jobs = [(i, j) for i in range(len(prompts)) for j in range(n)]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            texts = list(
                pool.map(
                    lambda ij: self._one(
                        prompts[ij[0]], max_tokens, temperature, seed + ij[0] * n + ij[1]
                    ),
                    jobs,
                )
            )
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    def close(self) -> None:
        self.client.close()


def make_backend(
    *,
    model: str | None = None,
    endpoint: str | None = None,
    served_model: str | None = None,
    api_key_env: str | None = "PRIVCODE_API_KEY",
    chat: bool = False,
    device: str = "cpu",
    base_model: str | None = None,
    cache_dir: str | None = None,
) -> Backend:
    """Exactly one of ``model`` (local path/preset) or ``endpoint`` (URL)."""
    if (model is None) == (endpoint is None):
        raise BackendError("give exactly one audited model: a local model path or an endpoint URL")
    if endpoint is not None:
        return OpenAIBackend(endpoint, served_model, api_key_env=api_key_env, chat=chat)
    return HFBackend(model, device=device, base_model=base_model, cache_dir=cache_dir)
