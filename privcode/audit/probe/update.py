"""Feature-library update from confirmed leaks: component division + clustering (seed 003, §5.2-5.3).
Design notes: docs/audits.md, "privcode/audit/probe/update.py".

**Component division.** Each confirmed leak, in its context ``x = (t_1..t_n)``, is scored token
by token under a PUBLIC model P that has not seen the private corpus:
``l_i = -log p_P(t_i | x with t_i masked)`` (masked LM, pseudo-NLL),
``l_i = -log p_P(t_i | t_<i)`` (causal LM), or ``l_i`` = 0 outside and 1 inside the value's
span (:class:`SpanScorer`, offline). Tokens with ``l_i <= Q1`` (the instance's lowest quartile)
are template tokens, the rest fragment tokens: the template replaces every fragment run by
the slot symbol; fragments are the runs clipped to the value's span, of at least
:data:`MIN_FRAGMENT_CHARS` characters with a letter or digit.
**Clustering.** L2-normalised character 2-4-gram TF vectors, DBSCAN (cosine, ``eps``,
``min_samples``); noise is dropped, each cluster joins Lambda(a) of its members' majority ``a``.

PRIVACY: fragments are pieces of private values; the updated library is saved only in the run
directory, and :func:`update_library` returns counts.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from privcode.audit.probe.library import FeatureLibrary
from privcode.audit.probe.taxonomy import ATTRIBUTES
from privcode.errors import PrivcodeError

__all__ = [
    "CausalLMScorer",
    "Leak",
    "MaskedLMScorer",
    "SpanScorer",
    "cluster_strings",
    "divide",
    "load_scorer",
    "update_library",
]

MIN_FRAGMENT_CHARS = 2


class ScorerError(PrivcodeError, ValueError):
    """The public scoring model cannot be loaded (names the path)."""


@dataclass(frozen=True)
class Leak:
    """A confirmed leak as the update sees it: attribute, value and its context text."""

    attribute: str
    value: str
    context: str


Scored = list[tuple[int, int, float]]  # (start, end, nll) per token, offsets into the text


class SpanScorer:
    """No-model fallback: word/punctuation tokens; NLL 1 inside the value's span, 0 outside."""

    name = "span"

    def score(self, text: str, span: tuple[int, int]) -> Scored:
        a, b = span
        return [
            (m.start(), m.end(), 1.0 if a <= m.start() < b else 0.0)
            for m in re.finditer(r"\w+|[^\w\s]", text)
        ]


class _HFScorer:
    """A public HF model's per-token scorer: the tokenizer (fast, for offsets) here, the
    model from the subclass's :meth:`_load`, which sets ``model`` and ``limit``."""

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        cache_dir: str | None = None,
        dtype: Any = None,
    ):
        from privcode.models.loading import ModelLoadError, load_tokenizer, resolve_model_path

        try:
            self.dir = resolve_model_path(path, cache_dir=cache_dir, progress=False)
            self.tokenizer = load_tokenizer(self.dir)
        except ModelLoadError as exc:
            raise ScorerError(f"public scoring model {path}: {exc}") from exc
        if not getattr(self.tokenizer, "is_fast", False):
            raise ScorerError(f"public scoring model {path}: needs a fast tokenizer (offsets)")
        self.device, self.dtype = device, dtype  # dtype None: float32 weights
        self.name = str(path)
        self._load()

    def _load(self) -> None:
        raise NotImplementedError

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


class CausalLMScorer(_HFScorer):
    """l_i = -log p(t_i | t_<i) under a public causal LM (see the module docstring)."""

    def _load(self) -> None:
        from privcode.models.loading import load_causal_lm

        self.model = load_causal_lm(self.dir, dtype=self.dtype, device=self.device)
        tok = self.tokenizer
        self.start = next(
            i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, 0) if i is not None
        )
        self.limit = getattr(self.model.config, "max_position_embeddings", None) or 1024

    def score(self, text: str, span: tuple[int, int]) -> Scored:
        import torch

        ids, offsets = self._encode(text)
        ids, offsets = ids[: self.limit - 1], offsets[: self.limit - 1]
        if not ids:
            return []
        x = torch.tensor([[self.start] + ids], device=self.device)
        with torch.inference_mode():
            logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
        nll = -logp[torch.arange(len(ids)), torch.tensor(ids, device=self.device)]
        return [(a, b, float(v)) for (a, b), v in zip(offsets, nll.tolist(), strict=True)]


