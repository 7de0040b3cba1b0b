"""Stage II round-trip filter (docs/methods.md, Stage II).
Design notes: docs/methods.md, "synth/roundtrip.py".

A public summariser M_r describes each generated snippet c_i; the pair ``(p_i, c_i)`` is kept
when ``sim(summary_i, p_i) >= tau_sim``, which removes pairs whose instruction does not
describe the code. Registries (name -> class, options passed through): :data:`SUMMARIZERS`
(``"offline"``: :class:`OfflineSummarizer`, from the AST, never the docstring;
``"hf"``: :class:`HFSummarizer`) and :data:`SCORERS` (``"embedding"``:
:class:`~privcode.models.embedding.EmbeddingScorer`; ``"bertscore"``:
:class:`BERTScoreScorer`). The authors' setting, BERTScore F1 >= 0.88, is
:data:`DEFAULT_THRESHOLDS` ``["bertscore"]``. Everything is offline (``HF_HUB_OFFLINE=1`` is
set unless already set) and models load lazily on the first batch.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from privcode.models.embedding import (
    EmbeddingScorer,
    check_pairs,
    length_batches,
    offline_env,
)
from privcode.registry import build
from privcode.synth.extract import HFGenerator, clean_text, split_identifier

__all__ = [
    "DEFAULT_THRESHOLDS",
    "SCORERS",
    "SUMMARIZERS",
    "BERTScoreScorer",
    "HFSummarizer",
    "OfflineSummarizer",
    "RoundTripFilter",
    "Scorer",
    "Summarizer",
    "make_scorer",
    "make_summarizer",
    "offline_summary",
]

_SUMMARY_CHARS = 600
_ITEMS = 6  # names per clause of the offline summary


@runtime_checkable
class Summarizer(Protocol):
    """M_r: one natural-language summary per code string, same order."""

    name: str

    def summarize(self, codes: Sequence[str]) -> list[str]: ...


@runtime_checkable
class Scorer(Protocol):
    """Pairwise similarity: ``score(a, b)[i] = sim(a[i], b[i])``."""

    name: str

    def score(self, a: Sequence[str], b: Sequence[str]) -> list[float]: ...


# --------------------------------------------------------------------------- summarisers


def _words(names: Sequence[str], limit: int = _ITEMS) -> str:
    out: list[str] = []
    for name in names:
        phrase = " ".join(split_identifier(name))
        if phrase and phrase not in out:
            out.append(phrase)
        if len(out) >= limit:
            break
    return ", ".join(out)


def _names_in(node: ast.AST | None) -> list[str]:
    """Identifiers (and short word-like string constants) in an expression, in source order."""
    if node is None:
        return []
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.append((n.lineno, n.col_offset, n.id))
        elif isinstance(n, ast.Attribute):
            found.append((n.lineno, n.end_col_offset, n.attr))
        elif (
            isinstance(n, ast.Constant)
            and isinstance(n.value, str | int | float | bool)
            and (not isinstance(n.value, str) or re.fullmatch(r"\w{1,30}", n.value))
        ):
            found.append((n.lineno, n.col_offset, str(n.value)))
    return [name for *_, name in sorted(found)]


def _body_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node below ``node``, its docstring excluded."""
    body = list(getattr(node, "body", []))
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    out: list[ast.AST] = []
    for stmt in body:
        out.extend(ast.walk(stmt))
    return sorted(out, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))


