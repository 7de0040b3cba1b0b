"""The LLM filters as Ray Data LLM processors: vLLM engines on GPUs (``extractor=vllm``,
``summarizer=vllm``).

The extractor (M_ext) or the summariser (M_r) becomes a ``ray.data.llm`` processor spliced
into the streaming dataset: tokenise on CPUs, ``synth.vllm_engines`` vLLM engines of
``synth.vllm_tensor_parallel_size`` GPUs each, detokenise; greedy,
``synth.llm_max_new_tokens`` tokens. The extractor writes ``prompt``; the summariser writes
``summary`` for the rows that passed execution, and the round-trip actor then only scores.
Needs ``pip install 'privcode[vllm]'`` and GPUs; the processor's config is built and checked
without either. Design notes: docs/methods.md, "synth/llm_stages.py".
"""

from __future__ import annotations

from typing import Any

from privcode.config import SynthConfig
from privcode.synth.extract import clean_text, offline_instruction

__all__ = ["VLLM_ROLES", "apply_vllm_stage", "vllm_processor_config"]

#: A role's task, its answer label, and the column it writes.
VLLM_ROLES = {
    "extractor": (
        "Here is a Python code snippet. Write the instruction a user could have given "
        "to get exactly this code. Reply with the instruction only.",
        "prompt",
    ),
    "summarizer": ("Summarise in one or two sentences what this Python code does.", "summary"),
}
_MAX_CODE_CHARS = 6000


def vllm_processor_config(cfg: SynthConfig, role: str) -> Any:
    """The ``vLLMEngineProcessorConfig`` of ``role`` (extractor or summarizer)."""
    from ray.data.llm import vLLMEngineProcessorConfig

    if role not in VLLM_ROLES:
        raise ValueError(f"unknown LLM role {role!r}; known: {', '.join(VLLM_ROLES)}")
    model = getattr(cfg, f"{role}_model")
    if not model:
        raise ValueError(f"synth.{role}=vllm needs synth.{role}_model (a local model path)")
    engine = {
        "max_model_len": cfg.vllm_max_model_len,
        "tensor_parallel_size": cfg.vllm_tensor_parallel_size,
        "enable_prefix_caching": True,  # every request starts with the same task text
    }
    if cfg.dtype != "auto":
        engine["dtype"] = cfg.dtype
    batch = (cfg.extract_batch_size if role == "extractor" else cfg.roundtrip_batch_size) or 64
    return vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs=engine,
        concurrency=cfg.vllm_engines,
        batch_size=batch,
        max_concurrent_batches=cfg.llm_concurrency,
        accelerator_type=cfg.vllm_accelerator_type or None,
    )


def _request(role: str, max_tokens: int):  # noqa: ANN202 - a row function for Ray Data
    task, _ = VLLM_ROLES[role]

    def preprocess(row: dict[str, Any]) -> dict[str, Any]:
        code = str(row["code"])[:_MAX_CODE_CHARS]
        skip = role == "summarizer" and not bool(row.get("exec_passed"))
        return {
            "messages": [{"role": "user", "content": f"{task}\n\n```python\n{code}\n```"}],
            "sampling_params": {"temperature": 0.0, "max_tokens": 1 if skip else max_tokens},
        }

    return preprocess


def _answer(role: str, columns: tuple[str, ...]):  # noqa: ANN202 - a row function for Ray Data
    _, column = VLLM_ROLES[role]

    def postprocess(row: dict[str, Any]) -> dict[str, Any]:

        out = {k: row[k] for k in columns if k in row}
        text = clean_text(str(row.get("generated_text") or ""))
        if role == "extractor":
            cond = str(row.get("cond_prompt") or "")
            out[column] = cond or text or offline_instruction(str(row["code"]))
        else:
            out[column] = text if bool(row.get("exec_passed")) else ""
        return out

    return postprocess


def apply_vllm_stage(ds: Any, cfg: SynthConfig, role: str, columns: tuple[str, ...]) -> Any:
    """``ds`` through the ``role`` processor; rows keep ``columns`` plus the role's column."""
    from ray.data.llm import build_processor

    processor = build_processor(
        vllm_processor_config(cfg, role),
        preprocess=_request(role, cfg.llm_max_new_tokens),
        postprocess=_answer(role, columns),
    )
    return processor(ds)
