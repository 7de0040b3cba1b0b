"""M_ext and M_r through an OpenAI-compatible completions endpoint.

``extractor=endpoint`` / ``summarizer=endpoint`` send each prompt to
``POST <synth.llm_endpoint>/v1/completions`` (``{"model", "prompt",
"max_tokens", "temperature": 0}``): vLLM's OpenAI server, a provider, or this
project's own premium Ray Serve app (which takes one prompt per request).
Batching is the server's: ``synth.llm_concurrency`` requests are in flight at
once from each actor, and vLLM's continuous batching or Serve's dynamic
batching groups them on the accelerator. The actor itself needs no GPU.

What is sent is post-processing of the DP release (generated code), never
private data. The server is treated as untrusted: each answer is capped at
``max_response_chars``, each request has a timeout, 429/5xx/connection
errors are retried ``retries`` times with exponential backoff, and a failure
names the URL and the HTTP status, never a prompt or an answer. The bearer
token comes from the environment variable ``synth.llm_api_key_env``; plain
http is refused except to a loopback address (the token would travel in the clear).
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from privcode.errors import PrivcodeError

__all__ = ["EndpointError", "EndpointGenerator", "check_endpoint_url"]

_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class EndpointError(PrivcodeError):
    """The completions endpoint is misconfigured or kept failing."""


def check_endpoint_url(url: str, key: str = "synth.llm_endpoint") -> str:
    """``url`` without a trailing slash (and without ``/v1``); refuses what is not http(s),
    and plain http to anything but a loopback host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EndpointError(f"{key}: need an http(s) URL such as https://llm.internal:8000")
    if parts.scheme == "http":
        host = parts.hostname
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise EndpointError(
                f"{key}: plain http to {host} would send the API token and the samples in the "
                "clear; use https (or a loopback address)"
            )
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class EndpointGenerator:
    """Greedy completions from an OpenAI-compatible endpoint, ``concurrency`` in flight.

    Same contract as :class:`privcode.synth.extract.HFGenerator` (``format``,
    ``generate``), so the extractor and the summariser use either.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str = "",
        api_key_env: str = "PRIVCODE_LLM_API_KEY",
        max_new_tokens: int = 96,
        concurrency: int = 8,
        timeout: float = 60.0,
        retries: int = 3,
        max_code_chars: int = 6000,
        max_response_chars: int = 8192,
        backoff: float = 0.5,
    ) -> None:
        if max_new_tokens < 1 or concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("max_new_tokens, concurrency >= 1, retries >= 0 and timeout > 0")
        self.base = check_endpoint_url(url)
        self.model = model
        self.api_key_env = api_key_env
        self.max_new_tokens, self.concurrency = int(max_new_tokens), int(concurrency)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.max_code_chars, self.max_response_chars = int(max_code_chars), int(max_response_chars)
        self._session: Any = None

    def _headers(self) -> dict[str, str]:
        token = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _open(self) -> Any:
        if self._session is None:
            import requests
            from requests.adapters import HTTPAdapter

            session = requests.Session()
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=self.concurrency)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            session.headers.update(self._headers())
            self._session = session
        return self._session

    def format(self, task: str, code: str, label: str) -> str:
        """The prompt: ``task``, the code (cut to ``max_code_chars``) and the answer cue."""
        return f"{task}\n\n```python\n{str(code)[: self.max_code_chars]}\n```\n\n{label}:"

    def _one(self, prompt: str) -> str:
        import requests

        body = {"prompt": prompt, "max_tokens": self.max_new_tokens, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        url = f"{self.base}/v1/completions"
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = self._open().post(url, json=body, timeout=self.timeout, stream=True)
            except requests.RequestException as exc:
                why = type(exc).__name__
                continue
            with resp:
                if resp.status_code in _RETRY_STATUS:
                    why = f"HTTP {resp.status_code}"
                    continue
                if resp.status_code != 200:
                    raise EndpointError(f"{url}: HTTP {resp.status_code} (not retried)")
                return self._text(resp, url)
        raise EndpointError(f"{url}: failed {self.retries + 1} times (last: {why})")

    def _text(self, resp: Any, url: str) -> str:
        """The first choice's text of a bounded JSON answer."""
        import json

        limit = 4 * self.max_response_chars + 4096  # JSON framing and escapes around the text
        raw = resp.raw.read(limit + 1, decode_content=True)
        if len(raw) > limit:
            raise EndpointError(f"{url}: answer larger than {limit} bytes")
        try:
            text = json.loads(raw)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"{url}: not an OpenAI completions answer") from None
        if not isinstance(text, str):
            raise EndpointError(f"{url}: not an OpenAI completions answer")
        return text[: self.max_response_chars]

    def generate(self, prompts: Sequence[str]) -> list[str]:
        """Greedy continuations of ``prompts``, in order."""
        if not prompts:
            return []
        with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._one, prompts))


def endpoint_options(cfg: Any, model: str) -> dict[str, Any]:
    """The options of an ``endpoint`` extractor/summariser from ``synth.*``."""
    if not cfg.llm_endpoint:
        raise EndpointError(
            "synth.llm_endpoint is empty; the endpoint extractor/summariser needs it"
        )
    check_endpoint_url(cfg.llm_endpoint)
    return {
        "url": cfg.llm_endpoint,
        "model": model,
        "api_key_env": cfg.llm_api_key_env,
        "concurrency": cfg.llm_concurrency,
    }