class MaskedLMScorer(_HFScorer):
    """The seed's pseudo-NLL: l_i = -log p(t_i | x with t_i masked) under a masked LM."""

    def _load(self) -> None:
        from transformers import AutoModelForMaskedLM

        extra = {} if self.dtype is None else {"dtype": self.dtype}
        self.model = AutoModelForMaskedLM.from_pretrained(self.dir, local_files_only=True, **extra)
        self.model.to(self.device).eval()
        if self.tokenizer.mask_token_id is None:
            raise ScorerError(f"public scoring model {self.name}: the tokenizer has no mask token")
        self.limit = getattr(self.model.config, "max_position_embeddings", None) or 512

    def score(self, text: str, span: tuple[int, int]) -> Scored:
        import torch

        tok = self.tokenizer
        enc = tok(
            text,
            add_special_tokens=True,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
            truncation=True,
            max_length=self.limit,
        )
        ids = list(enc["input_ids"])
        pos = [i for i, special in enumerate(enc["special_tokens_mask"]) if not special]
        if not pos:
            return []
        rows = torch.arange(len(pos))
        cols = torch.tensor(pos)
        batch = torch.tensor([ids] * len(pos))
        batch[rows, cols] = tok.mask_token_id
        targets = torch.tensor([ids[i] for i in pos], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=batch.to(self.device)).logits[rows, cols].float()
        nll = -torch.log_softmax(logits, dim=-1)[rows, targets]
        offsets = [tuple(enc["offset_mapping"][i]) for i in pos]
        return [(a, b, float(v)) for (a, b), v in zip(offsets, nll.tolist(), strict=True)]


def load_scorer(
    path: str | Path | None,
    device: str = "cpu",
    cache_dir: str | None = None,
    dtype: Any = None,
):
    """A masked-LM scorer when ``path`` is a masked LM, a causal-LM scorer otherwise; None -> span.

    ``dtype``: the model's weights (None: float32); the NLLs come from float32 logits.
    """
    if path is None:
        return SpanScorer()
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_MASKED_LM_MAPPING,
    )

    from privcode.models.loading import ModelLoadError, resolve_model_path

    try:
        directory = resolve_model_path(path, cache_dir=cache_dir, progress=False)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise ScorerError(f"public scoring model {path}: {exc}") from exc
    # Masked first: encoders such as BERT / RoBERTa (CodeBERT) also have a causal-LM class.
    if type(config) in MODEL_FOR_MASKED_LM_MAPPING:
        return MaskedLMScorer(directory, device, cache_dir, dtype)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return CausalLMScorer(directory, device, cache_dir, dtype)
    raise ScorerError(
        f"public scoring model {path}: a {config.model_type!r} model is neither a "
        "causal nor a masked LM"
    )


