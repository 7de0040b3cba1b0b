"""Ray Serve LLM's vLLM server with a plain-dict entry point: :class:`PrivcodeLLMServer`.

Imported only where vLLM is installed (the vLLM replicas and the builder of
:mod:`privcode.serve.premium_llm`). :meth:`PrivcodeLLMServer.complete` takes the OpenAI
completions request the guarded ingress built (:func:`~privcode.serve.premium_llm.
engine_payload`), runs it through ``LLMServer.completions`` (vLLM's continuous batching,
LoRA multiplexing) and answers the response as a dict, so no vLLM type crosses the
deployment handle and the ingress needs no vLLM. An engine error comes back as Ray's error
response dict (``{"error": {"code", ...}}``), which the ingress turns into a status that names
no input.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest
from ray.serve.llm.deployment import LLMServer

__all__ = ["PrivcodeLLMServer"]


class PrivcodeLLMServer(LLMServer):
    """``LLMServer`` plus :meth:`complete` (dict in, dict out, not streamed) and :meth:`stream`
    (dict in, a stream of chunk dicts out: call it with ``handle.options(stream=True)``)."""

    async def stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request = CompletionRequest(**{**payload, "stream": True})
        out = await self.completions(request)
        async for batch in out:  # lists of "data: {json}\n\n" strings (or error responses)
            for item in batch if isinstance(batch, list) else [batch]:
                if hasattr(item, "model_dump"):
                    yield item.model_dump()
                    continue
                for line in str(item).splitlines():
                    data = line.removeprefix("data: ").strip()
                    if data and data != "[DONE]" and line.startswith("data: "):
                        yield json.loads(data)

    async def complete(self, payload: dict[str, Any]) -> dict[str, Any]:
        request = CompletionRequest(**payload)
        stream = await self.completions(request)
        async for response in stream:  # not streamed: one response (or one error)
            return response.model_dump() if hasattr(response, "model_dump") else dict(response)
        return {"error": {"code": 500, "type": "EmptyResponse", "message": "no response"}}