def _body_facts(nodes: list[ast.AST]) -> list[str]:
    calls, attrs, loops, checks, returns, raises = ([] for _ in range(6))
    for n in nodes:
        if isinstance(n, ast.Call):
            f = n.func
            calls.append(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
        elif isinstance(n, ast.Attribute):
            attrs.append(n.attr)
        elif isinstance(n, ast.For | ast.AsyncFor | ast.comprehension):
            loops.extend(_names_in(n.iter))
        elif isinstance(n, ast.While | ast.If | ast.IfExp | ast.Assert):
            checks.extend(_names_in(n.test))
        elif isinstance(n, ast.Return | ast.Yield | ast.YieldFrom):
            returns.extend(_names_in(n.value) or ["none"])
        elif isinstance(n, ast.Raise):
            raises.extend(_names_in(n.exc.func if isinstance(n.exc, ast.Call) else n.exc))
    facts = []
    for label, names in (
        ("calls", calls),
        ("uses", [a for a in attrs if a not in calls]),
        ("loops over", loops),
        ("checks", checks),
        ("returns", returns),
        ("raises", raises),
    ):
        text = _words(names)
        if text:
            facts.append(f"{label} {text}")
    return facts


def _describe_def(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
    kind = "method" if params[:1] in (["self"], ["cls"]) else "function"
    params = [p for p in params if p not in ("self", "cls")]
    head = f"{kind} {' '.join(split_identifier(node.name)) or node.name}"
    if params:
        head += f" taking {_words(params)}"
    return "; ".join([head, *_body_facts(_body_nodes(node))])


def offline_summary(code: str, limit: int = _SUMMARY_CHARS) -> str:
    """What the code does, from its body only (docstrings excluded). Never raises."""
    try:
        try:
            tree = ast.parse(code if isinstance(code, str) else str(code))
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            words = _words(re.findall(r"[A-Za-z_]\w{2,}", str(code)[:5000]), 12)
            return clean_text(f"code mentioning {words}" if words else "code", limit)
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        if defs:
            text = _describe_def(defs[0])
        elif classes:
            cls = classes[0]
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            head = f"class {' '.join(split_identifier(cls.name)) or cls.name}"
            if cls.bases:
                head += f" based on {_words([ast.unparse(b) for b in cls.bases])}"
            if methods:
                head += f" with methods {_words([m.name for m in methods], 10)}"
            facts = _body_facts([n for m in methods for n in _body_nodes(m)])
            text = "; ".join([head, *facts])
        else:
            facts = _body_facts(_body_nodes(tree))
            text = "; ".join(["script", *facts]) if facts else "empty script"
        return clean_text(text, limit)
    except Exception:  # hostile input: never let one snippet fail the batch
        return "code"


class OfflineSummarizer:
    """M_r without a model: :func:`offline_summary` of each snippet."""

    name = "offline"

    def __init__(self, max_chars: int = _SUMMARY_CHARS) -> None:
        self.max_chars = int(max_chars)

    def summarize(self, codes: Sequence[str]) -> list[str]:
        return [offline_summary(c, self.max_chars) for c in codes]


_SUMMARY_TASK = "Summarise in one or two sentences what this Python code does."


class HFSummarizer:
    """M_r with a local HF instruct model (greedy, batched; see :class:`HFGenerator`)."""

    name = "hf"

    def __init__(self, model: str, *, max_chars: int = _SUMMARY_CHARS, **generation: Any) -> None:
        self.generator = HFGenerator(model, **generation)
        self.max_chars = int(max_chars)

    def summarize(self, codes: Sequence[str]) -> list[str]:
        prompts = [self.generator.format(_SUMMARY_TASK, str(c), "Summary") for c in codes]
        return [clean_text(s, self.max_chars) for s in self.generator.generate(prompts)]


# --------------------------------------------------------------------------- scorers


class BERTScoreScorer:
    """BERTScore F1 with a local HF encoder; idf off, special tokens excluded.

    Each text is encoded (``layer``: index into ``hidden_states``, default
    the last layer), token vectors are L2-normalised, and for candidate x and
    reference y: P = mean over x tokens of the max cosine to a y token,
    R = the same from y to x, F1 = 2PR / (P + R). Texts are truncated to
    ``max_length`` tokens and encoded in length-sorted batches of at most
    ``batch_size`` texts and ``token_budget`` padded tokens (:func:`length_batches`). A text with no tokens scores 0. ``dtype`` (None =
    the checkpoint's float32) is the encoder's weights' dtype on ``device``;
    the cosines are computed in float32 whatever it is.
    """

    name = "bertscore"

    def __init__(
        self,
        model: str | None = None,
        layer: int | None = None,
        batch_size: int = 32,
        max_length: int = 512,
        device: str | None = None,
        dtype: Any = None,
        token_budget: int = 8192,
    ) -> None:
        if not model:
            raise ValueError("the bertscore scorer needs model=<local HF encoder directory>")
        self.model_path, self.layer = str(model), layer
        self.batch_size, self.max_length, self.device = int(batch_size), int(max_length), device
        self.dtype, self.token_budget = dtype, int(token_budget)
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        if self._model is None:
            offline_env()
            from transformers import AutoModel, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            if tok.pad_token is None:  # decoder tokenizers: padded positions are masked anyway
                tok.pad_token = tok.eos_token or tok.unk_token
            self._tokenizer = tok
            extra = {} if self.dtype is None else {"dtype": self.dtype}
            model = AutoModel.from_pretrained(self.model_path, local_files_only=True, **extra)
            self._model = model.to(self.device).eval() if self.device else model.eval()

    def token_embeddings(self, texts: Sequence[str]) -> list[Any]:
        """Per text: a (tokens, hidden) tensor of unit-norm contextual embeddings."""
        import torch

        self._load()
        tok, model = self._tokenizer, self._model
        texts = [str(t) for t in texts]
        lengths = [
            len(x) for x in tok(texts, truncation=True, max_length=self.max_length)["input_ids"]
        ]
        out: list[Any] = [None] * len(texts)
        # Length-sorted batches within token_budget (at most batch_size texts): no batch pads
        # to the longest text of the call, and peak activations stay bounded.
        for rows in length_batches(lengths, self.token_budget, self.batch_size):
            chunk = [texts[i] for i in rows]
            enc = tok(
                chunk,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_special_tokens_mask=True,
            )
            keep = enc.pop("special_tokens_mask").eq(0) & enc["attention_mask"].bool()
            enc = {k: v.to(model.device) for k, v in enc.items()}
            with torch.inference_mode():
                res = model(**enc, output_hidden_states=self.layer is not None)
            hidden = res.last_hidden_state if self.layer is None else res.hidden_states[self.layer]
            hidden = torch.nn.functional.normalize(hidden.float().cpu(), dim=-1)
            for j, i in enumerate(rows):
                out[i] = hidden[j][keep[j]]
        return out

    def score(self, a: Sequence[str], b: Sequence[str]) -> list[float]:
        check_pairs(a, b)
        if not a:
            return []
        emb = self.token_embeddings([*a, *b])
        scores = []
        for x, y in zip(emb[: len(a)], emb[len(a) :], strict=True):
            if len(x) == 0 or len(y) == 0:
                scores.append(0.0)
                continue
            sim = x @ y.T
            p, r = sim.max(dim=1).values.mean(), sim.max(dim=0).values.mean()
            scores.append(float(2 * p * r / (p + r)) if float(p + r) > 0 else 0.0)
        return scores


class EndpointSummarizer(HFSummarizer):
    """M_r through an OpenAI-compatible endpoint (:mod:`privcode.synth.llm_endpoint`)."""

    name = "endpoint"

    def __init__(self, url: str, *, max_chars: int = _SUMMARY_CHARS, **options: Any) -> None:
        from privcode.synth.llm_endpoint import EndpointGenerator

        self.generator = EndpointGenerator(url, **options)  # type: ignore[assignment]
        self.max_chars = int(max_chars)


#: Registries: name -> class. Options are passed to the constructor. (``vllm`` summaries
#: come from a Ray Data stage before the round trip: :mod:`privcode.synth.llm_stages`.)
SUMMARIZERS: dict[str, type] = {
    "offline": OfflineSummarizer,
    "hf": HFSummarizer,
    "endpoint": EndpointSummarizer,
}
SCORERS: dict[str, type] = {"embedding": EmbeddingScorer, "bertscore": BERTScoreScorer}


def make_summarizer(name: str, **options: Any) -> Summarizer:
    """A summariser from :data:`SUMMARIZERS`."""
    return build("summarizer", SUMMARIZERS, name, options)


def make_scorer(name: str, **options: Any) -> Scorer:
    """A similarity scorer from :data:`SCORERS`."""
    return build("scorer", SCORERS, name, options)


#: Default tau_sim per scorer. "bertscore": the authors' BERTScore F1 cut-off
#: (with their 8B M_r). "embedding": calibrated for the offline summariser and
#: MiniLM, see :class:`RoundTripFilter`.
DEFAULT_THRESHOLDS: dict[str, float] = {"embedding": 0.34, "bertscore": 0.88}


class RoundTripFilter:
    """Keep ``(prompt, code)`` when sim(M_r(code), prompt) >= ``threshold``.

    ``summarizer`` / ``scorer``: a registry name (:data:`SUMMARIZERS`, :data:`SCORERS`) or an
    object with the protocol's method. Options are routed by prefix: ``summarizer_model=...``
    goes to the summariser as ``model=...``, ``scorer_batch_size=...`` to the scorer as
    ``batch_size``. ``threshold=None`` takes :data:`DEFAULT_THRESHOLDS` for the scorer's name:
    0.88 for ``bertscore`` (the authors', with an 8B instruct M_r); 0.34 for ``offline`` +
    ``embedding``, the equal error point on public stdlib pairs, never private data
    (calibration: docs/methods.md, "synth/roundtrip.py").
    """

    def __init__(
        self,
        summarizer: str | Summarizer = "offline",
        scorer: str | Scorer = "embedding",
        threshold: float | None = None,
        **options: Any,
    ) -> None:
        routed: dict[str, dict[str, Any]] = {"summarizer": {}, "scorer": {}}
        for key, value in options.items():
            prefix, _, rest = key.partition("_")
            if prefix not in routed or not rest:
                raise ValueError(
                    f"unknown option {key!r}: prefix options with 'summarizer_' or "
                    "'scorer_' (e.g. summarizer_model=..., scorer_model=...)"
                )
            routed[prefix][rest] = value
        self.summarizer = (
            make_summarizer(summarizer, **routed["summarizer"])
            if isinstance(summarizer, str)
            else summarizer
        )
        self.scorer = make_scorer(scorer, **routed["scorer"]) if isinstance(scorer, str) else scorer
        if threshold is None:
            name = getattr(self.scorer, "name", "")
            if name not in DEFAULT_THRESHOLDS:
                raise ValueError(f"no default threshold for scorer {name!r}: pass threshold=")
            threshold = DEFAULT_THRESHOLDS[name]
        self.threshold = float(threshold)

    def summaries(self, codes: Sequence[str]) -> list[str]:
        return self.summarizer.summarize(codes)

    def score(
        self,
        prompts: Sequence[str],
        codes: Sequence[str],
        summaries: Sequence[str] | None = None,
    ) -> list[float]:
        """sim(M_r(code_i), prompt_i) for each pair (``summaries``: M_r's, made upstream)."""
        check_pairs(prompts, codes)
        if not codes:
            return []
        if summaries is None:
            summaries = self.summaries(codes)
        check_pairs(summaries, codes)
        return self.scorer.score([str(s) for s in summaries], [str(p) for p in prompts])

    def verdicts(
        self, prompts: Sequence[str], codes: Sequence[str]
    ) -> tuple[list[float], list[bool]]:
        """Scores and keep flags from one pass (for a pipeline that records both)."""
        scores = self.score(prompts, codes)
        return scores, [s >= self.threshold for s in scores]

    def keep(self, prompts: Sequence[str], codes: Sequence[str]) -> list[bool]:
        """score >= threshold for each pair."""
        return self.verdicts(prompts, codes)[1]
