"""Per-language structural tokens and parse checks for ingested code.

The rest of the pipeline needs two things about a record's language without knowing its
grammar: which tokens are *structure* (keywords, operators, punctuation: what the syntax
term of training and the fidelity checks weigh) and whether a piece of code still parses
(after PII scrubbing, canary planting, synthesis). Python uses the interpreter's own
tables and compiler; every other language uses its tree-sitter grammar, loaded from the
installed grammar wheels only (nothing is downloaded). Parsers are cached per thread:
a tree-sitter ``Parser`` must not be shared between threads.
"""

from __future__ import annotations

import ast
import keyword
import threading
import token
import warnings
from collections.abc import Callable
from functools import cache

from tree_sitter import Language, Parser

__all__ = [
    "GRAMMARS",
    "parses",
    "structural_spans_ts",
    "structural_tokens",
    "ts_language",
    "ts_parser",
]


def _js() -> object:
    import tree_sitter_javascript

    return tree_sitter_javascript.language()


def _ts() -> object:
    import tree_sitter_typescript

    return tree_sitter_typescript.language_typescript()


def _tsx() -> object:
    import tree_sitter_typescript

    return tree_sitter_typescript.language_tsx()


def _go() -> object:
    import tree_sitter_go

    return tree_sitter_go.language()


def _java() -> object:
    import tree_sitter_java

    return tree_sitter_java.language()


def _rust() -> object:
    import tree_sitter_rust

    return tree_sitter_rust.language()


def _c() -> object:
    import tree_sitter_c

    return tree_sitter_c.language()


def _cpp() -> object:
    import tree_sitter_cpp

    return tree_sitter_cpp.language()


#: Grammar name -> loader of its tree-sitter language pointer. ``tsx`` is TypeScript with
#: JSX (``.tsx`` files); the language name ``typescript`` covers both grammars.
GRAMMARS: dict[str, Callable[[], object]] = {
    "javascript": _js,
    "typescript": _ts,
    "tsx": _tsx,
    "go": _go,
    "java": _java,
    "rust": _rust,
    "c": _c,
    "cpp": _cpp,
}
_KNOWN = frozenset(GRAMMARS) | {"python"}
_local = threading.local()


def _check(language: str) -> None:
    if language not in _KNOWN:
        raise ValueError(f"unknown language {language!r}: expected one of {sorted(_KNOWN)}")


@cache
def ts_language(grammar: str) -> Language:
    """The tree-sitter ``Language`` of a grammar in :data:`GRAMMARS` (loaded once)."""
    if grammar not in GRAMMARS:
        raise ValueError(f"no tree-sitter grammar {grammar!r}: expected one of {sorted(GRAMMARS)}")
    return Language(GRAMMARS[grammar]())


def ts_parser(grammar: str) -> Parser:
    """This thread's cached ``Parser`` for a grammar in :data:`GRAMMARS`."""
    parsers: dict[str, Parser] | None = getattr(_local, "parsers", None)
    if parsers is None:
        parsers = _local.parsers = {}
    parser = parsers.get(grammar)
    if parser is None:
        parser = parsers[grammar] = Parser(ts_language(grammar))
    return parser


def _grammars(language: str) -> tuple[str, ...]:
    return ("typescript", "tsx") if language == "typescript" else (language,)


@cache
def structural_tokens(language: str) -> frozenset[str]:
    """The keywords, operators and punctuation of ``language``.

    Python: ``keyword.kwlist``, the soft keywords and the exact tokens of the ``token``
    module. Others: every anonymous, visible node kind of the tree-sitter grammar (both
    TypeScript grammars for ``typescript``). Unknown language: ``ValueError``.
    """
    _check(language)
    if language == "python":
        return (
            frozenset(keyword.kwlist)
            | frozenset(keyword.softkwlist)
            | frozenset(token.EXACT_TOKEN_TYPES)
        )
    out: set[str] = set()
    for grammar in _grammars(language):
        lang = ts_language(grammar)
        for i in range(lang.node_kind_count):
            if not lang.node_kind_is_named(i) and lang.node_kind_is_visible(i):
                kind = lang.node_kind_for_id(i)
                if kind and kind.strip():
                    out.add(kind)
    return frozenset(out)


def parses(code: str, language: str) -> bool:
    """Whether ``code`` parses as ``language`` (tree-sitter: no error node in the tree).

    TypeScript passes if either the TypeScript or the TSX grammar accepts it. Unknown
    language: ``ValueError``.
    """
    _check(language)
    if language == "python":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes warn at parse time
                compile(code, "<unit>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return False
        return True
    data = code.encode("utf-8", "replace")
    return any(not ts_parser(g).parse(data).root_node.has_error for g in _grammars(language))


def structural_spans_ts(code: str, language: str) -> list[tuple[int, int]] | None:
    """Character spans ``[start, end)`` of the structural tokens of ``code`` in a tree-sitter
    language: every leaf of an anonymous kind (keywords, operators, punctuation), the
    counterpart of Python's keywords and OP tokens.  None when the code does not parse
    (an error node), as for Python's tokenizer failing."""
    _check(language)
    if language == "python":
        raise ValueError("Python's structural spans come from its tokenizer")
    data = code.encode("utf-8", "surrogatepass")
    tree = ts_parser(_grammars(language)[0]).parse(data)
    if tree.root_node.has_error:
        return None
    # byte offset -> character offset (tree-sitter counts bytes)
    char_at = [0] * (len(data) + 1)
    pos = 0
    for i, ch in enumerate(code):
        n = len(ch.encode("utf-8", "surrogatepass"))
        for k in range(n):
            char_at[pos + k] = i
        pos += n
    char_at[pos] = len(code)
    spans: list[tuple[int, int]] = []
    cursor = tree.walk()
    visited_children = False
    while True:
        node = cursor.node
        if not visited_children:
            if node is not None and node.child_count == 0 and not node.is_named:
                if node.end_byte > node.start_byte:
                    spans.append((char_at[node.start_byte], char_at[node.end_byte]))
            if cursor.goto_first_child():
                continue
        if cursor.goto_next_sibling():
            visited_children = False
            continue
        if not cursor.goto_parent():
            break
        visited_children = True
    spans.sort()
    return spans
