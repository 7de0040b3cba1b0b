"""Stage II prompt extraction M_ext(code) -> instruction (docs/methods.md, Stage II).

Each generated snippet c_i becomes an ``(instruction, code)`` pair. :data:`EXTRACTORS` holds
two classes, built once and called on batches (a Ray Data ``map_batches`` actor):
``"offline"`` (:class:`OfflineExtractor`: no model; an instruction from the main unit's
signature, docstring and identifiers, parsed with :mod:`ast`, never compiled or executed: the
snippets are untrusted) and ``"hf"`` (:class:`HFExtractor`: a local instruction-following HF
causal LM, batched greedy decoding, loaded on the first call). Both are deterministic, return
one string per input, never raise on any input string and cap instructions at
:data:`MAX_INSTRUCTION_CHARS`. Design notes: docs/methods.md, "synth/extract.py".
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from privcode.registry import build

__all__ = [
    "EXTRACTORS",
    "MAX_INSTRUCTION_CHARS",
    "Extractor",
    "HFExtractor",
    "HFGenerator",
    "OfflineExtractor",
    "clean_text",
    "make_extractor",
    "offline_instruction",
    "split_identifier",
    "third_person",
]

MAX_INSTRUCTION_CHARS = 500
_SIG_CHARS = 160  # a longer signature is shortened to its parameter names
_LIST_ITEMS = 5  # names listed in "It uses ..."
_DOC_SCAN_CHARS = 4000  # only the head of a (possibly huge) docstring is examined

#: Verbs that commonly start a function name or an imperative docstring.
VERBS = frozenset(
    """
