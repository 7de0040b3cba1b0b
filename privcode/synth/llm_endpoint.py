"""M_ext and M_r through an OpenAI-compatible completions endpoint.
Design notes: docs/methods.md, "synth/llm_endpoint.py".

``extractor=endpoint`` / ``summarizer=endpoint`` send each prompt to
``POST <synth.llm_endpoint>/v1/completions`` (temperature 0); ``synth.llm_concurrency``
requests are in flight from each actor, batching is the server's, the actor needs no GPU.
What is sent is post-processing of the DP release (generated code), never private data. The
transport is :class:`privcode.models.endpoint.EndpointClient`; each answer is cut to
``max_response_chars``. The bearer token comes from the environment variable
``synth.llm_api_key_env``; plain http is refused except to a loopback address.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from privcode.models.endpoint import EndpointClient, EndpointError, check_endpoint_url

__all__ = ["EndpointGenerator", "endpoint_options"]

_KEY = "synth.llm_endpoint"


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
        if max_new_tokens < 1 or concurrency < 1:
            raise ValueError("max_new_tokens and concurrency must be >= 1")
        self.model = model
        self.max_new_tokens, self.concurrency = int(max_new_tokens), int(concurrency)
        self.max_code_chars, self.max_response_chars = int(max_code_chars), int(max_response_chars)
        self.client = EndpointClient(
            url,
            api_key_env=api_key_env,
            timeout_s=timeout,
            retries=retries,
            backoff_s=backoff,
            concurrency=self.concurrency,
            # JSON framing and escapes around the text
            max_answer_bytes=4 * self.max_response_chars + 4096,
            key=_KEY,
        )

    def format(self, task: str, code: str, label: str) -> str:
        """The prompt: ``task``, the code (cut to ``max_code_chars``) and the answer cue."""
        return f"{task}\n\n```python\n{str(code)[: self.max_code_chars]}\n```\n\n{label}:"

    def _one(self, prompt: str) -> str:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": self.max_new_tokens,
            "temperature": 0.0,
        }
        if self.model:
            body["model"] = self.model
        return self.client.complete(body)[: self.max_response_chars]

    def generate(self, prompts: Sequence[str]) -> list[str]:
        """Greedy continuations of ``prompts``, in order."""
        if not prompts:
            return []
        with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._one, prompts))


def endpoint_options(cfg: Any, model: str) -> dict[str, Any]:
    """The options of an ``endpoint`` extractor/summariser from ``synth.*``."""
    if not cfg.llm_endpoint:
        raise EndpointError(f"{_KEY} is empty; the endpoint extractor/summariser needs it")
    check_endpoint_url(cfg.llm_endpoint, _KEY)
    return {
        "url": cfg.llm_endpoint,
        "model": model,
        "api_key_env": cfg.llm_api_key_env,
        "concurrency": cfg.llm_concurrency,
    }