def divide(leak: Leak, scored: Scored) -> tuple[str | None, list[str]]:
    """(abstract template or None, fragments) of one leak (component division, §5.2)."""
    text = leak.context
    start = text.find(leak.value)
    if start < 0 or not scored:
        return None, []
    span = (start, start + len(leak.value))
    q1 = float(np.quantile([s for _, _, s in scored], 0.25))
    frag = [s > q1 for _, _, s in scored]
    slot = ATTRIBUTES[leak.attribute].slot
    template, fragments, pos = [], [], 0
    i = 0
    while i < len(scored):
        a, b, _ = scored[i]
        if not frag[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(scored) and frag[j + 1]:
            j += 1
        run_a, run_b = a, scored[j][1]
        template += [text[pos:run_a], slot]
        pos = run_b
        lo, hi = max(run_a, span[0]), min(run_b, span[1])
        piece = text[lo:hi].strip() if lo < hi else ""
        if len(piece) >= MIN_FRAGMENT_CHARS and re.search(r"[A-Za-z0-9]", piece):
            fragments.append(piece)
        i = j + 1
    template.append(text[pos:])
    abstract = "".join(template).strip()
    abstract = re.sub(re.escape(slot) + r"(?:\s*" + re.escape(slot) + r")+", slot, abstract)
    covers_value = any(
        frag[k] and scored[k][0] < span[1] and scored[k][1] > span[0] for k in range(len(scored))
    )
    return (abstract if covers_value and slot in abstract else None), fragments


def cluster_strings(strings: Sequence[str], *, eps: float = 0.5, min_samples: int = 3) -> list[int]:
    """DBSCAN labels (-1 = noise) of strings as char 2-4-gram TF vectors, cosine distance."""
    if not strings:
        return []
    from sklearn.cluster import DBSCAN
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), lowercase=True, use_idf=False)
    try:
        x = vec.fit_transform(list(strings))
    except ValueError:  # no n-grams at all (e.g. single characters)
        return [-1] * len(strings)
    return DBSCAN(eps=eps, min_samples=min_samples, metric="cosine").fit(x).labels_.tolist()


def _keep_clusters(
    items: list[tuple[str, str]], eps: float, min_samples: int
) -> dict[str, list[str]]:
    """attribute -> strings of the dense clusters assigned to it (majority attribute)."""
    unique = list(dict.fromkeys(items))
    labels = cluster_strings([s for _, s in unique], eps=eps, min_samples=min_samples)
    clusters: dict[int, list[tuple[str, str]]] = {}
    for (attr, s), label in zip(unique, labels, strict=True):
        if label >= 0:
            clusters.setdefault(label, []).append((attr, s))
    out: dict[str, list[str]] = {}
    for label in sorted(clusters):
        members = clusters[label]
        votes = Counter(a for a, _ in members)
        attr = sorted(votes, key=lambda a: (-votes[a], a))[0]
        out.setdefault(attr, []).extend(s for _, s in members)
    return out


def update_library(
    library: FeatureLibrary,
    leaks: Sequence[Leak],
    scorer=None,
    *,
    eps: float = 0.5,
    min_samples: int = 3,
) -> dict[str, object]:
    """Divide, cluster and add to ``library`` in place; return counts only.

    ``scorer``: a :class:`CausalLMScorer` / :class:`MaskedLMScorer` /
    :class:`SpanScorer` (None: span). Leaks are deduplicated by (attribute, context).
    """
    scorer = scorer or SpanScorer()
    templates: list[tuple[str, str]] = []
    fragments: list[tuple[str, str]] = []
    for leak in dict.fromkeys(leaks):
        start = leak.context.find(leak.value)
        if start < 0:
            leak = Leak(leak.attribute, leak.value, leak.value)
            start = 0
        scored = scorer.score(leak.context, (start, start + len(leak.value)))
        template, frags = divide(leak, scored)
        if template:
            templates.append((leak.attribute, template))
        fragments += [(leak.attribute, f) for f in frags]
    kept_t = _keep_clusters(templates, eps, min_samples)
    kept_f = _keep_clusters(fragments, eps, min_samples)
    added: dict[str, dict[str, int]] = {}
    for attr in sorted(set(kept_t) | set(kept_f)):
        nt, nf = library.add(attr, templates=kept_t.get(attr, ()), fragments=kept_f.get(attr, ()))
        if nt or nf:
            added[attr] = {"templates": nt, "fragments": nf}
    return {
        "leaks": len(set(leaks)),
        "scorer": getattr(scorer, "name", type(scorer).__name__),
        "templates_divided": len(templates),
        "fragments_divided": len(fragments),
        "templates_kept": sum(len(v) for v in kept_t.values()),
        "fragments_kept": sum(len(v) for v in kept_f.values()),
        "added": added,
    }