accept add adjust allocate append apply assert assign attach build calculate call cast check
choose clean clear clip close collect combine compare compile compress compute concatenate
configure connect construct convert copy count create crop decode decompress decorate delete
deserialize detect determine divide download draw drop dump emit encode ensure escape evaluate
execute expand export extract fetch fill filter find fit fix flatten flush format generate get
group guess handle hash import increment index initialize insert install invalidate invert
iterate join keep list load lookup lower make map mark match measure merge move multiply
normalize open output pack pad parse partition patch pick plot pop prepare print process push
put quote raise rank read rebuild record reduce refresh register reload remove rename render
reorder repeat replace report request reset resolve restore retrieve return reverse rotate round
run sample save scale scan search select send serialize set setup shift show shuffle simplify
skip slice sort split square start stop store strip substitute subtract sum swap take tell test
tokenize trace transform translate transpose traverse trim truncate unpack unquote unwrap update
upper validate verify visit walk warn wrap write yield zip
""".split()
)
_IRREGULAR = {"be": "is", "have": "has", "do": "does", "go": "goes"}
_PREDICATES = frozenset({"is", "has", "can", "should", "contains"})
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`'\"(\[])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")


@runtime_checkable
class Extractor(Protocol):
    """M_ext: one instruction per code string, same order."""

    name: str

    def extract(self, codes: Sequence[str]) -> list[str]: ...


# --------------------------------------------------------------------------- text helpers


def clean_text(text: str, limit: int = MAX_INSTRUCTION_CHARS) -> str:
    """Control characters removed, whitespace collapsed, cut at a word to ``limit`` chars."""
    text = " ".join(_CONTROL.sub(" ", str(text)).split())
    if len(text) <= limit:
        return text
    cut = text[: max(limit - 3, 1)]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "..."


def split_identifier(name: str) -> list[str]:
    """``parse_HTTPHeader2`` -> ``["parse", "http", "header", "2"]`` (snake and camel case)."""
    return [w.lower() for part in str(name).split("_") for w in _CAMEL.findall(part)]


def third_person(verb: str) -> str:
    """``return`` -> ``returns``, ``process`` -> ``processes``; 3rd-person forms are kept."""
    verb = verb.lower()
    if verb in _IRREGULAR:
        return _IRREGULAR[verb]
    if verb.endswith(("ss", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("s"):
        return verb
    if verb.endswith("y") and len(verb) > 1 and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _is_third_person(word: str) -> bool:
    return (word.endswith("s") and (word[:-1] in VERBS or word[:-2] in VERBS)) or (
        word.endswith("ies") and word[:-3] + "y" in VERBS
    )


def _join_names(names: Sequence[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    para = doc[:_DOC_SCAN_CHARS].strip().split("\n\n", 1)[0]
    if para.lstrip().startswith(">>>"):
        return ""
    return " ".join(para.split())


def _that_clause(sentence: str) -> str | None:
    """``Return the sum.`` -> ``returns the sum.``; None when it does not start with a verb."""
    head, _, tail = sentence.partition(" ")
    word = head.lower()
    if not head.isalpha() or not (word in VERBS or _is_third_person(word)):
        return None
    return " ".join(filter(None, (third_person(word) if word in VERBS else word, tail)))


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else text + "."


def _name_description(name: str) -> str:
    """What a function called ``name`` does, from its words: ``parse_header`` -> "parses header"."""
    words = split_identifier(name)
    if not words:
        return ""
    first, rest = words[0], " ".join(words[1:])
    if first in _PREDICATES:
        return f"returns whether it {first} {rest}".rstrip()
    if first == "to" and rest:
        return f"converts its input to {rest}"
    if first in VERBS:
        return f"{third_person(first)} {rest}".rstrip()
    return "implements " + " ".join(words)


# --------------------------------------------------------------------------- AST helpers


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    sig = f"{node.name}({ast.unparse(node.args)}){ret}"
    if len(sig) <= _SIG_CHARS:
        return sig
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    sig = f"{node.name}({', '.join(names)})"
    return sig if len(sig) <= _SIG_CHARS else f"{node.name}(...)"


def _in_order(nodes: list[ast.AST]) -> list[ast.AST]:
    # ast.walk is breadth-first; sort by position so "uses" lists read in source order.
    return sorted(nodes, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))


def _walk(roots: Sequence[ast.AST]) -> list[ast.AST]:
    return [n for root in roots for n in ast.walk(root)]


def _called_names(roots: Sequence[ast.AST]) -> list[str]:
    calls = _in_order([n for n in _walk(roots) if isinstance(n, ast.Call)])
    out: list[str] = []
    for call in calls:
        func = call.func
        name = (
            func.id
            if isinstance(func, ast.Name)
            else (func.attr if isinstance(func, ast.Attribute) else None)
        )
        if name and name not in out:
            out.append(name)
    return out


def _returned_names(roots: Sequence[ast.AST]) -> list[str]:
    out: list[str] = []
    for node in _in_order([n for n in _walk(roots) if isinstance(n, ast.Return)]):
        value = node.value
        if isinstance(value, ast.Name) and value.id not in out:
            out.append(value.id)
    return out


def _uses_sentence(body: Sequence[ast.stmt], own_name: str | None) -> str:
    """What the body (not the signature's defaults or decorators) calls and returns."""
    calls = _called_names(body)
    recursive = own_name is not None and own_name in calls
    calls = [c for c in calls if c != own_name][:_LIST_ITEMS]
    returns = _returned_names(body)[:3]
    parts = []
    if calls and returns:
        parts.append(f"It uses {_join_names(calls)} and returns {_join_names(returns)}.")
    elif calls:
        parts.append(f"It uses {_join_names(calls)}.")
    elif returns:
        parts.append(f"It returns {_join_names(returns)}.")
    if recursive:
        parts.append("It calls itself recursively.")
    return " ".join(parts)


def _describe_function(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    kind = (
        "an async Python function"
        if isinstance(node, ast.AsyncFunctionDef)
        else "a Python function"
    )
    head = f"Write {kind} `{_signature(node)}`"
    para = _first_paragraph(ast.get_docstring(node))
    if para:
        first, rest = (_SENTENCE_END.split(para, maxsplit=1) + [""])[:2]
        clause = _that_clause(first)
        text = f"{head} that {_sentence(clause)}" if clause else f"{head}. {_sentence(first)}"
        return f"{text} {rest}".strip()
    desc = _name_description(node.name)
    text = f"{head} that {desc}." if desc else f"{head}."
    return f"{text} {_uses_sentence(node.body, node.name)}".strip()


def _describe_class(node: ast.ClassDef) -> str:
    bases = ", ".join(ast.unparse(b) for b in node.bases)
    title = f"{node.name}({bases})" if bases and len(bases) <= 80 else node.name
    methods = [n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    text = f"Write a Python class `{title}`"
    if methods:
        shown = methods[:8]
        listed = ", ".join(f"`{m}`" for m in shown) + (", ..." if len(methods) > len(shown) else "")
        text += f" with {'methods' if len(methods) > 1 else 'method'} {listed}"
    para = _first_paragraph(ast.get_docstring(node))
    return f"{text}. {_sentence(para)}" if para else f"{text}."


def _describe_script(tree: ast.Module) -> str:
    para = _first_paragraph(ast.get_docstring(tree))
    if para:
        return f"Write a Python script. {_sentence(para)}"
    calls = _called_names([tree])[:_LIST_ITEMS]
    return (
        f"Write a Python script that uses {_join_names(calls)}."
        if calls
        else "Write a Python script."
    )


def _generic(code: str) -> str:
    first = next((line.strip() for line in code.splitlines() if line.strip()), "")
    first = clean_text(first, 200)
    return f"Complete the following Python code: {first}" if first else "Write a Python script."


def offline_instruction(code: str, max_chars: int = MAX_INSTRUCTION_CHARS) -> str:
    """The offline instruction for one snippet; never raises (see :class:`OfflineExtractor`)."""
    try:
        code = code if isinstance(code, str) else str(code)
        try:
            tree = ast.parse(code)  # parse only: nothing is compiled to bytecode or run
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return clean_text(_generic(code), max_chars)
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        if defs:
            text = _describe_function(defs[0])
        elif classes:
            text = _describe_class(classes[0])
        else:
            text = _describe_script(tree)
        return clean_text(text, max_chars)
    except Exception:  # hostile input (e.g. nesting that exhausts the recursion limit)
        try:
            return clean_text(_generic(str(code)), max_chars)
        except Exception:
            return "Write a Python script."


# --------------------------------------------------------------------------- extractors


class OfflineExtractor:
    """Instruction from the AST: signature, docstring, identifiers (no model, no execution)."""

    name = "offline"

    def __init__(self, max_chars: int = MAX_INSTRUCTION_CHARS) -> None:
        if not 20 <= int(max_chars) <= MAX_INSTRUCTION_CHARS:
            raise ValueError(f"max_chars must be in [20, {MAX_INSTRUCTION_CHARS}], got {max_chars}")
        self.max_chars = int(max_chars)

    def extract(self, codes: Sequence[str]) -> list[str]:
        return [offline_instruction(code, self.max_chars) for code in codes]


class HFGenerator:
    """Batched greedy generation with a local HF causal LM; shared by M_ext and M_r.

    Loaded lazily on the first :meth:`generate` call (a Ray actor is built
    cheaply, the weights load in the worker). Prompts are left-truncated so the
    generation cue at their end survives and decoded in batches by
    :func:`privcode.models.generate.generate`; code longer than ``max_code_chars``
    is cut first.
    """

    def __init__(
        self,
        model: str,
        *,
        max_new_tokens: int = 96,
        batch_size: int = 8,
        max_input_tokens: int = 1024,
        max_code_chars: int = 6000,
        device: str | None = None,
        dtype: Any = None,
        cache_dir: str | None = None,
    ) -> None:
        if not model:
            raise ValueError("an HF model path (or preset name) is required")
        if max_new_tokens < 1 or batch_size < 1 or max_input_tokens < 8:
            raise ValueError("max_new_tokens and batch_size must be >= 1, max_input_tokens >= 8")
        self.model_path = str(model)
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = int(batch_size)
        self.max_input_tokens = int(max_input_tokens)
        self.max_code_chars = int(max_code_chars)
        self.device, self.dtype, self.cache_dir = device, dtype, cache_dir
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        if self._model is not None:
            return
        from privcode.models.loading import load_causal_lm, load_tokenizer

        tok = load_tokenizer(self.model_path, cache_dir=self.cache_dir)
        model = load_causal_lm(
            self.model_path, dtype=self.dtype, device=self.device, cache_dir=self.cache_dir
        )
        limit = (
            getattr(model.config, "max_position_embeddings", None)
            or getattr(model.config, "n_positions", None)
            or 2048
        )
        self._input_limit = max(8, min(self.max_input_tokens, int(limit) - self.max_new_tokens))
        self._tokenizer, self._model = tok, model

    def format(self, task: str, code: str, label: str) -> str:
        """The prompt: ``task`` plus the code, through the chat template when there is one."""
        self._load()
        code = str(code)[: self.max_code_chars]
        user = f"{task}\n\n```python\n{code}\n```"
        if getattr(self._tokenizer, "chat_template", None):
            try:
                return self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
                )
            except Exception:  # a template that rejects this message shape: use the plain format
                pass
        return f"{user}\n\n{label}:"

    def generate(self, prompts: Sequence[str]) -> list[str]:
        """Greedy continuations of ``prompts`` (new text only, special tokens dropped)."""
        if not prompts:
            return []
        self._load()
        from privcode.models.generate import generate  # torch and transformers: heavy

        tok, limit = self._tokenizer, self._input_limit
        out: list[str] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            ids = [tok(p, add_special_tokens=False)["input_ids"][-limit:] for p in chunk]
            rows = generate(
                self._model,
                tok,
                input_ids=ids,
                max_new_tokens=self.max_new_tokens,
                pad_id=tok.pad_token_id,
            )
            out += [g.text for g in rows]
        return out


_EXTRACT_TASK = (
    "Here is a Python code snippet. Write the instruction a user could have given "
    "to get exactly this code. Reply with the instruction only."
)


class HFExtractor:
    """M_ext with a local instruction-following HF model; empty answers fall back to offline."""

    name = "hf"

    def __init__(
        self, model: str, *, max_chars: int = MAX_INSTRUCTION_CHARS, **generation: Any
    ) -> None:
        self._use(HFGenerator(model, **generation), max_chars)

    def _use(self, generator: Any, max_chars: int) -> None:
        self.generator = generator
        self.fallback = OfflineExtractor(max_chars)
        self.max_chars = self.fallback.max_chars

    def extract(self, codes: Sequence[str]) -> list[str]:
        codes = [c if isinstance(c, str) else str(c) for c in codes]
        prompts = [self.generator.format(_EXTRACT_TASK, c, "Instruction") for c in codes]
        answers = self.generator.generate(prompts)
        out = []
        for code, answer in zip(codes, answers, strict=True):
            text = clean_text(
                re.sub(r"^\s*instruction\s*:\s*", "", answer, flags=re.I), self.max_chars
            )
            out.append(text or offline_instruction(code, self.max_chars))
        return out


class EndpointExtractor(HFExtractor):
    """M_ext through an OpenAI-compatible endpoint (:mod:`privcode.synth.llm_endpoint`);
    empty answers fall back to offline."""

    name = "endpoint"

    def __init__(self, url: str, *, max_chars: int = MAX_INSTRUCTION_CHARS, **options: Any) -> None:
        from privcode.synth.llm_endpoint import EndpointGenerator

        self._use(EndpointGenerator(url, **options), max_chars)


#: Extractor name -> class; ``make_extractor`` looks names up here (``vllm`` is a Ray Data
#: stage of its own: :mod:`privcode.synth.llm_stages`).
EXTRACTORS: dict[str, type] = {
    "offline": OfflineExtractor,
    "hf": HFExtractor,
    "endpoint": EndpointExtractor,
}


def make_extractor(name: str, **options: Any) -> Extractor:
    """An extractor from the registry, e.g. ``make_extractor("hf", model="/models/qwen")``."""
    return build("extractor", EXTRACTORS, name, options)
